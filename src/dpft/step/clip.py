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
from dpft.privacy.randomness import Randomness

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


# --------------------------------------------------------------------------- adaptive clipping


def effective_noise_multiplier(sigma: float, count_noise: float) -> float:
    """Gradient noise multiplier σ_Δ when the unclipped count is released beside the gradient.

    Andrew et al. 2021 ("Differentially Private Learning with Adaptive Clipping", Thm. 1):
    releasing the clipped sum with noise σ_Δ·C and the centred count Σ_i (b_i − ½) (L2
    sensitivity ½ under add/remove-one) with noise σ_b is one Gaussian mechanism with
    multiplier σ where σ⁻² = σ_Δ⁻² + (2σ_b)⁻². Hence σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) ≥ σ, and one
    ``GaussianDpEvent(σ)`` per step accounts for both releases. Same formula as Opacus'
    ``AdaClipDPOptimizer.add_noise``.

    Args:
        sigma: the accounted noise multiplier σ ≥ 0 (0 → 0: a non-private σ = 0 run).
        count_noise: σ_b > 0, std of the noise on the count (in counts).

    Raises:
        ValueError: σ ≥ 2σ_b (no σ_Δ exists; the message names the fix).
    """
    if sigma == 0:
        return 0.0
    if not count_noise > 0:
        raise ValueError(f"the count noise σ_b must be > 0, got {count_noise}")
    if sigma >= 2 * count_noise:
        raise ValueError(
            f"adaptive clipping needs σ < 2σ_b (Andrew et al. 2021, Thm. 1); got σ = {sigma:g}, "
            f"σ_b = {count_noise:g}. Raise the count noise σ_b (the recipe's count_noise) above {sigma / 2:g} (or lower σ)")
    return float((sigma ** -2 - (2 * count_noise) ** -2) ** -0.5)


class AdaptiveQuantileClip(FlatClip):
    """Flat clipping whose norm C follows a private quantile estimate (Andrew et al. 2021, Alg. 1).

    Per step: each example of the logical batch contributes the bit b_i = [‖g_i‖ ≤ C]; the
    centred count Σ(b_i − ½) is released with N(0, σ_b²) noise (sensitivity ½), the unclipped
    fraction is estimated with the *expected* batch size qN (the realised size is private):
    b̃ = (Σ(b_i − ½) + z) / (qN) + ½; then C ← clip(C·exp(−η (b̃ − (1 − ρ*))), C_min, C_max).
    C converges to the (1 − ρ*) quantile of the per-example norms, i.e. a fraction ρ* of
    examples is clipped. The privatised clip rate is ρ̃ = 1 − b̃.

    Checked against Opacus' ``AdaClipDPOptimizer`` (opacus/optimizers/adaclipoptimizer.py):
    same σ_Δ formula and geometric update, but Opacus adds its noise to the *uncentred* count
    Σ b_i (sensitivity 1 under add/remove-one, while its σ_Δ formula assumes ½) and divides by
    the realised batch size (data-dependent under Poisson sampling). dpft releases the centred
    sum, as in Andrew et al., and divides by the expected batch size qN.

    Args:
        initial_norm: C₀.
        target_unclipped: 1 − ρ* ∈ (0, 1).
        lr: η > 0, geometric step.
        count_noise: σ_b ≥ 0 (0 only for σ = 0 runs without a guarantee).
        min_norm, max_norm: clamp of C.
        rng: the run's secret randomness (privacy/randomness.py); step t's count noise comes
            from its stream ``count``, t.

    Raises:
        ValueError: bad ranges.
    """

    def __init__(self, initial_norm: float, target_unclipped: float = 0.8, lr: float = 0.2,
                 count_noise: float = 1.0, min_norm: float = 1e-3, max_norm: float = 1e3, rng=None):
        super().__init__(initial_norm)
        if not 0 < target_unclipped < 1:
            raise ValueError(f"target unclipped fraction must be in (0, 1), got {target_unclipped}")
        if not 0 < min_norm <= initial_norm <= max_norm:
            raise ValueError(f"need 0 < C_min ≤ C₀ ≤ C_max, got {min_norm}, {initial_norm}, {max_norm}")
        if lr <= 0 or count_noise < 0:
            raise ValueError("adaptive clipping needs clip_lr > 0 and count_noise ≥ 0")
        self.target_unclipped = float(target_unclipped)
        self.lr = float(lr)
        self.count_noise = float(count_noise)
        self.min_norm, self.max_norm_bound = float(min_norm), float(max_norm)
        if rng is None:
            rng = Randomness()  # secret
        self.rng = rng

    def noisy_unclipped_fraction(self, unclipped: int, batch_size: int, expected_batch: float, step: int) -> float:
        """Release b̃ for this step (the private statistic; a Gaussian release of sensitivity ½).

        Args:
            unclipped: number of examples with ‖g_i‖ ≤ C in the logical batch.
            batch_size: realised logical batch size |B| (enters only inside the private sum).
            expected_batch: qN.
        """
        z = float(self.rng.stream("count", step).normal((), dtype=torch.float64)) * self.count_noise
        centred = unclipped - 0.5 * batch_size
        return (centred + z) / expected_batch + 0.5

    def update(self, unclipped_fraction: float) -> float:
        """Geometric update of C from a (privatised) unclipped fraction; returns the new C."""
        c = self.max_norm * math.exp(-self.lr * (unclipped_fraction - self.target_unclipped))
        self.max_norm = float(min(self.max_norm_bound, max(self.min_norm, c)))
        return self.max_norm

    def state(self) -> dict:
        return {"C": self.max_norm}

    def load_state(self, st: dict) -> None:
        self.max_norm = float(st["C"])


class PaperPercentileClip(FlatClip):
    """REPRODUCTION ONLY — the DP-Adam-AC paper's rule (Yang, Alg. 1 lines 19–22), which leaks.

    C ← clip(P_{100(1−ρ*)}(U), C_min, C_max) where U holds the last H *raw* per-example
    gradient norms (micro-batch size m = 1, the per-example case of the paper's unit norm
    n_i / m_i). The raw norms steer C and the raw clip rate steers γ with no noise, so the
    guarantee of the noisy gradients no longer holds: a run using this is marked
    NOT CERTIFIED. (The paper's micro-batch clipping to C·m with noise σC, whose sensitivity
    is off by m, is not reproduced: dpft always clips per example.)
    """

    def __init__(self, initial_norm: float, target_clip_rate: float = 0.2, history: int = 100,
                 min_norm: float = 1e-3, max_norm: float = 1e3):
        super().__init__(initial_norm)
        self.q = 100.0 * (1.0 - target_clip_rate)
        self.history = int(history)
        self.min_norm, self.max_norm_bound = float(min_norm), float(max_norm)
        self.buffer: list[float] = []

    def update_from_norms(self, norms: torch.Tensor) -> float:
        """Append raw norms to U (keep the last H), set C to their percentile; returns C."""
        self.buffer = (self.buffer + [float(x) for x in norms.flatten()])[-self.history:]
        if self.buffer:
            p = float(torch.quantile(torch.tensor(self.buffer, dtype=torch.float64), self.q / 100.0))
            self.max_norm = float(min(self.max_norm_bound, max(self.min_norm, p)))
        return self.max_norm

    def state(self) -> dict:
        return {"C": self.max_norm, "buffer": list(self.buffer)}

    def load_state(self, st: dict) -> None:
        self.max_norm = float(st["C"])
        self.buffer = list(st.get("buffer", []))
