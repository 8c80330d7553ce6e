"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the book-keeping DP step (``perf.sharding: fsdp``).

What the world of K processes computes is the DP-SGD step of one process (DESIGN.md
"Distributed"), with parameters, clipped sums, noise and optimizer state sharded over the ranks:

- **Data parallel, as under DDP.** One Poisson logical batch for the world from the shared
  secret key; each rank runs every K-th example of it (``distributed.shard``) in micro-batches.
- **Per-example norms need no communication.** FSDP2 all-gathers each block's parameters before
  its forward (and again before its backward), so every hooked layer computes with the *full*
  weight, and its input ``A`` and output gradient ``G`` are full for the rank's own examples. The
  book-keeping norms ``‖g_i‖² = Σ_layers ‖G_iᵀA_i‖²`` of rank r's examples are therefore complete
  on rank r (every parameter shard's contribution is in them), so the clip factors are exactly
  those of one process. (Schemes that instantiate per-example gradients *shard by shard* would
  need an all-reduce of a (B,) vector of partial squared norms; here none is needed.)
- **FSDP never reduces an unclipped gradient.** The engine switches every trainable parameter to
  ``requires_grad=False`` for its pass, and FSDP2 copies that flag to the unsharded parameter at
  every all-gather (``FSDPParam.to_unsharded``), so autograd computes activation gradients only:
  no unsharded ``.grad`` exists and FSDP's post-backward reduce-scatter has nothing to reduce
  (:meth:`FSDPStep.run` checks it after every micro-batch).
- **The clipped sum is reduce-scattered.** For each parameter, as soon as the engine has
  computed the rank's full-shape clipped sum ``Σ_{i∈r} c_i g_i`` (``(c∘G)ᵀA``), :class:`ReduceScatter`
  sums it over the ranks and keeps this rank's dim-0 shard (FSDP's own layout, ``torch.chunk``),
  so one full-size gradient is alive at a time. Every rank runs the same number of micro-batches
  (a rank with fewer runs a *placeholder* one: it sends zeros, and still adds the shard it receives,
  which holds the other ranks' examples): FSDP's all-gathers and these reduce-scatters are
  collectives. The engine's one-time usage probe (a partial backward, so FSDP all-gathers that depend
  on the batch) runs on the same placeholder batch on every rank. An engine whose clipped sum is no
  sharded parameter (DP-SFT's (k,) coordinates, ``engine.replicated_sum``) gets
  :class:`~dpft.placement.fsdp_methods.ReplicatedSum` instead: all-reduced once per step, its noise drawn whole.
- **Noise on each shard from disjoint streams, together one draw.** :class:`ShardedGaussianMechanism`
  draws the noise of parameter ``name`` in fixed blocks of :data:`NOISE_BLOCK` flat elements,
  block k from the secret stream ``noise``, (t, name, ``"fsdp-block"``, k); a rank draws the blocks
  its shard overlaps and keeps its elements. Each element's noise comes from exactly one position
  of one stream, the shards are disjoint and cover the tensor, so the world adds exactly one
  N(0, σ²C²I) draw — and the same values whatever the number of ranks (a 1-process run with
  ``perf.sharding: fsdp`` draws the same noise as a K-process one). Any mechanism that draws its
  fresh Gaussian through ``noise_stream`` is sharded this way (:func:`shard_mechanism`): truncated
  Poisson (the Gaussian mechanism with its truncated event) and banded MF, whose y_t = (z_t −
  Σ_j c_j y_{t−j}) / c_0 is elementwise, so each rank keeps the noise buffers of its shard only.
- **One ledger event per logical step**, recorded by every rank's :class:`~dpft.step.DPStep`
  bookkeeping as in one process; rank 0 alone writes it.
- The optimizer steps the sharded ``DTensor`` parameters (its state is sharded too: about 1/K of
  parameter + optimizer memory per rank). Evaluation runs with all parameters gathered
  (:func:`gathered`); checkpoints are per rank (``torch.distributed.checkpoint``, dpft/placement/fsdp_checkpoint.py:
  no rank holds the full state); the model saved at the end is a plain copy (:func:`materialise`).

Works with frozen parameters (LoRA: FSDP shards them too; only trainable ones get clipped sums
and noise), tied embeddings (the root FSDP group holds both uses), mixed precision (bf16:
``MixedPrecisionPolicy(param_dtype=bf16)``, fp32 master shards, clipped sums and reduce-scatter
in fp32) and activation checkpointing (FSDP2 re-gathers inside the recomputation; the engine
counts each call once).

Source: DESIGN.md "Distributed"; issue 26 item 3; Zhao et al. 2023 (PyTorch FSDP); Bu et al.
2023 (book-keeping).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from dpft.placement.fsdp_methods import ReplicatedSum, method_refusals, wrap_transforms
from dpft.grads.groups import split_groups
from dpft.placement.shards import chunk_rows, is_sharded
from dpft.step.correlated import BandedMFMechanism
from dpft.step.noise import GaussianMechanism
from dpft.step.pipeline import DPStep, StepOutput

__all__ = ["NOISE_BLOCK", "FSDPError", "block_classes", "shard_model", "chunk_range", "local_range", "local", "ReduceScatter",
           "ShardedGaussianMechanism", "ShardedBandedMFMechanism", "shard_mechanism", "shard_noise", "FSDPStep", "check_recipe", "gathered", "full_state",
           "materialise", "is_sharded"]

#: Flat elements per noise block: the unit of the sharded noise layout (fixed, so the noise of a
#: tensor does not depend on how many ranks share it).
NOISE_BLOCK = 1 << 16

_TEMPLATES: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


class FSDPError(ValueError):
    """A recipe ``perf.sharding: fsdp`` cannot run (yet); the message names the fix."""


# -- recipe checks -----------------------------------------------------------------------------
def check_recipe(recipe, world_size: int, methods: list, private: bool, resume: bool) -> None:
    """Refuse, before any loading, what the FSDP step does not run correctly.

    Raises:
        FSDPError: another engine than book-keeping in a private run (``auto`` is book-keeping), a
            method plug-in that cannot run sharded (named with its reason: dpft/placement/fsdp_methods.py).
            ``--resume`` runs (dpft/placement/fsdp_checkpoint.py). User level runs: each rank clips whole users
            (``distributed.shard_units``), a placeholder micro-batch carries no clipping groups (its
            sum is replaced by zeros before the reduce-scatter).
    """
    why = []  # a non-private run is plain FSDP2 training (dpft/placement/fsdp_plain.py)
    if private and recipe.privacy.engine not in ("auto", "bookkeeping"):
        # ``auto`` is the book-keeping engine (step/build.py ``make_engine``), which FSDP runs.
        why.append(f"privacy.engine {recipe.privacy.engine!r}: FSDP runs the book-keeping engine only "
                   "(set privacy.engine: auto or bookkeeping)")
    why += method_refusals(methods)  # each method's own reason (methods/base.py ``sharded_refusal``)
    if why:
        raise FSDPError("perf.sharding: fsdp cannot run this recipe: " + "; ".join(why))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not sharded)."""
    return t.to_local() if is_sharded(t) else t


def local_range(p: torch.Tensor, rank: int, world_size: int) -> tuple[int, int]:
    """``(offset, numel)`` of this rank's shard of ``p`` in ``p``'s flattened (row-major) elements.

    FSDP2 shards dim 0 with ``torch.chunk`` (rows ``ceil(d0/K)`` per rank, the last ranks fewer or
    none), so a shard is a contiguous flat range. A parameter that is not sharded is whole.

    Raises:
        FSDPError: the local shard's shape is not the chunk this layout expects.
    """
    if not is_sharded(p):
        return 0, p.numel()
    d0 = p.shape[0]
    offset, count = chunk_range(tuple(p.shape), rank, world_size)
    inner = p.numel() // d0 if d0 else 0
    start, end = (offset // inner, (offset + count) // inner) if inner else (0, 0)
    loc = p.to_local()
    if tuple(loc.shape) != (end - start, *p.shape[1:]):
        raise FSDPError(f"FSDP shard of shape {tuple(loc.shape)} on rank {rank} is not rows [{start}, {end}) of "
                        f"{tuple(p.shape)}; dpft expects fully_shard's default dim-0 chunking")
    return start * inner, (end - start) * inner


def chunk_range(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """``(offset, numel)`` in the flattened elements of a ``shape`` tensor of rank ``rank``'s dim-0
    chunk among ``world_size`` (``torch.chunk``: ``ceil(d0/K)`` rows each, the last ranks fewer or none)."""
    d0 = shape[0] if shape else 1
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    start, end = chunk_rows(d0, rank, world_size)
    return start * inner, (end - start) * inner


# -- sharding the model -------------------------------------------------------------------------
def block_classes(model: nn.Module) -> set[str]:
    """Class names of the transformer blocks: every ``_no_split_modules`` a Hugging Face model (or
    the base model under a PEFT wrapper) declares. Each block becomes one FSDP unit."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return names


def _meta_template(model: nn.Module) -> nn.Module:
    """A parameter-free copy of ``model`` (parameters and buffers on the meta device; ties kept)
    to rebuild a plain model from gathered tensors later (:func:`materialise`)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def shard_model(model: nn.Module, world, dtype: str = "fp32", blocks: Optional[set[str]] = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply ``fully_shard`` to every transformer block (:func:`block_classes`) and to the root.

    Args:
        model: the placed model, identical on every rank (broadcast from rank 0 first).
        world: the :class:`~dpft.placement.world.World`; one process: returned as is (nothing to
            shard; the step still uses the sharded noise layout).
        dtype: ``perf.dtype``; ``bf16`` gathers bf16 parameters (``MixedPrecisionPolicy``), the
            shards (master weights) stay fp32.
        blocks: class names of the modules that become FSDP units (default :func:`block_classes`;
            an empty set: the root alone). DPTrainer maps ``transformer_layer_cls_to_wrap`` here.
        reshard_after_forward: the blocks' FSDP2 flag (``fsdp_config['reshard_after_forward']``).

    Embeddings and the output head stay in the root unit, so tied weights share one FSDP
    parameter. Blocks reshard after forward (all-gathered again for the backward); the root does not.
    """
    if not world.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _TEMPLATES[model] = _meta_template(model)
    dev = next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (world.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16" \
        else MixedPrecisionPolicy()
    blocks = block_classes(model) if blocks is None else set(blocks)
    for m in reversed(list(model.modules())):
        if m is not model and type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of ``model``. A unit left gathered by the last forward (the root
    keeps its parameters after forward; ``Trainer``'s evaluation; a user's call) would keep that
    pass's ``requires_grad`` flags, since FSDP2 copies them at all-gather only, and its parameters
    would be the unsharded tensors."""
    for m in _fsdp_modules(model):
        m.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module):
    """All parameters gathered on every rank, and kept so across forwards (no collective inside):
    for evaluation, where ranks run different numbers of batches. A no-op for an unsharded model.
    Costs the full model's memory while open."""
    mods = _fsdp_modules(model)
    if not mods:
        yield model
        return
    for m in mods:
        m.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_state(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of ``params`` on every rank, in name order (a collective: call on every
    rank). Unsharded tensors are returned as they are."""
    return {n: (params[n].full_tensor() if is_sharded(params[n]) else params[n]).detach() for n in sorted(params)}


def materialise(model: nn.Module, keep: bool = True) -> nn.Module:
    """A plain (unsharded) copy of an FSDP ``model`` with its current weights (a collective: every rank
    calls it; the parameters are gathered one at a time in ``model``'s name order). Used for what runs
    after training on rank 0 alone (saving, generation). A model that was never sharded is returned as is.

    ``keep`` False (the ranks that do not save): each gathered tensor is dropped at once (peak: one
    tensor's gather, not the model) and ``model`` itself, still sharded, is returned. ``keep`` True: the
    copy (peak: the full model plus one gather; a gathered tensor is used as is, not copied again).
    Measured: benchmarks/resume_memory.py ``--case save``."""
    tmpl = _TEMPLATES.get(model)
    if tmpl is None:
        return model
    full: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        t = (p.full_tensor() if is_sharded(p) else p).detach()
        if keep:  # a gathered tensor is used as is when it owns its memory; else (a live tensor, the shard
            # itself in a 1-rank mesh, a view of a padded buffer) copied
            st = t.untyped_storage()
            own = (is_sharded(p) and t.is_contiguous() and st.nbytes() == t.numel() * t.element_size()
                   and st.data_ptr() != p.to_local().untyped_storage().data_ptr())
            full[n] = t if own else t.clone()
        del t
    if not keep:
        return model
    bufs = dict(model.named_buffers(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}
    names = {}
    for n, p in tmpl.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for mname, m in tmpl.named_modules(remove_duplicate=False):
        for k, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(full.pop(names[id(p)]), requires_grad=p.requires_grad)
            m._parameters[k] = made[id(p)]
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = bufs[f"{mname}.{k}" if mname else k].detach().clone()
    return tmpl


# -- the clipped sum, reduce-scattered ----------------------------------------------------------
class ReduceScatter:
    """The book-keeping engine's per-parameter hook (``engine.on_param_sum``): sums the rank's
    full-shape clipped sum of one parameter over the ranks and returns this rank's shard.

    ``dummy`` = True: this micro-batch is a placeholder (a rank with fewer micro-batches than
    another); zeros are sent instead of its sum. :meth:`finish_with_zeros` completes a micro-batch
    whose engine call failed part way (the other ranks wait in these collectives).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], names: Iterable[str], world):
        self.params = dict(params)
        self.names = list(names)
        self.world = world
        self.dummy = False
        self.done: list[str] = []

    def start(self, dummy: bool) -> None:
        """A new micro-batch."""
        self.dummy, self.done = dummy, []

    def __call__(self, name: str, full: torch.Tensor) -> torch.Tensor:
        p = self.params[name]
        self.done.append(name)
        if self.dummy:
            full = torch.zeros(p.shape, dtype=torch.float32, device=full.device)
        full = full.float()
        if not is_sharded(p):
            return full
        from torch.distributed.tensor import DTensor, Partial, Shard

        part = DTensor.from_local(full, p.device_mesh, [Partial()], run_check=False)
        return part.redistribute(p.device_mesh, [Shard(0)]).to_local()

    def finish(self, agg) -> None:
        """Nothing left at the release: the sums were reduce-scattered per micro-batch."""

    def finish_with_zeros(self) -> None:
        """Send zeros for every parameter not yet reduce-scattered in this micro-batch."""
        left = [n for n in self.names if n not in self.done]
        self.dummy = True
        for n in left:
            p = self.params[n]
            self(n, torch.zeros(p.shape, dtype=torch.float32, device=local(p).device))


# -- noise ---------------------------------------------------------------------------------------
def shard_noise(mech: GaussianMechanism, step: int, name: str, numel: int, offset: int, count: int,
                device: torch.device) -> torch.Tensor:
    """Standard normal noise of flat elements ``[offset, offset+count)`` of the ``numel``-element
    tensor ``name`` at step ``step``: block k (:data:`NOISE_BLOCK` elements) from the secret stream
    ``noise``, (step, name, ``"fsdp-block"``, k), the blocks the range overlaps drawn whole and cut.
    ``(count,)`` fp32 on ``device``."""
    if count == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    out = []
    k0, k1 = offset // NOISE_BLOCK, (offset + count - 1) // NOISE_BLOCK
    for k in range(k0, k1 + 1):
        lo = k * NOISE_BLOCK
        n = min(NOISE_BLOCK, numel - lo)
        z = mech.rng.stream("noise", int(step), str(name), "fsdp-block", k, device=device).normal(
            (n,), dtype=torch.float32, device=device)
        a, b = max(offset, lo) - lo, min(offset + count, lo + n) - lo
        out.append(z[a:b])
    return torch.cat(out)


class _ShardStream:
    """What a mechanism's ``noise_stream(step, name, device)`` returns under FSDP: ``normal(shape)``
    draws this shard's elements of tensor ``name``'s noise with :func:`shard_noise` (the block
    layout), so any mechanism that draws its fresh Gaussian through ``noise_stream`` (the
    independent one, banded MF's z_t) draws the same values for any number of ranks."""

    def __init__(self, mech, step: int, name: str, layout: tuple[int, int, int]):
        self.mech, self.step, self.name, self.layout = mech, int(step), str(name), layout

    def normal(self, shape, dtype=torch.float32, device=None) -> torch.Tensor:
        numel, offset, count = self.layout
        if math.prod(shape) != count:
            raise FSDPError(f"{self.name}: shard of {math.prod(shape)} elements but the layout says {count}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return shard_noise(self.mech, self.step, self.name, numel, offset, count, dev).reshape(shape).to(dtype)


class _ShardedNoise:
    """Mixin: the mechanism's fresh Gaussian of tensor ``name`` is this shard's slice of the block
    layout (:class:`_ShardStream`); everything else — σ, sensitivity, the ledger event (the
    sampler's ``step_event`` under truncation), banded MF's correlation over its (shard-sized)
    buffers — is the base mechanism's.

    Args:
        base: the plan's mechanism (its attributes are copied: same σ, key, step event, state).
        layout: per tensor name, ``(numel, offset, count)``: its global element count and this
            shard's flat range (:func:`local_range`)."""

    def __init__(self, base, layout: Mapping[str, tuple[int, int, int]]):
        self.__dict__.update(vars(base))
        self.layout = dict(layout)

    def noise_stream(self, step: int, name: str, device: torch.device):  # type: ignore[override]
        return _ShardStream(self, step, name, self.layout[name])


class ShardedGaussianMechanism(_ShardedNoise, GaussianMechanism):
    """The Gaussian mechanism on a clipped sum held in shards (one per rank).

    ``grad_sum`` holds this rank's shards; ``layout`` gives, per tensor name, its global element
    count and this shard's flat ``(offset, numel)``. Noise std σC per coordinate, drawn by
    :func:`shard_noise` — disjoint streams per block, so the shards of the world together get one
    N(0, σ²C²I) draw. The ledger event is the unsharded mechanism's (one per logical step;
    truncated Poisson's ``TruncatedSubsampledGaussianDpEvent`` when the base records its sampler's
    ``step_event``).
    """


class ShardedBandedMFMechanism(_ShardedNoise, BandedMFMechanism):
    """Banded MF (step/correlated.py) on a clipped sum held in shards: z_t is this shard's slice
    of the block-layout draw, and y_t = (z_t − Σ_{j≥1} c_j y_{t−j}) / c_0 is computed elementwise,
    so each rank keeps the b − 1 noise buffers of its own shard only ((b − 1)/K of the trainable
    parameters in fp32 per rank) and the world's y_t is exactly the one-process (sharded-layout)
    noise. The ledger events (PoissonSampled(p, G(σ)) at t ≡ 0 mod b, NoOp otherwise) are the
    base mechanism's; the secret partition and row fingerprint travel with it.

    :meth:`state` gathers the buffers to full tensors (a collective: every rank calls it; the
    secret file is then the one a one-process run writes: ``make_private``'s ``save_noise_state``),
    :meth:`load_state` keeps this rank's slice (or takes the slices as they are when the state says
    ``local_buffers``: ``dpft train``'s per-rank checkpoints, dpft/placement/fsdp_checkpoint.py). ``world`` and ``shapes`` (name → (full shape, local shape)) are set by :class:`FSDPStep`."""

    world = None
    shapes: dict = {}

    def _gather(self, buf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = {n: t.detach().float().cpu().reshape(-1) for n, t in buf.items()}
        if self.world is not None and self.world.distributed:
            import torch.distributed as dist

            parts: list = [None] * self.world.world_size
            dist.all_gather_object(parts, flat, group=self.world.group)  # rank order = flat element order
            flat = {n: torch.cat([parts[r][n] for r in range(self.world.world_size)]) for n in flat}
        return {n: t.reshape(self.shapes[n][0]) if n in self.shapes else t for n, t in flat.items()}

    def state(self) -> dict:
        st = super().state()
        st["buffers"] = [self._gather(b) for b in self.buffers]
        return st

    def load_state(self, st: dict, device_of: Optional[dict[str, torch.Tensor]] = None) -> None:
        if st.get("local_buffers"):  # this rank's slices already (a per-rank checkpoint: dpft/placement/fsdp_checkpoint.py)
            return super().load_state(st, {n: local(p) for n, p in (device_of or {}).items()})
        mine = []
        for b in st["buffers"]:
            out = {}
            for n, t in b.items():
                _, off, cnt = self.layout[n]
                out[n] = t.reshape(-1)[off:off + cnt].reshape(self.shapes[n][1]).clone()
            mine.append(out)
        super().load_state({**st, "buffers": mine}, {n: local(p) for n, p in (device_of or {}).items()})


#: The sharded counterpart of each mechanism class the plan may build.
_SHARDED = {GaussianMechanism: ShardedGaussianMechanism, BandedMFMechanism: ShardedBandedMFMechanism}


def shard_mechanism(base, layout: Mapping[str, tuple[int, int, int]]):
    """The sharded counterpart of the plan's mechanism ``base`` (its attributes copied).

    Raises:
        FSDPError: a mechanism class with no sharded counterpart (named)."""
    cls = _SHARDED.get(type(base))
    if cls is None:
        raise FSDPError(f"perf.sharding: fsdp has no sharded noise for {type(base).__name__} (sharded: "
                        f"{', '.join(c.__name__ for c in _SHARDED)}); use perf.sharding: ddp")
    return cls(base, layout)


# -- the step ------------------------------------------------------------------------------------
class FSDPStep(DPStep):
    """:class:`~dpft.step.DPStep` over FSDP2-sharded parameters (see the module docstring).

    Args: as :class:`DPStep`, plus ``world`` and ``dummy_batch`` (a callable returning a small
    micro-batch, the same on every rank: run by a rank that has fewer micro-batches than another,
    its own contribution replaced by zeros; and the engine's first-call usage probe).

    Raises:
        FSDPError: a mechanism without a sharded counterpart (:func:`shard_mechanism`), or an
            engine without the per-parameter hook.
    """

    def __init__(self, spec, ledger, n, world, dummy_batch: Callable[[], Mapping[str, torch.Tensor]],
                 on_release=None):
        eng = spec.engine
        if not hasattr(eng, "on_param_sum"):
            raise FSDPError(f"perf.sharding: fsdp needs the book-keeping engine (got {type(eng).__name__})")
        self.world = world
        params = spec.params if spec.params is not None else eng.params
        # noise goes on what the engine sums (DP-SFT: its (k,) coordinates, whole on every rank)
        summed = {**params, **eng.params}
        self.layout = {n: (p.numel(), *local_range(p, world.rank, world.world_size)) for n, p in summed.items()}
        # a clipped sum that is no sharded parameter (DP-SFT's coordinates): all-reduced at release
        self.scatter = ReplicatedSum(world) if getattr(eng, "replicated_sum", False) \
            else ReduceScatter(params, eng.param_names, world)
        eng.on_param_sum = self.scatter
        if spec.mechanism is not None:
            mech = shard_mechanism(spec.mechanism, self.layout)
            mech.world = world
            mech.shapes = {n: (tuple(p.shape), tuple(local(p).shape)) for n, p in summed.items()}
            spec = spec.replace(mechanism=mech)
        # whole-tensor post-processing (RMT's SVD per matrix) on the gathered noisy gradient: fsdp_methods.py
        spec = spec.replace(transforms=wrap_transforms(spec.transforms, params, world))
        super().__init__(spec, ledger, n, on_release=on_release, world_group=world.group)
        self.dummy_batch = dummy_batch

    def _as_grad(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if not is_sharded(p):
            return g
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def _count(self, n: int) -> int:
        """The most micro-batches any rank has this step."""
        if not self.world.distributed:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world.group)
        return int(t.item())

    def _stats(self, agg, failed: bool) -> bool:
        """Sum the private counts over the ranks (the clipped sums are reduce-scattered already)."""
        if not self.world.distributed:
            return failed
        import torch.distributed as dist

        self.scatter.finish(agg)  # a replicated sum (DP-SFT's coordinates): all-reduced here
        s = torch.tensor([agg.loss_sum, float(agg.batch_size), float(agg.clipped), float(agg.overflowed),
                          float(failed)], dtype=torch.float64)
        dist.all_reduce(s, group=self.world.group)
        agg.loss_sum, agg.batch_size, agg.clipped, agg.overflowed = float(s[0]), int(s[1]), int(s[2]), int(s[3])
        return bool(s[4] > 0)

    def run(self, step: int, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> StepOutput:
        from dpft.step.aggregate import Aggregator
        from dpft.step.clip import NonFiniteGradientError

        sp = self.spec
        t0 = time.perf_counter()
        sp.engine.clip = sp.clip
        mine = list(micro_batches)  # token ids only: small
        total = self._count(len(mine))
        agg = Aggregator({n: local(p) for n, p in sp.engine.params.items()}, keep_norms=sp.keep_norms)
        if total and not getattr(sp.engine, "_checked", True):
            # The engine's one-time usage probe runs a partial backward (FSDP all-gathers) whose
            # collectives depend on the batch: every rank probes the same placeholder batch.
            from dpft.grads.bookkeeping import _rng_devices

            self._reshard()  # no unit may hold a gathered copy older than its shards (a resume's load)
            with torch.random.fork_rng(devices=_rng_devices(sp.engine.params.values())):
                # a placeholder with clipping groups (user level, DPO pairs) is probed as the step clips it
                sp.engine.check_usage(*split_groups(self.dummy_batch()))
            # The probe's layout check may backpropagate with the weights requiring grad (FSDP then
            # reduce-scatters that non-private gradient into .grad): dropped, never used.
            for p in _trained(sp.engine).values():
                p.grad = None
        failure: Optional[Exception] = None
        for i in range(total):
            dummy = failure is not None or i >= len(mine)
            batch = self.dummy_batch() if i >= len(mine) else mine[i]
            self.scatter.start(dummy)
            try:
                self._reshard()
                res = sp.engine.clipped_sum(batch)
                if not dummy:
                    agg.add(res)
                else:  # this rank sent zeros, but its shard of the sum holds the other ranks' examples
                    for n, buf in agg.sum.items():
                        buf.add_(res.grad_sum[n])
            except NonFiniteGradientError as exc:
                if not self.world.distributed:
                    raise
                failure = exc
                self.scatter.finish_with_zeros()
            self._check_no_fsdp_grads()
        if self._stats(agg, failure is not None):
            raise failure or NonFiniteGradientError(
                "non-finite training loss on another rank; lower optimizer.lr or check the data")
        return self.release_and_update(step, agg, t0)

    def _reshard(self) -> None:
        """Reshard every FSDP unit before a pass: a unit still gathered from the last one (the root
        keeps its parameters after forward) would keep that pass's ``requires_grad`` flags, since
        FSDP2 copies the flags at all-gather only; autograd would then compute (and FSDP
        reduce-scatter) unclipped gradients of its parameters."""
        reshard_all(self.spec.engine.model)

    def _check_no_fsdp_grads(self) -> None:
        """No gradient reached a parameter behind the engine's back (FSDP would reduce-scatter it
        unclipped)."""
        bad = [n for n, p in _trained(self.spec.engine).items() if p.grad is not None]
        if bad:
            raise FSDPError(f"FSDP step: parameters {bad[:3]} received an (unclipped) gradient from autograd; "
                            "the engine must switch requires_grad off for its pass")


def _trained(eng) -> Mapping[str, torch.Tensor]:
    """The model parameters the engine's pass must leave without ``.grad`` (DP-SFT: the spanned ones)."""
    return getattr(eng, "model_params", eng.params)
