"""One rank of a DPSFTTrainer run under FSDP2, for tests/test_sft_fsdp.py (not a test file); also run
in-process, with no process group, as the 1-process reference. The logging is tests/hf_fsdp_worker.py's
``_train`` (batches, shares, ledger, step class, FSDP units, gathered trainable weights).

Job keys: none — DPSFTTrainer (TRL) on the audit's tiny Llama with ``SFTConfig(fsdp=True,
fsdp_config={"fsdp_version": 2})``, prompt/completion rows, 3 reproducible logical steps; ``user_level``
— the same at user level (``DPArguments(user_column="user")``: 12 rows of 5 users, at most 2 rows per
sampled user, whole users per rank); ``caller_sharded`` — no ``fsdp=``: the caller shards the policy with
``fully_shard`` (its decoder layers, then the root) before building the trainer (2 processes only; the
test compares it with the ``fsdp=`` run of one process at the same unit); ``max_batch_size`` — truncated
Poisson; ``banded`` — banded MF (b = 2); ``dpo`` — DPDPOTrainer on preference pairs instead (the pair is the
unit). :func:`run_resume` (``resume_test``): AdamW, a run stopped after its checkpoint at step 2, resumed by
a new trainer, against an uninterrupted run. ``ddp`` — no FSDP at all: under 2 processes the DDP world
(every rank the whole model, one all-reduce of the clipped sums), in one process the plain step.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry

#: The user of each of the 12 training rows (5 users of 1 to 4 rows).
USERS = [0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 4, 1]


def _rows(user_level: bool):
    from dpft.audit.ways_in_ddp import trl_rows

    ds = trl_rows({"trainer": "sft", "rows": len(USERS)})
    return ds.add_column("user", [f"u{u}" for u in USERS]) if user_level else ds


def _dp_args(job: dict, user: bool):
    from dpft.integrations.hf.trainer import DPArguments

    mech = {"mechanism": "banded_mf", "bands": 2} if job.get("banded") else {}
    return DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=3 if user else 4,
                       reproducible_seed=3, max_physical_batch_size=2, user_column="user" if user else None,
                       max_rows_per_user=2, max_batch_size=job.get("max_batch_size"), **mech)


def _caller_shard(model) -> None:
    """What a user does before building the trainer: ``fully_shard`` on the decoder layers, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for m in model.modules():
        if type(m).__name__ == "LlamaDecoderLayer":
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_job(job: dict, out_dir: Path) -> dict:
    from hf_fsdp_worker import _train
    from trl import DPOConfig, SFTConfig

    from dpft.audit.ways_in_ddp import trl_rows
    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.trl.trainer import DPDPOTrainer, DPSFTTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))  # a fixed seed: the same initial weights on every rank
    fsdp = {} if job.get("ddp") else {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
    if job.get("caller_sharded"):  # the caller shards the policy; no fsdp= asked
        _caller_shard(model)
        fsdp = {}
    user = job.get("user_level", False)
    saving = {"save_strategy": "steps", "save_steps": 2} if job.get("checkpoint") else {"save_strategy": "no"}
    common = dict(output_dir=str(out_dir), max_steps=job.get("steps", 3), learning_rate=0.5,
                  lr_scheduler_type="constant", optim=job.get("optim", "sgd"), weight_decay=0.0,
                  per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_strategy="no",
                  disable_tqdm=True, max_length=64, dataset_num_proc=None, bf16=False, **saving, **fsdp)
    if job.get("dpo"):  # preference pairs: the pair is the unit (user level for DPO: tests/dpo_user_worker.py)
        tr = DPDPOTrainer(model=model, args=DPOConfig(beta=0.5, **common), processing_class=tok,
                          train_dataset=trl_rows({"trainer": "dpo", "rows": len(USERS)}), dp_args=_dp_args(job, False))
    else:
        # fp32 (SFTConfig defaults to bf16: one process would autocast, FSDP2 gather bf16 parameters); SFTConfig's
        # default gradient checkpointing stays on (FSDP2 re-gathers inside the recomputation).
        tr = DPSFTTrainer(model=model, args=SFTConfig(**common), train_dataset=_rows(user), processing_class=tok,
                          dp_args=_dp_args(job, user))
    log = _train(tr, job, out_dir)
    log["user_level"] = bool(getattr(tr, "user_level", False))
    return log


def run_resume(job: dict, out_dir: Path) -> dict:
    """AdamW, 4 steps with a checkpoint at 2: a run that stops at 2 and a new trainer resumed from its
    checkpoint-2 (the folder rank 0 wrote, read by every rank), against an uninterrupted run."""
    base = {"steps": 4, "optim": "adamw_torch", "checkpoint": True, **job}
    first = run_job({**base, "stop_at": 2}, out_dir / "run")
    resumed = run_job({**base, "resume": "checkpoint-2"}, out_dir / "run")
    whole = run_job(base, out_dir / "whole")
    return {"first_ledger": first["ledger"], "resumed": resumed, "whole": whole}


def run_jobs(cfg: dict, rank: int) -> dict:
    # a resumed run reads the checkpoint rank 0 wrote: one output folder for the world, as in practice
    out = {"jobs": {name: run_resume(job, Path(cfg.get("out", "."), name)) if job.get("resume_test") else
                    run_job(job, Path(cfg.get("out", "."), f"{name}-{rank}")) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (as accelerate launch makes)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
