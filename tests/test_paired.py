"""Paired evaluation tools (dpft.eval.paired) against known values, and eval.save_predictions."""

import json
import math

import pytest

from dpft.eval.paired import (PairedError, compare_runs, load_correct, mcnemar_exact, pair, paired_bootstrap,
                              write_predictions)


def _bits(b, c, both_right=5, both_wrong=3):
    a = [True] * b + [False] * c + [True] * both_right + [False] * both_wrong
    bb = [False] * b + [True] * c + [True] * both_right + [False] * both_wrong
    return a, bb


def test_mcnemar_exact_by_hand():
    # b = 1, c = 5: p = 2·(C(6,0) + C(6,1))/2⁶ = 2·7/64
    a, b = _bits(1, 5)
    r = mcnemar_exact(a, b)
    assert (r["b"], r["c"], r["n"]) == (1, 5, 14)
    assert r["p_value"] == pytest.approx(14 / 64, abs=1e-15)
    assert mcnemar_exact(*_bits(0, 0))["p_value"] == 1.0
    assert mcnemar_exact(*_bits(3, 3))["p_value"] == 1.0  # symmetric: capped at 1


@pytest.mark.parametrize("b,c", [(7, 19), (40, 61), (200, 150)])
def test_mcnemar_exact_matches_scipy_binomtest(b, c):
    scipy_stats = pytest.importorskip("scipy.stats")
    ref = scipy_stats.binomtest(b, b + c, 0.5, alternative="two-sided").pvalue
    assert mcnemar_exact(*_bits(b, c))["p_value"] == pytest.approx(ref, rel=1e-9)


def test_paired_bootstrap_ci_brackets_the_difference_and_matches_normal_width():
    a, b = _bits(30, 10, both_right=400, both_wrong=60)
    r = paired_bootstrap(a, b, n_boot=4000, seed=1)
    n = len(a)
    assert r["diff"] == pytest.approx(20 / n)
    assert r["lo"] < r["diff"] < r["hi"]
    # normal approximation of the paired difference: sd of d_i / √n
    mean = 20 / n
    sd = math.sqrt((40 / n) - mean ** 2) / math.sqrt(n)
    assert (r["hi"] - r["lo"]) == pytest.approx(2 * 1.96 * sd, rel=0.1)
    assert paired_bootstrap(a, a)["lo"] == paired_bootstrap(a, a)["hi"] == 0.0


def test_files_pairing_and_errors(tmp_path):
    write_predictions(tmp_path / "a.jsonl", [{"index": i, "prediction": 1, "correct": i % 2 == 0} for i in range(6)])
    write_predictions(tmp_path / "b.jsonl", [{"index": i, "prediction": 0, "correct": True} for i in range(6)])
    assert load_correct(tmp_path / "a.jsonl") == {i: i % 2 == 0 for i in range(6)}
    r = compare_runs(tmp_path / "a.jsonl", tmp_path / "b.jsonl", n_boot=100)
    assert r["acc_a"] == 0.5 and r["acc_b"] == 1.0 and r["mcnemar"]["c"] == 3 and r["mcnemar"]["b"] == 0
    with pytest.raises(PairedError, match="different dev examples"):
        pair({0: True, 1: False}, {0: True})
    with pytest.raises(PairedError, match="save_predictions"):
        load_correct(tmp_path / "missing")


def test_trainer_writes_dev_predictions(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.config.recipe import load_recipe
    from dpft.run.loop import Trainer

    rec = load_recipe(None, {"model.name": str(tiny_model_dir), "model.max_length": 16, "task.name": "files",
                             "task.train_file": str(sst_like_files["csv"]), "batch.expected_batch_size": 8,
                             "schedule.steps": 1, "eval.every_steps": 1, "checkpoint_every": 1,
                             "privacy.enabled": False, "eval.save_predictions": True})
    t = Trainer(rec, tmp_path / "r", progress=False)
    rep = t.run()
    rows = [json.loads(x) for x in (tmp_path / "r" / "dev_predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(t.dev_tok)))
    assert sum(r["correct"] for r in rows) / len(rows) == pytest.approx(rep["metrics"]["dev_accuracy"])
