"""One rank of a DPDPOTrainer / QLoRA DPTrainer run under ``TrainingArguments.fsdp`` (FSDP2), for
tests/test_trl_fsdp.py (not a test file); also run in-process, with no process group, as the 1-process
reference. The logging is tests/hf_fsdp_worker.py's ``_train`` (batches, shares, ledger, step class,
FSDP units, gathered trainable weights).

Jobs: ``dpo`` — DPDPOTrainer, full fine-tuning of the audit's tiny Llama (no ``ref_model``: TRL scores
the pairs with the policy before training, here sharded: every rank scores together); ``dpo_lora`` — a
LoRA policy (the reference: its adapters disabled, on the sharded model); ``dpo_ref`` — an unsharded
``ref_model`` passed by the caller (rank 0 scores alone); ``qlora`` — DPTrainer on a 4-bit NF4 tiny Llama
(bitsandbytes' CPU backend, ``bnb_4bit_quant_storage`` = fp32 so that FSDP2 shards the packed weights)
with LoRA adapters. Each also records the reference log-probabilities of the training pairs (DPO).
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry


def _dpo(job: dict, common: dict):
    from trl import DPOConfig

    from dpft.audit.checks_hf_ddp import trl_rows
    from dpft.audit.checks_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.hf import DPArguments
    from dpft.integrations.trl import DPDPOTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    if job.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    extra = {"ref_model": tiny_llama(len(tok))} if job.get("ref_model") else {}
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=4,
                     reproducible_seed=3, max_physical_batch_size=2)
    args = DPOConfig(bf16=False, beta=0.5, max_length=64, dataset_num_proc=None, **common)
    return DPDPOTrainer(model=model, args=args, train_dataset=trl_rows({"trainer": "dpo", "rows": 12}),
                        processing_class=tok, dp_args=dp, **extra)


def run_job(job: dict, out_dir: Path) -> dict:
    from hf_fsdp_worker import _train

    fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, **job.get("fsdp_config", {})}}
    common = dict(output_dir=str(out_dir), max_steps=job.get("steps", 3), learning_rate=0.5,
                  lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, per_device_train_batch_size=2,
                  report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, save_strategy="no", **fsdp)
    tr = _dpo(job, common) if job.get("dpo") else _qlora(job, common)
    log = {}
    if job.get("dpo"):
        ds = tr.train_dataset
        log["ref_logps"] = [list(map(float, ds["ref_chosen_logps"])), list(map(float, ds["ref_rejected_logps"]))]
    log.update(_train(tr, job, out_dir))
    return log


def _qlora(job: dict, common: dict):
    raise NotImplementedError  # filled in below


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: run_job(job, Path(cfg.get("out", "."), f"{name}-{rank}"))
                    for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (as accelerate launch makes)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
