"""Clip policies as PyTorch users express them: ``head_body`` with the head named by parameter
names, and ``per_group`` — one share of C per optimizer param group."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional

import torch

from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.groups import PerExampleOverK
from dpft.step.clip import EPS, ClipPolicy, make_clip_policy


class GroupClip(ClipPolicy):
    """Flat clipping per group of parameters: group ``g`` is clipped to ``C·√f_g`` with
    ``Σ_g f_g ≤ 1``, so one example's whole clipped gradient stays within ``C`` (sensitivity
    ``C``, add/remove-one; per-layer clipping of McMahan et al. 2018 with chosen groups).
    ``head_body`` is the two-group case.

    Args:
        max_norm: C.
        group_of: ``(G,)`` group index of each engine parameter (engine order).
        fractions: ``f_g`` per group index, each > 0, summing to ≤ 1.

    Raises:
        ValueError: C not positive, a fraction ≤ 0, or fractions summing above 1.
    """

    def __init__(self, max_norm: float, group_of, fractions):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        fr = [float(f) for f in fractions]
        if any(not f > 0 for f in fr) or sum(fr) > 1 + 1e-9:
            raise ValueError(f"per-group clip fractions must be > 0 and sum to ≤ 1, got {fr}")
        self.max_norm = float(max_norm)
        self.group_of = torch.as_tensor(group_of, dtype=torch.long)
        self.fractions = fr

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        if self.group_of.numel() != sq_norms.shape[1]:
            raise ValueError("GroupClip: one group index per trainable parameter is needed")
        gid = self.group_of.to(sq_norms.device)
        out = torch.ones_like(sq_norms)
        for g, f in enumerate(self.fractions):
            sel = gid == g
            if sel.any():
                norms = sq_norms[:, sel].sum(dim=1).clamp_min(0).sqrt()
                c = (self.max_norm * math.sqrt(f) / (norms + EPS)).clamp(max=1.0)
                out[:, sel] = c[:, None]
        return out


CLIPPING_STYLES = ("flat", "per_layer", "automatic", "head_body", "per_group")


def _head_mask(params: "OrderedDict[str, torch.Tensor] | dict", head_parameters: Any) -> list[bool]:
    """``head_body``: True for the engine parameters of the head (given, or by name)."""
    if head_parameters is None:
        from dpft.models.load import is_head_param

        mask = [is_head_param(n) for n in params]
        how = ("no parameter name has a classifier/score/pooler/lm_head component; pass "
               "head_parameters=model.<head>.parameters()")
    else:
        given = list(head_parameters)
        ids = {id(h) for h in given if isinstance(h, torch.Tensor)}
        strs = {h for h in given if isinstance(h, str)}
        unknown = sorted(strs - set(params))
        if unknown:
            raise ValueError(f"make_private: head_parameters names {unknown[:3]} are not trainable "
                             "parameters of module")
        mask = [n in strs or id(p) in ids for n, p in params.items()]
        how = "head_parameters holds none of the module's trainable parameters"
    if not any(mask):
        raise ValueError(f"make_private: clipping='head_body' needs a head: {how}")
    if all(mask):
        raise ValueError("make_private: clipping='head_body' found only head parameters (no body to "
                         "clip separately); use clipping='flat'")
    return mask


def _group_clip(c: float, params: dict, optimizer: torch.optim.Optimizer) -> GroupClip:
    """``per_group``: one clip group per optimizer param group, C·√f_g each."""
    where = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            where[id(p)] = gi
    missing = [n for n, p in params.items() if id(p) not in where]
    if missing:
        raise ValueError(f"make_private: clipping='per_group' needs every trainable parameter in an "
                         f"optimizer param group; {missing[:3]} are in none")
    given = {gi: g.get("clip_fraction") for gi, g in enumerate(optimizer.param_groups)}
    used = sorted({where[id(p)] for p in params.values()})
    fixed = sum(float(given[g]) for g in used if given[g] is not None)
    free = [g for g in used if given[g] is None]
    if fixed > 1 + 1e-9 or (free and fixed >= 1):
        raise ValueError(f"make_private: the param groups' clip_fraction values sum to {fixed:g}; they "
                         "must sum to ≤ 1 (< 1 when some groups have none)")
    share = (1.0 - fixed) / len(free) if free else 0.0
    index = {g: k for k, g in enumerate(used)}
    fractions = [float(given[g]) if given[g] is not None else share for g in used]
    return GroupClip(c, [index[where[id(p)]] for p in params.values()], fractions)


def _not_called(forward, batch):  # pragma: no cover - the user's loop computes the loss
    raise RuntimeError("make_private drives the book-keeping engine from the user's loop")


def api_clip_and_engine(module, optimizer: torch.optim.Optimizer, clipping: str, max_grad_norm: float,
                        head_fraction: float, head_parameters, norm_mode: str, over_k: Optional[int] = None):
    """``make_private``'s clip policy and book-keeping engine (the plan's ``parts``).

    Args:
        clipping: one of :data:`CLIPPING_STYLES`; max_grad_norm: C.
        over_k: user level with ``per_example_over_k``: each row clipped to C/k (k rows ≤ C).

    Returns:
        ``(clip, engine)``; the engine's clip is the returned policy.

    Raises:
        ValueError: a head_body split without head or body; a parameter in no param group."""
    c_row = max_grad_norm / over_k if over_k else max_grad_norm
    clip = (make_clip_policy(clipping, c_row, head_fraction=head_fraction)
            if clipping != "per_group" else GroupClip(c_row, [0], [1.0]))
    engine = BookKeepingEngine(module, _not_called, clip, norm_mode=norm_mode)
    if clipping == "head_body":
        clip.set_head_mask(_head_mask(engine.params, head_parameters))
    elif clipping == "per_group":
        clip = _group_clip(c_row, engine.params, optimizer)
    if over_k:
        clip = PerExampleOverK(clip, over_k)
    engine.clip = clip
    return clip, engine
