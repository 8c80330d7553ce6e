"""The one privacy-plan builder: typed inputs -> a frozen :class:`PrivacyPlan` (jax_privacy's
``DPExecutionPlan`` idea). Every way in — ``dpft train``'s ``RunPlan`` (run/plan.py),
``make_private`` (api/engine.py), ``DPTrainer`` and the TRL trainers (integrations/) — builds its
privacy through :func:`build_privacy_plan`; their own code adapts only the front end (arguments,
data loader, Trainer hooks). In order::

    sampler     the mechanism's batch selection over the N units (or the unit's own sampler:
                user level, a batch schedule)
    steps       the planned logical steps: ``steps``, or ⌈epochs · N / B⌉ (one rule everywhere)
    σ           explicit, or calibrated (PLD) on the events this phase will record, composed
                after ``prior`` (the ledger's earlier events); δ < 1/N checked
    clip,engine the front end's (built from the sampler: user level clips to C/k)
    spec        Gaussian mechanism N(0, σ²C²I) from the run's secret randomness (step/noise.py)
    hooks       the methods' ``build`` (each returns a changed copy of the spec)
    install     the mechanism's own release (truncation, banded noise + its secret state)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dpft.step.build import build_step_spec, resolve_sigma
from dpft.step.mechanisms import Mechanism

__all__ = ["PrivacyPlan", "build_privacy_plan", "planned_steps"]


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


def build_privacy_plan(*, n: int, expected_batch_size: int, steps: int, mechanism: Mechanism, rng,
                       parts: Callable[[Any], tuple[Any, Any]], optimizer=None,
                       optimizer_factory: Optional[Callable[[dict], Any]] = None,
                       noise_multiplier: Optional[float] = None, target_epsilon: Optional[float] = None,
                       delta: Optional[float] = None, prior: Sequence = (),
                       calibrate: Optional[Callable] = None, sampler: Any = None, private: bool = True,
                       hardened: bool = True, transforms: Sequence = (),
                       head_mask: Optional[Callable[[list[str]], list[bool]]] = None,
                       hooks: Sequence[Callable[[Any], Any]] = (), rows: Any = None, padded: bool = False,
                       phase: str = "train", on_sigma: Optional[Callable[[Optional[float]], None]] = None
                       ) -> PrivacyPlan:
    """The privacy plan of one phase (see the module docstring for the order).

    Args:
        n: N privacy units (rows, or users); expected_batch_size: B (units); steps: planned
            logical steps (:func:`planned_steps`).
        mechanism: from :func:`~dpft.step.mechanisms.mechanism_of`.
        rng: the phase's secret randomness (``privacy/randomness.py``).
        parts: ``sampler -> (clip, engine)``, the front end's clip policy and per-example engine.
        optimizer: the step's optimizer (or a stand-in whose step the front end drives); or
            optimizer_factory: ``engine.params -> optimizer``.
        noise_multiplier / target_epsilon + delta: σ (wins when both are given), or the (ε, δ)
            target σ is calibrated to;
            prior: the ledger's earlier events; calibrate: runs the calibration (DDP: rank 0).
        sampler: the unit's own sampler (user level, a batch schedule) instead of the
            mechanism's; private: False gives a phase with no mechanism (σ None).
        hooks: ``spec -> spec`` (the methods' ``build``), applied before the mechanism's install.
        on_sigma: called with σ as soon as it is resolved, before ``parts`` and the hooks (a
            method's ``build`` reads ``run.sigma``: DP-Adam-AC's gradient and count noise).
        rows: the training rows the sampler indexes (a stateful mechanism fingerprints them).
        padded: rows are padded to fixed shapes (truncated Poisson masks the padding).

    Raises:
        PlanError: the mechanism's sampler refuses (e.g. banded p > 1), its noise buffers are too
            large; CalibrationError: δ ≥ 1/N or the target cannot be met.
    """
    sampler = sampler if sampler is not None else mechanism.sampler(n, expected_batch_size, rng)
    q = float(sampler.q)
    event = mechanism.phase_event(sampler, n, q, steps) if private else None
    sigma = None
    if private:
        sigma = resolve_sigma(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, delta=delta, q=q, steps=steps, n=n, prior=prior,
                              calibrate=calibrate, phase_event=event)
    if on_sigma is not None:
        on_sigma(sigma)
    clip, engine = parts(sampler)
    if optimizer_factory is not None:
        optimizer = optimizer_factory(engine.params)
    spec = build_step_spec(engine=engine, clip=clip, sigma=sigma, rng=rng, sampler=sampler, optimizer=optimizer,
                           head_mask=head_mask, hardened=hardened, transforms=list(transforms), phase=phase)
    for hook in hooks:
        spec = hook(spec)
    # Non-private too: truncated Poisson still masks padded rows (a banded install needs noise).
    spec = mechanism.install(spec, n=n, sampler=sampler, rng=rng, sigma=sigma, steps=steps, rows=rows, padded=padded)
    return PrivacyPlan(mechanism=mechanism, sampler=sampler, n=int(n), q=q, steps=int(steps), sigma=sigma,
                       clip=spec.clip, engine=spec.engine, spec=spec, phase=phase, phase_event=event,
                       private=bool(private))
