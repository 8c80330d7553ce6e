"""The training loop on tiny models: resume equals an uninterrupted run; bad input errors."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from dpft.cli.commands import app
from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer, TrainingError


def tiny_recipe(model_dir, files, **extra):
    ov = {
        "model.name": str(model_dir), "model.max_length": 16,
        "task.name": "files", "task.train_file": str(files["csv"]),
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 3,
        "schedule.steps": 6, "schedule.warmup_steps": 1, "eval.every_steps": 3, "checkpoint_every": 3,
        "privacy.target_epsilon": 6.0, "privacy.delta": 1e-3, "privacy.engine": "reference",
        "optimizer.lr": 1e-2,
    }
    ov.update(extra)
    return load_recipe(None, ov)


def final_params(run_dir):
    return load_file(str(run_dir / "checkpoint" / "trainable.safetensors"))


@pytest.mark.slow  # two runs on the tiny model: ~25 s
def test_resume_equals_uninterrupted_run(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """Reproducible mode: the resumed run replays the same batches and noise, so its weights
    equal an uninterrupted run's; the live ledger still counts the replayed step again (the
    ledger is never shrunk), so its ε is at least the uninterrupted one."""
    rec = tiny_recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True})
    a = Trainer(rec, tmp_path / "a", progress=False)
    rep_a = a.run()

    # Crash in step 5 (after the checkpoint at step 3), then resume.
    b = Trainer(rec, tmp_path / "b", progress=False)
    real_step = Trainer.step

    def crashing(self, step):
        if step == 4:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "step", crashing)
    with pytest.raises(KeyboardInterrupt):
        b.run()
    monkeypatch.setattr(Trainer, "step", real_step)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 3
    # allow_overspend: run every planned step (by default the resume stops at step 5, one early,
    # so that ε stays within the target: issue 36, tests/test_resume_cap.py)
    c = Trainer(rec, tmp_path / "b", resume=True, progress=False, allow_overspend=True)
    rep_c = c.run()

    pa, pc = final_params(tmp_path / "a"), final_params(tmp_path / "b")
    for n in pa:
        torch.testing.assert_close(pa[n], pc[n], rtol=0, atol=0)
    assert a.ledger.steps == 6
    assert c.ledger.steps == 7  # steps 1-4 before the crash, 4-6 after: step 4 replayed, counted twice
    assert rep_c["privacy"]["epsilon"] >= rep_a["privacy"]["epsilon"]
    assert rep_c["metrics"] == rep_a["metrics"]
    for f in ("report.json", "report.md", "training.png", "ledger.json", "metrics.jsonl"):
        assert (tmp_path / "b" / f).is_file()
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_epsilon_reported_equals_ledger_and_target(tiny_model_dir, sst_like_files, tmp_path):
    rec = tiny_recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 3})
    t = Trainer(rec, tmp_path / "r", progress=False)
    rep = t.run()
    from dpft.accounting.calibrate import epsilon_for_sigma

    eps = epsilon_for_sigma(t.sigma, t.q, 3, 1e-3)
    assert rep["privacy"]["epsilon"] == pytest.approx(eps, rel=1e-12)
    assert eps <= 6.0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "ε = " in md and "Poisson" in md


def test_no_dp_report_says_no_guarantee(tiny_model_dir, sst_like_files, tmp_path):
    rec = tiny_recipe(tiny_model_dir, sst_like_files, **{"privacy.enabled": False, "schedule.steps": 2})
    rep = Trainer(rec, tmp_path / "n", progress=False).run()
    assert "no privacy guarantee" in rep["privacy"]["guarantee"]
    assert "no privacy guarantee" in (tmp_path / "n" / "report.md").read_text()


def test_nan_loss_stops_without_corrupting_checkpoint(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    rec = tiny_recipe(tiny_model_dir, sst_like_files)
    t = Trainer(rec, tmp_path / "x", progress=False)
    orig = t.engine.clipped_sum
    calls = {"n": 0}

    def poisoned(batch):
        res = orig(batch)
        calls["n"] += 1
        if t.ledger.steps >= 3:
            res.loss_sum = float("nan")
        return res

    t.engine.clipped_sum = poisoned
    with pytest.raises(TrainingError, match="non-finite"):
        t.run()
    state = json.loads((tmp_path / "x" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3
    assert json.loads((tmp_path / "x" / "checkpoint" / "ledger.json").read_text())["entries"][0]["count"] == 3


def test_refuses_to_overwrite_and_checks_resume_recipe(tiny_model_dir, sst_like_files, tmp_path):
    rec = tiny_recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 3})
    Trainer(rec, tmp_path / "o", progress=False).run()
    with pytest.raises(TrainingError, match="already holds a run"):
        Trainer(rec, tmp_path / "o", progress=False).run()
    other = tiny_recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 3, "optimizer.lr": 0.5})
    with pytest.raises(TrainingError, match="recipe differs"):
        Trainer(other, tmp_path / "o", resume=True, progress=False).run()


@pytest.mark.parametrize("mode", ["head", "last_k", "bias", "lora"])
def test_trainable_modes(tiny_model_dir, sst_like_files, tmp_path, mode):
    rec = tiny_recipe(tiny_model_dir, sst_like_files, **{"trainable.mode": mode, "trainable.last_k": 1,
                                                         "schedule.steps": 1})
    t = Trainer(rec, tmp_path / mode, progress=False)
    names = list(t.params)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.run()
    changed = {n for n, p in t.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and changed <= set(names)
    if mode == "head":
        assert all("classifier" in n or "pooler" in n for n in names)
    if mode == "lora":
        assert any("lora_A" in n for n in names)


def test_cli_errors_exit_nonzero(tiny_model_dir, sst_like_files, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["train", "--train-file", str(tmp_path / "nope.csv"), "--model", str(tiny_model_dir),
                            "-o", str(tmp_path / "e1"), "--quiet"])
    assert r.exit_code == 2 and "not found" in r.output
    r = runner.invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--model", str(tmp_path / "nomodel"),
                            "-o", str(tmp_path / "e2"), "--quiet", "--steps", "1"])
    assert r.exit_code == 2 and f"model folder {tmp_path / 'nomodel'} not found" in " ".join(r.output.split())
    r = runner.invoke(app, ["train", "--set", "privacy.bogus=1", "-o", str(tmp_path / "e3")])
    assert r.exit_code == 2 and "unknown key" in r.output
    r = runner.invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--model", str(tiny_model_dir),
                            "--trainable", "lora", "--set", "trainable.lora.target_modules=[nope]",
                            "-o", str(tmp_path / "e4"), "--quiet", "--steps", "1"])
    assert r.exit_code == 2 and "not in this model" in r.output
    r = runner.invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--model", str(tiny_model_dir),
                            "--delta", "0.5", "--batch-size", "8", "-o", str(tmp_path / "e5"), "--quiet", "--steps", "1"])
    assert r.exit_code == 2 and "1/N" in r.output


@pytest.mark.integration
def test_cli_tiny_real_run_minilm_sst2(shared_data, tmp_path, monkeypatch):
    """The real MiniLM on a few hundred real SST-2 sentences, through the CLI, then `report`."""
    monkeypatch.setenv("DPFT_DATA_DIR", str(shared_data))
    out = tmp_path / "real"
    r = CliRunner().invoke(app, [
        "train", "recipes/sst2-minilm.yaml", "-o", str(out), "--quiet",
        "--max-train-examples", "300", "--max-dev-examples", "100", "--steps", "3", "--batch-size", "16",
        "--max-physical-batch-size", "16", "--eval-every", "3", "--epsilon", "4", "--delta", "1e-3",
    ])
    assert r.exit_code == 0, r.output
    assert "dev accuracy:" in r.output and "ε = " in r.output and "δ = 0.001" in r.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["privacy"]["epsilon"] <= 4.0 and rep["task"]["n_train"] == 300
    r = CliRunner().invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and "dpft run report" in r.output


def test_rmt_denoise_is_post_processing_only(tiny_model_dir, sst_like_files, tmp_path):
    """denoise: rmt changes the update, never the ledger: ε identical with and without."""
    base = tiny_recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 2, "privacy.engine": "auto"})
    den = tiny_recipe(tiny_model_dir, sst_like_files, **{"schedule.steps": 2, "privacy.engine": "auto",
                                                          "denoise.method": "rmt", "denoise.kappa": 1.0})
    a = Trainer(base, tmp_path / "plain", progress=False)
    ra = a.run()
    b = Trainer(den, tmp_path / "rmt", progress=False)
    rb = b.run()
    assert len(b.transforms) == 1 and b.transforms[0].denoiser.last_stats
    assert ra["privacy"]["epsilon"] == rb["privacy"]["epsilon"]
    assert a.ledger.to_json() == b.ledger.to_json()
