"""Each way in reaches the private session unchanged (issue 46 item 4): given the same settings, every way in
asks dpft/session/core.py's :class:`~dpft.session.core.PrivateSession` for exactly one plan, with those
settings, and steps with that plan's parts; the plans agree with step/plan.py's one steps rule and with one
another (N, q, T, σ). The session's own properties are then checked once (audit/ways_in.py and the check
modules), not once per way in.

:data:`SESSION_WAYS` holds ``make_private`` and ``DPTrainer`` (audit/ways_in.py ``api_checks``); the TRL trainers
add theirs (audit/ways_in_trl.py). Planted ``session_steps_rule`` (audit/ways_in.py): the session counts steps
by a rule of its own.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.audit.planted import patched
from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft.integrations.hf import trainer as hf
from dpft.session import core as session_core
from dpft.step.plan import planned_steps

__all__ = ["SESSION_SETTINGS", "SESSION_WAYS", "session_check", "session_plans"]

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


def session_check(ways: Sequence = SESSION_WAYS) -> list[Check]:
    """Each way in, given :data:`SESSION_SETTINGS`, asks the private session for exactly one plan, with those
    settings (C, B, ε, δ; the length as epochs, which the session counts into steps), and steps with that plan's parts;
    and the plans agree with step/plan.py's one steps rule and with one another (N, q, T, σ): the way in
    reaches the session unchanged. Planted ``session_steps_rule``: the session counts steps by a rule of its
    own."""
    st, out, plans = SESSION_SETTINGS, [], {}
    want_t = planned_steps(st["n"], st["batch"], None, st["epochs"])
    for name, build in ways:
        t0 = time.perf_counter()
        with session_plans() as seen:
            step = build()
        problems = []
        if len(seen) != 1:
            problems.append(f"{len(seen)} session plans (one expected)")
        else:
            s, plan = seen[0]
            plans[name] = (plan.n, plan.q, plan.steps, plan.sigma)
            got = (s.max_grad_norm, s.expected_batch_size, s.target_epsilon, s.target_delta)
            if got != (st["c"], st["batch"], st["epsilon"], st["delta"]):
                problems.append(f"settings (C, B, ε, δ) = {got}")
            if (plan.n, plan.steps) != (st["n"], want_t) or abs(plan.q - st["batch"] / st["n"]) > 1e-12:
                problems.append(f"plan N = {plan.n}, q = {plan.q:.4g}, T = {plan.steps} (step/plan.py: T = {want_t})")
            if step.spec is not plan.spec:
                problems.append("the way in's step does not run the session plan's parts")
        out.append(Check(f"session: {name} reaches the session unchanged", not problems,
                         "; ".join(problems) or f"one session plan with the given settings: N = {st['n']}, q = "
                         f"{st['batch'] / st['n']:g}, T = {want_t} (epochs {st['epochs']}), σ = "
                         f"{plans[name][3]:.4g}; the step runs its parts", {"seconds": round(time.perf_counter() - t0, 2)}))
    same = len(set(plans.values())) <= 1 and len(plans) == len(ways)
    out.append(Check("session: every way in gets the same plan (N, q, T, σ)", same,
                     "; ".join(f"{k}: {v[0]}, {v[1]:g}, {v[2]}, {v[3]:.6g}" for k, v in plans.items())
                     + ("" if same else " — the ways in do not plan alike"), {}))
    return out
