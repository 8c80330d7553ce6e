"""One rank of a DPTrainer run under ``TrainingArguments.fsdp`` or accelerate's FSDP2 plugin
environment (integrations/hf/fsdp.py ``shard_requested``), for tests/test_hf_fsdp.py (not a test
file); also run in-process, with no process group, as the 1-process reference.

:func:`run_job`: a reproducible DPTrainer on the audit's tiny BERT (the same seed on every rank; rank
0's weights are broadcast before sharding anyway), 3 logical steps, at example level, with truncated
Poisson (``max_batch_size``) or at user level; FSDP asked through ``TrainingArguments(fsdp=...,
fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]})`` or through
accelerate's environment (``sft``: DPSFTTrainer on a tiny Llama, the default wrap classes) (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, ...). Logs the world's
logical batch and this rank's share per step, the ledger, the step class, whether the model holds FSDP
modules or accelerate's wrapper, the gathered trainable weights, and (``save``) the weights
``from_pretrained`` loads from ``save_model``'s folder and whether any saved tensor is a DTensor.
:func:`run_resume`: AdamW, a run stopped after its checkpoint at step 2, resumed by a new DPTrainer, against
an uninterrupted run; and what the checkpoint's ``optimizer.pt`` holds (``banded``: banded MF with b = 2, and
the secret noise state file rank 0 wrote at the checkpoint: mode, place, step, gathered buffers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from _launch import gloo_entry

#: accelerate launch's environment for an FSDP2 config (``distributed_type: FSDP``, ``fsdp_version: 2``).
ACCELERATE_FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer",
                        "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}


def run_job(job: dict, out_dir: Path) -> dict:
    from dpft.integrations.hf.trainer import DPArguments

    env = ACCELERATE_FSDP2_ENV if job.get("env") else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fsdp = {} if job.get("env") else {"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if job.get("sft") else {
            "fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"],
                                                  **job.get("fsdp_config", {})}}
        users = [i % 7 for i in range(30)] if job.get("user_level") else None
        saving = {"save_strategy": "steps", "save_steps": 2} if job.get("checkpoint") else {"save_strategy": "no"}
        if job.get("eval"):  # Trainer's evaluation between steps (a forward outside the DP step)
            saving.update(eval_strategy="steps", eval_steps=1)
        common = dict(output_dir=str(out_dir), max_steps=job.get("steps", 3), learning_rate=0.5,
                      lr_scheduler_type="constant", optim=job.get("optim", "sgd"), weight_decay=0.0,
                      per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_strategy="no",
                      disable_tqdm=True, **saving, **fsdp)
        if job.get("sft"):  # DPSFTTrainer (TRL) on a tiny Llama: FSDP units = its decoder layers + the root
            from trl import SFTConfig

            from dpft.audit import ways_in_ddp as hd
            from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
            from dpft.integrations.trl.trainer import DPSFTTrainer

            tok = tiny_tokenizer()
            dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=4,
                             reproducible_seed=3, max_physical_batch_size=2)
            # SFTConfig's default gradient checkpointing stays on: FSDP2 re-gathers inside the recomputation
            # fp32: SFTConfig defaults to bf16, which one process runs as autocast and FSDP2 as bf16-gathered
            # parameters (MixedPrecisionPolicy): equal only to bf16 rounding. Its default gradient
            # checkpointing stays on (FSDP2 re-gathers inside the recomputation).
            tr = DPSFTTrainer(model=tiny_llama(len(tok)), args=SFTConfig(max_length=64, dataset_num_proc=None, bf16=False,
                                                                         **common),
                              train_dataset=hd.trl_rows({"trainer": "sft", "rows": 12}), processing_class=tok, dp_args=dp)
        else:
            tr = _hf_trainer(job, common, users)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return _train(tr, job, out_dir)


def _hf_trainer(job: dict, common: dict, users):
    from transformers import TrainingArguments

    from dpft.audit.ways_in_ddp import USER_COLUMN, make_rows, pad_collate, tiny_model
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    args = TrainingArguments(label_names=["labels"], bf16=job.get("bf16", False), **common)
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=6,
                     reproducible_seed=3, max_physical_batch_size=2, user_column=USER_COLUMN if users else None,
                     max_rows_per_user=2, max_batch_size=job.get("max_batch_size"),
                     **({"mechanism": "banded_mf", "bands": 2} if job.get("banded") else {}))
    model = tiny_model()
    if job.get("lora"):  # frozen base, trainable adapter and head: save_model writes the adapter
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4,
                                                 target_modules=["query", "value"], lora_dropout=0.0))
    evals = {"eval_dataset": make_rows(8, seed=4)} if job.get("eval") else {}
    return DPTrainer(model=model, args=args, train_dataset=make_rows(30, users), data_collator=pad_collate,
                     dp_args=dp, **evals)


def _train(tr, job: dict, out_dir: Path) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PrinterCallback

    from dpft.audit.ways_in_ddp import record_shares
    from dpft.placement.fsdp import FSDPStep

    tr.remove_callback(PrinterCallback)
    log: dict = {"batches": {}, "shares": {}, "sharded": tr.sharded, "step": type(tr.dp_step).__name__,
                 "fsdp_step": isinstance(tr.dp_step, FSDPStep),
                 "fsdp_units": sum(isinstance(m, FSDPModule) for m in tr.model.modules()),
                 "accelerate_fsdp": bool(getattr(tr, "is_fsdp_enabled", False)),
                 "args_fsdp": bool(tr.args.fsdp)}
    record_shares(tr, log)
    if job.get("stop_at"):  # a run that dies after its checkpoint at step stop_at (its ledger says so)
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= job["stop_at"]

        tr.add_callback(Stop())
    tr.train(resume_from_checkpoint=str(out_dir / job["resume"]) if job.get("resume") else None)
    log["ledger"] = tr.ledger.to_json()
    log["eval_losses"] = [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h]
    log["weights"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                      for n, p in tr.engine.params.items()}
    log["world_size"], log["rank"] = tr.world.world_size, tr.world.rank
    log["mechanism"] = type(tr.mechanism).__name__
    if job.get("banded") and job.get("checkpoint") and tr.world.is_main:  # rank 0 wrote it (after the gather)
        log["noise"] = _noise_file(out_dir)
    if job.get("save"):
        final = out_dir / "final"
        tr.save_model(str(final))
        if tr.world.is_main:
            log.update(_saved(final, job.get("lora", False)))
    return log


def _saved(folder: Path, lora: bool = False) -> dict:
    """What ``from_pretrained`` loads from ``folder`` (an adapter: ``PeftModel.from_pretrained`` over the
    same tiny base), and whether a saved tensor is a DTensor."""
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    files = sorted(p.name for p in folder.iterdir())
    raw = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            raw.update({k: fh.get_tensor(k) for k in fh.keys()})
    if lora:
        from peft import PeftModel

        from dpft.audit.ways_in_ddp import tiny_model

        loaded = PeftModel.from_pretrained(tiny_model(), str(folder))
    else:
        loaded = AutoModelForSequenceClassification.from_pretrained(str(folder))
    return {"saved_files": files, "saved_keys": len(raw),
            "saved_dtensor": any(type(t).__name__ == "DTensor" for t in raw.values()),
            "loaded": {n: p.detach().flatten().tolist() for n, p in loaded.named_parameters()}}


def _optimizer_file(path: Path) -> dict:
    import torch

    st = torch.load(str(path), map_location="cpu", weights_only=True)
    tensors = [v for s in st["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"optimizer_names": sorted(st["state"])[:2], "optimizer_tensors": len(tensors),
            "optimizer_dtensor": any(type(t).__name__ == "DTensor" for t in tensors)}


def run_resume(job: dict, out_dir: Path) -> dict:
    """AdamW, 4 steps with a checkpoint at 2: a run that stops at 2 and a new DPTrainer resumed from its
    checkpoint-2, against an uninterrupted run in another folder."""
    base = {"steps": 4, "optim": "adamw_torch", "checkpoint": True, **job}
    first = run_job({**base, "stop_at": 2}, out_dir / "run")  # (a real crash: the same files, no later step)
    ckpt = out_dir / "run" / "checkpoint-2"
    resumed = run_job({**base, "resume": "checkpoint-2"}, out_dir / "run")
    whole = run_job(base, out_dir / "whole")
    out = {"first_ledger": first["ledger"], "resumed": resumed, "whole": whole}
    if (ckpt / "optimizer.pt").exists():
        out.update(_optimizer_file(ckpt / "optimizer.pt"))
    if job.get("banded"):
        out["noise"] = first.get("noise")  # rank 0 only
    return out


def _noise_file(run_dir: Path) -> dict:
    """banded_mf's secret noise state as rank 0 wrote it: its mode, where it lies (not under any
    checkpoint-*/), its step and its buffers (full tensors: gathered from every rank's slices)."""
    import torch

    from dpft.step.correlated import NOISE_STATE_FILE

    path = run_dir / NOISE_STATE_FILE
    st = torch.load(str(path), map_location="cpu", weights_only=True)
    return {"mode": path.stat().st_mode & 0o777,
            "in_checkpoints": sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("checkpoint-*/**/*")
                                     if "noise" in p.name),
            "next_step": int(st["next_step"]),
            "buffers": [{n: t.flatten().tolist() for n, t in b.items()} for b in st["buffers"]],
            "shapes": {n: list(t.shape) for b in st["buffers"] for n, t in b.items()}}


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
