"""Audit checks of method plug-ins on FSDP2-sharded parameters (issue 38; dpft/fsdp_methods.py).

White-box, in one process (no process group), on the real classes:

* **a sharded RMT update equals the one-process update** — the transform RMT's plug-in builds
  (methods/rmt.py ``build``: it must declare every weight matrix in ``whole_tensors``) is run by
  K = 2, 3 simulated ranks, each holding FSDP's dim-0 row shard of the averaged noisy gradient,
  through :class:`~dpft.fsdp_methods.WholeTensors` (the wrapper :class:`~dpft.fsdp.FSDPStep` puts
  around it; the all-gather simulated by concatenating the ranks' rows). Every rank must compute the
  same denoised matrices (the randomized SVD's sketch generator is public and seeded), and the
  ranks' rows of the SGD update, put together, must equal one process's update on the whole
  gradient — for a full SVD and a randomized top-2 SVD, on a gradient with a spike above the
  Marchenko–Pastur edge (the denoiser must touch it, or the check proves nothing). RMT is
  post-processing of the noisy gradient: this is a correctness check (the update the run reports is
  the method's), not a privacy one.
  Planted ``fsdp_rmt_local_rows``: each rank denoises its own rows of the gradient instead of the
  gathered matrix (the SVD of a row block is not the row block of the SVD).

:func:`fsdp_methods_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator, Optional

import torch
from torch import nn

from dpft import fsdp_methods
from dpft.audit.whitebox import Check
from dpft.distributed import World
from dpft.methods.rmt import DenoiseCfg, RMTDenoise
from dpft.step.pipeline import StepSpec
from dpft.transforms.rmt import matrix_param_names

__all__ = ["PLANTED", "fsdp_methods_checks"]

#: Planted bugs :func:`fsdp_methods_checks` must catch.
PLANTED = ("fsdp_rmt_local_rows",)


@contextlib.contextmanager
def _planted(name: Optional[str]) -> Iterator[None]:
    saved = []
    try:
        if name == "fsdp_rmt_local_rows":
            real = fsdp_methods.WholeTensors.__call__
            saved.append((fsdp_methods.WholeTensors, "__call__", real))
            fsdp_methods.WholeTensors.__call__ = lambda self, grads, ctx: self.tf(grads, ctx)  # no gather
        yield
    finally:
        for obj, attr, val in reversed(saved):
            setattr(obj, attr, val)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 30), nn.Tanh(), nn.Linear(30, 17))  # min dims 24, 17 > r + oversample


def _rmt_transform(model: nn.Module, rank: Optional[int]):
    """The transform RMT's plug-in adds to the step (its real ``build``), over the model's parameters."""
    params = dict(model.named_parameters())
    spec = StepSpec(engine=SimpleNamespace(params=params), clip=None, mechanism=None, sampler=None, optimizer=None,
                    params=params)
    cfg = DenoiseCfg(method="rmt", kappa=1.0, rank=rank, min_dim=1)
    out = RMTDenoise(cfg, None).build(spec, SimpleNamespace(private=True, model=model))
    return out.transforms[-1]


def _noisy_grads(model: nn.Module, s: float) -> dict[str, torch.Tensor]:
    """An averaged noisy gradient: a rank-1 spike well above the bulk edge plus N(0, s²) noise."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for n, p in model.named_parameters():
        noise = s * torch.randn(p.shape, generator=g)
        if p.ndim == 2:
            u, v = torch.randn(p.shape[0], 1, generator=g), torch.randn(1, p.shape[1], generator=g)
            noise = noise + 6 * s * u @ v
        out[n] = noise
    return out


def _rmt_check(lr: float = 0.5, s: float = 0.05) -> list[Check]:
    model = _model()
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = _noisy_grads(model, s)
    ctx = {"noise_std": s, "step": 0, "q": 0.1}
    out = []
    for rank in (None, 2):
        tf = _rmt_transform(model, rank)
        wanted = set(matrix_param_names(model, list(theta)))
        declared = set(getattr(tf, "whole_tensors", None) or ())
        one = tf(dict(grads), ctx)
        touched = sum(st.touched for st in tf.denoiser.last_stats.values())
        want = {n: theta[n] - lr * one[n] for n in theta}
        ok, why = declared >= wanted and touched > 0, ""
        if not declared >= wanted:
            why = f"RMT's transform does not declare {sorted(wanted - declared)} whole: FSDP would denoise row shards"
        elif not touched:
            why = "the one-process denoiser touched no matrix: the check would prove nothing"
        for k in (2, 3):
            if not ok:
                break
            rows = {n: list(torch.tensor_split(g, [min(r * -(-g.shape[0] // k), g.shape[0]) for r in range(1, k)]))
                    for n, g in grads.items()}
            fulls, parts = [], {n: [] for n in theta}
            for r in range(k):
                tf_r = _rmt_transform(model, rank)  # each rank builds its own (same seed)
                seen = {}

                def record(gr, c, tf_r=tf_r, seen=seen):
                    res = tf_r(gr, c)
                    seen.update({n: t.clone() for n, t in res.items() if n in wanted})
                    return res

                record.whole_tensors = tf_r.whole_tensors  # type: ignore[attr-defined]
                w = fsdp_methods.WholeTensors(record, dict(model.named_parameters()), World(r, k),
                                              gather=lambda n, x, rows=rows: torch.cat(rows[n]), check_agree=False)
                res = w({n: rows[n][r] for n in theta}, ctx)
                fulls.append(seen)
                for n in theta:
                    start = sum(len(x) for x in rows[n][:r])
                    parts[n].append(theta[n][start:start + len(rows[n][r])] - lr * res[n])
            same_on_ranks = all(f.keys() == fulls[0].keys() and all(torch.equal(f[n], fulls[0][n]) for n in f)
                                for f in fulls[1:])
            got = {n: torch.cat(v) for n, v in parts.items()}
            equal = all(got[n].shape == want[n].shape and torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-6)
                        for n in theta)
            if not (same_on_ranks and equal):
                ok = False
                why = (f"K = {k}: " + ("the ranks' denoised matrices differ; " if not same_on_ranks else "")
                       + ("" if equal else "the ranks' rows of the update are not the one-process update (a row "
                                           "shard was denoised instead of the gathered matrix)"))
        svd = "full SVD" if rank is None else f"randomized top-{rank} SVD"
        out.append(Check(f"fsdp rmt ({svd}): 2 and 3 ranks' sharded update equals the one-process update", ok,
                         why or f"the rows gathered per matrix, denoised alike on every rank ({touched} of "
                                f"{len(wanted)} matrices touched), this rank's rows kept"))
    return out


def fsdp_methods_checks(planted: Optional[str] = None) -> list[Check]:
    """The white-box checks of methods on FSDP2 shards (module docstring); ``planted``: one of
    :data:`PLANTED` (the checks must then fail)."""
    with _planted(planted):
        return _rmt_check()
