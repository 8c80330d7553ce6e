"""The target ε as a hard cap across crashes (issue 36 item 3; DESIGN.md "Resume never overspends").

A run killed between two checkpoints has released the steps after the last checkpoint; its
resume replays them with fresh noise, which are *new* releases. Run to its planned end, it
would spend more than planned (8.337 for a target of 8). :func:`resume_cap` finds the last step
a resumed run may reach so that the ledger's releases plus the events of its remaining steps
stay within the target: the run stops early by as many steps as it replays (exactly, when every
step's event is the same), or more when the events differ by step. Nothing here adds ε's: every
value is dp-accounting's PLD accountant on the composition of the events.

Imports nothing of dpft but the ledger, so every way in (``dpft train --resume``, ``DPTrainer``
resume, ``make_private``) can cap with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import dp_accounting as dpa

from dpft.accounting.ledger import _canonical, pld_accountant

__all__ = ["ResumeCap", "pld_epsilon", "resume_cap", "ledger_resume_cap"]

#: Relative slack on the target (the same as the report's overspend test): float noise only.
_RTOL = 1e-9


def pld_epsilon(events: Sequence[dpa.DpEvent], delta: float) -> float:
    """ε(δ) of the composition of ``events`` (PLD, add/remove-one; the ledger's accountant)."""
    evs = _canonical(events)
    if not evs:
        return 0.0
    acc = pld_accountant()
    acc.compose(evs[0] if len(evs) == 1 else dpa.ComposedDpEvent(evs))
    return float(acc.get_epsilon(delta))


@dataclass(frozen=True)
class ResumeCap:
    """What a resumed run may still do.

    Attributes:
        start: the step it resumes from (the checkpoint's).
        planned: the steps it was planned to reach.
        stop: the step it stops at (≤ ``planned``): the last that keeps ε ≤ ``target``.
        held: releases of the run's phase that the ledger already holds (the checkpoint's and any
            made after it by the attempt that crashed).
        target: the cap on ε (the recipe's target, or the ε the plan would have reached).
        epsilon_end: ε(δ) the run ends at when it stops at ``stop``.
        epsilon_planned: ε(δ) it would end at running to ``planned`` (``--allow-overspend``).
    """

    start: int
    planned: int
    stop: int
    held: int
    target: float
    epsilon_end: float
    epsilon_planned: float

    @property
    def early(self) -> int:
        """Steps dropped from the plan so as to stay within the target."""
        return self.planned - self.stop


def resume_cap(ledger_events: Sequence[dpa.DpEvent], step_event: Callable[[int], dpa.DpEvent], start: int,
               planned: int, delta: float, target: float | None = None, held: int = 0,
               other_events: Sequence[dpa.DpEvent] = ()) -> ResumeCap:
    """The last step a run resumed at ``start`` may reach with ε(δ) ≤ ``target``.

    Args:
        ledger_events: every event the run's ledger holds now (all phases, the crashed
            attempt's releases past the checkpoint included).
        step_event: the ledger event of step ``s`` (0-based) of the run's phase, as the run
            will record it (e.g. ``mechanism.event_at(s, q_at(s))``).
        start: the step the run resumes from; planned: the step it was planned to reach.
        delta: δ of the guarantee.
        target: the cap; None = the ε the plan reaches without a crash, i.e. ``other_events``
            (the ledger's events of other phases) then ``step_event(s)`` for every planned step.
        held: releases of the run's phase in the ledger (reported only).

    Returns:
        :class:`ResumeCap`; ``stop == start`` when the ledger alone is at or above the target.

    Source: dp-accounting's PLD accountant on the composition (no ε is added by hand).
    """
    if target is None:
        target = pld_epsilon(list(other_events) + [step_event(s) for s in range(planned)], delta)
    prior = list(ledger_events)
    cache: dict[int, float] = {}

    def eps(stop: int) -> float:
        if stop not in cache:
            cache[stop] = pld_epsilon(prior + [step_event(s) for s in range(start, stop)], delta)
        return cache[stop]

    def ok(stop: int) -> bool:
        return eps(stop) <= target * (1 + _RTOL)

    stop = planned
    if not ok(planned):
        lo, hi = start, planned  # ok(lo) or lo == start; not ok(hi)
        guess = planned - max(0, held - start)  # held − start: releases past the checkpoint, replayed
        if start < guess < planned:  # identical steps: stopping short by the replayed releases is exact
            if ok(guess):
                lo = guess
                if not ok(guess + 1):
                    hi = guess + 1
            else:
                hi = guess
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        stop = lo
    return ResumeCap(start=start, planned=planned, stop=stop, held=held, target=float(target),
                     epsilon_end=eps(stop), epsilon_planned=eps(planned))


def ledger_resume_cap(ledger, phase: str, mechanism, q_at: Callable[[int], float], start: int, planned: int,
                      delta: float, target: float | None = None) -> ResumeCap:
    """:func:`resume_cap` of a run's ``ledger``: the releases of ``phase`` it holds are ``held``,
    the other phases' events compose before them, and step ``s`` records ``mechanism.event_at(s, q_at(s))``
    (step/noise.py: the step matters to banded MF, q to independent noise).
    Shared by ``dpft train --resume`` (run/checkpoint.py) and DPTrainer's resume."""
    held = sum(e.count for e in ledger.entries if e.phase == phase)
    step_event = lambda s: mechanism.event_at(s, q_at(s))  # noqa: E731  (the mechanism family's one interface)
    return resume_cap(ledger.events(), step_event, start, planned, delta, target, held,
                      [e.composed() for e in ledger.entries if e.phase != phase])
