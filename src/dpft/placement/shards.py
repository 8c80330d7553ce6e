"""FSDP2's dim-0 layout, shared by the sharded DP step (dpft/placement/fsdp.py) and the whole-tensor transforms of
method plug-ins (dpft/placement/fsdp_methods.py): which tensors are shards, and which rows a rank holds.

FSDP2 shards dim 0 with ``torch.chunk``: ``ceil(d0/K)`` rows per rank, the last ranks fewer or none.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

__all__ = ["is_sharded", "chunk_rows", "full_on_rank0"]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 sharded parameter)."""
    from torch.distributed.tensor import DTensor  # deferred: torch.distributed's tensor package is heavy

    return isinstance(t, DTensor)


def chunk_rows(d0: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of rank ``rank``'s dim-0 chunk of a tensor with ``d0`` rows among
    ``world_size`` ranks (empty when the rank holds none)."""
    rows = math.ceil(d0 / world_size) if d0 else 0
    return min(rank * rows, d0), min((rank + 1) * rows, d0)


def full_on_rank0(tensors: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
    """Full (gathered) copies of ``tensors`` on rank 0 of the default process group, in name order, and
    None on the other ranks (a collective: every rank calls it; each ``DTensor`` is gathered with
    ``full_tensor()`` in the same order). A rank other than 0 drops each gathered tensor at once: its
    peak is one tensor's gather, not the full set. Unsharded tensors are returned as they are (detached);
    outside a process group every rank is rank 0."""
    import torch.distributed as dist  # deferred with DTensor (is_sharded)

    keep = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for n in sorted(tensors):
        t = tensors[n]
        full = (t.full_tensor() if is_sharded(t) else t).detach()
        if keep:
            out[n] = full
        del full
    return out if keep else None
