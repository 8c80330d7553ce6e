"""Per-example losses of Hugging Face models for :class:`~dpft.integrations.hf.trainer.DPTrainer`
(causal LM or classification, read from the model class)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from dpft.grads.base import PerExampleLoss

__all__ = ["hf_per_example_loss", "is_causal_lm", "is_seq2seq", "logits_of"]



def is_causal_lm(model: torch.nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([v] if isinstance(v, str) else list(v))
    return type(base).__name__ in names


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, Mapping):
        return out["logits"]
    return out[0]


def is_seq2seq(model: torch.nn.Module) -> bool:
    """An encoder-decoder model (T5, BART, …): its config says ``is_encoder_decoder``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(getattr(base, "config", None), "is_encoder_decoder", False))


def hf_per_example_loss(causal: bool, label_keys: tuple[str, ...] = ("labels",),
                        seq2seq: bool = False) -> PerExampleLoss:
    """The per-example loss ``loss_fn(forward, batch) -> (B,)`` (nats) for a Hugging Face batch.

    The model gets every key of the batch except the label keys. Then:

    * ``causal``: next-token cross-entropy, **summed** over each example's predicted tokens
      (``labels`` shifted by one, ``-100`` ignored; without ``labels``, ``input_ids`` where
      ``attention_mask`` is 1), as dpft's CLI does for causal LMs;
    * integer labels ``(B,)`` with logits ``(B, C)``: cross-entropy (sequence classification);
      labels ``(B, T)`` with logits ``(B, T, C)``: token cross-entropy summed per example,
      ``-100`` ignored (token classification);
    * float labels: squared error (logits ``(B, 1)``, regression) or binary cross-entropy
      summed over labels (multi-label), as ``transformers`` picks them;
    * ``seq2seq`` (encoder-decoder): the target tokens' cross-entropy summed per example, with the
      collator's ``decoder_input_ids`` (``DataCollatorForSeq2Seq(tokenizer, model=model)``).

    Raises (when called): ValueError if a supervised batch holds no labels, or a seq2seq batch no
    ``decoder_input_ids``.
    """
    keys = tuple(dict.fromkeys(("labels", "label", "label_ids", *label_keys)))

    def loss_fn(forward: Callable[..., Any], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in keys}
        labels = next((batch[k] for k in keys if k in batch), None)
        logits = logits_of(forward(**inputs))
        if causal:
            if labels is None:
                labels = batch["input_ids"]
                if "attention_mask" in batch:
                    labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
            shift = logits[:, :-1].float()
            tok = torch.nn.functional.cross_entropy(shift.transpose(1, 2), labels[:, 1:],
                                                    ignore_index=-100, reduction="none")
            return tok.sum(dim=1)
        if labels is None:
            raise ValueError("DPTrainer: the training batch holds no `labels`; have the data collator add them, "
                             "or pass DPTrainer(loss_fn=...) with a per-example loss")
        if seq2seq and "decoder_input_ids" not in batch:
            raise ValueError("DPTrainer: an encoder-decoder batch needs `decoder_input_ids` (the labels shifted right); "
                             "use transformers.DataCollatorForSeq2Seq(tokenizer, model=model) as the data collator")
        logits = logits.float()
        if labels.is_floating_point():
            b = labels.shape[0]
            if logits.shape[-1] == 1:  # regression (num_labels == 1)
                return ((logits.reshape(b, -1) - labels.reshape(b, -1).float()) ** 2).sum(dim=1)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
            return bce.reshape(bce.shape[0], -1).sum(dim=1)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100, reduction="none")
        return ce.reshape(labels.shape[0], -1).sum(dim=1)

    return loss_fn
