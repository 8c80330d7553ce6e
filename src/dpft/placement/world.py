"""Multi-process data parallel training on ``torch.distributed`` (launched with ``torchrun``).

What the world of K processes computes is *one* DP-SGD run, the same mechanism as one process:

- **One Poisson logical batch for the world.** Every rank holds the same secret
  :class:`~dpft.privacy.randomness.Randomness`: rank 0 draws the 256-bit key from the OS CSPRNG
  and broadcasts it (:func:`shared_randomness`; in reproducible mode every rank derives it from
  the recorded seed). Every rank therefore draws the same membership of step t's logical batch
  from stream ``sample``, t, sorts it by length and keeps every K-th example from its rank on
  (:func:`shard`): the shares are disjoint and cover the logical batch, and each rank splits its
  share into physical micro-batches.
- **Clipped sums all-reduced once per logical step.** Per-example clipping happens on each rank
  before any communication; ``DPStep.run`` calls :meth:`~dpft.step.aggregate.Aggregator.all_reduce`
  once per logical step (no per-micro-batch or per-backward all-reduce: that is why dpft does not
  wrap the model in ``torch.nn.parallel.DistributedDataParallel``, whose gradient buckets reduce
  the *unclipped* batch gradient of every backward).
- **Noise added once for the world.** After the all-reduce every rank holds the same clipped sum
  S = Σᵢ cᵢgᵢ over the whole logical batch, and every rank draws the *same* noise vector z from
  the shared key's streams ``noise``, (t, tensor name) — the streams depend on the device type,
  not its index, so ``cuda:r`` on rank r draws what ``cuda:0`` draws on rank 0. Each rank computes S + σC·z, one and the same value: the
  world releases one draw of the Gaussian mechanism N(S, σ²C²I), exactly what one process
  releases, so the ledger records one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` per step.
  (Independent noise on each rank, summed, would be a different mechanism; rank 0 adding the
  noise and broadcasting S + σCz would release the same value at the cost of a second
  gradient-sized collective per step.) All ranks then apply the same update, so their weights
  stay equal without a parameter broadcast; :func:`check_step_digest` verifies at every logical
  step that the ranks cut their shares from the same logical batch in the same order and hold
  the same weights after the noisy update (else the run stops before the step is released), and
  :func:`check_in_sync` checks the weights again at every checkpoint (gloo and NCCL all-reduce
  give every rank the same bits).
- **Rank 0 writes, and only rank 0 reads the run directory.** Ledger, checkpoints, metrics,
  report and model are written by rank 0; a checkpoint (and the live ledger) is read by rank 0
  and broadcast, so the run directory need not be on a file system the other ranks see.
  Decisions that depend on files (``--resume`` checks, an earlier attempt's ledger) are taken
  on rank 0 and sent to every rank (:func:`on_rank0`), so every rank raises the same error.
- **Evaluation is sharded:** each rank evaluates every K-th dev example and the sums (loss,
  correct, count) are all-reduced (:func:`all_sum`), so every rank returns the same metrics.
- **Dropout masks** come from the secret seed ``dropout``, (t, rank): secret, different on
  each rank and each step (not a mechanism, so a plain ``seed_for`` seed; every mechanism's
  draw uses ``Randomness.stream``, ≥ 128 bits per draw).

Backends: ``gloo`` on CPU; on a machine with CUDA the group is created as
``cpu:gloo,cuda:nccl``, so collectives on CUDA tensors use NCCL and those on CPU tensors gloo.

The process group is created from the environment ``torchrun`` (and ``accelerate launch``)
set: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. Without them,
or with ``WORLD_SIZE=1``, nothing here does anything and a run is the single process it always
was. A process group the caller created already is used as it is.

Source: DESIGN.md "Distributed"; Abadi et al. 2016 (DP-SGD); issue 16.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch

from dpft.privacy.randomness import Randomness

__all__ = ["World", "DistributedError", "init_from_env", "shared_randomness", "check_same_randomness", "shard", "on_rank0", "all_sum", "all_max",
           "any_rank", "broadcast_object", "broadcast_module", "check_in_sync", "check_step_digest", "check_methods", "barrier",
           "shard_units", "refuse_ddp_wrapper", "refuse_sharded_model", "SHARDED_FIX"]

T = TypeVar("T")

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: World sizes MPI launchers (Open MPI, MPICH/Intel MPI, MVAPICH) set instead of WORLD_SIZE.
_MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


class DistributedError(ValueError):
    """A multi-process launch or configuration that cannot run; the message names the fix."""


@dataclass(frozen=True)
class World:
    """This process's place in the world.

    Attributes:
        rank: global rank (0 … world_size − 1); rank 0 writes the run directory.
        world_size: number of processes K sharing each logical batch.
        local_rank: rank on this machine (the CUDA device index under torchrun).
        group: ``torch.distributed`` group (None = the default group).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Optional[Any] = None

    @property
    def distributed(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only writer of the run directory."""
        return self.rank == 0


_OWNED = False  # whether this module created the default process group (then it destroys it)


def _destroy() -> None:
    import torch.distributed as dist

    global _OWNED
    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED = False


def init_from_env() -> World:
    """The world of this process, creating the default process group from ``torchrun``'s
    environment when needed.

    Returns:
        ``World()`` (rank 0 of 1) when ``WORLD_SIZE`` is unset or 1 and no group exists.

    Raises:
        DistributedError: ``WORLD_SIZE`` > 1 but another launch variable is missing, this
            torch has no ``torch.distributed``, or ``LOCAL_RANK`` names no GPU while CUDA is
            used.
    """
    global _OWNED
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    try:
        ws = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; launch with "
                               "torchrun --nproc_per_node=K -m dpft train RECIPE") from None
    if ws <= 1:
        mpi = {k: os.environ[k] for k in _MPI_SIZE if os.environ.get(k, "1").strip() not in ("", "0", "1")}
        if "WORLD_SIZE" not in os.environ and mpi:
            # K copies of a single-process run would each draw their own secret key and write the
            # same run directory: refuse rather than train K unrelated models.
            raise DistributedError(
                f"this process was started by an MPI launcher ({', '.join(f'{k}={v}' for k, v in mpi.items())}; "
                "e.g. accelerate launch --cpu with an mpirun hostfile) but dpft joins a world only through "
                "torchrun's variables (RANK, WORLD_SIZE, …); launch with torchrun --nproc_per_node=K -m dpft train "
                "RECIPE (or accelerate launch --multi_gpu --num_processes K, which runs torchrun, also on CPU)")
        return World()
    missing = [k for k in _ENV if not os.environ.get(k)]
    if missing:
        raise DistributedError(f"WORLD_SIZE={ws} but {', '.join(missing)} not set; launch with torchrun "
                               "--nproc_per_node=K -m dpft train RECIPE (it sets RANK, LOCAL_RANK, MASTER_ADDR, "
                               "MASTER_PORT), or unset WORLD_SIZE for one process")
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed; run one process (unset WORLD_SIZE)")
    local = int(os.environ["LOCAL_RANK"])
    backend = "gloo"
    if torch.cuda.is_available():
        n_gpu = torch.cuda.device_count()
        if local < n_gpu:
            torch.cuda.set_device(local)
            # CUDA tensors reduce over NCCL, CPU tensors (and object collectives) over gloo.
            backend = "cpu:gloo,cuda:nccl"
        else:
            warnings.warn(f"LOCAL_RANK {local} but only {n_gpu} GPU(s): this process group is gloo only, so the "
                          "run must stay on CPU; use --nproc_per_node ≤ the number of GPUs to train on them",
                          stacklevel=2)
    dist.init_process_group(backend=backend)
    _OWNED = True
    atexit.register(_destroy)
    return World(dist.get_rank(), dist.get_world_size(), local)


def _host(world: World) -> torch.device:
    """Where small collective tensors go: CPU (gloo), except in an NCCL-only group the caller
    created (``init_process_group("nccl")``), which reduces CUDA tensors only."""
    import torch.distributed as dist

    if dist.get_backend(world.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Destroy the process group if :func:`init_from_env` created it (no-op otherwise)."""
    _destroy()


# -- randomness ------------------------------------------------------------------------------
def shared_randomness(world: World, seed: Optional[int]) -> Randomness:
    """The run's secret randomness, identical on every rank.

    Args:
        seed: None = secure: rank 0 draws a 256-bit key from the OS CSPRNG and broadcasts it
            (it travels only over the process group, never to a file); an int = reproducible:
            every rank derives the key from the recorded seed.
    """
    if seed is not None or not world.distributed:
        return Randomness(seed)
    import torch.distributed as dist

    key = Randomness().key_tensor() if world.is_main else torch.zeros(32, dtype=torch.uint8)
    key = key.to(_host(world))
    dist.broadcast(key, src=0, group=world.group)
    return Randomness.from_key(bytes(key.cpu().tolist()))


def dropout_seed(rng: Randomness, step: int, world: World) -> int:
    """Seed of step ``step``'s dropout masks: secret stream ``dropout``, per step and, under
    DDP, per rank (one process keeps the single-process stream ``dropout``, t)."""
    return rng.seed_for("dropout", step, world.rank) if world.distributed else rng.seed_for("dropout", step)


def check_same_randomness(world: World, rng: Randomness) -> None:
    """Raise on every rank unless all ranks hold the same secret key.

    Compares the output of a stream no mechanism uses (``ddp-same-key``): a keyed-hash value
    that tells nothing about any other stream. Catches a caller that made a ``Randomness`` on
    each rank (K secret keys = K different logical batches per step, which the ledger would
    not describe).

    Raises:
        DistributedError: the keys differ; make the source with :func:`shared_randomness`.
    """
    if not world.distributed:
        return
    import torch.distributed as dist

    v = torch.tensor([rng.seed_for("ddp-same-key")], dtype=torch.int64, device=_host(world))
    lo, hi = v.clone(), v.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=world.group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=world.group)
    if not torch.equal(lo, hi):
        raise DistributedError("the ranks hold different secret randomness (each made its own Randomness), so "
                               "they would draw different logical batches; create it with "
                               "dpft.placement.world.shared_randomness (rank 0 draws the key and broadcasts it)")


# -- data ------------------------------------------------------------------------------------
def shard(indices: torch.Tensor, world: World) -> torch.Tensor:
    """This rank's share of a logical batch: every K-th index from position ``rank`` on.

    ``indices`` must be in the same order on every rank (dpft sorts the logical batch by
    length first, so the shares get similar lengths); the K shares are disjoint and cover it.
    """
    if not world.distributed:
        return indices
    return indices[world.rank::world.world_size]


def shard_units(indices: torch.Tensor, units: torch.Tensor, world: World) -> torch.Tensor:
    """This rank's share of a logical batch whose rows come grouped by privacy unit (user level):
    every K-th *unit*, with all its rows, from position ``rank`` on (:func:`shard` over the
    units in the order they appear).

    A user's rows must stay on one rank: their summed gradient is clipped as one (grads/groups.py),
    so split across ranks each part would be clipped to C on its own (sensitivity up to K·C).

    Args:
        indices: ``(B,)`` row indices, the same order on every rank, each unit's rows contiguous.
        units: ``(B,)`` the unit (user) of each row of ``indices``.

    Raises:
        ValueError: a unit's rows are not contiguous in ``indices``.
    """
    if not world.distributed or not len(indices):
        return indices
    units = torch.as_tensor(units).to(indices.device)
    order = torch.unique_consecutive(units)
    if len(order) != len(torch.unique(units)):
        raise ValueError("shard_units: the rows of a unit must be contiguous in the logical batch (group them by unit)")
    mine = shard(order, world)
    return indices[torch.isin(units, mine)]


def refuse_ddp_wrapper(module: torch.nn.Module, where: str) -> None:
    """Refuse a model wrapped in ``torch.nn.parallel.DistributedDataParallel``.

    DDP's gradient buckets all-reduce the *unclipped* batch gradient at every backward; dpft
    clips each example (user) on its rank and all-reduces the clipped sums once per logical step
    (:meth:`~dpft.step.aggregate.Aggregator.all_reduce`), so the wrapper must go. An FSDP1 wrapper
    is refused too; an FSDP2 (``fully_shard``) model is let through: make_private runs it with
    the sharded step (api/sharded.py).

    Raises:
        DistributedError: naming the fix (pass ``model.module``, the unwrapped model).
    """
    from torch.nn.parallel import DistributedDataParallel

    refuse_sharded_model(module, where, allow_fsdp2=True)  # FSDP2: make_private's sharded step (api/sharded.py)
    if isinstance(module, DistributedDataParallel):
        raise DistributedError(
            f"{where}: the model is wrapped in DistributedDataParallel, whose gradient buckets all-reduce the "
            "unclipped gradient of every backward; pass the unwrapped model (model.module): dpft clips each "
            "example on its rank and all-reduces the clipped sums itself, once per logical step")


#: The fix named when a sharded model reaches a way in that does not shard.
SHARDED_FIX = ("shard the model yourself with FSDP2 (torch.distributed.fsdp.fully_shard on its blocks, then on the "
               "root) before make_private / DPTrainer (dpft's sharded step), or use `dpft train` with "
               "perf.sharding: fsdp, or DDP here: the unwrapped, unsharded model under torchrun / accelerate launch")


def refuse_sharded_model(module: Any, where: str, allow_fsdp2: bool = False) -> None:
    """Refuse a model sharded by FSDP2 (``fully_shard``: a ``torch.distributed.fsdp.FSDPModule``,
    on the model or any submodule) or FSDP1 (``FullyShardedDataParallel``).

    A sharded model holds 1/K of each parameter per rank, reduce-scatters the *unclipped*
    gradient in its backward hooks and gathers the weights around each forward; make_private's and
    DPTrainer's per-example engines read whole parameters and whole per-example gradients, and
    all-reduce clipped sums themselves. dpft's sharded DP step (src/dpft/placement/fsdp.py: clipped sums
    reduce-scattered, noise drawn per shard) runs in ``dpft train`` (``perf.sharding: fsdp``) and in
    ``make_private`` (``allow_fsdp2``: FSDP2 let through). ``module`` that is not an ``nn.Module``
    (a model name) is let through.

    Raises:
        DistributedError: naming the fix (:data:`SHARDED_FIX`).
    """
    if not isinstance(module, torch.nn.Module):
        return
    kinds = []
    try:
        from torch.distributed.fsdp import FSDPModule
        if not allow_fsdp2:
            kinds.append((FSDPModule, "FSDP2 (fully_shard)"))
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds.append((FullyShardedDataParallel, "FSDP1 (FullyShardedDataParallel)"))
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    for name, m in module.named_modules():
        for cls, what in kinds:
            if isinstance(m, cls):
                raise DistributedError(
                    f"{where}: the model is sharded by {what} ({name or 'the model itself'}), whose hooks "
                    "reduce-scatter the unclipped gradient and hold 1/K of each parameter per rank; the per-example "
                    f"engine here needs whole parameters. {SHARDED_FIX[0].upper()}{SHARDED_FIX[1:]}")


# -- collectives -----------------------------------------------------------------------------
def broadcast_object(world: World, obj: T) -> T:
    """Rank 0's ``obj`` on every rank (pickled over the group; a no-op alone)."""
    if not world.distributed:
        return obj
    import torch.distributed as dist

    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0, group=world.group)
    return box[0]


def on_rank0(world: World, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and return its result on every rank; an exception raised by
    ``fn`` on rank 0 is raised on every rank (so all stop with the same message instead of
    the others waiting at the next collective). Used for everything that reads the run
    directory."""
    if not world.distributed:
        return fn()
    out: tuple[bool, Any] = (True, None)
    if world.is_main:
        try:
            out = (True, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            out = (False, exc)
    try:
        ok, val = broadcast_object(world, out)
    except Exception:  # an exception that cannot be pickled: send its text
        ok, val = broadcast_object(world, (out[0], out[1] if out[0] else RuntimeError(str(out[1]))))
    if not ok:
        if world.is_main:
            raise out[1]
        raise val
    return val


def all_sum(world: World, values: Iterable[float]) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64; a no-op alone)."""
    vals = [float(v) for v in values]
    if not world.distributed:
        return vals
    import torch.distributed as dist

    t = torch.tensor(vals, dtype=torch.float64, device=_host(world))
    dist.all_reduce(t, group=world.group)
    return [float(x) for x in t.cpu()]


def all_max(world: World, value: int) -> int:
    """The largest ``value`` (an integer) over all ranks (a no-op alone)."""
    if not world.distributed:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=_host(world))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.group)
    return int(t.item())


def any_rank(world: World, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (a no-op alone)."""
    return all_max(world, 1 if flag else 0) > 0


def barrier(world: World) -> None:
    """Wait for every rank (a no-op alone)."""
    if world.distributed:
        import torch.distributed as dist

        dist.barrier(group=world.group)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.data for p in module.parameters()] + [b for b in module.buffers()]


def broadcast_module(world: World, module: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``module`` (in place), so the
    world starts from one set of weights whatever each rank's initialisation drew."""
    if not world.distributed:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for t in _tensors(module):
            dist.broadcast(t, src=0, group=world.group)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksums(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Two int64 sums per tensor of the raw bit patterns (all elements; every 7th), computed
    where the tensor lives: any single changed bit changes them, with no host copy."""
    out = []
    for n in sorted(params):
        bits = params[n].detach().contiguous().view(_BITS[params[n].element_size()]).flatten()
        out += [bits.sum(dtype=torch.int64), bits[::7].sum(dtype=torch.int64)]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def check_in_sync(world: World, params: dict[str, torch.Tensor]) -> bool:
    """Whether every rank holds bit-identical ``params``; if not, rank 0's are broadcast (its
    weights are the ones checkpointed and released) and a warning says so. Called at each
    checkpoint: identical all-reduce results and identical noise keep the ranks equal, this
    makes sure of it."""
    if not world.distributed:
        return True
    import torch.distributed as dist

    d = _checksums(params).to(_host(world))
    lo, hi = d.clone(), d.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=world.group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=world.group)
    if torch.equal(lo, hi):
        return True
    if world.is_main:
        warnings.warn("DDP ranks' weights differed at a checkpoint; rank 0's were broadcast to all", stacklevel=2)
    with torch.no_grad():
        for n in sorted(params):
            dist.broadcast(params[n].data, src=0, group=world.group)
    return False


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def step_digest(step: int, indices: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(3,)`` int64 digest of logical step ``step`` on this rank: the step, a SHA-256 of the
    world's logical batch in the order it is sharded (its row indices; what each rank's share
    is cut from), and a SHA-256 of the bit-pattern checksums of the weights after the update
    (which hold this step's noise: a rank that drew other noise, or summed other clipped
    gradients, holds other weights)."""
    idx = indices.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    w = _checksums(params).cpu().contiguous().numpy().tobytes()
    return torch.tensor([int(step), _digest64(idx), _digest64(w)], dtype=torch.int64)


def check_step_digest(world: World, step: int, indices: torch.Tensor, params: dict[str, torch.Tensor]) -> None:
    """Stop the run when the ranks disagree on step ``step``'s logical batch or noisy update.

    Called at every logical step after the update and before anything of the step is written
    (metrics, checkpoint, report): the digests of :func:`step_digest` are all-gathered and every
    rank compares them with rank 0's, so every rank raises the same error. A rank that
    tokenised or sorted its data differently cuts its share from another order (an example on
    two ranks: sensitivity 2C); a rank with another key draws other noise or another batch.
    A no-op in one process.

    Raises:
        DistributedError: naming the ranks whose batch order or weights differ from rank 0's.
    """
    if not world.distributed:
        return
    import torch.distributed as dist

    mine = step_digest(step, indices, params).to(_host(world))
    got = [torch.zeros_like(mine) for _ in range(world.world_size)]
    dist.all_gather(got, mine, group=world.group)
    got = [g.cpu() for g in got]
    batch = [r for r, g in enumerate(got) if int(g[1]) != int(got[0][1]) or int(g[0]) != int(got[0][0])]
    noise = [r for r, g in enumerate(got) if int(g[2]) != int(got[0][2])]
    if batch or noise:
        why = []
        if batch:
            why.append(f"ranks {batch} hold another logical batch (or order) than rank 0: each rank must "
                       "tokenise the same data with the same tokenizer and model.max_length")
        if noise:
            why.append(f"ranks {noise} hold other weights than rank 0 after the noisy update (other noise or "
                       "another clipped sum): every rank must share the run's key and start from the same weights")
        raise DistributedError(f"DDP step {step}: the ranks disagree; the run is stopped before this step is "
                               "released. " + "; ".join(why))


def recipe_digest(recipe_json: dict) -> str:
    """SHA-256 of a recipe's JSON (every rank must run the same recipe)."""
    return hashlib.sha256(json.dumps(recipe_json, sort_keys=True).encode()).hexdigest()


def check_same_recipe(world: World, recipe_json: dict) -> None:
    """Raise on every rank if any rank's recipe differs from rank 0's.

    Raises:
        DistributedError: the ranks were launched with different recipes or flags.
    """
    if not world.distributed:
        return
    mine = recipe_digest(recipe_json)
    ref = broadcast_object(world, mine)
    if any_rank(world, mine != ref):
        raise DistributedError("the ranks of this torchrun launch hold different recipes (flags, files or "
                               "environment differ between processes); launch every rank with the same command")


def check_methods(world: World, methods: list, keep_norms: bool = False,
                  registry: Optional[dict] = None) -> None:
    """Refuse what does not run correctly across ranks.

    A method runs under DDP when its class declares ``supports_ddp = True`` (methods/base.py:
    the method's promise that it draws per-example randomness per rank and reads only
    all-reduced statistics); an object without the attribute is looked up by its ``name`` in
    ``registry`` (name → method class: the caller's capability, e.g. ``methods.base.registered()``;
    placement never imports the method registry). The driver names no method.

    Raises:
        DistributedError: a method not declared correct across ranks (e.g. a forward-pass
            noise layer would add the *same* noise draw to examples on different ranks; a method
            with an earlier training phase runs that phase as a run of its own), or raw
            per-example norms (``keep_norms``, a NOT CERTIFIED paper reproduction) that would
            steer each rank's clip norm differently.
    """
    if not world.distributed:
        return
    reg = dict(registry or {})

    def declared(m) -> bool:
        if hasattr(m, "supports_ddp"):
            return bool(m.supports_ddp)
        cls = reg.get(getattr(m, "name", ""))
        return bool(getattr(cls, "supports_ddp", False))

    bad = [m for m in methods if not declared(m)]
    if bad:
        ok = sorted(n for n, cls in reg.items() if getattr(cls, "supports_ddp", False))
        # Each method's own reason, in terms of its mechanism (methods/base.py ``ddp_refusal``).
        why = [f"{m.name}: {r}" for m in bad
               for r in [getattr(m, "ddp_refusal", None) or getattr(reg.get(m.name), "ddp_refusal", None)] if r]
        raise DistributedError(
            f"method(s) {', '.join(m.name for m in bad)} are not supported with {world.world_size} processes "
            f"(supported: {', '.join(ok)}); run them in one process (without torchrun)"
            + ("".join(f". {w}" for w in why)))
    if keep_norms:
        raise DistributedError("the paper's percentile clipping (raw per-example norms, NOT CERTIFIED) cannot "
                               "run across processes; use the method's private adaptive clipping instead of its "
                               "reproduce_paper option, or run one process")
