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
    only the same world replays a reproducible run's steps as they were.
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
    from dpft.accounting.ledger import PrivacyLedger
    from dpft import distributed as ddp

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
