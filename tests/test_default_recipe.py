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
    assert rec.trainable.mode == "last_k" and rec.trainable.last_k == 2
    assert rec.privacy.clipping.style == "head_body" and rec.privacy.clipping.head_fraction == 0.5
    # no batch or steps flag: (B, T) chosen by the accountant (issue 35), the recipe's lr 3e-4 at B = 256
    # scaled by the square-root rule (accounting/budget.py)
    assert "auto: B = " in r.output and isinstance(rec.batch.expected_batch_size, int)
    assert rec.optimizer.lr == pytest.approx(3e-4 * (rec.batch.expected_batch_size / 256) ** 0.5)
    assert rec.optimizer.head_lr == 1e-2
    assert rec.model.pooling == "mean" and rec.model.dropout == 0.0
    assert rec.task.name == "files"


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
