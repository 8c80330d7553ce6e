"""Budget-aware defaults: ``batch.expected_batch_size: auto`` and ``schedule.steps: auto``.

At a fixed compute budget E = B·T (examples processed), choose the expected batch size B (and
T = E/B steps) that minimises the effective noise σ(q = B/N, T, ε, δ) / B — the standard deviation
of the noise on the *averaged* gradient in units of C, which Sander et al. (ICML 2023, "TAN
without a burn: scaling laws of DP-SGD") identify as what drives DP-SGD's utility at fixed
compute. σ comes from dp-accounting (``calibrate_dp_mechanism`` with its RDP accountant: fast,
and RDP is conservative against the PLD the run then calibrates with, so the ranking is of
certified quantities). The run itself calibrates σ again with PLD (accounting/calibrate.py).

Learning rate rule (documented, applied only when B is chosen here): the recipe's ``lr`` is taken
as tuned for B_ref = 256 (the recipe default) and scaled by √(B/B_ref) for Adam/AdamW (the
square-root rule for adaptive optimizers, Malladi et al. 2022) and by B/B_ref for SGD (the linear
rule, Goyal et al. 2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import dp_accounting as dpa
from dp_accounting.rdp import rdp_privacy_accountant

from dpft.accounting.quiet import quiet_absl as _quiet_absl  # absl's RDP notes: not errors

__all__ = ["BudgetChoice", "choose_batch_and_steps", "choose_for_time", "steps_in_time", "scaled_lr", "B_REF",
           "BudgetError"]

#: The batch size the recipe's learning rate is taken to be tuned for.
B_REF = 256
#: At least this many steps (or budget/8 when the budget is smaller): σ/B keeps falling as B grows
#: at fixed B·T, but a handful of updates cannot train whatever the noise (Sander et al. 2023 fix T).
MIN_STEPS = 100


class BudgetError(ValueError):
    """``auto`` cannot be resolved; the message says what to set."""


@dataclass
class BudgetChoice:
    """The chosen (B, T), its σ and σ/B, and every candidate's row (for the printout)."""

    batch: int
    steps: int
    sigma: float
    noise_per_example: float
    budget: int
    rows: list[dict] = field(default_factory=list)

    def explain(self) -> str:
        head = (f"auto: B = {self.batch}, T = {self.steps} steps (B·T ≈ {self.budget} examples processed): the "
                f"smallest noise on the averaged gradient σ/B = {self.noise_per_example:.4g} (σ = {self.sigma:.3g}) "
                "among the candidates at this compute (Sander et al. 2023):")
        lines = [f"    B = {r['batch']:>6}  T = {r['steps']:>6}  σ = {r['sigma']:8.3f}  σ/B = {r['noise_per_example']:.4g}"
                 + (f"  ≈ {r['seconds']:.0f} s of steps" if "seconds" in r else "") for r in self.rows]
        return "\n".join([head, *lines])


def _candidate_rows(cands, n: int, epsilon: float, delta: float, extra=None, sigma_for=None) -> list[dict]:
    """One row per candidate (B, T) the target ε reaches: σ (``sigma_for(q, T)``; default RDP of one run,
    for ranking only; the run's σ is then calibrated with PLD), σ/B, and ``extra(B, T)``'s keys; a (B, T)
    out of reach is left out."""
    rows = []
    for b, t in cands:
        try:
            s = sigma_for(b / n, t) if sigma_for else _sigma_rdp(b / n, t, epsilon, delta)
        except Exception:  # noqa: BLE001 - the target is out of reach at this (B, T)
            continue
        rows.append({"batch": b, "steps": t, "sigma": s, "noise_per_example": s / b, **(extra(b, t) if extra else {})})
    return rows


def _sigma_rdp(q: float, steps: int, epsilon: float, delta: float) -> float:
    def make(s):
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), steps)

    with _quiet_absl():
        return float(dpa.calibrate_dp_mechanism(rdp_privacy_accountant.RdpAccountant, make, epsilon, delta,
                                                bracket_interval=dpa.ExplicitBracketInterval(0.2, 500.0), tol=1e-3))


def choose_batch_and_steps(n: int, epsilon: float, delta: float, budget: Optional[int] = None,
                           batch: Optional[int] = None, steps: Optional[int] = None,
                           sigma_for: Optional[Callable[[float, int], float]] = None) -> BudgetChoice:
    """(B, T) minimising σ(B/N, T)/B at B·T = ``budget`` (default 3 epochs: 3N), B = 8, 16, … ≤ N
    with T = budget/B ≥ min(MIN_STEPS, budget/8).

    Args:
        n: training examples N. epsilon, delta: the run's target.
        budget: examples processed E; batch / steps: a fixed B or T (the other is E / it).
        sigma_for: σ of a candidate (q, T) (raises where the target is out of reach); default: one run's σ
            at (ε, δ) by RDP. A private search (run/tune_space.py) passes each trial's σ at which the whole
            search spends ε (the selection bound, accounting/selection.py ``calibrate_search``).

    Raises:
        BudgetError: N < 2, or no candidate meets the target (then raise ε or the budget)."""
    if n < 2:
        raise BudgetError(f"auto batch/steps need N ≥ 2 training examples (got {n})")
    budget = int(budget or 3 * n)
    if batch is not None and steps is not None:
        raise BudgetError("nothing is auto: give batch.expected_batch_size or schedule.steps as auto")
    if batch is not None:
        cands = [(batch, max(1, round(budget / batch)))]
    elif steps is not None:
        cands = [(max(1, min(n, round(budget / steps))), steps)]
    else:
        t_min = max(1, min(MIN_STEPS, budget // 8))
        bs, b = [], 8
        while b <= n and b * t_min <= budget:
            bs.append(b)
            b *= 2
        bs = bs or [min(n, budget)]
        cands = [(b, max(1, round(budget / b))) for b in bs]
    rows = _candidate_rows(cands, n, epsilon, delta, sigma_for=sigma_for)
    if not rows:
        raise BudgetError(f"no (B, T) at B·T = {budget} meets ε = {epsilon:g} at δ = {delta:g} with σ ≤ 500; "
                          "raise ε or lower schedule.compute_budget")
    best = min(rows, key=lambda r: r["noise_per_example"])
    return BudgetChoice(best["batch"], best["steps"], best["sigma"], best["noise_per_example"], budget, rows)


def steps_in_time(seconds: float, step_seconds: float, eval_seconds: float = 0.0,
                  eval_every: Optional[int] = None) -> int:
    """The most logical steps T that fit ``seconds`` of wall time when each step takes ``step_seconds``
    and the run evaluates every ``eval_every`` steps and once at the end, ``eval_seconds`` each:
    T·s + (⌊T/e⌋ + 1)·E ≤ seconds, solved with T/e for ⌊T/e⌋ (so never more than fits). 0: none fits."""
    room = seconds - eval_seconds
    per = step_seconds + (eval_seconds / eval_every if eval_every else 0.0)
    if not per > 0:
        raise BudgetError(f"a measured step time must be positive (got {step_seconds!r} s)")
    if room <= 0:
        return 0
    return int(math.floor(room / per + 1e-9))


def choose_for_time(n: int, epsilon: float, delta: float, seconds: float, step_seconds: Callable[[int], float],
                    eval_seconds: float = 0.0, eval_every: Optional[int] = None,
                    batch: Optional[int] = None) -> BudgetChoice:
    """(B, T) for a wall-clock budget: each candidate B = 8, 16, … ≤ N (or the given ``batch``) gets the
    most steps that fit (:func:`steps_in_time` with its measured ``step_seconds(B)``), and the B with the
    smallest σ(B/N, T_B)/B wins (the compute-budget rule of :func:`choose_batch_and_steps` with the
    budget in seconds instead of examples). ``rows`` carry each candidate's estimated seconds.

    Raises:
        BudgetError: N < 2, or no step fits in ``seconds`` (then raise the budget), or none meets ε."""
    if n < 2:
        raise BudgetError(f"auto batch/steps need N ≥ 2 training examples (got {n})")
    bs = [batch] if batch is not None else []
    b = 8
    while batch is None and b <= n:
        bs.append(b)
        b *= 2
    bs = bs or [n]
    cands = [(b, steps_in_time(seconds, step_seconds(b), eval_seconds, eval_every)) for b in bs]
    cands = [(b, t) for b, t in cands if t >= 1]
    if not cands:
        raise BudgetError(f"the time budget ({seconds:.0f} s left after setup) does not fit one step of B = {bs[0]} "
                          f"({step_seconds(bs[0]):.3g} s a step, {eval_seconds:.3g} s an evaluation): raise it, "
                          "lower model.max_length or the batch size")
    if batch is None:  # the compute budget's floor: T ≥ min(MIN_STEPS, T at the smallest B)
        t_min = max(1, min(MIN_STEPS, cands[0][1]))
        cands = [(b, t) for b, t in cands if t >= t_min] or cands[:1]
    rows = _candidate_rows(cands, n, epsilon, delta, lambda b, t: {"seconds": t * step_seconds(b)})
    if not rows:
        raise BudgetError(f"no (B, T) that fits the time budget meets ε = {epsilon:g} at δ = {delta:g} with σ ≤ 500; "
                          "raise ε or the time budget")
    best = min(rows, key=lambda r: r["noise_per_example"])
    return BudgetChoice(best["batch"], best["steps"], best["sigma"], best["noise_per_example"],
                        best["batch"] * best["steps"], rows)


def scaled_lr(lr: float, batch: int, optimizer: str) -> float:
    """``lr`` tuned at B_REF, scaled to ``batch`` (√ for Adam/AdamW, linear for SGD; module docstring)."""
    ratio = batch / B_REF
    return lr * (ratio if optimizer == "sgd" else math.sqrt(ratio))
