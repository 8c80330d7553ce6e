"""Builders of the DP step's parts, shared by every way in (``dpft train``'s plan, ``make_private``,
``DPTrainer``): the noise multiplier σ, the per-example engine, and the step spec (Poisson sampler,
Gaussian mechanism, clip policy, optimizer, transforms). Each way in turns its own arguments into
these calls; none wires the step its own way.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dpft.accounting.calibrate import calibrate_sigma, check_delta
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine
from dpft.step.clip import ClipSettings, build_clip_policy
from dpft.step.noise import GaussianMechanism
from dpft.step.pipeline import StepSpec

__all__ = ["resolve_sigma", "make_engine", "build_clip", "build_step_spec"]


def resolve_sigma(*, noise_multiplier: Optional[float], target_epsilon: Optional[float], delta: Optional[float],
                  q: float, steps: int, n: int, prior: Sequence = (),
                  calibrate: Optional[Callable[[Callable[[], float]], float]] = None,
                  phase_event: Optional[Callable[[float], Any]] = None) -> float:
    """The noise multiplier σ of a plan: the explicit ``noise_multiplier``, or calibrated with
    ``dp_accounting`` (PLD) so that the ``prior`` events composed with ``steps`` events
    ``PoissonSampled(q, Gaussian(σ))`` give ``target_epsilon`` at ``delta`` — the same events the run
    will record (accounting/calibrate.py). δ < 1/N is checked whenever δ is given.

    Args:
        n: N units (the δ check).
        calibrate: runs the calibration (DDP: on rank 0, the answer broadcast); default: here.
        phase_event: ``σ -> DpEvent`` of the whole phase when the run records other events than
            ``steps`` × PoissonSampled(q, Gaussian(σ)) (truncated Poisson, banded MF: see
            :func:`phase_event_of`).

    Raises:
        CalibrationError: δ ≥ 1/N, or no σ reaches the target.
    """
    if delta is not None:
        check_delta(delta, n)
    if noise_multiplier is not None:
        return float(noise_multiplier)

    def run() -> float:
        return calibrate_sigma(target_epsilon, delta, q, steps, prior=list(prior), phase_event=phase_event)

    return calibrate(run) if calibrate is not None else run()


def make_engine(kind: str, model, loss_fn, clip, **engine_kw):
    """The per-example engine: ``bookkeeping`` (fast path, grads/bookkeeping.py) · ``reference``
    (``torch.func``, grads/reference.py) · ``auto`` (book-keeping, else reference).

    Unknown kinds give the reference engine (the recipe schema names the three)."""
    if kind in ("auto", "bookkeeping"):
        return BookKeepingEngine(model, loss_fn, clip, **engine_kw)
    return ReferenceEngine(model, loss_fn, clip)


def build_step_spec(*, engine, clip, sigma: Optional[float], rng, sampler, optimizer,
                    head_mask: Optional[Callable[[list[str]], list[bool]]] = None, hardened: bool = True,
                    transforms: Sequence = (), params: Optional[dict] = None, phase: str = "train"):
    """The :class:`~dpft.step.pipeline.StepSpec` of a private (``sigma`` given) or non-private
    (``sigma`` None: no mechanism) step.

    The Gaussian mechanism adds N(0, σ²C²I) with C the clip policy's sensitivity, drawn from
    ``rng`` (the run's secret randomness; step/noise.py). ``head_mask`` maps the engine's
    parameter names to head flags for a clip policy that splits C between head and body.
    """
    if head_mask is not None and hasattr(clip, "set_head_mask"):
        clip.set_head_mask(head_mask(list(engine.params)))
    mechanism: Any = None if sigma is None else GaussianMechanism(sigma, clip.sensitivity, rng, hardened=hardened)
    return StepSpec(engine=engine, clip=clip, mechanism=mechanism, sampler=sampler, optimizer=optimizer,
                    transforms=list(transforms), params=params if params is not None else engine.params, phase=phase)


def build_clip(privacy_cfg, user_clipping: Optional[str] = None, max_rows_per_user: int = 1):
    """The recipe's clip policy: ``privacy.clipping`` (style, max_norm, gamma, head_fraction) and, at
    user level, ``task.user_clipping`` / ``task.max_rows_per_user`` translated into the one clip
    builder (step/clip.py :func:`~dpft.step.clip.build_clip_policy`, as ``make_private`` and
    ``DPTrainer`` call it). With ``per_example_over_k`` each row is clipped to C/k."""
    c = privacy_cfg.clipping
    return build_clip_policy(ClipSettings(c.style, c.max_norm, c.gamma, c.head_fraction,
                                          max_rows_per_user if user_clipping == "per_example_over_k" else None))
