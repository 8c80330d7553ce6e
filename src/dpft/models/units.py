"""Named parameter *units* of a model: the layers DP-SelFT scores and selects (Sha et al.,
Section 4.3 Eq. 14–16; Appendix B "each layer independently").

Granularities:
- ``block`` (default): ``embeddings``, ``block.0`` … ``block.{L-1}`` (the transformer blocks,
  found as the longest ModuleList named layer/layers/h/blocks), and ``head`` (classifier,
  pooler, score, lm_head, plus any parameter outside embeddings and blocks, e.g. GPT-2's
  final ``ln_f``);
- ``linear``: every ``nn.Linear`` (or GPT-2 ``Conv1D``) inside the blocks as its own unit (named by module path,
  e.g. ``bert.encoder.layer.0.attention.self.query``), plus ``embeddings`` and ``head``.

:func:`resolve_units` also accepts any module path (``bert.encoder.layer.3.attention``): the
unit is then every parameter under it — the attention-only heuristic baseline uses this.
"""

from __future__ import annotations

import re
from typing import Iterable

from torch import nn

from dpft.models.arch import HEAD_PATTERNS, ModelError, _block_list

_EMBED = re.compile(r"(^|\.)(embeddings|embed_tokens|wte|wpe|embed_positions)(\.|$)")


def _is_linear(mod: nn.Module) -> bool:
    """nn.Linear or GPT-2's Conv1D (a transposed Linear)."""
    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def _is_head(name: str) -> bool:
    return any(h in name.split(".") for h in HEAD_PATTERNS)


def unit_map(model: nn.Module, granularity: str = "block") -> dict[str, list[str]]:
    """Ordered ``{unit name: [parameter names]}``; every parameter in at most one unit
    (``block``: exactly one). Tied parameters appear once (``named_parameters``).

    Raises:
        ModelError: unknown granularity or no transformer blocks found.
    """
    if granularity not in ("block", "linear"):
        raise ModelError(f"unit granularity must be 'block' or 'linear', got {granularity!r}")
    prefix, blocks = _block_list(model)
    names = [n for n, _ in model.named_parameters()]
    units: dict[str, list[str]] = {"embeddings": []}
    block_of = {}
    for i in range(len(blocks)):
        units[f"block.{i}"] = []
    if granularity == "linear":
        units = {"embeddings": []}
        for mname, mod in model.named_modules():
            if _is_linear(mod) and mname.startswith(prefix + ".") and not _is_head(mname):
                units[mname] = [f"{mname}.{p}" for p, _ in mod.named_parameters(recurse=False)]
                for p in units[mname]:
                    block_of[p] = mname
    units["head"] = []
    for n in names:
        if n in block_of:
            continue
        m = re.match(re.escape(prefix) + r"\.(\d+)\.", n)
        if m:
            if granularity == "block":
                units[f"block.{m.group(1)}"].append(n)
            # linear granularity: non-Linear block parameters (LayerNorms) belong to no unit
        elif _EMBED.search(n) and not _is_head(n):
            units["embeddings"].append(n)
        else:
            units["head"].append(n)
    return {k: v for k, v in units.items() if v}


def resolve_units(model: nn.Module, units: Iterable[str], with_head: bool = False) -> list[str]:
    """Parameter names of the named units (either granularity, or module paths), in model order.

    Raises:
        ModelError: a name that is no unit and no module of the model (lists the valid names).
    """
    maps = {**unit_map(model, "linear"), **unit_map(model, "block")}
    modules = dict(model.named_modules())
    all_names = [n for n, _ in model.named_parameters()]
    chosen: set[str] = set()
    for u in units:
        if u in maps:
            chosen.update(maps[u])
        elif u in modules and u:
            got = [n for n in all_names if n.startswith(u + ".")]
            if not got:
                raise ModelError(f"unit {u!r} has no parameters")
            chosen.update(got)
        else:
            raise ModelError(f"unknown unit {u!r}; block units are {list(unit_map(model, 'block'))}, "
                             "or give a module path (e.g. one of the Linear layers)")
    if with_head:
        chosen.update(maps.get("head", []))
    return [n for n in all_names if n in chosen]


def attention_units(model: nn.Module) -> list[str]:
    """The heuristic baseline (Appendix B, "updates only attention layers"): every block's
    attention module (``attention``, ``attn`` or ``self_attn``) as a module-path unit.

    Raises:
        ModelError: no attention modules found.
    """
    prefix, blocks = _block_list(model)
    out = []
    for i, blk in enumerate(blocks):
        for name in ("attention", "attn", "self_attn"):
            if hasattr(blk, name):
                out.append(f"{prefix}.{i}.{name}")
                break
    if not out:
        raise ModelError("no attention modules (attention/attn/self_attn) found in the blocks")
    return out


def lora_targets_in_units(model: nn.Module, param_names: Iterable[str], leaf_names: Iterable[str]) -> list[str]:
    """Full module paths of the Linear layers whose leaf name is in ``leaf_names`` and whose
    weight is among ``param_names`` (LoRA restricted to selected units: DP-SelFT+LoRA)."""
    pn, leaves = set(param_names), set(leaf_names)
    return [m for m, mod in model.named_modules()
            if _is_linear(mod) and m.split(".")[-1] in leaves and f"{m}.weight" in pn]
