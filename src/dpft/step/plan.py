"""The one privacy plan: a value in simple types, then σ, then the live step (jax_privacy's
``DPExecutionPlan``: config → ``calibrate(ε, δ)`` → ``make(performance)``). Every way in —
``dpft train``'s ``RunPlan`` (run/plan.py), ``make_private`` (api/engine.py), ``DPTrainer`` and the
TRL trainers (integrations/), all through session/core.py — builds its privacy through
:func:`build_privacy_plan`, which is exactly::

    PlanSettings.of(mechanism, sampler, ...)   simple types (report.json can carry ``to_dict()``)
      .calibrate(prior, calibrate)            -> CalibratedPlan: σ, pure (nothing live, nothing drawn)
      .make(rng, parts, optimizer, hooks, ...) -> PrivacyPlan: the live parts

In order::

    settings    N, B, steps, the mechanism's name and parameters, σ or (ε, δ), phase, private;
                the unit's own sampler (user level, a batch schedule) enters only as its rates
    steps       the planned logical steps: ``steps``, or ⌈epochs · N / B⌉ (one rule everywhere)
    σ           explicit, or calibrated (PLD) on the events this phase will record, composed
                after ``prior`` (the ledger's earlier events); δ < 1/N checked; what the sampler
                would refuse (B > N, banded p > 1) is refused first
    sampler     the mechanism's batch selection over the N units (or the unit's own sampler,
                whose rates must be the settings')
    clip,engine the front end's (built from the sampler: user level clips to C/k)
    spec        Gaussian mechanism N(0, σ²C²I) from the run's secret randomness (step/noise.py)
    hooks       the methods' ``build`` (each returns a changed copy of the spec)
    install     the mechanism's own release (truncation, banded noise + its secret state)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dpft.step.build import build_step_spec, resolve_sigma
from dpft.step.mechanisms import KWARG_NAMES, Mechanism, mechanism_of

__all__ = ["PrivacySettings", "PlanSettings", "CalibratedPlan", "PrivacyPlan", "build_privacy_plan", "planned_steps"]


def planned_steps(n: int, expected_batch_size: int, steps: Optional[int] = None,
                  epochs: Optional[float] = None) -> int:
    """Logical steps of a phase: ``steps``, else ⌈epochs · N / B⌉ (at least 1) — the one rule of
    every way in (an epoch is N / B expected batches; a fractional epoch is allowed).

    Raises:
        ValueError: neither ``steps`` nor ``epochs``."""
    if steps is not None:
        return int(steps)
    if epochs is None:
        raise ValueError("give steps or epochs")
    return max(1, math.ceil(float(epochs) * n / int(expected_batch_size) - 1e-9))


@dataclass(frozen=True)
class PrivacyPlan:
    """A private phase, resolved before its first step. Frozen: the loops read it.

    Attributes:
        mechanism: the :class:`~dpft.step.mechanisms.Mechanism` (its report ``info``, refusals).
        sampler: draws step t's logical batch (unit indices) from the secret randomness.
        n, q: N privacy units and the sampling rate q = B/N.
        steps: logical steps planned; sigma: σ (None for a non-private phase).
        clip, engine: the clip policy and per-example engine; spec: the step's parts (after the
            methods' hooks and the mechanism's install); phase: the ledger phase.
        phase_event: ``σ -> DpEvent`` σ was calibrated on (None: ``steps`` × PoissonSampled(q, G(σ))).
        private: False for a phase without a mechanism (``dpft train --no-dp``; σ None).
        calibrated: the value it was made from (:class:`CalibratedPlan`: settings and σ).
    """

    mechanism: Mechanism
    sampler: Any
    n: int
    q: float
    steps: int
    sigma: Optional[float]
    clip: Any
    engine: Any
    spec: Any
    phase: str
    phase_event: Optional[Callable[[float], Any]] = None
    private: bool = True
    calibrated: Optional["CalibratedPlan"] = None

    @property
    def params(self) -> dict:
        """The parameters the step updates (name → tensor)."""
        return self.spec.params if self.spec.params is not None else self.spec.engine.params

    @property
    def release(self):
        """The step's release (the mechanism object that draws noise and records events)."""
        return self.spec.mechanism

    def info(self) -> dict:
        """The report's public description of the mechanism (no realised counts)."""
        return self.mechanism.info(self.sampler, self.steps) if self.sigma is not None else {}



@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """The privacy settings every phase states before its N units and T steps are known, declared
    once: the session's :class:`~dpft.session.core.SessionSettings` (a way in's) and
    :class:`PlanSettings` (the plan's, with N and T) are these plus their own. Simple types
    (coerced on construction: B an int, σ, ε, δ floats or None).

    Attributes:
        expected_batch_size: B, the expected logical batch in units (rows, or users).
        noise_multiplier: σ (wins when a target is given too); target_epsilon, target_delta: the
            (ε, δ) σ is calibrated to (δ < 1/N checked whenever given).
        phase: the ledger phase of the releases; private: False for a phase without a mechanism
            (``dpft train --no-dp``: σ None, nothing recorded; a truncated sampler still masks padded
            rows); hardened: hardened noise draws (privacy/randomness.py).
    """

    expected_batch_size: int
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    phase: str = "train"
    private: bool = True
    hardened: bool = True

    def __post_init__(self) -> None:
        for name, kind in (("expected_batch_size", int), ("noise_multiplier", float), ("target_epsilon", float),
                           ("target_delta", float), ("phase", str), ("private", bool), ("hardened", bool)):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, kind(v))

    def privacy_settings(self) -> dict:
        """These privacy fields by name: what a way in's settings hand the plan (:func:`build_privacy_plan`,
        :meth:`PlanSettings.of`), the one translation."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PrivacySettings)}


@dataclass(frozen=True, kw_only=True)
class PlanSettings(PrivacySettings):
    """The privacy settings of one phase in simple types (JSON: :meth:`to_dict`), before σ: the
    :class:`PrivacySettings` and N, T and the mechanism's — the same value for the same settings
    whichever way in built it.

    Attributes:
        n: N privacy units (rows, or users); steps: planned logical steps (:func:`planned_steps`).
        mechanism: ``gaussian`` | ``banded_mf``; bands: b of banded MF; max_batch_size: B_max of
            truncated Poisson (:func:`~dpft.step.mechanisms.mechanism_of`'s settings).
        q: the sampling rate of the unit's own sampler (user level, a batch schedule); None: B/N,
            the mechanism's sampler. partition_rate: p of the own cyclic sampler (banded MF);
            None: b·B/N.
        names: ``(setting, spelling)`` pairs of the way in's refusals (() : keyword spellings);
            wording only, not part of the value (left out of equality and of :meth:`to_dict`).
    """

    n: int
    steps: int
    mechanism: str = "gaussian"
    bands: Optional[int] = None
    max_batch_size: Optional[int] = None
    q: Optional[float] = None
    partition_rate: Optional[float] = None
    names: tuple = dataclasses.field(default=(), compare=False)

    @classmethod
    def of(cls, mechanism: Mechanism, *, n: int, steps: int, sampler: Any = None, **privacy) -> "PlanSettings":
        """The settings of a live ``mechanism`` and the ``sampler`` the plan draws with (None: the
        mechanism's, built by :meth:`CalibratedPlan.make`); ``privacy``: the :class:`PrivacySettings`
        fields by name (``expected_batch_size`` required). One rule for every way in
        (:meth:`~dpft.step.mechanisms.Mechanism.owns`): the mechanism's own sampler adds nothing (q,
        p None: B/N, b·B/N), a unit's own (user level, a batch schedule) enters as its rates (q,
        and banded MF's p when private)."""
        part = mechanism.settings()
        if sampler is not None and mechanism.owns(sampler, int(n), int(privacy["expected_batch_size"])):
            sampler = None
        own_p = sampler is not None and privacy.get("private", True) and part["mechanism"] == "banded_mf"
        return cls(n=int(n), steps=int(steps), **part, **privacy, q=None if sampler is None else float(sampler.q),
                   partition_rate=sampler.partition_rate if own_p else None,
                   names=() if mechanism.names == KWARG_NAMES else tuple(mechanism.names.items()))

    def to_dict(self) -> dict:
        """JSON-serialisable: the simple values, without ``names`` (:meth:`from_dict` inverts)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "names"}

    @classmethod
    def from_dict(cls, d: dict) -> "PlanSettings":
        """The settings :meth:`to_dict` wrote (an older value's ``names`` mapping read as its spelling)."""
        return cls(**{**d, "names": tuple(dict(d.get("names") or {}).items())})

    def mechanism_part(self) -> Mechanism:
        """The live mechanism of these settings (raises PlanError naming the fix)."""
        return mechanism_of(self.mechanism, self.bands, self.max_batch_size, dict(self.names) or None)

    @property
    def sampling_rate(self) -> float:
        """q: the own sampler's, else B/N (as :class:`~dpft.step.sample.PoissonSampler` computes it)."""
        return self.q if self.q is not None else self.expected_batch_size / self.n

    def rates(self) -> tuple[float, Optional[float]]:
        """``(q, p)``: the sampling rate and banded MF's partition rate (None otherwise).

        Raises:
            PlanError: banded p = b·B/N > 1."""
        q, p = self.sampling_rate, self.partition_rate
        if p is None and self.mechanism == "banded_mf":
            p = self.mechanism_part().partition_rate(self.n, self.expected_batch_size)
        return q, p

    def phase_event(self) -> Optional[Callable[[float], Any]]:
        """``σ -> DpEvent`` of the phase σ is calibrated on (None: ``steps`` × PoissonSampled(q,
        Gaussian(σ)), or a phase that is not private). Built once per value: :meth:`calibrate` and
        :meth:`CalibratedPlan.make` read the same one (the plan records it as ``phase_event``)."""
        return self._phase_event

    @functools.cached_property
    def _phase_event(self) -> Optional[Callable[[float], Any]]:
        if not self.private:
            return None
        q, p = self.rates()
        return self.mechanism_part().event_of(self.n, q, self.steps, p)

    def calibrate(self, prior: Sequence = (), calibrate: Optional[Callable] = None) -> "CalibratedPlan":
        """The settings with σ: ``noise_multiplier``, else calibrated (PLD) so that ``prior`` (the
        ledger's earlier events) composed with :meth:`phase_event` gives ``target_epsilon`` at
        ``target_delta`` (step/build.py ``resolve_sigma``). Pure: nothing live is built, nothing drawn.

        Args:
            calibrate: runs the calibration (DDP: rank 0, the answer broadcast); default: here.

        Raises:
            ValueError, PlanError: what the mechanism's sampler would refuse (B > N, banded
                p > 1), first; CalibrationError: δ ≥ 1/N or the target cannot be met.
        """
        if self.q is None:
            self.mechanism_part().check(self.n, self.expected_batch_size)
        sigma = None
        if self.private:
            sigma = resolve_sigma(noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon,
                                  delta=self.target_delta, q=self.sampling_rate, steps=self.steps, n=self.n,
                                  prior=prior, calibrate=calibrate, phase_event=self.phase_event())
        return CalibratedPlan(self, sigma)


@dataclass(frozen=True)
class CalibratedPlan:
    """:class:`PlanSettings` with σ (None: not private); :meth:`make` builds the live plan."""

    settings: PlanSettings
    sigma: Optional[float]

    def to_dict(self) -> dict:
        """The settings' :meth:`~PlanSettings.to_dict` and ``sigma`` (JSON-serialisable)."""
        return {**self.settings.to_dict(), "sigma": self.sigma}

    @classmethod
    def from_dict(cls, d: dict) -> "CalibratedPlan":
        """The value :meth:`to_dict` wrote (report.json's ``dp.plan``, DPTrainer's ``dp_state.json`` ``plan``)."""
        return cls(PlanSettings.from_dict({k: v for k, v in d.items() if k != "sigma"}), d["sigma"])

    def make(self, *, rng, parts: Callable[[Any], tuple[Any, Any]], optimizer=None,
             optimizer_factory: Optional[Callable[[dict], Any]] = None, sampler: Any = None,
             transforms: Sequence = (), head_mask: Optional[Callable[[list[str]], list[bool]]] = None,
             hooks: Sequence[Callable[[Any], Any]] = (), rows: Any = None, padded: bool = False,
             mechanism: Optional[Mechanism] = None) -> PrivacyPlan:
        """The live plan: sampler, clip and engine, spec, the methods' hooks, the mechanism's install.

        Args:
            rng: the phase's secret randomness (``privacy/randomness.py``).
            parts: ``sampler -> (clip, engine)``, the front end's clip policy and per-example engine.
            optimizer: the step's optimizer (or a stand-in whose step the front end drives); or
                optimizer_factory: ``engine.params -> optimizer``.
            sampler: the sampler to draw with (its rates must be the settings'); default: the mechanism's.
            hooks: ``spec -> spec`` (the methods' ``build``), applied before the mechanism's install.
            rows: the training rows the sampler indexes (a stateful mechanism fingerprints them).
            padded: rows are padded to fixed shapes (truncated Poisson masks the padding).
            mechanism: the live mechanism (default: :meth:`PlanSettings.mechanism_part`).

        Raises:
            ValueError: the settings name an own sampler and none is given, or its rates are not
                the settings'; PlanError: the mechanism's noise buffers are too large.
        """
        s, sigma = self.settings, self.sigma
        mech = mechanism if mechanism is not None else s.mechanism_part()
        if sampler is None:
            if s.q is not None:
                raise ValueError(f"the plan was calibrated for the unit's own sampler (q = {s.q}); pass it as sampler")
            sampler = mech.sampler(s.n, s.expected_batch_size, rng)
        q = float(sampler.q)
        if q != s.sampling_rate or (s.partition_rate is not None and sampler.partition_rate != s.partition_rate):
            raise ValueError(f"the sampler's rate q = {q} is not the q = {s.sampling_rate} σ was calibrated on")
        clip, engine = parts(sampler)
        if optimizer_factory is not None:
            optimizer = optimizer_factory(engine.params)
        spec = build_step_spec(engine=engine, clip=clip, sigma=sigma, rng=rng, sampler=sampler, optimizer=optimizer,
                               head_mask=head_mask, hardened=s.hardened, transforms=list(transforms), phase=s.phase)
        for hook in hooks:
            spec = hook(spec)
        # Non-private too: truncated Poisson still masks padded rows (a banded install needs noise).
        spec = mech.install(spec, n=s.n, sampler=sampler, rng=rng, sigma=sigma, steps=s.steps, rows=rows,
                            padded=padded)
        return PrivacyPlan(mechanism=mech, sampler=sampler, n=s.n, q=q, steps=s.steps, sigma=sigma,
                           clip=spec.clip, engine=spec.engine, spec=spec, phase=s.phase,
                           phase_event=s.phase_event(), private=s.private, calibrated=self)


def build_privacy_plan(*, n: int, steps: int, mechanism: Mechanism, rng, parts: Callable[[Any], tuple[Any, Any]],
                       optimizer=None, optimizer_factory: Optional[Callable[[dict], Any]] = None, prior: Sequence = (),
                       calibrate: Optional[Callable] = None, sampler: Any = None, transforms: Sequence = (),
                       head_mask: Optional[Callable[[list[str]], list[bool]]] = None,
                       hooks: Sequence[Callable[[Any], Any]] = (), rows: Any = None, padded: bool = False,
                       on_sigma: Optional[Callable[[Optional[float]], None]] = None, **privacy) -> PrivacyPlan:
    """The privacy plan of one phase (see the module docstring for the order).

    Args:
        n: N privacy units (rows, or users); steps: planned logical steps (:func:`planned_steps`).
        **privacy: the :class:`PrivacySettings` fields by name (a way in's ``privacy_settings()``):
            ``expected_batch_size`` B (units); ``noise_multiplier`` σ (wins when a target is given
            too), or ``target_epsilon`` + ``target_delta``, the (ε, δ) σ is calibrated to; ``phase``;
            ``private`` (False: a phase with no mechanism, σ None); ``hardened``.
        mechanism: from :func:`~dpft.step.mechanisms.mechanism_of`.
        rng: the phase's secret randomness (``privacy/randomness.py``).
        parts: ``sampler -> (clip, engine)``, the front end's clip policy and per-example engine.
        optimizer: the step's optimizer (or a stand-in whose step the front end drives); or
            optimizer_factory: ``engine.params -> optimizer``.
        prior: the ledger's earlier events; calibrate: runs the calibration (DDP: rank 0).
        sampler: the sampler to draw with: a unit's own (user level, a batch schedule), or the
            mechanism's (dpft train builds it with its unit; the value records it as none given).
        hooks: ``spec -> spec`` (the methods' ``build``), applied before the mechanism's install.
        on_sigma: called with σ as soon as it is resolved, before ``parts`` and the hooks (a
            method's ``build`` reads ``run.sigma``: DP-Adam-AC's gradient and count noise).
        rows: the training rows the sampler indexes (a stateful mechanism fingerprints them).
        padded: rows are padded to fixed shapes (truncated Poisson masks the padding).

    Raises:
        PlanError: the mechanism's sampler refuses (e.g. banded p > 1), its noise buffers are too
            large; CalibrationError: δ ≥ 1/N or the target cannot be met.
    """
    calibrated = PlanSettings.of(mechanism, n=n, steps=steps, sampler=sampler, **privacy).calibrate(prior, calibrate)
    if on_sigma is not None:
        on_sigma(calibrated.sigma)
    return calibrated.make(rng=rng, parts=parts, optimizer=optimizer, optimizer_factory=optimizer_factory,
                           sampler=sampler, transforms=transforms, head_mask=head_mask, hooks=hooks, rows=rows,
                           padded=padded, mechanism=mechanism)
