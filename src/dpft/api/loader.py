"""``DPDataLoader``: Poisson logical batches over the user's dataset, yielded as physical
micro-batches (Opacus' ``DPDataLoader`` + ``BatchMemoryManager``)."""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from dpft.placement import world as ddp
from dpft.api.guards import check_unpacked_batch
from dpft.api.optimizer import DPOptimizer
from dpft.step.sample import PoissonSampler


@dataclass
class _Plan:
    """What the loader drew for one yielded micro-batch (or one empty logical batch / share).

    ``groups``: the micro-batch's local user ids (user-level group clipping), else None.
    ``batch``: on the last entry of a step, the *world's* logical batch in the order it was
    sharded (the per-step digest of distributed.py compares it across ranks)."""

    step: int
    size: int
    last: bool
    empty: bool = False
    groups: Optional[torch.Tensor] = None
    batch: Optional[torch.Tensor] = None


class _PoissonMicroBatches:
    """Batch sampler: per logical step t, the Poisson draw of ``sampler`` (stream ``sample``,
    t) — rows, or users with at most k rows each — for the whole world; this rank's share of it
    (``distributed.shard``, or ``distributed.shard_units`` at user level: whole users per rank),
    split into micro-batches of at most ``max_physical`` indices (whole users at user level).
    Every yielded micro-batch (and every empty share) is announced in a FIFO the loader reads
    in order."""

    def __init__(self, sampler: PoissonSampler, steps_per_epoch: int, max_physical: Optional[int],
                 planned_steps: Optional[int], world: Optional["ddp.World"] = None, groups: bool = False):
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.max_physical = max_physical
        self.planned_steps = planned_steps
        self.world = world if world is not None else ddp.World()
        self.user_level = hasattr(sampler, "users")
        self.groups = groups  # user-level group clipping: each micro-batch carries its users' ids
        self.next_step = 0  # global logical step counter: every index is drawn at most once
        self.plan: deque[_Plan] = deque()

    def share(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's share of the world's logical batch ``idx`` (all of it in one process)."""
        if self.user_level:
            return ddp.shard_units(idx, self.sampler.users[idx], self.world)
        return ddp.shard(idx, self.world)

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
            idx = self.sampler.indices(t)  # the world's logical batch (sorted; grouped by user)
            mine = self.share(idx)
            chunks = self.sampler.micro_batches(mine, self.max_physical or max(1, len(mine)))
            if not chunks:  # an empty batch, or an empty share: this rank still joins the release
                plan.append(_Plan(t, 0, True, empty=True, batch=idx))
                continue
            for k, c in enumerate(chunks):
                last = k == len(chunks) - 1
                plan.append(_Plan(t, len(c), last, groups=self.sampler.groups(c) if self.groups else None,
                                  batch=idx if last else None))
                yield c.tolist()


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over the same dataset (and collate function, workers, pinning) that
    yields Poisson-sampled logical batches as physical micro-batches. Built by
    :meth:`PrivacyEngine.make_private`; not meant to be constructed directly.

    Attributes:
        sample_rate: q = expected batch / N.
        expected_batch_size: qN.
        max_physical_batch_size: largest micro-batch (None: a logical batch is one micro-batch;
            at user level a micro-batch holds whole users, up to ``max(this, k)`` rows).
        planned_steps: the logical steps the noise was calibrated for (None: unlimited).
        rank, world_size: this process's place under ``torch.distributed`` (0 and 1 alone): the
            loader yields this rank's share of the world's logical batch.
        user_level: the privacy unit is a user (``make_private(user_ids=...)``); then
            ``sample_rate`` and ``expected_batch_size`` count users.
    """

    def __init__(self, dataset: Dataset, batch_sampler: _PoissonMicroBatches, optimizer: "DPOptimizer",
                 **loader_kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        self._dp_optimizer = optimizer
        self.sample_rate = batch_sampler.sampler.q
        self.expected_batch_size = batch_sampler.sampler.expected_batch_size
        self.max_physical_batch_size = batch_sampler.max_physical
        self.planned_steps = batch_sampler.planned_steps
        self.rank, self.world_size = batch_sampler.world.rank, batch_sampler.world.world_size
        self.user_level = batch_sampler.user_level
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
                opt._release_empty(entry.step, entry.batch)
                entry = plan.popleft()
            check_unpacked_batch(batch, entry.size, "make_private")
            opt._begin_micro_batch(entry.step, entry.size, entry.last, groups=entry.groups, batch=entry.batch)
            yield batch
        while plan:
            entry = plan.popleft()
            if entry.empty:
                opt._release_empty(entry.step, entry.batch)
        opt._end_of_epoch()
