"""Clip policies: turn per-example (per-group) gradient norms into clip factors.

A policy sees only norms, never gradients, so it is orthogonal to how the per-example engine
computes them (torch.func reference, book-keeping hooks, subspace coordinates); the engines apply
the factors. The step's clip stage (step/clip.py) re-exports these and adds the policies that
release a statistic (adaptive clipping).

Every policy guarantees that the clipped contribution of one example, ``c_i * g_i`` taken over
all groups together, has L2 norm at most ``C`` (the sensitivity of the clipped sum under
add/remove-one neighbouring datasets is therefore ``C``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

__all__ = ["EPS", "NonFiniteGradientError", "check_finite_norms", "ClipPolicy", "FlatClip", "PerLayerClip",
           "AutoClip", "HeadBodyClip", "NoClip", "make_clip_policy"]

#: Added to norms before dividing, as in Opacus, so a zero gradient gives a finite factor.
EPS = 1e-6


class NonFiniteGradientError(FloatingPointError):
    """A per-example gradient norm is inf or NaN: clipping cannot bound its contribution."""


def check_finite_norms(sq_norms: torch.Tensor) -> None:
    """Raise :class:`NonFiniteGradientError` if any per-example squared norm ``(B, G)`` is not finite.

    A non-finite norm would give a clip factor of 0 (or NaN) and a NaN model; refusing it keeps
    the last checkpoint valid."""
    if not bool(torch.isfinite(sq_norms).all()):
        bad = (~torch.isfinite(sq_norms)).any(dim=1).nonzero().flatten().tolist()
        raise NonFiniteGradientError(
            f"non-finite per-example gradient norm for {len(bad)} example(s) of the micro-batch "
            f"(positions {bad[:5]}); lower optimizer.lr, use a smaller model.max_length or check the data "
            "for extreme inputs. Nothing was released for this step")


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


class HeadBodyClip(ClipPolicy):
    """Two-group flat clipping: the task head to ``C·√f`` and the rest of the trainable
    parameters to ``C·√(1−f)`` (``f = head_fraction``), so the whole example stays within ``C``
    (``C²f + C²(1−f) = C²``; sensitivity ``C``, add/remove-one).

    Why: with one flat clip, an example's norm is dominated by the millions of body
    coordinates, so the freshly initialised head keeps a tiny share of ``C`` while it receives
    the same noise σC per coordinate as everything else, and under DP-Adam it random-walks.
    Giving the head its own budget is per-layer clipping (McMahan et al. 2018) with two groups.

    ``set_head_mask(mask)`` must be called with a ``(G,)`` bool tensor (True = head group, in
    engine parameter order) before ``scales``; the trainer does it.

    Raises:
        ValueError: C not positive, f not in (0, 1), or ``scales`` before ``set_head_mask``.
    """

    def __init__(self, max_norm: float, head_fraction: float = 0.5):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        if not 0 < head_fraction < 1:
            raise ValueError(f"clipping.head_fraction must be in (0, 1), got {head_fraction}")
        self.max_norm = float(max_norm)
        self.head_fraction = float(head_fraction)
        self.head_mask: torch.Tensor | None = None

    def set_head_mask(self, mask) -> None:
        self.head_mask = torch.as_tensor(mask, dtype=torch.bool)

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        if self.head_mask is None or self.head_mask.numel() != sq_norms.shape[1]:
            raise ValueError("HeadBodyClip needs set_head_mask() with one flag per trainable parameter group")
        mask = self.head_mask.to(sq_norms.device)
        out = torch.empty_like(sq_norms)
        for sel, budget in ((mask, self.head_fraction), (~mask, 1.0 - self.head_fraction)):
            if sel.any():
                norms = sq_norms[:, sel].sum(dim=1).clamp_min(0).sqrt()
                c = (self.max_norm * math.sqrt(budget) / (norms + EPS)).clamp(max=1.0)
                out[:, sel] = c[:, None]
        return out


class NoClip(ClipPolicy):
    """No clipping (non-private reference runs only): factors are 1, sensitivity unbounded."""

    max_norm = math.inf

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(sq_norms)


def make_clip_policy(style: str, max_norm: float, gamma: float = 0.01, head_fraction: float = 0.5) -> ClipPolicy:
    """Build a policy by name: ``flat`` | ``per_layer`` | ``automatic`` | ``head_body``.

    Raises:
        ValueError: unknown style (the message lists the known ones).
    """
    if style == "flat":
        return FlatClip(max_norm)
    if style == "per_layer":
        return PerLayerClip(max_norm)
    if style in ("automatic", "auto", "auto_s"):
        return AutoClip(max_norm, gamma)
    if style == "head_body":
        return HeadBodyClip(max_norm, head_fraction)
    raise ValueError(f"unknown clipping style {style!r}; use one of: flat, per_layer, automatic, head_body")
