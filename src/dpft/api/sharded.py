"""``make_private`` on a model the user sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``):
the same sharded DP step as ``dpft train``'s ``perf.sharding: fsdp`` (dpft/placement/fsdp.py), driven by the
user's own loop.

- **The plan is the one plan** (step/plan.py): sampler, σ, mechanism, clip policy and the
  book-keeping engine over the module's sharded (``DTensor``) parameters are built as for an
  unsharded module; :class:`~dpft.placement.fsdp.FSDPStep` then reduce-scatters each micro-batch's clipped
  sum (``engine.on_param_sum``) and shards the mechanism's noise (block layout: the same values for
  any number of ranks; banded MF keeps each shard's buffers, and ``save_noise_state`` /
  ``load_noise_state`` are collectives that gather and re-slice them: api/state.py).
- **The user's forward and backward are collectives** (FSDP all-gathers around them), so every rank
  must run the same number of micro-batches per logical batch: :class:`ShardedMicroBatches` yields,
  on a rank whose share has fewer micro-batches than another rank's, *placeholder* micro-batches
  (row 0 of the dataset, the same on every rank). The user's loop runs them like any other; the
  engine's clipped sum of a placeholder is replaced by zeros before the reduce-scatter
  (:class:`~dpft.placement.fsdp.ReduceScatter`) and its statistics are not counted, while the shard this rank
  receives (the other ranks' examples) is still added. Every rank computes every rank's share from
  the world's logical batch (the same on every rank), so no message is needed to agree on the count.
- **Unsharded autograd never reaches the shards:** the live book-keeping hooks (grads/live.py)
  switch the trainable parameters to ``requires_grad=False`` for each training forward after the
  first; FSDP2 copies the flag to the unsharded parameters it all-gathers, so its post-backward
  reduce-scatter has no gradient to reduce. (The first micro-batch's non-private gradient, which
  the usage check needs, is dropped at the flush, as in one process.)
- **Release:** at the last micro-batch ``optimizer.step()`` sums the private counts over the ranks
  (the clipped sums are reduce-scattered already), adds each shard's noise, records one ledger event
  per logical step (every rank the same) and steps the user's optimizer on the sharded parameters.

Requires ``fully_shard`` on the root module (every trainable parameter a ``DTensor`` of one mesh):
a model with only some submodules sharded would leave the other parameters' clipped sums unreduced.

Source: DESIGN.md "Distributed"; issue 38 item 1.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
from torch import nn

from dpft.placement import world as ddp
from dpft.placement import fsdp
from dpft.api.loader import _Plan, _PoissonMicroBatches
from dpft.api.optimizer import DPOptimizer
from dpft.step.aggregate import Aggregator
from dpft.step.clip import NonFiniteGradientError

__all__ = ["is_fsdp2_model", "check_fsdp2_model", "ShardedMicroBatches", "ShardedDPOptimizer"]


def is_fsdp2_model(module) -> bool:
    """Whether ``module`` or any submodule is sharded by FSDP2 (``fully_shard``)."""
    if not isinstance(module, nn.Module):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def check_fsdp2_model(module: nn.Module, where: str) -> None:
    """Refuse an FSDP2 model the sharded step cannot run: the root not ``fully_shard``-ed (some
    trainable parameters plain tensors) or shards not on dim 0 of one mesh. Every mechanism runs
    sharded: banded MF's per-shard buffers are gathered and re-sliced by ``save_noise_state`` /
    ``load_noise_state`` (api/state.py) and by DPTrainer's checkpoints (integrations/hf/state.py).

    Raises:
        ddp.DistributedError: naming the fix."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    if not isinstance(module, FSDPModule):
        raise ddp.DistributedError(
            f"{where}: only submodules of the model are sharded by FSDP2 (fully_shard); apply fully_shard to the "
            "root module too (after its blocks), so that every parameter is sharded and its clipped sum "
            "reduce-scattered")
    plain = [n for n, p in module.named_parameters() if p.requires_grad and not fsdp.is_sharded(p)]
    if plain:
        raise ddp.DistributedError(f"{where}: trainable parameters {plain[:3]} are not FSDP2 shards; apply "
                                   "fully_shard to the root module")
    odd = [n for n, p in module.named_parameters() if p.requires_grad
           and (len(p.placements) != 1 or p.placements[0] != Shard(0))]
    if odd:
        raise ddp.DistributedError(f"{where}: parameters {odd[:3]} are not sharded on dim 0 of a 1-D mesh "
                                   "(fully_shard's default); dpft's sharded step expects that layout")


class ShardedMicroBatches(_PoissonMicroBatches):
    """The loader's batch sampler under FSDP2: as :class:`~dpft.api.loader._PoissonMicroBatches`,
    but every rank yields the same number of micro-batches per logical step — the most any rank's
    share splits into — a short rank filling up with placeholders (``[0]``: dataset row 0).
    ``dummies``: one flag per yielded micro-batch, in order (the optimizer pops it when the loader
    opens that micro-batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dummies: deque[bool] = deque()

    def _count(self, idx: torch.Tensor) -> int:
        size = self.max_physical
        most = 0
        for r in range(self.world.world_size):
            other = ddp.World(r, self.world.world_size, group=self.world.group)
            share = (ddp.shard_units(idx, self.sampler.users[idx], other) if self.user_level
                     else ddp.shard(idx, other))
            most = max(most, len(self.sampler.micro_batches(share, size or max(1, len(share)))))
        return most

    def __iter__(self):
        self.dummies = deque()
        return super().__iter__()

    def _gen(self, plan, n_steps: int):
        for _ in range(n_steps):
            t = self.next_step
            self.next_step += 1
            idx = self.sampler.indices(t)
            mine = self.share(idx)
            chunks = self.sampler.micro_batches(mine, self.max_physical or max(1, len(mine))) if len(mine) else []
            total = self._count(idx) if self.world.distributed else len(chunks)
            if total == 0:  # the world's batch is empty: noise only
                plan.append(_Plan(t, 0, True, empty=True, batch=idx))
                continue
            for k in range(total):
                last = k == total - 1
                dummy = k >= len(chunks)
                c = torch.zeros(1, dtype=torch.long) if dummy else chunks[k]
                groups = (torch.zeros(1, dtype=torch.long) if dummy else self.sampler.groups(c)) if self.groups \
                    else None
                plan.append(_Plan(t, len(c), last, groups=groups, batch=idx if last else None))
                self.dummies.append(dummy)
                yield c.tolist()


class ShardedDPOptimizer(DPOptimizer):
    """:class:`~dpft.api.optimizer.DPOptimizer` over an :class:`~dpft.placement.fsdp.FSDPStep`: local-shard
    accumulators, placeholder micro-batches, the counts (not the sums) all-reduced at release."""

    def __init__(self, optimizer, dp_step: "fsdp.FSDPStep", planned_steps, world, batches: ShardedMicroBatches,
                 methods=None):
        super().__init__(optimizer, dp_step, planned_steps, world=world, methods=methods)
        self.batches = batches
        self._dummy = False

    def _new_aggregator(self) -> Aggregator:
        # what the engine sums (DP-SFT: its (k,) coordinates, not the parameters the step updates)
        return Aggregator({n: fsdp.local(p) for n, p in self.dp_step.spec.engine.params.items()})

    def _digest_params(self) -> dict:
        return {}  # the ranks hold different shards; the digest compares the logical batch

    def _reduce_world(self, agg: Aggregator) -> None:
        failed, self._failed = self._failed, None
        if self.dp_step._stats(agg, failed is not None):
            raise failed or NonFiniteGradientError(
                "non-finite training loss on another rank; lower the learning rate or check the data "
                "(nothing was released for this logical batch)")

    def _flush(self) -> None:
        """Reduce the open micro-batch; a non-finite loss or norm on this rank still completes the
        micro-batch's reduce-scatters with zeros (the other ranks wait in them) and is told to every
        rank at the release's all-reduce (nothing is released)."""
        if self.session is None:
            return
        try:
            self.session.flush()
        except NonFiniteGradientError as exc:
            if not self.world.distributed:
                raise
            self._failed = exc
            self.dp_step.scatter.finish_with_zeros()

    def _begin_micro_batch(self, step: int, size: int, last: bool, groups: Optional[torch.Tensor] = None,
                           batch: Optional[torch.Tensor] = None) -> None:
        self._flush()  # the previous micro-batch is reduced under its own placeholder flag
        # every unit sharded, so the forward's all-gathers copy this pass's requires_grad flags
        self.dp_step._reshard()
        self._dummy = self.batches.dummies.popleft() if self.batches.dummies else False
        self.dp_step.scatter.start(self._dummy)
        super()._begin_micro_batch(step, size, last, groups=groups, batch=batch)

    def _on_result(self, res) -> None:
        if not self._dummy:
            return super()._on_result(res)
        # A placeholder: this rank sent zeros; the shard it received holds the other ranks' examples.
        if self._agg is not None and self._agg_step is not None and self._agg_step > self._released_upto:
            for n, buf in self._agg.sum.items():
                buf.add_(res.grad_sum[n].float())
