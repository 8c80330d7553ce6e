"""dpft's mean-pooling classifier and its standard Hugging Face form: ``MeanPoolClassifier``
(what training uses) and ``DpftMeanPoolForSequenceClassification`` (``model_type:
dpft_mean_pool``, defined in ``hf_mean_pool.py``, a file that needs only transformers and is
copied into every saved model folder with ``auto_map``; registered with transformers'
``AutoConfig`` and ``AutoModelForSequenceClassification`` when this module is imported), with
:func:`to_standard` between them. Saving, adapters and loading for inference are models/export.py's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification

from dpft.models.hf_mean_pool import (MODEL_TYPE, PAIR_MODES, DpftMeanPoolConfig,  # noqa: F401 (re-exported)
                                      DpftMeanPoolForSequenceClassification, _config, label_maps, masked_mean,
                                      pair_width, pooled_features)

#: Written beside a LoRA adapter: what dpft needs to rebuild its base (pooling, labels, base).
ADAPTER_META = "dpft_adapter.json"


def register() -> None:
    """Register :class:`DpftMeanPoolConfig` with ``AutoConfig`` and the model with
    ``AutoModelForSequenceClassification`` (idempotent; done on import of this module)."""
    AutoConfig.register(MODEL_TYPE, DpftMeanPoolConfig, exist_ok=True)
    # Not AutoModel: that would hand out logits where a feature extractor expects hidden states.
    AutoModelForSequenceClassification.register(DpftMeanPoolConfig, DpftMeanPoolForSequenceClassification,
                                                exist_ok=True)


register()


# ---------------------------------------------------------------------------------------------
# Conversion of what dpft trains into what the ecosystem loads


class MeanPoolClassifier(nn.Module):
    """Encoder + masked mean pooling + dropout + linear head.

    ``forward(input_ids (B,T), attention_mask (B,T), ...)`` → an output with ``logits`` (B, L).
    The mean runs over positions with ``attention_mask == 1`` only, so padding never enters an
    example's representation (and per-example gradients stay per-example). This is the pooling
    all-MiniLM-L6-v2 was trained with (sentence-transformers); BERT's [CLS] pooler of that
    checkpoint was not trained for it.

    ``pair="siamese"`` (sentence pairs, hf_mean_pool.py :func:`pooled_features`): the two
    sentences of each row are encoded alone and the head, ``Linear(4H, L)``, reads
    ``[u, v, |u − v|, √H · u ⊙ v]``. The encoder then runs on ``2B`` rows, two per example, so it must
    stay frozen (``trainable.mode: head``): a per-example gradient engine would count the two
    sentences as two examples.
    """

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float = 0.1, pair: str = "joint"):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        self.pair = pair
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size * pair_width(pair), num_labels)

    def features(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                 inputs_embeds=None) -> "torch.Tensor":
        """What the head reads: ``(B, H)`` pooled embeddings, ``(B, 4H)`` with ``pair="siamese"``.

        Raises:
            ValueError: ``pair="siamese"`` with a trainable encoder while gradients are on (two
                encoder rows per example: per-example gradients would be per sentence).
        """
        kw = {k: v for k, v in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                                ("position_ids", position_ids), ("inputs_embeds", inputs_embeds)) if v is not None}
        self.check_frozen_encoder()
        return pooled_features(self.encoder, self.pair, input_ids, **kw)

    def check_frozen_encoder(self) -> None:
        """Refuse ``pair="siamese"`` with a trainable encoder while gradients are on (dpft audit's
        ``features_siamese_trainable_encoder`` plants its absence).

        Raises:
            ValueError: naming the fix (``trainable.mode: head`` or ``pair: joint``).
        """
        if self.pair == "siamese" and torch.is_grad_enabled() and \
                any(p.requires_grad for p in self.encoder.parameters()):
            raise ValueError("pair: siamese encodes each row's two sentences as two encoder rows, so only the head "
                             "may train (trainable.mode: head); freeze the encoder or use pair: joint")

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, **_ignored):
        from transformers.modeling_outputs import SequenceClassifierOutput

        pooled = self.features(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        return SequenceClassifierOutput(logits=self.classifier(self.dropout(pooled)))

    def save_pretrained(self, out, labels=None, **kwargs) -> None:
        """A standard Hugging Face folder that ``AutoModelForSequenceClassification`` and
        ``pipeline`` load as this model (``DpftMeanPoolForSequenceClassification``, models/export.py),
        with ``id2label`` from ``labels`` (names, in label order) when given."""
        to_standard(self, labels).save_pretrained(out, **kwargs)


def _is_classifier(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def to_standard(model: nn.Module, labels: Optional[Sequence[str]] = None) -> nn.Module:
    """The model as a standard Hugging Face model: a :class:`MeanPoolClassifier` becomes a
    :class:`DpftMeanPoolForSequenceClassification` with the same weights (a copy); a Hugging
    Face model is returned as is, with ``id2label``/``label2id`` set when ``labels`` is given.

    Raises:
        ValueError: ``labels`` does not match the head's number of outputs.
    """
    if isinstance(model, MeanPoolClassifier):
        k = model.classifier.out_features
        names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(k)]
        if len(names) != k:
            raise ValueError(f"{len(names)} label names for a head of {k} outputs")
        out = DpftMeanPoolForSequenceClassification(_config(model.encoder.config, names, model.dropout.p, model.pair))
        missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"cannot map the mean-pooling classifier: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return out.to(next(model.parameters()).device)
    if labels is not None and hasattr(model, "config") and _is_classifier(model):
        k = getattr(model.config, "num_labels", None)
        if k is not None and k != len(labels):
            raise ValueError(f"{len(labels)} label names for a head of {k} outputs")
        for key, v in label_maps(labels).items():
            setattr(model.config, key, v)
    return model


