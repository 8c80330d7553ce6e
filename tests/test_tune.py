"""dpft tune (issue 35): the selection bounds, calibration, K sampling, and a tiny search end to end."""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest

from dpft.accounting.ledger import PrivacyLedger
from dpft.accounting.selection import (KDistribution, RandomKSelectionDpEvent, SelectionError, calibrate_search,
                                       candidate_event, selection_epsilon, selection_rdp_curve, ORDERS)


@pytest.mark.parametrize("eta", [0.0, 1.0, 2.0])
def test_pure_dp_limit_is_2_plus_eta_epsilon(eta):
    """Papernot & Steinke 2022: for an ε-DP base (Laplace, RDP ≤ ε at every order) Theorem 2 gives
    (2 + η)ε as λ, λ̂ → ∞ (η = 1: Liu & Talwar's 3ε; η = 0: 2ε, their Corollary for the logarithmic law)."""
    d = KDistribution("truncated_negative_binomial", eta, 1e-3)
    c = selection_rdp_curve([dpa.LaplaceDpEvent(1.0)], d)
    lam = ORDERS[-1]
    # the finite-order remainder: (1+η) log(1/γ)/λ̂ + log E[K]/(λ−1) at λ = λ̂ = 1024, and ε(λ̂)(1+η)/λ̂
    assert abs(c[-1] - (2 + eta)) < (1 + eta) * math.log(1e3) / lam + math.log(d.mean()) / (lam - 1) + 1e-9


def test_theorem_2_formula_at_one_order():
    """An independent evaluation of Theorem 2 at λ = 8 on the RDP of the Gaussian mechanism
    (ε(λ) = λ/(2σ²)), with λ̂ minimised in closed form over the same orders."""
    sigma, eta, gamma = 3.0, 1.0, 0.1
    d = KDistribution("truncated_negative_binomial", eta, gamma)
    curve = selection_rdp_curve([dpa.GaussianDpEvent(sigma)], d)
    lam = np.array(ORDERS)
    hat = min((1 + eta) * (1 - 1 / lh) * lh / (2 * sigma ** 2) + (1 + eta) * math.log(1 / gamma) / lh for lh in ORDERS)
    i = ORDERS.index(8.0)
    expect = 8.0 / (2 * sigma ** 2) + hat + math.log(1 / gamma) / 7.0  # E[K] = 1/γ for η = 1 (geometric)
    assert curve[i] == pytest.approx(expect, rel=1e-9)
    assert lam[i] == 8.0


@pytest.mark.parametrize("d", [KDistribution("truncated_negative_binomial", 1, 0.2),
                               KDistribution("truncated_negative_binomial", 0, 0.05),
                               KDistribution("truncated_negative_binomial", -0.5, 0.02),
                               KDistribution("poisson", mu=4.0)])
def test_k_law_mean_and_sampling(d):
    ks = np.arange(0, 5000)
    p = np.array([d.pmf(int(k)) for k in ks])
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert (ks * p).sum() == pytest.approx(d.mean(), rel=1e-9)
    rng = np.random.default_rng(0)
    draws = np.array([d.sample(u) for u in rng.random(4000)])
    assert draws.mean() == pytest.approx(d.mean(), rel=0.15)
    # chi-square on the first cells against the pmf
    from scipy.stats import chisquare

    top = 6
    obs = [int((draws == k).sum()) for k in range(top)] + [int((draws >= top).sum())]
    exp = [4000 * d.pmf(k) for k in range(top)] + [4000 * (1 - sum(d.pmf(k) for k in range(top)))]
    keep = [i for i, e in enumerate(exp) if e > 5]
    o, e = np.array(obs)[keep], np.array(exp)[keep]
    assert chisquare(o, e * o.sum() / e.sum()).pvalue > 1e-4


def test_with_mean_inverts_mean():
    d = KDistribution.with_mean("truncated_negative_binomial", 10.0, eta=1.0)
    assert d.mean() == pytest.approx(10.0, rel=1e-9)
    assert d.gamma == pytest.approx(0.1, rel=1e-6)  # geometric on {1, 2, …}: E[K] = 1/γ
    with pytest.raises(SelectionError):
        KDistribution.with_mean("truncated_negative_binomial", 1.0)


def test_selection_costs_more_than_one_trial_and_less_than_naive():
    ev = candidate_event(1.0, 0.02, 200, 10.0)
    b = selection_epsilon([ev], KDistribution.with_mean("truncated_negative_binomial", 10.0), 1e-5)
    assert b.per_trial_epsilon < b.epsilon_rdp < b.epsilon_naive
    assert b.per_trial_epsilon < b.epsilon_profile
    assert b.epsilon == min(b.epsilon_rdp, b.epsilon_profile, b.epsilon_naive)
    assert b.certified_by == min(("rdp", "profile", "naive"), key=lambda k: getattr(b, f"epsilon_{k}"))


def test_calibration_meets_target_from_below():
    d = KDistribution.with_mean("truncated_negative_binomial", 5.0)
    sig, b = calibrate_search(6.0, 1e-5, d, [(0.02, 100), (0.05, 50)], 10.0, rel_tol=5e-3, bound="rdp")
    assert b.epsilon_rdp <= 6.0
    assert b.epsilon_rdp > 6.0 * 0.97  # spends (almost) all of it
    # both configurations' trial costs are alike (their σ's differ)
    assert sig[0] != sig[1]


def test_ledger_composes_selection_conservatively():
    ev = candidate_event(1.5, 0.02, 100, 10.0)
    sel = RandomKSelectionDpEvent(candidates=[ev], kind="truncated_negative_binomial", eta=1.0, gamma=0.2)
    led = PrivacyLedger()
    led.record("tune", sel)
    alone = led.epsilon(1e-5).epsilon
    assert alone == pytest.approx(selection_epsilon([ev], sel.distribution, 1e-5).epsilon, rel=1e-9)
    led2 = PrivacyLedger.from_json(json.loads(json.dumps(led.to_json())))
    led2.record("other", dpa.GaussianDpEvent(4.0))
    assert led2.epsilon(1e-5).epsilon > alone
    # a trial not covered by the candidates is composed on top
    bigger = candidate_event(0.8, 0.02, 100, 10.0)
    sel3 = RandomKSelectionDpEvent(candidates=[ev], kind="truncated_negative_binomial", eta=1.0, gamma=0.2,
                                   trials=[ev, bigger])
    led3 = PrivacyLedger()
    led3.record("tune", sel3)
    assert led3.epsilon(1e-5).epsilon > alone


def tune_recipe(model_dir, files, **extra):
    from dpft.config import load_recipe

    ov = {
        "model.name": str(model_dir), "model.max_length": 16,
        "task.name": "files", "task.train_file": str(files["csv"]),
        "batch.max_physical_batch_size": 8, "schedule.steps": 2, "eval.every_steps": 50,
        "privacy.target_epsilon": 8.0, "privacy.delta": 1e-3, "privacy.engine": "reference",
        "privacy.reproducible": True, "seed": 7,  # K = 2 under this seed: the resume path runs "optimizer.lr": 1e-2,
        "tune": {"trials": {"distribution": "truncated_negative_binomial", "mean": 2.0, "eta": 1.0},
                 "score_fraction": 0.3,
                 "space": {"optimizer.lr": {"log_uniform": [1e-3, 1e-1]},
                           "batch.expected_batch_size": {"choice": [4, 8]}}},
    }
    ov.update(extra)
    return load_recipe(None, ov)


@pytest.mark.slow
def test_tiny_tune_releases_one_model_and_resume_keeps_k(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    from dpft.run import tune as T

    rec = tune_recipe(tiny_model_dir, sst_like_files)
    out = tmp_path / "t"
    # interrupt after the first trial: the state (K, hyperparameters) was written before it
    calls = {"n": 0}
    from dpft.run.loop import Trainer

    real_run = Trainer.run

    def run_once(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_run(self)

    monkeypatch.setattr(Trainer, "run", run_once)
    try:
        rep = T.tune(rec, out, progress=False)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    state = json.loads((out / "tune_private" / "state.json").read_text())
    k = state["k"]
    assert k >= 1 and len(state["trials"]) == k
    monkeypatch.setattr(Trainer, "run", real_run)
    assert interrupted  # K = 2 under seed 7 (draw_trials from the reproducible key)
    if interrupted:
        assert k >= 2
        with pytest.raises(T.TuneError, match="--resume"):
            T.tune(rec, out, progress=False)
        # a resume with another secret key must not redraw K
        monkeypatch.setattr(T, "draw_trials", lambda *a, **kw: pytest.fail("K redrawn on resume"))
        rep = T.tune(rec, out, resume=True, progress=False)
    state2 = json.loads((out / "tune_private" / "state.json").read_text())
    assert state2["k"] == k and all(t["score"] is not None for t in state2["trials"])
    # one release folder: the chosen model; no trial folder is left
    assert (out / "model" / "config.json").is_file()
    assert not any(p.name.startswith("trial_") or p.suffix == ".jsonl" for p in (out / "tune_private").iterdir())
    assert T.tune(rec, out, resume=True, progress=False)["epsilon"] == rep["epsilon"]  # finished: nothing reruns
    with pytest.raises(T.TuneError, match="recipe differs"):
        T.tune(tune_recipe(tiny_model_dir, sst_like_files, **{"tune.trials.mean": 5.0}), out, resume=True,
               progress=False)
    assert "Hyperparameter search (covered)" in (out / "model" / "README.md").read_text()
    # ledger: one selection entry, no trials in the released file (K is not released)
    led = json.loads((out / "ledger.json").read_text())
    assert [e["phase"] for e in led["entries"]] == ["tune"]
    assert led["entries"][0]["event"]["type"] == "RandomKSelectionDpEvent"
    assert led["entries"][0]["event"]["trials"] == []
    eps = PrivacyLedger.load(out / "ledger.json").epsilon(1e-3).epsilon
    assert eps <= 8.0 and rep["epsilon"] == pytest.approx(eps)
    # each trial's events: its DP-SGD steps and the noisy score, covered by a candidate
    for t in state2["trials"]:
        kinds = json.dumps(t["events"])
        assert "PoissonSampledDpEvent" in kinds and "GaussianDpEvent" in kinds
    assert rep["chosen"]["hyperparameters"] in [t["hyperparameters"] for t in state2["trials"]]


def test_audit_tune_planted_bugs_are_caught():
    from dpft.audit import checks_tune as C
    from dpft.audit import planted, suite

    assert set(C.PLANTED) <= set(planted.ALL)
    assert ("dpft.audit.checks_tune", "tune_checks", C.PLANTED) in suite.OPTIONAL_CHECKS

    assert C._k_law(None).passed and not C._k_law("k_fixed").passed
    assert C._noisy_score(None).passed and not C._noisy_score("score_without_noise").passed
    assert C._one_release(None).passed and not C._one_release("losing_models_released").passed


@pytest.mark.slow
def test_audit_tune_checks_pass():
    from dpft.audit.checks_tune import tune_checks

    checks = tune_checks()
    assert len(checks) == 4 and all(c.passed for c in checks), [c.row() for c in checks if not c.passed]
    # a profile bound computed in our favour (the R^{η+1} factor on δ dropped) is caught
    from dpft.audit.checks_tune import _selection_epsilon

    assert not _selection_epsilon("profile_ratio_dropped").passed


def test_cli_tune_refusals_before_loading(tmp_path):
    from typer.testing import CliRunner

    from dpft.cli import app

    f = tmp_path / "r.yaml"
    f.write_text("task: {name: files, train_file: nowhere.csv}\n")
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "tune: section" in res.output
    f.write_text("task: {name: files, train_file: nowhere.csv}\nprivacy: {noise_multiplier: 1.0}\n"
                 "tune: {trials: {mean: 3}}\n")
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "noise_multiplier" in res.output
    f.write_text("tune: {space: {schedule.steps: {log_uniform: [10, 100]}}}\n")
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "must be a choice" in res.output
