"""Variable sampling rate: a schedule of expected batch sizes, one Poisson rate q_t per step.

The DP-Adam-AC paper accounts a changing batch size with its own "variable-q" RDP accountant
(Yang, App. C). dpft records each step's own ``PoissonSampledDpEvent(q_t, GaussianDpEvent(σ))``
in the ledger instead, and the PLD accountant of ``dp_accounting`` composes the heterogeneous
events (runs of equal q are grouped by the ledger).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from dpft.step.sample import PoissonSampler


class ScheduledPoissonSampler(PoissonSampler):
    """Poisson sampling with expected batch size ``b_t`` from a step schedule.

    Args:
        n: dataset size N.
        schedule: ``[(from_step, expected_batch_size), ...]``, the first at step 0, steps
            strictly increasing, every size in [1, N].
        rng: the run's secret randomness (privacy/randomness.py).

    Raises:
        ValueError: a malformed schedule (the message says which entry).
    """

    def __init__(self, n: int, schedule: Sequence[tuple[int, int]], rng):
        sched = [(int(s), int(b)) for s, b in schedule]
        if not sched or sched[0][0] != 0:
            raise ValueError("batch.schedule must start with an entry for step 0, e.g. [[0, 64], [100, 128]]")
        for (s0, _), (s1, _) in zip(sched, sched[1:]):
            if s1 <= s0:
                raise ValueError(f"batch.schedule steps must increase strictly; {s1} follows {s0}")
        for s, b in sched:
            if not 1 <= b <= n:
                raise ValueError(f"batch.schedule: expected batch {b} at step {s} must be between 1 and N = {n}")
        super().__init__(n, sched[0][1], rng)
        self.schedule = sched
        self._starts = [s for s, _ in sched]

    def expected_batch_at(self, step: int) -> int:
        return self.schedule[bisect.bisect_right(self._starts, step) - 1][1]

    def q_at(self, step: int) -> float:
        """q_t = b_t / N."""
        return self.expected_batch_at(step) / self.n

    def indices(self, step: int) -> torch.Tensor:
        return self.draw(step, self.q_at(step))
