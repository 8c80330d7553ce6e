"""``benchmarks/_experiment.py`` ``paired_row_losses``: the paired test of a per-row dev loss
(generation tasks; ``benchmarks/banded_mf_e2e.py``). Milliseconds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exp():
    spec = importlib.util.spec_from_file_location("_experiment_under_test", ROOT / "benchmarks" / "_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_experiment_under_test"] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("_experiment_under_test", None)


def test_token_weighted_differences_and_tests(exp):
    rng = np.random.default_rng(0)
    pairs, want = [], []
    for _ in range(3):
        tokens = rng.integers(5, 40, size=200)
        base = rng.uniform(1.0, 3.0, size=200)
        a = {i: (float((base[i] - 0.1 + rng.normal(0, 0.01)) * tokens[i]), int(tokens[i])) for i in range(200)}
        b = {i: (float(base[i] * tokens[i]), int(tokens[i])) for i in range(200)}
        pairs.append((a, b))
        want.append(sum(v[0] for v in a.values()) / tokens.sum() - sum(v[0] for v in b.values()) / tokens.sum())
    st = exp.paired_row_losses(pairs, n_boot=500)
    assert st["seed_pairs"] == 3
    assert np.allclose(st["per_seed"], want)
    assert st["lo"] <= st["pooled"] <= st["hi"] < 0  # A is better by ~0.1 nats/token on every row
    assert abs(st["pooled"] + 0.1) < 0.01
    assert st["wilcoxon_p"] < 1e-10 and st["t_p"] < 0.01


def test_no_difference_is_not_significant(exp):
    rng = np.random.default_rng(1)
    a = {i: (float(rng.uniform(10, 50)), 20) for i in range(300)}
    b = {i: (v + float(rng.normal(0, 2)), n) for i, (v, n) in a.items()}
    st = exp.paired_row_losses([(a, b), (b, a)], n_boot=500)
    assert st["lo"] < 0 < st["hi"] and st["wilcoxon_p"] > 0.05


def test_different_rows_are_refused(exp):
    from dpft.eval.paired import PairedError

    with pytest.raises(PairedError, match="different dev rows"):
        exp.paired_row_losses([({0: (1.0, 1), 1: (1.0, 1)}, {0: (1.0, 1), 2: (1.0, 1)})])
