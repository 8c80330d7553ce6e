"""One rank of a DPDPOTrainer run at user level (``DPArguments(user_column="user")``), for
tests/test_dpo_user.py (not a test file); also run in-process, with no process group, as the
1-process reference. The trainer's settings and logging are tests/sft_fsdp_worker.py's and
tests/hf_fsdp_worker.py's ``_train`` (batches, shares, ledger, step class, gathered weights).

Job keys: ``ddp`` — no FSDP (2 processes: the DDP world); otherwise ``DPOConfig(fsdp=True,
fsdp_config={"fsdp_version": 2})``. 12 preference pairs of 5 users (sft_fsdp_worker.USERS), at most
2 pairs per sampled user, 3 reproducible logical steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry
from sft_fsdp_worker import USERS, _dp_args


def run_job(job: dict, out_dir: Path) -> dict:
    from hf_fsdp_worker import _train
    from trl import DPOConfig

    from dpft.audit.ways_in_ddp import trl_rows
    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.trl.trainer import DPDPOTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))  # a fixed seed: the same initial weights on every rank
    fsdp = {} if job.get("ddp") else {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}
    args = DPOConfig(beta=0.5, output_dir=str(out_dir), max_steps=3, learning_rate=0.5, lr_scheduler_type="constant",
                     optim="sgd", weight_decay=0.0, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                     logging_strategy="no", disable_tqdm=True, max_length=64, dataset_num_proc=None, bf16=False,
                     save_strategy="no", **fsdp)
    rows = trl_rows({"trainer": "dpo", "rows": len(USERS)}).add_column("user", [f"u{u}" for u in USERS])
    tr = DPDPOTrainer(model=model, args=args, processing_class=tok, train_dataset=rows, dp_args=_dp_args(job, True))
    log = _train(tr, job, out_dir)
    log["user_level"] = bool(tr.user_level)
    return log


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: run_job(job, Path(cfg.get("out", "."), f"{name}-{rank}"))
                    for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (as accelerate launch makes)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
