"""The Gaussian mechanism applied to the summed clipped gradient of one logical batch."""

from __future__ import annotations

from typing import Callable, Optional

import dp_accounting as dpa
import torch

from dpft.privacy.randomness import Randomness, SecretStream


class GaussianMechanism:
    """Adds ``N(0, (σ·C)² I)`` to the clipped sum ``Σ_i c_i g_i`` once per logical batch.

    Sensitivity: under add/remove-one neighbouring datasets one example changes the clipped
    sum by at most ``C`` in L2 (every clip policy guarantees ‖c_i g_i‖ ≤ C), so noise std σC
    gives the Gaussian mechanism with noise multiplier σ. Under replace-one it would be 2C;
    dpft accounts with add/remove-one throughout.

    Args:
        sigma: noise multiplier σ ≥ 0.
        sensitivity: clipping norm C.
        rng: the run's secret randomness; the noise of tensor ``name`` at step t comes from
            its stream ``noise``, (t, name) (secret by default, so nobody can regenerate and
            subtract it; in reproducible mode a resumed run redraws the same noise for the same
            step). Every tensor has its own stream, so no two tensors of a release — on one
            device or on several — get the same noise.
        hardened: accepted for compatibility and ignored: every draw is the sum of four
            independent generators' normals / 2 (privacy/randomness.py states its entropy).
        accounted_sigma: σ recorded in the ledger when it differs from the noise σ (adaptive
            clipping).
        step_event: ``(q, σ) -> DpEvent``, one step's ledger event as the sampler that draws the
            batches defines it (truncated Poisson: :meth:`~dpft.step.truncated.TruncatedPoissonSampler.step_event`,
            handed over by step/mechanisms.py ``TruncatedPoisson.install``); None: plain Poisson,
            ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``.

    Attributes:
        stateful: carries secret state beyond the key, saved and restored on resume (False here;
            :class:`~dpft.step.correlated.BandedMFMechanism`'s noise buffers: True).

    Raises:
        ValueError: σ < 0.
    """

    stateful = False

    def __init__(self, sigma: float, sensitivity: float, rng: Randomness, hardened: bool = True,
                 accounted_sigma: float | None = None,
                 step_event: Callable[[float, float], dpa.DpEvent] | None = None):
        if sigma < 0:
            raise ValueError(f"noise multiplier σ must be ≥ 0, got {sigma}")
        self.sigma = float(sigma)
        #: σ of the ledger event. Equal to σ except with adaptive clipping, where the gradient
        #: noise σ_Δ and the count noise together make one Gaussian of multiplier σ
        #: (Andrew et al. 2021; step/clip.py ``effective_noise_multiplier``).
        self.accounted_sigma = float(sigma if accounted_sigma is None else accounted_sigma)
        self.sensitivity = float(sensitivity)
        self.rng = rng
        self.hardened = hardened
        #: The sampler's ``(q, σ) -> DpEvent`` of one step (None: plain Poisson); the sampler's
        #: property (e.g. truncation's (N, B_max)), read through it, never copied here.
        self.step_event = step_event

    @property
    def std(self) -> float:
        """Noise standard deviation per coordinate of the sum: σ·C."""
        return self.sigma * self.sensitivity

    def noise_stream(self, step: int, name: str, device: torch.device) -> SecretStream:
        """The secret stream of tensor ``name``'s noise at step ``step``: ``noise``, (step, name),
        drawn on ``device``. The device *index* is not part of it, so DDP ranks (each holding
        the tensor on its own ``cuda:r``) draw the same noise; the name keeps the tensors of one
        release apart whatever device each lives on."""
        return self.rng.stream("noise", int(step), str(name), device=device)

    def add_noise(self, grad_sum: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Return ``{name: sum + N(0, (σC)²)}`` (new fp32-noised tensors; parameters in name order).

        The noise of each tensor is drawn on the tensor's own device from its own stream
        (:meth:`noise_stream`): on CUDA four ``torch.Generator(device="cuda:N")`` (Philox)
        seeded on the host from different 64-bit slices of the secret stream; nothing is
        drawn on the CPU or copied. Drawn and added in fp32 whatever the autocast dtype of
        the step (the sums are fp32)."""
        out = {}
        for name, t in grad_sum.items():
            noise = self.noise_stream(step, name, t.device).normal(t.shape, dtype=torch.float32, device=t.device)
            out[name] = (t.float() + self.std * noise).to(t.dtype)
        return out

    def release(self, grad_sum: dict[str, torch.Tensor], sensitivity: float, q: float,
                step: int) -> tuple[dict[str, torch.Tensor], dpa.DpEvent]:
        """The Gaussian mechanism on one logical step's clipped sum.

        Args:
            grad_sum: name → Σᵢ cᵢgᵢ (the clipped sum, not averaged).
            sensitivity: the clip policy's L2 sensitivity C *at release time* (adaptive
                clipping moves it between steps).
            q: this step's Poisson sampling rate.
            step: the logical step index (selects the secret noise stream).

        Returns:
            ``(noisy sum, event(q))``: :meth:`event`.
        """
        self.sensitivity = float(sensitivity)
        return self.add_noise(grad_sum, step), self.event(q)

    def event_at(self, step: int, q: float) -> dpa.DpEvent:
        """The ledger event of logical step ``step`` at sampling rate ``q``: :meth:`event` (independent
        noise: the same at every step). The one interface of the mechanism family — banded MF's
        event depends on the step (:meth:`~dpft.step.correlated.BandedMFMechanism.event_at`)."""
        return self.event(q)

    def state(self) -> dict:
        """Secret state beyond the key: none (``stateful`` False; banded MF's noise buffers)."""
        return {}

    def load_state(self, st: dict, device_of: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Nothing to restore (:meth:`state` is empty)."""

    def event(self, q: float) -> dpa.DpEvent:
        """The ledger event of one step: ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_accounted))``,
        or the sampler's ``step_event(q, σ_accounted)`` when it was handed one (truncated Poisson:
        ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ_accounted)``)."""
        if self.step_event is not None:
            return self.step_event(q, self.accounted_sigma)
        return dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(self.accounted_sigma))
