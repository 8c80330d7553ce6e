"""EW-FT / DP-Forward wired into the Trainer (methods/ewft/method.py) on a tiny BERT."""

import json

import dp_accounting as dpa
import pytest
from dp_accounting.pld import pld_privacy_accountant

from conftest import ldp_recipe
from dpft.privacy.ldp import LDPError
from dpft.run.loop import Trainer


def test_ldp_run_ledger_schedule_and_report(tiny_model_dir, sst_like_files, tmp_path):
    t = Trainer(ldp_recipe(tiny_model_dir, sst_like_files), tmp_path / "r", progress=False)
    spe = t.method("ewft").ldp.steps_per_epoch
    assert t.total_steps == 2 * spe
    sig = t.method("ewft").ldp.schedule.sigmas
    assert sig[0] > sig[1]  # EWPBA: later epochs get less noise
    rep = t.run()
    # one ledger event per step, σ of its epoch
    entries = t.ledger.entries
    assert [e.count for e in entries] == [spe, spe] and all(e.phase == "ldp-forward" for e in entries)
    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(t.q, dpa.GaussianDpEvent(s)), spe) for s in sig]))
    assert rep["privacy"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-3), abs=1e-9)
    assert 4.0 - 1e-4 <= rep["privacy"]["epsilon"] <= 4.0
    loc = rep["privacy"]["local"]
    assert len(loc["epsilon_per_release_by_epoch"]) == 2 and loc["epsilon_per_example_all_releases"] > 0
    assert rep["ldp"]["sensitivity"] == 2.0 and rep["ldp"]["release_shape"] == [16, 4]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Forward-pass local DP" in md and "analytic Gaussian" in md
    saved = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert len(saved["entries"]) == 2
    assert (tmp_path / "r" / "model" / "autoencoder.safetensors").is_file()


def test_uniform_dp_forward_without_autoencoder(tiny_model_dir, sst_like_files, tmp_path):
    rec = ldp_recipe(tiny_model_dir, sst_like_files, **{"ldp.schedule": "uniform", "ldp.autoencoder.sizes": [],
                                                          "ldp.position": "embeddings"})
    t = Trainer(rec, tmp_path / "u", progress=False)
    assert len(set(t.method("ewft").ldp.schedule.sigmas)) == 1
    rep = t.run()
    assert rep["ldp"]["release_shape"] == [16, 16]
    assert 4.0 - 1e-4 <= rep["privacy"]["epsilon"] <= 4.0


def test_ldp_refuses_bad_configs(tiny_model_dir, sst_like_files, tmp_path):
    with pytest.raises(LDPError, match="privacy.enabled: false"):
        Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **{"privacy.enabled": True}), tmp_path / "a")
    with pytest.raises(LDPError, match="whole number"):
        Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **{"schedule.epochs": 1.5}), tmp_path / "b")
    with pytest.raises(LDPError, match="hidden size"):
        Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **{"ldp.autoencoder.sizes": [8, 4]}), tmp_path / "c")


def test_tiny_fixed_sigma_reports_infinity_fast(tiny_model_dir, sst_like_files, tmp_path):
    rec = ldp_recipe(tiny_model_dir, sst_like_files, **{"ldp.noise_multiplier": 0.05, "ldp.target_epsilon": None,
                                                          "schedule.epochs": 1})
    rep = Trainer(rec, tmp_path / "f", progress=False).run()
    assert rep["privacy"]["epsilon"] == float("inf") and "not computed" in rep["privacy"]["accountant"]
