"""Per-example losses (nats), shape ``(B,)``, for the tasks dpft trains."""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from dpft.privacy.label_rr import forward_corrected_loss

#: Keys of a batch that are model inputs (everything else, e.g. ``labels``, is a target).
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_INPUT_KEYS if k in batch}


def classification_loss(forward: Callable[..., object], batch: Mapping[str, torch.Tensor]):
    """Cross-entropy of a sequence-classification head, one value per example.

    ``batch["labels"]``: ``(B,)`` int64 in ``[0, num_labels)``. Returns ``(B,)`` nats.
    """
    out = forward(**model_inputs(batch))
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float(), batch["labels"], reduction="none")


def causal_lm_loss(forward: Callable[..., object], batch: Mapping[str, torch.Tensor]):
    """Next-token cross-entropy summed over each example's predicted tokens, ``(B,)`` nats.

    Positions with ``attention_mask == 0`` (padding) do not count. Summing (not averaging)
    keeps every token of the privacy unit in its one example's gradient.

    With ``batch["labels"]`` of shape ``(B, T)`` (the ``instruct`` task, data/instruct.py) the
    targets are ``labels[:, 1:]`` and positions labelled ``-100`` (prompt, other roles,
    padding) do not count: completion-only loss, per example.
    """
    out = forward(**model_inputs(batch))
    logits = out.logits if hasattr(out, "logits") else out
    shift_logits = logits[:, :-1].float()
    labels = batch.get("labels")
    if labels is not None and labels.dim() == 2:
        targets = labels[:, 1:]
        keep = targets != -100
        if "attention_mask" in batch:
            keep = keep & batch["attention_mask"][:, 1:].bool()
        tok = F.cross_entropy(shift_logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
        return (tok * keep.to(tok.dtype)).sum(dim=1)
    targets = batch["input_ids"][:, 1:]
    tok = F.cross_entropy(shift_logits.transpose(1, 2), targets, reduction="none")
    if "attention_mask" in batch:
        tok = tok * batch["attention_mask"][:, 1:].to(tok.dtype)
    return tok.sum(dim=1)


def seq2seq_lm_loss(forward: Callable[..., object], batch: Mapping[str, torch.Tensor]):
    """Target-token cross-entropy of an encoder-decoder LM (T5, BART), summed over each example's
    target tokens, ``(B,)`` nats (the causal-LM convention: every token of the privacy unit in its
    one example's gradient).

    ``batch``: ``input_ids``/``attention_mask`` ``(B, S)`` (source) and ``labels`` ``(B, T)``
    (target, -100 after its end; data/tokenize.py ``collate_seq2seq``). The decoder input is the
    model's own right shift of ``labels`` (``decoder_start_token_id`` first, -100 → pad), built by
    transformers from ``labels``; the loss transformers then computes (a batch mean) is not used.
    """
    labels = batch["labels"]
    out = forward(**model_inputs(batch), labels=labels)
    logits = out.logits if hasattr(out, "logits") else out
    keep = labels != -100
    tok = F.cross_entropy(logits.float().transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (tok * keep.to(tok.dtype)).sum(dim=1)


def make_corrected_classification_loss(transition: torch.Tensor) -> Callable:
    """A drop-in for :func:`classification_loss` (``loss_fn(forward, batch) → (B,)`` nats) for labels
    released by K-ary randomized response: the forward-corrected loss
    (:func:`dpft.privacy.label_rr.forward_corrected_loss`) with the RR transition matrix ``transition``
    ``(K, K)`` applied to ``batch["labels"]`` ``(B,)`` int64 (the noisy labels)."""
    def corrected_classification_loss(forward: Callable[..., object], batch: Mapping[str, torch.Tensor]):
        out = forward(**model_inputs(batch))
        logits = out.logits if hasattr(out, "logits") else out
        return forward_corrected_loss(logits, batch["labels"], transition)

    return corrected_classification_loss
