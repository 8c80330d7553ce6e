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
  own config nested under ``encoder``, weights ``encoder.*`` and ``classifier.*``). Following the
  Hugging Face convention for custom heads, its modeling code (``hf_mean_pool.py``, torch and
  transformers only) is saved in the folder and ``config.json`` names it in ``auto_map``, so a
  person with only transformers loads it as trained with ``trust_remote_code=True``
  (``AutoModelForSequenceClassification.from_pretrained`` or ``pipeline``; issue 36 item 5).
  With dpft imported the classes are registered locally and no ``trust_remote_code`` is needed.

LoRA runs save the adapter in PEFT's format (the trained head with it, as
``modules_to_save``) and, on request (``output.merge_lora``), the merged model as above.
A causal LM is saved as the ``AutoModelForCausalLM`` it is, an encoder-decoder (seq2seq task) as
the ``AutoModelForSeq2SeqLM`` it is.
"""

from __future__ import annotations

import copy
import sys
import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification

from dpft.models.standard import (ADAPTER_META, MODEL_TYPE, DpftMeanPoolConfig,  # noqa: F401 (re-exported)
                                  DpftMeanPoolForSequenceClassification, MeanPoolClassifier, _is_classifier,
                                  label_maps, register, to_standard)
from dpft.models.adapters import ADAPTER_CONFIG, load_adapters, save_adapters, strip_adapters
from dpft.models.load import load_classifier


def _is_peft(model: nn.Module) -> bool:
    # A PeftModel exists only once peft is imported: a model of a process that never imported it
    # is not one, and importing peft here would import bitsandbytes (and its "Failed to load"
    # warning) on every run (issue 36).
    peft = sys.modules.get("peft")
    pm = getattr(peft, "PeftModel", None) if peft is not None else None
    return pm is not None and isinstance(model, pm)


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
    elif getattr(model, "dpft_adapter", None) is not None:  # bottleneck adapters (models/adapters.py)

        to_standard(strip_adapters(copy.deepcopy(model)), labels).save_pretrained(out)
        save_adapters(model, out)
    else:
        to_standard(model, labels).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return written


def _save_adapter(model, out: Path, labels: Optional[Sequence[str]], base_name: Optional[str]) -> None:
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

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
        meta = {"pooling": "model", "task": "classification" if _is_classifier(base) else
                "seq2seq_lm" if _is_seq2seq(base) else "causal_lm"}
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


def _is_seq2seq(model: nn.Module) -> bool:
    """An encoder-decoder LM (T5, BART ``…ForConditionalGeneration``; the seq2seq task)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)) and \
        type(model).__name__.endswith("ForConditionalGeneration")


def load_for_inference(path: str | Path, device: str | torch.device = "cpu"):
    """``(tokenizer, model, kind)`` from a folder written by :func:`save_standard` (or an older
    dpft run: a bare encoder + ``dpft_head.safetensors``), in eval mode. ``kind`` is
    ``"classification"``, ``"causal_lm"`` or ``"seq2seq_lm"``.

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
        elif getattr(cfg, "is_encoder_decoder", False) and any(a.endswith("ForConditionalGeneration") for a in archs):
            from transformers import AutoModelForSeq2SeqLM

            model, kind = AutoModelForSeq2SeqLM.from_pretrained(path), "seq2seq_lm"
        elif (path / "dpft_head.safetensors").is_file():  # a run saved before issue 24

            meta = json.loads((path / "dpft_head.json").read_text())
            _, model = load_classifier(str(path), int(meta["num_labels"]), pooling="mean", head_dropout=0.0)
            kind = "classification"
        else:
            model, kind = AutoModelForSequenceClassification.from_pretrained(path), "classification"
    else:
        raise FileNotFoundError(f"{path} holds no config.json or adapter_config.json: not a saved model folder")

    if (path / ADAPTER_CONFIG).is_file():  # bottleneck adapters saved beside the base
        model = load_adapters(model, path)
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
    elif meta.get("task") == "seq2seq_lm" or str(pcfg.task_type) in ("SEQ_2_SEQ_LM", "TaskType.SEQ_2_SEQ_LM"):
        from transformers import AutoModelForSeq2SeqLM

        base, kind = AutoModelForSeq2SeqLM.from_pretrained(base_name), "seq2seq_lm"
    elif meta.get("task") == "causal_lm" or str(pcfg.task_type) == "CAUSAL_LM":
        base, kind = AutoModelForCausalLM.from_pretrained(base_name), "causal_lm"
    else:
        labels = meta.get("labels")
        extra = label_maps(labels) if labels else {}
        base = AutoModelForSequenceClassification.from_pretrained(base_name, **extra)
        kind = "classification"
    return PeftModel.from_pretrained(base, str(path)), kind
