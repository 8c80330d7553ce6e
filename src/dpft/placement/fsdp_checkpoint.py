"""Checkpoints of a sharded run (``perf.sharding: fsdp``, dpft/placement/fsdp.py): save and ``--resume``.

**Per-rank checkpoints through** ``torch.distributed.checkpoint`` **(DCP)**, so that no rank ever holds
the full model or optimizer state (issue 38 item 3):

- ``run_dir/checkpoint_shards/step-N-<tag>/`` — the trainable weights (the sharded ``DTensor`` parameters
  themselves: each rank writes its shard) and the optimizer state keyed by parameter name
  (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, sharded). Model and optimizer
  state are post-processing of the noisy releases (DESIGN.md "The release set"); ``checkpoint/``
  (written by rank 0 with the driver's writer, handed in) holds the step, ledger, scheduler and
  released history, and its ``state.json`` names the shard folder (``sharded_checkpoint``). Its
  ``trainable.safetensors`` is empty: the weights are in the shard folder (:func:`read_trainable`
  reads them in one process).
- ``run_dir/noise_state.secret.dcp/step-N-<tag>/`` — banded MF's b − 1 noise buffers, each rank writing the
  slice of its own shards (``DTensor``\\ s of the parameters' layout). **Secret**: the folder is mode
  0700 from creation and every file in it 0600; it is outside ``checkpoint/`` and outside the release
  set. The small rest of the secret state (next step, coefficients, the secret partition, the rows'
  fingerprint) is ``noise_state.secret.pt`` (0600, rank 0), as in one process, naming the folder.

Crash safety: the shard folders of step N are complete before rank 0 swaps ``checkpoint/`` in
(atomically) and writes the noise state; the folders of earlier steps are removed only after that,
so a crash leaves the previous checkpoint whole. Every rank writes its files under its own
``run_dir``, so the ranks' files meet in one folder on a shared file system (one host, or a cluster's
shared storage). **Resuming** needs every rank to see every rank's files (DCP spreads the replicated
items — optimizer step counts, hyperparameters — over the ranks' files, and reshards by reading any
rank's chunks): on hosts without a shared file system, copy each rank's ``checkpoint_shards/`` and
``noise_state.secret.dcp/`` into the others' first; a rank that cannot see a file is refused (every
rank, before any read) with that fix. **Resuming on another number of ranks** works: DCP reshards
(each rank reads the parts of the saved chunks its new shard covers), and the noise layout and the
world's Poisson batch do not depend on the number of ranks.

Old checkpoints (full tensors gathered through rank 0 into ``trainable.safetensors``, written before
this format) are still read: each rank copies its dim-0 slice; their banded buffers are the gathered
ones of ``noise_state.secret.pt``.

Source: DESIGN.md "Distributed", "The release set"; issue 38; PyTorch ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dpft.placement import world as ddp
from dpft.placement.fsdp import FSDPError, is_sharded, local, local_range
from dpft.step.correlated import (NOISE_STATE_FILE, BandedMFMechanism, check_state_step, in_secret_format,
                                  write_secret)
from dpft.step.guard import restoring_optimizer_state

__all__ = ["SHARDS_DIR", "SECRET_SHARDS_DIR", "save_checkpoint", "load_checkpoint", "read_trainable"]

#: Per-rank model + optimizer shards (DCP), one folder per checkpoint step; releasable.
SHARDS_DIR = "checkpoint_shards"
#: Per-rank banded-MF noise buffers (DCP), one folder per checkpoint step; secret (0700 / 0600).
SECRET_SHARDS_DIR = "noise_state.secret.dcp"


def _step_name(world, step: int) -> str:
    """``step-N-<tag>``: the tag (rank 0's, the same on every rank) keeps a new save from ever
    writing into the folder the current checkpoint names, even for the same step."""
    tag = ddp.broadcast_object(world, os.urandom(4).hex() if world.is_main else None)
    return f"step-{int(step):08d}-{tag}"


def _fresh_dir(world, d: Path, secret: bool) -> None:
    """Rank 0 makes ``d`` empty (a crashed save of the same step may have left files); then every
    rank makes sure it exists under its own run folder (hosts without a shared file system). A
    secret folder and its parent are 0700 from creation (``mkdir(mode=0o700)``, then ``chmod``
    against the umask), before any file is in it."""
    def make() -> None:
        d.parent.parent.mkdir(parents=True, exist_ok=True)  # a rank other than 0 may have no run folder yet
        for p in (d.parent, d):
            if not p.is_dir():
                p.mkdir(mode=0o700 if secret else 0o777, exist_ok=True)
            if secret:
                os.chmod(p, 0o700)

    if world.is_main:
        if d.exists():
            shutil.rmtree(d)
        make()
    ddp.barrier(world)
    make()


def _owner_only(d: Path) -> None:
    """Every file under ``d`` mode 0600 (DCP creates them with the umask's mode; the folder is 0700)."""
    for f in d.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o600)


#: DCP warns that a one-process save/load assumes one process: that is what ``no_dist`` asks for.
_ONE_PROCESS = ".*assuming the intent is to (save|load) in a single process"


def _dcp_save(world, state: dict, d: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        dcp.save(state, checkpoint_id=str(d), no_dist=not world.distributed)


def _missing_file(d: Path) -> str | None:
    """The first file of the DCP checkpoint ``d`` (its ``.metadata`` or a shard file it names) that
    this rank cannot see, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (d / ".metadata").is_file():
        return ".metadata"
    storage = FileSystemReader(str(d)).read_metadata().storage_data or {}
    lost = sorted({str(v.relative_path) for v in storage.values()} - {f.name for f in d.iterdir()})
    return lost[0] if lost else None


def _dcp_load(world, state: dict, d: Path, what: str) -> None:
    """``dcp.load`` of ``state`` from ``d`` on every rank; refused on every rank (before the
    collective) when a rank cannot see all the files — DCP reads any rank's file on any rank (the
    replicated items are spread over the ranks' files), so the ranks need one shared folder."""
    import torch.distributed.checkpoint as dcp

    lost = _missing_file(d)
    if ddp.any_rank(world, lost is not None):
        who = f"rank {world.rank} cannot see {lost}" if lost else "another rank cannot see one of its files"
        raise FSDPError(f"--resume: {d} ({what}): {who}; every rank must see every rank's checkpoint files: put "
                        "the run folder on a file system the ranks share"
                        f", or copy each rank's {d.parent.name}/ folder into the others' before "
                        "resuming (or start a new --output-dir)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        dcp.load(state, checkpoint_id=str(d), no_dist=not world.distributed)


def _optim_owner(trainer) -> torch.nn.Module:
    """The module whose parameter names key the optimizer state: the model, or — when the optimizer steps
    tensors that are no model parameter (DP-SFT ``optimizer_space: coords``: the k coordinates, whole on
    every rank) — a holder of ``trainer.params`` under their names."""
    owned = {id(p) for p in trainer.model.parameters()}
    if all(id(p) in owned for g in trainer.optimizer.param_groups for p in g["params"]):
        return trainer.model
    holder = torch.nn.Module()
    for name, p in trainer.params.items():
        *path, leaf = name.split(".")
        m = holder
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, p)
    return holder


def _optim_state(trainer) -> dict:
    """The optimizer state keyed by parameter name (this rank's ``DTensor`` shards under FSDP2;
    plain tensors in one process), as DCP saves and loads it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(_optim_owner(trainer), trainer.optimizer)


def _buffer_tensors(mech, params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Banded MF's buffers as tensors of the parameters' layout: this rank's slice of buffer j of
    ``name`` as a ``DTensor`` sharded as the parameter (a plain tensor when it is not sharded)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for j, buf in enumerate(mech.buffers):
        out[str(j)] = {}
        for n, t in buf.items():
            p = params[n]
            t = t.detach().float().reshape(local(p).shape)
            out[str(j)][n] = (DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                 stride=p.stride()) if is_sharded(p) else t)
    return out


def _empty_buffers(count: int, params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Destination tensors for :func:`_buffer_tensors` (fp32, this rank's layout)."""
    from torch.distributed.tensor import DTensor

    def like(p):
        z = torch.zeros(local(p).shape, dtype=torch.float32, device=local(p).device)
        return (DTensor.from_local(z, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride()) if is_sharded(p) else z)

    return {str(j): {n: like(p) for n, p in params.items()} for j in range(count)}


def save_checkpoint(trainer, step: int, write: Callable[..., Any]) -> None:
    """The checkpoint of a sharded run (module docstring): every rank writes its shards of the
    trainable weights and optimizer state (and banded MF's buffers, secret) through DCP; rank 0
    then writes ``checkpoint/`` with ``write`` (the driver's ``run/checkpoint.save_checkpoint``,
    handed in: placement never imports the driver) and the small secret noise state. A collective:
    every rank calls it.

    Raises:
        ValueError: banded MF's buffers at another step than the checkpoint (step/correlated.py
            ``check_state_step``, the session's ``secret_state(at=)`` check)."""
    world, mech = trainer.world, trainer.mechanism
    banded = isinstance(mech, BandedMFMechanism)
    check_state_step(mech, step)  # the one check every way in's save makes
    run, name = Path(trainer.run_dir), _step_name(world, step)
    shards = run / SHARDS_DIR / name
    _fresh_dir(world, shards, secret=False)
    _dcp_save(world, {"model": {n: p.detach() for n, p in trainer.params.items()},
                      "optim": _optim_state(trainer)}, shards)
    small = None
    if banded:  # secret: per-rank buffer slices in a 0700 folder, files 0600, outside the release set
        secret = run / SECRET_SHARDS_DIR / name
        _fresh_dir(world, secret, secret=True)
        _dcp_save(world, {"buffers": _buffer_tensors(mech, trainer.params)}, secret)
        _owner_only(secret)
        # next step, coefficients, partition, rows' fingerprint, in the one versioned secret-state format
        small = in_secret_format(BandedMFMechanism.state(mech))
        small.update(buffers=[], buffers_dcp=f"{SECRET_SHARDS_DIR}/{name}", buffers_count=len(mech.buffers))
    ddp.barrier(world)  # every rank's files are written before the checkpoint names them
    trainer._last_checkpoint = step
    if world.is_main:
        class _Sharded:  # the optimizer state is in the shard folder
            def state_dict(self):
                return {}

        write(run, step=step, params={}, optimizer=_Sharded(), scheduler=trainer.scheduler,
              ledger_json=trainer.ledger.to_json(),
              state={**trainer._state(), "sharded_checkpoint": f"{SHARDS_DIR}/{name}"})
        if small is not None:
            write_secret(run / NOISE_STATE_FILE, small)
    ddp.barrier(world)
    for top in (SHARDS_DIR, SECRET_SHARDS_DIR):  # earlier steps' folders, now unreferenced
        for old in (run / top).glob("step-*") if (run / top).is_dir() else []:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(trainer, ck: Mapping[str, Any]) -> None:
    """Resume a sharded run from ``ck`` (the driver's ``run/checkpoint.load_checkpoint``, read by
    rank 0 and broadcast): a DCP checkpoint (``state.json`` names ``sharded_checkpoint``) is loaded
    by every rank from the shard folder into its own shards, for any number of ranks; banded MF's
    buffers are loaded likewise from the secret folder and handed to the session's
    ``restore_secret_state`` (session/core.py) as this rank's slices (``local_buffers``). An old checkpoint (gathered
    ``trainable.safetensors``) is sliced per rank. A collective: every rank calls it.

    Raises:
        FSDPError: a parameter missing from the checkpoint or of another shape; a shard folder
            missing on a rank (naming the fix)."""
    st = ck["state"]
    if not st.get("sharded_checkpoint"):
        return _load_gathered(trainer, ck)
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    world, run = trainer.world, Path(trainer.run_dir)
    state = {"model": {n: p.detach() for n, p in trainer.params.items()}, "optim": _optim_state(trainer)}
    with torch.no_grad():  # DCP copies into the destinations: the parameters' own shards
        _dcp_load(world, state, run / st["sharded_checkpoint"], "the trainable weights and optimizer state")
    with restoring_optimizer_state(trainer.optimizer):  # torch's state initialisation: a step at lr 0
        set_optimizer_state_dict(_optim_owner(trainer), trainer.optimizer, optim_state_dict=state["optim"])
    noise = ck.get("noise_state")
    if noise is not None and noise.get("buffers_dcp"):
        bufs = {"buffers": _empty_buffers(int(noise["buffers_count"]), trainer.params)}
        _dcp_load(world, bufs, run / noise["buffers_dcp"], "the secret banded-MF noise buffers")
        noise["buffers"] = [{n: local(t).clone() for n, t in bufs["buffers"][str(j)].items()}
                            for j in range(int(noise["buffers_count"]))]
        noise["local_buffers"] = True


def _load_gathered(trainer, ck: Mapping[str, Any]) -> None:
    """An old-format checkpoint: full tensors; each rank copies its dim-0 slice and sets its
    optimizer shards from the full, name-keyed state."""
    w = trainer.world
    missing = set(trainer.params) - set(ck["params"])
    if missing:
        raise FSDPError(f"--resume: checkpoint lacks parameters {sorted(missing)[:3]}…")
    with torch.no_grad():
        for n, p in trainer.params.items():
            full = ck["params"][n]
            if tuple(full.shape) != tuple(p.shape):
                raise FSDPError(f"--resume: checkpoint tensor {n} has shape {tuple(full.shape)}, the parameter "
                                f"{tuple(p.shape)}")
            off, cnt = local_range(p, w.rank, w.world_size)
            loc = local(p)
            loc.copy_(full.reshape(-1)[off:off + cnt].reshape(loc.shape).to(loc.device, loc.dtype))
    if any(is_sharded(p) for p in trainer.params.values()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        with restoring_optimizer_state(trainer.optimizer):  # torch's state initialisation: a step at lr 0
            set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=ck["optim"]["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
    else:  # one process: the optimizer's own state dict
        trainer.optimizer.load_state_dict(ck["optim"]["optimizer"])


def read_trainable(run_dir, *rank_dirs) -> dict[str, torch.Tensor]:
    """The trainable weights of ``run_dir``'s checkpoint as full tensors, in one process with no
    process group (for inspection and tests): from the DCP shard folder or an old-format
    ``trainable.safetensors``. ``rank_dirs``: the run folders of the other ranks when they wrote
    on their own file systems (their shard files are read from there). Name → tensor (CPU).

    Raises:
        FileNotFoundError: no checkpoint, or a rank's shard file in none of the folders."""
    import json
    import tempfile

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    ck = Path(run_dir) / "checkpoint"
    st = json.loads((ck / "state.json").read_text())
    if not st.get("sharded_checkpoint"):
        return load_file(str(ck / "trainable.safetensors"))
    rel = st["sharded_checkpoint"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)  # every rank's files side by side (links), as on a shared file system
        for d in (Path(run_dir), *map(Path, rank_dirs)):
            for f in (d / rel).iterdir() if (d / rel).is_dir() else []:
                if not (folder / f.name).exists():
                    (folder / f.name).symlink_to(f.resolve())
        meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        out = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
               for k, m in meta.items() if k.startswith("model.") and hasattr(m, "size")}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ONE_PROCESS)
            dcp.load({"model": out}, checkpoint_id=str(folder), no_dist=True)
    return out
