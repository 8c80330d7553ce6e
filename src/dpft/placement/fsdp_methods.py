"""Method plug-ins on FSDP2-sharded parameters (issue 38): which methods run sharded (and why the
others cannot, per method), and post-processing transforms that act on whole tensors.

Under FSDP2 (dpft/placement/fsdp.py) each rank holds the dim-0 row shard of every parameter, of the
reduce-scattered clipped sum and of the noise, so the post-processing transforms of
:meth:`~dpft.step.DPStep.release_and_update` see this rank's rows of the averaged noisy gradient
``(ḡ + z)/(qN)``. An elementwise transform (DP-AdamBC's noise variance, a division) is the same on
rows as on the whole tensor; one that is not — RMT's singular-value shrinkage of each weight
matrix (Marchenko–Pastur, transforms/rmt/) — declares the names it needs whole in its
``whole_tensors`` attribute (a collection of names; ``True``: every tensor). :class:`WholeTensors`
then all-gathers those rows into the full matrices (the gradient is already noised: this is
post-processing, no privacy cost), runs the transform on every rank on the same full tensors (its
randomness, e.g. RMT's randomized-SVD sketch, is public and seeded, so every rank computes the same
result), checks that the ranks agree (one all-reduce of a float64 digest per gathered tensor), and
keeps this rank's rows. A 1-process run (nothing sharded) calls the transform as it is, so K
processes equal 1 process.

Which methods run sharded is each method's declaration (methods/base.py ``supports_fsdp``,
``fsdp_refusal``, ``sharded_refusal(cfg)``); this module reads the declarations by duck typing
(placement never imports the method registry).

Memory: the gathered tensors of a whole-tensor transform are alive on every rank while it runs
(for RMT: the full gradients of the trainable weight matrices — small for LoRA; a full fine-tune of
a large model pays one full gradient per rank at that moment).

An engine whose clipped sum is not a sharded parameter — DP-SFT's ``(k,)`` subspace coordinates
(grads/subspace.py, ``replicated_sum``) — gets :class:`ReplicatedSum` as its per-micro-batch hook
instead of the step's reduce-scatter: each rank keeps the sum of its own examples (a placeholder's
replaced by zeros) and one all-reduce per logical batch gives every rank the world's sum, which the
step's mechanism then noises identically on every rank (the tensor is whole, so every rank draws
the same block of the shared key's stream: the same values for any number of ranks).
:func:`local_rows` names the dim-0 rows of a parameter this rank holds, for a post-processing map
that writes only those rows (DP-SFT's unprojection ``P z``: the rank's column block of ``P``), and
:func:`held` the tensor of those rows to write in place (DP-SFT ``optimizer_space: coords`` writes its rows
of ``Θ_start + P z`` there after each step).

Source: issue 38; DESIGN.md "Distributed"; Gavish & Donoho 2014 / RMT denoising (transforms/rmt/).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from dpft.placement.shards import chunk_rows, is_sharded

__all__ = ["method_refusals", "refusal_message", "WholeTensors", "wrap_transforms", "full_tensor", "ReplicatedSum",
           "local_rows", "held"]


# -- which methods run sharded -------------------------------------------------------------------
def method_refusals(methods: Iterable[Any]) -> list[str]:
    """``"method 'name': reason"`` for every method of ``methods`` (plug-in instances, methods/base.py)
    that cannot run on FSDP2-sharded parameters with its config; empty when all can."""
    out = []
    for m in methods:
        fn = getattr(m, "sharded_refusal", None)
        if fn is None:
            why = "it declares nothing about FSDP2 (a dpft Method sets supports_fsdp / fsdp_refusal)"
        else:
            why = fn(m.cfg)
        if why:
            out.append(f"method {getattr(m, 'name', type(m).__name__)!r}: {why}")
    return out


def refusal_message(where: str, methods: Iterable[Any]) -> Optional[str]:
    """The refusal of ``where`` (a way in) for the methods that cannot run sharded, or None."""
    why = method_refusals(methods)
    if not why:
        return None
    return (f"{where}: with an FSDP2-sharded model, " + "; ".join(why)
            + " (drop the method, or train unsharded: DDP / one process)")


# -- whole-tensor post-processing -----------------------------------------------------------------
def full_tensor(p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The full tensor whose dim-0 shard on this rank is ``rows``, laid out as the sharded parameter
    ``p`` (a collective: every rank calls it for the same parameter, in the same order)."""
    from torch.distributed.tensor import DTensor

    d = DTensor.from_local(rows.contiguous(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                           stride=p.stride())
    return d.full_tensor()


class WholeTensors:
    """A post-processing transform run on whole tensors although the step holds row shards.

    Args:
        tf: ``tf(grads, ctx) -> grads`` with a ``whole_tensors`` attribute (names, or True: all).
        params: name → parameter (``DTensor`` shards under FSDP2; plain tensors are whole already).
        world: the :class:`~dpft.placement.world.World` (rank, size, group).
        gather: ``gather(name, rows) -> full`` (default :func:`full_tensor` over ``params[name]``;
            the audit passes a simulated one).
        check_agree: compare the ranks' results (a collective; off for simulated ranks, whose
            caller compares them).

    Raises (from a call):
        RuntimeError: the ranks' transformed tensors differ (their digests disagree): a transform whose
            result is not a function of the gathered tensors alone (e.g. unseeded randomness).
    """

    def __init__(self, tf: Callable, params: Mapping[str, torch.Tensor], world,
                 gather: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None, check_agree: bool = True):
        self.tf = tf
        self.check_agree = check_agree
        self.params = dict(params)
        self.world = world
        want = getattr(tf, "whole_tensors", True)
        names = list(self.params) if want is True else [n for n in self.params if n in set(want)]
        self.names = [n for n in names if gather is not None or is_sharded(self.params[n])]
        self.gather = gather or (lambda name, rows: full_tensor(self.params[name], rows))
        if hasattr(tf, "denoiser"):  # DPStep releases the denoiser's summary (rmt/layers, touched, spikes)
            self.denoiser = tf.denoiser

    def __call__(self, grads: dict[str, torch.Tensor], ctx: dict[str, Any]) -> dict[str, torch.Tensor]:
        names = [n for n in self.names if n in grads]
        full = dict(grads)
        for n in names:  # every rank gathers the same names in the same order (a collective each)
            full[n] = self.gather(n, grads[n])
        out = self.tf(full, ctx)
        self._check_agree(out, names)
        res = dict(out)
        for n in names:
            a, b = chunk_rows(self.params[n].shape[0], self.world.rank, self.world.world_size)
            res[n] = out[n][a:b].clone()  # this rank's rows; the full tensor is freed
        return res

    def _check_agree(self, out: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Every rank transformed the gathered tensors to the same result (digests: Σx and Σx² in
        float64 per tensor, compared by an all-reduce of max and min)."""
        if not names or not self.check_agree or not getattr(self.world, "distributed", False):
            return
        import torch.distributed as dist

        dev = out[names[0]].device
        d = torch.stack([torch.stack([out[n].double().sum(), out[n].double().square().sum()]) for n in names])
        d = d.to(dev).reshape(-1)
        hi, lo = d.clone(), d.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.world.group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.world.group)
        if not torch.equal(hi, lo):
            raise RuntimeError(f"FSDP: the ranks' results of the whole-tensor transform {self.tf!r} differ (it "
                               "must depend only on the gathered noisy gradient and public, seeded randomness); "
                               "run it in one process or under DDP")


def wrap_transforms(transforms: Iterable[Callable], params: Mapping[str, torch.Tensor], world) -> list[Callable]:
    """``transforms`` with every one that declares ``whole_tensors`` wrapped in :class:`WholeTensors`
    (the others see this rank's row shards, which is right for elementwise maps)."""
    out = []
    for tf in transforms:
        if getattr(tf, "whole_tensors", None) and any(is_sharded(p) for p in params.values()):
            tf = WholeTensors(tf, params, world)
        out.append(tf)
    return out


# -- a clipped sum held whole by every rank (DP-SFT's coordinates) --------------------------------
class ReplicatedSum:
    """The sharded step's sum hook (``engine.on_param_sum``) for an engine whose clipped sum is a
    small tensor held whole by every rank (``engine.replicated_sum``: DP-SFT's ``Σ_i c_i s_i``,
    ``(k,)``), in place of :class:`~dpft.placement.fsdp.ReduceScatter`.

    Per micro-batch nothing is sent: the rank's sum is kept (a placeholder's replaced by zeros, so
    the step's placeholder branch adds nothing). :meth:`finish` all-reduces the logical batch's sums
    over the world once, before the release (every rank then holds the world's clipped sum, and the
    mechanism adds one noise draw that is the same on every rank). Not a reduce-scatter: the sum is
    no sharded parameter; its ``k`` floats cost one small all-reduce per logical step.

    Args:
        world: the :class:`~dpft.placement.world.World` (its group).
        reduce: ``reduce(name, buf)`` sums ``buf`` over the ranks in place (default: ``all_reduce`` over
            the world's group when it is distributed; the audit passes a simulated one)."""

    def __init__(self, world, reduce: Optional[Callable[[str, torch.Tensor], None]] = None):
        self.world = world
        self.reduce = reduce
        self.dummy = False

    def start(self, dummy: bool) -> None:
        """A new micro-batch (``dummy``: a placeholder whose contribution must be zeros)."""
        self.dummy = dummy

    def __call__(self, name: str, total: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(total, dtype=torch.float32) if self.dummy else total.float()

    def finish_with_zeros(self) -> None:
        """Nothing to complete: no collective runs per micro-batch."""

    def finish(self, agg) -> None:
        """Sum ``agg``'s buffers over the world (a collective: every rank, once per logical batch)."""
        if self.reduce is not None:
            for n, buf in agg.sum.items():
                self.reduce(n, buf)
            return
        if not getattr(self.world, "distributed", False):
            return
        import torch.distributed as dist

        for buf in agg.sum.values():
            dist.all_reduce(buf, group=self.world.group)


def local_rows(p: torch.Tensor) -> Optional[tuple[int, int]]:
    """Rows ``[start, end)`` of dim 0 of parameter ``p`` that this rank holds: FSDP2's chunk of its
    mesh rank (``torch.chunk`` layout, dpft/placement/shards.py), or None when ``p`` is whole (not sharded).

    Raises:
        ValueError: ``p`` is sharded otherwise than on dim 0 of a 1-D mesh (fully_shard's default), or its
            local shard is not that chunk."""
    if not is_sharded(p):
        return None
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    if mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise ValueError(f"a parameter of shape {tuple(p.shape)} is sharded as {p.placements} on a {mesh.ndim}-D "
                         "mesh; dpft expects fully_shard's dim-0 chunks on a 1-D mesh")
    a, b = chunk_rows(p.shape[0], mesh.get_local_rank(), mesh.size())
    if p.to_local().shape[0] != b - a:
        raise ValueError(f"the local shard of a {tuple(p.shape)} parameter has {p.to_local().shape[0]} rows, not "
                         f"rows [{a}, {b}) of fully_shard's dim-0 chunking")
    return a, b


def held(p: torch.Tensor) -> torch.Tensor:
    """The tensor of the rows of ``p`` this rank holds, to read or write in place: FSDP2's local shard
    (rows :func:`local_rows`) of a sharded parameter, else ``p`` itself (detached)."""
    return p.to_local().detach() if is_sharded(p) else p.detach()
