"""Checkpoints of a sharded run (``perf.sharding: fsdp``, dpft/fsdp.py): save and ``--resume``.

A checkpoint holds full (gathered) tensors written by rank 0 — the trainable weights, the
name-keyed optimizer state (``torch.distributed.checkpoint.state_dict``, ``full_state_dict``) and,
for banded MF, the gathered secret noise buffers (mode 0600, outside the release set) — so it is
the checkpoint one process writes, and the driver's resume rules (ledger continued, releases past
the checkpoint, the same world size) apply unchanged. On resume every rank copies its dim-0 slice.
Whole tensors pass through rank 0: fine for what a few GPUs train; a checkpoint per rank
(``torch.distributed.checkpoint.save`` of the sharded state dicts) is the path for models whose
full state does not fit one host (issue 38 item 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dpft.fsdp import FSDPError, ShardedBandedMFMechanism, _fsdp_modules, full_state, local, local_range
from dpft.step.correlated import NOISE_STATE_FILE, write_secret

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(trainer, step: int, write: Callable[..., Any]) -> None:
    """The checkpoint of a sharded run: full trainable weights (gathered) and the full optimizer
    state (``torch.distributed.checkpoint.state_dict``, keyed by parameter name), written by rank 0
    with ``write`` (the driver's ``run/checkpoint.save_checkpoint``, handed in: placement never
    imports the driver). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    params = full_state(trainer.params)
    optim = trainer.optimizer
    if _fsdp_modules(trainer.model):
        sd = get_optimizer_state_dict(trainer.model, optim,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        class _Full:  # what save_checkpoint reads of an optimizer
            def state_dict(self):
                return sd

        optim = _Full()
    mech = trainer.mechanism
    noise = None
    if isinstance(mech, ShardedBandedMFMechanism):  # banded MF: the gathered secret buffers (a collective)
        if mech.next_step != int(step):
            raise FSDPError(f"noise buffers at step {mech.next_step}, checkpoint at step {step}")
        noise = mech.state()
    trainer._last_checkpoint = step
    if trainer.world.is_main:
        write(trainer.run_dir, step=step, params=params, optimizer=optim, scheduler=trainer.scheduler,
              ledger_json=trainer.ledger.to_json(), state=trainer._state())
        if noise is not None:  # secret, owner-only, outside the release set (as one process writes it)
            write_secret(Path(trainer.run_dir) / NOISE_STATE_FILE, noise)


def load_checkpoint(trainer, ck: Mapping[str, Any]) -> None:
    """Resume a sharded run from its checkpoint (:func:`save_checkpoint`: full trainable weights and
    the full, name-keyed optimizer state, read by rank 0 and broadcast by the driver): each rank
    copies its dim-0 slice of every parameter and sets its optimizer shards from the full state
    (``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``). Banded MF's buffers are
    restored by the driver's ``resume_noise_state`` (:meth:`ShardedBandedMFMechanism.load_state`
    keeps this rank's slice). The world size must be the checkpoint's (the driver checks it).

    Raises:
        FSDPError: a checkpoint tensor of another shape than its parameter."""
    w = trainer.world
    with torch.no_grad():
        for n, p in trainer.params.items():
            full = ck["params"][n]
            if tuple(full.shape) != tuple(p.shape):
                raise FSDPError(f"--resume: checkpoint tensor {n} has shape {tuple(full.shape)}, the parameter "
                                f"{tuple(p.shape)}")
            off, cnt = local_range(p, w.rank, w.world_size)
            loc = local(p)
            loc.copy_(full.reshape(-1)[off:off + cnt].reshape(loc.shape).to(loc.device, loc.dtype))
    if _fsdp_modules(trainer.model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=ck["optim"]["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        trainer.optimizer.load_state_dict(ck["optim"]["optimizer"])
