"""dpft tune with ``batch.expected_batch_size: auto`` / ``schedule.steps: auto`` (issue 35): (B, T) chosen
against the whole search's selection bound, the learning rate scaled, the accounting that of a typed-in
recipe, a resume reusing the first choice."""

import json
import math

import pytest

from dpft.accounting import budget
from dpft.accounting.selection import KDistribution, calibrate_search, candidate_event, selection_epsilon
from dpft.config.recipe import Recipe
from dpft.run import tune as T
from dpft.run import tune_space as S


def _recipe(space=None, **sections):
    d = {"privacy": {"target_epsilon": 8.0, "delta": 1e-5}, "batch": {"expected_batch_size": "auto"},
         "schedule": {"steps": "auto"}, "optimizer": {"lr": 4e-4, "head_lr": 1e-2},
         "tune": {"trials": {"mean": 3.0}, "space": space if space is not None else
                  {"optimizer.lr": {"log_uniform": [1e-4, 1e-3]}, "privacy.clipping.max_norm": {"choice": [0.5, 1.0]}}}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return Recipe.model_validate(d)


def test_rule_is_train_auto_with_the_search_sigma(monkeypatch):
    """Same candidates as dpft train's auto, σ of each from search_sigma (here a stand-in), the argmin of
    σ/B chosen; the recipe's lr and the searched lr range scaled by √(B/256), head_lr not; the choice is
    a recipe with numbers (no auto, no compute budget left)."""
    seen = []

    def fake(q, t, eps, delta, dist, score_sigma):
        seen.append((q, t, eps, delta, dist.mean(), score_sigma))
        return 0.4 + 40.0 * q  # grows with q, slower than B: the largest B wins
    monkeypatch.setattr(S, "search_sigma", fake)
    r = _recipe()
    n, dist = 1000, KDistribution.with_mean("truncated_negative_binomial", 3.0)
    r2, auto, msg = S.resolve_search_auto(r, n, dist, 10.0)
    ref = budget.choose_batch_and_steps(n, 8.0, 1e-5, None, sigma_for=lambda q, t: 0.4 + 40.0 * q)
    assert [(x["batch"], x["steps"]) for x in auto["rows"]] == [(x["batch"], x["steps"]) for x in ref.rows]
    assert [(q, t) for q, t, *_ in seen] == [(x["batch"] / n, x["steps"]) for x in ref.rows]
    # the search's ε, δ, law of K and score noise
    assert all(s[2:] == pytest.approx((8.0, 1e-5, 3.0, 10.0)) for s in seen)
    best = min(auto["rows"], key=lambda x: x["sigma"] / x["batch"])
    assert (auto["batch"], auto["steps"], auto["sigma"]) == (best["batch"], best["steps"], best["sigma"])
    assert (r2.batch.expected_batch_size, r2.schedule.steps) == (auto["batch"], auto["steps"])
    assert r2.schedule.compute_budget is None and r2.schedule.epochs is None
    scale = math.sqrt(auto["batch"] / 256)
    assert auto["lr_scale"] == pytest.approx(scale)
    assert r2.optimizer.lr == pytest.approx(4e-4 * scale) and r2.optimizer.head_lr == 1e-2
    assert r2.tune.space["optimizer.lr"]["log_uniform"] == pytest.approx([1e-4 * scale, 1e-3 * scale])
    assert r2.tune.space["privacy.clipping.max_norm"] == {"choice": [0.5, 1.0]}
    assert "WHOLE search" in msg and f"B = {auto['batch']}" in msg and "treated as public" in msg
    assert not S.search_auto(r2) and T.configurations(r2) == [{}]
    # B given, steps auto: T = budget / B, the learning rate untouched
    r3, a3, _ = S.resolve_search_auto(_recipe(batch={"expected_batch_size": 64}, schedule={"compute_budget": 6400}),
                                      n, dist, 10.0)
    assert (a3["batch"], a3["steps"], a3["lr_scale"], r3.optimizer.lr) == (64, 100, 1.0, 4e-4)
    assert T.configurations(r3) == [{}] and T._steps_and_q(r3, {}, n) == (64 / n, 100)  # the plan tune() checks
    with pytest.raises(S.BudgetError, match="exceeds the 37 fit rows"):
        S.resolve_search_auto(_recipe(batch={"expected_batch_size": 64}), 37, dist, 10.0)
    # a resume: the saved choice, nothing recomputed
    monkeypatch.setattr(S, "search_sigma", lambda *a: pytest.fail("recomputed on resume"))
    r4, a4, msg4 = S.resolve_search_auto(r, n, dist, 10.0, done=json.loads(json.dumps(auto)))
    assert r4 == r2 and a4 == json.loads(json.dumps(auto)) and "resumed" in msg4


def test_chosen_sigma_is_the_typed_in_calibration():
    """The choice's σ_trial is exactly what dpft tune calibrates for a recipe with (B, T) typed in, the
    search's ε meets the target, and it is larger than one run's σ at the same ε (the search's bound)."""
    r = _recipe(schedule={"compute_budget": 400})
    n, dist = 200, KDistribution.with_mean("truncated_negative_binomial", 3.0)
    r2, auto, _ = S.resolve_search_auto(r, n, dist, 10.0)
    assert (auto["batch"], auto["steps"]) == (8, 50)  # budget 400 < 800: T ≥ 400 // 8 = 50 leaves only B = 8
    typed = Recipe.model_validate({**r.model_dump(mode="json"), "batch": {"expected_batch_size": 8},
                                   "schedule": {"steps": 50}, "optimizer": {"lr": 4e-4 * math.sqrt(8 / 256),
                                                                            "head_lr": 1e-2}})
    plans = [T._steps_and_q(typed, c, n) for c in T.configurations(typed)]
    sig, bound = calibrate_search(8.0, 1e-5, dist, plans, 10.0)
    assert plans == [(8 / n, 50)] and sig == [auto["sigma"]]
    eps = selection_epsilon([candidate_event(auto["sigma"], 8 / n, 50, 10.0)], dist, 1e-5).epsilon
    assert 7.9 < eps <= 8.0
    assert auto["sigma"] > budget._sigma_rdp(8 / n, 50, 8.0, 1e-5)


@pytest.mark.parametrize("space,sections,match", [
    ({"batch.expected_batch_size": {"choice": ["auto", 256]}}, {"batch": {"expected_batch_size": 256}},
     "'auto' among the choices is not supported"),
    ({"batch.expected_batch_size": {"choice": [64, 256]}}, {}, "auto and searched in tune.space"),
    ({"schedule.steps": {"choice": [10, 20]}}, {}, "remove schedule.steps/epochs"),
    ({}, {"schedule": {"steps": None, "time_budget": "1h"}}, "auto with a time budget is not supported"),
])
def test_auto_refusals_before_loading(space, sections, match):
    r = _recipe(space, **sections)
    with pytest.raises(T.TuneError, match=match):
        T.check_tune_recipe(r)


def test_steps_auto_beside_epochs_is_refused_by_the_recipe():
    """The recipe itself refuses a length given twice (config/refusals.py ``schedule.steps:both_lengths``)."""
    with pytest.raises(ValueError, match="not both: the number of noisy steps has one rule"):
        _recipe({}, batch={"expected_batch_size": 64}, schedule={"epochs": 2})


def test_auto_accepted_forms():
    T.check_tune_recipe(_recipe())  # both auto
    T.check_tune_recipe(_recipe(schedule={"steps": 100}))  # B auto, T given
    T.check_tune_recipe(_recipe(batch={"expected_batch_size": 64}))  # T auto, B given
    r = Recipe.model_validate(__import__("yaml").safe_load(open("recipes/tune-auto-minilm.yaml")))
    T.check_tune_recipe(r)
    assert S.search_auto(r) and set(r.tune.space) == {"optimizer.lr", "optimizer.head_lr", "privacy.clipping.max_norm"}


def _auto_recipe(model_dir, files, typed=None):
    from test_tune import tune_recipe

    space = {"optimizer.lr": {"log_uniform": [1e-3, 1e-1]}, "privacy.clipping.max_norm": {"choice": [0.5, 1.0]}}
    extra = {"batch.expected_batch_size": "auto", "schedule.steps": "auto", "schedule.compute_budget": 32,
             "optimizer.lr": 1e-2}
    if typed:  # the same search with the auto choice typed in: (B, T) and the scaled learning rates
        s = typed["lr_scale"]
        space["optimizer.lr"] = {"log_uniform": [1e-3 * s, 1e-1 * s]}
        extra = {"batch.expected_batch_size": typed["batch"], "schedule.steps": typed["steps"],
                 "optimizer.lr": 1e-2 * s}
    extra["tune"] = {"trials": {"distribution": "truncated_negative_binomial", "mean": 2.0, "eta": 1.0},
                     "score_fraction": 0.3, "space": space}
    return tune_recipe(model_dir, files, **extra)


@pytest.mark.slow
def test_tiny_auto_search_equals_typed_in_and_resume_reuses(tiny_model_dir, sst_like_files, tmp_path, monkeypatch,
                                                            capsys):
    """End to end: an auto search interrupted after its first trial resumes with the first choice (the
    chooser is never called again); its released ledger, accounting table and trial draws are those of
    the same search with the chosen numbers typed in."""
    from dpft.run.loop import Trainer

    rec = _auto_recipe(tiny_model_dir, sst_like_files)
    out = tmp_path / "auto"
    real_run, calls = Trainer.run, {"n": 0}

    def run_once(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_run(self)

    monkeypatch.setattr(Trainer, "run", run_once)
    with pytest.raises(KeyboardInterrupt):  # K = 2 under seed 7
        T.tune(rec, out, progress=True)
    said = capsys.readouterr().err
    assert "auto (search): B = 8, T = 4 steps per trial" in said and "WHOLE search" in said
    state = json.loads((out / "tune_private" / "state.json").read_text())
    auto = state["auto"]
    assert (auto["batch"], auto["steps"]) == (8, 4) and state["sigmas"] == [auto["sigma"]]
    monkeypatch.setattr(Trainer, "run", real_run)
    monkeypatch.setattr(S, "search_sigma", lambda *a: pytest.fail("the choice was recomputed on resume"))
    monkeypatch.setattr(T, "calibrate_search", lambda *a, **k: pytest.fail("recalibrated on resume"))
    rep = T.tune(rec, out, resume=True, progress=True)
    assert "auto (search) (resumed: the choice made when the search started): B = 8, T = 4" in capsys.readouterr().err
    monkeypatch.undo()
    assert rep["auto"]["batch"] == 8 and rep["epsilon"] <= 8.0
    chosen = __import__("yaml").safe_load((out / "recipe.yaml").read_text())
    assert chosen["batch"]["expected_batch_size"] == 8 and chosen["schedule"]["steps"] == 4
    typed = _auto_recipe(tiny_model_dir, sst_like_files, typed=auto)
    rep2 = T.tune(typed, tmp_path / "typed", progress=False)
    state2 = json.loads((tmp_path / "typed" / "tune_private" / "state.json").read_text())
    assert (out / "ledger.json").read_text() == (tmp_path / "typed" / "ledger.json").read_text()
    assert rep["selection"] == rep2["selection"] and rep["epsilon"] == rep2["epsilon"]
    assert T.summary(rep).splitlines()[0] == T.summary(rep2).splitlines()[0]
    table = [ln for ln in (out / "report.md").read_text().splitlines() if ln.startswith("|")]
    assert table == [ln for ln in (tmp_path / "typed" / "report.md").read_text().splitlines() if ln.startswith("|")]
    assert state2["sigmas"] == state["sigmas"] and state2["k"] == state["k"]
    assert [t["hyperparameters"] for t in state2["trials"]] == [t["hyperparameters"] for t in state["trials"]]
    assert rep2["auto"] is None and "batch/steps auto" in (out / "report.md").read_text()


@pytest.mark.slow
def test_audit_auto_search_check_and_its_planted_bug():
    """The audit's check passes, and (B, T) chosen against one run's ε instead of the search's bound (an
    overspend) is caught; the bug is registered with the suite and planted through bug_planter."""
    from dpft.audit import checks_tune as C
    from dpft.audit import planted, suite

    assert "auto_single_run_sigma" in C.PLANTED and "auto_single_run_sigma" in planted.ALL
    assert ("dpft.audit.checks_tune", "tune_checks", C.PLANTED) in suite.OPTIONAL_CHECKS
    ok = C._auto_search(None)
    assert ok.passed, ok.message
    bad = C._auto_search("auto_single_run_sigma")
    assert not bad.passed and bad.stats["epsilon"] > 8.0, bad.message
    assert S.search_sigma.__module__ == "dpft.run.tune_space"  # the plant was undone
