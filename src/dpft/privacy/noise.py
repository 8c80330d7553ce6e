"""The Gaussian mechanism applied to the summed clipped gradient of one logical batch."""

from __future__ import annotations

import os

import dp_accounting as dpa
import torch

from dpft.data.sampler import hash_seed


class GaussianMechanism:
    """Adds ``N(0, (σ·C)² I)`` to the clipped sum ``Σ_i c_i g_i`` once per logical batch.

    Sensitivity: under add/remove-one neighbouring datasets one example changes the clipped
    sum by at most ``C`` in L2 (every clip policy guarantees ‖c_i g_i‖ ≤ C), so noise std σC
    gives the Gaussian mechanism with noise multiplier σ. Under replace-one it would be 2C;
    dpft accounts with add/remove-one throughout.

    Args:
        sigma: noise multiplier σ ≥ 0.
        sensitivity: clipping norm C.
        seed: noise seed; step t's noise comes from a generator seeded by (seed, t), so a
            resumed run redraws the same noise (the same release, not a second one).
        secure: draw each step's generator seed from ``os.urandom`` (not reproducible; a replayed
            step after a crash is then a new release and is accounted again).
    """

    def __init__(self, sigma: float, sensitivity: float, seed: int, secure: bool = False):
        if sigma < 0:
            raise ValueError(f"noise multiplier σ must be ≥ 0, got {sigma}")
        self.sigma = float(sigma)
        self.sensitivity = float(sensitivity)
        self.seed = seed
        self.secure = secure

    @property
    def std(self) -> float:
        """Noise standard deviation per coordinate of the sum: σ·C."""
        return self.sigma * self.sensitivity

    def generator(self, step: int) -> torch.Generator:
        s = int.from_bytes(os.urandom(8), "little") >> 1 if self.secure else hash_seed(self.seed, step, 0x4E)
        return torch.Generator().manual_seed(s)

    def add_noise(self, grad_sum: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """Return ``{name: sum + N(0, (σC)²)}`` (new tensors; parameters in name order)."""
        g = self.generator(step)
        out = {}
        for name, t in grad_sum.items():
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
            out[name] = t + self.std * noise
        return out

    def event(self, q: float) -> dpa.DpEvent:
        """The ledger event of one step: ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``."""
        return dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(self.sigma))
