"""The step's clip stage: the clip policies (grads/clip.py: per-example norms → clip factors,
re-exported here), per-group clipping, the ONE clip builder every way in calls
(:func:`build_clip_policy` from :class:`ClipSettings`), and the policies whose norm C follows the
data, which release a statistic of their own: adaptive quantile clipping (a noisy count, folded
into the step's one Gaussian) and the DP-Adam-AC paper's percentile rule (NOT CERTIFIED).

Every policy guarantees that the clipped contribution of one example, ``c_i * g_i`` taken over
all groups together, has L2 norm at most ``C`` (the sensitivity of the clipped sum under
add/remove-one neighbouring datasets is therefore ``C``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dpft.grads.clip import (EPS, AutoClip, ClipPolicy, FlatClip, HeadBodyClip, NoClip,  # noqa: F401 (public here)
                             NonFiniteGradientError, PerLayerClip, check_finite_norms, make_clip_policy)
from dpft.grads.groups import PerExampleOverK
from dpft.privacy.randomness import Randomness


# --------------------------------------------------------------------------- the one clip builder


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


@dataclass(frozen=True)
class ClipSettings:
    """How one privacy unit's gradient is clipped, as each way in translates its own keys
    (``dpft train``: ``privacy.clipping.*``, ``task.user_clipping``/``task.max_rows_per_user``;
    ``make_private``: ``clipping``, ``max_grad_norm``, ``head_fraction``, ``user_clipping``;
    ``DPArguments``: ``clipping``, ``max_grad_norm``, ``clipping_gamma``, ``head_fraction``, ...).

    Attributes:
        style: ``flat`` | ``per_layer`` | ``automatic`` (``auto``, ``auto_s``) | ``head_body`` |
            ``per_group`` (make_private: one share of C per optimizer param group).
        max_norm: C > 0, the L2 bound of one unit's clipped contribution (its sensitivity, add/remove-one).
        gamma: AUTO-S stability constant (``automatic``).
        head_fraction: f ∈ (0, 1), the head's share of C² (``head_body``).
        over_k: k at user level with ``per_example_over_k``: each row clipped to C/k, so a user's at
            most k rows sum to ≤ C (grads/groups.py ``PerExampleOverK``); None: each unit clipped to C
            (a row, or a user's summed rows with ``group`` clipping).
    """

    style: str
    max_norm: float
    gamma: float = 0.01
    head_fraction: float = 0.5
    over_k: Optional[int] = None


def build_clip_policy(s: ClipSettings, *, head_mask: Optional[Sequence[bool]] = None,
                      groups: Optional[tuple[Sequence[int], Sequence[float]]] = None) -> ClipPolicy:
    """The clip policy of ``s`` — the one clip builder of ``dpft train``, ``make_private`` and
    ``DPTrainer`` (and the TRL trainers): :func:`make_clip_policy` (or :class:`GroupClip`) at C, or at
    C/k wrapped in :class:`~dpft.grads.groups.PerExampleOverK` (sensitivity k · C/k = C).

    Args:
        head_mask: ``(G,)`` head flags in engine parameter order, set on a ``head_body`` policy now
            (a way in that knows them only later gives them to the step spec: step/build.py).
        groups: ``per_group`` only: ``(group index of each engine parameter, fraction f_g per group)``.

    Raises:
        ValueError: an unknown style, C not positive and finite, f outside (0, 1), γ ≤ 0, k < 1,
            ``per_group`` without ``groups`` or with fractions summing above 1.
    """
    c = s.max_norm / s.over_k if s.over_k is not None else s.max_norm
    if s.style == "per_group":
        if groups is None:
            raise ValueError("clipping 'per_group' needs the parameter groups (one share of C per optimizer "
                             "param group: make_private only)")
        clip: ClipPolicy = GroupClip(c, *groups)
    else:
        clip = make_clip_policy(s.style, c, s.gamma, s.head_fraction)
    if head_mask is not None and hasattr(clip, "set_head_mask"):
        clip.set_head_mask(head_mask)
    return PerExampleOverK(clip, s.over_k) if s.over_k is not None else clip


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
