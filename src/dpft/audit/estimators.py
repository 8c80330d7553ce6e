"""One-run ε̂ lower bounds from canary scores (issue 37): Steinke et al. 2023 and the f-DP
estimator of Mahloujifar et al. 2025, with the threshold chosen under a Bonferroni correction.

The game (Steinke, Nasr & Jagielski, NeurIPS 2023, "Privacy auditing with one (1) training run",
Sec. 3): m canaries, each included in training with probability ½ by a secret coin; after
training, each canary gets a score (higher = "looks included"). The auditor guesses "in" for the
canaries scoring at or above a threshold (r guesses, v of them correct) and abstains on the rest
(one-sided guesses, their k₋ = 0). Both estimators turn (m, r, v) into the largest ε at which
an (ε, δ) claim is rejected at significance α:

* **Steinke et al. 2023**, Thm. 3.1 / Prop. 5.2 (δ > 0): under (ε, δ)-DP with p = e^ε/(1+e^ε),

      P[V ≥ v] ≤ P[Bin(r, p) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Bin(r, p) < v] / i,

  and ε̂ is the largest ε whose bound is still ≤ α (:func:`steinke_epsilon`).
* **Mahloujifar et al. 2025** ("Auditing f-differential privacy in one run", Alg. 3
  ``audit_rh_with_cap``): the same game tested against a whole trade-off curve f. Here f is
  the μ-GDP curve whose (ε, δ) point is tight, f(x) = Φ(Φ⁻¹(1 − x) − μ), μ = 1/σ(ε, δ) with
  σ(ε, δ) the Gaussian mechanism's exact noise (dp_accounting ``get_sigma_gaussian``);
  ε̂ is the largest ε whose GDP curve is rejected (:func:`fdp_epsilon`). This is a lower bound
  on ε for mechanisms whose privacy curve is Gaussian-shaped (DP-SGD's is close to it); for
  an arbitrary (ε, δ) mechanism only the Steinke bound holds.

Threshold choice (:func:`epsilon_lower_bound`): every threshold on the upper hull of the
(false-negative, true-negative) count curve is tried at significance α / (number of hull
points) (Bonferroni), so the reported ε̂ holds at confidence 1 − α whatever threshold wins.
The formulas, the hull and the correction follow jax_privacy's ``auditing.py``
(``CanaryScoreAuditor.epsilon_one_run`` / ``epsilon_one_run_fdp`` with ``Bonferroni()``); the
test ``tests/test_audit_final_model.py`` checks that the numbers agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
from scipy import optimize, special, stats

__all__ = ["EpsilonBound", "steinke_p_value", "steinke_epsilon", "fdp_epsilon", "hull_counts",
           "epsilon_lower_bound", "gaussian_events", "METHODS", "GAUSSIAN_ASSUMPTION"]

#: Estimator names (:func:`epsilon_lower_bound` ``method``) → what the report calls them. The
#: Steinke bound is valid for any (ε, δ) mechanism (the headline); the f-DP bound only for a
#: mechanism under the Gaussian trade-off curve (shown with :data:`GAUSSIAN_ASSUMPTION`).
METHODS = {"steinke": "one-run, valid for any mechanism (Steinke, Nasr & Jagielski 2023)",
           "fdp": "one-run f-DP, assuming a Gaussian trade-off curve (Mahloujifar et al. 2025)"}
#: The words that go with every f-DP ε̂ (report, model card, CLI, final_model_audit.md).
GAUSSIAN_ASSUMPTION = "assuming a Gaussian trade-off curve"


def gaussian_events(events) -> bool:
    """Whether every ``dp_accounting`` event of a ledger is built from Gaussian releases only
    (``GaussianDpEvent`` under Poisson or truncated subsampling, self-composed or composed;
    ``NoOpDpEvent``): the runs whose f-DP ε̂ counts in the final-model audit's verdict. Any
    other event (randomized response, Laplace, a selection event, an unknown one) gives False:
    there only the Steinke bound is valid, the f-DP one can exceed ε on an honest run (ε-DP
    randomized response: in most runs). An empty list gives False (nothing was released)."""
    import dp_accounting as dpa

    def ok(e) -> bool:
        if isinstance(e, (dpa.GaussianDpEvent, dpa.NoOpDpEvent)):
            return True
        if isinstance(e, dpa.TruncatedSubsampledGaussianDpEvent):
            return True
        if isinstance(e, (dpa.PoissonSampledDpEvent, dpa.SampledWithReplacementDpEvent,
                          dpa.SampledWithoutReplacementDpEvent, dpa.SelfComposedDpEvent)):
            return ok(e.event)
        if isinstance(e, dpa.ComposedDpEvent):
            return all(ok(x) for x in e.events)
        return False

    events = list(events)
    return bool(events) and all(ok(e) for e in events)


@dataclass(frozen=True)
class EpsilonBound:
    """An ε̂ lower bound and how it was obtained.

    Attributes:
        epsilon: ε̂ ≥ 0 (0 = no (ε, δ) claim with ε ≥ 0 could be rejected).
        confidence: 1 − α: the probability, over the canary coins and the training randomness,
            that a mechanism satisfying the claim gives an ε̂ this large is at most α.
        delta: the δ of the rejected (ε̂, δ) claim.
        method: ``steinke`` or ``fdp`` (:data:`METHODS`).
        m: canaries in the game; guesses, correct: r and v at the winning threshold.
        threshold: the winning score threshold (guess "in" at or above it); hypotheses: the
            Bonferroni factor (hull points tried).
    """

    epsilon: float
    confidence: float
    delta: float
    method: str
    m: int
    guesses: int
    correct: int
    threshold: float
    hypotheses: int

    def as_dict(self) -> dict:
        return {**asdict(self), "method_name": METHODS[self.method]}


def _check_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got correct={v}, guesses={r}, m={m}")


def steinke_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[≥ v of r guesses correct] under an (ε, δ)-DP mechanism with m canaries (Steinke et al.
    2023, Prop. 5.2). Unitless probability in [0, 1].

    Raises:
        ValueError: not 0 ≤ v ≤ r ≤ m."""
    _check_counts(m, r, v)
    p = special.expit(eps)
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin(r, p) ≥ v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    # P[v − i ≤ Bin < v] / i for i = 1..v: cumulative pmf of v−1, v−2, …, 0 over i.
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))
    worst = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * worst, 1.0)


def _largest_rejected(rejects_by: Callable[[float], float], eps_floor: float) -> float:
    """The largest ε ≥ eps_floor with ``rejects_by(ε) > 0`` (decreasing in ε), to 1e-6; eps_floor
    when none. Brackets by doubling, then Brent's method."""
    if rejects_by(eps_floor) <= 0:
        return eps_floor
    lo, hi = eps_floor, max(1.0, 2 * eps_floor)
    while rejects_by(hi) > 0:
        lo, hi = hi, 2 * hi
    return float(optimize.brentq(rejects_by, lo, hi, xtol=1e-6))


def steinke_epsilon(m: int, r: int, v: int, alpha: float, delta: float, eps_floor: float = 0.0) -> float:
    """Largest ε whose (ε, δ) claim is rejected at significance α by v correct of r guesses with
    m canaries (Steinke et al. 2023); ``eps_floor`` when none is (0 by default)."""
    _check_counts(m, r, v)
    if r == 0 or steinke_p_value(m, r, v, eps_floor, 0.0) > alpha:  # δ only adds to the p-value
        return eps_floor
    return _largest_rejected(lambda e: alpha - steinke_p_value(m, r, v, e, delta), eps_floor)


@lru_cache(maxsize=4096)
def _gdp_mu(eps: float, delta: float) -> float:
    """μ of the Gaussian trade-off curve whose (ε, δ) point is exact: 1/σ(ε, δ) (∞ for σ = 0)."""
    from dp_accounting import get_sigma_gaussian  # dp-accounting: the exact Balle–Wang σ

    sigma = get_sigma_gaussian(eps, delta)
    return math.inf if sigma == 0 else 1.0 / sigma


def _gdp_curve_margin(m: int, r: int, v: int, alpha: float, mu: float) -> float:
    """Mahloujifar et al. 2025, Alg. 3 (``audit_rh_with_cap``) for the μ-GDP curve: > 0 when v
    correct of r guesses reject μ-GDP at significance α.

    Starting from the α-scaled masses of right (ρ = αv/m) and wrong (h = α(r − v)/m) guesses,
    the recursion walks the number of correct guesses down from v: h is raised to at least
    Φ(Φ⁻¹(ρ) − μ) (what the curve forces beside ρ) and the increase passes back to ρ in proportion
    i / (r − i); the claim is rejected when ρ + h exceeds the r / m guesses made."""
    def wrong_floor(x: float) -> float:
        if math.isinf(mu):
            return float(x == 1.0)
        return float(stats.norm.cdf(stats.norm.ppf(x) - mu))

    right, wrong = alpha * v / m, alpha * (r - v) / m
    for i in range(v - 1, -1, -1):
        raised = max(wrong, wrong_floor(right))
        if raised == wrong:  # a fixed point: neither mass moves again
            break
        right = min(right + i / (r - i) * (raised - wrong), 1.0)
        wrong = raised
    return right + wrong - r / m


def fdp_epsilon(m: int, r: int, v: int, alpha: float, delta: float, eps_floor: float = 0.0) -> float:
    """Largest ε whose μ(ε, δ)-GDP curve is rejected at significance α by v correct of r guesses
    with m canaries (Mahloujifar et al. 2025, Gaussian f); ``eps_floor`` when none is."""
    _check_counts(m, r, v)
    if r == 0:
        return eps_floor
    return _largest_rejected(lambda e: _gdp_curve_margin(m, r, v, alpha, _gdp_mu(e, delta)), eps_floor)


def hull_counts(in_scores: Sequence[float], out_scores: Sequence[float]):
    """Thresholds worth trying and their counts.

    For each threshold t among the distinct scores and +∞, the rule "in iff score ≥ t" has
    fn(t) = #in-canaries below t and tn(t) = #out-canaries below t. A threshold whose point
    (fn, tn) lies on or under the chord of two others is dominated (a mix of those two does at
    least as well), so only the strict upper hull of the curve is kept (Andrew's monotone chain).

    Returns:
        (thresholds, tp, fp): float and int arrays of equal length (hull points, increasing t),
        with tp = #in ≥ t and fp = #out ≥ t.

    Raises:
        ValueError: either score list empty or not one-dimensional."""
    a, b = np.asarray(in_scores, dtype=float), np.asarray(out_scores, dtype=float)
    for name, x in (("in", a), ("out", b)):
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"{name}-canary scores must be a non-empty 1-d list, got shape {x.shape}")
    ts = np.concatenate([np.union1d(a, b), [np.inf]])
    fn = np.searchsorted(np.sort(a), ts, side="left")
    tn = np.searchsorted(np.sort(b), ts, side="left")
    keep: list[int] = []
    for j in range(len(ts)):
        while len(keep) >= 2:
            i0, i1 = keep[-2], keep[-1]
            turn = (tn[i1] - tn[i0]) * (fn[j] - fn[i1]) - (tn[j] - tn[i1]) * (fn[i1] - fn[i0])
            if turn > 0:  # i1 strictly above the chord i0 → j
                break
            keep.pop()
        keep.append(j)
    k = np.asarray(keep)
    return ts[k], a.size - fn[k], b.size - tn[k]


def epsilon_lower_bound(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                        method: str = "fdp", confidence: float = 0.95) -> EpsilonBound:
    """ε̂ of a one-run audit from the scores of the included (``in_scores``) and excluded
    (``out_scores``) canaries; higher scores must mean "more likely included".

    Every hull threshold (:func:`hull_counts`) is tried at α / (hull size), α = 1 − confidence
    (Bonferroni), and the best ε̂ is returned: it holds at ``confidence`` jointly.

    Raises:
        ValueError: an unknown method, confidence outside (0, 1), δ outside (0, 1], empty scores."""
    if method not in METHODS:
        raise ValueError(f"unknown estimator {method!r}; one of {sorted(METHODS)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 < delta <= 1:
        raise ValueError(f"delta must be in (0, 1], got {delta}")
    ts, tp, fp = hull_counts(in_scores, out_scores)
    m = len(in_scores) + len(out_scores)
    alpha = (1 - confidence) / len(ts)
    fn = fdp_epsilon if method == "fdp" else steinke_epsilon
    best, best_j = 0.0, len(ts) - 1
    guesses = tp + fp
    precision = np.where(guesses > 0, tp / np.maximum(guesses, 1), 0.0)
    for j in np.argsort(-precision, kind="stable"):  # likely winners first: later ones prune cheaply
        r, v = int(guesses[j]), int(tp[j])
        if r == 0 or v / r <= special.expit(best):
            continue  # precision at or below e^ε̂/(1+e^ε̂): cannot reject a larger ε
        eps = fn(m, r, v, alpha, delta, eps_floor=best)
        if eps > best:
            best, best_j = eps, int(j)
    return EpsilonBound(epsilon=float(best), confidence=confidence, delta=delta, method=method, m=m,
                        guesses=int(guesses[best_j]) if best > 0 else 0, correct=int(tp[best_j]) if best > 0 else 0,
                        threshold=float(ts[best_j]), hypotheses=len(ts))
