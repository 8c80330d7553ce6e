"""``make_private``'s clip keywords translated for the one clip builder (step/clip.py
``build_clip_policy``): ``head_body`` with the head given by parameters or names, and ``per_group``
— one share of C per optimizer param group."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

from dpft.grads.base import trainable_parameters
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.step.clip import ClipSettings, build_clip_policy


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


def _groups(params: dict, optimizer: torch.optim.Optimizer) -> tuple[list[int], list[float]]:
    """``per_group``: the group index of each engine parameter (one group per optimizer param group
    that holds one) and each group's fraction f_g (its ``clip_fraction``, or an equal share of what
    the others leave)."""
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
    return [index[where[id(p)]] for p in params.values()], fractions


def _not_called(forward, batch):  # pragma: no cover - the user's loop computes the loss
    raise RuntimeError("make_private drives the book-keeping engine from the user's loop")


def api_clip_and_engine(module, optimizer: torch.optim.Optimizer, clipping: str, max_grad_norm: float,
                        head_fraction: float, head_parameters, norm_mode: str, over_k: Optional[int] = None):
    """``make_private``'s clip policy (its keywords translated for step/clip.py ``build_clip_policy``,
    the one clip builder) and book-keeping engine (the plan's ``parts``).

    Args:
        clipping: one of :data:`CLIPPING_STYLES`; max_grad_norm: C.
        over_k: user level with ``per_example_over_k``: each row clipped to C/k (k rows ≤ C).

    Returns:
        ``(clip, engine)``; the engine's clip is the returned policy.

    Raises:
        ValueError: a head_body split without head or body; a parameter in no param group."""
    params = trainable_parameters(module)  # the engine's parameters, in its order
    clip = build_clip_policy(ClipSettings(clipping, max_grad_norm, head_fraction=head_fraction, over_k=over_k),
                             head_mask=_head_mask(params, head_parameters) if clipping == "head_body" else None,
                             groups=_groups(params, optimizer) if clipping == "per_group" else None)
    return clip, BookKeepingEngine(module, _not_called, clip, norm_mode=norm_mode)
