"""Resolve ``batch.expected_batch_size: auto`` / ``schedule.steps: auto`` into numbers before the run
is planned (the CLI and ``dpft tune`` call :func:`resolve_auto`; the search is accounting/budget.py)."""

from __future__ import annotations

from typing import Optional

from dpft.accounting.budget import BudgetError, choose_batch_and_steps, scaled_lr

__all__ = ["resolve_auto", "has_auto"]


def has_auto(recipe) -> bool:
    return recipe.batch.expected_batch_size == "auto" or recipe.schedule.steps == "auto"


def resolve_auto(recipe, n: Optional[int] = None) -> tuple[object, Optional[str]]:
    """``recipe`` with its ``auto`` fields chosen, and the explanation to print (None: nothing was auto).

    N is the training rows the run will see (``load_task``; given as ``n`` when known).

    Raises:
        BudgetError: a non-private run, a causal-LM or user-level task, ``steps: auto`` with
            ``epochs``, or no feasible (B, T) — each naming the fix, before any model loading."""
    if not has_auto(recipe):
        return recipe, None
    r = recipe
    if not r.privacy.enabled or r.privacy.target_epsilon is None or r.privacy.noise_multiplier is not None:
        raise BudgetError("batch/steps auto choose (B, T) for a target ε: set privacy.target_epsilon (and no "
                          "noise_multiplier), or give numbers")
    if r.task.name in ("text", "instruct", "seq2seq") or r.task.user_column:
        raise BudgetError("batch/steps auto support example-level classification tasks; give numbers for this task")
    if r.schedule.steps == "auto" and r.schedule.epochs is not None:
        raise BudgetError("schedule.steps: auto and schedule.epochs both set; keep one")
    if n is None:
        from dpft.data.tasks import load_task

        n = len(load_task(r.task, seed=r.seed).train)
    b_auto, t_auto = r.batch.expected_batch_size == "auto", r.schedule.steps == "auto"
    fixed_t = None
    if not t_auto:
        import math

        fixed_t = r.schedule.steps or max(1, math.ceil(r.schedule.epochs * n / 256))
    choice = choose_batch_and_steps(n, r.privacy.target_epsilon, r.privacy.delta, r.schedule.compute_budget,
                                    batch=None if b_auto else r.batch.expected_batch_size,
                                    steps=None if t_auto else fixed_t)
    upd = {"batch": r.batch.model_copy(update={"expected_batch_size": choice.batch}),
           "schedule": r.schedule.model_copy(update={"steps": choice.steps, "epochs": None})}
    msg = choice.explain() + f"\n  N = {n} training examples; ε = {r.privacy.target_epsilon:g}, δ = {r.privacy.delta:g}"
    if b_auto:
        lr = scaled_lr(r.optimizer.lr, choice.batch, r.optimizer.name)
        upd["optimizer"] = r.optimizer.model_copy(update={"lr": lr})
        msg += (f"\n  learning rate {r.optimizer.lr:g} (taken as tuned at B = 256) scaled to {lr:.3g} "
                f"({'linear' if r.optimizer.name == 'sgd' else 'square-root'} rule, accounting/budget.py)")
    return r.model_copy(update=upd), msg


__all__ += ["BudgetError"]
