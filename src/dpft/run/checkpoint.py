"""Checkpoints: trainable weights (safetensors), optimizer, scheduler, step and ledger.

A checkpoint is a folder written beside the live one and swapped in with ``os.replace``, so
a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from dpft.placement import world as ddp
from dpft.accounting.cap import ledger_resume_cap
from dpft.accounting.ledger import PrivacyLedger

CKPT = "checkpoint"


def save_checkpoint(run_dir: Path, *, step: int, params: dict[str, torch.Tensor], optimizer, scheduler,
                    ledger_json: dict, state: dict[str, Any]) -> Path:
    """Write ``run_dir/checkpoint`` atomically. ``state`` holds JSON-able loop state."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{CKPT}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in params.items()}, str(tmp / "trainable.safetensors"))
    # No RNG state: every draw comes from the run's secret randomness (privacy/randomness.py).
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
    (tmp / "ledger.json").write_text(json.dumps(ledger_json, indent=1))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = run_dir / CKPT
    old = run_dir / f".{CKPT}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    return final


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """Read ``run_dir/checkpoint``. Raises FileNotFoundError naming the folder if absent."""
    d = Path(run_dir) / CKPT
    if not (d / "state.json").is_file():
        old = Path(run_dir) / f".{CKPT}.old"
        if (old / "state.json").is_file():  # crash between the two renames
            d = old
        else:
            raise FileNotFoundError(f"no checkpoint in {run_dir}; run without --resume to start fresh")
    return {
        "params": load_file(str(d / "trainable.safetensors")),
        # map_location cpu: a GPU checkpoint resumes anywhere (load_state_dict moves state to the params).
        "optim": torch.load(d / "optim.pt", weights_only=True, map_location="cpu"),  # tensors and containers only
        "ledger": json.loads((d / "ledger.json").read_text()),
        "state": json.loads((d / "state.json").read_text()),
    }


def check_world_size(state: dict[str, Any], world_size: int, run_dir: Path) -> str | None:
    """Why a checkpoint cannot be resumed by ``world_size`` processes (None = it can).

    A checkpoint records the number of processes that wrote it (``world_size``; absent in
    checkpoints written before DDP = 1). A resumed run must have as many: each rank's share of
    a logical batch, its dropout stream and the order of the all-reduced sums depend on it, so
    only the same world replays a reproducible run's steps as they were. (FSDP2 runs are not
    checked here: their per-rank DCP shards reshard to any world, dpft/placement/fsdp_checkpoint.py.)
    """
    was = int(state.get("world_size", 1))
    if was == world_size:
        return None
    how = ("without torchrun (one process)" if was == 1 else
           f"with {was} processes in all (torchrun --nproc_per_node={was} -m dpft train … --resume on one machine, "
           f"or --nnodes × --nproc_per_node = {was})")
    return (f"--resume: {run_dir}/checkpoint was written by {was} process(es) but this run has {world_size}; "
            f"resume it {how}, or start a new --output-dir")


def continue_ledger(world, run_dir: Path, live: Path, resume: bool, ledger) -> tuple[Any, list[str]]:
    """The ledger a run starts from: ``ledger`` (phases a caller already spent, e.g. synthetic
    data) after the releases a crashed attempt in ``run_dir`` recorded in its live ``ledger.json``
    before its first checkpoint — appended to, never replaced (DESIGN.md "The ledger").

    Returns ``(ledger, notes)``; the notes say what was carried, for the report. Under DDP rank 0
    reads the directory and every rank gets its answer.
    """
    def earlier_ledger():
        if not resume and live.is_file() and not (Path(run_dir) / CKPT).exists():
            return PrivacyLedger.load(live).to_json()
        return None

    earlier_json = ddp.on_rank0(world, earlier_ledger)
    if earlier_json is None:
        return ledger, []
    earlier = PrivacyLedger.from_json(earlier_json)
    merged = PrivacyLedger(earlier.entries + ledger.entries, certified=earlier.certified and ledger.certified,
                           not_certified_reason=earlier.not_certified_reason or ledger.not_certified_reason)
    return merged, [f"{live} held {earlier.steps} releases of an earlier attempt in this directory (crashed before "
                    "its first checkpoint); they are carried in this ledger"]


def cap_resumed_run(trainer, allow_overspend: bool = False, log=None):
    """The target ε as a hard cap on a resumed run (issue 36 item 3; accounting/cap.py).

    Counts the releases ``trainer``'s ledger already holds (those past the checkpoint, made by an
    attempt killed before its next checkpoint, included), and unless ``allow_overspend`` lowers
    ``trainer.total_steps`` to the last step that keeps ε(δ) within the recipe's target (or,
    with a fixed ``privacy.noise_multiplier``, within the ε the plan reaches without a crash).
    ``log`` gets, before the first step, the line saying how many releases the ledger holds, how
    many steps remain and the ε the run ends at. Under DDP rank 0 computes and every rank gets it.

    Returns the :class:`~dpft.accounting.cap.ResumeCap` as a dict for the report (with
    ``allow_overspend``), or None for a run without a gradient mechanism (non-private, forward LDP).
    """
    mech, r = trainer.mechanism, trainer.recipe
    if not trainer.private or mech is None:
        return None
    p = r.privacy
    target = p.target_epsilon if p.noise_multiplier is None else None
    cap = ddp.on_rank0(trainer.world, lambda: ledger_resume_cap(
        trainer.ledger, trainer.phase, mech, trainer.dp_step.q_at, trainer.start_step, trainer.total_steps, p.delta,
        target))
    held = cap.held
    past = held - cap.start
    holds = (f"resume: the ledger holds {held} releases of this run's steps"
             + (f" ({cap.start} up to the checkpoint at step {cap.start}, {past} after it by the attempt that "
                "stopped before its next checkpoint: those steps run again as new releases)" if past > 0
                else f" (up to the checkpoint at step {cap.start})"))
    goal = f"the target ε = {cap.target:g}" if target is not None else f"the planned ε = {cap.target:.4g}"
    if allow_overspend or cap.stop == cap.planned:
        over = cap.epsilon_planned > cap.target * (1 + 1e-9)
        line = (f"{holds}; {cap.planned - cap.start} steps remain (to step {cap.planned}); this run ends at "
                f"ε = {cap.epsilon_planned:.4g} at δ = {p.delta:g}"
                + (f", ABOVE {goal} (--allow-overspend)" if over else ""))
    else:
        trainer.total_steps = cap.stop
        line = (f"{holds}; {cap.stop - cap.start} steps remain: the run stops at step {cap.stop} of the "
                f"{cap.planned} planned ({cap.early} early) so that ε stays within {goal}; it ends at "
                f"ε = {cap.epsilon_end:.4g} at δ = {p.delta:g} (--allow-overspend runs all {cap.planned} steps "
                f"and ends at ε = {cap.epsilon_planned:.4g})")
        if cap.stop == cap.start and cap.epsilon_end > cap.target * (1 + 1e-9):
            line += "; the ledger alone is already above the target: no step runs"
    if log is not None and trainer.world.is_main:
        log(line)
    return {"start": cap.start, "planned_steps": cap.planned, "stop": trainer.total_steps, "held": held,
            "target_epsilon": cap.target, "epsilon_end": cap.epsilon_end, "epsilon_planned": cap.epsilon_planned,
            "allow_overspend": bool(allow_overspend), "line": line}


#: Trainable modes whose part is small (LoRA, a head, biases) and the most parameters of a part
#: checkpointed at every release by default (``checkpoint_every_release``).
CHEAP_MODES, CHEAP_PARAMS = ("lora", "head", "bias"), 20_000_000


def release_checkpoints(recipe, private: bool, sharded: bool, params: dict) -> bool:
    """Whether a run checkpoints at every release: the recipe's ``checkpoint_every_release``, or
    (None) when the run is private, unsharded, trains a small part (``trainable.mode`` in
    :data:`CHEAP_MODES`) of at most :data:`CHEAP_PARAMS` parameters: then a checkpoint costs little
    and a crash leaves no release to replay."""
    want = getattr(recipe, "checkpoint_every_release", None)
    if want is not None:
        return bool(want) and not sharded
    if not private or sharded or recipe.trainable.mode not in CHEAP_MODES:
        return False
    return sum(p.numel() for p in params.values()) <= CHEAP_PARAMS
