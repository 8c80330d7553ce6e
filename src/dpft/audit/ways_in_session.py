"""Each way in reaches the private session unchanged: one check over a table of ways in (issue 46 item 4).

Given settings, every way in asks dpft/session/core.py's :class:`~dpft.session.core.PrivateSession` for exactly
one plan, with those settings, and steps with that plan's parts; the plan is the one the plan builder
(step/plan.py ``PlanSettings.calibrate``, ``planned_steps``) gives for those settings (N, q, T, σ: every way in
therefore gets the same plan); where the way in trained, its ledger holds that plan's events of steps 0…T−1,
those σ was calibrated on (:func:`reaches_session`). The session's own properties are then checked once
(audit/ways_in.py and the check modules), not once per way in.

:data:`SESSION_WAYS` holds ``make_private`` and ``DPTrainer`` (audit/ways_in.py ``api_checks``); the TRL trainers
add theirs (audit/ways_in_trl.py), the mechanism settings theirs (audit/ways_in_mechanisms.py
``reaches_session_check``). Planted ``session_steps_rule`` (audit/ways_in.py): the session counts steps by a
rule of its own.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import warnings
from typing import Any, Iterator, Optional, Sequence

import dp_accounting as dpa
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.audit.planted import patched
from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft.integrations.hf import trainer as hf
from dpft.session import core as session_core
from dpft.step.plan import PlanSettings, planned_steps

__all__ = ["SESSION_SETTINGS", "SESSION_WAYS", "reaches_session", "session_check", "session_plans"]

#: The settings every way in is given (issue 46: epochs 1.1, N 100, B 10 is 11 steps by step/plan.py's rule).
SESSION_SETTINGS = dict(n=100, batch=10, epochs=1.1, epsilon=3.0, delta=1e-3, c=1.0)


@contextlib.contextmanager
def session_plans() -> Iterator[list]:
    """Record every ``(settings, plan)`` the private session builds (dpft/session/core.py) meanwhile."""
    seen: list = []

    def plan(self, s, real=session_core.PrivateSession.plan, **kw):
        seen.append((s, real(self, s, **kw)))
        return seen[-1][1]

    with patched((session_core.PrivateSession, "plan", plan)):
        yield seen


def _session_make_private() -> Any:
    st = SESSION_SETTINGS
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(st["n"], 4, generator=g), torch.randint(0, 2, (st["n"],), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = PrivacyEngine()
        _, opt, _, _ = eng.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=st["batch"],
                                        max_grad_norm=st["c"], epochs=st["epochs"], target_epsilon=st["epsilon"],
                                        target_delta=st["delta"])
    eng.detach()
    return opt.dp_step


def _session_dp_trainer() -> Any:
    from transformers import TrainingArguments, default_data_collator

    st = SESSION_SETTINGS
    rows = tiny_rows(st["n"], 4)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = hf.DPTrainer(model=tiny_classifier("bert", vocab=64, max_len=16), train_dataset=rows,
                          args=TrainingArguments(output_dir=d, num_train_epochs=st["epochs"], report_to=[],
                                                 use_cpu=True, label_names=["labels"]),
                          data_collator=default_data_collator,
                          dp_args=hf.DPArguments(target_epsilon=st["epsilon"], target_delta=st["delta"],
                                                 expected_batch_size=st["batch"], max_grad_norm=st["c"]))
    return tr.dp_step


#: The ways in as the session check builds them: ``(name, build() -> the way in's DP step)``.
SESSION_WAYS: tuple = (("make_private", _session_make_private), ("DPTrainer", _session_dp_trainer))


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
        want_ev = [rel.event_at(t) if hasattr(rel, "event_at") else rel.event(plan.q) for t in range(plan.steps)]
        cal = plan.phase_event(plan.sigma)  # SelfComposed(event, count): what σ was calibrated on
        if got_ev != want_ev or [e for e in got_ev if not isinstance(e, dpa.NoOpDpEvent)] != [cal.event] * cal.count:
            problems.append(f"the ledger's {ledger.steps} steps are not the plan's {plan.steps} steps 0…T−1 with the "
                            "events its σ was calibrated on")
    return problems


def session_check(ways: Sequence = SESSION_WAYS) -> list[Check]:
    """Each way in of ``ways``, given :data:`SESSION_SETTINGS`, reaches the session unchanged
    (:func:`reaches_session`): one plan with those settings (C, B, ε, δ; the length as epochs, which the session
    counts into steps), the step runs its parts, and the plan is step/plan.py's for those settings — the same
    (N, q, T, σ) for every way in. Planted ``session_steps_rule``: the session counts steps by a rule of its
    own."""
    st, out = SESSION_SETTINGS, []
    t = planned_steps(st["n"], st["batch"], None, st["epochs"])
    sigma = PlanSettings(n=st["n"], expected_batch_size=st["batch"], steps=t, target_epsilon=st["epsilon"],
                         delta=st["delta"]).calibrate().sigma
    want = (st["n"], st["batch"] / st["n"], t, sigma)
    asked = {"C": st["c"], "B": st["batch"], "ε": st["epsilon"], "δ": st["delta"]}
    for name, build in ways:
        t0 = time.perf_counter()
        with session_plans() as seen:
            step = build()
        problems = reaches_session(seen, step.spec, asked, want)
        out.append(Check(f"session: {name} reaches the session unchanged", not problems,
                         "; ".join(problems) or f"one session plan with the given settings: N = {st['n']}, q = "
                         f"{want[1]:g}, T = {t} (epochs {st['epochs']}), σ = {sigma:.6g}, as step/plan.py plans them; "
                         "the step runs its parts", {"seconds": round(time.perf_counter() - t0, 2)}))
    return out
