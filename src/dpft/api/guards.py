"""Guards and diagnostics of the user's loop: batches that are one row per sampled example
(no packing), optimizer parameters the engine clips, and a warning when every prediction is
one class. Shared by ``make_private`` and ``DPTrainer``."""

from __future__ import annotations

import warnings
from typing import Any

import torch


class PackedBatchError(ValueError):
    """A collated batch does not hold one row per sampled example (packing / padding-free
    collators): several privacy units would be clipped as one."""


class UnclippedParameterError(RuntimeError):
    """An optimizer parameter outside the DP engine holds a gradient: the optimizer would apply
    it without clipping or noise."""


#: Batch keys of padding-free / packed layouts (transformers' ``DataCollatorWithFlattening``,
#: flash-attention varlen): their presence means several rows share one batch row.
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k", "seq_idx")

_PACKING_FIX = ("one sampled row must be one row of the batch (the privacy unit). Use a padding "
                "collator (e.g. transformers.DataCollatorWithPadding / DataCollatorForLanguageModeling) "
                "instead of a packing or padding-free one (DataCollatorWithFlattening, packing=True in "
                "SFT), and pack nothing across examples")


def check_unpacked_batch(batch: Any, rows: int, where: str) -> None:
    """Refuse a collated batch that is not one row per sampled example.

    Checked on the top level of ``batch`` (a tensor, a tuple/list of tensors, or a mapping):
    every tensor with a leading dimension must have ``rows`` rows; no packing key
    (:data:`PACKING_KEYS`); ``position_ids`` (mapping key) must not restart inside a row (over
    the positions whose ``attention_mask`` is 1, when there is one).

    Raises:
        PackedBatchError: with the fix (a padding collator).
    """
    if isinstance(batch, torch.Tensor):
        items = [("batch", batch)]
    elif isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        keys = list(batch.keys())
        found = [k for k in keys if k in PACKING_KEYS]
        if found:
            raise PackedBatchError(f"{where}: the batch holds the packing keys {found}; {_PACKING_FIX}")
        items = [(str(k), batch[k]) for k in keys]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        return
    for name, v in items:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != rows:
            raise PackedBatchError(
                f"{where}: {name} has leading dimension {v.shape[0]} for {rows} sampled rows; {_PACKING_FIX}")
    if isinstance(batch, torch.Tensor) or isinstance(batch, (tuple, list)):
        return
    pos = batch["position_ids"] if "position_ids" in batch.keys() else None
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[1] > 1:
        mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
        pos = pos.detach().cpu()
        keep = (torch.ones_like(pos, dtype=torch.bool) if not isinstance(mask, torch.Tensor)
                or mask.shape != pos.shape else mask.detach().cpu().bool())
        for r in range(pos.shape[0]):
            p = pos[r][keep[r]]
            if p.numel() > 1 and bool((p[1:] <= p[:-1]).any()):
                raise PackedBatchError(
                    f"{where}: position_ids restart inside row {r} (several sequences packed into one "
                    f"row); {_PACKING_FIX}")


def prediction_summary(predictions: Any, labels: Any = None, *, warn: bool = True) -> dict:
    """Accuracy and class spread of classifier predictions, warning when they are all one class.

    A DP run whose noise swamps the signal often ends predicting the majority class for every
    input; its accuracy (the majority share) then looks like learning. Call this on the dev
    predictions of a ``make_private`` model.

    Args:
        predictions: ``(n,)`` class ids, or ``(n, C)`` logits/scores (argmax taken).
        labels: ``(n,)`` true class ids (optional).
        warn: emit a ``UserWarning`` when every prediction is one class (n ≥ 2).

    Returns:
        ``{"n", "top_class", "top_class_share", "single_class"}`` and, with labels,
        ``"accuracy"`` and ``"majority_baseline"`` (share of the most frequent true class).
    """
    pred = torch.as_tensor(predictions)
    if pred.dim() == 2:
        pred = pred.argmax(dim=1)
    pred = pred.reshape(-1).long().cpu()
    n = int(pred.numel())
    out: dict[str, Any] = {"n": n}
    if n == 0:
        return out
    counts = torch.bincount(pred)
    top = int(counts.argmax())
    out.update(top_class=top, top_class_share=float(counts[top]) / n,
               single_class=bool(int((counts > 0).sum()) == 1))
    if labels is not None:
        lab = torch.as_tensor(labels).reshape(-1).long().cpu()
        out["accuracy"] = float((pred == lab).float().mean())
        out["majority_baseline"] = float(torch.bincount(lab).max()) / n
    if warn and out["single_class"] and n >= 2:
        warnings.warn(
            f"every one of the {n} predictions is class {top}: the model has learnt nothing beyond a "
            "constant (its accuracy is that class's share). Under DP this usually means the noise "
            "swamps the signal: use head_body clipping with a larger head learning rate, a larger "
            "expected batch, or more steps (README, \"From Python\")", stacklevel=2)
    return out
