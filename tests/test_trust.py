"""Trust by default (issue 13): secret randomness, only covered releases leave a run, every
phase in the ledger, never replaced."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest
import torch

from conftest import files_recipe
from dpft.privacy.randomness import Randomness
from dpft.run.loop import Trainer, TrainingError


def _recipe(model_dir, files, **extra):
    return files_recipe(model_dir, files, **{"privacy.noise_multiplier": 1.0, **extra})


def _noise(t: Trainer, step: int = 0) -> torch.Tensor:
    return t.mechanism.add_noise({"x": torch.zeros(64)}, step)["x"]


# ----------------------------------------------------------------------------- randomness
def test_default_runs_draw_different_batches_and_noise(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files)
    a, b = Trainer(rec, tmp_path / "a", progress=False), Trainer(rec, tmp_path / "b", progress=False)
    assert not a.rng.reproducible
    assert not torch.equal(_noise(a), _noise(b))
    assert any(not torch.equal(a.sampler.indices(s), b.sampler.indices(s)) for s in range(3))
    # every mechanism's stream differs between the two runs: count noise, forward LDP, label RR
    for stream in ("count", "ldp", "label_rr", "synth"):
        assert not torch.equal(a.rng.stream(stream, 0).normal((8,)), b.rng.stream(stream, 0).normal((8,)))
    assert a.rng.seed_for("dropout", 0) != b.rng.seed_for("dropout", 0)


def test_reproducible_mode_draws_the_same(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True})
    a, b = Trainer(rec, tmp_path / "a", progress=False), Trainer(rec, tmp_path / "b", progress=False)
    assert torch.equal(_noise(a), _noise(b))
    assert all(torch.equal(a.sampler.indices(s), b.sampler.indices(s)) for s in range(3))
    other = Trainer(_recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True, "seed": 1}),
                    tmp_path / "c", progress=False)
    assert not torch.equal(_noise(a), _noise(other))


def test_streams_are_independent_and_the_key_cannot_be_saved():
    r = Randomness()
    d = {k: r.stream(*k).normal((8,)) for k in [("noise", 0), ("noise", 1), ("sample", 0)]}
    assert not torch.equal(d["noise", 0], d["noise", 1]) and not torch.equal(d["noise", 0], d["sample", 0])
    assert not torch.equal(r.child("x").stream("noise", 0).normal((8,)), d["noise", 0])
    with pytest.raises(TypeError):
        pickle.dumps(r)
    assert "key" not in repr(r) and r._key.hex() not in repr(r)
    # the 4-generator normal: the law N(0, 1)
    z = r.stream("t").normal((200_000,))
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01


# ----------------------------------------------------------------------------- release set
def _release_files(run_dir):
    for root, _, files in os.walk(run_dir):
        for f in files:
            if f == "private_diagnostics.jsonl":
                continue
            yield os.path.join(root, f)


def test_release_set_holds_no_private_statistics_and_no_secret(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files)
    t = Trainer(rec, tmp_path / "r", progress=False)
    t.run()
    d = tmp_path / "r"
    assert not (d / "private_diagnostics.jsonl").exists()  # off by default
    secrets_ = [t.rng._key.hex()] + [str(t.rng.seed_for(s, k)) for s in ("sample", "noise", "dropout") for k in range(3)]
    for path in _release_files(d):
        if path.endswith((".json", ".jsonl", ".md", ".yaml")):
            text = open(path).read()
            for key in ("train_loss", "clip_fraction", "step_seconds", "noise_seed", "rr_seed"):
                assert key not in text, (path, key)
            for s in secrets_:
                assert s not in text, path
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    rep = json.loads((d / "report.json").read_text())
    state = json.loads((d / "checkpoint" / "state.json").read_text())
    for hist in (rows, rep["history"], state["history"]):
        assert hist and all("batch_size" not in r and "train_loss" not in r for r in hist)
    assert rep["dp"]["randomness"].startswith("secret")
    md = (d / "report.md").read_text()
    # coverage sentences: a dev split of the user's file is not called public
    assert "NOT covered by ε" in md and "public dev split" not in md
    assert "REPRODUCIBLE MODE" not in md


def test_private_diagnostics_are_opt_in_0600_and_marked(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files, **{"log.private_diagnostics": True})
    Trainer(rec, tmp_path / "r", progress=False).run()
    f = tmp_path / "r" / "private_diagnostics.jsonl"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert "NOT covered" in lines[0]["NOT_COVERED"]
    assert all("train_loss" in x and "batch_size" in x for x in lines[1:]) and len(lines) == 4


def test_reproducible_report_headline_warns(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True})
    Trainer(rec, tmp_path / "r", progress=False).run()
    head = next(x for x in (tmp_path / "r" / "report.md").read_text().splitlines() if x.startswith("**Privacy:**"))
    assert "ε = " in head and "holds only while that seed stays secret" in head


# ----------------------------------------------------------------------------- the ledger
def test_rerun_after_crash_before_first_checkpoint_carries_earlier_releases(tiny_model_dir, sst_like_files,
                                                                               tmp_path, monkeypatch):
    rec = _recipe(tiny_model_dir, sst_like_files, **{"checkpoint_every": 10, "schedule.steps": 4})
    real = Trainer.step

    def crashing(self, step):
        if step == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(self, step)

    monkeypatch.setattr(Trainer, "step", crashing)
    with pytest.raises(KeyboardInterrupt):
        Trainer(rec, tmp_path / "r", progress=False).run()
    monkeypatch.setattr(Trainer, "step", real)
    assert not (tmp_path / "r" / "checkpoint").exists()
    live = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert sum(e["count"] for e in live["entries"]) == 2  # steps 0 and 1 were released
    t = Trainer(rec, tmp_path / "r", progress=False)
    rep = t.run()
    assert t.ledger.steps == 2 + 4  # the earlier releases are carried, not overwritten
    assert any("earlier attempt" in n for n in rep["task"]["notes"])


def test_ldp_with_batch_schedule_is_refused(tiny_model_dir, sst_like_files, tmp_path):
    from conftest import ldp_recipe

    from dpft.privacy.ldp import LDPError

    rec = ldp_recipe(tiny_model_dir, sst_like_files, **{"batch.schedule": [[0, 8], [2, 4]]})
    with pytest.raises(LDPError, match="batch.schedule"):
        Trainer(rec, tmp_path / "r", progress=False)


def test_selft_with_reproduce_paper_is_not_certified_and_keeps_every_phase(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.methods.selft import SelFTCfg, run_selft
    from dpft.run.loop import train_phase

    cands = [f"a {w} movie {i}" for i, w in enumerate(["good", "bad", "great", "awful"] * 4)]
    rec = _recipe(tiny_model_dir, sst_like_files, **{
        "adam_ac.reproduce_paper": True, "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 16})
    cfg = SelFTCfg(epsilon_syn=0.5, encoder=str(tiny_model_dir), top_k=1, score_steps=1, score_batch_size=8,
                   n_select=8)
    rep = run_selft(rec, cfg, tmp_path / "s", candidates=cands, progress=False, log=lambda m: None,
                    train_phase=train_phase)
    assert rep["privacy"]["guarantee"] == "NOT CERTIFIED" and rep["privacy"]["epsilon"] is None
    led = json.loads((tmp_path / "s" / "ledger.json").read_text())
    assert led["certified"] is False
    assert [e["phase"] for e in led["entries"]] == ["synthetic_select", "synthetic_label", "train"]
    assert "NOT CERTIFIED" in (tmp_path / "s" / "report.md").read_text()


def test_private_dpsft_stage1_writes_into_the_run_ledger(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """A crash in stage 1 leaves its releases in the run's live ledger; the rerun carries them."""
    from dpft.methods.dpsft import method as dpsft

    rec = _recipe(tiny_model_dir, sst_like_files, **{
        "subspace.source": "private", "subspace.k": 2, "subspace.steps": 4, "trainable.mode": "last_k",
        "trainable.last_k": 1})
    real = dpsft.Snapshots.__call__

    def crashing(self, done, params):  # stage 1's step hook: crash once 2 steps are released
        if done == 2:
            raise KeyboardInterrupt("simulated crash in stage 1")
        return real(self, done, params)

    monkeypatch.setattr(dpsft.Snapshots, "__call__", crashing)
    with pytest.raises(KeyboardInterrupt):
        Trainer(rec, tmp_path / "r", progress=False)
    monkeypatch.setattr(dpsft.Snapshots, "__call__", real)
    live = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert [(e["phase"], e["count"]) for e in live["entries"]] == [("subspace", 2)]
    import shutil

    shutil.rmtree(tmp_path / "r" / "subspace")  # what the stage-1 error message tells the user to do
    t = Trainer(rec, tmp_path / "r", progress=False)
    t.run()
    phases = [(e.phase, e.count) for e in t.ledger.entries]
    assert phases == [("subspace", 2 + 4), ("train", 3)]


def test_transforms_never_see_the_clean_sum(tiny_model_dir, sst_like_files, tmp_path):
    seen = []

    def spy(grads, ctx):
        seen.append(set(ctx))
        return grads

    rec = _recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 1})
    Trainer(rec, tmp_path / "r", progress=False, transforms=[spy]).run()
    assert seen and all("clean_sum" not in s for s in seen)


def test_non_finite_per_example_norm_raises_and_keeps_the_checkpoint(tiny_model_dir, sst_like_files, tmp_path):
    rec = _recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 2, "checkpoint_every": 1})
    t = Trainer(rec, tmp_path / "r", progress=False)
    real = t.step

    def poisoned(step):
        if step == 1:
            with torch.no_grad():
                next(iter(t.params.values())).fill_(float("inf"))
        return real(step)

    t.step = poisoned
    with pytest.raises(TrainingError, match="non-finite"):
        t.run()
    assert (tmp_path / "r" / "checkpoint" / "state.json").is_file()
