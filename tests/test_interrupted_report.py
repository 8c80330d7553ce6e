"""``dpft report`` on a ``dpft train`` run stopped before its report (issue 36 item 6): it is a
dpft train run, and its ε is the one its ledger certifies (it used to be read as "a DPTrainer
run … ε: NOT CERTIFIED")."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dpft.accounting.calibrate import dp_sgd_event
from dpft.accounting.ledger import PrivacyLedger
from dpft.cli.commands import app


def _interrupted(d, with_checkpoint=True):
    led = PrivacyLedger()
    led.record("train", dp_sgd_event(1.1, 0.2, 1), count=6)
    d.mkdir(parents=True)
    led.save(d / "ledger.json")
    recipe = {"name": "notes", "privacy": {"enabled": True, "delta": 1e-3, "target_epsilon": 6.0,
                                           "noise_multiplier": None}}
    (d / "recipe.yaml").write_text("name: notes\nprivacy:\n  delta: 0.001\n  target_epsilon: 6.0\n")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 4, "lr": 0.01, "dev_accuracy": 0.625, "epsilon": 2.0}) + "\n")
    if with_checkpoint:
        (d / "checkpoint").mkdir()
        (d / "checkpoint" / "state.json").write_text(json.dumps(
            {"step": 4, "total_steps": 12, "sigma": 1.1, "q": 0.2, "n": 60, "recipe": recipe, "replays": []}))
    return led.epsilon(1e-3).epsilon


def test_report_of_an_interrupted_train_run_gives_its_certified_epsilon(tmp_path):
    eps = _interrupted(tmp_path / "run")
    r = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "# dpft train run: notes — not finished (no report.json)" in r.output
    assert f"**Privacy (spent so far):** ε = {eps:.4g} at δ = 0.001" in r.output
    assert "DPTrainer" not in r.output and "NOT CERTIFIED" not in r.output
    assert "checkpoint at step 4 of 12; its ledger holds 6 training releases" in r.output
    assert f"--output-dir {tmp_path / 'run'} --resume" in r.output
    assert "| steps | 6 released (ledger), 12 planned (checkpoint at step 4) |" in r.output
    assert "dev_accuracy 0.625" in r.output
    # stopped before its first checkpoint: δ from recipe.yaml
    eps2 = _interrupted(tmp_path / "early", with_checkpoint=False)
    r = CliRunner().invoke(app, ["report", str(tmp_path / "early")])
    assert r.exit_code == 0 and f"ε = {eps2:.4g} at δ = 0.001" in r.output and "no checkpoint yet" in r.output


def test_resume_of_a_finished_run_is_refused_before_loading_and_rewrites_nothing(tmp_path, monkeypatch,
                                                                                   sst_like_files):
    """Old: --resume on a finished run evaluated the test set a second time and rewrote the
    release files (report, model card, model)."""
    import dpft.data.tasks as tasks
    import dpft.models.build as build

    def boom(*a, **k):
        raise AssertionError("loaded data or a model")

    monkeypatch.setattr(tasks, "load_task", boom)
    monkeypatch.setattr(build, "load_classifier", boom)
    d = tmp_path / "run"
    _interrupted(d)
    st = json.loads((d / "checkpoint" / "state.json").read_text())
    st["step"] = 12
    (d / "checkpoint" / "state.json").write_text(json.dumps(st))
    (d / "report.json").write_text("{}")
    before = {p.name: p.stat().st_mtime_ns for p in d.rglob("*")}
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(d), "--resume"])
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert (f"error: --resume: the run in {d} is finished (step 12 of 12, report.json written); nothing to resume and "
            f"nothing was rewritten. Its report: dpft report {d}") in flat
    assert {p.name: p.stat().st_mtime_ns for p in d.rglob("*")} == before
    # the same folder stopped at its last step but before its report: --resume still writes them
    (d / "report.json").unlink()
    from dpft.outputs.rundir import check_output_dir

    check_output_dir(d, resume=True)
