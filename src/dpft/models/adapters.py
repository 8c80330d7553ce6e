"""Bottleneck adapters (Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP"),
the Adapter-DP baseline of Yu et al. 2022 ("Differentially Private Fine-tuning of Language
Models"), for BERT-family encoders (BERT, RoBERTa, MiniLM).

In every transformer block two adapters: one on the attention output projection and one on the
FFN output projection, each before the residual connection and LayerNorm (Houlsby Fig. 2)::

    h ← dense(x);  h ← h + up(act(down(h)));  out ← LayerNorm(dropout(h) + residual)

``down``: d → d/r, ``up``: d/r → d (``r`` = ``reduction_factor``), ``up`` initialised to zero so
the adapted model starts as the pre-trained one. The adapters are plain ``nn.Linear`` modules, so
dpft's exact per-example rules (grads/linear.py, book-keeping and reference engines) apply with
no new rule. Only the adapters and the task head train (``trainable.mode: head`` + adapters).

Why not the ``adapters`` library: adapters 1.3.0 (the current release) pins
``transformers ~= 4.57.6``; dpft runs on transformers 5.x, which it would downgrade.

Saving and loading: a run's ``model/`` holds the base model with its trained head (the standard
folder, models/export.py), ``adapters.safetensors`` (the adapter weights, keys as in the adapted
model) and ``dpft_adapters.json`` (the config). :func:`dpft.models.export.load_for_inference`
puts the adapters back; by hand: load the folder as usual, then :func:`load_adapters`. A plain
``pipeline`` on the folder without dpft runs WITHOUT the adapters (a different model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Files of a saved adapted model (beside the standard model folder).
ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "dpft_adapters.json"
_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU}


class AdapterError(ValueError):
    """An adapter configuration that cannot be applied; the message names the fix."""


class BottleneckAdapter(nn.Module):
    """``x + up(act(down(x)))``: ``(…, d)`` → ``(…, d)``; ``down`` d→m, ``up`` m→d (zero-init)."""

    def __init__(self, d: int, m: int, nonlinearity: str = "relu"):
        super().__init__()
        if nonlinearity not in _ACTS:
            raise AdapterError(f"adapter nonlinearity {nonlinearity!r}: use one of {sorted(_ACTS)}")
        self.down = nn.Linear(d, m)
        self.act = _ACTS[nonlinearity]()
        self.up = nn.Linear(m, d)
        nn.init.normal_(self.down.weight, std=1e-2)  # near-identity start (Houlsby Sec. 2.1)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.act(self.down(x)))


def _adapted_forward(self, hidden_states, input_tensor):
    # BertSelfOutput / BertOutput (and RoBERTa's) with the adapter after the projection
    h = self.adapter(self.dense(hidden_states))
    return self.LayerNorm(self.dropout(h) + input_tensor)


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Adapter{cls.__name__}", (cls,), {"forward": _adapted_forward})
    return _CLASSES[cls]


def _blocks(model: nn.Module) -> list[nn.Module]:
    for name, mod in model.named_modules():
        layers = getattr(getattr(mod, "encoder", None), "layer", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(layers[0], "attention"):
            return list(layers)
    raise AdapterError(f"bottleneck adapters support BERT-family encoders (encoder.layer[i].attention.output, "
                       f".output); {type(model).__name__} has none — use trainable.mode: lora instead")


def _sites(block: nn.Module) -> list[nn.Module]:
    sites = [block.attention.output, block.output]
    for s in sites:
        if not all(hasattr(s, a) for a in ("dense", "LayerNorm", "dropout")):
            raise AdapterError(f"{type(s).__name__} is not a BERT-style output (dense, dropout, LayerNorm)")
    return sites


def add_adapters(model: nn.Module, cfg: Any) -> nn.Module:
    """Insert Houlsby adapters in every block of ``model`` (in place; returns it).

    ``cfg``: ``type`` (``houlsby``), ``reduction_factor`` r (bottleneck ``d // r``, at least 1),
    ``nonlinearity``. The new parameters train (``requires_grad``); nothing else is changed, so
    call it after the trainable selection (which leaves the head trainable). The config is kept
    on the model (``model.dpft_adapter``) for saving.

    Raises:
        AdapterError: not a BERT-family encoder, unknown type or nonlinearity, already adapted.
    """
    c = _as_dict(cfg)
    if c["type"] != "houlsby":
        raise AdapterError(f"model.adapter.type {c['type']!r}: only 'houlsby' is built")
    if has_adapters(model):
        raise AdapterError("the model already has adapters")
    blocks = _blocks(model)
    dev = next(model.parameters()).device
    for blk in blocks:
        for site in _sites(blk):
            d = site.dense.out_features
            site.adapter = BottleneckAdapter(d, max(1, d // int(c["reduction_factor"])), c["nonlinearity"]).to(dev)
            site.__class__ = _adapted_class(type(site))
    model.dpft_adapter = c
    return model


def _as_dict(cfg: Any) -> dict:
    d = cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)
    return {"type": d.get("type", "houlsby"), "reduction_factor": int(d.get("reduction_factor", 16)),
            "nonlinearity": d.get("nonlinearity", "relu")}


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, BottleneckAdapter) for m in model.modules())


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights, keyed as in ``model.state_dict()``."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".adapter." in f".{k}"}


def strip_adapters(model: nn.Module) -> nn.Module:
    """Remove the adapters (in place): the base model with its head, as loaded before
    :func:`add_adapters` (used to save the standard folder beside ``adapters.safetensors``)."""
    for blk in _blocks(model):
        for site in (blk.attention.output, blk.output):
            if isinstance(getattr(site, "adapter", None), BottleneckAdapter):
                del site.adapter
                site.__class__ = site.__class__.__mro__[1]
    if hasattr(model, "dpft_adapter"):
        del model.dpft_adapter
    return model


def save_adapters(model: nn.Module, out: str | Path) -> None:
    """Write ``adapters.safetensors`` and ``dpft_adapters.json`` to ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = adapter_state(model)
    # keys relative to the encoder: a MeanPoolClassifier ('encoder.…') and its standard class agree
    save_file({k: v.cpu() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps({**model.dpft_adapter, "keys": len(state)}, indent=1))


def load_adapters(model: nn.Module, path: str | Path) -> nn.Module:
    """Add the adapters saved in ``path`` to ``model`` (the loaded base) and load their weights.

    Raises:
        AdapterError: the saved keys do not match this model's adapters (another base model)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    add_adapters(model, cfg)
    saved = load_file(str(path / ADAPTER_WEIGHTS))
    own = adapter_state(model)
    if set(saved) != set(own):
        # the standard mean-pool class and the training class name the encoder alike
        # ('encoder.'), BERT's own head names it 'bert.': match on the key's tail
        tail = {k.split(".encoder.layer.", 1)[-1]: k for k in own}
        saved = {tail.get(k.split(".encoder.layer.", 1)[-1], k): v for k, v in saved.items()}
    if set(saved) != set(own):
        raise AdapterError(f"saved adapters do not match this model: {sorted(set(saved) ^ set(own))[:4]}")
    model.load_state_dict(saved, strict=False)
    return model


def check_recipe(model_cfg: Any, trainable_cfg: Any) -> None:
    """Refuse a trainable selection other than ``head`` with adapters (only adapters + head train).

    Raises:
        AdapterError: naming the fix."""
    if getattr(model_cfg, "adapter", None) is not None and trainable_cfg.mode != "head":
        raise AdapterError(f"model.adapter trains the adapters and the head only: set trainable.mode: head "
                           f"(got {trainable_cfg.mode!r})")


__all__ = ["BottleneckAdapter", "AdapterError", "add_adapters", "has_adapters", "adapter_state", "strip_adapters",
           "save_adapters", "load_adapters", "check_recipe", "ADAPTER_WEIGHTS", "ADAPTER_CONFIG"]
