"""Aggregation: Σᵢ cᵢgᵢ over the physical micro-batches of one logical batch.

The per-example engine returns, per micro-batch, the clipped sum of its examples; the
aggregator adds them up (one buffer per trainable parameter, fp32 on the parameter's device,
whatever the autocast dtype) and keeps the private
per-step statistics (loss sum, realised batch size, clipped count) that never leave the run
except in the opt-in diagnostics file. Under ``torch.distributed`` :meth:`Aggregator.all_reduce`
sums the buffers of every rank once per logical step, before the noise is added once for the
world (DESIGN.md "Distributed").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from dpft.step.clip import NonFiniteGradientError

if TYPE_CHECKING:
    from dpft.grads.base import ClippedBatch


class Aggregator:
    """Accumulates clipped micro-batch sums of one logical step.

    Args:
        params: name → trainable parameter (the buffers take their shapes; fp32 accumulation).
        keep_norms: also keep the raw per-example norms (only the NOT CERTIFIED DP-Adam-AC
            reproduction reads them).
    """

    def __init__(self, params: dict[str, torch.Tensor], keep_norms: bool = False):
        self.sum = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in params.items()}
        self.loss_sum = 0.0
        self.batch_size = 0
        self.clipped = 0
        #: fp16: examples that overflowed and contributed 0 (private, like ``clipped``).
        self.overflowed = 0
        self.keep_norms = keep_norms
        self.norms: list[torch.Tensor] = []

    def add(self, res: "ClippedBatch") -> None:
        """Add one micro-batch's clipped sum (``res.grad_sum``) and its private statistics.

        Raises:
            NonFiniteGradientError: the micro-batch's loss is inf/NaN (nothing is released).
        """
        if not math.isfinite(float(res.loss_sum)):
            raise NonFiniteGradientError("non-finite training loss; lower optimizer.lr or check the data")
        for n, buf in self.sum.items():
            buf.add_(res.grad_sum[n].float())
        self.loss_sum += float(res.loss_sum)
        self.batch_size += int(res.n)
        if res.scales.numel():
            self.clipped += int((res.scales < 1).any(dim=1).sum())
        self.overflowed += int(getattr(res, "overflowed", 0))
        if self.keep_norms:
            self.norms.append(res.norms.detach())

    @staticmethod
    def distributed(group: Optional[object] = None) -> bool:
        """Whether ``torch.distributed`` is initialised with more than one rank in ``group``."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def all_reduce(self, group: Optional[object] = None, failed: bool = False) -> bool:
        """Sum the buffers (and counts) over all ranks of ``torch.distributed`` (no-op alone).

        Args:
            group: the ranks sharing the logical batch (None = the default group).
            failed: this rank's micro-batches hit a non-finite loss; every rank learns it here,
                in the same collective as the counts, so that no rank releases the step.

        Returns:
            Whether any rank failed (``failed`` itself alone).
        """
        if not self.distributed(group):
            return failed
        import torch.distributed as dist

        for buf in self.sum.values():
            dist.all_reduce(buf, group=group)
        # The counts go over the CPU (gloo) side of the group: they are host numbers.
        stats = torch.tensor([self.loss_sum, float(self.batch_size), float(self.clipped), float(self.overflowed),
                              float(failed)], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":  # an NCCL-only group reduces CUDA tensors only
            stats = stats.to(next(iter(self.sum.values())).device)
        dist.all_reduce(stats, group=group)
        self.loss_sum, self.batch_size, self.clipped = float(stats[0]), int(stats[1]), int(stats[2])
        self.overflowed = int(stats[3])
        return bool(stats[4] > 0)
