"""Epoch-weighted privacy budget allocation (EWPBA) and its uniform special case (DP-Forward).

Source: Zhang et al., "EW-FT: an epoch-weighted privacy budget allocation framework for
fine-tuning LLMs" (Sci. China Inf. Sci. 2026), Algorithm 1, Eq. (9)–(10), and ComposePRV'
(Algorithm 3). The paper composes per-epoch PRV curves; here the same composition —
``steps_per_epoch`` × ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_e))`` for each epoch e,
all epochs composed — is handed to the PLD accountant of ``dp-accounting`` through
:func:`dpft.accounting.ledger.pld_accountant`. No accountant of our own: this module only
searches σ's and builds the events the run's ledger will record.

σ_e is a noise multiplier relative to the *replace-one* sensitivity 2C of a clipped hidden
matrix (``privacy/ldp.py`` draws N(0, σ_e²(2C)²)); under add/remove of a row of norm ≤ C the
same noise is 2σ_e relative to C, so recording σ_e is conservative by that factor.

Algorithm 1, in the paper's order:

1. σ_beg: bisection of a *uniform* σ on [0.2, 50] until ε(σ_beg) is within ``tol`` of ε′ = ε − 1.
2. bisection of σ_fir on [0, σ_beg]: Add_num = 4(σ_beg − σ_fir) / ((E − 1)(S + 1)) (Eq. 9); the
   list starts at σ_fir and grows by Add_num while ``epoch_num < E/2 − 1`` and by S·Add_num
   after (Eq. 10, epoch_num = 1 … E−1); stop when ε(list) is within ``tol`` of ε.
3. reverse the list: early epochs get the most noise, the last epoch the least.

Both searches solve the same equations as the paper's bisections (ε(σ_beg) = ε − 1, then
ε(list(σ_fir)) = ε), but (a) stop only on the side ε ≤ target (target − 1e-4 ≤ ε ≤ target: never
rounding in the user's favour, where the paper accepts either side), and (b) to be affordable on
a CPU run regula falsi on log ε, first on a coarse PLD grid (1e-3, pessimistic so safe) and then
on the reporting grid 1e-4 — about 10 PLD evaluations per search instead of ~40.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import dp_accounting as dpa

from dpft.accounting.ledger import pld_accountant

#: Bracket of the uniform search (Algorithm 1, line 2).
SIGMA_START, SIGMA_END = 0.2, 50.0
#: Below this σ the PLD of a subsampled Gaussian needs huge arrays; such a σ is treated as
#: spending more than any target (the search then stays above it: more noise, never less).
SIGMA_FLOOR = 0.15


class ScheduleError(ValueError):
    """An EWPBA/uniform schedule that cannot be built; the message names the fix."""


def epoch_events(sigmas: list[float], q: float, steps_per_epoch: int) -> list[dpa.DpEvent]:
    """One event per epoch: ``steps_per_epoch`` × PoissonSampled(q, Gaussian(σ_e)).

    Exactly what the training stream records in the ledger (one entry per step, grouped).
    """
    return [dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(float(s))), steps_per_epoch)
            for s in sigmas]


def schedule_epsilon(sigmas: list[float], q: float, steps_per_epoch: int, delta: float,
                     discretization: float = 1e-4) -> float:
    """ε(δ) of the heterogeneous composition (the paper's ComposePRV′) with the PLD accountant."""
    if min(sigmas) < SIGMA_FLOOR:
        return math.inf
    return _schedule_epsilon(tuple(float(x) for x in sigmas), float(q), int(steps_per_epoch), float(delta),
                             float(discretization))


@functools.lru_cache(maxsize=512)
def _schedule_epsilon(sigmas: tuple, q: float, steps_per_epoch: int, delta: float, discretization: float) -> float:
    acc = pld_accountant(discretization)
    acc.compose(dpa.ComposedDpEvent(epoch_events(sigmas, q, steps_per_epoch)))
    return float(acc.get_epsilon(delta))


def two_stage_list(sigma_fir: float, sigma_beg: float, epochs: int, step_distance: float) -> list[float]:
    """Algorithm 1 lines 16–26, *before* the reversal of line 34.

    Returns ``[σ_fir, σ_fir + a_1, …]`` of length E, with Add_num = 4(σ_beg − σ_fir)/((E−1)(S+1))
    (Eq. 9) added while ``epoch_num < E/2 − 1`` and S·Add_num afterwards (Eq. 10).
    """
    if epochs == 1:
        return [sigma_fir]
    add = 4.0 * (sigma_beg - sigma_fir) / ((epochs - 1) * (step_distance + 1))
    out, s = [sigma_fir], sigma_fir
    for epoch_num in range(1, epochs):
        s = s + (add if epoch_num < epochs / 2 - 1 else step_distance * add)
        out.append(s)
    return out


@dataclass
class NoiseSchedule:
    """Per-epoch noise multipliers σ_e (relative to the replace-one sensitivity 2C) and the
    events that spend them.

    Attributes:
        sigmas: σ_e for epoch e = 1 … E (training order).
        q: Poisson sampling rate (expected batch / N).
        steps_per_epoch: noisy steps per epoch.
        delta: δ of the target.
        target_epsilon: ε the schedule was built for.
        epsilon: ε(δ) of all E epochs (PLD, grid 1e-4).
        method: ``ewpba`` or ``uniform``.
        sigma_beg: Algorithm 1's σ_beg (ewpba only).
    """

    sigmas: list[float]
    q: float
    steps_per_epoch: int
    delta: float
    target_epsilon: float
    epsilon: float
    method: str
    sigma_beg: float | None = None
    notes: list[str] = field(default_factory=list)

    def sigma_at(self, step: int) -> float:
        """σ of the epoch that holds ``step`` (0-based)."""
        e = min(step // self.steps_per_epoch, len(self.sigmas) - 1)
        return self.sigmas[e]

    def step_event(self, step: int) -> dpa.DpEvent:
        """The ledger event of one step: PoissonSampled(q, Gaussian(σ_e))."""
        return dpa.PoissonSampledDpEvent(self.q, dpa.GaussianDpEvent(float(self.sigma_at(step))))

    def events(self) -> list[dpa.DpEvent]:
        return epoch_events(self.sigmas, self.q, self.steps_per_epoch)

    def as_dict(self) -> dict:
        return {"method": self.method, "sigmas": self.sigmas, "q": self.q, "steps_per_epoch": self.steps_per_epoch,
                "delta": self.delta, "target_epsilon": self.target_epsilon, "epsilon": self.epsilon,
                "sigma_beg": self.sigma_beg, "notes": self.notes}


def _check(target_epsilon: float, delta: float, q: float, steps_per_epoch: int, epochs: int) -> None:
    if not target_epsilon > 0:
        raise ScheduleError(f"target ε must be > 0, got {target_epsilon}")
    if not 0 < delta < 1:
        raise ScheduleError(f"δ must be in (0, 1), got {delta}")
    if not 0 < q <= 1:
        raise ScheduleError(f"sampling rate q must be in (0, 1], got {q}")
    if steps_per_epoch < 1 or epochs < 1:
        raise ScheduleError(f"need ≥ 1 epoch and ≥ 1 step per epoch, got E={epochs}, steps={steps_per_epoch}")


def _illinois(f, a: float, fa: float, b: float, fb: float, target: float, tol: float,
              max_iter: int = 60) -> tuple[float, float, float, float]:
    """Regula falsi (Illinois variant) for decreasing f with f(a) > target ≥ f(b).

    Returns the final bracket ``(a, fa, b, fb)``; stops once target − tol ≤ f(b) ≤ target.
    """
    side = 0
    ga, gb = fa, fb  # weights of the secant (halved at a stale end)
    for _ in range(max_iter):
        if target - fb <= tol or b - a < 1e-12:
            break
        x = b - (gb - target) * (b - a) / (gb - ga) if math.isfinite(ga) else (a + b) / 2
        if not a < x < b:
            x = (a + b) / 2
        fx = f(x)
        if fx > target:
            a, fa, ga = x, fx, fx
            if side == -1:
                gb = target + (gb - target) / 2
            side = -1
        else:
            b, fb, gb = x, fx, fx
            if side == 1 and math.isfinite(ga):
                ga = target + (ga - target) / 2
            side = 1
    return a, fa, b, fb


def _solve(eps_fn, lo: float, hi: float, target: float, tol: float) -> tuple[float, float]:
    """x in [lo, hi] with target − tol ≤ ε(x) ≤ target, for ε decreasing in x, given
    ε(lo) > target ≥ ε(hi) — the root that Algorithm 1's bisections look for.

    The search runs on log ε (nearly linear in σ) with regula falsi, first on a coarse PLD grid
    (10× faster; PLD discretisation is pessimistic, so the coarse ε is ≥ the reporting one),
    then on the reporting grid (1e-4) from the coarse answer. Returns ``(x, ε(x))`` with the
    reporting-grid ε(x) ≤ target.
    """
    lt = math.log(target)
    ltol = lt - math.log(target - tol) if tol < target else lt

    def logf(grid):
        return lambda x: math.log(max(eps_fn(x, grid), 1e-300))

    coarse, fine = logf(_COARSE_GRID), logf(1e-4)
    a, fa, b, fb = _illinois(coarse, lo, coarse(lo), hi, coarse(hi), lt, 1e-3)
    slope = (fa - fb) / (a - b) if math.isfinite(fa) and b > a else None
    gb = fine(b)
    if lt - gb <= ltol:
        return b, math.exp(gb)
    # One secant step on the coarse slope lands close; then bracket and refine on the fine grid.
    x = b + (lt - ltol / 2 - gb) / slope if slope else b - 1e-3 * b
    x = min(max(x, lo), b)
    gx = fine(x)
    while gx <= lt and x > lo:  # still under the target: accept or step further
        if lt - gx <= ltol:
            return x, math.exp(gx)
        b, gb = x, gx
        x = max(lo, b - 2 * max(b - x, 1e-3 * b))
        gx = fine(x)
    if gx <= lt:  # even lo meets the target: more noise than needed, never less
        return x, math.exp(gx)
    a, fa, b, fb = _illinois(fine, x, gx, b, gb, lt, ltol)
    return b, math.exp(fb)


#: PLD grid of the coarse search (faster; pessimistic, so safe).
_COARSE_GRID = 1e-3


def _bisect_uniform(target: float, delta: float, q: float, steps_per_epoch: int, epochs: int,
                    tol: float) -> float:
    """Algorithm 1 lines 2–12: uniform σ in [0.2, 50] with target − tol ≤ ε(σ) ≤ target."""
    lo, hi = SIGMA_START, SIGMA_END

    def eps(s, grid=1e-4):
        return schedule_epsilon([s] * epochs, q, steps_per_epoch, delta, grid)

    if eps(hi, _COARSE_GRID) > target and eps(hi) > target:
        raise ScheduleError(
            f"ε = {target:g} at δ = {delta:g} cannot be met even with σ = {hi:g} over {epochs} epochs × "
            f"{steps_per_epoch} steps at q = {q:.4g}; raise ε or use fewer epochs")
    if eps(lo, _COARSE_GRID) <= target:
        return lo  # coarse ε ≥ reporting ε: more noise than needed, never less
    return _solve(eps, lo, hi, target, tol)[0]


def uniform_schedule(target_epsilon: float, delta: float, q: float, steps_per_epoch: int, epochs: int,
                     tol: float = 1e-4) -> NoiseSchedule:
    """DP-Forward's schedule: one σ for every epoch, ε(δ) within ``tol`` below the target.

    Same code path as EWPBA (bisection on the same events), with a single σ.

    Raises:
        ScheduleError: bad arguments or an unreachable target.
    """
    _check(target_epsilon, delta, q, steps_per_epoch, epochs)
    s = _bisect_uniform(target_epsilon, delta, q, steps_per_epoch, epochs, tol)
    sig = [s] * epochs
    return NoiseSchedule(sig, q, steps_per_epoch, delta, target_epsilon,
                         schedule_epsilon(sig, q, steps_per_epoch, delta), "uniform")


def ewpba_schedule(target_epsilon: float, delta: float, q: float, steps_per_epoch: int, epochs: int,
                   step_distance: float = 2.0, tol: float = 1e-4) -> NoiseSchedule:
    """EWPBA, Algorithm 1 of Zhang et al. 2026: decreasing per-epoch σ_e meeting ε(δ).

    Args:
        target_epsilon: ε of the whole training stream; must be > 1 (ε′ = ε − 1 > 0).
        delta: δ.
        q: Poisson sampling rate B/|D| (Algorithm 1, line 1: P).
        steps_per_epoch: noisy steps per epoch (Com/E).
        epochs: E ≥ 1.
        step_distance: S > 0 (paper default 2): stage-1 steps are S× the stage-2 steps.
        tol: |ε(list) − ε| stopping threshold (paper: 1e-4).

    Returns:
        :class:`NoiseSchedule` with ``sigmas`` in training order (non-increasing).

    Raises:
        ScheduleError: ε ≤ 1, S ≤ 0, bad q/δ, or an unreachable target.
    """
    _check(target_epsilon, delta, q, steps_per_epoch, epochs)
    if target_epsilon <= 1:
        raise ScheduleError(f"EWPBA needs ε > 1 (it starts from ε′ = ε − 1), got {target_epsilon}; "
                            "use the uniform schedule (ldp.schedule: uniform) for ε ≤ 1")
    if step_distance <= 0:
        raise ScheduleError(f"step distance S must be > 0, got {step_distance}")
    sigma_beg = _bisect_uniform(target_epsilon - 1.0, delta, q, steps_per_epoch, epochs, tol)
    notes = []
    if epochs <= 3:
        notes.append(f"E = {epochs}: Eq. (10)'s stage-2 test epoch_num < E/2 − 1 never holds, so every "
                     "epoch-to-epoch step is S·Add_num (one stage)")
    if epochs == 1:
        s = _bisect_uniform(target_epsilon, delta, q, steps_per_epoch, 1, tol)
        return NoiseSchedule([s], q, steps_per_epoch, delta, target_epsilon,
                             schedule_epsilon([s], q, steps_per_epoch, delta), "ewpba", sigma_beg,
                             notes + ["E = 1: a single σ"])
    # σ_fir = 0 is no privacy (ε > target); σ_fir = σ_beg is the uniform list at ε − 1.
    def eps(fir, grid=1e-4):
        return schedule_epsilon(two_stage_list(fir, sigma_beg, epochs, step_distance), q, steps_per_epoch,
                                delta, grid)

    s2 = _solve(eps, 0.0, sigma_beg, target_epsilon, tol)[0]
    sig = list(reversed(two_stage_list(s2, sigma_beg, epochs, step_distance)))
    return NoiseSchedule(sig, q, steps_per_epoch, delta, target_epsilon,
                         schedule_epsilon(sig, q, steps_per_epoch, delta), "ewpba", sigma_beg, notes)


def make_schedule(method: str, target_epsilon: float, delta: float, q: float, steps_per_epoch: int,
                  epochs: int, step_distance: float = 2.0) -> NoiseSchedule:
    """``ewpba`` (EW-FT) or ``uniform`` (DP-Forward)."""
    if method == "ewpba":
        return ewpba_schedule(target_epsilon, delta, q, steps_per_epoch, epochs, step_distance)
    if method == "uniform":
        return uniform_schedule(target_epsilon, delta, q, steps_per_epoch, epochs)
    raise ScheduleError(f"unknown schedule {method!r}; choose 'ewpba' or 'uniform'")
