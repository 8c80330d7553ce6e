"""Clip policies: turn per-example (per-group) gradient norms into clip factors.

A policy sees only norms, never gradients, so it is orthogonal to how the per-example engine
computes them (torch.func reference, book-keeping hooks, subspace coordinates).

Every policy guarantees that the clipped contribution of one example, ``c_i * g_i`` taken over
all groups together, has L2 norm at most ``C`` (the sensitivity of the clipped sum under
add/remove-one neighbouring datasets is therefore ``C``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

#: Added to norms before dividing, as in Opacus, so a zero gradient gives a finite factor.
EPS = 1e-6


class ClipPolicy(ABC):
    """Maps per-example squared group norms ``(B, G)`` to clip factors ``(B, G)``.

    ``G`` is the number of clipping groups (trainable parameters in engine order). The factors
    multiply each group's per-example gradient before summing over the batch.
    """

    #: L2 sensitivity of one example's clipped contribution (add/remove relation).
    max_norm: float

    @abstractmethod
    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        """Return clip factors, shape ``(B, G)``, dtype of ``sq_norms``."""

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum to adding or removing one example."""
        return float(self.max_norm)


class FlatClip(ClipPolicy):
    """Flat clipping (Abadi et al. 2016): ``c_i = min(1, C / (||g_i|| + 1e-6))`` for all groups."""

    def __init__(self, max_norm: float):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        self.max_norm = float(max_norm)

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        norms = sq_norms.sum(dim=1).clamp_min(0).sqrt()
        c = (self.max_norm / (norms + EPS)).clamp(max=1.0)
        return c[:, None].expand_as(sq_norms).contiguous()


class PerLayerClip(ClipPolicy):
    """Per-layer clipping: group ``g`` is clipped to ``C_g = C / sqrt(G)`` so that the whole
    example stays within ``C`` (``sum_g C_g^2 = C^2``)."""

    def __init__(self, max_norm: float):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        self.max_norm = float(max_norm)

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        g = sq_norms.shape[1]
        per_group = self.max_norm / math.sqrt(max(g, 1))
        return (per_group / (sq_norms.clamp_min(0).sqrt() + EPS)).clamp(max=1.0)


class AutoClip(ClipPolicy):
    """Automatic clipping AUTO-S (Bu et al. 2022, "Automatic clipping", Eq. 4 with stability
    constant gamma): ``c_i = C / (||g_i|| + gamma)``. Every example is normalised, so the
    contribution norm is ``C ||g_i|| / (||g_i|| + gamma) < C``."""

    def __init__(self, max_norm: float, gamma: float = 0.01):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        if not gamma > 0:
            raise ValueError(f"AUTO-S stability constant gamma must be > 0, got {gamma}")
        self.max_norm = float(max_norm)
        self.gamma = float(gamma)

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        norms = sq_norms.sum(dim=1).clamp_min(0).sqrt()
        c = self.max_norm / (norms + self.gamma)
        return c[:, None].expand_as(sq_norms).contiguous()


class NoClip(ClipPolicy):
    """No clipping (non-private reference runs only): factors are 1, sensitivity unbounded."""

    max_norm = math.inf

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(sq_norms)


def make_clip_policy(style: str, max_norm: float, gamma: float = 0.01) -> ClipPolicy:
    """Build a policy by name: ``flat`` | ``per_layer`` | ``automatic``.

    Raises:
        ValueError: unknown style (the message lists the known ones).
    """
    if style == "flat":
        return FlatClip(max_norm)
    if style == "per_layer":
        return PerLayerClip(max_norm)
    if style in ("automatic", "auto", "auto_s"):
        return AutoClip(max_norm, gamma)
    raise ValueError(f"unknown clipping style {style!r}; use one of: flat, per_layer, automatic")
