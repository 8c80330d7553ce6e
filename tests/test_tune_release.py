"""A search releases only its release (issue 44 item 1): silent trials, one tracker record, no per-trial
line on the screen; the search's lock and ledger (item 3); reproducible mode labelled (item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_tune import tune_recipe


class StubTracker:
    """Stands in for run/tracking.py ``Trackers``: records every run opened and every row logged."""

    opened: list = []
    rows: list = []

    def __init__(self, names, run_dir, run_name, config):
        StubTracker.opened.append({"names": list(names), "run_dir": str(run_dir), "config": config})

    def log(self, row, step=None):
        StubTracker.rows.append(dict(row))

    def close(self):
        pass


def _quick(model_dir, files, **extra):
    return tune_recipe(model_dir, files, **{"schedule.steps": 1, **extra})


def test_trial_recipe_has_no_outputs_of_its_own(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run import tune as T

    rec = _quick(tiny_model_dir, sst_like_files, **{"log.report_to": ["tensorboard"], "eval.every_steps": 1,
                                                     "task.test_file": str(sst_like_files["csv"])})
    t = T._trial_recipe(rec, {"optimizer.lr": 0.01}, 1.0, tmp_path / "f.jsonl", tmp_path / "s.jsonl", False,
                        ["0", "1"])
    assert t.log.report_to == [] and not t.log.private_diagnostics
    assert t.eval.every_steps == T.NEVER and not t.eval.save_predictions and t.task.test_file is None
    for key, word in (("eval.save_predictions", "save_predictions"), ("log.private_diagnostics", "diagnostics")):
        with pytest.raises(T.TuneError, match=word):
            T.check_tune_recipe(_quick(tiny_model_dir, sst_like_files, **{key: True}))


@pytest.mark.slow  # ~20 s alone on 2 cores (74 s under a load of 14)
def test_search_releases_one_record_and_prints_no_trial(tiny_model_dir, sst_like_files, tmp_path, monkeypatch, capfd):
    """With a tracker configured, exactly ONE record (the search's ε, the chosen hyperparameters, the noisy
    score) reaches it; stdout/stderr carry no trial's hyperparameters, σ or accuracy, and no trial bar."""
    from dpft.run import loop, timing, tracking
    from dpft.run import tune as T

    fixed = timing.StepTiming(micro_batch_seconds=0.5, update_seconds=0.0, checkpoint_seconds=0.0,
                              checkpoints_per_step=0.0, eval_row_seconds=0.0, setup_seconds=1.0, physical=8, length=16)
    monkeypatch.setattr(timing, "probe_step_time", lambda r, k, **kw: fixed)  # the probe is timed elsewhere
    StubTracker.opened, StubTracker.rows = [], []
    monkeypatch.setattr(tracking, "Trackers", StubTracker)
    if hasattr(loop, "Trackers"):
        monkeypatch.setattr(loop, "Trackers", StubTracker)
    rec = _quick(tiny_model_dir, sst_like_files, **{"log.report_to": ["tensorboard"], "eval.every_steps": 1,
                                                     "task.test_file": str(sst_like_files["jsonl"])})
    out = tmp_path / "t"
    rep = T.tune(rec, out, progress=True, keep_trials=True)
    seen = capfd.readouterr()
    text = seen.out + seen.err
    state = json.loads((out / "tune_private" / "state.json").read_text())
    assert len(StubTracker.opened) == 1 and len(StubTracker.rows) == 1, (StubTracker.opened, StubTracker.rows)
    row, cfg = StubTracker.rows[0], StubTracker.opened[0]["config"]
    assert row["epsilon"] == pytest.approx(rep["epsilon"]) and row["noisy_score"] == rep["chosen"]["noisy_score"]
    assert cfg["chosen"] == rep["chosen"]["hyperparameters"]
    assert "dev_acc" not in text and "trial 1" not in text and "σ =" not in text
    assert "law of K" in text and "estimated time" in text  # before the first trial; K itself is not shown
    for t in state["trials"]:
        correct = t["correct"]
        assert f"correct {correct}" not in text
        if t["hyperparameters"] != rep["chosen"]["hyperparameters"]:
            assert repr(t["hyperparameters"]["optimizer.lr"])[:8] not in text
    # the released model on the test file, once
    assert rep["test"]["n"] == 60 and 0.0 <= rep["test"]["test_accuracy"] <= 1.0
    assert "test accuracy" in T.summary(rep)
    # a trial folder holds no tracker output and no test score of its own
    for t in state["trials"]:
        tdir = out / "tune_private" / f"trial_{t['index']}"
        assert not (tdir / "tensorboard").exists()
        assert not json.loads((tdir / "report.json").read_text()).get("test")


def test_second_search_into_a_live_folder_is_refused(tmp_path):
    """Another process holds the search folder (a live ``dpft tune``): a resume is refused naming it."""
    import subprocess
    import sys

    from dpft.config.recipe import Recipe
    from dpft.errors import RunLockError
    from dpft.run import tune as T

    run = tmp_path / "run"
    code = ("import sys, time; from dpft.outputs.lock import RunLock; RunLock.for_dir(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        r = Recipe.model_validate({"privacy": {"target_epsilon": 8.0}, "tune": {"trials": {"mean": 3.0}}})
        with pytest.raises(RunLockError, match=f"pid {p.pid}"):
            T.tune(r, run, resume=True, progress=False)
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow  # two tiny trials and a resume: 61 s on 2 cores under a load of 7
def test_search_killed_between_score_and_state_resumes_to_the_same_release(tiny_model_dir, sst_like_files, tmp_path,
                                                                           monkeypatch):
    """Issue 44 item 3, end to end: the search dies after a trial's noisy score is formed (its score event in
    the trial's ledger) and before ``state.json`` records it. The resume forms the SAME score (the kept
    noise), the trial's ledger holds ONE score event, and the search's ε stays ≤ its target (nothing
    composed on top: the review's black-box run had ended at ε 4.256 for a target of 2)."""
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.run import tune as T
    from dpft.run.loop import Trainer

    rec = _quick(tiny_model_dir, sst_like_files)
    out = tmp_path / "t"
    real_save, seen = T._save_state, {}

    def crash_once(path, state):
        scored = [t for t in state["trials"] if t.get("score") is not None]
        if scored and not seen:  # the first write that would record a formed score: die before it
            seen.update(index=scored[0]["index"], score=scored[0]["score"])
            raise KeyboardInterrupt
        return real_save(path, state)

    monkeypatch.setattr(T, "_save_state", crash_once)
    with pytest.raises(KeyboardInterrupt):
        T.tune(rec, out, progress=False)
    priv = out / "tune_private"
    before = json.loads((priv / "state.json").read_text())
    crashed = [t for t in before["trials"] if t["index"] == seen["index"]][0]
    assert crashed["correct"] is not None and crashed.get("score") is None  # the state never saw the score
    tled = PrivacyLedger.load(priv / f"trial_{seen['index']}" / "ledger.json")
    assert [e.phase for e in tled.entries].count("score") == 1  # the release happened before the crash
    monkeypatch.setattr(T, "_save_state", real_save)
    runs = {"n": 0}
    real_run = Trainer.run

    def counted(self):
        runs["n"] += 1
        return real_run(self)

    monkeypatch.setattr(Trainer, "run", counted)
    rep = T.tune(rec, out, resume=True, progress=False, keep_trials=True)
    after = json.loads((priv / "state.json").read_text())
    again = [t for t in after["trials"] if t["index"] == seen["index"]][0]
    assert again["score"] == seen["score"]  # the same count + the same kept noise: the same release
    assert runs["n"] == after["k"] - 1  # the crashed trial is not trained again
    tled = PrivacyLedger.load(priv / f"trial_{seen['index']}" / "ledger.json")
    assert [e.phase for e in tled.entries].count("score") == 1
    score_event = {"type": "GaussianDpEvent", "noise_multiplier": after["score_sigma"]}
    assert sum(e == score_event for e in again["events"]) == 1  # what the search composes: one score release
    led = json.loads((out / "ledger.json").read_text())
    assert [e["phase"] for e in led["entries"]] == [f"tune:{after['search_id']}"]  # no trial composed on top
    eps = PrivacyLedger.load(out / "ledger.json").epsilon(rec.privacy.delta).epsilon
    assert eps <= rec.privacy.target_epsilon and rep["epsilon"] == pytest.approx(eps)


@pytest.mark.slow  # two tiny searches: 74 s on 2 cores under a load of 7
def test_audit_catches_a_trial_that_prints_its_numbers():
    """``dpft audit``'s screen check (audit/checks_tune_release.py): a tiny search's captured stdout/stderr
    name no trial's hyperparameters, σ, count or score; planted ``trial_prints`` is caught."""
    from dpft.audit import checks_tune as C
    from dpft.audit import planted, suite
    from dpft.audit import checks_tune_release as R

    assert "trial_prints" in R.RELEASE_PLANTED and "trial_prints" in C.PLANTED and "trial_prints" in planted.ALL
    assert ("dpft.audit.checks_tune", "tune_checks", C.PLANTED) in suite.OPTIONAL_CHECKS
    clean = R._screen_silent(None)
    assert clean.passed and clean.message.endswith("on the screen: none"), clean.row()
    bad = R._screen_silent("trial_prints")
    assert not bad.passed
    for what in ("learning rate", "σ", "score", "count"):
        assert f"trial 0's {what}" in bad.message, bad.row()
