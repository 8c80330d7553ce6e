"""The model split behind frozen features computed once (issue 45 item 1; DESIGN.md "Features
first at small N").

When the trainable scope leaves a *frozen prefix* — the embeddings and the transformer blocks
below the first block that trains (``trainable.mode: head``, ``last_k``, ``units`` above block
i) — the prefix's output for a row never changes during a run. :func:`frozen_prefix` finds it;
:class:`FrozenPrefix` runs it (``prefix(batch) -> cached tensors``) and runs the rest of the
*same* model object on those tensors (:meth:`FrozenPrefix.suffix_forward`), so the per-example
engine, clip, noise and ledger see the same trainable parameters under the same names:

- ``pooled`` (dpft's mean-pooling classifier, nothing in the encoder trains): the cached tensor
  is what the head reads, the pooled sentence embedding ``(N, d)`` (``(N, 4d)`` siamese pair
  features with ``model.pair: siamese``); the suffix is dropout + the linear head.
- ``hidden`` (any other prefix): the cached tensors are the hidden states entering block
  ``start`` ``(T_i, d)`` per row; the suffix runs the model's own forward with the embeddings
  replaced by the cached states and blocks ``< start`` left out (the model builds its attention
  mask itself, as it does without the cache), then pooling and head.

The frozen prefix runs in eval mode (no dropout) in both paths: :meth:`FrozenPrefix.eval_prefix`
is called by the training step whether or not features are cached, so the two are the same
computation (tests/test_feature_cache.py checks the released values agree).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from dpft.models.arch import _block_list
from dpft.models.standard import MeanPoolClassifier

__all__ = ["FrozenPrefix", "frozen_prefix"]


class _Given(nn.Module):
    """Stands in for the embeddings during the suffix's forward: returns the cached states."""

    def __init__(self, states: torch.Tensor):
        super().__init__()
        self.states = states

    def forward(self, *args, **kwargs):  # noqa: D401 - the embeddings' output, given
        return self.states


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _unwrap(model: nn.Module) -> nn.Module:
    """The classifier inside a peft wrapper (names are unchanged: the split patches modules)."""
    inner = model
    while hasattr(inner, "base_model") and inner.base_model is not inner and hasattr(inner, "peft_config"):
        inner = inner.base_model
        if hasattr(inner, "model"):
            inner = inner.model
    return inner


@dataclass
class FrozenPrefix:
    """The frozen prefix of a classifier and how to run either side of the split.

    Attributes:
        model: the whole model (what the engine, evaluation and saving see).
        kind: ``"pooled"`` (cache ``(N, d)`` pooled embeddings) or ``"hidden"`` (cache the
            ``(T_i, d)`` hidden states entering block ``start``).
        start: index of the first block that is not frozen (``L`` when none trains).
        num_blocks: L, the model's number of blocks.
        base: the module that owns ``embeddings`` and the block list (e.g. ``BertModel``).
        blocks_owner, blocks_attr: the module holding the block ``ModuleList`` and its attribute.
    """

    model: nn.Module
    kind: str
    start: int
    num_blocks: int
    base: nn.Module
    blocks_owner: nn.Module
    blocks_attr: str

    # ------------------------------------------------------------------ description
    def describe(self) -> str:
        """``"embeddings + blocks 0–3"`` etc. (for the plan that ``dpft train`` prints)."""
        if self.kind == "pooled":
            if self.pair == "siamese":
                return f"encoder ({self.num_blocks} blocks) + mean pooling of each sentence (siamese pair features)"
            return f"encoder ({self.num_blocks} blocks) + mean pooling"
        if self.start == 0:
            return "the embeddings"
        return f"embeddings + blocks 0–{self.start - 1} of {self.num_blocks}"

    @property
    def pair(self) -> str:
        """How the classifier reads a sentence pair (models/hf_mean_pool.py ``PAIR_MODES``; ``joint``
        for any classifier that is not dpft's mean-pooling one)."""
        return getattr(_unwrap(self.model), "pair", "joint")

    @property
    def width(self) -> int:
        """d, the last dimension of a cached row: the head's input (``pooled``: H, or 4H for siamese
        pair features) or the hidden size (``hidden``)."""
        if self.kind == "pooled":
            return int(_unwrap(self.model).classifier.in_features)
        return int(self.base.config.hidden_size)

    def prefix_modules(self) -> list[nn.Module]:
        """The frozen modules that run before the trainable scope."""
        blocks = getattr(self.blocks_owner, self.blocks_attr)
        if self.kind == "pooled":
            return [self.base]
        return [self.base.embeddings, *list(blocks)[:self.start]]

    def eval_prefix(self) -> None:
        """Put the frozen prefix in eval mode (no dropout): called after ``model.train()`` by
        every training step, with or without cached features."""
        for m in self.prefix_modules():
            m.eval()

    def fingerprint(self) -> str:
        """SHA-256 of the split (kind, start, model class) and the frozen prefix's weights and
        buffers (bytes, names, shapes, dtypes): a changed model never reuses a cache."""
        h = hashlib.sha256()
        head = f"{type(_unwrap(self.model)).__name__}|{self.kind}|{self.start}|{self.num_blocks}|{self.pair}"
        h.update(head.encode())
        for i, m in enumerate(self.prefix_modules()):
            for name, t in sorted(m.state_dict().items()):
                h.update(f"{i}.{name}|{tuple(t.shape)}|{t.dtype}".encode())
                h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ the two sides
    @contextlib.contextmanager
    def _patched(self, blocks_slice: slice, embeddings: Optional[nn.Module]) -> Iterator[None]:
        """Temporarily keep only ``blocks[blocks_slice]`` (and replace the embeddings)."""
        owner, attr = self.blocks_owner, self.blocks_attr
        full = getattr(owner, attr)
        old_emb = self.base.embeddings
        setattr(owner, attr, nn.ModuleList(list(full)[blocks_slice]))
        if embeddings is not None:
            self.base.embeddings = embeddings
        try:
            yield
        finally:
            setattr(owner, attr, full)
            if embeddings is not None:
                self.base.embeddings = old_emb

    @torch.no_grad()
    def prefix(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The frozen part's output for a collated batch (call in eval mode): ``(B, d)``
        pooled embeddings (``pooled``) or ``(B, T, d)`` hidden states entering block ``start``
        (``hidden``; rows padded to the batch's T, padding positions are never read)."""
        kw = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids") if k in batch}
        if self.kind == "pooled":  # the classifier's own pooling (mean, or the siamese pair features)
            return _unwrap(self.model).features(**kw)
        with self._patched(slice(0, self.start), None):
            return self.base(**kw).last_hidden_state

    def suffix_forward(self, features: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                       position_ids: Optional[torch.Tensor] = None) -> Any:
        """The model's output (with ``logits``) from cached features: ``(B, d)`` (``pooled``) or
        ``(B, T, d)`` with ``attention_mask (B, T)`` (``hidden``). Gradients reach the trainable
        parameters of the whole model object (same names as without the cache)."""
        inner = _unwrap(self.model)
        if self.kind == "pooled":
            from transformers.modeling_outputs import SequenceClassifierOutput

            return SequenceClassifierOutput(logits=inner.classifier(inner.dropout(features)))
        kw: dict[str, Any] = {"inputs_embeds": features}
        if attention_mask is not None:
            kw["attention_mask"] = attention_mask
        if position_ids is not None:
            kw["position_ids"] = position_ids
        with self._patched(slice(self.start, None), _Given(features)):
            return self.model(**kw)


def frozen_prefix(model: nn.Module) -> tuple[Optional[FrozenPrefix], str]:
    """The frozen prefix of a sequence classifier, or ``(None, why not)``.

    A prefix exists when the embeddings and blocks ``< start`` hold no trainable parameter and
    ``start ≥ 1`` (or, for dpft's mean-pooling classifier, when nothing in the encoder trains:
    the ``pooled`` split). Every other trainable parameter must lie in blocks ``≥ start`` or
    outside the encoder (the head).
    """
    inner = _unwrap(model)
    try:
        owner_name, blocks = _block_list(inner)
    except Exception:  # noqa: BLE001 - no block list: no prefix to cache
        return None, "no transformer blocks found"
    modules = dict(inner.named_modules())
    base = None
    base_name = ""
    for name, m in inner.named_modules():
        if hasattr(m, "embeddings") and isinstance(getattr(m, "embeddings"), nn.Module) and \
                owner_name.startswith(f"{name}." if name else ""):
            base, base_name = m, name
    if base is None:
        return None, "no embeddings module above the blocks"
    parent_name, _, attr = owner_name.rpartition(".")
    owner = modules[parent_name] if parent_name else inner
    L = len(blocks)
    if _trainable(base.embeddings):
        return None, "the embeddings train"
    start = next((i for i, b in enumerate(blocks) if _trainable(b)), L)
    # Anything else trainable inside the base model (not in a block, not its pooler/head)?
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    for n, p in base.named_parameters():
        if p.requires_grad and id(p) not in block_ids and not n.startswith("pooler."):
            return None, f"parameter {base_name + '.' if base_name else ''}{n} trains outside the blocks"
    if isinstance(inner, MeanPoolClassifier) and start == L and base is inner.encoder:
        return FrozenPrefix(model, "pooled", L, L, base, owner, attr), ""
    if start == 0:
        return None, "block 0 trains: no frozen blocks to compute once"
    return FrozenPrefix(model, "hidden", start, L, base, owner, attr), ""
