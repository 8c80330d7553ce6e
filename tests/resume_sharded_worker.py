"""One rank of a DPTrainer run on a model the *caller* sharded with ``fully_shard`` (no ``fsdp=``), stopped
after its checkpoint and resumed (integrations/hf/fsdp.py ``load_full_into_shards``), for
tests/test_resume_sharded.py and tests/test_sft_fsdp.py (not a test file). The trainer, its logging and the
stop are tests/hf_fsdp_worker.py's (the audit's tiny BERT, AdamW, 4 reproducible logical steps, a checkpoint
at step 2); the model is sharded here, before ``DPTrainer(...)``: its ``BertLayer`` blocks, then the root, on
the world's CPU mesh (a 1-process gloo group: one rank holds every shard, still ``DTensor`` parameters).
Job keys: ``lora`` — a PEFT LoRA adapter (the checkpoint holds ``adapter_model.safetensors``, keys without
the adapter name); ``banded`` — banded MF (b = 2: the secret noise state rank 0 gathered at the checkpoint
is given back to each rank's shards on resume).
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry


def _caller_shard(model) -> None:
    """What a user does before building the trainer: ``fully_shard`` on the blocks, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if type(m).__name__ == "BertLayer":
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_job(job: dict, out_dir: Path) -> dict:
    from hf_fsdp_worker import _train
    from transformers import TrainingArguments

    from dpft.audit.ways_in_ddp import make_rows, pad_collate, tiny_model
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    args = TrainingArguments(output_dir=str(out_dir), max_steps=4, learning_rate=0.5, lr_scheduler_type="constant",
                             optim="adamw_torch", weight_decay=0.0, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, logging_strategy="no", disable_tqdm=True, save_strategy="steps",
                             save_steps=2, label_names=["labels"])
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=6,
                     reproducible_seed=3, max_physical_batch_size=2, max_rows_per_user=2,
                     **({"mechanism": "banded_mf", "bands": 2} if job.get("banded") else {}))
    model = tiny_model()
    if job.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4,
                                                 target_modules=["query", "value"], lora_dropout=0.0))
    _caller_shard(model)
    tr = DPTrainer(model=model, args=args, train_dataset=make_rows(30), data_collator=pad_collate, dp_args=dp)
    return _train(tr, job, out_dir)


def run_resume(job: dict, out_dir: Path) -> dict:
    """A run stopped after its checkpoint at step 2 and a new DPTrainer resumed from its checkpoint-2,
    against an uninterrupted run in another folder (every rank: one output folder for the world)."""
    first = run_job({**job, "stop_at": 2}, out_dir / "run")
    resumed = run_job({**job, "resume": "checkpoint-2"}, out_dir / "run")
    whole = run_job(job, out_dir / "whole")
    ckpt = out_dir / "run" / "checkpoint-2"
    return {"first_ledger": first["ledger"], "resumed": resumed, "whole": whole,
            "ckpt_files": sorted(p.name for p in ckpt.iterdir())}


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: run_resume(job, Path(cfg["out"], name)) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (as accelerate launch makes)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
