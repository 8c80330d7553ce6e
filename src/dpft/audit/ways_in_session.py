"""Each way in reaches the private session unchanged: one check over a table of ways in (issue 46 item 4).

Given settings, every way in asks dpft/session/core.py's :class:`~dpft.session.core.PrivateSession` for exactly
one plan, with those settings, and steps with that plan's parts; the plan is the one the plan builder
(step/plan.py ``PlanSettings.calibrate``, ``planned_steps``) gives for those settings (N, q, T, σ: every way in
therefore gets the same plan); where the way in trained, its ledger holds that plan's events of steps 0…T−1,
those σ was calibrated on (:func:`reaches_session`). The session's own properties are then checked once
(audit/ways_in.py and the check modules), not once per way in.

The ways in: ``make_private`` and ``DPTrainer`` (audit/ways_in.py ``SESSION_WAYS``), the TRL trainers
(audit/ways_in_trl.py), ``dpft train`` (:func:`train_check`, in ``dpft audit RECIPE``), and the mechanism
settings through the Python ways in (audit/ways_in_mechanisms.py ``reaches_session_check``). Planted
``session_steps_rule`` (:func:`plant_steps_rule`; listed with audit/ways_in.py's, and planted around ``dpft
train``'s Trainer by ``dpft audit RECIPE``: :func:`planted_session`): the session counts steps by a rule of its own.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, Optional, Sequence

import dp_accounting as dpa

from dpft.audit.planted import patched
from dpft.audit.whitebox import Check
from dpft.session import core as session_core
from dpft.step.plan import PlanSettings, planned_steps

__all__ = ["SESSION_SETTINGS", "STEPS_RULE", "plant_steps_rule", "planted_session", "reaches_session",
           "session_check", "session_plans", "train_check"]

#: The settings every way in is given (issue 46: epochs 1.1, N 100, B 10 is 11 steps by step/plan.py's rule).
SESSION_SETTINGS = dict(n=100, batch=10, epochs=1.1, epsilon=3.0, delta=1e-3, c=1.0)
#: The planted bug of the session's one steps count.
STEPS_RULE = "session_steps_rule"


def plant_steps_rule(p: Any) -> None:
    """Planted ``session_steps_rule``: the session counts steps by a rule of its own (⌈epochs·N/B⌉ without
    step/plan.py's float guard: epochs 1.1, N 100, B 10 gives 12 steps, not 11), as ``dpft train`` once did;
    every way in's T is the session's count (session/core.py ``PrivateSession.prepare``), so every way in's row
    catches it where its settings tell the two rules apart. ``p``: the patches of audit/planted.py ``patched``."""
    p.set(session_core, "planned_steps", lambda n, b, steps, epochs: steps or math.ceil(epochs * n / b))


@contextlib.contextmanager
def planted_session(name: Optional[str]) -> Iterator[None]:
    """:func:`plant_steps_rule` for the duration when ``name`` is :data:`STEPS_RULE` (any other name: nothing
    planted here; ``dpft audit RECIPE --plant`` builds ``dpft train``'s Trainer inside it)."""
    with patched() as p:
        if name == STEPS_RULE:
            plant_steps_rule(p)
        yield


@contextlib.contextmanager
def session_plans() -> Iterator[list]:
    """Record every ``(settings, plan)`` the private session builds (dpft/session/core.py) meanwhile."""
    seen: list = []

    def plan(self, s, real=session_core.PrivateSession.plan, **kw):
        seen.append((s, real(self, s, **kw)))
        return seen[-1][1]

    with patched((session_core.PrivateSession, "plan", plan)):
        yield seen


def reaches_session(seen: list, spec: Any, asked: dict, want: Optional[tuple] = None,
                    ledger: Any = None) -> list[str]:
    """Why a way in did not reach the session unchanged ([] : it did), from the ``(settings, plan)`` pairs the
    session built meanwhile (:func:`session_plans`) and the way in's step parts ``spec``: exactly one plan; its
    settings are ``asked`` (keys of ``C``, ``B``, ``ε``, ``δ`` and the mechanism's ``settings()``); the step runs
    that plan's parts; the plan's (N, q, T, σ) is ``want`` (None: not compared); ``ledger`` (None: the way in did
    not train) holds the plan mechanism's events of steps 0…T−1, those σ was calibrated on."""
    if len(seen) != 1:
        return [f"{len(seen)} session plans (one expected)"]
    (s, plan), problems = seen[0], []
    got = {"C": s.max_grad_norm, "B": s.expected_batch_size, "ε": s.target_epsilon, "δ": s.target_delta,
           **s.mechanism.settings()}
    if {k: got.get(k) for k in asked} != asked:
        problems.append(f"the session was asked for {({k: got.get(k) for k in asked})}, not {asked}")
    if want is not None and (plan.n, plan.q, plan.steps, plan.sigma) != want:
        problems.append(f"plan N = {plan.n}, q = {plan.q:.4g}, T = {plan.steps}, σ = {plan.sigma:.6g} (step/plan.py: "
                        f"N = {want[0]}, q = {want[1]:.4g}, T = {want[2]}, σ = {want[3]:.6g})")
    if spec is not plan.spec:
        problems.append("the way in's step does not run the session plan's parts")
    if ledger is not None:
        rel, got_ev = plan.spec.mechanism, [e.event for e in ledger.entries for _ in range(e.count)]
        want_ev = [rel.event_at(t, plan.q) for t in range(plan.steps)]
        cal = plan.phase_event(plan.sigma)  # SelfComposed(event, count): what σ was calibrated on
        if got_ev != want_ev or [e for e in got_ev if not isinstance(e, dpa.NoOpDpEvent)] != [cal.event] * cal.count:
            problems.append(f"the ledger's {ledger.steps} steps are not the plan's {plan.steps} steps 0…T−1 with the "
                            "events its σ was calibrated on")
    return problems


def _plan_of(n: int, b: int, steps: Optional[int], epochs: Optional[float], epsilon: float, delta: float) -> tuple:
    """step/plan.py's (N, q, T, σ) for these settings (the one steps rule, σ calibrated by ``PlanSettings``)."""
    t = planned_steps(n, b, steps, epochs)
    sigma = PlanSettings(n=n, expected_batch_size=b, steps=t, target_epsilon=epsilon, target_delta=delta).calibrate().sigma
    return n, b / n, t, sigma


def train_check(trainer, plan: dict, seen: list) -> list[Check]:
    """``dpft train`` reaches the session unchanged (:func:`reaches_session`): ``seen``, the session plans built
    while its Trainer was (:func:`session_plans`), is one plan with the recipe's settings, the Trainer's step runs
    its parts, and its (N, q, T, σ) is step/plan.py's for the recipe's settings. Only where the two are
    comparable (``plan``: audit/trainer_walk.py ``trainer_plan``): one phase, example level, plain Poisson, σ
    calibrated, one process; otherwise no check (the walk's own checks still run)."""
    r, p = trainer.recipe, trainer.recipe.privacy
    if (plan.get("unit") != "example" or plan.get("prior_phases") or "bands" in plan or "max_batch_size" in plan
            or p.noise_multiplier is not None or plan.get("world_size", 1) != 1):
        return []
    b, eps, delta = int(r.batch.expected_batch_size), float(p.target_epsilon), float(plan["delta"])
    want = _plan_of(int(plan["n"]), b, r.schedule.steps or None, r.schedule.epochs, eps, delta)
    problems = reaches_session(seen, trainer.dp_step.spec, {"C": plan["C"], "B": b, "ε": eps, "δ": delta}, want)
    return [Check("session: dpft train reaches the session unchanged", not problems, "; ".join(problems) or
                  f"one session plan with the recipe's settings: N = {want[0]}, q = {want[1]:.4g}, T = {want[2]}, "
                  f"σ = {want[3]:.6g}, as step/plan.py plans them; the step runs its parts", {"steps": want[2]})]


def session_check(ways: Sequence) -> list[Check]:
    """Each way in of ``ways``, given :data:`SESSION_SETTINGS`, reaches the session unchanged
    (:func:`reaches_session`): one plan with those settings (C, B, ε, δ; the length as epochs, which the session
    counts into steps), the step runs its parts, and the plan is step/plan.py's for those settings — the same
    (N, q, T, σ) for every way in. Planted ``session_steps_rule``: the session counts steps by a rule of its
    own."""
    st, out = SESSION_SETTINGS, []
    want = _plan_of(st["n"], st["batch"], None, st["epochs"], st["epsilon"], st["delta"])
    asked = {"C": st["c"], "B": st["batch"], "ε": st["epsilon"], "δ": st["delta"]}
    for name, build in ways:
        t0 = time.perf_counter()
        with session_plans() as seen:
            step = build()
        problems = reaches_session(seen, step.spec, asked, want)
        out.append(Check(f"session: {name} reaches the session unchanged", not problems,
                         "; ".join(problems) or f"one session plan with the given settings: N = {st['n']}, q = "
                         f"{want[1]:g}, T = {want[2]} (epochs {st['epochs']}), σ = {want[3]:.6g}, as step/plan.py plans "
                         "them; the step runs its parts", {"seconds": round(time.perf_counter() - t0, 2)}))
    return out
