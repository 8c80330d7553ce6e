"""``DPDataLoader``: Poisson logical batches over the user's dataset, yielded as physical
micro-batches (Opacus' ``DPDataLoader`` + ``BatchMemoryManager``)."""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from torch.utils.data import DataLoader, Dataset

from dpft.api.guards import check_unpacked_batch
from dpft.api.optimizer import DPOptimizer
from dpft.step.sample import PoissonSampler


@dataclass
class _Plan:
    """What the loader drew for one yielded micro-batch (or one empty logical batch)."""

    step: int
    size: int
    last: bool
    empty: bool = False


class _PoissonMicroBatches:
    """Batch sampler: per logical step t, the Poisson draw of ``sampler`` (stream ``sample``,
    t), split into micro-batches of at most ``max_physical`` indices. Every yielded micro-batch
    (and every empty logical batch) is announced in a FIFO the loader reads in order."""

    def __init__(self, sampler: PoissonSampler, steps_per_epoch: int, max_physical: Optional[int],
                 planned_steps: Optional[int]):
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.max_physical = max_physical
        self.planned_steps = planned_steps
        self.next_step = 0  # global logical step counter: every index is drawn at most once
        self.plan: deque[_Plan] = deque()

    def remaining(self) -> int:
        if self.planned_steps is None:
            return self.steps_per_epoch
        return max(0, min(self.steps_per_epoch, self.planned_steps - self.next_step))

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self):
        self.plan = plan = deque()
        return self._gen(plan, self.remaining())

    def _gen(self, plan: deque, n_steps: int):
        for _ in range(n_steps):
            t = self.next_step
            self.next_step += 1
            idx = self.sampler.indices(t)
            chunks = PoissonSampler.micro_batches(idx, self.max_physical or max(1, len(idx)))
            if not chunks:
                plan.append(_Plan(t, 0, True, empty=True))
                continue
            for k, c in enumerate(chunks):
                plan.append(_Plan(t, len(c), k == len(chunks) - 1))
                yield c.tolist()


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over the same dataset (and collate function, workers, pinning) that
    yields Poisson-sampled logical batches as physical micro-batches. Built by
    :meth:`PrivacyEngine.make_private`; not meant to be constructed directly.

    Attributes:
        sample_rate: q = expected batch / N.
        expected_batch_size: qN.
        max_physical_batch_size: largest micro-batch (None: a logical batch is one micro-batch).
        planned_steps: the logical steps the noise was calibrated for (None: unlimited).
    """

    def __init__(self, dataset: Dataset, batch_sampler: _PoissonMicroBatches, optimizer: "DPOptimizer",
                 **loader_kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        self._dp_optimizer = optimizer
        self.sample_rate = batch_sampler.sampler.q
        self.expected_batch_size = batch_sampler.sampler.expected_batch_size
        self.max_physical_batch_size = batch_sampler.max_physical
        self.planned_steps = batch_sampler.planned_steps
        self._warned_done = False

    def __iter__(self):
        sampler: _PoissonMicroBatches = self.batch_sampler  # type: ignore[assignment]
        if sampler.remaining() == 0 and sampler.planned_steps is not None and not self._warned_done:
            self._warned_done = True
            warnings.warn(
                f"make_private: the {sampler.planned_steps} planned logical steps are done; the "
                "data loader yields nothing more (more steps would spend more than the target ε)",
                stacklevel=2)
        base = super().__iter__()
        return self._wrap(base, sampler.plan)

    def _wrap(self, base, plan: deque):
        opt = self._dp_optimizer
        for batch in base:
            entry = plan.popleft()
            while entry.empty:
                opt._release_empty(entry.step)
                entry = plan.popleft()
            check_unpacked_batch(batch, entry.size, "make_private")
            opt._begin_micro_batch(entry.step, entry.size, entry.last)
            yield batch
        while plan:
            entry = plan.popleft()
            if entry.empty:
                opt._release_empty(entry.step)
        opt._end_of_epoch()
