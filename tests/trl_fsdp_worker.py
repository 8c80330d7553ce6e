"""One rank of a DPDPOTrainer / QLoRA DPTrainer run under ``TrainingArguments.fsdp`` (FSDP2), for
tests/test_trl_fsdp.py (not a test file); also run in-process, with no process group, as the 1-process
reference. The logging is tests/hf_fsdp_worker.py's ``_train`` (batches, shares, ledger, step class,
FSDP units, gathered trainable weights).

Job keys: ``dpo`` — DPDPOTrainer on the audit's tiny Llama, full fine-tuning (no ``ref_model``: TRL scores
the pairs with the policy before training, here sharded: every rank scores together); with ``lora`` — a
LoRA policy (the reference: TRL's frozen ``ref`` copy of the adapter, made before sharding); ``ref_model`` —
an unsharded ``ref_model`` passed by the caller (rank 0 scores alone); ``env`` — FSDP asked through
accelerate's FSDP2 environment (``accelerate launch``) instead of ``DPOConfig.fsdp``; ``user_sharded`` — the
policy sharded by the caller with ``fully_shard`` (its reference adapter added first; 2 processes only);
``user_level`` — DPO at user level (``DPArguments(user_column="user")``: tests/sft_fsdp_worker.py's 12 pairs of
5 users and its user-level ``DPArguments``, as tests/dpo_user_worker.py). ``resume_test`` — the job is
tests/sft_fsdp_worker.py's ``run_resume`` (AdamW, stopped after the checkpoint at step 2 of 4 and resumed,
against the uninterrupted run), so one launch runs both workers' jobs; ``refusals`` — no trainer:
:func:`refused_checkpoints` (2 processes only).
Without ``dpo``: DPTrainer on a 4-bit NF4 tiny Llama (``llama_dir``; bitsandbytes' CPU backend,
``bnb_4bit_quant_storage`` = fp32 so that FSDP2 shards the packed weights) with LoRA adapters, logging each
NF4 layer's shard. DPO jobs also log the reference log-probabilities of the training pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry


def _dpo(job: dict, common: dict):
    from trl import DPOConfig

    from dpft.audit.ways_in_ddp import trl_rows
    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPDPOTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    if job.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    if job.get("user_sharded"):  # the caller shards the policy (the same initial weights on every rank)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from dpft.integrations.trl.fsdp import add_reference_adapter

        add_reference_adapter(model)  # TRL's reference adapter, made before fully_shard (sharded with the base)
        mesh = init_device_mesh("cpu", (2,))
        for m in model.modules():
            if type(m).__name__ == "LlamaDecoderLayer":
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        common = {k: v for k, v in common.items() if k not in ("fsdp", "fsdp_config")}
    extra = {"ref_model": tiny_llama(len(tok))} if job.get("ref_model") else {}
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=4,
                     reproducible_seed=3, max_physical_batch_size=2)
    rows = trl_rows({"trainer": "dpo", "rows": 12})
    if job.get("user_level"):  # the settings of tests/dpo_user_worker.py: a 1-process run equals its fsdp= job
        from sft_fsdp_worker import USERS, _dp_args

        rows, dp = rows.add_column("user", [f"u{u}" for u in USERS]), _dp_args({}, True)
    args = DPOConfig(bf16=False, beta=0.5, max_length=64, dataset_num_proc=None, **common)
    return DPDPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, dp_args=dp, **extra)


#: accelerate launch's environment for an FSDP2 config on the tiny Llama (``distributed_type: FSDP``,
#: ``fsdp_version: 2``), for the ``env`` jobs.
ACCELERATE_FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}


def run_job(job: dict, out_dir: Path) -> dict:
    import os

    from hf_fsdp_worker import _train

    env = ACCELERATE_FSDP2_ENV if job.get("env") else {}
    fsdp = {} if env else {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, **job.get("fsdp_config", {})}}
    common = dict(output_dir=str(out_dir), max_steps=job.get("steps", 3), learning_rate=0.5,
                  lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, per_device_train_batch_size=2,
                  report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, save_strategy="no", **fsdp)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        tr = _dpo(job, common) if job.get("dpo") else _qlora(job, common)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    log = {}
    if job.get("dpo"):
        ds = tr.train_dataset
        log["ref_logps"] = [list(map(float, ds["ref_chosen_logps"])), list(map(float, ds["ref_rejected_logps"]))]
    else:
        log["nf4"] = _nf4_shards(tr.model)
    log.update(_train(tr, job, out_dir))
    log["user_level"] = bool(getattr(tr, "user_level", False))
    return log


def _nf4_shards(model) -> dict:
    """After DPTrainer sharded the model: every bitsandbytes 4-bit layer's weight (a DTensor? local and
    global shape, storage dtype) and this rank's share of the parameter bytes."""
    from dpft.placement import fsdp

    rows = [{"dtensor": fsdp.is_sharded(m.weight), "local": list(fsdp.local(m.weight).shape),
             "global": list(m.weight.shape), "dtype": str(m.weight.dtype)}
            for m in model.modules() if type(m).__module__.startswith("bitsandbytes.")]
    local = sum(fsdp.local(p).numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"layers": rows, "byte_share": local / full}


#: The tiny Llama's vocabulary and the rows' lengths: bitsandbytes' CPU 4-bit kernels want out_features
#: % 32 == 0 and in_features >= their block size (64), hence hidden 64 (tests/test_qlora.py).
QLORA_VOCAB = 96


def save_tiny_llama(path: Path) -> Path:
    """A tiny random Llama (2 decoder layers, hidden 64) saved to ``path`` for ``from_pretrained`` with a
    ``BitsAndBytesConfig`` (quantization happens while loading)."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=QLORA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)).save_pretrained(path)
    return path


def causal_rows(n: int):
    """``n`` token sequences of 3 to 8 ids (a fixed generator: the same rows in every process)."""
    import datasets
    import torch

    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        k = int(torch.randint(3, 9, (1,), generator=g))
        rows.append({"input_ids": torch.randint(3, QLORA_VOCAB, (k,), generator=g).tolist()})
    return datasets.Dataset.from_list(rows)


def causal_collate(rows: list[dict]) -> dict:
    """Right-padded ``input_ids`` / ``attention_mask``, ``labels`` = the ids with -100 on padding."""
    import torch

    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def qlora_model(path: str):
    """The QLoRA recipe of the peft/bitsandbytes docs: NF4 base (dpft's ``bnb_config``: double quantization,
    compute and storage dtype fp32, so FSDP2 shards the packed weights), ``prepare_model_for_kbit_training``,
    LoRA adapters with random B (non-zero gradients for A and B from the first step)."""
    import warnings

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from dpft.models.quant import bnb_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config("nf4", torch.float32),
                                                    device_map="cpu", dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                     init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "down_proj"])).train()


def _qlora(job: dict, common: dict):
    from transformers import TrainingArguments

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=6,
                     reproducible_seed=3, max_physical_batch_size=2)
    args = TrainingArguments(label_names=["labels"], **common)
    return DPTrainer(model=qlora_model(job["llama_dir"]), args=args, train_dataset=causal_rows(30),
                     data_collator=causal_collate, dp_args=dp)


def refused_checkpoints(out_dir: Path) -> dict:
    """``load_full_into_shards`` of a tiny Llama the caller sharded, from a folder without weights and from
    another model's checkpoint (rank 0 reads and checks them): what each rank raises (type, message)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from sft_fsdp_worker import _caller_shard

    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.hf.fsdp import load_full_into_shards

    model = tiny_llama(len(tiny_tokenizer()))
    _caller_shard(model)
    empty, foreign = out_dir / "empty", out_dir / "foreign"
    if dist.get_rank() == 0:
        empty.mkdir(parents=True, exist_ok=True)
        foreign.mkdir(parents=True, exist_ok=True)
        save_file({"classifier.weight": torch.zeros(2, 2)}, str(foreign / "model.safetensors"))
    dist.barrier()
    out = {}
    for name, folder in (("empty", empty), ("foreign", foreign)):
        try:
            load_full_into_shards(model, str(folder))
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
            out[name] = [type(exc).__name__, str(exc)]
    return out


def run_jobs(cfg: dict, rank: int) -> dict:
    from sft_fsdp_worker import run_resume

    def one(name: str, job: dict):
        out = Path(cfg.get("out", "."), name)
        if job.get("refusals"):
            return refused_checkpoints(out)
        # a resumed run reads the checkpoint rank 0 wrote: one output folder for the world, as in practice
        return run_resume(job, out) if job.get("resume_test") else run_job(job, Path(f"{out}-{rank}"))

    out = {"jobs": {name: one(name, job) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (as accelerate launch makes)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
