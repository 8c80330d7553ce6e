"""A privacy-profile bound for private selection with a random number of trials K.

The search runs K i.i.d. trials of a base mechanism Q (train with DP-SGD, release a noisy score)
and releases the trial of highest score. Koskela, Redberg & Wang (ICML 2024, "Privacy profiles
for private selection") bound such a selection's privacy profile δ(ε) directly from Q's privacy
profile δ_Q(ε), avoiding the RDP → (ε, δ) conversion loss of Papernot & Steinke (2022). The
statement of their theorems could not be read in this build (only the paper's abstract was
available), so the bound below is **derived here** along the same route (probability-generating
function of K + hockey-stick divergence) and proved in full in this docstring; it is not claimed
to be their exact theorem, and it has NOT been checked against their published numbers.

Derivation (add/remove neighbours X, X'; Q = Q(X), Q' = Q(X'); φ(x) = E[x^K]):

1. Order outputs by score, ties broken by an independent uniform U (post-processing; with i.i.d.
   trials, "first best" by trial index has the same output law). With F(y) = Q(Z ≤ z_y) the
   continuous CDF of the order variable, best-of-K has density a(y) = q(y) φ'(F(y))
   (K = 0 releases ⊥ with the same probability under X and X': no contribution for ε ≥ 0).
2. Truncated negative binomial D_{η,γ} (η > −1, 0 < γ < 1; Papernot & Steinke 2022, §3):
   φ'(x) = c (1 − (1−γ)x)^{−(η+1)} with c > 0, and 1 − (1−γ)F = γ + (1−γ)S, S = Q(Z > z).
   For the event {Z > z}, S' ≤ e^{ε₂} S + δ_Q(ε₂) (ε₂ ≥ 0), hence
   φ'(F)/φ'(F') = ((γ + (1−γ)S')/(γ + (1−γ)S))^{η+1} ≤ R^{η+1},
   R = min(1/γ, e^{ε₂} + (1−γ) δ_Q(ε₂)/γ).
   Poisson(μ): φ'(x) = μ e^{μ(x−1)}, φ'(F)/φ'(F') = e^{μ(S'−S)} ≤ e^{μ TV}, TV = δ_Q(0); write
   (η+1) log R := μ δ_Q(0).
3. a − e^ε a' ≤ φ'(F') R^{η+1} (q − e^{ε₁} q') with ε₁ = ε − (η+1) log R, and φ'(F') ≤ φ'(1) = E[K];
   integrating the positive part:

       δ(ε₁ + (η+1) log R) ≤ E[K] · R^{η+1} · δ_Q(ε₁)      for every ε₁, ε₂ ≥ 0.

   Pure ε₀-DP Q (δ_Q = 0): ε = (2+η) ε₀, the limit of Liu & Talwar (2019) and Papernot & Steinke.
   Several configurations drawn independently of the data: Q is their mixture and the hockey-stick
   divergence is jointly convex, so δ_Q is bounded by the pointwise maximum of their profiles.

Numerics (never in our favour): δ_Q(ε) comes from dp-accounting's pessimistic PLD (the maximum of
the add and remove directions), evaluated on a grid of ε with step ``STEP`` (or ε_max/20,000 when
wider); ε₁ is the first grid point whose δ_Q is ≤ the δ asked of Q (ε rounded up to the grid),
ε₂ ranges over a subgrid (any
ε₂ gives a valid bound, so a minimum over a subset is still one), and R and the final ε are
inflated by 1e-12 relative against floating-point rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

__all__ = ["STEP", "ProfileGrid", "profile_grid", "log_ratio", "profile_epsilon", "profile_delta",
           "THEOREM"]

#: ε-grid step of Q's privacy profile; ε₁ is rounded up to it.
STEP = 1e-3
#: How the bound is named in reports.
THEOREM = ("privacy-profile bound δ(ε₁ + (η+1)log R) ≤ E[K]·R^{η+1}·δ_Q(ε₁) (derived in "
           "accounting/selection_profile.py along Koskela, Redberg & Wang 2024; δ_Q from dp-accounting's PLD)")
_INFLATE = 1.0 + 1e-12


@dataclass(frozen=True)
class ProfileGrid:
    """Q's privacy profile on a grid: ``delta[i]`` ≥ δ_Q(``eps[i]``) (pessimistic), eps[0] = 0."""

    eps: np.ndarray
    delta: np.ndarray
    _run_min: Optional[np.ndarray] = field(default=None, repr=False, compare=False)

    def epsilon_for_delta(self, target: float) -> float:
        """The smallest grid ε whose δ_Q is ≤ ``target`` (inf if none on the grid)."""
        # first index of the running minimum ≤ target = first index with δ ≤ target (no monotonicity assumed)
        run_min = np.minimum.accumulate(self.delta) if self._run_min is None else self._run_min
        object.__setattr__(self, "_run_min", run_min)
        i = int(np.searchsorted(-run_min, -target, side="left"))
        return float(self.eps[i]) if i < len(self.eps) else math.inf

    def delta_at_or_below(self, eps: float) -> float:
        """δ_Q at the largest grid ε ≤ ``eps`` (δ_Q is non-increasing: an upper bound on δ_Q(eps))."""
        if eps < 0:
            return 1.0
        i = int(np.searchsorted(self.eps, eps, side="right")) - 1  # beyond the grid: δ_Q(eps) ≤ δ at its end
        return float(self.delta[i])


def profile_grid(plds: Sequence, eps_max: float, step: float = STEP, max_points: int = 20_000) -> ProfileGrid:
    """Pointwise maximum over ``plds`` (dp-accounting PrivacyLossDistribution objects, pessimistic)
    of δ(ε) on the grid 0, step, …, ≥ eps_max (the step widened to eps_max/max_points if needed)."""
    if not plds:
        raise ValueError("profile_grid needs at least one PLD")
    step = max(step, eps_max / max_points)
    grid = np.arange(0.0, max(eps_max, step) + step, step)
    delta = np.max(np.stack([np.asarray(p.get_delta_for_epsilon(grid), dtype=float) for p in plds]), axis=0)
    return ProfileGrid(grid, np.minimum(1.0, delta))


def log_ratio(dist, eps2: float, delta2: float) -> float:
    """(η+1) log R of step 2 (module docstring) for the law ``dist`` (a KDistribution) at the
    inner level (ε₂, δ_Q(ε₂)); Poisson uses ε₂ = 0 only (``delta2`` = TV = δ_Q(0))."""
    if dist.kind == "poisson":
        return dist.mu * delta2 * _INFLATE
    g = dist.gamma
    r = min(1.0 / g, math.exp(eps2) + (1.0 - g) * delta2 / g) * _INFLATE
    return (dist.eta + 1.0) * math.log(r)


def _inner_levels(dist, grid: ProfileGrid, n: int = 300) -> list[int]:
    """Indices of the ε₂ tried: every other grid point up to ε = 1.5, then ``n`` geometric ones."""
    if dist.kind == "poisson":
        return [0]
    step = float(grid.eps[1] - grid.eps[0])
    top = float(grid.eps[-1])
    fine = np.arange(0, int(min(top, 1.5) / step) + 1, 2)
    coarse = np.rint(np.geomspace(1.5, max(top, 1.5), n) / step).astype(int)
    idx = np.unique(np.concatenate([fine, coarse]))
    return [int(i) for i in idx if i < len(grid.eps)]


def profile_epsilon(dist, grid: ProfileGrid, delta: float) -> tuple[float, dict]:
    """ε at ``delta`` of the selection by the bound (module docstring), and the (ε₁, ε₂) attaining it.

    Returns (inf, {}) when no grid point meets the δ asked of Q (raise the grid's ε_max)."""
    if not 0 < delta < 1:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    mean = dist.mean()
    best, arg = math.inf, {}
    for i in _inner_levels(dist, grid):
        lr = log_ratio(dist, float(grid.eps[i]), float(grid.delta[i]))
        eps1 = grid.epsilon_for_delta(delta / (mean * math.exp(lr) * _INFLATE))
        eps = (eps1 + lr) * _INFLATE
        if eps < best:
            best, arg = eps, {"eps1": eps1, "eps2": float(grid.eps[i]), "log_ratio": lr}
    return best, arg


def profile_delta(dist, grid: ProfileGrid, epsilon: float) -> float:
    """δ at ``epsilon`` of the selection by the bound: min over ε₂ of E[K] R^{η+1} δ_Q(ε − (η+1)log R),
    δ_Q read at the grid point at or below (an upper bound); 1 where ε₁ < 0."""
    mean = dist.mean()
    out = 1.0
    for i in _inner_levels(dist, grid):
        lr = log_ratio(dist, float(grid.eps[i]), float(grid.delta[i]))
        out = min(out, mean * math.exp(lr) * grid.delta_at_or_below(epsilon - lr) * _INFLATE)
    return out
