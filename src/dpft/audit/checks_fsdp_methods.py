"""Audit checks of method plug-ins on FSDP2-sharded parameters (issue 38; dpft/placement/fsdp_methods.py).

White-box, in one process (no process group), on the real classes:

* **a sharded RMT update equals the one-process update** — the transform RMT's plug-in builds
  (methods/rmt.py ``build``: it must declare every weight matrix in ``whole_tensors``) is run by
  K = 2, 3 simulated ranks, each holding FSDP's dim-0 row shard of the averaged noisy gradient,
  through :class:`~dpft.placement.fsdp_methods.WholeTensors` (the wrapper :class:`~dpft.placement.fsdp.FSDPStep` puts
  around it; the all-gather simulated by concatenating the ranks' rows). Every rank must compute the
  same denoised matrices (the randomized SVD's sketch generator is public and seeded), and the
  ranks' rows of the SGD update, put together, must equal one process's update on the whole
  gradient — for a full SVD and a randomized top-2 SVD, on a gradient with a spike above the
  Marchenko–Pastur edge (the denoiser must touch it, or the check proves nothing). RMT is
  post-processing of the noisy gradient: this is a correctness check (the update the run reports is
  the method's), not a privacy one.
  Planted ``fsdp_rmt_local_rows``: each rank denoises its own rows of the gradient instead of the
  gathered matrix (the SVD of a row block is not the row block of the SVD).
* **a sharded DP-SFT step equals the one-process step** — DP-SFT stage 2 on a given basis (its real
  ``build``: the subspace engine and the unprojection) under :class:`~dpft.placement.fsdp.FSDPStep` (real
  construction: it must pick :class:`~dpft.placement.fsdp_methods.ReplicatedSum` for the engine's (k,) sum and lay
  the coordinates' noise out whole) on K = 2, 3 simulated ranks, each running its share of one Poisson
  batch (every K-th example) in micro-batches of 2, a short rank padding with placeholders; the
  all-reduce simulated through ``ReplicatedSum.finish``'s ``reduce``; the release by the step's sharded
  mechanism; each rank's unprojection writes its FSDP dim-0 rows (``local_rows`` simulated). Every rank
  must hold the same noisy coordinates z, equal to one process's, record the same ledger event, and the
  ranks' rows of the SGD update, put together, must equal one process's update — with a clipped example
  in the batch and noise of std σC = 0.3 on each coordinate (a rank's own noise would show).
  Planted ``fsdp_dpsft_local_coords``: no all-reduce (each rank noises its own examples' sum);
  ``fsdp_dpsft_rank_noise``: each rank draws its own noise for z (the stream named by its rank).
* **DP-SFT ``optimizer_space: coords`` writes Θ = Θ_start + P z on each rank's rows** — the real
  ``build`` (its :class:`~dpft.methods.dpsft.method.CoordsSync` on the optimizer of z) on K = 1, 2, 3 simulated
  ranks, each holding FSDP's dim-0 rows of every parameter (``local_rows``/``held`` simulated as row views
  of the rank's model copy): right after one optimizer step on z (no forward in between: an evaluation on
  gathered weights reads the rows as they are), the ranks' rows put together equal one process's
  ``Θ_start + P z`` and no rank touched rows it does not hold; after z is overwritten as a resume loads it,
  ``before_step`` writes ``Θ_start + P z_loaded``. Planted ``fsdp_dpsft_coords_rows_offset``: a rank writes
  rows ``[0, b − a)`` of ``P z`` into its rows ``[a, b)`` (its offset dropped); ``fsdp_dpsft_coords_stale``:
  nothing is written after the step (the old forward-hook timing: evaluation would see stale Θ).
* **DP-SFT stage 1 builds one basis for the world** — the real :class:`~dpft.methods.dpsft.stage1.Snapshots`
  and :func:`~dpft.methods.dpsft.stage1.world_basis` (``run_stage1``'s path after the phase) on K = 2, 3
  simulated ranks, each holding FSDP's dim-0 rows of every parameter along a 4-step trajectory (the gather
  ``full_on_rank0`` and the broadcasts simulated: rank 0 gets the full tensors, the others what rank 0
  sent): every rank must hold the one-process ``P``, singular values, ``Θ*`` (full shapes) and meta, and
  no rank but 0 may keep snapshots (memory). Planted ``dpsft_stage1_rank_basis``: each rank builds the basis
  from its own rows of the snapshots (no gather, no broadcast).

:func:`fsdp_methods_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from dpft.placement import fsdp
from dpft.placement import fsdp_methods
from dpft.accounting.ledger import PrivacyLedger
from dpft.audit.planted import bug_planter, patched
from dpft.audit.whitebox import Check
from dpft.placement.world import World, shard
from dpft.grads.subspace import COORDS
from dpft.methods.dpsft import method as dpsft
from dpft.methods.dpsft import stage1 as dpsft_stage1
from dpft.methods.rmt import DenoiseCfg, RMTDenoise
from dpft.privacy.randomness import Randomness
from dpft.placement.shards import chunk_rows
from dpft.step.aggregate import Aggregator
from dpft.step.clip import FlatClip
from dpft.step.noise import GaussianMechanism
from dpft.step.pipeline import StepSpec
from dpft.step.postprocess import divide
from dpft.transforms.rmt import matrix_param_names
from dpft.transforms.subspace import SubspaceBasis

__all__ = ["PLANTED", "fsdp_dpsft_check", "fsdp_methods_checks"]

#: Planted bugs :func:`fsdp_methods_checks` must catch.
PLANTED = ("fsdp_rmt_local_rows", "fsdp_dpsft_local_coords", "fsdp_dpsft_rank_noise", "fsdp_dpsft_coords_rows_offset",
           "fsdp_dpsft_coords_stale", "dpsft_stage1_rank_basis")


@torch.no_grad()
def _write_unshifted(self):  # fsdp_dpsft_coords_rows_offset: P z's first rows, whatever rows the rank holds
    full = self.unproject.basis.unproject(self.z.detach())
    for n, p in self.params.items():
        dst = dpsft.held(p)
        dst.copy_(self.start[n] + full[n][:dst.shape[0]].to(dst.dtype))
    self.seen = self.z.detach().clone()


_planted = bug_planter(PLANTED, {
    # no gather: each rank denoises its own rows
    "fsdp_rmt_local_rows": lambda p: p.set(fsdp_methods.WholeTensors, "__call__",
                                           lambda self, grads, ctx: self.tf(grads, ctx)),
    # a rank's own sum is noised
    "fsdp_dpsft_local_coords": lambda p: p.set(fsdp_methods.ReplicatedSum, "finish", lambda self, agg: None),
    # each rank its own stream
    "fsdp_dpsft_rank_noise": lambda p: p.set(fsdp._ShardedNoise, "noise_stream", lambda self, step, n, device: (
        fsdp._ShardStream(self, step, f"{n}@rank{self.world.rank}", self.layout[n]))),
    "fsdp_dpsft_coords_rows_offset": lambda p: p.set(dpsft.CoordsSync, "write", _write_unshifted),
    # written at the next forward only
    "fsdp_dpsft_coords_stale": lambda p: p.set(dpsft.CoordsSync, "attach", lambda self, optimizer: self),
    # each rank its own rows, its own basis
    "dpsft_stage1_rank_basis": lambda p: (
        p.set(dpsft_stage1, "gather_on_rank0", lambda params, world: {n: q.detach() for n, q in params.items()}),
        p.set(dpsft_stage1, "share_basis", lambda world, build, device: build())),
})


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


# -- DP-SFT stage 2 on simulated ranks ----------------------------------------------------------------
_K, _C, _SIGMA, _LR, _N = 3, 0.3, 1.0, 0.5, 40


def _dpsft_parts():
    """A tiny MLP with uneven dim-0 chunks (5 and 3 rows), a random orthonormal basis over its
    parameters, one logical batch of 9 examples (one of them clipped) and its loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), _K, generator=g))
    blocks, o = {}, 0
    for n, p in params.items():
        blocks[n] = flat[o:o + p.numel()].T.reshape(_K, *p.shape).contiguous()
        o += p.numel()
    basis = SubspaceBasis(blocks=blocks, singular_values=torch.ones(_K, dtype=torch.float64), meta={"source": "public"})
    x = torch.randn(9, 6, generator=g)
    x[4] *= 40
    batch = {"x": x, "y": torch.randint(0, 3, (9,), generator=g)}

    def loss(fwd, b):
        return nn.functional.cross_entropy(fwd(input=b["x"]), b["y"], reduction="none")

    return model, basis, batch, loss


def _dpsft_rank(model, basis, loss, world: World):
    """Rank ``world.rank``'s FSDPStep over DP-SFT's real ``build`` (its own model copy and engine)."""
    model = copy.deepcopy(model)
    recipe = SimpleNamespace(method_config=lambda name: SimpleNamespace(method="none"),
                             privacy=SimpleNamespace(clipping=SimpleNamespace(style="flat", max_norm=_C)))
    m = dpsft.DPSFT(dpsft.SubspaceCfg(source="file", file="basis.safetensors", k=_K, start="initial"), recipe)
    m.basis, m.info = basis, {}
    run = SimpleNamespace(recipe=recipe, private=True, model=model, per_example_loss=loss, evaluate=None,
                          make_optimizer=None, device=torch.device("cpu"))
    spec = StepSpec(engine=None, clip=FlatClip(_C), mechanism=GaussianMechanism(_SIGMA, _C, Randomness(5)),
                    sampler=None, optimizer=None, params=None)
    spec = m.build(spec, run)
    return fsdp.FSDPStep(spec, PrivacyLedger(), _N, world, lambda: None), model


def _rows_of(rank: int, k: int):
    """``dpsft.local_rows`` as on rank ``rank`` of ``k`` (FSDP2's dim-0 chunk of every parameter), for a ``with``."""
    return patched((dpsft, "local_rows", lambda p: chunk_rows(p.shape[0], rank, k) if k > 1 else None))


def _dpsft_world(k: int):
    """One logical step of K simulated ranks; returns per rank ``(z, event, rows of the updated weights)``
    and whether FSDPStep chose the replicated sum with the coordinates' noise laid out whole."""
    model, basis, batch, loss = _dpsft_parts()
    idx = torch.arange(9)
    ranks = [_dpsft_rank(model, basis, loss, World(r, k)) for r in range(k)]
    wired = all(isinstance(st.scatter, fsdp_methods.ReplicatedSum) and st.layout.get(COORDS) == (_K, 0, _K)
                for st, _ in ranks)
    shares = [shard(idx, World(r, k)) for r in range(k)]
    most = max(-(-len(s) // 2) for s in shares)
    aggs = []
    for (st, _), mine in zip(ranks, shares):  # FSDPStep.run's loop: the rank's micro-batches, then placeholders
        eng, chunks = st.spec.engine, list(mine.split(2))
        agg = Aggregator({n: fsdp.local(p) for n, p in eng.params.items()})
        for i in range(most):
            dummy = i >= len(chunks)
            st.scatter.start(dummy)
            res = eng.clipped_sum({n: v[idx[:1] if dummy else chunks[i]] for n, v in batch.items()})
            if dummy:
                for n, buf in agg.sum.items():
                    buf.add_(res.grad_sum[n])
            else:
                agg.add(res)
        aggs.append(agg)
    totals = {n: torch.stack([a.sum[n] for a in aggs]).sum(0) for n in aggs[0].sum}
    out = []
    for r, ((st, mdl), agg) in enumerate(zip(ranks, aggs)):
        st.scatter.reduce = lambda n, buf: buf.copy_(totals[n])  # the simulated all-reduce
        st.scatter.finish(agg)
        q = 9 / _N
        noisy, event = st.spec.mechanism.release(agg.sum, _C, q, 0)
        grads = divide(noisy, q * _N)
        with _rows_of(r, k):
            for tf in st.spec.transforms:
                grads = tf(grads, {"noise_std": _SIGMA * _C / (q * _N), "step": 0, "q": q})
        rows = {}
        for n, p in dict(mdl.named_parameters()).items():
            a, b = chunk_rows(p.shape[0], r, k) if k > 1 else (0, p.shape[0])
            rows[n] = p.detach()[a:b] - _LR * grads[n]
        out.append((noisy[COORDS], repr(event), rows))
    return out, wired


def _dpsft_check() -> list[Check]:
    (one,), _ = _dpsft_world(1)
    out = []
    for k in (2, 3):
        ranks, wired = _dpsft_world(k)
        same_z = all(torch.equal(z, ranks[0][0]) for z, _, _ in ranks)
        z_one = torch.allclose(ranks[0][0], one[0], rtol=1e-5, atol=1e-6)
        events = all(e == one[1] for _, e, _ in ranks)
        got = {n: torch.cat([rows[n] for _, _, rows in ranks]) for n in one[2]}
        equal = all(got[n].shape == one[2][n].shape and torch.allclose(got[n], one[2][n], rtol=1e-5, atol=1e-6)
                    for n in one[2])
        ok = wired and same_z and z_one and events and equal
        why = "; ".join(w for w, bad in (
            ("FSDPStep did not put ReplicatedSum on the engine's (k,) sum with its noise laid out whole", not wired),
            ("the ranks hold different noisy coordinates z", not same_z),
            ("the ranks' noisy z is not one process's (no all-reduce of the clipped sums, or other noise)", not z_one),
            ("a rank's ledger event differs from one process's", not events),
            ("the ranks' rows of P z put together are not the one-process update", not equal)) if bad)
        out.append(Check(f"fsdp dpsft (source file): {k} ranks' sharded step equals the one-process step", ok,
                         f"K = {k}: {why}" if why else "the (k,) clipped sums all-reduced, one noise draw for the "
                         "world, each rank's rows of P z: the one-process update"))
    return out


def _held_rows(rank: int, k: int):
    """``dpsft.local_rows``/``dpsft.held`` as on rank ``rank`` of ``k``: the rank's dim-0 chunk of every
    parameter, a row view of its (whole) model copy, so writes land in those rows only (for a ``with``)."""
    return patched((dpsft, "local_rows", lambda p: chunk_rows(p.shape[0], rank, k) if k > 1 else None),
                   (dpsft, "held", (lambda p: p.detach()[slice(*chunk_rows(p.shape[0], rank, k))]) if k > 1
                    else dpsft.held))


def _coords_world(k: int):
    """DP-SFT coords on K simulated ranks: per rank (rows after one SGD step on z, rows after a load of z,
    whether rows outside the rank's chunk stayed Θ_start); and one process's Θ_start + P z for both z."""
    model, basis, _, loss = _dpsft_parts()
    g = torch.randn(_K, generator=torch.Generator().manual_seed(7))  # the noisy coordinate gradient
    z_load = torch.randn(_K, generator=torch.Generator().manual_seed(8))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = [{n: start[n] + d for n, d in basis.unproject(-_LR * g).items()},
            {n: start[n] + d for n, d in basis.unproject(z_load).items()}]
    out = []
    for r in range(k):
        mdl = copy.deepcopy(model)
        recipe = SimpleNamespace(method_config=lambda name: SimpleNamespace(method="none"),
                                 privacy=SimpleNamespace(clipping=SimpleNamespace(style="flat", max_norm=_C)))
        m = dpsft.DPSFT(dpsft.SubspaceCfg(source="file", file="basis.safetensors", k=_K, start="initial",
                                          optimizer_space="coords"), recipe)
        m.basis, m.info = basis, {}
        run = SimpleNamespace(recipe=recipe, private=True, model=mdl, per_example_loss=loss, evaluate=None,
                              make_optimizer=lambda params: torch.optim.SGD(list(params.values()), lr=_LR),
                              device=torch.device("cpu"))
        spec = StepSpec(engine=None, clip=FlatClip(_C), mechanism=None, sampler=None, optimizer=None, params=None)
        with _held_rows(r, k):
            spec = m.build(spec, run)
            z = spec.params[COORDS]
            z.grad = g.clone()
            spec.optimizer.step()  # the write follows the step: no forward in between
            stepped = {n: p.detach().clone() for n, p in mdl.named_parameters()}
            with torch.no_grad():
                z.copy_(z_load)  # as a resume's load of the checkpointed coordinates
            m.before_step(0, run)
            loaded = {n: p.detach().clone() for n, p in mdl.named_parameters()}
        rows = {n: slice(*chunk_rows(p.shape[0], r, k)) for n, p in start.items()}
        outside = all(torch.equal(torch.cat([w[n][:rows[n].start], w[n][rows[n].stop:]]),
                                  torch.cat([start[n][:rows[n].start], start[n][rows[n].stop:]]))
                      for w in (stepped, loaded) for n in start)
        out.append(({n: stepped[n][rows[n]] for n in start}, {n: loaded[n][rows[n]] for n in start}, outside))
    return out, want


def _coords_check() -> list[Check]:
    out = []
    for k in (1, 2, 3):
        ranks, want = _coords_world(k)
        good = [all(torch.allclose(torch.cat([rk[j][n] for rk in ranks]), want[j][n], rtol=1e-5, atol=1e-6)
                    for n in want[j]) for j in (0, 1)]
        outside = all(o for _, _, o in ranks)
        why = "; ".join(w for w, bad in (
            ("right after the optimizer step the ranks' rows put together are not Θ_start + P z (stale or "
             "misplaced rows)", not good[0]),
            ("after a load of z the rows are not Θ_start + P z_loaded", not good[1]),
            ("a rank wrote rows it does not hold", not outside)) if bad)
        out.append(Check(f"fsdp dpsft coords: {k} ranks' rows of Θ_start + P z after the step and after a load",
                         not why, f"K = {k}: {why}" if why else "each rank writes its rows of Θ_start + P z after "
                         "every step and after a load: together the one-process Θ"))
    return out


def _trajectory(m: int = 4):
    """Θ_0..Θ_m of a tiny MLP with uneven dim-0 chunks (random steps: a trajectory of rank m)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    g = torch.Generator().manual_seed(3)
    traj = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for _ in range(m):
        traj.append({n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in traj[-1].items()})
    return traj


def _sim_collectives(rank: int, sent: list):
    """``full_on_rank0`` and the broadcasts of ``share_basis`` as on rank ``rank``: a simulated shard carries its
    full tensor (``_full``, what the gather would assemble); rank 0 records what it broadcasts in ``sent``,
    the other ranks receive it in order (for a ``with``)."""
    got = iter(list(sent))

    def obj(world, o):
        if rank == 0:
            sent.append(o)
            return o
        return next(got)

    def bcast(buf, src=0, group=None):
        if rank == 0:
            sent.append(buf.clone())
        else:
            buf.copy_(next(got))

    return patched((dpsft_stage1, "full_on_rank0", lambda ts: {n: ts[n]._full for n in sorted(ts)} if rank == 0
                    else None), (dpsft_stage1, "broadcast_object", obj), (dist, "broadcast", bcast))


def _stage1_check() -> list[Check]:
    traj, meta = _trajectory(), {"source": "private", "stage1_steps": 4}
    after = list(range(1, len(traj)))

    def run(views, world):
        snaps = dpsft_stage1.Snapshots(after)
        snaps.start(views[0], world)
        for t in after:
            snaps(t, views[t])
        return dpsft_stage1.world_basis(snaps, views[-1], world, _K, dict(meta)), snaps

    one, _ = run(traj, None)
    out = []
    for k in (2, 3):
        sent: list = []
        ranks = []
        for r in range(k):
            views = []
            for state in traj:
                v = {}
                for n, t in state.items():
                    v[n] = t[slice(*chunk_rows(t.shape[0], r, k))].clone()
                    v[n]._full = t  # what FSDP2's gather assembles from the ranks' rows
                views.append(v)
            with _sim_collectives(r, sent):
                ranks.append(run(views, World(r, k)))
        same = all(b.blocks.keys() == one.blocks.keys() and b.start is not None
                   and all(b.blocks[n].shape == one.blocks[n].shape and torch.equal(b.blocks[n], one.blocks[n])
                           and torch.equal(b.start[n], one.start[n]) for n in one.blocks)
                   and torch.equal(b.singular_values, one.singular_values) and b.meta == one.meta for b, _ in ranks)
        kept = all(not s.snapshots for _, s in ranks[1:])
        why = "; ".join(w for w, bad in (
            ("a rank's basis P, Θ* or singular values is not the one-process basis (built from its own rows?)",
             not same), ("a rank other than 0 kept snapshots", not kept)) if bad)
        out.append(Check(f"dpsft stage 1: {k} ranks hold the one-process basis", not why,
                         f"K = {k}: {why}" if why else "full snapshots gathered to rank 0, P and Θ* built there "
                         "once and broadcast: every rank holds the one-process basis"))
    return out


def fsdp_dpsft_check(planted: Optional[str] = None) -> list[Check]:
    """The sharded DP-SFT step's check alone (module docstring); ``planted`` as :func:`fsdp_methods_checks`."""
    with _planted(planted):
        return _dpsft_check() + _coords_check() + _stage1_check()


def fsdp_methods_checks(planted: Optional[str] = None) -> list[Check]:
    """The white-box checks of methods on FSDP2 shards (module docstring); ``planted``: one of
    :data:`PLANTED` (the checks must then fail)."""
    with _planted(planted):
        return _rmt_check() + _dpsft_check() + _coords_check() + _stage1_check()
