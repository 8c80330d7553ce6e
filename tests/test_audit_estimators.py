"""The one-run ε̂ estimators (audit/estimators.py, issue 37): known values, monotonicity, chance
level, and equality with jax_privacy's ``auditing.py`` on the same scores."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dpft.audit.estimators import (epsilon_lower_bound, fdp_epsilon, hull_counts, steinke_epsilon,
                                   steinke_p_value)
from dpft.audit.stats import one_run_p_value


def _deterministic_normal(mu: float, n: int) -> np.ndarray:
    """n scores at the quantiles (i + ½)/n of N(mu, 1): the inputs of jax_privacy's own test."""
    return stats.norm.ppf((np.arange(n) + 0.5) / n) + mu


# jax_privacy tests/auditing_test.py ``test_epsilon_one_run_close`` (commit 8967688c): n = 10,000 in
# and out canaries, significance 0.05, δ = 1e-6, Bonferroni thresholds — their expected values.
@pytest.mark.parametrize("method,shift,expected", [
    ("steinke", 0, 0.0), ("fdp", 0, 0.0), ("steinke", 1, 1.13346), ("fdp", 1, 2.164749),
    ("steinke", 4, 4.395568), ("fdp", 4, 9.133752)])
def test_matches_jax_privacy_published_values(method, shift, expected):
    b = epsilon_lower_bound(_deterministic_normal(shift, 10_000), _deterministic_normal(0, 10_000),
                            delta=1e-6, method=method, confidence=0.95)
    assert b.epsilon == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert b.confidence == 0.95 and b.m == 20_000


def _scores(seed, n_in, n_out, shift, ties):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(shift, 1, n_in), rng.normal(0, 1, n_out)
    if ties:
        a, b = np.round(a * 2) / 2, np.round(b * 2) / 2
    return a, b


# Values returned by jax_privacy's ``CanaryScoreAuditor(a, b).epsilon_one_run(0.05, δ)`` and
# ``.epsilon_one_run_fdp(0.05, δ)`` (auditing.py at commit 8967688c, loaded from its file: it needs
# only numpy, scipy and dp_accounting) on the scores of ``_scores`` — ties included, unequal in/out.
JAX_CASES = [
    (1, 200, 200, 1.0, False, 1e-05, 1.076599, 1.560573),
    (2, 200, 200, 2.5, True, 1e-05, 2.341156, 3.614462),
    (3, 50, 150, 3.0, False, 0.001, 0.0, 2.121311),
    (4, 300, 100, 0.5, True, 1e-05, 1.530261, 2.278155),
    (5, 100, 100, 0.0, False, 1e-05, 0.0, 0.0),
    (6, 250, 250, 4.0, True, 0.01, 0.0, 3.382443),
]


@pytest.mark.parametrize("case", JAX_CASES, ids=[f"seed{c[0]}" for c in JAX_CASES])
def test_matches_jax_privacy_on_same_scores(case):
    seed, n_in, n_out, shift, ties, delta, jax_steinke, jax_fdp = case
    a, b = _scores(seed, n_in, n_out, shift, ties)
    assert epsilon_lower_bound(a, b, delta=delta, method="steinke").epsilon == pytest.approx(jax_steinke, abs=2e-6)
    assert epsilon_lower_bound(a, b, delta=delta, method="fdp").epsilon == pytest.approx(jax_fdp, abs=2e-6)


def test_against_jax_privacy_when_installed():
    auditing = pytest.importorskip("jax_privacy.auditing")
    for seed in range(5):
        a, b = _scores(seed, 150, 150, 0.8 * seed, seed % 2 == 0)
        aud = auditing.CanaryScoreAuditor(a, b)
        assert epsilon_lower_bound(a, b, delta=1e-5, method="steinke").epsilon == pytest.approx(
            aud.epsilon_one_run(0.05, 1e-5), abs=2e-6)
        assert epsilon_lower_bound(a, b, delta=1e-5, method="fdp").epsilon == pytest.approx(
            aud.epsilon_one_run_fdp(0.05, 1e-5), abs=2e-6)


def test_p_value_agrees_with_the_audit_module_and_brute_force():
    for m, r, v, eps, delta in [(100, 20, 15, 0.5, 1e-3), (1000, 100, 90, 1.0, 1e-5), (50, 10, 10, 2.0, 0.0)]:
        p = steinke_p_value(m, r, v, eps, delta)
        assert p == pytest.approx(one_run_p_value(m, r, v, eps, delta), rel=1e-9)
        q = 1 / (1 + np.exp(-eps))
        worst = max(sum(stats.binom.pmf(v - j, r, q) for j in range(1, i + 1)) / i for i in range(1, v + 1))
        assert p == pytest.approx(min(1.0, stats.binom.sf(v - 1, r, q) + 2 * m * delta * worst), rel=1e-9)


@pytest.mark.parametrize("fn", [steinke_epsilon, fdp_epsilon])
def test_monotone_in_correct_guesses_and_zero_at_chance(fn):
    m, r = 1000, 100
    eps = [fn(m, r, v, 0.05, 1e-5) for v in range(50, 101, 5)]
    assert all(b >= a - 1e-9 for a, b in zip(eps, eps[1:])) and eps[-1] > eps[0]
    assert fn(m, r, 50, 0.05, 1e-5) == 0.0  # half right: chance, no evidence
    assert fn(m, 0, 0, 0.05, 1e-5) == 0.0


def test_bound_is_the_largest_rejected_epsilon():
    m, r, v, alpha, delta = 1000, 200, 180, 0.05, 1e-5
    e = steinke_epsilon(m, r, v, alpha, delta)
    assert steinke_p_value(m, r, v, e - 1e-3, delta) < alpha < steinke_p_value(m, r, v, e + 1e-3, delta)


def test_fdp_is_at_least_steinke_and_grows_with_m_guessed():
    # the f-DP test uses the whole Gaussian curve: never weaker on the same counts here
    for r, v in [(100, 90), (400, 330), (40, 40)]:
        assert fdp_epsilon(1000, r, v, 0.05, 1e-5) >= steinke_epsilon(1000, r, v, 0.05, 1e-5) - 1e-6


def test_separated_scores_give_large_bound_random_ones_do_not():
    rng = np.random.default_rng(0)
    sep = epsilon_lower_bound(rng.normal(10, 1, 500), rng.normal(0, 1, 500), delta=1e-5)
    assert sep.epsilon > 4 and sep.guesses >= sep.correct > 0
    null = [epsilon_lower_bound(*np.split(rng.normal(0, 1, 400), 2), delta=1e-5).epsilon for _ in range(10)]
    assert max(null) < 0.5  # 95 % bounds: a false ε̂ > 0 is rare, and then small


def test_hull_keeps_the_extremes_and_bad_input_is_refused():
    ts, tp, fp = hull_counts([1.0, 2.0, 3.0], [0.0, 1.0])
    assert ts[-1] == np.inf and tp[-1] == 0 and fp[-1] == 0 and tp[0] == 3 and fp[0] == 2
    with pytest.raises(ValueError, match="non-empty"):
        epsilon_lower_bound([], [1.0], delta=1e-5)
    with pytest.raises(ValueError, match="unknown estimator"):
        epsilon_lower_bound([1.0], [0.0], delta=1e-5, method="magic")
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound([1.0], [0.0], delta=1e-5, confidence=1.0)
