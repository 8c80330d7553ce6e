"""Issue 23 finding 6: ``dpft audit`` walks the Trainer's own step with the recipe's own N, q, T,
σ — user level included — and catches the planted bugs of that path."""

from __future__ import annotations

import pytest
import torch

from dpft.audit import planted
from dpft.audit import trainer_walk as tw
from dpft.audit.ways_in_session import STEPS_RULE, planted_session, session_plans, train_check
from dpft.session import core as session_core
from dpft.step.plan import planned_steps
from test_user_level import _recipe, _user_files


@pytest.fixture()
def user_recipe(tiny_model_dir, tmp_path):
    train, dev = _user_files(tmp_path)
    # C small enough that every row's and user's gradient is clipped (the check then binds)
    return _recipe(tiny_model_dir, train, dev, **{"privacy.clipping.max_norm": 1e-3})


@pytest.fixture()
def row_recipe(tiny_model_dir, tmp_path):
    train, dev = _user_files(tmp_path)
    return _recipe(tiny_model_dir, train, dev, **{"task.user_column": None, "privacy.clipping.max_norm": 1e-3,
                                                   "batch.expected_batch_size": 12})


def _failed(checks):
    return [c.name for c in checks if not c.passed]


def test_user_level_plan_counts_users_and_honest_walk_passes(user_recipe):
    t = tw.build_trainer(user_recipe)
    plan = tw.trainer_plan(t)
    assert plan["unit"] == "user" and plan["n"] == 30 and plan["q"] == pytest.approx(0.2)
    assert plan["steps"] == 3 and plan["sigma"] == pytest.approx(t.sigma) and plan["epsilon"] <= 4.0 + 1e-9
    before = {k: v.detach().clone() for k, v in t.params.items()}
    checks = tw.trainer_checks(t, plan)
    assert not _failed(checks), [c.row() for c in checks]
    sens = checks[0]
    assert sens.name == "Trainer step: leave-one-user-out sensitivity"
    assert 0.5e-3 < sens.stats["max_change"] <= 1e-3 * (1 + 1e-4)  # clipping binds: the check is not vacuous
    # the audit moved no weight, wrote no ledger entry of the run
    assert all(torch.equal(before[k], t.params[k]) for k in before) and t.ledger.steps == 0


def test_example_level_walk_passes(row_recipe):
    t = tw.build_trainer(row_recipe)
    plan = tw.trainer_plan(t)
    assert plan["unit"] == "example" and plan["n"] == 60
    checks = tw.trainer_checks(t, plan)
    assert not _failed(checks), [c.row() for c in checks]
    assert checks[0].stats["rows"] > t.recipe.batch.max_physical_batch_size  # several micro-batches


def test_planted_row_level_user_recipe_is_caught(user_recipe):
    """The audit calibrated over rows (N = 60, q = 0.1) for a recipe the Trainer runs over users
    (N = 30, q = 0.2): the sampling rate, the noise std and the ledger event disagree."""
    t = tw.build_trainer(user_recipe)
    plan = tw.row_level_plan(t)
    assert plan["n"] == 60
    bad = _failed(tw.trainer_checks(t, plan))
    assert "Trainer step: user sampling rate q" in bad and "Trainer step: ledger event = plan" in bad
    assert "Trainer step: noise std σC" in bad


def test_planted_user_clipping_broken_is_caught(user_recipe):
    t = tw.build_trainer(user_recipe)
    plan = tw.trainer_plan(t)
    with planted.plant(tw.USER_CLIPPING_BROKEN):
        bad = _failed(tw.trainer_checks(t, plan))
    assert bad == ["Trainer step: leave-one-user-out sensitivity"]


@pytest.mark.slow
def test_cli_plant_row_level_user_recipe_fails_and_says_planted(user_recipe, tmp_path):
    """``dpft audit RECIPE --plant row_level_user_recipe``: exit 1, the report headed PLANTED, the
    plan (unit, N, q, σ, T) printed, the Trainer-walk checks failed."""
    import json

    from typer.testing import CliRunner

    from dpft.cli.commands import app
    from dpft.config.recipe import dump_recipe

    y = tmp_path / "user.yaml"
    y.write_text(dump_recipe(user_recipe))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["audit", str(y), "--quick", "--out", str(out), "--plant", "row_level_user_recipe"])
    assert res.exit_code == 1, res.output
    assert "plan: unit example, N = 60, q = 0.1" in res.output  # the planted (row) plan, caught below
    md = (out / "audit.md").read_text()
    assert "PLANTED BUG `row_level_user_recipe`" in md and "N = 60 examples" in md
    d = json.loads((out / "audit.json").read_text())
    bad = {c["check"] for c in d["whitebox"] if c["verdict"] != "pass"}
    assert {"Trainer step: user sampling rate q", "Trainer step: ledger event = plan"} <= bad
    assert d["planted"] == "row_level_user_recipe" and d["verdict"] == "FAIL" and d["seconds"] > 0
    res = CliRunner().invoke(app, ["audit", str(y), "--quick", "--out", str(out), "--plant", "no-such-bug"])
    assert res.exit_code == 2 and "unknown planted bug" in res.output


def test_dpft_train_plans_like_the_session(tiny_model_dir, tmp_path):
    """issue 46: `dpft train` reaches the session unchanged, its plan step/plan.py's for its settings from epochs
    (1.1 · 50 / 5 = 11.000000000000002 in floating point: T = 11), as every way in's; its T is the session's count,
    so the session's planted steps rule (12 steps) is caught on dpft train's row too, as `dpft audit RECIPE
    --plant session_steps_rule` builds the Trainer (audit/suite.py; the Python ways in: tests/test_audit_ways_in.py)."""
    train, dev = _user_files(tmp_path)
    rec = _recipe(tiny_model_dir, train, dev, **{"task.user_column": None, "task.max_train_examples": 50,
                                                 "batch.expected_batch_size": 5, "schedule.steps": None,
                                                 "schedule.epochs": 1.1})
    with session_plans() as seen:
        t = tw.build_trainer(rec)
    plan = tw.trainer_plan(t)
    (ok,) = train_check(t, plan, seen)
    assert plan["n"] == 50 and 1.1 * 50 / 5 > 11, plan
    assert ok.passed and plan["steps"] == ok.stats["steps"] == 11 and "T = 11" in ok.message, ok.row()
    with session_plans() as planted_seen, planted_session(STEPS_RULE):
        bad_t = tw.build_trainer(rec)
    (caught,) = train_check(bad_t, tw.trainer_plan(bad_t), planted_seen)
    assert not caught.passed and bad_t.total_steps == 12, caught.row()
    assert "T = 12, σ" in caught.message and "(step/plan.py: N = 50, q = 0.1, T = 11" in caught.message
    assert session_core.planned_steps is planned_steps  # undone afterwards
    assert ok.name == "session: dpft train reaches the session unchanged"
    (bad,) = train_check(t, plan, seen + seen)  # two plans for one loop: not the session's one plan
    assert not bad.passed and "2 session plans" in bad.message
    assert train_check(tw.build_trainer(_recipe(tiny_model_dir, train, dev)), plan | {"unit": "user"}, []) == []


@pytest.mark.parametrize("plant", [None, STEPS_RULE])
def test_dpft_audit_plants_the_session_steps_rule_on_dpft_trains_row(plant, tiny_model_dir, tmp_path, monkeypatch):
    """`dpft audit RECIPE --plant session_steps_rule` builds dpft train's Trainer with the session's planted steps
    rule (audit/suite.py ``audit_recipe``): its row fails (T = 12, step/plan.py's 11); honest, it passes. The
    rest of the audit (``run_audit``: the Python ways in catch the same bug, tests/test_audit_ways_in.py) is
    stubbed here."""
    from dpft.audit import suite

    monkeypatch.setattr(suite, "run_audit", lambda sigma, c, q, delta, **k: suite.AuditReport(sigma, c, q, delta,
                                                                                              planted=k["planted"]))
    train, dev = _user_files(tmp_path)
    rec = _recipe(tiny_model_dir, train, dev, **{"task.user_column": None, "task.max_train_examples": 50,
                                                 "batch.expected_batch_size": 5, "schedule.steps": None,
                                                 "schedule.epochs": 1.1})
    cal, rep = suite.audit_recipe(rec, quick=True, planted=plant)
    (row,) = [c for c in rep.checks if c.name == "session: dpft train reaches the session unchanged"]
    assert row.passed is (plant is None) and rep.planted == plant, row.row()
    assert ("T = 12, σ" in row.message) is (plant is not None) and cal["steps"] == (11 if plant is None else 12)
    assert session_core.planned_steps is planned_steps  # undone afterwards
