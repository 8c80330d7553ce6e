"""Noise calibration: target (ε, δ) → noise multiplier σ, on the very events the run records.

Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent search) with the PLD accountant, then
checks the answer and, if the search landed on the wrong side of the target, raises σ until
ε(σ) ≤ target: calibration never rounds in the user's favour.
"""

from __future__ import annotations

import math

import dp_accounting as dpa

from dpft.accounting.ledger import epsilon_of, pld_accountant


#: Smallest σ the calibration searches (see :func:`calibrate_sigma`).
SIGMA_MIN = 0.15


class CalibrationError(ValueError):
    """A privacy target that cannot be met; the message says why and what to change."""


def dp_sgd_event(sigma: float, q: float, steps: int) -> dpa.DpEvent:
    """``steps`` × PoissonSampled(q, Gaussian(σ)): the event one DP-SGD phase records."""
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


def check_delta(delta: float, n: int | None) -> None:
    """δ must be in (0,1) and below 1/N (a δ ≥ 1/N allows publishing one record in the clear).

    Raises:
        CalibrationError: δ out of range.
    """
    if not 0 < delta < 1:
        raise CalibrationError(f"δ must be in (0, 1), got {delta}")
    if n is not None and delta >= 1.0 / n:
        raise CalibrationError(
            f"δ = {delta:g} is not below 1/N = {1.0 / n:.3g} for N = {n} training examples; "
            f"choose δ < 1/N (e.g. δ = {10 ** math.floor(math.log10(0.1 / n)):g})"
        )


def epsilon_for_sigma(sigma: float, q: float, steps: int, delta: float, prior=(),
                      discretization: float = 1e-4, phase_event=None) -> float:
    """ε(δ) of ``prior`` events composed with ``steps`` DP-SGD steps at (σ, q) (PLD); or with
    ``phase_event(σ)`` when given (the whole phase's event for another mechanism)."""
    acc = pld_accountant(discretization)
    phase = dp_sgd_event(sigma, q, steps) if phase_event is None else phase_event(sigma)
    acc.compose(dpa.ComposedDpEvent([*prior, phase]))
    return float(acc.get_epsilon(delta))


#: The search runs on a coarser PLD grid (faster); PLD discretisation is pessimistic, so a
#: coarser grid over-estimates ε and the σ found is at least the exact one. The final check
#: uses the reporting accountant (grid 1e-4).
_SEARCH_GRID = 1e-3


def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    prior: tuple[dpa.DpEvent, ...] | list = (),
    sigma_max: float = 500.0,
    phase_event=None,
) -> float:
    """Smallest σ (to ~1e-4 relative) with ε(δ) ≤ target for ``steps`` Poisson-sampled Gaussian
    steps at sampling rate ``q``, composed after the ``prior`` events already spent.

    Args:
        target_epsilon: total ε budget of the run (ε > 0).
        delta: target δ.
        q: Poisson sampling rate, expected batch / N.
        steps: number of noisy steps.
        prior: events already in the ledger (e.g. a private subspace phase).
        phase_event: ``σ -> DpEvent`` of the whole phase when it is not ``steps`` ×
            PoissonSampled(q, Gaussian(σ)) — truncated Poisson (step/truncated.py) or banded
            matrix factorization (step/correlated.py); the run records exactly these events.

    Raises:
        CalibrationError: the target cannot be met (prior events alone exceed it, or even
            σ = sigma_max is not enough), with the reason.
    """
    if not target_epsilon > 0:
        raise CalibrationError(f"target ε must be > 0, got {target_epsilon}")
    if not 0 < q <= 1:
        raise CalibrationError(f"sampling rate q must be in (0, 1], got {q}")
    if steps < 1:
        raise CalibrationError(f"need at least one step, got {steps}")
    prior = list(prior)
    if prior:
        eps_prior = epsilon_of(prior, delta).epsilon
        if eps_prior >= target_epsilon:
            raise CalibrationError(
                f"earlier phases already spent ε = {eps_prior:.4g} ≥ target {target_epsilon:g}; "
                "raise the target ε or give the earlier phases less budget"
            )
    ev = phase_event
    if epsilon_for_sigma(sigma_max, q, steps, delta, prior, phase_event=ev) > target_epsilon:
        raise CalibrationError(
            f"target ε = {target_epsilon:g} at δ = {delta:g} cannot be met with {steps} steps at "
            f"q = {q:.4g} even with σ = {sigma_max:g}; raise ε or δ, or use fewer steps / a "
            "smaller sampling rate"
        )

    def make_event(sigma):
        return dpa.ComposedDpEvent([*prior, dp_sgd_event(sigma, q, steps) if ev is None else ev(sigma)])

    # Explicit bracket: PLD discretisation of a very small σ needs huge arrays, so σ is
    # searched no lower than SIGMA_MIN; a target met even there gets σ = SIGMA_MIN (more
    # noise than needed, never less).
    hi = sigma_max
    lo = 1.0
    g = min(_SEARCH_GRID, target_epsilon / 100)  # grid fine enough to resolve the target
    while lo > SIGMA_MIN and epsilon_for_sigma(lo, q, steps, delta, prior, g, ev) <= target_epsilon:
        hi, lo = lo, max(lo / 2, SIGMA_MIN)
    if epsilon_for_sigma(lo, q, steps, delta, prior, g, ev) <= target_epsilon:
        return lo
    sigma = dpa.calibrate_dp_mechanism(
        lambda: pld_accountant(g),
        make_event,
        target_epsilon,
        delta,
        bracket_interval=dpa.ExplicitBracketInterval(lo, hi),
        tol=1e-4,
    )
    sigma = float(sigma)
    # Never approximate in our favour: step σ up until the certified ε meets the target.
    for _ in range(200):
        if epsilon_for_sigma(sigma, q, steps, delta, prior, phase_event=ev) <= target_epsilon:
            return sigma
        sigma *= 1.0 + 1e-4
    raise CalibrationError("σ calibration did not converge; report this as a bug")  # pragma: no cover
