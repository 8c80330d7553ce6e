"""Statistics of the audits: Clopper–Pearson bounds and the two ε̂ lower bounds.

* Hypothesis-testing ε̂ (Kairouz et al. 2015, Thm 2.1; Nasr et al. 2021, "Adversary
  instantiation: lower bounds for differentially private machine learning", Sec. 3): any test
  of an (ε, δ)-DP mechanism satisfies FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ, so

      ε̂ = max( log((1 − δ − FNR⁺)/FPR⁺), log((1 − δ − FPR⁺)/FNR⁺) )

  with FPR⁺, FNR⁺ one-sided Clopper–Pearson upper bounds at level 1 − α/2 each (union bound:
  joint confidence 1 − α).
* One-run ε̂ (Steinke, Nasr & Jagielski, NeurIPS 2023, "Privacy auditing with one (1)
  training run", Thm. 3.1 / Alg. 1 and their reference p-value code): with m canaries each
  included with probability ½, r guesses and v correct ones, under (ε, δ)-DP

      P[V ≥ v] ≤ P[Binom(r, p_ε) ≥ v] + 2mδ · max_{i ≥ 1} P[v > Binom(r, p_ε) ≥ v − i] / i,
      p_ε = e^ε/(1 + e^ε),

  and ε̂ is the largest ε whose p-value is below α.
"""

from __future__ import annotations

import math

from scipy import stats


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided (1 − α) Clopper–Pearson upper bound on a binomial rate with k successes of n."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, k + 1, n - k))


def eps_from_error_rates(fp: int, n0: int, fn: int, n1: int, delta: float, alpha: float = 0.05) -> float:
    """ε̂ of one fixed test: ``fp`` false positives of ``n0`` null trials and ``fn`` false
    negatives of ``n1`` canary trials (Clopper–Pearson at 1 − α/2 each, joint 1 − α). ≥ 0."""
    fpr = clopper_pearson_upper(fp, n0, alpha / 2)
    fnr = clopper_pearson_upper(fn, n1, alpha / 2)
    best = 0.0
    for num, den in ((1 - delta - fnr, fpr), (1 - delta - fpr, fnr)):
        if num > 0 and den > 0:
            best = max(best, math.log(num / den))
    return best


def eps_cap_game(n0: int, n1: int, delta: float, alpha: float = 0.05) -> float:
    """The largest ε̂ a game with n0 null / n1 canary trials can certify (a perfect test)."""
    return eps_from_error_rates(0, n0, 0, n1, delta, alpha)


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke et al. 2023, Thm. 3.1: P[≥ v correct of r guesses] under (ε, δ)-DP, m canaries."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-eps))
    beta = float(stats.binom.sf(v - 1, r, p))
    if delta <= 0 or v == 0:
        return min(1.0, beta)
    pmf = stats.binom.pmf(list(range(v - 1, -1, -1)), r, p)  # v-1, v-2, ..., 0
    acc, worst = 0.0, 0.0
    for i, x in enumerate(pmf, start=1):
        acc += float(x)
        worst = max(worst, acc / i)
    return min(1.0, beta + 2 * m * delta * worst)


def one_run_epsilon(m: int, r: int, v: int, delta: float, alpha: float = 0.05) -> float:
    """Largest ε with p-value < α (Steinke et al. 2023), by bisection; 0 if none."""
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < alpha and hi < 64:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) < alpha:
            lo = mid
        else:
            hi = mid
    return lo
