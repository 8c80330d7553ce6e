"""Default LoRA target modules that follow the architecture (issue 44 item 8).

``trainable.lora.target_modules`` left unset (``None``) means: the targets PEFT itself uses for the
model's ``config.model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``:
``query, value`` for BERT, ``q_proj, v_proj`` for Llama, ``c_attn`` for GPT-2, ``q, v`` for T5 …),
and for a type PEFT does not list, the query and value projections of the model's attention blocks
found by name (:data:`_PAIRS`, then a fused projection of :data:`_FUSED`). Before this, the default
was BERT's ``query, value`` on every architecture, so ``--trainable lora`` on a Llama model failed.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from dpft.models.arch import ModelError

__all__ = ["default_lora_targets", "resolve_lora_targets"]

#: (query, value) projection names by family, tried in order when PEFT has no entry for the model type.
_PAIRS = (("q_proj", "v_proj"), ("query", "value"), ("q_lin", "v_lin"), ("q", "v"), ("wq", "wv"))
#: a fused query-key-value projection (one Linear), when no pair is found.
_FUSED = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "in_proj")


def _model_type(model: nn.Module) -> Optional[str]:
    for m in (model, getattr(model, "encoder", None), getattr(model, "base_model", None)):
        cfg = getattr(m, "config", None)
        mt = getattr(cfg, "model_type", None)
        if isinstance(mt, str) and mt:
            return mt
    return None


def _linear_leaves(model: nn.Module) -> set[str]:
    # transformers' Conv1D (GPT-2's c_attn) is a Linear with its weight transposed; PEFT adapts it too
    return {n.split(".")[-1] for n, m in model.named_modules()
            if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")}


def default_lora_targets(model: nn.Module) -> list[str]:
    """LoRA target module names (leaf names) for ``model``: PEFT's per-model-type mapping when it
    lists the model's ``config.model_type`` and those names are Linear layers of the model; else
    the attention's query and value projections found by name; else a fused qkv projection.

    Raises:
        ModelError: none found (the message lists the model's Linear layer names and the setting)."""
    leaves = _linear_leaves(model)
    mt = _model_type(model)
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_map
    except ImportError:  # pragma: no cover - peft is a dependency of LoRA runs
        peft_map = {}
    mapped = list(peft_map.get(mt, []) or []) if mt else []
    if mapped and all(t in leaves for t in mapped):
        return mapped
    for pair in _PAIRS:
        if all(t in leaves for t in pair):
            return list(pair)
    for fused in _FUSED:
        if fused in leaves:
            return [fused]
    raise ModelError(f"no default LoRA target modules for this model (model type {mt!r}: not in PEFT's mapping and "
                     f"no query/value projection found); set trainable.lora.target_modules to some of its Linear "
                     f"layers: {sorted(leaves)}")


def resolve_lora_targets(model: nn.Module, targets: Optional[list[str]]) -> list[str]:
    """``targets`` when the recipe sets them, else :func:`default_lora_targets`."""
    return list(targets) if targets else default_lora_targets(model)
