"""CLI ergonomics a new user meets (issue 15 item 7): did-you-mean for unknown keys, blamed on
the flag or the file that gave them; --clipping help from the schema; runs named after their
data; --epochs with a plan line and a time estimate; --checkpoint-every."""

from __future__ import annotations

import json
import math
import re
import shutil
from typing import get_args

import pytest
from typer.testing import CliRunner

from dpft.cli import _name_run, app
from dpft.config import ClippingCfg, RecipeError, load_recipe, recipe_keys, suggest_key
from dpft.run.loop import Trainer


def _flat(text: str) -> str:
    """Help text without rich's box drawing and line wrapping."""
    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)


def _tiny_args(model_dir, *extra):
    return ["--model", str(model_dir), "--max-length", "16", "--batch-size", "12", "--max-physical-batch-size", "12",
            "--epsilon", "6", "--delta", "1e-3", "--eval-every", "100", "--lr", "1e-2", *extra]


# did you mean ----------------------------------------------------------------------------------

def test_unknown_set_key_blames_the_flag_with_a_suggestion(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nschedule:\n  steps: 3\n")
    r = CliRunner().invoke(app, ["train", str(recipe), "--set", "privacy.epsilon=3", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert ("--set privacy.epsilon=3: unknown key 'privacy.epsilon'; did you mean 'privacy.target_epsilon'?"
            in r.output)
    assert "mine.yaml" not in r.output  # the file is fine: the flag is at fault
    assert not (tmp_path / "o").exists()


def test_unknown_yaml_key_blames_the_file_with_a_suggestion(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("privacy:\n  epsilon: 3\nschedule:\n  stepz: 3\n")
    r = CliRunner().invoke(app, ["train", str(recipe), "--epsilon", "2", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert f"invalid recipe {recipe}" in r.output
    assert f"privacy.epsilon: unknown key in {recipe}; did you mean 'privacy.target_epsilon'?" in r.output
    assert "schedule.stepz: unknown key" in r.output and "did you mean 'schedule.steps'?" in r.output
    # API form: a bad override value names the override, a bad file value the file
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, {"optimizer.lr": -1.0}, {"optimizer.lr": "--lr -1.0"})
    assert "--lr -1.0: optimizer.lr: Input should be greater than 0" in str(e.value)


def test_suggestions_walk_nested_models():
    keys = recipe_keys()
    for k in ("privacy.clipping.style", "subspace.public_task.train_file", "trainable.lora.r", "checkpoint_every"):
        assert k in keys
    assert suggest_key("privacy.clip_norm") == "privacy.clipping.max_norm"
    assert suggest_key("optimizer.epochs") == "schedule.epochs"  # right field, wrong section
    assert suggest_key("epsilon") == "privacy.target_epsilon"
    assert suggest_key("checkpoint_evry") == "checkpoint_every"
    assert suggest_key("zzzz.qqq") is None


# help ------------------------------------------------------------------------------------------

def test_clipping_help_lists_every_style():
    styles = get_args(ClippingCfg.model_fields["style"].annotation)
    assert {"flat", "per_layer", "automatic", "head_body"} <= set(styles)
    r = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
    assert r.exit_code == 0
    line = re.search(r"--clipping .*?privacy\.clipping\.style:([^.]*)\.", _flat(r.output))
    assert line, r.output
    assert [s.strip() for s in line.group(1).split(",")] == list(styles)
    assert "--checkpoint-every" in r.output and "--epochs" in r.output


# names -----------------------------------------------------------------------------------------

def test_default_names():
    rec = load_recipe(None, {})
    _name_run(rec, {})
    assert rec.name == "sst2-minilm"
    rec = load_recipe(None, {"model.name": "/models/tinybert/", "task.name": "qnli"})
    _name_run(rec, {})
    assert rec.name == "qnli-tinybert"
    rec = load_recipe("recipes/sst2-minilm.yaml", {"task.train_file": "data/notes.csv"})
    _name_run(rec, {"task.train_file": "data/notes.csv"})
    assert rec.name == "notes"  # the data names the run, not the recipe it overrides
    rec = load_recipe("recipes/sst2-minilm.yaml", {"task.train_file": "notes.csv", "name": "mine"})
    _name_run(rec, {"task.train_file": "notes.csv", "name": "mine"})
    assert rec.name == "mine"


def test_user_file_run_is_named_after_the_file_and_epochs_give_the_steps(tiny_model_dir, sst_like_files,
                                                                          tmp_path, monkeypatch):
    """A recipe named sst2-minilm run on notes.csv: runs/notes; --epochs 2 over N examples at an
    expected batch of 12 is ⌈2N/12⌉ steps, announced before training with a time estimate."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(sst_like_files["csv"], tmp_path / "notes.csv")
    (tmp_path / "r.yaml").write_text("name: sst2-minilm\nschedule:\n  steps: 100\n")
    r = CliRunner().invoke(app, ["train", "r.yaml", "--train-file", "notes.csv", "--epochs", "2",
                                 *_tiny_args(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "notes"
    assert f"run directory: {run_dir.relative_to(tmp_path)}" in r.output
    rep = json.loads((run_dir / "report.json").read_text())
    n = rep["task"]["n_train"]
    steps = math.ceil(2 * n / 12)
    assert rep["dp"]["steps"] == steps
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == steps
    plan = next(x for x in r.output.splitlines() if x.startswith("plan: "))
    assert f"{steps} logical steps" in plan and "12 expected examples per step" in plan
    assert f"N = {n} training examples" in plan and "≈ 2 epochs" in plan
    assert re.search(rf"first step: [0-9.]+ s; about .+ for the {steps - 1} steps left", r.output)


def test_checkpoint_every_sets_the_cadence_and_quiet_is_quiet(tiny_model_dir, sst_like_files, tmp_path,
                                                              monkeypatch):
    saved = []
    real_save = Trainer.save

    def save(self, step):
        saved.append(step)
        real_save(self, step)

    monkeypatch.setattr(Trainer, "save", save)
    out = tmp_path / "ck"
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--steps", "5",
                                 "--checkpoint-every", "2", "--quiet", "-o", str(out),
                                 *_tiny_args(tiny_model_dir)])
    assert r.exit_code == 0, r.output
    assert saved == [2, 4, 5]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 5
    assert "checkpoint_every: 2" in (out / "recipe.yaml").read_text()
    assert "plan: " not in r.output and "first step" not in r.output
