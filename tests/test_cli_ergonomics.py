"""CLI ergonomics a new user meets (issue 15 item 7): did-you-mean for unknown keys, blamed on
the flag or the file that gave them; --clipping help from the schema; runs named after their
data; --epochs with a plan line and a time estimate; --checkpoint-every."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import get_args

import pytest
from typer.testing import CliRunner

from dpft.cli.commands import _name_run, app
from dpft.config.recipe import ClippingCfg, RecipeError, load_recipe, recipe_keys, suggest_key
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


# issue 24 item 6: rough edges a new user hit ------------------------------------------------------

def test_readme_own_instruction_data_command_keeps_the_instruct_task(tmp_path, monkeypatch):
    """The README's own-data instruction command (`--train-file … --set task.prompt_column=…`)
    used to switch the task to classification ("no text column 'text'")."""
    from conftest import ROOT, SHARED_DATA

    model = SHARED_DATA / "models" / "stories260K"
    if not model.is_dir():
        pytest.skip("stories260K not present")
    readme = (ROOT / "README.md").read_text()
    cmd = re.search(r"dpft train (recipes/e2e-instruct-stories260k\.yaml --train-file tickets\.jsonl.*?)#", readme,
                    re.S)
    assert cmd, "the README's own-data instruction command moved"
    args = [a for a in cmd.group(1).replace("\\\n", " ").split()]
    args[args.index("--model") + 1] = str(model)  # offline: the local tiny Llama instead of the hub's Qwen
    (tmp_path / "tickets.jsonl").write_text("".join(f'{{"question": "where is order {i}?", "answer": "it ships on '
                                                    f'day {i % 5}"}}\n' for i in range(24)))
    (tmp_path / "dev.jsonl").write_text("".join(f'{{"question": "q{i}", "answer": "a{i}"}}\n' for i in range(4)))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    r = CliRunner().invoke(app, ["train", *args, "--steps", "2", "--batch-size", "8", "--max-length", "32",
                                 "--set", "eval.max_new_tokens=2", "--quiet", "-o", "out"])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["task"]["name"] == "instruct" and rep["task"]["n_train"] == 24  # max_train_examples=null: all rows
    assert rep["metrics"]["dev_generated"] == 4


def _no_loading(monkeypatch):
    """Make any model or data loading fail the test: checks must come first."""
    import dpft.data.tasks as tasks
    import dpft.models.build as build

    def boom(*a, **k):
        raise AssertionError("loaded data or a model before the checks")

    # where the plan's builders load rows and models (data/prepare.py, models/build.py)
    monkeypatch.setattr(tasks, "load_task", boom)
    monkeypatch.setattr(build, "load_classifier", boom)
    monkeypatch.setattr(build, "load_causal_lm", boom)


def test_read_only_output_folder_is_refused_before_loading(tmp_path, monkeypatch, sst_like_files):
    import dpft.cli.commands as cli

    _no_loading(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, m: False if Path(p) == ro else real(p, m))  # root ignores 0o500
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(ro / "run")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"cannot write to the folder {ro} (where the output folder {ro / 'run'} would go): permission denied" \
        in _flat(r.output)
    # an OSError during the run (disk full, folder made read-only meanwhile): one line, no traceback
    monkeypatch.setattr(cli.os, "access", real)

    class Fails:
        def __init__(self, *a, **k):
            raise PermissionError(13, "Permission denied", str(tmp_path / "x" / "metrics.jsonl"))

    monkeypatch.setattr("dpft.run.loop.Trainer", Fails)
    # --steps and a scope: no auto (budget-aware B/T or the scope, which read the rows to count N before the Trainer)
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--steps", "3",
                                 "--trainable", "last_k", "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit)
    assert f"error: cannot write {tmp_path / 'x' / 'metrics.jsonl'}: Permission denied" in _flat(r.output)


def test_output_folder_and_delta_are_checked_before_the_model_is_loaded(tmp_path, monkeypatch, sst_like_files,
                                                                        tiny_model_dir):
    import dpft.models.build as build

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text("{}")
    _no_loading(monkeypatch)
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(out)])
    assert r.exit_code == 2 and "already holds a run; pass --resume" in r.output
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(tmp_path / "new"),
                                 "--resume"])
    assert r.exit_code == 2 and "--resume: no checkpoint in" in r.output
    monkeypatch.undo()
    loaded = []
    monkeypatch.setattr(build, "load_classifier", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(
        AssertionError("model loaded before the δ check")))
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--model", str(tiny_model_dir),
                                 "--delta", "0.1", "-o", str(tmp_path / "d")])
    assert r.exit_code == 2 and "δ = 0.1 is not below 1/N" in r.output and not loaded


def test_default_run_dirs_are_unique_without_a_double_suffix(tmp_path, monkeypatch):
    from dpft.cli.commands import _default_run_dir

    monkeypatch.chdir(tmp_path)
    assert _default_run_dir("notes", False, False) == (Path("runs/notes"), None)
    (tmp_path / "runs" / "notes").mkdir(parents=True)
    (tmp_path / "runs" / "notes" / "report.json").write_text("{}")
    assert _default_run_dir("notes", False, False) == (Path("runs/notes-2"), Path("runs/notes"))
    (tmp_path / "runs" / "notes-2" / "checkpoint").mkdir(parents=True)
    assert _default_run_dir("notes", False, False)[0] == Path("runs/notes-3")
    assert _default_run_dir("notes", False, True)[0] == Path("runs/notes-2")  # --resume: the latest with a run
    assert _default_run_dir("notes", True, False)[0] == Path("runs/notes-nodp")
    assert _default_run_dir("notes-nodp", True, False)[0] == Path("runs/notes-nodp")  # --name notes-nodp --no-dp
    # a folder an attempt left without a checkpoint (its ledger is carried) is reused
    (tmp_path / "runs" / "x").mkdir()
    (tmp_path / "runs" / "x" / "ledger.json").write_text("{}")
    assert _default_run_dir("x", False, False) == (Path("runs/x"), None)


def test_report_md_lists_only_files_present(tmp_path):
    from dpft.outputs.report import present_files
    from dpft.outputs.release import RELEASE_SET

    (tmp_path / "model").mkdir()
    (tmp_path / "ledger.json").write_text("{}")
    got = present_files(tmp_path, RELEASE_SET)
    assert set(got) == {"model/", "ledger.json", "report.json", "report.md"}


def _hf_folder(d: Path, steps: int = 30, target: float = 3.0) -> float:
    """A DPTrainer output_dir as integrations/hf/trainer.py writes it: ledger.json (live) and
    dp_state.json (save_model), a checkpoint-K/ with both and trainer_state.json."""
    from dpft.accounting.calibrate import dp_sgd_event
    from dpft.accounting.ledger import PrivacyLedger

    led = PrivacyLedger()
    led.record("train", dp_sgd_event(1.1, 0.05, 1), count=steps)
    d.mkdir(parents=True)
    led.save(d / "ledger.json")
    eps = led.epsilon(1e-5).epsilon
    state = {"sigma": 1.1, "q": 0.05, "n": 2000, "total_steps": steps, "global_step": steps, "ledger_steps": steps,
             "epsilon": eps, "accountant": "PLD (dp-accounting), add/remove-one",
             "dp_args": {"target_delta": 1e-5, "expected_batch_size": 100, "target_epsilon": target,
                         "noise_multiplier": None, "max_grad_norm": 1.0, "clipping": "flat", "engine": "bookkeeping",
                         "reproducible": False}}
    (d / "dp_state.json").write_text(json.dumps(state))
    ck = d / f"checkpoint-{steps}"
    ck.mkdir()
    (ck / "dp_state.json").write_text(json.dumps(state))
    led.save(ck / "ledger.json")
    (ck / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"eval_accuracy": 0.8125, "eval_loss": 0.44, "epsilon": eps, "step": steps}]}))
    return eps


def test_dpft_report_reads_a_dptrainer_output_folder(tmp_path):
    eps = _hf_folder(tmp_path / "hf")
    r = CliRunner().invoke(app, ["report", str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    assert f"**Privacy:** ε = {eps:.4g} at δ = 1e-05" in r.output and "exceeds" not in r.output
    assert "| noise multiplier σ | 1.1000 |" in r.output and "| steps | 30 (optimizer steps done: 30) |" in r.output
    assert "eval_accuracy 0.8125" in r.output and "| train | 30 |" in r.output
    # a folder of neither kind names both
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no report.json" in r.output and "DPTrainer" in r.output


def test_audit_takes_output_dir_like_train_and_fails_clearly_offline(tmp_path, monkeypatch):
    from conftest import ROOT

    from dpft.data import tasks

    r = CliRunner().invoke(app, ["audit", "--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
    assert "--output-dir" in r.output and "-o" in r.output and "--out" in r.output
    monkeypatch.delenv("DPFT_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tasks, "_PROJECT", tmp_path)  # no ../shared/data beside the project or here
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["audit", str(ROOT / "recipes" / "sst2-minilm.yaml"), "-o", str(tmp_path / "a")])
    assert r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit)
    assert "error: task sst2: no local task files" in r.output and "DPFT_DATA_DIR" in r.output
