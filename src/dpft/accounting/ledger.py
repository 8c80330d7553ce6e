"""The privacy ledger: the single source of truth for a run's ε.

An append-only list of ``(phase, dp_accounting.DpEvent)`` entries. Consecutive identical
events of one phase are grouped as ``SelfComposedDpEvent(event, count)`` so a 10,000-step run
is one entry, not 10,000. ε(δ) of the whole run is the PLD accountant of ``dp-accounting``
applied to the composition of every entry (RDP reported beside it as a cross-check). This
module never adds ε's by hand and holds no accountant of its own.

The ledger serialises to JSON (``to_json``/``from_json``) so that checkpoints carry what was
spent, and resuming never counts budget twice nor loses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

import attr
import dp_accounting as dpa
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpft.accounting import selection as _sel
from dpft.accounting.quiet import quiet_absl as _quiet_absl
from dpft.accounting.io import atomic_write_text

#: Neighbouring relation used by every accountant of dpft unless a phase says otherwise.
ADD_OR_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE

_EVENT_CLASSES = {
    cls.__name__: cls
    for cls in vars(dpa.dp_event).values()
    if isinstance(cls, type) and issubclass(cls, dpa.DpEvent)
}
#: The random-K selection of a hyperparameter search (accounting/selection.py): no dp-accounting class.
_EVENT_CLASSES[_sel.RandomKSelectionDpEvent.__name__] = _sel.RandomKSelectionDpEvent


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """JSON-able form of any ``dp_accounting`` event (attrs classes, nested)."""

    def enc(v):
        if isinstance(v, dpa.DpEvent):
            return event_to_dict(v)
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v

    return {"type": type(event).__name__, **{k: enc(v) for k, v in attr.asdict(event, recurse=False).items()}}


def event_from_dict(d: dict[str, Any]) -> dpa.DpEvent:
    """Inverse of :func:`event_to_dict`."""

    def dec(v):
        if isinstance(v, dict) and "type" in v:
            return event_from_dict(v)
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    d = dict(d)
    cls = _EVENT_CLASSES[d.pop("type")]
    return cls(**{k: dec(v) for k, v in d.items()})


@dataclass
class LedgerEntry:
    """One group of identical events of one phase: ``event`` composed ``count`` times."""

    phase: str
    event: dpa.DpEvent
    count: int = 1

    def composed(self) -> dpa.DpEvent:
        return self.event if self.count == 1 else dpa.SelfComposedDpEvent(self.event, self.count)


@dataclass
class PrivacyReport:
    """ε at δ of a composition, from PLD (primary) and RDP (cross-check)."""

    epsilon: float
    delta: float
    epsilon_rdp: float
    accountant: str = "PLD (dp-accounting)"

    def as_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "epsilon_rdp": self.epsilon_rdp,
            "accountant": self.accountant,
        }


def pld_accountant(discretization: float = 1e-4) -> pld_privacy_accountant.PLDAccountant:
    """A fresh PLD accountant (add/remove-one, pessimistic discretisation of dp-accounting)."""
    return pld_privacy_accountant.PLDAccountant(ADD_OR_REMOVE, value_discretization_interval=discretization)


def _canonical(events: Iterable[dpa.DpEvent]) -> list[dpa.DpEvent]:
    """The same composition with ``NoOpDpEvent`` dropped and equal events merged into one
    ``SelfComposedDpEvent`` each (composition is commutative, so ε is unchanged; banded_mf
    records a no-op on b − 1 steps of every b, which would otherwise leave many short entries)."""
    counts: dict[dpa.DpEvent, int] = {}
    rest: list[dpa.DpEvent] = []
    for ev in events:
        k = 1
        while isinstance(ev, dpa.SelfComposedDpEvent):
            k *= ev.count
            ev = ev.event
        if isinstance(ev, dpa.NoOpDpEvent) or k == 0:
            continue
        try:
            counts[ev] = counts.get(ev, 0) + k
        except TypeError:  # an unhashable event (e.g. a ComposedDpEvent's list): kept as it is
            rest.append(ev if k == 1 else dpa.SelfComposedDpEvent(ev, k))
    return [ev if k == 1 else dpa.SelfComposedDpEvent(ev, k) for ev, k in counts.items()] + rest


def epsilon_of(events: Iterable[dpa.DpEvent], delta: float) -> PrivacyReport:
    """ε(δ) of the composition of ``events`` with PLD and RDP.

    Raises:
        ValueError: δ not in (0, 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    events = _canonical(events)
    if not events:
        return PrivacyReport(0.0, delta, 0.0)
    if any(isinstance(e, _sel.RandomKSelectionDpEvent) for e in events):
        return _epsilon_with_selection(events, delta)
    event = events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
    pld = pld_accountant()
    pld.compose(event)
    with _quiet_absl():
        rdp = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_OR_REMOVE)
        if rdp.supports(event):
            rdp.compose(event)
            eps_rdp = float(rdp.get_epsilon(delta))
        else:  # e.g. TruncatedSubsampledGaussianDpEvent: PLD only, no RDP cross-check
            eps_rdp = math.nan
    return PrivacyReport(float(pld.get_epsilon(delta)), delta, eps_rdp)


def _epsilon_with_selection(events: list[dpa.DpEvent], delta: float) -> PrivacyReport:
    """ε(δ) of a composition that holds random-K selections (hyperparameter searches), which the
    dp-accounting accountants cannot compose. Two valid bounds, the smaller reported:

    * RDP: the selections' RDP curves (Papernot & Steinke 2022, accounting/selection.py) plus the
      RDP curve of the other events (dp-accounting), converted by dp-accounting;
    * basic composition: each selection at δ/(2s) by its own best bound (RDP, privacy profile or
      naive composition: accounting/selection.py ``selection_epsilon``), the other events by PLD
      at δ/2 (or the selections share all of δ when there is nothing else); ε's add.

    A trial whose recorded events are not covered by the selection's candidates (a resumed trial
    that released steps again) is composed on top, in full.
    """
    sels = [e for e in events if isinstance(e, _sel.RandomKSelectionDpEvent)]
    rest = [e for e in events if not isinstance(e, _sel.RandomKSelectionDpEvent)]
    for s in sels:  # uncovered trials: counted again, in full (never in our favour)
        rest += [s.trials[i] for i in _sel.check_trials_covered(s)]
    orders = list(_sel.ORDERS)
    with _quiet_absl():
        curve = sum(_sel.selection_rdp_curve(s.candidates, s.distribution) for s in sels)
        try:
            if rest:
                curve = curve + _sel.rdp_curve(dpa.ComposedDpEvent(rest))
            eps_rdp = float(rdp_privacy_accountant.compute_epsilon(orders, list(curve), delta)[0])
        except _sel.SelectionError:  # e.g. truncated Poisson elsewhere in the run: basic composition only
            eps_rdp = math.inf
    d_sel = (delta / 2 if rest else delta) / len(sels)
    eps_basic = sum(_sel.selection_epsilon(s.candidates, s.distribution, d_sel).epsilon for s in sels)
    if rest:
        pld = pld_accountant()
        pld.compose(dpa.ComposedDpEvent(rest))
        eps_basic += float(pld.get_epsilon(delta / 2))
    return PrivacyReport(min(eps_rdp, eps_basic), delta, eps_rdp,
                         accountant="random-K selection (the smaller of Papernot & Steinke 2022 RDP and the "
                                    "privacy-profile bound, accounting/selection.py) composed with the run's "
                                    "other events (RDP, or PLD by basic composition: the smaller)")


class PrivacyLedger:
    """Append-only record of every private release of a run.

    ``record(phase, event)`` appends (grouping repeats); ``epsilon(delta)`` composes all.
    Entries are never removed; ``from_json`` restores a saved ledger exactly.
    """

    def __init__(self, entries: list[LedgerEntry] | None = None, certified: bool = True,
                 not_certified_reason: str | None = None):
        self.entries: list[LedgerEntry] = list(entries or [])
        #: False when a reproduction flag ran an uncertifiable configuration; ε is then refused.
        self.certified = certified
        self.not_certified_reason = not_certified_reason
        self._cache: dict[tuple[float, int], PrivacyReport] = {}

    def record(self, phase: str, event: dpa.DpEvent, count: int = 1) -> None:
        """Append ``event`` (``count`` times) under ``phase``."""
        if count <= 0:
            return
        last = self.entries[-1] if self.entries else None
        if last is not None and last.phase == phase and last.event == event:
            last.count += count
        else:
            self.entries.append(LedgerEntry(phase, event, count))

    def mark_not_certified(self, reason: str) -> None:
        """Irrevocably mark the run as not certifiable (reproduction flags only)."""
        self.certified = False
        self.not_certified_reason = reason

    @property
    def steps(self) -> int:
        return sum(e.count for e in self.entries)

    def events(self, phase: str | None = None) -> list[dpa.DpEvent]:
        return [e.composed() for e in self.entries if phase is None or e.phase == phase]

    def epsilon(self, delta: float) -> PrivacyReport:
        """ε(δ) of everything recorded so far (cached per ledger length).

        Raises:
            NotCertifiedError: the run was marked not certified.
        """
        if not self.certified:
            raise NotCertifiedError(self.not_certified_reason or "run marked not certified")
        key = (delta, sum(e.count for e in self.entries) + 1000003 * len(self.entries))
        if key not in self._cache:
            self._cache = {key: epsilon_of(self.events(), delta)}
        return self._cache[key]

    def to_json(self) -> dict[str, Any]:
        return {
            "certified": self.certified,
            "not_certified_reason": self.not_certified_reason,
            "entries": [
                {"phase": e.phase, "count": e.count, "event": event_to_dict(e.event)} for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PrivacyLedger":
        return cls(
            [LedgerEntry(x["phase"], event_from_dict(x["event"]), int(x["count"])) for x in d["entries"]],
            certified=d.get("certified", True),
            not_certified_reason=d.get("not_certified_reason"),
        )

    def save(self, path) -> None:
        atomic_write_text(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> "PrivacyLedger":
        with open(path) as f:
            return cls.from_json(json.load(f))


class NotCertifiedError(RuntimeError):
    """Raised when an ε is asked of a run whose guarantee cannot be certified."""


def format_epsilon(ledger: PrivacyLedger, delta: float) -> str:
    """Human string: ``ε = 7.98 at δ = 1e-05 (PLD; RDP 8.61)`` or ``ε: NOT CERTIFIED (...)``."""
    if not ledger.certified:
        return f"ε: NOT CERTIFIED ({ledger.not_certified_reason})"
    r = ledger.epsilon(delta)
    if math.isinf(r.epsilon):
        return f"ε = inf at δ = {delta:g}"
    return f"ε = {r.epsilon:.4g} at δ = {delta:g} (PLD; RDP {r.epsilon_rdp:.4g})"
