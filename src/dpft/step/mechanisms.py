"""Wiring of the mechanisms beyond independent-Gaussian DP-SGD into a plan (run/plan.py):
truncated Poisson with fixed shapes (``batch.max_batch_size``, step/truncated.py) and banded
matrix factorization (``privacy.mechanism: banded_mf``, step/correlated.py).

Each function is a no-op for a plain recipe, so the plan calls them unconditionally.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

__all__ = ["check_mechanisms", "make_sampler", "phase_event_of", "install_mechanism", "mechanism_info",
           "sampler_phase_event", "make_banded_mechanism"]


def _banded(recipe) -> bool:
    return recipe.privacy.enabled and recipe.privacy.mechanism == "banded_mf"


def check_mechanisms(recipe, method_names: list[str]) -> None:
    """Refuse combinations that cannot be certified yet, from the recipe alone (before loading).

    Raises:
        TrainingError: naming the reason and the fix."""
    from dpft.run.errors import TrainingError

    r = recipe
    trunc = r.batch.max_batch_size is not None
    why = []
    if (trunc or _banded(r)) and r.batch.schedule:
        why.append("batch.schedule (a variable q) is not supported; use batch.expected_batch_size")
    if (trunc or _banded(r)) and r.task.user_column and r.privacy.enabled:
        why.append("user-level privacy (task.user_column) is not supported; drop the user column")
    if (trunc or _banded(r)) and method_names and r.privacy.enabled:
        why.append(f"methods {method_names} build their own steps and mechanisms; run them with the plain "
                   "mechanism (no batch.max_batch_size, privacy.mechanism: gaussian)")
    if trunc and _banded(r):
        why.append("banded_mf with truncated Poisson has no dp-accounting event; drop batch.max_batch_size")
    if why:
        raise TrainingError("cannot certify this recipe: " + "; ".join(why))


def make_sampler(recipe, n_rows: int, rng) -> Optional[Any]:
    """The sampler these mechanisms need (None: the plain Poisson sampler).

    Raises:
        TrainingError: banded_mf with b·B > N."""
    r = recipe
    if _banded(r):
        from dpft.run.errors import TrainingError
        from dpft.step.correlated import CyclicPoissonSampler

        try:
            return CyclicPoissonSampler(n_rows, r.batch.expected_batch_size, rng, r.privacy.bands)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
    if r.batch.max_batch_size is not None:
        from dpft.step.truncated import TruncatedPoissonSampler

        return TruncatedPoissonSampler(n_rows, r.batch.expected_batch_size, rng, r.batch.max_batch_size)
    return None


def phase_event_of(recipe, unit, steps: int) -> Optional[Callable[[float], Any]]:
    """``σ -> DpEvent`` of the training phase when it is not ``steps`` × PoissonSampled(q,
    Gaussian(σ)) — for σ calibration on the very events the run records; None otherwise."""
    return sampler_phase_event(unit.sampler, unit.n, unit.q, steps)


def sampler_phase_event(sampler, n: int, q: float, steps: int) -> Optional[Callable[[float], Any]]:
    """``σ -> DpEvent`` of ``steps`` steps drawn by ``sampler`` (the event σ is calibrated on and
    the run records): ⌈steps/b⌉ × PoissonSampled(p, Gaussian(σ)) for a
    :class:`~dpft.step.correlated.CyclicPoissonSampler` (banded MF), ``steps`` ×
    TruncatedSubsampledGaussian(N, q, B_max, σ) for a truncated sampler; None for plain Poisson.
    Shared by ``dpft train`` (:func:`phase_event_of`), ``make_private`` and ``DPTrainer``."""
    import dp_accounting as dpa

    from dpft.step.correlated import CyclicPoissonSampler, banded_phase_event

    s = sampler
    if isinstance(s, CyclicPoissonSampler):
        return lambda sigma: banded_phase_event(sigma, s.partition_rate, steps, s.bands)
    if getattr(s, "max_batch_size", None) is not None:
        from dpft.step.truncated import truncated_event

        return lambda sigma: dpa.SelfComposedDpEvent(truncated_event(n, q, s.max_batch_size, sigma), int(steps))
    return None


def make_banded_mechanism(params, sigma: float, sensitivity: float, rng, sampler, steps: int, hardened: bool = True):
    """The banded-MF mechanism for ``steps`` steps of the cyclic Poisson ``sampler`` (its secret
    partition travels with the noise state, so a resume keeps b-min-separation), after the
    buffer-memory check (step/correlated.py). Shared by every way in.

    Raises:
        ValueError: the noise buffers ((b − 1) × ``params`` in fp32) above the limit."""
    from dpft.step.correlated import BandedMFMechanism, banded_coefficients, check_buffer_memory

    check_buffer_memory(params, sampler.bands)
    mech = BandedMFMechanism(sigma, sensitivity, rng, banded_coefficients(steps, sampler.bands),
                             sampler.partition_rate, hardened=hardened)
    mech.sampler = sampler
    return mech


def install_mechanism(spec, recipe, unit, rng, sigma: float, steps: int):
    """The step spec with these mechanisms in force (after the methods' ``build``): truncation
    recorded by the Gaussian mechanism and padded rows masked by the engine; or the banded-MF
    mechanism. Returns ``spec`` itself for a plain or non-private recipe.

    Raises:
        TrainingError: banded_mf noise buffers too large (step/correlated.py)."""
    r = recipe
    s = unit.sampler
    if getattr(s, "max_batch_size", None) is not None:
        from dpft.step.truncated import MaskedEngine

        if spec.mechanism is not None:
            spec.mechanism.truncation = (unit.n, s.max_batch_size)
        return spec.replace(engine=MaskedEngine(spec.engine))
    if spec.mechanism is None:
        return spec
    if _banded(r):
        from dpft.run.errors import TrainingError

        params = spec.params if spec.params is not None else spec.engine.params
        try:
            mech = make_banded_mechanism(params, sigma, spec.mechanism.sensitivity, rng, s, steps,
                                         hardened=spec.mechanism.hardened)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        return spec.replace(mechanism=mech)
    return spec


def mechanism_info(recipe, unit, steps: int) -> dict:
    """The report's public description of the mechanism (no realised counts)."""
    r = recipe
    s = unit.sampler
    if _banded(r):
        from dpft.step.correlated import banded_coefficients

        b = s.bands
        return {"mechanism": "banded_mf", "bands": b, "coefficients": [float(x) for x in banded_coefficients(steps, b)],
                "partition_rate": s.partition_rate, "participations_accounted": math.ceil(steps / b),
                "participation": f"cyclic Poisson: {b} secret partitions, partition t mod {b} at step t, rate p",
                "source": "Choquette-Choo et al. 2023, Amplified banded matrix factorization, Theorem 4"}
    if getattr(s, "max_batch_size", None) is not None:
        return {"mechanism": "gaussian", "max_batch_size": s.max_batch_size,
                "truncation_probability_per_step": s.truncation_probability,
                "truncation_note": "P[Binomial(N, q) > max_batch_size], from N, q and the bound only",
                "event": "TruncatedSubsampledGaussianDpEvent"}
    return {}
