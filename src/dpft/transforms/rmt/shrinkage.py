"""RMT formulas: the averaged gradient's per-entry noise std, the Marchenko–Pastur bulk edge and
the Frobenius-optimal singular-value shrinker (Gavish & Donoho 2017, Eq. (7)); the default κ.

The estimator these formulas make is described in :mod:`dpft.transforms.rmt`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Default threshold multiplier κ (denoise a layer only if ``y_1 > κ (1 + √β)``). The paper
#: tunes κ > 1 on SST-2/RoBERTa-base and keeps it fixed across tasks; its numeric value is
#: not legible in the text we have. 1.05 comes from our sweep on real MiniLM/SST-2 gradients
#: at ε = 3 (benchmarks/rmt_kappa_sweep.py → benchmarks/results/rmt_kappa_sweep.md): κ ≥ 1.1
#: almost never fires there (gain ≤ +0.0006 in cosine), κ ∈ {1.0, 1.02, 1.05} give the largest
#: gains (+0.007…+0.010, within one standard deviation of each other); 1.05 is the largest of
#: those, keeping a margin above the edge against finite-size (Tracy–Widom) fluctuations of
#: pure noise, whose top singular value overshoots 1 + √β by ~1 % at n = 384.
DEFAULT_KAPPA = 1.05


# --------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------


def averaged_noise_std(
    noise_multiplier: float, sensitivity: float, sample_rate: float, dataset_size: int
) -> float:
    """Per-entry std ``s = σ Δ / (q N)`` of the noise in the averaged privatised gradient.

    Args:
        noise_multiplier: ``σ`` (dimensionless).
        sensitivity: ``Δ``, L2 sensitivity of the clipped sum: ``C`` under add/remove-one
            neighbouring datasets, ``2C`` under replace-one (per-example L2 norm units).
        sample_rate: Poisson sampling rate ``q`` in (0, 1].
        dataset_size: ``N``; ``q N`` is the expected batch size the noisy sum is divided by.

    Returns:
        ``s`` in gradient units (same units as the averaged gradient's entries).

    Raises:
        ValueError: on a negative/non-finite σ or Δ, or ``q N <= 0``.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not (math.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity}")
    if not (0 < sample_rate <= 1):
        raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate}")
    if dataset_size <= 0:
        raise ValueError(f"dataset size N must be > 0, got {dataset_size}")
    return float(noise_multiplier) * float(sensitivity) / (float(sample_rate) * dataset_size)


def bulk_edge(beta: float) -> float:
    """Upper edge ``1 + √β`` of the Marchenko–Pastur singular-value bulk of an ``m × n``
    (``β = m/n <= 1``) matrix with i.i.d. ``N(0, 1/n)`` entries (dimensionless)."""
    if not (0 < beta <= 1):
        raise ValueError(f"aspect ratio beta = m/n must be in (0, 1], got {beta}")
    return 1.0 + math.sqrt(beta)


def optimal_shrinkage(y: Tensor, beta: float) -> Tensor:
    """Frobenius-optimal singular-value shrinker with known noise level.

    ``η(y) = √((y² - β - 1)² - 4β) / y`` for ``y > 1 + √β`` and 0 otherwise (Gavish & Donoho
    2017, Eq. (7); equals ``x(y) c(y) c̃(y)`` of Shabalin & Nobel 2013 / the paper's Eq. (8)).

    Args:
        y: singular values of the *normalised* matrix ``Y = G̃ / (s √n)``, any shape.
        beta: aspect ratio ``m / n`` in (0, 1].

    Returns:
        ``η(y)``, same shape and dtype as ``y``, in the normalised units.
    """
    edge = bulk_edge(beta)
    above = y > edge
    y_safe = torch.where(above, y, torch.full_like(y, 2.0 * edge))
    disc = ((y_safe * y_safe - beta - 1.0) ** 2 - 4.0 * beta).clamp_min(0.0)
    return torch.where(above, disc.sqrt() / y_safe, torch.zeros_like(y))
