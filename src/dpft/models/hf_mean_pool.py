"""dpft's mean-pooling classifier in its standard Hugging Face form, as a file that needs only
``torch`` and ``transformers`` (issue 36 item 5).

A run's ``model/`` folder holds a copy of this file beside ``config.json``, whose ``auto_map``
names its classes (the Hugging Face convention for custom heads), so a person with only
transformers loads the model as trained::

    from transformers import AutoModelForSequenceClassification, pipeline
    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
    clf = pipeline("text-classification", model=folder, trust_remote_code=True)

With dpft imported the same classes are registered locally (``dpft.models.standard.register``),
so ``trust_remote_code`` is not needed there. Do not import dpft here: the copy in a model folder
must load without it.

Model: encoder + masked mean of the last hidden states (over positions with
``attention_mask == 1``) + dropout + linear head; ``input_ids (B, T)`` → ``logits (B, L)``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

#: ``model_type`` of the mean-pooling classifier in ``config.json``.
MODEL_TYPE = "dpft_mean_pool"



def masked_mean(h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, T, H)`` hidden states → ``(B, H)``: the mean over positions with ``attention_mask == 1``
    (all positions without a mask), so padding never enters an example's representation."""
    if attention_mask is None:
        return h.mean(dim=1)
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)

class DpftMeanPoolConfig(PretrainedConfig):
    """Config of :class:`DpftMeanPoolForSequenceClassification`.

    Keys (besides the usual ``id2label`` / ``label2id``): ``encoder`` (dict: the encoder's own
    config, with its ``model_type``), ``head_dropout`` (float, dropout before the linear head).
    No custom ``__init__``: extra keys become attributes in transformers 4 and 5 alike.
    """

    model_type = MODEL_TYPE

    def encoder_config(self) -> PretrainedConfig:
        enc = dict(getattr(self, "encoder", None) or {})
        if "model_type" not in enc:
            raise ValueError(f"{MODEL_TYPE} config has no encoder.model_type; was it written by dpft?")
        return AutoConfig.for_model(enc.pop("model_type"), **enc)


def _encoder_from_config(cfg: PretrainedConfig) -> nn.Module:
    try:  # BERT-likes: no [CLS] pooler (unused by the mean-pooled head, as in training)
        return AutoModel.from_config(cfg, add_pooling_layer=False)
    except TypeError:
        return AutoModel.from_config(cfg)


class DpftMeanPoolForSequenceClassification(PreTrainedModel):
    """Encoder + masked mean of the last hidden states + dropout + linear head.

    The same computation as :class:`dpft.models.load.MeanPoolClassifier` (the module dpft trains):
    ``forward(input_ids (B,T), attention_mask (B,T), ...)`` → ``logits (B, L)``; the mean runs
    over positions with ``attention_mask == 1``. With ``labels (B,)`` the output carries the
    cross-entropy ``loss`` (mean over the batch).
    """

    config_class = DpftMeanPoolConfig
    base_model_prefix = "dpft_mean_pool"  # not "encoder": the encoder is a part, not the base model
    _no_split_modules: list[str] = []

    def __init__(self, config: DpftMeanPoolConfig):
        super().__init__(config)
        enc_cfg = config.encoder_config()
        self.encoder = _encoder_from_config(enc_cfg)
        self.dropout = nn.Dropout(float(getattr(config, "head_dropout", 0.0) or 0.0))
        self.classifier = nn.Linear(enc_cfg.hidden_size, config.num_labels)
        self.post_init()

    def _init_weights(self, module):  # only a fresh head is ever initialised here
        if isinstance(module, nn.Linear) and module is getattr(self, "classifier", None):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.encoder.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.encoder.set_input_embeddings(value)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, return_dict=None, **_ignored):
        kw = {k: v for k, v in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                                ("position_ids", position_ids), ("inputs_embeds", inputs_embeds)) if v is not None}
        h = self.encoder(input_ids=input_ids, **kw).last_hidden_state  # (B, T, H)
        pooled = masked_mean(h, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float(), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    @classmethod
    def from_encoder(cls, name_or_path: str, labels: Sequence[str], head_dropout: float = 0.0,
                     **kwargs) -> "DpftMeanPoolForSequenceClassification":
        """A pre-trained encoder (folder or hub id) with a fresh head for ``labels`` — the base a
        mean-pooling LoRA adapter is applied to."""
        from transformers.utils import logging as hf_logging

        enc_cfg = AutoConfig.from_pretrained(name_or_path)
        model = cls(_config(enc_cfg, labels, head_dropout))
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the unused [CLS] pooler's weights are expected to be skipped
        try:
            try:
                enc = AutoModel.from_pretrained(name_or_path, add_pooling_layer=False, **kwargs)
            except TypeError:
                enc = AutoModel.from_pretrained(name_or_path, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        model.encoder.load_state_dict(enc.state_dict())
        return model


def _config(enc_cfg: PretrainedConfig, labels: Sequence[str], head_dropout: float) -> DpftMeanPoolConfig:
    enc = enc_cfg.to_dict()
    for k in ("id2label", "label2id", "architectures", "_name_or_path", "transformers_version"):
        enc.pop(k, None)
    return DpftMeanPoolConfig(encoder=enc, head_dropout=float(head_dropout), **label_maps(labels),
                              architectures=[DpftMeanPoolForSequenceClassification.__name__])


def label_maps(labels: Sequence[str]) -> dict[str, dict]:
    """``{"id2label": {0: name, …}, "label2id": {name: 0, …}}`` for config.json."""
    names = [str(x) for x in labels]
    return {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}


# save_pretrained copies this file into the model folder and writes ``auto_map`` in config.json
# (transformers' custom_object_save), so that the folder loads without dpft.
DpftMeanPoolConfig.register_for_auto_class()
DpftMeanPoolForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
