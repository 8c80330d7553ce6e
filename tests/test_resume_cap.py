"""The target ε is a hard cap across crashes (issue 36 item 3): a run killed after releasing
steps past its last checkpoint, then resumed, stops early so that the ledger ends within the
target, and says so before its first step; ``--allow-overspend`` keeps the old behaviour."""

from __future__ import annotations

import json

import dp_accounting as dpa
import pytest
from typer.testing import CliRunner

from dpft.accounting.cap import pld_epsilon, resume_cap
from dpft.accounting.ledger import PrivacyLedger
from conftest import files_recipe
from dpft.cli.commands import app


def _ev(q=0.2, sigma=1.0):
    return dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))


def test_identical_steps_stop_short_by_the_replayed_releases_exactly():
    full = pld_epsilon([_ev()] * 20, 1e-5)
    # killed after releasing step 9 with the checkpoint at step 6: the ledger holds 9 releases
    cap = resume_cap([_ev()] * 9, lambda s: _ev(), start=6, planned=20, delta=1e-5, target=full, held=9)
    assert cap.stop == 17 and cap.early == 3  # 9 held + 11 more = 20 releases, as planned
    assert cap.epsilon_end == pytest.approx(full) and cap.epsilon_end <= full * (1 + 1e-9)
    assert cap.epsilon_planned > full  # running to 20 would spend 23 releases
    # a fixed σ (no target): the cap is the ε of the plan without a crash
    cap2 = resume_cap([_ev()] * 9, lambda s: _ev(), start=6, planned=20, delta=1e-5, held=9)
    assert cap2.stop == 17 and cap2.target == pytest.approx(full)


def test_steps_whose_events_differ_are_capped_by_the_composition_not_the_count():
    """Events that differ by step (a batch schedule, banded MF's no-ops): the count rule alone
    could overshoot; the cap composes the real events of every remaining step."""
    def ev(s):
        return _ev(q=0.05 if s < 10 else 0.2, sigma=2.0)

    planned = [ev(s) for s in range(20)]
    target = pld_epsilon(planned, 1e-5)
    held = [ev(s) for s in range(12)] + [ev(s) for s in range(10, 12)]  # steps 11–12 released, checkpoint at 10
    cap = resume_cap(held, ev, start=10, planned=20, delta=1e-5, target=target, held=12)
    assert cap.epsilon_end <= target * (1 + 1e-9)
    assert pld_epsilon(held + [ev(s) for s in range(10, cap.stop + 1)], 1e-5) > target  # one more step overshoots
    assert cap.stop <= 18
    # the ledger alone already above the target: nothing runs
    over = resume_cap(planned + planned, ev, start=10, planned=20, delta=1e-5, target=target, held=40)
    assert over.stop == 10


def _args(model_dir, csv, out, steps=12):
    return ["train", "--train-file", str(csv), "--model", str(model_dir), "--max-length", "16", "--batch-size", "12",
            "--max-physical-batch-size", "12", "--epsilon", "6", "--delta", "1e-3", "--steps", str(steps),
            "--eval-every", "100", "--checkpoint-every", "4", "--lr", "1e-2", "--quiet", "-o", str(out)]


@pytest.mark.slow  # two tiny CLI runs with σ calibration: ~45 s on 2 shared cores
def test_resume_after_a_crash_between_checkpoints_ends_within_the_target(tiny_model_dir, sst_like_files, tmp_path,
                                                                       monkeypatch):
    """Old: the resume replayed steps 5–6 and ran to step 12: 14 releases, ε above the target,
    said only at the end. New: an up-front line, 12 releases, ε ≤ 6."""
    from dpft.run import loop

    out = tmp_path / "run"
    args = _args(tiny_model_dir, sst_like_files["csv"], out)
    inner = loop.Trainer.step

    def crash_after_step_6(self, i):
        res = inner(self, i)
        if i == 5:  # step 6 released (live ledger written), checkpoint at step 4: as a kill -9 here
            raise RuntimeError("killed")
        return res

    monkeypatch.setattr(loop.Trainer, "step", crash_after_step_6)
    r = CliRunner().invoke(app, args)
    assert isinstance(r.exception, RuntimeError)
    monkeypatch.undo()
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4
    led = PrivacyLedger.load(out / "ledger.json")
    assert led.steps == 6

    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("resume: "))
    rep = json.loads((out / "report.json").read_text())
    eps = rep["privacy"]["epsilon"]
    assert eps <= 6.0 * (1 + 1e-9)
    assert ("resume: the ledger holds 6 releases of this run's steps (4 up to the checkpoint at step 4, 2 after it by "
            "the attempt that stopped before its next checkpoint") in line
    stop = rep["dp"]["steps"]
    assert 10 <= stop < 12 and rep["dp"]["released_steps"] == 6 + stop - 4
    assert f"{stop - 4} steps remain: the run stops at step {stop} of the 12 planned ({12 - stop} early) so that ε " \
           f"stays within the target ε = 6; it ends at ε = {eps:.4g} at δ = 0.001" in line
    assert rep["dp"]["resume_cap"]["planned_steps"] == 12 and rep["dp"]["resume_cap"]["stop"] == stop
    assert "exceeds" not in (out / "report.md").read_text()
    assert f"stopped at step {stop} of the 12 planned" in (out / "report.md").read_text()
    # the finished run refuses another --resume, naming that it is finished; nothing is rewritten
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 2 and f"--resume: the run in {out} is finished (step {stop} of {stop}" in " ".join(
        r.output.split())
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == before


def test_a_small_trainable_part_is_checkpointed_at_every_release(tiny_model_dir, sst_like_files, tmp_path):
    """Issue 36 item 3: with LoRA, a head or biases (a small part) the run checkpoints at every release,
    so a crash leaves nothing to replay; a large trainable part keeps checkpoint_every; the recipe key
    forces either."""
    from dpft.run.checkpoint import release_checkpoints
    from dpft.run.loop import Trainer

    head = files_recipe(tiny_model_dir, sst_like_files, **{"trainable.mode": "head", "privacy.noise_multiplier": 1.0,
                                                           "schedule.steps": 4, "checkpoint_every": 50})
    tr = Trainer(head, tmp_path / "head", progress=False)
    assert tr.release_checkpoints
    saved = []
    real = tr.save
    tr.save = lambda step: (saved.append(step), real(step))
    tr.run()
    assert saved == [1, 2, 3, 4]
    full = files_recipe(tiny_model_dir, sst_like_files, **{"privacy.noise_multiplier": 1.0})
    assert not Trainer(full, tmp_path / "full", progress=False).release_checkpoints  # full fine-tuning
    forced = files_recipe(tiny_model_dir, sst_like_files, **{"privacy.noise_multiplier": 1.0,
                                                             "checkpoint_every_release": True})
    assert release_checkpoints(forced, True, False, {})
    assert not release_checkpoints(forced, True, True, {})  # FSDP: its own checkpoints
