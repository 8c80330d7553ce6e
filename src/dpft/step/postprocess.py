"""Post-processing of the privatised gradient: free under DP (no ledger event).

Order in :class:`~dpft.step.pipeline.DPStep`: the noisy sum is divided by the *expected*
logical batch size qN (the realised size is private), then each :data:`Transform` runs in
turn — e.g. RMT singular-value shrinkage (Marchenko–Pastur, ``transforms/rmt/``) or the
unprojection ``P·s̃`` from a DP-SFT subspace (``transforms/subspace.py``).

A transform sees only released quantities: the noisy averaged gradient and the context keys
``noise_std`` (per-entry std of the averaged noise, σC/(qN)), ``step`` and ``q``. It never
sees the clean clipped sum.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from dpft.transforms.rmt import RMTDenoiser, matrix_param_names

#: ``fn(grads, ctx) -> grads`` on the noisy averaged gradient (name → tensor).
Transform = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]


def divide(grads: dict[str, torch.Tensor], denom: float) -> dict[str, torch.Tensor]:
    """``grads / denom`` with denom = qN, the expected batch size (never the realised one)."""
    return {n: g / denom for n, g in grads.items()}


def rmt_transform(model, trainable_names: list[str], cfg) -> Transform:
    """The RMT denoiser as a transform: shrinks each 2-D weight gradient given the per-entry
    noise std σC/(qN) of the averaged gradient (Marchenko–Pastur; post-processing)."""
    den = RMTDenoiser(kappa=cfg.kappa, rank=cfg.rank, min_dim=getattr(cfg, "min_dim", 1))
    names = matrix_param_names(model, trainable_names)

    def apply(grads, ctx):
        return den(grads, ctx["noise_std"], names)

    apply.denoiser = den  # type: ignore[attr-defined]
    return apply
