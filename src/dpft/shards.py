"""FSDP2's dim-0 layout, shared by the sharded DP step (dpft/fsdp.py) and the whole-tensor transforms of
method plug-ins (dpft/fsdp_methods.py): which tensors are shards, and which rows a rank holds.

FSDP2 shards dim 0 with ``torch.chunk``: ``ceil(d0/K)`` rows per rank, the last ranks fewer or none.
"""

from __future__ import annotations

import math

import torch

__all__ = ["is_sharded", "chunk_rows"]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 sharded parameter)."""
    from torch.distributed.tensor import DTensor  # deferred: torch.distributed's tensor package is heavy

    return isinstance(t, DTensor)


def chunk_rows(d0: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of rank ``rank``'s dim-0 chunk of a tensor with ``d0`` rows among
    ``world_size`` ranks (empty when the rank holds none)."""
    rows = math.ceil(d0 / world_size) if d0 else 0
    return min(rank * rows, d0), min((rank + 1) * rows, d0)
