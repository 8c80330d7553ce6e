"""LP-FT (methods/lpft.py, issue 45 item 3): a DP linear probe, then DP fine-tuning from its head, both
phases in one ledger that ends at the target ε."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import files_recipe
from dpft.config import load_recipe
from dpft.methods.base import MethodError
from dpft.methods.lpft import LPFTCfg, probe_recipe


def test_probe_recipe_is_the_head_on_its_share_of_the_budget():
    r = load_recipe(None, {"privacy.target_epsilon": 6.0, "trainable.mode": "last_k"})
    p = probe_recipe(r, LPFTCfg(share=0.25, epochs=10, sampling_rate=0.5, lr=0.05), 1000)
    assert p.trainable.mode == "head" and p.methods == []
    assert p.privacy.target_epsilon == pytest.approx(1.5) and p.privacy.delta == r.privacy.delta
    assert p.privacy.clipping.style == "flat" and p.privacy.clipping.max_norm == r.privacy.clipping.max_norm
    assert p.batch.expected_batch_size == 500 and p.schedule.epochs == 10 and p.schedule.steps is None
    assert p.optimizer.lr == 0.05 and p.task.test_file is None and p.output.model_card is False
    with pytest.raises(MethodError, match="target_epsilon"):
        probe_recipe(load_recipe(None, {"privacy.noise_multiplier": 1.0}), LPFTCfg(), 1000)


def test_lpft_two_phases_one_ledger_ending_at_the_target(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.run.loop import Trainer

    r = files_recipe(tiny_model_dir, sst_like_files, **{
        "trainable.mode": "last_k", "trainable.last_k": 1, "privacy.target_epsilon": 4.0,
        "task.dev_file": str(sst_like_files["csv"]), "schedule.steps": 3, "batch.expected_batch_size": 8,
        "methods": [{"name": "lpft", "share": 0.4, "epochs": 2, "sampling_rate": 0.5, "lr": 0.05}]})
    out = tmp_path / "run"
    rep = Trainer(r, out, progress=False).run()
    ledger = json.loads((out / "ledger.json").read_text())
    phases = [e["phase"] for e in ledger["entries"]] if "entries" in ledger else None
    led = PrivacyLedger.load(out / "ledger.json")
    probe_steps = rep["lpft"]["probe_steps"]
    assert probe_steps == 4  # ⌈2 epochs · 60 / 30⌉
    assert led.steps == probe_steps + 3  # both phases' releases, one ledger
    assert led.epsilon(r.privacy.delta).epsilon <= 4.0 + 1e-6
    assert rep["privacy"]["epsilon"] == pytest.approx(led.epsilon(r.privacy.delta).epsilon, rel=1e-6)
    assert rep["lpft"]["probe_target_epsilon"] == pytest.approx(1.6)
    head = load_file(str(out / "lpft" / "head.safetensors"))
    assert head and all(any(h in k for h in ("classifier", "score", "head", "pooler")) for k in head)
    assert phases is None or "probe" in phases
    # resume: the saved head is loaded, the probe is not run again
    assert "## LP-FT" in (out / "report.md").read_text()


def test_lpft_refuses_a_head_only_recipe(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    r = files_recipe(tiny_model_dir, sst_like_files, **{"trainable.mode": "head", "methods": [{"name": "lpft"}],
                                                        "task.dev_file": str(sst_like_files["csv"])})
    with pytest.raises(MethodError, match="probe alone"):
        Trainer(r, tmp_path / "run", progress=False).run()


@pytest.mark.slow
def test_audit_lpft_check_passes_and_catches_its_planted_bug():
    from dpft.audit.checks_lpft import lpft_checks

    (honest,) = lpft_checks()
    assert honest.passed, honest.message
    (planted,) = lpft_checks("lpft_probe_own_ledger")
    assert not planted.passed, planted.message
