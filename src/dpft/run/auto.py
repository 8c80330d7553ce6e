"""Resolve ``batch.expected_batch_size: auto`` / ``schedule.steps: auto`` into numbers before the run
is planned (the CLI and ``dpft tune`` call :func:`resolve_auto`; the search is accounting/budget.py).

With ``schedule.time_budget`` (``--time-budget``), T — and B when auto — are chosen so that the run
fits the wall-clock budget, from a step timed on synthetic rows before σ is calibrated
(run/timing.py says what is timed, what is not, and why nothing private is touched)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from dpft.run.scope import has_auto_scope, resolve_scope
from dpft.step.plan import planned_steps
from dpft.accounting.budget import (BudgetError, choose_batch_and_steps, choose_for_time, scaled_lr,
                                    steps_in_time)

__all__ = ["resolve_auto", "has_auto", "describe_seconds", "time_budget_refusal"]


def has_auto(recipe) -> bool:
    return (recipe.batch.expected_batch_size == "auto" or recipe.schedule.steps == "auto"
            or has_auto_scope(recipe))


def describe_seconds(s: float) -> str:
    """``95 s``, ``12.5 min``, ``2.25 h``."""
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.3g} min" if s < 7200 else f"{s / 3600:.3g} h"


def resolve_auto(recipe, n: Optional[int] = None, *, num_labels: Optional[int] = None, n_dev: int = 0,
                 timing=None, resume_dir: Optional[str | Path] = None) -> tuple[object, Optional[str]]:
    """``recipe`` with its ``auto`` fields chosen, and the explanation to print (None: nothing was auto).

    N is the training rows the run will see (``load_task``; given as ``n`` when known, with
    ``num_labels`` and ``n_dev`` for a time budget). ``timing``: a :class:`~dpft.run.timing.StepTiming`
    (default: measured by :func:`~dpft.run.timing.probe_step_time`). ``resume_dir``: a run being
    resumed; with a time budget its checkpoint's (B, T, lr) are kept (the budget is not re-measured,
    so a resume plans the same run and σ).

    Raises:
        BudgetError: a non-private run (with ``auto`` batch) with no target ε to take the choice at (with one:
            the private run's choice, :func:`_reference`), a causal-LM or user-level task,
            ``steps: auto`` with ``epochs``, no feasible (B, T), a time budget under torchrun — each
            naming the fix, before any model loading (the time probe loads one, after these checks)."""
    if not has_auto(recipe):
        return recipe, None
    if has_auto_scope(recipe):  # the scope first: its bundle may set B and T (run/scope.py)
        if n is None:
            n, n_dev, num_labels = _sizes(recipe)
        recipe, scope_msg = resolve_scope(recipe, n)
        if not has_auto(recipe):
            return recipe, scope_msg
        recipe, msg = resolve_auto(recipe, n, num_labels=num_labels, n_dev=n_dev, timing=timing,
                                   resume_dir=resume_dir)
        return recipe, scope_msg + ("\n" + msg if msg else "")
    r = recipe
    timed = r.schedule.time_budget is not None
    private = r.privacy.enabled and r.privacy.target_epsilon is not None and r.privacy.noise_multiplier is None
    if not private and not (timed and r.batch.expected_batch_size != "auto") and _nominal(r):
        return _reference(r, n, num_labels=num_labels, n_dev=n_dev, timing=timing, resume_dir=resume_dir)
    if not private and not (timed and r.batch.expected_batch_size != "auto"):
        raise BudgetError("batch/steps auto choose (B, T) for a target ε: set privacy.target_epsilon (and no "
                          "noise_multiplier), or give numbers")
    if r.task.name in ("text", "instruct", "seq2seq") or r.task.user_column:
        raise BudgetError("batch/steps auto support example-level classification tasks; give numbers for this task")
    if r.schedule.steps == "auto" and r.schedule.epochs is not None:
        raise BudgetError("schedule.steps: auto and schedule.epochs both set; keep one")
    if timed:
        return _resolve_time(r, n, num_labels, n_dev, timing, resume_dir, private)
    if n is None:
        n = _sizes(r)[0]
    b_auto, t_auto = r.batch.expected_batch_size == "auto", r.schedule.steps == "auto"
    fixed_t = None
    if not t_auto:
        fixed_t = planned_steps(n, 256, r.schedule.steps or None, r.schedule.epochs)
    choice = choose_batch_and_steps(n, r.privacy.target_epsilon, r.privacy.delta, r.schedule.compute_budget,
                                    batch=None if b_auto else r.batch.expected_batch_size,
                                    steps=None if t_auto else fixed_t)
    msg = choice.explain() + f"\n  N = {n} training examples; ε = {r.privacy.target_epsilon:g}, δ = {r.privacy.delta:g}"
    lr = r.optimizer.lr
    if b_auto:
        lr = scaled_lr(r.optimizer.lr, choice.batch, r.optimizer.name)
        msg += _lr_line(r, lr)
    return _resolved(r, choice.batch, choice.steps, lr), msg


def _nominal(r) -> bool:
    """A non-private run (``--no-dp``) whose recipe still names a target ε and no σ: its auto (B, T) can be
    the private run's at that ε (:func:`_reference`)."""
    p = r.privacy
    return not p.enabled and p.target_epsilon is not None and p.noise_multiplier is None


def _reference(r, n, **kw):
    """``--no-dp`` with batch/steps auto (issue 44 item 9): the non-private reference of the run the same
    command makes with DP — the B, T and scaled learning rate :func:`resolve_auto` chooses for this recipe at
    its nominal ``privacy.target_epsilon`` (``--epsilon``, or the default recipe's), so that "the same
    recipe without DP" is one flag. Nothing private is spent: the choice reads N (and a timed probe on
    synthetic rows under a time budget), as the private run's does.

    Returns ``(recipe, explanation)``: ``r`` (still non-private) with that (B, T, lr), and the private
    choice's explanation headed by the line that says whose choice it is."""
    priv = r.model_copy(update={"privacy": r.privacy.model_copy(update={"enabled": True})})
    chosen, msg = resolve_auto(priv, n, **kw)
    b, t, lr = chosen.batch.expected_batch_size, chosen.schedule.steps, chosen.optimizer.lr
    head = (f"non-private reference of the run dpft train would make at ε = {r.privacy.target_epsilon:g}: "
            f"B = {b}, T = {t}, lr = {lr:.3g} (its auto choice, below; this run adds no noise and has NO privacy "
            "guarantee)")
    return _resolved(r, b, t, lr), head + ("\n" + msg if msg else "")


def _resolved(r, b: int, t: int, lr: float):
    """``r`` with B, T and the learning rate as chosen (no epochs, no time budget left to resolve)."""
    return r.model_copy(update={
        "batch": r.batch.model_copy(update={"expected_batch_size": b}),
        "schedule": r.schedule.model_copy(update={"steps": t, "epochs": None, "time_budget": None}),
        "optimizer": r.optimizer.model_copy(update={"lr": lr})})


def time_budget_refusal(recipe, world_size: Optional[int] = None) -> Optional[str]:
    """Why a time budget cannot be honoured for ``recipe`` (None: it can), from the recipe alone."""
    r = recipe
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if ws > 1:
        return ("a time budget under torchrun: each rank would time itself and the ranks could choose different T; "
                "give schedule.steps (e.g. the T a one-process run with --time-budget prints)")
    if r.task.name in ("text", "instruct", "seq2seq") or r.task.user_column:
        return "a time budget supports example-level classification tasks for now; give schedule.steps"
    if r.perf.sharding == "fsdp":
        return "a time budget with perf.sharding: fsdp; give schedule.steps"
    return None


def _sizes(r) -> tuple[int, int, int]:
    """(N training rows, dev rows, labels) of the recipe's task (data/tasks.py ``load_task``)."""
    from dpft.data.tasks import load_task

    task = load_task(r.task, seed=r.seed)
    return len(task.train), len(task.dev), task.num_labels


def _lr_line(r, lr: float) -> str:
    return (f"\n  learning rate {r.optimizer.lr:g} (taken as tuned at B = 256) scaled to {lr:.3g} "
            f"({'linear' if r.optimizer.name == 'sgd' else 'square-root'} rule, accounting/budget.py)")


def _resumed_choice(r, resume_dir: Optional[str | Path]):
    """(B, T, lr) of the run in ``resume_dir`` (its checkpoint's recipe), or None."""
    if resume_dir is None:
        return None
    path = Path(resume_dir) / "checkpoint" / "state.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text()).get("recipe") or {}
    try:
        return int(rec["batch"]["expected_batch_size"]), int(rec["schedule"]["steps"]), float(rec["optimizer"]["lr"])
    except (KeyError, TypeError, ValueError):
        return None


def _resolve_time(r, n, num_labels, n_dev, timing, resume_dir, private: bool):
    from dpft.run.timing import probe_step_time

    why = time_budget_refusal(r)
    if why:
        raise BudgetError(why)
    budget = float(r.schedule.time_budget)
    b_auto = r.batch.expected_batch_size == "auto"

    again = _resumed_choice(r, resume_dir)
    if again is not None:
        b, t, lr = again
        return _resolved(r, b, t, lr), (f"time budget {describe_seconds(budget)}: resuming with the B = {b}, T = {t} "
                                    "chosen when the run started (not re-measured: the same plan and σ)")
    if n is None or num_labels is None:
        n, n_dev, num_labels = _sizes(r)
    timing = timing or probe_step_time(r, num_labels)
    room = budget - timing.setup_seconds  # the run builds its model again
    ev = timing.eval_seconds(n_dev)

    def step(b: int) -> float:  # the Poisson batch's expected micro-batches over N rows
        return timing.step_seconds(b, n)

    if private:
        choice = choose_for_time(n, r.privacy.target_epsilon, r.privacy.delta, room, step, ev,
                                 r.eval.every_steps, batch=None if b_auto else int(r.batch.expected_batch_size))
        b, t = choice.batch, choice.steps
    else:  # --no-dp (or σ given) with a time budget: the batch is given, T is what fits
        b = int(r.batch.expected_batch_size)
        t = steps_in_time(room, step(b), ev, r.eval.every_steps)
        if t < 1:
            raise BudgetError(f"the time budget {describe_seconds(budget)} does not fit one step; raise it")
        choice = None
    lr = scaled_lr(r.optimizer.lr, b, r.optimizer.name) if b_auto else r.optimizer.lr
    evals = t // r.eval.every_steps + 1
    used = timing.setup_seconds + t * step(b) + evals * ev
    msg = [f"time budget {describe_seconds(budget)}: {timing.describe()}",
           f"  reserved: setup {timing.setup_seconds:.3g} s (the run loads its model again); {evals} evaluation(s) of "
           f"{n_dev} dev rows ≈ {evals * ev:.3g} s"]
    if choice is not None:
        msg += [choice.explain(),
                f"  N = {n} training examples; ε = {r.privacy.target_epsilon:g}, δ = {r.privacy.delta:g}; σ is "
                "calibrated for this (B, T) before the first noisy step"]
    else:
        msg += [f"  B = {b} (given), T = {t} steps ("
                + ("non-private run)" if not r.privacy.enabled else "σ given by privacy.noise_multiplier)")]
    if b_auto:
        msg += [_lr_line(r, lr).lstrip("\n")]
    msg += [f"  estimate: {t} steps × {step(b):.3g} s (E {timing.micro_batches(b, n):.2f} micro-batches of the "
            f"Poisson batch) + evaluations + setup ≈ {describe_seconds(used)} "
            f"of {describe_seconds(budget)}; not included: a method's own phases, a test file, saving the model "
            "and report, other load on the machine"]
    if r.methods:
        msg += ["  note: this recipe's methods were not timed (their phases and per-step work add to it)"]
    return _resolved(r, b, t, lr), "\n".join(msg)


__all__ += ["BudgetError"]
