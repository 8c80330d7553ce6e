"""Budget-aware defaults (issue 35 item 3): (B, T) at fixed B·T minimising σ/B; the lr rule."""

import math

import pytest

from dpft.accounting.budget import BudgetError, choose_batch_and_steps, scaled_lr


def test_choice_minimises_noise_per_example_among_candidates():
    c = choose_batch_and_steps(2000, 4.0, 1e-5, budget=6000)
    assert c.batch * c.steps == pytest.approx(6000, rel=0.1)
    assert c.noise_per_example == min(r["noise_per_example"] for r in c.rows)
    assert all(r["steps"] >= min(100, 6000 // 8) for r in c.rows)
    assert "σ/B" in c.explain()


def test_fixed_steps_and_errors():
    c = choose_batch_and_steps(1000, 8.0, 1e-5, budget=5000, steps=50)
    assert (c.batch, c.steps) == (100, 50)
    with pytest.raises(BudgetError):
        choose_batch_and_steps(1, 8.0, 1e-5)


def test_lr_rule():
    assert scaled_lr(1e-3, 1024, "adamw") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 64, "sgd") == pytest.approx(2.5e-4)


def test_resolver_rewrites_recipe_and_refuses_non_private():
    from dpft.config import Recipe
    from dpft.run.auto import resolve_auto

    r = Recipe.model_validate({"batch": {"expected_batch_size": "auto"}, "schedule": {"steps": "auto",
                                                                                    "compute_budget": 3000},
                               "privacy": {"target_epsilon": 3.0}})
    r2, msg = resolve_auto(r, n=1000)
    assert isinstance(r2.batch.expected_batch_size, int) and isinstance(r2.schedule.steps, int)
    assert r2.optimizer.lr == pytest.approx(r.optimizer.lr * math.sqrt(r2.batch.expected_batch_size / 256))
    assert "auto: B =" in msg and "learning rate" in msg
    assert resolve_auto(Recipe(), n=1000) == (Recipe(), None)
    with pytest.raises(BudgetError, match="target_epsilon"):
        resolve_auto(r.model_copy(update={"privacy": r.privacy.model_copy(update={"enabled": False})}), n=1000)
