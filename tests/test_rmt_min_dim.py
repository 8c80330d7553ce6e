"""Issue 18, RMT: ``denoise.min_dim`` (no MP shrinkage of e.g. a 2 × h head) and
``denoise.diagnostics`` (spike strength of the clean gradient; NOT CERTIFIED)."""

import json
import math

import pytest
import torch

from dpft.transforms.rmt import RMTDenoiser, spike_report


def _spiked(m, n, x, s=0.1, seed=0):
    """Clean rank-1 G with ‖G‖₂ = x·s·√n, and G + N(0, s²)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(m, generator=g)
    v = torch.randn(n, generator=g)
    clean = torch.outer(u / u.norm(), v / v.norm()) * x * s * math.sqrt(n)
    return clean, clean + s * torch.randn(m, n, generator=g)


def test_min_dim_leaves_small_matrices_alone():
    _, head = _spiked(2, 64, 20.0)
    _, body = _spiked(32, 64, 20.0, seed=1)
    grads = {"head": head, "body": body}
    out = RMTDenoiser(kappa=1.05, targets="all-2d", min_dim=8)(grads, 0.1)
    assert out["head"] is head and out["body"] is not body  # body denoised, head untouched
    den = RMTDenoiser(kappa=1.05, targets="all-2d", min_dim=8)
    den(grads, 0.1)
    assert den.last_excluded == ["head"] and set(den.last_stats) == {"body"}
    assert RMTDenoiser(kappa=1.05, targets="all-2d", min_dim=1)(grads, 0.1)["head"] is not head
    with pytest.raises(ValueError, match="min_dim"):
        RMTDenoiser(min_dim=0)


def test_spike_report_x_and_thresholds():
    clean, _ = _spiked(32, 128, 3.0)
    r = spike_report({"w": clean, "b": torch.zeros(5)}, noise_std=0.1, kappa=1.05)["w"]
    beta = 32 / 128
    assert set(spike_report({"w": clean}, 0.1)) == {"w"}
    assert r["x"] == pytest.approx(3.0, rel=1e-5)
    assert r["bbp"] == pytest.approx(beta ** 0.25)
    assert r["y_pred"] == pytest.approx(math.sqrt((1 + 9) * (beta + 9)) / 3)
    assert r["threshold"] == pytest.approx(1.05 * (1 + math.sqrt(beta)))
    assert r["above_bbp"] and r["detectable"]
    weak = spike_report({"w": _spiked(32, 128, 0.5)[0]}, 0.1)["w"]
    assert not weak["above_bbp"] and not weak["detectable"]  # 0.5 < β^{1/4} ≈ 0.707


def _recipe(model_dir, files, **extra):
    from dpft.config.recipe import load_recipe

    ov = {"model.name": str(model_dir), "model.max_length": 16, "task.name": "files",
          "task.train_file": str(files["csv"]), "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 16,
          "schedule.steps": 2, "eval.every_steps": 2, "checkpoint_every": 2, "privacy.noise_multiplier": 1.0,
          "privacy.delta": 1e-3, "optimizer.lr": 1e-2, "denoise.method": "rmt"}
    ov.update(extra)
    return load_recipe(None, ov)


def test_certified_run_excludes_the_head(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    t = Trainer(_recipe(tiny_model_dir, sst_like_files), tmp_path / "r", progress=False)
    rep = t.run()
    den = [tf.denoiser for tf in t.dp_step.spec.transforms if hasattr(tf, "denoiser")][0]
    assert den.min_dim == 8 and den.last_excluded == ["classifier.weight"]
    assert rep["privacy"]["guarantee"] == "certified" and rep["rmt"]["min_dim"] == 8
    assert not (tmp_path / "r" / "rmt_diagnostics.jsonl").exists()


def test_diagnostics_run_is_not_certified_and_logs_spikes(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    t = Trainer(_recipe(tiny_model_dir, sst_like_files, **{"denoise.diagnostics": True}), tmp_path / "d",
                progress=False)
    rep = t.run()
    assert not t.ledger.certified and "diagnostics" in t.ledger.not_certified_reason
    assert rep["privacy"]["guarantee"] == "NOT CERTIFIED" and rep["privacy"]["epsilon"] is None
    rows = [json.loads(x) for x in (tmp_path / "d" / "rmt_diagnostics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["excluded_min_dim"] == ["classifier.weight"]
    lay = next(iter(rows[0]["layers"].values()))
    assert {"x", "bbp", "threshold", "y1_observed", "cos_noisy", "cos_denoised"} <= set(lay)
    assert -1.0 <= rows[0]["cos_total"]["noisy"] <= 1.0
