"""The mechanisms as one family: each owns its batch selection (sampler), its release (noise
draw, correlation state), the ``dp_accounting`` event the ledger records and σ is calibrated on,
its secret state, and the combinations it refuses — so nothing outside asks which one it is.

- :class:`Mechanism`: Poisson sampling + independent Gaussian noise (DP-SGD, Abadi et al. 2016);
  the one-band case of banded MF.
- :class:`TruncatedPoisson`: at most B_max examples per logical batch (step/truncated.py;
  ``TruncatedSubsampledGaussianDpEvent``).
- :class:`BandedMF`: cyclic Poisson over b secret partitions and correlated noise
  (step/correlated.py; Choquette-Choo et al. 2023, Theorem 4).

Every way in picks one with :func:`mechanism_of` and hands it to the plan builder
(step/plan.py); ``names`` spells the settings as that way in does (recipe keys or keyword
arguments) so that each refusal names the fix the user can type.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import dp_accounting as dpa

from dpft.errors import PlanError
from dpft.step.correlated import (BandedMFMechanism, CyclicPoissonSampler, banded_coefficients, banded_phase_event,
                                  check_buffer_memory)
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler, check_batch
from dpft.step.truncated import MaskedEngine, TruncatedPoissonSampler, check_max_batch, truncated_event

__all__ = ["Mechanism", "TruncatedPoisson", "BandedMF", "mechanism_of", "mechanism_of_recipe", "RECIPE_NAMES", "KWARG_NAMES",
           "sampler_phase_event", "make_banded_mechanism"]

#: How ``dpft train`` spells the settings in a refusal.
RECIPE_NAMES = {"mechanism": "privacy.mechanism", "bands": "privacy.bands", "max_batch_size": "batch.max_batch_size",
                "batch": "batch.expected_batch_size", "user": "task.user_column", "schedule": "batch.schedule"}
#: How ``make_private`` and ``DPArguments`` spell them.
KWARG_NAMES = {"mechanism": "mechanism", "bands": "bands", "max_batch_size": "max_batch_size",
               "batch": "expected_batch_size", "user": "user_ids", "schedule": "batch schedule"}


class Mechanism:
    """Poisson sampling at q = B/N and N(0, σ²C²I) added once per logical batch (DP-SGD).

    Attributes:
        name: ``gaussian`` | ``banded_mf`` (the way in's ``mechanism`` setting).
        stateful: carries secret state beyond the key (saved and restored on resume).
    """

    name = "gaussian"
    stateful = False
    #: the class :meth:`sampler` builds (:meth:`owns`)
    _sampler_class = PoissonSampler

    def __init__(self, names: Optional[dict] = None):
        self.names = dict(KWARG_NAMES if names is None else names)

    def refusals(self, *, user_level: bool = False, methods: Sequence[str] = (), schedule: bool = False) -> list[str]:
        """Why this mechanism cannot be certified with these settings ([] when it can)."""
        return []

    def settings(self) -> dict:
        """Its parameters in simple types (step/plan.py ``PlanSettings``; :func:`mechanism_of`'s
        ``kind``, ``bands``, ``max_batch_size``)."""
        return {"mechanism": self.name}

    def check(self, n: int, expected_batch_size: int) -> None:
        """Raise what :meth:`sampler` would raise for N, B — nothing drawn (the plan checks its
        settings before σ is calibrated).

        Raises:
            ValueError, PlanError: naming the fix."""
        check_batch(n, expected_batch_size)

    def sampler(self, n: int, expected_batch_size: int, rng) -> PoissonSampler:
        """The logical-batch sampler over N units (raises ValueError naming the fix)."""
        return PoissonSampler(n, expected_batch_size, rng)

    def owns(self, sampler: Any, n: int, expected_batch_size: int) -> bool:
        """``sampler`` is this mechanism's own batch selection over N units at B (what :meth:`sampler`
        builds: its class and parameters), not a unit's own (user level, a batch schedule). The one
        rule of what the plan value records of a sampler (step/plan.py ``PlanSettings.of``): no rates
        for the mechanism's own (q = B/N, banded p = b·B/N follow from the settings), the rates of
        any other — the same value for the same settings whichever way in handed the sampler."""
        return (type(sampler) is self._sampler_class and sampler.n == n
                and sampler.expected_batch_size == expected_batch_size and self._same_parameters(sampler))

    def _same_parameters(self, sampler: Any) -> bool:
        return True

    def event_of(self, n: int, q: float, steps: int, partition_rate: Optional[float] = None
                 ) -> Optional[Callable[[float], Any]]:
        """``σ -> DpEvent`` of ``steps`` steps at rate q over N units (``partition_rate``: p of
        banded MF's cyclic sampler) when they are not ``steps`` × PoissonSampled(q, Gaussian(σ));
        None for plain Poisson (the calibration's default event). Pure: simple values only."""
        return None

    def phase_event(self, sampler, n: int, q: float, steps: int) -> Optional[Callable[[float], Any]]:
        """:meth:`event_of` for the rates of ``sampler``."""
        return self.event_of(n, q, steps)

    def install(self, spec, *, n: int, sampler, rng, sigma: float, steps: int, rows: Any = None,
                padded: bool = False):
        """The step spec with this mechanism in force (after the methods' ``build``)."""
        return spec

    def info(self, sampler, steps: int) -> dict:
        """The report's public description (no realised counts)."""
        return {}


class TruncatedPoisson(Mechanism):
    """Poisson sampling truncated to at most ``max_batch_size`` examples (a uniformly random
    subset when more are drawn); the ledger records ``TruncatedSubsampledGaussianDpEvent``."""

    _sampler_class = TruncatedPoissonSampler

    def __init__(self, max_batch_size: int, names: Optional[dict] = None):
        super().__init__(names)
        self.max_batch_size = int(max_batch_size)

    def refusals(self, *, user_level=False, methods=(), schedule=False) -> list[str]:
        nm = self.names
        why = []
        if schedule:
            why.append(f"{nm['schedule']} (a variable q) is not supported with {nm['max_batch_size']}; use "
                       f"{nm['batch']}")
        if user_level:
            why.append(f"user-level privacy ({nm['user']}) with truncated Poisson ({nm['max_batch_size']}) is not "
                       f"supported: at user level the batch is bounded by the rows per sampled user; drop "
                       f"{nm['max_batch_size']}")
        if methods:
            why.append(f"methods {list(methods)} build their own steps and mechanisms; run them with the plain "
                       f"mechanism (no {nm['max_batch_size']})")
        return why

    def settings(self):
        return {"mechanism": self.name, "max_batch_size": self.max_batch_size}

    def check(self, n, expected_batch_size):
        super().check(n, expected_batch_size)
        check_max_batch(self.max_batch_size)

    def sampler(self, n, expected_batch_size, rng):
        return TruncatedPoissonSampler(n, expected_batch_size, rng, self.max_batch_size)

    def _same_parameters(self, sampler):
        return sampler.max_batch_size == self.max_batch_size

    def event_of(self, n, q, steps, partition_rate=None):
        b = self.max_batch_size
        return lambda sigma: dpa.SelfComposedDpEvent(truncated_event(n, q, b, sigma), int(steps))

    def install(self, spec, *, n, sampler, rng, sigma, steps, rows=None, padded=False):
        """The spec's Gaussian mechanism rebuilt to record the sampler's event (its
        ``step_event``: ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` from the sampler's
        ``truncation``, read there at every step, never copied onto the mechanism); padded
        fixed-shape rows (``dpft train``) masked out of the clipped sum by the engine.

        Raises:
            PlanError: ``sampler`` does not truncate (its batches would not match the events), or
                the spec's mechanism is not the plain Gaussian one (a method's own release)."""
        if spec.mechanism is not None:
            if not isinstance(sampler, TruncatedPoissonSampler):
                raise PlanError(f"truncated Poisson ({self.names['max_batch_size']}) needs its own sampler, "
                                f"got {type(sampler).__name__}; drop {self.names['max_batch_size']} or the sampler")
            m = spec.mechanism
            if type(m) is not GaussianMechanism:  # a method's own release would be lost here
                raise PlanError(f"truncated Poisson ({self.names['max_batch_size']}) records its event on the plain "
                                f"Gaussian mechanism, got {type(m).__name__}; drop {self.names['max_batch_size']}")
            spec = spec.replace(mechanism=GaussianMechanism(m.sigma, m.sensitivity, m.rng, hardened=m.hardened,
                                                            accounted_sigma=m.accounted_sigma,
                                                            step_event=sampler.step_event))
        return spec.replace(engine=MaskedEngine(spec.engine)) if padded else spec

    def info(self, sampler, steps):
        return {"mechanism": "gaussian", "max_batch_size": self.max_batch_size,
                "truncation_probability_per_step": sampler.truncation_probability,
                "truncation_note": "P[Binomial(N, q) > max_batch_size], from N, q and the bound only",
                "event": "TruncatedSubsampledGaussianDpEvent"}


class BandedMF(Mechanism):
    """Banded matrix factorization with b bands (b = 1 is DP-SGD): cyclic Poisson over b secret
    partitions at rate p = b·B/N and the noise row t of C⁻¹Z; the ledger records
    PoissonSampled(p, Gaussian(σ)) at t ≡ 0 (mod b), NoOp otherwise (step/correlated.py)."""

    name = "banded_mf"
    stateful = True
    _sampler_class = CyclicPoissonSampler

    def __init__(self, bands: int, names: Optional[dict] = None):
        super().__init__(names)
        self.bands = int(bands)

    def refusals(self, *, user_level=False, methods=(), schedule=False) -> list[str]:
        nm = self.names
        why = []
        if schedule:
            why.append(f"{nm['schedule']} (a variable q) is not supported with banded_mf; use {nm['batch']}")
        if user_level:
            why.append(f"user-level privacy ({nm['user']}) with banded_mf has no certified accounting here "
                       f"(b-min-separation is per example); drop {nm['user']} or use {nm['mechanism']}='gaussian'")
        if methods:
            why.append(f"methods {list(methods)} build their own steps and mechanisms; run them with the plain "
                       f"mechanism ({nm['mechanism']}: gaussian)")
        return why

    def settings(self):
        return {"mechanism": self.name, "bands": self.bands}

    def partition_rate(self, n: int, expected_batch_size: int) -> float:
        """p = b·B/N, the Poisson rate within a partition (as :class:`CyclicPoissonSampler`'s).

        Raises:
            PlanError: p > 1, naming the fix."""
        p = self.bands * expected_batch_size / n
        if p > 1:
            nm = self.names
            raise PlanError(f"banded_mf with bands = {self.bands} samples each of {self.bands} partitions of N = {n} "
                             f"at rate p = b·B/N = {p:.3g} > 1; lower {nm['bands']} or {nm['batch']}")
        return p

    def check(self, n, expected_batch_size):
        self.partition_rate(n, expected_batch_size)
        super().check(n, expected_batch_size)

    def sampler(self, n, expected_batch_size, rng):
        self.partition_rate(n, expected_batch_size)
        return CyclicPoissonSampler(n, expected_batch_size, rng, self.bands)

    def _same_parameters(self, sampler):
        return sampler.bands == self.bands

    def event_of(self, n, q, steps, partition_rate=None):
        p, b = partition_rate, self.bands
        return lambda sigma: banded_phase_event(sigma, p, steps, b)

    def phase_event(self, sampler, n, q, steps):
        return self.event_of(n, q, steps, sampler.partition_rate)

    def install(self, spec, *, n, sampler, rng, sigma, steps, rows=None, padded=False):
        """The banded-MF mechanism for ``steps`` steps (after the buffer-memory check); its state
        carries the sampler's secret partition and a fingerprint of ``rows``."""
        if spec.mechanism is None:
            return spec
        params = spec.params if spec.params is not None else spec.engine.params
        try:
            mech = make_banded_mechanism(params, sigma, spec.mechanism.sensitivity, rng, sampler, steps,
                                         hardened=spec.mechanism.hardened)
        except ValueError as exc:  # noise buffers above the limit
            raise PlanError(str(exc)) from None
        mech.rows = rows
        return spec.replace(mechanism=mech)

    def info(self, sampler, steps):
        b = self.bands
        return {"mechanism": "banded_mf", "bands": b, "coefficients": [float(x) for x in banded_coefficients(steps, b)],
                "partition_rate": sampler.partition_rate, "participations_accounted": math.ceil(steps / b),
                "participation": f"cyclic Poisson: {b} secret partitions, partition t mod {b} at step t, rate p",
                "source": "Choquette-Choo et al. 2023, Amplified banded matrix factorization, Theorem 4"}


def mechanism_of(kind: str = "gaussian", bands: Optional[int] = None, max_batch_size: Optional[int] = None,
                 names: Optional[dict] = None) -> Mechanism:
    """The mechanism a way in asks for.

    Args:
        kind: ``gaussian`` | ``banded_mf``.
        bands: b ≥ 1 of ``banded_mf`` (default 4); refused with ``gaussian``.
        max_batch_size: B_max ≥ 1 of truncated Poisson; refused with ``banded_mf``.
        names: how the way in spells these settings (:data:`RECIPE_NAMES`, :data:`KWARG_NAMES`).

    Raises:
        PlanError: an unknown kind, bands without banded_mf or < 1, B_max < 1, or banded_mf
            with truncated Poisson (no dp-accounting event) — each naming the fix.
    """
    nm = dict(KWARG_NAMES if names is None else names)
    if kind not in ("gaussian", "banded_mf"):
        raise PlanError(f"{nm['mechanism']} must be 'gaussian' or 'banded_mf', got {kind!r}")
    if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
                                       or max_batch_size < 1):
        raise PlanError(f"{nm['max_batch_size']} must be a positive integer, got {max_batch_size!r}")
    if kind == "banded_mf":
        b = 4 if bands is None else bands
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise PlanError(f"{nm['bands']} must be an integer ≥ 1, got {b!r}")
        if max_batch_size is not None:
            raise PlanError(f"banded_mf with truncated Poisson has no dp-accounting event; drop "
                             f"{nm['max_batch_size']} or use {nm['mechanism']}='gaussian'")
        return BandedMF(b, nm)
    if bands is not None:
        raise PlanError(f"{nm['bands']} is the b of {nm['mechanism']}='banded_mf'; set {nm['mechanism']}='banded_mf' "
                         f"or drop {nm['bands']}")
    return TruncatedPoisson(max_batch_size, nm) if max_batch_size is not None else Mechanism(nm)


def mechanism_of_recipe(recipe) -> Mechanism:
    """The mechanism of a ``dpft train`` recipe (``privacy.mechanism``, ``privacy.bands``,
    ``batch.max_batch_size``; a non-private recipe keeps only the truncated sampler).

    Raises:
        PlanError: as :func:`mechanism_of`, in the recipe's spelling."""
    r = recipe
    banded = r.privacy.enabled and r.privacy.mechanism == "banded_mf"
    return mechanism_of("banded_mf" if banded else "gaussian", r.privacy.bands if banded else None,
                        r.batch.max_batch_size, RECIPE_NAMES)


def sampler_phase_event(sampler, n: int, q: float, steps: int) -> Optional[Callable[[float], Any]]:
    """``σ -> DpEvent`` of ``steps`` steps drawn by ``sampler`` (the event σ is calibrated on),
    read off the sampler: banded (cyclic Poisson), truncated, or None for plain Poisson."""
    if isinstance(sampler, CyclicPoissonSampler):
        return BandedMF(sampler.bands).phase_event(sampler, n, q, steps)
    if getattr(sampler, "max_batch_size", None) is not None:
        return TruncatedPoisson(sampler.max_batch_size).phase_event(sampler, n, q, steps)
    return None


def make_banded_mechanism(params, sigma: float, sensitivity: float, rng, sampler, steps: int, hardened: bool = True):
    """The banded-MF mechanism for ``steps`` steps of the cyclic Poisson ``sampler`` (its secret
    partition travels with the noise state, so a resume keeps b-min-separation), after the
    buffer-memory check (step/correlated.py).

    Raises:
        ValueError: the noise buffers ((b − 1) × ``params`` in fp32) above the limit."""
    check_buffer_memory(params, sampler.bands)
    mech = BandedMFMechanism(sigma, sensitivity, rng, banded_coefficients(steps, sampler.bands),
                             sampler.partition_rate, hardened=hardened)
    mech.sampler = sampler
    return mech
