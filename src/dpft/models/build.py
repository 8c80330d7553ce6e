"""The run's model as a plan part (run/plan.py): a causal LM or a sequence classifier, dropout
and the trainable selection applied (placement is perf.py's ``place_model``)."""

from __future__ import annotations

from dpft.models.causal import load_causal_lm
from dpft.models.load import load_classifier, select_trainable, set_dropout
from dpft.models.quant import check_recipe as quant_check, load_quantized_causal_lm, quant_device

__all__ = ["build_model"]


def build_model(recipe, num_labels: int | None, device=None):
    """The run's tokenizer and model, trainable parameters selected (a plan part, run/plan.py).

    ``task.name: seq2seq``: an ``AutoModelForSeq2SeqLM`` (T5, BART). ``num_labels`` None: a
    causal LM (``text``/``instruct`` tasks, ``models/causal.py``); else a
    sequence classifier with that many labels (:func:`load_classifier`). ``model.dropout`` and
    ``trainable`` are applied here; placement on the device is :func:`dpft.placement.device.place_model`'s.
    ``model.quantization`` (QLoRA, ``models/quant.py``): the base is quantized while loading, on
    ``device`` (the run's device; default from ``perf.device``), and checked before loading.

    Returns:
        ``(tokenizer, model)``.

    Raises:
        ModelError: the model cannot be loaded or the trainable selection matches nothing.
    """
    r = recipe
    quant_check(r)  # before loading: bitsandbytes installed, trainable.mode lora, a causal-LM task
    if getattr(r.model, "adapter", None) is not None:
        from dpft.models.adapters import check_recipe

        check_recipe(r.model, r.trainable)  # before loading: only adapters + head train
    if r.task.name == "seq2seq":  # encoder-decoder (T5, BART): models/causal.py
        from dpft.models.causal import load_seq2seq_lm

        tokenizer, model = load_seq2seq_lm(r.model.name, seed=r.seed)
    elif num_labels is None and r.model.quantization is not None:
        tokenizer, model = load_quantized_causal_lm(
            r.model.name, r.model.quantization, seed=r.seed, dtype=r.perf.dtype,
            device=device if device is not None else quant_device(r.perf.device))
    elif num_labels is None:
        tokenizer, model = load_causal_lm(r.model.name, seed=r.seed)
    else:
        tokenizer, model = load_classifier(r.model.name, num_labels, seed=r.seed, pooling=r.model.pooling,
                                           head_dropout=r.model.head_dropout, pair=r.model.pair)
    if r.model.dropout is not None:
        set_dropout(model, r.model.dropout)
    model = select_trainable(model, r.trainable)
    if getattr(r.model, "adapter", None) is not None:
        from dpft.models.adapters import add_adapters

        model = add_adapters(model, r.model.adapter)  # Houlsby adapters, trainable beside the head
    return tokenizer, model
