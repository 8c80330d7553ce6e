"""``dpft train`` with data flags only (issue 36 item 7): the task's tuned recipe, not full
fine-tuning with flat clipping and one learning rate (which ends at the majority class)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dpft.cli.commands import app
from dpft.errors import TrainingError


@pytest.fixture()
def captured(monkeypatch):
    seen = {}

    class Stop:
        def __init__(self, rec, *a, **k):
            seen["recipe"] = rec
            raise TrainingError("stopped by the test before loading")

    monkeypatch.setattr("dpft.run.loop.Trainer", Stop)
    return seen


def test_data_flags_only_give_the_tuned_classification_recipe(tmp_path, sst_like_files, captured):
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "stopped by the test" in r.output, r.output
    assert "no recipe: the tuned classification defaults of recipes/sst2-minilm.yaml" in " ".join(r.output.split())
    rec = captured["recipe"]
    # trainable.mode: auto (issue 45 item 4): 60 rows is a probe's size (run/scope.py), said on the screen
    out = " ".join(r.output.split())
    assert "trainable scope (auto): head" in out and "N = 54 ≤ 10000" in out  # 60 rows, 10% held out for dev
    assert rec.trainable.mode == "head" and rec.privacy.clipping.style == "flat"
    assert rec.batch.expected_batch_size == 14 and rec.schedule.epochs == 25 and rec.schedule.steps is None
    assert rec.optimizer.lr == 0.02 and rec.optimizer.head_lr is None
    assert rec.model.pooling == "mean" and rec.model.dropout == 0.0
    assert rec.task.name == "files"


@pytest.fixture()
def big_csv(tmp_path):
    """20,001 labelled rows (and themselves as the dev file): above the probe's size (run/scope.py)."""
    import pandas as pd

    f = tmp_path / "big.csv"
    pd.DataFrame({"text": [f"row {i}" for i in range(20_001)], "label": [i % 2 for i in range(20_001)]}).to_csv(
        f, index=False)
    return f


def test_data_flags_only_at_large_n_train_the_top_blocks(tmp_path, captured, big_csv):
    """Above 20,000 rows auto keeps the top 2 blocks, head_body clipping and (B, T) from the accountant."""
    f = big_csv
    r = CliRunner().invoke(app, ["train", "--train-file", str(f), "--dev-file", str(f), "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "stopped by the test" in r.output, r.output
    rec = captured["recipe"]
    assert "trainable scope (auto): last_k" in " ".join(r.output.split())
    assert rec.trainable.mode == "last_k" and rec.trainable.last_k == 2
    assert rec.privacy.clipping.style == "head_body" and rec.privacy.clipping.head_fraction == 0.5
    # no batch or steps flag: (B, T) chosen by the accountant (issue 35), the recipe's lr 3e-4 at B = 256
    # scaled by the square-root rule (accounting/budget.py)
    assert "auto: B = " in r.output and isinstance(rec.batch.expected_batch_size, int)
    assert rec.optimizer.lr == pytest.approx(3e-4 * (rec.batch.expected_batch_size / 256) ** 0.5)
    assert rec.optimizer.head_lr == 1e-2


def test_flags_override_the_default_recipe(tmp_path, sst_like_files, captured):
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--trainable", "full",
                                 "--clipping", "flat", "--lr", "1e-3", "--quiet", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no recipe" not in r.output
    rec = captured["recipe"]
    assert rec.trainable.mode == "full" and rec.privacy.clipping.style == "flat" and rec.optimizer.lr == 1e-3


def test_instruct_without_a_recipe_uses_lora_on_the_models_linear_layers(tmp_path, captured):
    from conftest import SHARED_DATA

    model = SHARED_DATA / "models" / "stories260K"
    if not model.is_dir():
        pytest.skip("stories260K not present")
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "a", "completion": "b"}\n')
    r = CliRunner().invoke(app, ["train", "--task", "instruct", "--train-file", str(f), "--model", str(model),
                                 "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "stopped by the test" in r.output, r.output
    rec = captured["recipe"]
    assert rec.trainable.mode == "lora" and rec.trainable.lora.target_modules[:2] == ["q_proj", "k_proj"]
    assert rec.privacy.clipping.style == "flat" and rec.optimizer.lr == 1e-2
    assert rec.schedule.epochs == 1.0 and rec.schedule.steps is None and rec.batch.expected_batch_size == 128
    # a recipe file is taken as it is
    (tmp_path / "r.yaml").write_text("name: mine\n")
    r = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml"), "--train-file", str(tmp_path / "t.jsonl"),
                                 "-o", str(tmp_path / "o2")])
    assert captured["recipe"].trainable.mode == "full"


@pytest.mark.parametrize("eps", [None, 3.0])
def test_no_dp_without_a_recipe_is_the_reference_of_the_private_run(tmp_path, big_csv, captured, eps):
    """``dpft train --no-dp`` with data flags only (issue 44 item 9): was refused ("batch/steps auto choose (B, T)
    for a target ε"); now the same command's auto choice at its nominal ε (the default recipe's 8, or
    ``--epsilon``) — the same B, T and scaled learning rate — without noise, and it says so."""
    flags = ["train", "--train-file", str(big_csv), "--dev-file", str(big_csv)] + (["--epsilon", str(eps)] if eps else [])
    r = CliRunner().invoke(app, flags + ["-o", str(tmp_path / "dp")])
    assert r.exit_code == 2 and "stopped by the test" in r.output, r.output
    dp = captured["recipe"]
    r = CliRunner().invoke(app, flags + ["--no-dp", "-o", str(tmp_path / "nodp")])
    assert r.exit_code == 2 and "stopped by the test" in r.output, r.output
    ref = captured["recipe"]
    assert dp.privacy.enabled and not ref.privacy.enabled
    b, t, lr = dp.batch.expected_batch_size, dp.schedule.steps, dp.optimizer.lr
    assert isinstance(b, int) and isinstance(t, int) and lr != 3e-4  # an auto choice, the lr scaled with B
    assert (ref.batch.expected_batch_size, ref.schedule.steps, ref.optimizer.lr) == (b, t, lr)
    assert ref.optimizer.head_lr == dp.optimizer.head_lr and ref.trainable.mode == dp.trainable.mode
    said = " ".join(r.output.split())
    assert (f"non-private reference of the run dpft train would make at ε = {eps or 8.0:g}: B = {b}, T = {t}, "
            f"lr = {lr:.3g}") in said, said


def test_no_dp_auto_without_a_target_is_still_refused(tmp_path, big_csv, captured):
    """Nothing to take the choice at (``privacy.target_epsilon: null``): refused, naming the fix (at a probe's
    size the scope's own B and epochs need no ε: test_no_dp_at_a_probes_size_is_the_same_probe)."""
    r = CliRunner().invoke(app, ["train", "--train-file", str(big_csv), "--dev-file", str(big_csv), "--no-dp", "--set",
                                 "privacy.target_epsilon=null", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "stopped by the test" not in r.output
    assert "set privacy.target_epsilon" in " ".join(r.output.split()), r.output


def test_no_dp_at_a_probes_size_is_the_same_probe(tmp_path, sst_like_files, captured):
    """At N ≤ 20,000 ``--no-dp`` without a recipe is the same probe (scope, B, epochs, lr) without noise."""
    flags = ["train", "--train-file", str(sst_like_files["csv"])]
    CliRunner().invoke(app, flags + ["-o", str(tmp_path / "dp")])
    dp = captured["recipe"]
    r = CliRunner().invoke(app, flags + ["--no-dp", "-o", str(tmp_path / "nodp")])
    ref = captured["recipe"]
    assert "trainable scope (auto): head" in " ".join(r.output.split())
    assert dp.privacy.enabled and not ref.privacy.enabled and ref.trainable.mode == dp.trainable.mode == "head"
    assert (ref.batch.expected_batch_size, ref.schedule.epochs, ref.optimizer.lr) == (
        dp.batch.expected_batch_size, dp.schedule.epochs, dp.optimizer.lr)
