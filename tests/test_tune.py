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
    from dpft.config.recipe import load_recipe

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
    assert [e["phase"] for e in led["entries"]] == [f"tune:{state2['search_id']}"]
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
    assert C._uncovered_charged(None).passed and not C._uncovered_charged("uncovered_trial_hidden").passed
    honest = C._scope_candidates(None)
    assert honest.passed and "full" in honest.message and "lora" in honest.message, honest.message
    assert not C._scope_candidates("scope_schedule_uncharged").passed  # issue 45: a scope's own (q, T)
    from dpft.audit import checks_tune_release as R  # issue 44

    for check, bug in ((R._silent_trials, "trial_publishes"), (R._lock_held, "search_skips_lock"),
                       (R._ledger_composes, "ledger_entry_replaced"), (R._score_once, "score_redrawn_on_resume")):
        assert check(None).passed, check(None).row()
        assert not check(bug).passed, bug


@pytest.mark.slow
def test_audit_tune_checks_pass():
    from dpft.audit.checks_tune import tune_checks

    checks = tune_checks()
    assert len(checks) == 13 and all(c.passed for c in checks), [c.row() for c in checks if not c.passed]
    # a profile bound computed in our favour (the R^{η+1} factor on δ dropped) is caught
    from dpft.audit.checks_tune import _selection_epsilon

    assert not _selection_epsilon("profile_ratio_dropped").passed


def test_cli_tune_refusals_before_loading(tmp_path):
    from typer.testing import CliRunner

    from dpft.cli.commands import app

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


# ---- methods in the search space; the search under a time budget (issue 35, left open) ----

def _space_recipe(space, methods=None, **extra):
    from dpft.config.recipe import Recipe

    d = {"privacy": {"target_epsilon": 8.0, "delta": 1e-5}, "schedule": {"steps": 10},
         "tune": {"trials": {"mean": 3.0}, "space": space}, "methods": methods or []}
    for k, v in extra.items():
        d[k] = v
    return Recipe.model_validate(d)


def test_space_over_methods_that_keep_the_events():
    from dpft.run.tune import TuneError, check_tune_recipe

    ok = _space_recipe({"methods.rmt.method": {"choice": ["none", "rmt"]},
                        "methods.rmt.kappa": {"log_uniform": [1.01, 2.0]},
                        "methods.dp_adam_ac.adaptive_clip": {"choice": [False, True]},
                        "methods.dp_adam_ac.target_clip_rate": {"choice": [0.1, 0.3]},
                        "trainable.last_k": {"choice": [1, 2]}})
    check_tune_recipe(ok)  # no refusal
    check_tune_recipe(_space_recipe({}, methods=[{"name": "rmt", "method": "rmt"}]))  # a fixed method in the recipe
    for space, methods, match in [
        ({"methods.dpsft.rank": {"choice": [4, 8]}}, None, "privacy events of its own"),
        ({}, [{"name": "dpsft"}], "privacy events of its own"),
        ({"methods.rmt.diagnostics": {"choice": [False, True]}}, None, "NOT CERTIFIED"),
        ({}, [{"name": "rmt", "method": "rmt", "diagnostics": True}], "NOT CERTIFIED"),
        ({"methods.rmt.kapa": {"choice": [1.1]}}, None, "no field 'kapa'"),
        ({"methods.rmt.kappa": {"choice": [0.5]}}, None, "not valid"),
        ({"methods.nosuch.x": {"choice": [1]}}, None, "unknown method"),
    ]:
        with pytest.raises(TuneError, match=match):
            check_tune_recipe(_space_recipe(space, methods))
    with pytest.raises(ValueError, match="cannot be searched"):  # the schema: methods.<name>.<field> or a plain key
        _space_recipe({"methods.rmt": {"choice": [1]}})


def test_trial_recipe_sets_method_fields():
    from dpft.config.recipe import Recipe
    from dpft.run.tune_space import apply_hyperparameters

    r = _space_recipe({}, methods=[{"name": "rmt", "method": "rmt", "kappa": 1.2}])
    d = apply_hyperparameters(r.model_dump(mode="json"), {
        "optimizer.lr": 1e-3, "methods.rmt.kappa": 1.5, "methods.rmt.rank": 3.7,
        "methods.dp_adam_ac.adaptive_clip": True})
    t = Recipe.model_validate(d)
    assert t.optimizer.lr == 1e-3
    rmt = [m for m in d["methods"] if m["name"] == "rmt"][0]
    assert (rmt["kappa"], rmt["rank"], rmt["method"]) == (1.5, 4, "rmt")  # a log-uniform draw for an int is rounded
    assert [m for m in d["methods"] if m["name"] == "dp_adam_ac"][0]["adaptive_clip"] is True  # added when absent
    assert len(t.methods) == 2


def test_time_plan_per_expected_trial_and_quantile():
    from dpft.accounting.selection import KDistribution
    from dpft.run.timing import StepTiming
    from dpft.run.tune import TuneError, check_tune_recipe, configurations
    from dpft.run.tune_space import time_plan

    timing = StepTiming(micro_batch_seconds=1.0, update_seconds=0.1, checkpoint_seconds=0.0, checkpoints_per_step=0.0,
                        eval_row_seconds=0.01, setup_seconds=5.0, physical=16, length=64)
    r = _space_recipe({"batch.expected_batch_size": {"choice": [16, 64]}, "optimizer.lr": {"log_uniform": [1e-4, 1e-2]}},
                      schedule={"time_budget": "1h"})
    check_tune_recipe(r)
    dist = KDistribution.with_mean("truncated_negative_binomial", 3.0)
    steps, msg = time_plan(r, 900, 100, 2, dist, configurations(r), timing)
    share = 3600.0 / 3.0
    for b, t in steps.items():
        # a trial is evaluated twice (its last step, the search's score): never periodically (issue 44 item 1)
        used = 5.0 + t * timing.step_seconds(int(b), 900) + 2 * timing.eval_seconds(100)
        assert used <= share + 1e-6 < used + timing.step_seconds(int(b), 900)
    assert steps["16"] > steps["64"] > 0
    assert "budget / E[K] = 3" in msg and "P[K > 3]" in msg and "keeps its declared law" in msg
    r90 = r.model_copy(update={"tune": r.tune.model_copy(update={"trials": r.tune.trials.model_copy(
        update={"time_quantile": 0.9})})})
    steps90, msg90 = time_plan(r90, 900, 100, 2, dist, configurations(r90), timing)
    k90 = dist.tail_quantile(0.1)
    assert f"k_0.9 = {k90}" in msg90 and steps90["16"] < steps["16"]
    with pytest.raises(TuneError, match="time_budget chooses each trial's steps"):
        check_tune_recipe(_space_recipe({"schedule.steps": {"choice": [5, 10]}}, schedule={"time_budget": "1h"}))
    with pytest.raises(TrainingError_, match="fits no step"):
        time_plan(r.model_copy(update={"schedule": r.schedule.model_copy(update={"time_budget": 20.0})}), 900, 100, 2,
                  dist, configurations(r), timing)


from dpft.run.errors import TrainingError as TrainingError_  # noqa: E402


@pytest.mark.slow
def test_tiny_tune_over_a_method_under_a_time_budget(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """A search that switches RMT on/off and varies κ, under a time budget (probe replaced by a fixed
    measurement): every trial's events stay covered by the candidates (no uncovered entry in the ledger),
    T comes from the time plan, the chosen recipe carries the method's drawn settings."""
    import yaml

    from dpft.run import timing
    from dpft.run import tune as T

    fixed = timing.StepTiming(micro_batch_seconds=1.0, update_seconds=0.0, checkpoint_seconds=0.0,
                              checkpoints_per_step=0.0, eval_row_seconds=0.0, setup_seconds=1.0, physical=8, length=16)
    monkeypatch.setattr(timing, "probe_step_time", lambda r, k, **kw: fixed)
    rec = tune_recipe(tiny_model_dir, sst_like_files, **{
        "schedule.steps": "auto", "schedule.time_budget": 8.0,
        "tune": {"trials": {"distribution": "truncated_negative_binomial", "mean": 2.0, "eta": 1.0},
                 "score_fraction": 0.3,
                 "space": {"methods.rmt.method": {"choice": ["none", "rmt"]},
                           "methods.rmt.kappa": {"log_uniform": [1.01, 1.5]},
                           "batch.expected_batch_size": {"choice": [4, 8]}}}})
    rep = T.tune(rec, tmp_path / "t", progress=False, keep_trials=True)
    state = json.loads((tmp_path / "t" / "tune_private" / "state.json").read_text())
    # 4 s per expected trial: 1 s setup, 1 s a micro-batch of ≤ 8 rows, E⌈X/8⌉ of them for the Poisson batch X
    expect = {str(b): int((4.0 - 1.0) / fixed.step_seconds(b, state["n_fit"])) for b in (4, 8)}
    assert state["steps_by_batch"] == expect and all(t >= 1 for t in expect.values())
    assert all("PoissonSampledDpEvent" in json.dumps(t["events"]) for t in state["trials"])
    led = json.loads((tmp_path / "t" / "ledger.json").read_text())
    assert [e["phase"] for e in led["entries"]] == [f"tune:{state['search_id']}"]  # every trial covered: nothing composed on top
    chosen = yaml.safe_load((tmp_path / "t" / "recipe.yaml").read_text())
    hp = rep["chosen"]["hyperparameters"]
    rmt = [m for m in chosen["methods"] if m["name"] == "rmt"][0]
    assert rmt["method"] == hp["methods.rmt.method"] and rmt["kappa"] == pytest.approx(hp["methods.rmt.kappa"])
    assert chosen["schedule"]["steps"] == expect[str(chosen["batch"]["expected_batch_size"])]
    assert chosen["schedule"]["time_budget"] is None
    assert rep["epsilon"] <= 8.0


def test_audit_catches_a_method_that_claims_search_safety_wrongly(monkeypatch):
    """A plug-in declaring search_events_unchanged while its prepare records a release (or with no audit
    entry at all) fails the audit's method check; the built-ins pass it."""
    import dp_accounting as dpa
    from pydantic import BaseModel

    from dpft.audit import checks_tune as C
    from dpft.methods import base

    assert C._method_events().passed

    class LeakyCfg(BaseModel):
        on: bool = True

    class Leaky(base.Method):
        name = "leaky_search_test"
        config = LeakyCfg
        search_events_unchanged = True

        def prepare(self, run):
            run.ledger.record("leaky", dpa.GaussianDpEvent(3.0))

    monkeypatch.setitem(base._REGISTRY, Leaky.name, Leaky)
    assert not C._method_events().passed  # claimed, never audited
    monkeypatch.setitem(C.METHOD_ON, Leaky.name, {"on": True})
    chk = C._method_events()
    assert not chk.passed and "leaky_search_test" in chk.message and "ledger entries 1" in chk.message


def test_cli_tune_time_budget_refusals(tmp_path):
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    f = tmp_path / "r.yaml"
    f.write_text("task: {name: files, train_file: nowhere.csv}\nprivacy: {target_epsilon: 8}\nschedule: {steps: 50}\n"
                 "tune: {trials: {mean: 3}, space: {schedule.steps: {choice: [10, 20]}}}\n")
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o"), "--time-budget", "1h",
                                   "--set", "schedule.steps=5"])
    assert res.exit_code == 2 and "drop --set schedule.steps=5" in res.output
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o"), "--time-budget", "1h"])
    assert res.exit_code == 2 and "time_budget chooses each trial's steps" in res.output  # the recipe's steps: replaced
    res = CliRunner().invoke(app, ["tune", str(f), "-o", str(tmp_path / "o"), "--time-budget", "later"])
    assert res.exit_code == 2 and "30m" in res.output


@pytest.mark.slow
def test_a_head_search_computes_its_frozen_features_once(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """Issue 45 item 1: the frozen features are computed by the first trial and reused by every later one
    (same key), and removed when the search ends — not one forward pass of the encoder per trial."""
    from dpft.data import feature_store
    from dpft.run import tune as T

    calls = {"n": 0}
    real = feature_store.compute_split

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(feature_store, "compute_split", counting)
    import dpft.run.features as F

    monkeypatch.setattr(F, "compute_split", counting)
    rec = tune_recipe(tiny_model_dir, sst_like_files, **{"trainable.mode": "head", "model.pooling": "mean",
                                                         "perf.feature_cache": "on"})
    from dpft.run.loop import Trainer

    trials = {"n": 0}
    real_init = Trainer.__init__

    def counted(self, *a, **kw):
        trials["n"] += 1
        return real_init(self, *a, **kw)

    monkeypatch.setattr(Trainer, "__init__", counted)
    T.tune(rec, tmp_path / "t", progress=False)
    assert trials["n"] >= 2  # K = 2 under seed 7 (+ the released model's own evaluation, if any)
    assert calls["n"] == 2  # one pass over the train rows and one over the dev rows, for the whole search
    assert not list((tmp_path / "t").rglob("*.npy"))  # nothing of the cache in the run folder


@pytest.mark.slow
def test_a_search_over_the_full_and_lora_scopes_runs_each_as_its_bundle(tiny_model_dir, sst_like_files, tmp_path,
                                                                         monkeypatch):
    """``tune.space.trainable.mode: {choice: [full, lora]}`` (issue 45 item 4) end to end on the tiny model: every
    trial runs the scope it drew with that scope's batch and schedule (q = 1/8, 5 epochs), and one model is
    released with the search's ε."""
    from dpft.run import tune as T
    from dpft.run.loop import Trainer

    seen = []
    real_init = Trainer.__init__

    def spy(self, recipe, *a, **kw):
        seen.append((recipe.trainable.mode, recipe.batch.expected_batch_size, recipe.schedule.epochs))
        return real_init(self, recipe, *a, **kw)

    monkeypatch.setattr(Trainer, "__init__", spy)
    rec = tune_recipe(tiny_model_dir, sst_like_files, **{
        "model.pooling": "mean", "trainable.mode": "last_k", "trainable.last_k": 1,
        "tune": {"trials": {"distribution": "truncated_negative_binomial", "mean": 2.0, "eta": 1.0},
                 "score_fraction": 0.3, "space": {"trainable.mode": {"choice": ["full", "lora"]}}}})
    rep = T.tune(rec, tmp_path / "t", progress=False)
    modes = {m for m, _, _ in seen}
    assert seen and modes <= {"full", "lora"}
    assert all(e == 5.0 for m, _, e in seen if m in ("full", "lora"))
    assert rep["epsilon"] <= 8.0 + 1e-6
    assert (tmp_path / "t" / "model" / "config.json").is_file()  # the one chosen trial's model, released
