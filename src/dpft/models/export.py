"""Standard Hugging Face outputs of a run (issue 24 item 1).

A classification run's ``model/`` loads with ``AutoModelForSequenceClassification`` and
``pipeline("text-classification")`` *as trained*, with ``id2label``/``label2id`` from the task:

- ``model.pooling: model`` (the architecture's own head, e.g. BERT's [CLS] → pooler → linear):
  the model already is a standard ``…ForSequenceClassification``; it is saved as is.
- ``model.pooling: mean`` (dpft's :class:`~dpft.models.load.MeanPoolClassifier`, the demo's
  head): no standard class of a BERT-family encoder pools by a masked mean (BERT's head pools
  [CLS] through a tanh layer, which the mean-pooled head never trained), so mapping it onto
  ``BertForSequenceClassification`` would change its outputs. It is saved as
  :class:`DpftMeanPoolForSequenceClassification` (``model_type: dpft_mean_pool``: the encoder's
  own config nested under ``encoder``, weights ``encoder.*`` and ``classifier.*``), which this
  module registers with transformers' ``AutoConfig`` and ``AutoModelForSequenceClassification``
  when it is imported — no ``trust_remote_code``, no
  code in the model folder. ``import dpft.models.export`` before ``from_pretrained`` /
  ``pipeline`` (dpft's own loaders do it). Without dpft, transformers refuses the folder
  ("unrecognized model type dpft_mean_pool") rather than load a different head.

LoRA runs save the adapter in PEFT's format (the trained head with it, as
``modules_to_save``) and, on request (``output.merge_lora``), the merged model as above.
A causal LM is saved as the ``AutoModelForCausalLM`` it is.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

#: ``model_type`` of the mean-pooling classifier in ``config.json``.
MODEL_TYPE = "dpft_mean_pool"
#: Written beside a LoRA adapter: what dpft needs to rebuild its base (pooling, labels, base).
ADAPTER_META = "dpft_adapter.json"


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
        if attention_mask is None:
            pooled = h.mean(dim=1)
        else:
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
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


def to_standard(model: nn.Module, labels: Optional[Sequence[str]] = None) -> nn.Module:
    """The model as a standard Hugging Face model: a :class:`MeanPoolClassifier` becomes a
    :class:`DpftMeanPoolForSequenceClassification` with the same weights (a copy); a Hugging
    Face model is returned as is, with ``id2label``/``label2id`` set when ``labels`` is given.

    Raises:
        ValueError: ``labels`` does not match the head's number of outputs.
    """
    from dpft.models.load import MeanPoolClassifier

    if isinstance(model, MeanPoolClassifier):
        k = model.classifier.out_features
        names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(k)]
        if len(names) != k:
            raise ValueError(f"{len(names)} label names for a head of {k} outputs")
        out = DpftMeanPoolForSequenceClassification(_config(model.encoder.config, names, model.dropout.p))
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


def _is_classifier(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def save_standard(model: nn.Module, tokenizer, out: str | Path, labels: Optional[Sequence[str]] = None,
                  merge_lora: bool = False, base_name: Optional[str] = None) -> dict[str, str]:
    """Write ``model`` (and ``tokenizer``) where the ecosystem loads it; returns what was written,
    ``{"model": folder, "merged": folder?}``.

    - a full (non-LoRA) model → ``out`` (``save_pretrained``, safetensors) via :func:`to_standard`;
    - a PEFT (LoRA) model → its adapter in ``out`` (PEFT format; a mean-pooling head as
      ``modules_to_save``, with :data:`ADAPTER_META`), and with ``merge_lora`` the merged model in
      ``<out>_merged`` (a sibling folder).

    ``base_name``: the pre-trained model the adapter applies to (folder or hub id), recorded in
    ``adapter_config.json``.
    """
    out = Path(out)
    written: dict[str, str] = {"model": str(out)}
    if _is_peft(model):
        _save_adapter(model, out, labels, base_name)
        if merge_lora:
            merged_dir = out.parent / f"{out.name}_merged"
            merged = copy.deepcopy(model).merge_and_unload()
            to_standard(merged, labels).save_pretrained(merged_dir)
            tokenizer.save_pretrained(merged_dir)
            written["merged"] = str(merged_dir)
    else:
        to_standard(model, labels).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return written


def _save_adapter(model, out: Path, labels: Optional[Sequence[str]], base_name: Optional[str]) -> None:
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from dpft.models.load import MeanPoolClassifier

    base = model.get_base_model()
    cfg = copy.deepcopy(model.peft_config[model.active_adapter])
    if base_name:
        cfg.base_model_name_or_path = base_name
    if not isinstance(base, MeanPoolClassifier):
        if labels is not None and _is_classifier(base):
            to_standard(base, labels)  # id2label in the base config (not saved with an adapter; kept in meta)
        old = model.peft_config[model.active_adapter].base_model_name_or_path
        if base_name:
            model.peft_config[model.active_adapter].base_model_name_or_path = base_name
        try:
            model.save_pretrained(out)
        finally:
            model.peft_config[model.active_adapter].base_model_name_or_path = old
        meta = {"pooling": "model", "task": "causal_lm" if not _is_classifier(base) else "classification"}
    else:
        # The mean-pooling head was trained by hand (not a peft modules_to_save): rebuild the
        # adapter on the standard class with the head as modules_to_save, so PEFT saves it.
        plain = copy.deepcopy(model).unload()  # base weights + trained head, no LoRA layers
        std = to_standard(plain, labels)
        cfg.modules_to_save = ["classifier"]
        cfg.task_type = None
        if base_name:
            std.name_or_path = base_name  # peft records the base from the model's name_or_path
        peft_std = get_peft_model(std, cfg)
        peft_std.peft_config[peft_std.active_adapter].base_model_name_or_path = base_name
        state = dict(get_peft_model_state_dict(model))
        state.update({f"base_model.model.classifier.{k}": v for k, v in base.classifier.state_dict().items()})
        res = set_peft_model_state_dict(peft_std, state)
        bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
        if bad:
            raise ValueError(f"LoRA weights did not map onto the standard class: {bad[:4]}")
        peft_std.save_pretrained(out)
        meta = {"pooling": "mean", "task": "classification", "head_dropout": float(base.dropout.p)}
    meta.update({"labels": list(labels) if labels is not None else None, "base_model": base_name})
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=1))


def load_for_inference(path: str | Path, device: str | torch.device = "cpu"):
    """``(tokenizer, model, kind)`` from a folder written by :func:`save_standard` (or an older
    dpft run: a bare encoder + ``dpft_head.safetensors``), in eval mode. ``kind`` is
    ``"classification"`` or ``"causal_lm"``.

    Raises:
        FileNotFoundError: no config.json / adapter_config.json in ``path``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(path)
    if (path / "adapter_config.json").is_file():
        model, kind = _load_adapter(path)
    elif (path / "config.json").is_file():
        cfg = AutoConfig.from_pretrained(path)
        archs = getattr(cfg, "architectures", None) or []
        if any(a.endswith("ForCausalLM") for a in archs):
            model, kind = AutoModelForCausalLM.from_pretrained(path), "causal_lm"
        elif (path / "dpft_head.safetensors").is_file():  # a run saved before issue 24
            from dpft.models.load import load_classifier

            meta = json.loads((path / "dpft_head.json").read_text())
            _, model = load_classifier(str(path), int(meta["num_labels"]), pooling="mean", head_dropout=0.0)
            kind = "classification"
        else:
            model, kind = AutoModelForSequenceClassification.from_pretrained(path), "classification"
    else:
        raise FileNotFoundError(f"{path} holds no config.json or adapter_config.json: not a saved model folder")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok, model.to(device).eval(), kind


def _load_adapter(path: Path):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    meta = json.loads((path / ADAPTER_META).read_text()) if (path / ADAPTER_META).is_file() else {}
    pcfg = PeftConfig.from_pretrained(str(path))
    base_name = pcfg.base_model_name_or_path
    if meta.get("pooling") == "mean":
        base = DpftMeanPoolForSequenceClassification.from_encoder(base_name, meta["labels"],
                                                                  meta.get("head_dropout", 0.0))
        kind = "classification"
    elif meta.get("task") == "causal_lm" or str(pcfg.task_type) == "CAUSAL_LM":
        base, kind = AutoModelForCausalLM.from_pretrained(base_name), "causal_lm"
    else:
        labels = meta.get("labels")
        extra = label_maps(labels) if labels else {}
        base = AutoModelForSequenceClassification.from_pretrained(base_name, **extra)
        kind = "classification"
    return PeftModel.from_pretrained(base, str(path)), kind
