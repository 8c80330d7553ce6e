"""DP-SFT stage 1 in every world: the trajectory snapshots and one basis ``P`` for the world (issue 38).

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models" (AAAI 2026),
Algorithm 1 lines 12-15 (snapshots ``Θ_t − Θ_0``) and Eq. 3-4 (the top-k right singular vectors of the
trajectory ``A``). Wiring only: the basis maths lives in ``transforms/subspace.py``.

Stage 1 is an ordinary (DP-)SGD phase that the driver runs (``Run.train_phase``), so under DDP or FSDP2 it
is a world run like any other (one Poisson batch for the world, clipped sums reduced once, noise drawn once,
one ledger event per step on every rank's copy of the ledger, rank 0 writing it). What is particular to
DP-SFT is what this module does:

* the snapshots are the **full** trainable parameters: under FSDP2 each one is gathered
  (:func:`dpft.placement.shards.full_on_rank0`, a collective every rank calls at the same steps), rank 0 alone keeps
  them (the other ranks drop each gathered tensor at once); under DDP every rank already holds the full
  (equal) tensors, and rank 0 alone keeps them too;
* the basis is computed **once**, on rank 0, and broadcast (:func:`share_basis`): every rank holds the same
  ``P``, ``Θ*`` and provenance, bit for bit (no rank builds a basis from its own shard or from its own
  round-off). An error on rank 0 (``rank(A) < k``) is raised on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dpft.placement.world import World, broadcast_object
from dpft.placement.shards import full_on_rank0
from dpft.transforms.subspace import SubspaceBasis, basis_from_snapshots

__all__ = ["Snapshots", "gather_on_rank0", "share_basis", "world_basis"]


def gather_on_rank0(params: dict[str, torch.Tensor], world: Optional[World]) -> Optional[dict[str, torch.Tensor]]:
    """Full copies of ``params`` in ``params``' own order on rank 0 (FSDP2 shards gathered: a collective every
    rank calls), None on the other ranks; in one process the detached tensors themselves."""
    if world is None or not world.distributed:
        return {n: p.detach() for n, p in params.items()}
    full = full_on_rank0(params)
    return None if full is None else {n: full[n] for n in params}


class Snapshots:
    """Stage 1's step hook: records ``Θ_t − Θ_0`` of the phase's trainable parameters after the
    given steps (Algorithm 1 lines 12-15). Called by the driver as ``on_step(done, params)``
    after each completed step; ``snapshots``: name -> ``(m, *shape)`` (full shapes; in a world of several
    processes on rank 0 only, empty on the others).

    Args:
        record_after: the step counts (1-based: steps done) after which to record, in order.
    """

    def __init__(self, record_after: list[int]):
        self.record_after = {s: j for j, s in enumerate(record_after)}
        self.theta0: Optional[dict[str, torch.Tensor]] = None
        self.snapshots: dict[str, torch.Tensor] = {}
        self.recorded = 0
        #: The phase's world (set by :meth:`start`; None: one process).
        self.world: Optional[World] = None

    def start(self, params: dict, world: Optional[World] = None) -> None:
        """Take Θ_0 (the phase's parameters before its first step); the snapshots live on the
        parameters' device (the basis is built there). ``world``: the phase's world (a collective under
        FSDP2: every rank calls it)."""
        self.world = world
        full = gather_on_rank0(params, world)
        self.theta0 = None if full is None else {n: p.clone() for n, p in full.items()}
        m = len(self.record_after)
        self.snapshots = {} if full is None else {
            n: torch.zeros(m, *p.shape, dtype=torch.float32, device=p.device) for n, p in full.items()}

    def __call__(self, done: int, params: dict) -> None:
        j = self.record_after.get(done)
        if j is not None:
            full = gather_on_rank0(params, self.world)  # every rank reaches the same steps: one collective
            if full is not None:
                for n, p in full.items():
                    self.snapshots[n][j] = (p - self.theta0[n]).float()
            self.recorded += 1


def share_basis(world: Optional[World], build: Callable[[], SubspaceBasis], device: torch.device) -> SubspaceBasis:
    """Rank 0's basis on every rank: ``build`` runs on rank 0 alone; its ``P`` blocks, singular values, ``Θ*``
    and ``meta`` are broadcast (tensors with ``torch.distributed.broadcast`` on ``device``, shapes and meta
    pickled), so every rank holds the same values bit for bit. An exception raised by ``build`` is raised on
    every rank. In one process: ``build()``.

    Raises: what ``build`` raises (on every rank)."""
    if world is None or not world.distributed:
        return build()
    import torch.distributed as dist

    basis, head = None, None
    if world.is_main:
        try:
            basis = build()
            head = ("ok", {n: (tuple(b.shape), str(b.dtype)) for n, b in basis.blocks.items()},
                    None if basis.start is None else {n: (tuple(t.shape), str(t.dtype)) for n, t in basis.start.items()},
                    tuple(basis.singular_values.shape), basis.meta)
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            head = ("error", exc)
    head = broadcast_object(world, head)
    if head[0] == "error":
        raise head[1]
    _, blocks, start, sv_shape, meta = head

    def bcast(t: Optional[torch.Tensor], shape, dtype: str) -> torch.Tensor:
        buf = (t.detach().to(device).contiguous() if world.is_main
               else torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device))
        dist.broadcast(buf, src=0, group=world.group)
        return buf

    got = {n: bcast(basis.blocks[n] if basis else None, *blocks[n]) for n in blocks}
    sv = bcast(basis.singular_values if basis else None, sv_shape, "torch.float64").cpu()
    st = None if start is None else {n: bcast(basis.start[n] if basis else None, *start[n]) for n in start}
    return SubspaceBasis(got, sv, st, dict(meta))


def world_basis(snaps: Snapshots, params: dict[str, torch.Tensor], world: Optional[World], k: int,
                meta: dict) -> SubspaceBasis:
    """Stage 1's basis for the world, after its last step: ``Θ*`` = the full ``params`` (gathered: a collective
    under FSDP2), ``P`` = the top-k basis of ``snaps`` (Eq. 3-4), built on rank 0 alone with ``meta`` added and
    broadcast (:func:`share_basis`), so every rank holds the same ``P``, ``Θ*`` (full shapes) and meta.

    Raises:
        SubspaceError: rank(A) < k (on every rank)."""
    final = gather_on_rank0(params, world)
    dev = next(iter(params.values())).device

    def build() -> SubspaceBasis:
        b = basis_from_snapshots(snaps.snapshots, k)
        b.start = {n: p.clone() for n, p in final.items()}
        b.meta.update(meta)
        return b

    return share_basis(world, build, dev)
