"""Poisson sampling of logical batches, split into physical micro-batches.

Each example joins step t's logical batch independently with probability q = expected batch
size / N, where N is the size of the training set (never ``1 / len(loader)``). This is the
sampling the accountant's ``PoissonSampledDpEvent(q, ·)`` assumes. Batches may be empty.

The draw of step t comes from the run's secret randomness (privacy/randomness.py), stream
``sample`` and step t: secret by default (a resumed run draws fresh batches; the live ledger
accounts the replayed steps), the same batches for the same seed in reproducible mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dpft.privacy.randomness import Randomness


class PoissonSampler:
    """Args:
        n: dataset size N (≥ 1).
        expected_batch_size: q·N (≥ 1, ≤ N).
        rng: the run's :class:`~dpft.privacy.randomness.Randomness` (secret by default).

    Raises:
        ValueError: empty dataset or expected batch larger than N.
    """

    def __init__(self, n: int, expected_batch_size: int, rng: "Randomness"):
        if n < 1:
            raise ValueError("cannot sample from an empty training set")
        if not 1 <= expected_batch_size <= n:
            raise ValueError(
                f"expected batch size {expected_batch_size} must be between 1 and N = {n}; "
                "lower batch.expected_batch_size"
            )
        self.n = n
        self.expected_batch_size = expected_batch_size
        self.q = expected_batch_size / n
        self.rng = rng

    def indices(self, step: int) -> torch.Tensor:
        """Indices of step ``step``'s logical batch (int64, sorted, possibly empty)."""
        return self.draw(step, self.q)

    def draw(self, step: int, q: float) -> torch.Tensor:
        """Each of the N examples independently with probability ``q`` (stream ``sample``, step)."""
        g = self.rng.generator("sample", step)
        return torch.nonzero(torch.rand(self.n, generator=g) < q).flatten()

    @staticmethod
    def micro_batches(indices: torch.Tensor, max_physical: int) -> list[torch.Tensor]:
        """Split a logical batch into chunks of at most ``max_physical`` examples."""
        return list(torch.split(indices, max_physical)) if len(indices) else []


def hash_seed(*parts: int) -> int:
    """Mix integers into a 63-bit seed (SplitMix64 steps), so per-step seeds don't collide."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x = z ^ (z >> 31)
    return x & 0x7FFFFFFFFFFFFFFF
