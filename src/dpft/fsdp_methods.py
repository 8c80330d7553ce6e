"""Method plug-ins on FSDP2-sharded parameters (issue 38): which methods run sharded (and why the
others cannot, per method), and post-processing transforms that act on whole tensors.

Under FSDP2 (dpft/fsdp.py) each rank holds the dim-0 row shard of every parameter, of the
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

Source: issue 38; DESIGN.md "Distributed"; Gavish & Donoho 2014 / RMT denoising (transforms/rmt/).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from dpft.shards import chunk_rows, is_sharded

__all__ = ["method_refusals", "refusal_message", "WholeTensors", "wrap_transforms", "full_tensor"]


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
        world: the :class:`~dpft.distributed.World` (rank, size, group).
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
