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


def test_resolver_rewrites_recipe_and_gives_non_private_the_private_choice():
    from dpft.config.recipe import Recipe
    from dpft.run.auto import resolve_auto

    r = Recipe.model_validate({"batch": {"expected_batch_size": "auto"}, "schedule": {"steps": "auto",
                                                                                    "compute_budget": 3000},
                               "privacy": {"target_epsilon": 3.0}})
    r2, msg = resolve_auto(r, n=1000)
    assert isinstance(r2.batch.expected_batch_size, int) and isinstance(r2.schedule.steps, int)
    assert r2.optimizer.lr == pytest.approx(r.optimizer.lr * math.sqrt(r2.batch.expected_batch_size / 256))
    assert "auto: B =" in msg and "learning rate" in msg
    assert resolve_auto(Recipe(), n=1000) == (Recipe(), None)
    # --no-dp (issue 44 item 9): the private run's (B, T, lr) at the recipe's target ε, said as such
    ref, msg = resolve_auto(r.model_copy(update={"privacy": r.privacy.model_copy(update={"enabled": False})}), n=1000)
    assert not ref.privacy.enabled
    got = (ref.batch.expected_batch_size, ref.schedule.steps, ref.optimizer.lr)
    assert got == (r2.batch.expected_batch_size, r2.schedule.steps, r2.optimizer.lr)
    assert msg.startswith(f"non-private reference of the run dpft train would make at ε = 3: B = {got[0]}, T = {got[1]}")
    with pytest.raises(BudgetError, match="target_epsilon"):  # no target ε to take the choice at
        resolve_auto(r.model_copy(update={"privacy": r.privacy.model_copy(update={"enabled": False,
                                                                                  "target_epsilon": None})}), n=1000)


# ---- time budget (issue 35 item 3, left open: "a time budget measured on the first step") ----

def _timing(**kw):
    from dpft.run.timing import StepTiming

    base = dict(micro_batch_seconds=0.5, update_seconds=0.1, checkpoint_seconds=0.2, checkpoints_per_step=0.02,
                eval_row_seconds=0.001, setup_seconds=3.0, physical=32, length=128, repeats=3)
    base.update(kw)
    return StepTiming(**base)


def test_durations_and_the_schedule_field():
    from dpft.config.recipe import Recipe
    from dpft.config.tune import parse_duration

    assert [parse_duration(v) for v in ("90s", "30m", "2h", "1h30m", "1.5h", 45, "45")] == \
        [90.0, 1800.0, 7200.0, 5400.0, 5400.0, 45.0, 45.0]
    for bad in ("soon", "1h30", "0", "-5m", True):
        with pytest.raises(ValueError):
            parse_duration(bad)
    r = Recipe.model_validate({"schedule": {"time_budget": "30m"}, "privacy": {"target_epsilon": 3.0}})
    assert r.schedule.time_budget == 1800.0 and r.schedule.steps == "auto"  # a time budget alone means steps: auto
    for sched in ({"time_budget": "30m", "steps": 100}, {"time_budget": "30m", "epochs": 1.0},
                  {"time_budget": "30m", "steps": "auto", "compute_budget": 1000}):
        with pytest.raises(ValueError, match="time_budget"):
            Recipe.model_validate({"schedule": sched})


def test_steps_in_time_never_overruns():
    from dpft.accounting.budget import steps_in_time

    for secs, s, e, every in [(100.0, 0.7, 2.0, 50), (100.0, 0.7, 2.0, 3), (10.0, 3.0, 0.0, None), (5.0, 1.0, 1.0, 1)]:
        t = steps_in_time(secs, s, e, every)
        evals = (t // every if every else 0) + 1
        assert t * s + evals * e <= secs + 1e-9
        t1 = t + 1  # one more step would not fit when each step carries its share e/every of the evaluations
        assert t1 * (s + (e / every if every else 0.0)) + e > secs
    assert steps_in_time(5.0, 1.0, 6.0, 1) == 0


def test_choose_for_time_fits_and_minimises_noise():
    from dpft.accounting.budget import choose_for_time

    t = _timing()
    c = choose_for_time(2000, 3.0, 1e-5, 600.0, t.step_seconds, t.eval_seconds(800), 50)
    assert all(r["steps"] * t.step_seconds(r["batch"]) <= 600.0 for r in c.rows)
    assert c.noise_per_example == min(r["noise_per_example"] for r in c.rows)
    assert len(c.rows) > 2 and "s of steps" in c.explain()
    assert all(r["steps"] >= min(100, c.rows[0]["steps"]) for r in c.rows)  # the compute budget's floor on T
    # a budget that gives the smallest B fewer than 100 steps keeps those steps: B grows only while T does not fall
    slow = _timing(micro_batch_seconds=8.0)
    c2 = choose_for_time(2000, 3.0, 1e-5, 180.0, slow.step_seconds, 0.0, None)
    assert c2.steps == c2.rows[0]["steps"] < 100 and c2.batch == 32  # B = 8, 16, 32 fill one micro-batch alike
    fixed = choose_for_time(2000, 3.0, 1e-5, 600.0, t.step_seconds, 0.0, None, batch=64)
    assert fixed.batch == 64 and fixed.steps == int(600.0 / t.step_seconds(64))  # 2 micro-batches a step
    with pytest.raises(BudgetError, match="does not fit one step"):
        choose_for_time(2000, 3.0, 1e-5, 0.5, t.step_seconds, 0.0, None)


def test_resolve_time_budget_with_a_measured_step():
    from dpft.config.recipe import Recipe, dump_recipe, load_recipe
    from dpft.run.auto import resolve_auto

    r = Recipe.model_validate({"batch": {"expected_batch_size": "auto"}, "schedule": {"time_budget": "10m"},
                               "privacy": {"target_epsilon": 3.0}})
    t = _timing()
    r2, msg = resolve_auto(r, n=5000, num_labels=2, n_dev=800, timing=t)
    b, steps = r2.batch.expected_batch_size, r2.schedule.steps
    assert isinstance(b, int) and isinstance(steps, int) and r2.schedule.time_budget is None
    evals = steps // r.eval.every_steps + 1
    assert t.setup_seconds + steps * t.step_seconds(b, 5000) + evals * t.eval_seconds(800) <= 600.0
    assert "synthetic rows (no private data)" in msg and "σ is calibrated for this (B, T)" in msg and "≈" in msg
    assert r2.optimizer.lr == pytest.approx(r.optimizer.lr * math.sqrt(b / 256))
    load_recipe(None, __import__("yaml").safe_load(dump_recipe(r2)))  # the resolved recipe is a valid recipe
    # a fixed batch keeps B (and its learning rate); only T is chosen
    r3, _ = resolve_auto(r.model_copy(update={"batch": r.batch.model_copy(update={"expected_batch_size": 64})}),
                         n=5000, num_labels=2, n_dev=800, timing=t)
    assert r3.batch.expected_batch_size == 64 and r3.optimizer.lr == r.optimizer.lr
    # a non-private reference run with a time budget: B given, T fits
    nodp = r3.model_copy(update={"privacy": r.privacy.model_copy(update={"enabled": False}),
                                 "batch": r3.batch, "schedule": r.schedule})
    r4, msg4 = resolve_auto(nodp, n=5000, num_labels=2, n_dev=800, timing=t)
    assert r4.schedule.steps >= r3.schedule.steps and "non-private" in msg4
    with pytest.raises(BudgetError, match="torchrun"):
        __import__("os").environ["WORLD_SIZE"] = "2"
        try:
            resolve_auto(r, n=5000, num_labels=2, n_dev=800, timing=t)
        finally:
            del __import__("os").environ["WORLD_SIZE"]


def test_resume_keeps_the_first_choice(tmp_path, monkeypatch):
    import json

    from dpft.config.recipe import Recipe
    from dpft.run import auto, timing

    r = Recipe.model_validate({"batch": {"expected_batch_size": "auto"}, "schedule": {"time_budget": "10m"},
                               "privacy": {"target_epsilon": 3.0}})
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"recipe": {
        "batch": {"expected_batch_size": 128}, "schedule": {"steps": 321}, "optimizer": {"lr": 3.5e-4}}}))
    monkeypatch.setattr(timing, "probe_step_time", lambda *a, **k: pytest.fail("the time budget was re-measured"))
    r2, msg = auto.resolve_auto(r, n=5000, num_labels=2, resume_dir=tmp_path)
    assert (r2.batch.expected_batch_size, r2.schedule.steps, r2.optimizer.lr) == (128, 321, 3.5e-4)
    assert "not re-measured" in msg


def test_probe_times_synthetic_rows_only(tiny_model_dir, sst_like_files, monkeypatch):
    """The probe builds the run's parts on public synthetic rows: the task's rows are never read, the
    run's secret randomness is never created, nothing is written; with a fake clock every interval is 1 s."""
    from conftest import files_recipe

    import dpft.data.tasks as tasks
    from dpft.privacy import randomness
    from dpft.run.timing import probe_step_time, synthetic_rows

    rec = files_recipe(tiny_model_dir, sst_like_files, **{"privacy.engine": "bookkeeping",
                                                          "batch.expected_batch_size": "auto"})
    monkeypatch.setattr(tasks, "load_task", lambda *a, **k: pytest.fail("the probe read the task's rows"))
    real = randomness.Randomness.__init__

    def public_only(self, seed=None):
        assert seed is not None, "the probe created a secret key"
        real(self, seed)

    monkeypatch.setattr(randomness.Randomness, "__init__", public_only)
    ticks = iter(range(1000))
    t = probe_step_time(rec, 2, repeats=2, clock=lambda: float(next(ticks)))
    assert (t.setup_seconds, t.micro_batch_seconds, t.update_seconds, t.checkpoint_seconds) == (1.0, 1.0, 1.0, 1.0)
    assert t.eval_row_seconds == pytest.approx(1.0 / t.physical) and t.repeats == 2
    assert (t.physical, t.length) == (rec.batch.max_physical_batch_size, rec.model.max_length)
    assert t.step_seconds(3 * t.physical) == pytest.approx(3 + 1 + t.checkpoints_per_step)
    # over N rows the Poisson batch X ~ Bin(N, B/N) needs E⌈X/P⌉ micro-batches: more than B/P when B = 3P
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.binomial(1000, 3 * t.physical / 1000, size=200_000)
    assert t.micro_batches(3 * t.physical, 1000) == pytest.approx(np.ceil(x / t.physical).mean(), rel=5e-3)
    assert t.micro_batches(3 * t.physical, 1000) > 3
    from transformers import AutoTokenizer

    rows = synthetic_rows(AutoTokenizer.from_pretrained(tiny_model_dir), 4, 16, 2)
    assert rows == synthetic_rows(AutoTokenizer.from_pretrained(tiny_model_dir), 4, 16, 2)  # public seed
    assert all(len(x["input_ids"]) == 16 and x["label"] in (0, 1) for x in rows)


@pytest.mark.slow
def test_cli_train_time_budget_prints_its_choice_and_runs_it(tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """A newcomer's command with --time-budget (the probe replaced by a fixed measurement): the printed
    choice, σ calibrated for it, and the run does the T it chose."""
    import json

    from typer.testing import CliRunner

    from dpft.cli.commands import app
    from dpft.run import timing

    monkeypatch.setattr(timing, "probe_step_time", lambda r, k, **kw: _timing(
        micro_batch_seconds=2.0, update_seconds=0.1, setup_seconds=1.0, eval_row_seconds=0.0, physical=8, length=16))
    base = ["train", "--model", str(tiny_model_dir), "--train-file", str(sst_like_files["csv"]), "--epsilon", "8",
            "--delta", "1e-3", "--max-length", "16", "--max-physical-batch-size", "8"]
    res = CliRunner().invoke(app, base + ["--time-budget", "10s", "--steps", "5", "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--time-budget chooses the number of steps: drop --steps 5" in res.output
    res = CliRunner().invoke(app, base + ["--time-budget", "soon", "-o", str(tmp_path / "y")])
    assert res.exit_code == 2 and "30m" in res.output
    out = tmp_path / "run"
    res = CliRunner().invoke(app, base + ["--time-budget", "10s", "-o", str(out)])
    assert res.exit_code == 0, res.output
    steps = json.loads((out / "report.json").read_text())
    rec = __import__("yaml").safe_load((out / "recipe.yaml").read_text())
    t = rec["schedule"]["steps"]
    assert f"T = {t} steps" in res.output and "time budget 10 s" in res.output and "σ =" in res.output
    assert rec["schedule"]["time_budget"] is None and 1 <= t <= 4  # 9 s left after setup, ≥ 2.1 s a step
    assert steps["privacy"]["epsilon"] <= 8.0


def test_python_time_budget_replaces_the_recipes_steps():
    """dpft.train/tune(..., time_budget=...): the recipe's steps are chosen by the budget."""
    import dpft

    r = dpft._recipe_of({"schedule": {"steps": 500}, "privacy": {"target_epsilon": 3.0}},
                        dpft._with_time_budget(None, "45m"))
    assert (r.schedule.time_budget, r.schedule.steps, r.schedule.epochs) == (2700.0, "auto", None)
    assert dpft._with_time_budget({"optimizer.lr": 1e-3}, None) == {"optimizer.lr": 1e-3}


def test_cli_compute_budget_sets_auto_batch_and_steps_and_refuses_typed_steps(tiny_model_dir, sst_like_files, tmp_path):
    """--compute-budget N: schedule.compute_budget = N with T (and B unless --batch-size) auto; a typed
    --steps is refused before any loading, naming the flag to drop."""
    from typer.testing import CliRunner

    from dpft.cli.commands import _compute_budget_choice, app

    ov, origins = {"schedule.steps": 150}, {"schedule.steps": "recipe"}
    _compute_budget_choice(ov, origins, 4000)
    assert ov == {"schedule.steps": "auto", "schedule.epochs": None, "batch.expected_batch_size": "auto"}
    ov, origins = {"batch.expected_batch_size": 64}, {"batch.expected_batch_size": "--batch-size 64"}
    _compute_budget_choice(ov, origins, 4000)
    assert ov["batch.expected_batch_size"] == 64 and ov["schedule.steps"] == "auto"
    res = CliRunner().invoke(app, ["train", "--model", str(tiny_model_dir), "--train-file", str(sst_like_files["csv"]),
                                   "--epsilon", "8", "--compute-budget", "4000", "--steps", "5",
                                   "-o", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--compute-budget chooses the number of steps: drop --steps 5" in res.output
