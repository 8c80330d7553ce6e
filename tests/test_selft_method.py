"""DP-SelFT end to end on a tiny random BERT: both phases in one ledger composed to the target ε,
the selected units (and head) are the only parameters that moved, the report names them."""

from __future__ import annotations

import json

import pytest
import torch

from dpft.config.recipe import load_recipe
from dpft.methods.selft import SelFTCfg, run_selft, select_units
from dpft.models.units import resolve_units
from dpft.run.loop import train_phase


def _recipe(tiny_model_dir, files, tmp_path, **over):
    o = {"model.name": str(tiny_model_dir), "model.max_length": 16, "task.name": "files",
         "task.train_file": str(files["csv"]), "privacy.target_epsilon": 3.0, "privacy.delta": 1e-3,
         "schedule.steps": 3, "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 16,
         "eval.every_steps": 3, "checkpoint_every": 3, "optimizer.lr": 1e-2, **over}
    return load_recipe(None, o)


CANDS = [f"a {w} movie {i}" for i, w in enumerate(["good", "bad", "great", "awful", "fine", "poor"] * 4)]


def test_selft_end_to_end(tiny_model_dir, sst_like_files, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from dpft.models.load import load_classifier

    # fixed σ keeps the test fast (no calibration); the attention test below calibrates
    r = _recipe(tiny_model_dir, sst_like_files, tmp_path, **{"privacy.noise_multiplier": 1.5})
    cfg = SelFTCfg(epsilon_syn=0.5, encoder=str(tiny_model_dir), top_k=1, score_steps=2, score_batch_size=8,
                   n_select=12, cache_dir=str(tmp_path / "cache"))
    rep = run_selft(r, cfg, tmp_path / "run", candidates=CANDS, progress=False, log=lambda m: None,
                    train_phase=train_phase)
    units = rep["selft"]["selected_units"]
    assert len(units) == 1 and units[0] != "head"
    phases = [e["phase"] for e in rep["privacy"]["ledger"]]
    assert phases == ["synthetic_select", "synthetic_label", "train"]
    from dpft.accounting.calibrate import dp_sgd_event
    from dpft.accounting.ledger import epsilon_of
    from dpft.synth.select_label import select_label_events

    syn = rep["selft"]["synthetic"]
    expect = epsilon_of(select_label_events(syn["sigma_select"], syn["sigma_label"])
                        + [dp_sgd_event(1.5, rep["dp"]["sampling_rate"], 3)], 1e-3).epsilon
    assert rep["privacy"]["epsilon"] == pytest.approx(expect, rel=1e-6)  # both phases composed (PLD)
    assert rep["privacy"]["epsilon"] > epsilon_of([dp_sgd_event(1.5, rep["dp"]["sampling_rate"], 3)], 1e-3).epsilon
    assert set(rep["selft"]["scores"]) == {"embeddings", "block.0", "block.1"}  # head trains in all
    assert rep["model"]["trainable"] == "units"
    # only the selected unit and the head moved away from θ⁽⁰⁾
    _, m0 = load_classifier(str(tiny_model_dir), 2, seed=r.seed)
    m1 = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model")
    allowed = set(resolve_units(m0, units, with_head=True))
    p0 = dict(m0.named_parameters())
    moved = {n for n, p in m1.named_parameters() if not torch.equal(p, p0[n])}
    assert moved and moved <= allowed
    # a k sweep reuses the cached scores
    files = list((tmp_path / "cache").glob("scores-*.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())) == 3


def test_selft_attention_selector_and_errors(tiny_model_dir, sst_like_files, tmp_path):
    r = _recipe(tiny_model_dir, sst_like_files, tmp_path)
    cfg = SelFTCfg(selector="attention", encoder=str(tiny_model_dir), n_select=12)
    sel = select_units(r, cfg, candidates=CANDS, log=lambda m: None)
    from dpft.accounting.calibrate import epsilon_for_sigma

    n, b = 54, 16  # 90% of 60 rows train; the heuristic spends nothing on synthetic data:
    total = epsilon_for_sigma(sel["sigma"], b / n, 3, 1e-3)  # σ meets the whole ε alone
    assert 2.9 < total <= 3.0
    assert sel["units"] == ["bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention"]
    assert sel["ledger"].entries == [] and sel["synthetic"]["spent"] is False
    with pytest.raises(ValueError, match="candidates"):
        select_units(r, SelFTCfg(), log=lambda m: None)
    from dpft.accounting.calibrate import CalibrationError

    with pytest.raises(CalibrationError, match="already spent"):
        select_units(_recipe(tiny_model_dir, sst_like_files, tmp_path, **{"privacy.target_epsilon": 0.2}),
                     SelFTCfg(epsilon_syn=0.5, encoder=str(tiny_model_dir), n_select=12), candidates=CANDS,
                     log=lambda m: None)


def test_cli_selft(tiny_model_dir, sst_like_files, tmp_path):
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    cands = tmp_path / "c.txt"
    cands.write_text("\n".join(CANDS))
    sets = [f"model.name={tiny_model_dir}", "model.max_length=16", "task.name=files",
            f"task.train_file={sst_like_files['csv']}", "privacy.noise_multiplier=1.5", "privacy.delta=1e-3",
            "schedule.steps=2", "batch.expected_batch_size=16", "eval.every_steps=2", "checkpoint_every=2"]
    args = ["selft", "-o", str(tmp_path / "run"), "--candidates", str(cands), "--top-k", "1", "--score-steps", "1",
            "--n-select", "10", "--selector", "attention", "--quiet"]
    for s in sets:
        args += ["--set", s]
    import dpft.methods.selft as m

    orig = m.SelFTCfg
    m.SelFTCfg = lambda **kw: orig(**{**kw, "encoder": str(tiny_model_dir)})  # tiny encoder, not MiniLM
    try:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert "selected units: ['" in res.output and "ε = " in res.output
        bad = CliRunner().invoke(app, ["selft", "--set", f"model.name={tiny_model_dir}"])
        assert bad.exit_code == 2 and "--candidates" in bad.output
    finally:
        m.SelFTCfg = orig
