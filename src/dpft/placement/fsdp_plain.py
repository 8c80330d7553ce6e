"""The non-private step under FSDP2 (``dpft train --no-dp`` with ``perf.sharding: fsdp``): the baseline a
DP run is compared with at the same sharding. Source: issue 38 item 3.

A non-private step has no clipping and no noise, so it is plain FSDP2 training: autograd through the
sharded model and FSDP2's own reduce-scatter of the gradient in its post-backward hooks — nothing the DP
step's guarantees depend on, since nothing is released under a privacy claim (no mechanism, no ledger
event; the report says "not private"). What :class:`PlainFSDPStep` keeps from :class:`~dpft.placement.fsdp.FSDPStep`
is what makes K processes equal one:

- **The world's logical batch**, each rank's share in micro-batches; every rank runs the same number of
  micro-batches (FSDP's all-gathers and reduce-scatters are collectives): a short rank runs a placeholder
  micro-batch whose loss is multiplied by 0 before the backward, so it adds exact zeros to the reduced
  gradient.
- **The sum, not FSDP's mean.** Each backward reduce-scatters the rank's micro-batch gradient with FSDP2's
  default average over the K ranks, accumulated into each parameter's sharded ``.grad``; multiplying by K
  gives the rank's shard of the world's summed gradient Σ_i ∇ℓ_i, which the step divides by the expected
  batch size qN and hands to the optimizer as one process does (:meth:`~dpft.step.DPStep.release_and_update`,
  no mechanism).
- The private counts (loss sum, batch size) are all-reduced; a non-finite loss on any rank stops every
  rank before the optimizer step.

In one process (nothing sharded) the same code is plain autograd of the summed loss, what
``NonPrivateEngine`` computes, so a 1-process run equals a K-process one within float tolerance.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Mapping

import torch

from dpft.placement.fsdp import FSDPError, FSDPStep, ReduceScatter, local
from dpft.step import DPStep
from dpft.step.aggregate import Aggregator
from dpft.step.clip import NonFiniteGradientError
from dpft.step.pipeline import StepOutput

__all__ = ["PlainFSDPStep"]


class PlainFSDPStep(FSDPStep):
    """The non-private step over FSDP2-sharded parameters (see the module docstring).

    Args:
        spec: the plan's step parts with no mechanism (``private=False``); its engine is the
            ``NonPrivateEngine`` (its ``model``, ``loss_fn``, ``params`` and ``precision`` are used).
        ledger, n, world, dummy_batch, on_release: as :class:`~dpft.placement.fsdp.FSDPStep` (no event is recorded).

    Raises:
        FSDPError: a spec with a mechanism (a private step must clip: :class:`~dpft.placement.fsdp.FSDPStep`).
    """

    #: The placeholder micro-batch's loss weight: 0, so a short rank adds exact zeros to the reduced gradient
    #: (the audit plants 1.0: audit/checks_fsdp.py ``fsdp_plain_dummy_counted``).
    DUMMY_WEIGHT = 0.0

    def __init__(self, spec, ledger, n, world, dummy_batch: Callable[[], Mapping[str, torch.Tensor]],
                 on_release=None):
        if spec.mechanism is not None:
            raise FSDPError("PlainFSDPStep is the non-private step; a private step needs FSDPStep (clipped sums)")
        self.world = world
        # FSDPStep._stats finishes its sum hook (a replicated sum's all-reduce); FSDP2 reduced this step's
        # gradients itself, so the hook holds nothing: a reduce-scatter over no parameter
        self.scatter = ReduceScatter({}, [], world)
        DPStep.__init__(self, spec, ledger, n, on_release=on_release, world_group=world.group)
        self.dummy_batch = dummy_batch

    def run(self, step: int, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> StepOutput:
        sp = self.spec
        t0 = time.perf_counter()
        eng = sp.engine
        params = eng.params
        mine = list(micro_batches)
        total = self._count(len(mine))
        for p in params.values():
            p.grad = None
        scale = float(eng.precision.loss_scale)
        loss_sum, size, failed = 0.0, 0, False
        for i in range(total):
            dummy = i >= len(mine)
            batch = self.dummy_batch() if dummy else mine[i]
            with eng.precision.autocast():
                losses = eng.loss_fn(lambda **kw: eng.model(**kw), batch)
            if not dummy:
                s = float(losses.detach().sum())
                failed = failed or not math.isfinite(s)
                loss_sum, size = loss_sum + s, size + int(losses.shape[0])
            # every rank backpropagates every micro-batch (FSDP's collectives); a placeholder adds zeros
            (losses.sum() * (self.DUMMY_WEIGHT if dummy else scale)).backward()
        agg = Aggregator({n: local(p) for n, p in params.items()})
        k = self.world.world_size if self.world.distributed else 1
        for n, p in params.items():
            if p.grad is not None:  # FSDP2 averaged over the K ranks: × K is the world's sum (this rank's shard)
                agg.sum[n] = local(p.grad).detach().float() * (k / scale)
            p.grad = None
        agg.loss_sum, agg.batch_size = loss_sum, size
        if self._stats(agg, failed):
            raise NonFiniteGradientError("non-finite training loss (on this or another rank); lower optimizer.lr "
                                         "or check the data")
        return self.release_and_update(step, agg, t0)
