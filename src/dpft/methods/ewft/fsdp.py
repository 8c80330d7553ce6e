"""``ldp.train_pre`` (methods/ewft/train_pre.py) under FSDP2 (``perf.sharding: fsdp``; issue 38).

What a world of K FSDP2 processes computes is, draw for draw, what K DDP processes compute (and, in its
ledger, what one process records):

- **The engine runs on a plain copy of the model, gathered once per step.** :class:`TrainPreEngine`
  calls pre(·) and post(·) outside the model's forward (its own representation release, post(·)'s
  plain gradients, a per-example engine on pre(·)'s tail), so FSDP2's hooks would not gather the root
  unit's parameters around it, nor could its all-gathers be paired across ranks that run different
  numbers of micro-batches. Instead, at the start of each step every rank all-gathers the trainable
  parameters (the frozen ones once, at the first step) in name order — the same collectives in the
  same order on every rank, whatever its share of the batch — into a plain (unsharded) copy of the
  split model built from the template :func:`dpft.placement.fsdp.shard_model` kept, and runs the one-process
  engine on it. No FSDP2 hook runs inside the step, so no collective depends on the batch and no
  placeholder micro-batch is needed. Memory: the whole model per rank while the step runs (as
  :func:`dpft.placement.fsdp.gathered` for evaluation); the optimizer state, the clipped sums after the
  reduce-scatter, the noise and the update stay sharded.
- **The representation release is the rank's own, as under DDP.** The copy's noise layer takes the
  live layer's σ and secret stream (``ldp``, step, ``rank``, r: methods/ewft/parts.py ``rank_parts``)
  before every step (:func:`sync_layer`), so rank r adds exactly the noise DDP's rank r adds.
- **Clipped sums reduce-scattered, once per step.** The rank's full-shape sums over its micro-batches
  (pre(·): Σ_i c_i g_i, clipped to C_g; post(·): plain gradient sums — post-processing of the noisy
  codes) are summed over the ranks by :class:`dpft.placement.fsdp.ReduceScatter` (FSDP's dim-0 layout), so each
  rank holds its shard of the world's sum: DDP's all-reduced sum, sliced.
- **The gradient noise is DDP's draw, sliced.** :class:`ShardedTrainPreMechanism` draws the noise of
  pre(·)'s tensor ``name`` from the stream ``noise``, (t, name) in the tensor's full shape — what
  :class:`~dpft.step.noise.GaussianMechanism` draws in one process and on every DDP rank — and keeps
  this rank's flat range. The shards are disjoint and cover the tensor, so the world adds exactly one
  N(0, (σ_grad·C_g)²I) draw, equal to DDP's for any K (each rank draws the full tensor: time, and one
  tensor of memory at a time). post(·)'s sums get no noise, as in one process.
- **One ledger event per step**, ``PoissonSampled(q, Gaussian(σ_eff))`` (the base mechanism's), recorded
  by every rank's step as in one process; rank 0 alone writes it.

In one process (``perf.sharding: fsdp`` without torchrun) nothing is sharded: the engine runs on the live
model and the mechanism's slice is the whole tensor. Source: DESIGN.md "Distributed"; issue 38 item 3.
"""

from __future__ import annotations

import copy
import time
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from dpft.placement.fsdp import _TEMPLATES, FSDPError, FSDPStep, ReduceScatter, local, local_range
from dpft.placement.fsdp_methods import wrap_transforms
from dpft.methods.ewft.train_pre import TrainPreEngine, TrainPreMechanism
from dpft.placement.shards import is_sharded
from dpft.step.aggregate import Aggregator
from dpft.step.clip import NonFiniteGradientError
from dpft.step.noise import GaussianMechanism
from dpft.step.pipeline import DPStep, StepOutput

__all__ = ["ShardedTrainPreMechanism", "TrainPreFSDPStep", "sync_layer", "shard_slice"]


def shard_slice(full: torch.Tensor, layout: tuple[int, int, int], shape) -> torch.Tensor:
    """This rank's elements of ``full`` (a full-shape tensor): flat ``[offset, offset+count)`` of
    ``layout = (numel, offset, count)`` (:func:`dpft.placement.fsdp.local_range`), reshaped to ``shape``.

    Raises:
        FSDPError: the layout does not fit ``full`` or ``shape``."""
    numel, off, cnt = layout
    if full.numel() != numel or int(torch.Size(shape).numel()) != cnt:
        raise FSDPError(f"a shard of {int(torch.Size(shape).numel())} elements at {off} does not fit the layout "
                        f"{layout} of a {full.numel()}-element tensor")
    return full.reshape(-1)[off:off + cnt].reshape(shape)


class _SliceStream:
    """``normal(shape)`` = this shard's slice of the full-shape draw of ``base``'s stream (noise, t, name)."""

    def __init__(self, base: GaussianMechanism, step: int, name: str, full_shape, layout):
        self.base, self.step, self.name, self.full_shape, self.layout = base, int(step), str(name), full_shape, layout

    def normal(self, shape, dtype=torch.float32, device=None) -> torch.Tensor:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        full = GaussianMechanism.noise_stream(self.base, self.step, self.name, dev).normal(
            self.full_shape, dtype=torch.float32, device=dev)
        return shard_slice(full, self.layout, shape).clone().to(dtype)


class _SlicedGaussian(GaussianMechanism):
    """A :class:`GaussianMechanism` whose draw of tensor ``name`` is the shard's slice of the one-process draw."""

    def __init__(self, base: GaussianMechanism, layout: Mapping[str, tuple[int, int, int]],
                 shapes: Mapping[str, tuple]):
        self.__dict__.update(vars(base))
        self.layout, self.shapes = dict(layout), dict(shapes)

    def noise_stream(self, step: int, name: str, device: torch.device):  # type: ignore[override]
        return _SliceStream(self, step, name, self.shapes[name], self.layout[name])


class ShardedTrainPreMechanism(TrainPreMechanism):
    """:class:`TrainPreMechanism` on sums held in FSDP2 shards: pre(·)'s entries get this shard's slice of
    the one-process (and DDP) noise draw (module docstring), post(·)'s none; the same σ's and the same
    ledger event.

    Args:
        base: the plan's mechanism (its σ's, sensitivity, secret key and pre(·) names are kept).
        layout: name → ``(numel, offset, count)`` of this rank's shard (:func:`dpft.placement.fsdp.local_range`).
        shapes: name → the tensor's full shape."""

    def __init__(self, base: TrainPreMechanism, layout: Mapping[str, tuple[int, int, int]],
                 shapes: Mapping[str, tuple]):
        self.__dict__.update(vars(base))
        self.gauss = _SlicedGaussian(base.gauss, layout, shapes)


def sync_layer(plain: nn.Module, live: nn.Module) -> None:
    """Give the plain copy's noise layer what :meth:`dpft.methods.ewft.method.LDPRun.before_step` set on the live
    one this step — σ, the secret stream (``ldp``, t, rank) — and the live model's train/eval mode."""
    lay, src = plain.noise, live.noise
    lay.set_sigma(src.sigma)
    lay.generator = src.generator
    lay.eval_noise = src.eval_noise
    plain.train(live.training)


def _plain_copy(live: nn.Module) -> nn.Module:
    """A plain copy of the sharded ``live`` model (from :func:`dpft.placement.fsdp.shard_model`'s template), its
    parameters allocated (uninitialised, on the live shards' device; tied ones stay one Parameter) for
    :meth:`TrainPreFSDPStep._gather` to fill, its buffers copied."""
    tmpl = _TEMPLATES.get(live)
    if tmpl is None:
        raise FSDPError("ldp.train_pre under FSDP2: the model was not sharded by dpft.placement.fsdp.shard_model (no template)")
    plain = copy.deepcopy(tmpl)
    dev = local(next(live.parameters())).device
    bufs = dict(live.named_buffers(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}
    for mname, m in plain.named_modules(remove_duplicate=False):
        for k, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=dev),
                                               requires_grad=p.requires_grad)
                m._parameters[k] = made[id(p)]
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = bufs[f"{mname}.{k}" if mname else k].detach().clone()
    return plain


class TrainPreFSDPStep(FSDPStep):
    """The ``ldp.train_pre`` step over FSDP2-sharded parameters (module docstring).

    Args:
        spec: the plan's step parts as :meth:`dpft.methods.ewft.method.ForwardLDP.build` made them: a
            :class:`TrainPreEngine` on the live (sharded) split model and a :class:`TrainPreMechanism`.
        ledger, n, world, on_release: as :class:`dpft.placement.fsdp.FSDPStep`.

    Raises:
        FSDPError: another engine or mechanism."""

    def __init__(self, spec, ledger, n, world, on_release=None):
        if not isinstance(spec.engine, TrainPreEngine) or not isinstance(spec.mechanism, TrainPreMechanism):
            raise FSDPError("TrainPreFSDPStep runs the ldp.train_pre step (TrainPreEngine and TrainPreMechanism)")
        self.world = world
        params = spec.params if spec.params is not None else spec.engine.params
        self.layout = {k: (p.numel(), *local_range(p, world.rank, world.world_size)) for k, p in params.items()}
        mech = ShardedTrainPreMechanism(spec.mechanism, self.layout, {k: tuple(p.shape) for k, p in params.items()})
        spec = spec.replace(mechanism=mech, transforms=wrap_transforms(spec.transforms, params, world))
        DPStep.__init__(self, spec, ledger, n, on_release=on_release, world_group=world.group)
        self.scatter = ReduceScatter(params, list(params), world)
        #: The engine on the plain copy (built at the first step; None in one process: the live engine runs).
        self.plain_engine: Optional[TrainPreEngine] = None
        self._sharded = any(is_sharded(p) for p in spec.engine.model.parameters())

    def _gather(self, plain: nn.Module, live: nn.Module, names: Optional[set]) -> None:
        """All-gather ``live``'s parameters (those in ``names``; all when None) into ``plain``, in
        ``live``'s name order: the same collectives in the same order on every rank."""
        dst = dict(plain.named_parameters())
        with torch.no_grad():
            for k, p in live.named_parameters():
                if names is None or k in names:
                    dst[k].copy_((p.full_tensor() if is_sharded(p) else p).detach())

    def engine_for_step(self) -> TrainPreEngine:
        """The engine of this step, its copy's weights current (a collective under FSDP2)."""
        live_eng = self.spec.engine
        if not self._sharded:
            return live_eng
        live = live_eng.model
        if self.plain_engine is None:
            plain = _plain_copy(live)
            self._gather(plain, live, None)
            e = live_eng
            self.plain_engine = TrainPreEngine(plain, e.loss_fn, self.spec.clip, e.first_block,
                                               e.tail.embeddings is not None, e.engine_name)
            self.plain_engine.precision = getattr(e, "precision", self.plain_engine.precision)
            if list(self.plain_engine.params) != list(self.params):
                raise FSDPError("ldp.train_pre under FSDP2: the plain copy's trainable parameters are not the model's")
        else:
            self._gather(self.plain_engine.model, live, set(self.params))
        sync_layer(self.plain_engine.model, live)
        return self.plain_engine

    def run(self, step: int, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> StepOutput:
        sp = self.spec
        t0 = time.perf_counter()
        eng = self.engine_for_step()
        eng.clip = sp.clip
        full = Aggregator(eng.params, keep_norms=sp.keep_norms)
        failure: Optional[Exception] = None
        try:
            for batch in micro_batches:  # no collective inside: the copy is a plain module
                full.add(eng.clipped_sum(batch))
        except NonFiniteGradientError as exc:
            if not self.world.distributed:
                raise
            failure = exc  # the other ranks still wait in the reduce-scatters below: this rank sends zeros
        agg = Aggregator({k: local(p) for k, p in self.params.items()}, keep_norms=sp.keep_norms)
        self.scatter.start(failure is not None)
        for k in self.params:  # every rank, every parameter, the same order
            agg.sum[k] = self.scatter(k, full.sum[k])
        agg.loss_sum, agg.batch_size, agg.clipped, agg.overflowed = (full.loss_sum, full.batch_size, full.clipped,
                                                                     full.overflowed)
        agg.norms = full.norms
        del full
        if self._stats(agg, failure is not None):
            raise failure or NonFiniteGradientError(
                "non-finite training loss on another rank; lower optimizer.lr or check the data")
        return self.release_and_update(step, agg, t0)


def make_step(spec, ledger, n, world, on_release=None) -> TrainPreFSDPStep:
    """The engine's FSDP2 step factory (``TrainPreEngine.fsdp_step``; dpft/session/step.py ``step_for``)."""
    return TrainPreFSDPStep(spec, ledger, n, world, on_release=on_release)
