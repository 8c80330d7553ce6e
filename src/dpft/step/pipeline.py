"""``DPStep``: the one place a private step happens.

sample → per-example engine → clip policy (inside the engine) → aggregate → mechanism.release
(returns its ``DpEvent``; sensitivity asked of the clip policy at release time) → ledger.record
→ post-processing transforms → optimizer. The CLI trainer (``run/loop.py``), the Opacus-shaped
``PrivacyEngine`` (``api/``) and the Hugging Face ``DPTrainer`` (``integrations/hf/trainer.py``) all
run their private steps through it, so sampling, noise and accounting agree by construction
(jax_privacy's ``DPExecutionPlan`` idea).

Source: Abadi et al. 2016 (DP-SGD, Algorithm 1), with Poisson sampling and division by the
expected batch size qN (the realised size is private).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional

import torch

from dpft.accounting.ledger import PrivacyLedger
from dpft.step.aggregate import Aggregator
from dpft.step.clip import ClipPolicy, NonFiniteGradientError
from dpft.step.noise import GaussianMechanism
from dpft.step.postprocess import Transform, divide
from dpft.step.sample import PoissonSampler

if TYPE_CHECKING:
    from dpft.grads.base import PerExampleEngine


#: Release observers of this process (:func:`observe_releases`), in registration order.
_RELEASE_OBSERVERS: list = []


@contextlib.contextmanager
def observe_releases(observer) -> Iterator[Any]:
    """While active, every private release of every :class:`DPStep` in this process (``dpft train``,
    ``make_private``, ``DPTrainer``, the TRL trainers) passes through ``observer`` — the hook of the
    white-box audit (audit/dirac.py), which adds its gradient canaries to the clipped sum and reads
    their coordinates of the noised release:

    * ``observer.before_release(clipped_sum, sensitivity, q, step, mechanism) -> clipped_sum``
      (a dict of tensors; return it unchanged to only observe);
    * ``observer.after_release(noisy_sum, sensitivity, q, step, mechanism)``.

    Non-private steps (no mechanism) are not observed. Yields ``observer``."""
    _RELEASE_OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _RELEASE_OBSERVERS.remove(observer)


@dataclass
class StepSpec:
    """The parts of a DP step. Methods return a changed copy (``dataclasses.replace``) from
    ``Method.build``; nothing else mutates them.

    Attributes:
        engine: per-example engine (book-keeping, reference, subspace, non-private).
        clip: clip policy; its ``sensitivity`` is read at release time.
        mechanism: the Gaussian mechanism, or None for a non-private run (no ledger event).
        sampler: Poisson sampler over the N privacy units.
        optimizer: any ``torch.optim.Optimizer`` over the engine's parameters (or the
            parameters ``params`` names, e.g. DP-SFT's coordinates).
        transforms: post-processing, in order.
        params: name → parameter that receives ``.grad`` (default: ``engine.params``).
        phase: ledger phase of this step's events.
        keep_norms: keep raw per-example norms in the output (NOT CERTIFIED reproductions only).
    """

    engine: "PerExampleEngine"
    clip: ClipPolicy
    mechanism: Optional[GaussianMechanism]
    sampler: PoissonSampler
    optimizer: torch.optim.Optimizer
    transforms: list[Transform] = field(default_factory=list)
    params: Optional[dict[str, torch.Tensor]] = None
    phase: str = "train"
    keep_norms: bool = False

    def replace(self, **changes) -> "StepSpec":
        """A changed copy (the spec itself is never mutated by methods)."""
        return replace(self, **changes)


@dataclass
class StepOutput:
    """What one logical step produced.

    ``released``: post-processing statistics of the noisy gradient (safe to publish).
    ``private``: un-noised statistics (loss, realised batch size, clipped count, times): the
    release set never holds them (outputs/release.py).
    """

    step: int
    q: float
    released: dict[str, Any]
    private: dict[str, Any]
    raw_norms: Optional[torch.Tensor] = None


class DPStep:
    """Runs logical steps of DP-SGD / DP-Adam over a :class:`StepSpec`.

    Args:
        spec: the parts.
        ledger: the run's ledger; this object appends one event per private step.
        n: number of privacy units N (the sampler's population).
        on_release: called after every ledger append (e.g. save the live ``ledger.json``).
        world_group: ``torch.distributed`` group whose ranks share one logical batch (None =
            the default group when initialised, else a single process).

    Raises (from :meth:`run`): ``NonFiniteGradientError`` from the engine; nothing is recorded
    or stepped for that step.
    """

    def __init__(self, spec: StepSpec, ledger: PrivacyLedger, n: int,
                 on_release: Optional[Callable[[], None]] = None, world_group: Optional[object] = None):
        self.spec = spec
        self.ledger = ledger
        self.n = int(n)
        self.on_release = on_release
        self.world_group = world_group
        #: The way in's :class:`~dpft.step.guard.ReleaseGuard` (None: no guard): every release
        #: grants the real optimizer exactly one update on the gradient it wrote.
        self.guard = None
        #: Ledger events this step has recorded (its releases; the guard's end-of-training count).
        self.recorded = 0

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.spec.params if self.spec.params is not None else self.spec.engine.params

    def q_at(self, step: int) -> float:
        s = self.spec.sampler
        return s.q_at(step) if hasattr(s, "q_at") else s.q

    def indices(self, step: int) -> torch.Tensor:
        """This step's logical batch (the rank's share of it under DDP is chosen by the caller)."""
        return self.spec.sampler.indices(step)

    def run(self, step: int, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> StepOutput:
        """One logical step over the given physical micro-batches (already sampled).

        Args:
            step: logical step index t (selects the secret noise stream).
            micro_batches: the logical batch's micro-batches (dicts of ``(B, …)`` tensors); an
                empty iterable is an empty Poisson batch, which still releases noise.
        """
        sp = self.spec
        t0 = time.perf_counter()
        sp.engine.clip = sp.clip  # the spec's clip policy is the one in force (methods may swap it)
        agg = Aggregator(sp.engine.params, keep_norms=sp.keep_norms)
        failure: Optional[NonFiniteGradientError] = None
        try:
            for batch in micro_batches:
                agg.add(sp.engine.clipped_sum(batch))
        except NonFiniteGradientError as exc:
            if not Aggregator.distributed(self.world_group):
                raise
            failure = exc  # DDP: the other ranks must hear of it before anyone releases the step
        if agg.all_reduce(self.world_group, failed=failure is not None):
            raise failure or NonFiniteGradientError(
                "non-finite training loss on another rank; lower optimizer.lr or check the data")
        return self.release_and_update(step, agg, t0)

    def _as_grad(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``g`` as ``p``'s ``.grad`` (FSDP, dpft/placement/fsdp.py: this rank's shard wrapped as a DTensor)."""
        return g

    def release_and_update(self, step: int, agg: Aggregator, t0: Optional[float] = None) -> StepOutput:
        """Noise (once per logical step), ledger, post-processing and the optimizer step on an
        aggregated clipped sum (``make_private`` accumulates micro-batches itself)."""
        sp = self.spec
        t0 = time.perf_counter() if t0 is None else t0
        q = self.q_at(step)
        if sp.mechanism is not None:
            clipped = agg.sum
            for obs in _RELEASE_OBSERVERS:  # the white-box audit's canaries (observe_releases)
                clipped = obs.before_release(clipped, sp.clip.sensitivity, q, step, sp.mechanism)
            noisy, event = sp.mechanism.release(clipped, sp.clip.sensitivity, q, step)
            for obs in _RELEASE_OBSERVERS:
                obs.after_release(noisy, sp.clip.sensitivity, q, step, sp.mechanism)
            self.ledger.record(sp.phase, event)
            self.recorded += 1
            if self.on_release is not None:
                self.on_release()
            noise_std = sp.mechanism.std
        else:
            noisy, noise_std = agg.sum, 0.0
        denom = q * self.n  # expected batch size: the realised one is private
        grads = divide(noisy, denom)
        ctx = {"noise_std": noise_std / denom, "step": step, "q": q}
        released: dict[str, Any] = {}
        t_tf = time.perf_counter()
        for tf in sp.transforms:
            grads = tf(grads, ctx)
            den = getattr(tf, "denoiser", None)
            if den is not None:
                released.update(den.summary())
        t_tf = time.perf_counter() - t_tf
        params = self.params
        for name, p in params.items():
            p.grad = self._as_grad(p, grads[name].to(p.dtype))
        if self.guard is not None and sp.mechanism is not None:
            self.guard.grant(params)  # the optimizer may apply this noised gradient, once
        sp.optimizer.step()
        sp.optimizer.zero_grad(set_to_none=True)
        private = {"train_loss": agg.loss_sum / max(agg.batch_size, 1), "batch_size": agg.batch_size,
                   "clipped": agg.clipped, "loss_sum": agg.loss_sum,
                   "step_seconds": time.perf_counter() - t0, "transform_seconds": t_tf}
        if sp.mechanism is not None:
            private["clip_fraction"] = agg.clipped / max(agg.batch_size, 1)
        private["overflowed"] = agg.overflowed  # fp16 examples that contributed 0 (dpft/placement/device.py)
        norms = torch.cat(agg.norms) if agg.norms else None
        return StepOutput(step, q, released, private, norms)
