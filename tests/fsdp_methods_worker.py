"""One rank of a ``make_private`` loop or a ``DPTrainer`` run with method plug-ins (RMT, DP-Adam-AC's
adaptive clipping) on an FSDP2 (``fully_shard``) model, for tests/test_fsdp_methods_api.py (not a
test file); also run in-process, on a 1-process gloo group, as the reference.

The models and data are tests/fsdp_api_worker.py's (a tiny MLP with uneven dim-0 shards; a tiny BERT
with each ``BertLayer`` and the root sharded). Each job logs the ledger, ε, what the step and the
methods released per logical step (RMT's layers/touched/spikes, the C used, the private clip rate)
and the gathered weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry
from fsdp_api_worker import sharded_model


def run_api_job(job: dict) -> dict:
    """A reproducible make_private loop (4 logical steps) with ``job["methods"]``."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from ddp_api_worker import N, _data
    from dpft import PrivacyEngine

    model = sharded_model()
    x, y, _ = _data()
    rows = [{"x": x[i], "y": y[i]} for i in range(N)]
    engine = PrivacyEngine(reproducible_seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    module, opt, crit, dl = engine.make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(rows, batch_size=8),
        noise_multiplier=0.8, max_grad_norm=0.5, steps=4, max_physical_batch_size=3, methods=job["methods"])
    log: dict = {"released": [], "method_stats": []}
    while opt.logical_steps < 4:
        for b in dl:
            before = opt.logical_steps
            opt.zero_grad()
            crit(module(b["x"]), b["y"]).backward()
            opt.step()
            if opt.logical_steps > before:
                log["released"].append(dict(opt.last_step.released))
                log["method_stats"].append(dict(opt.method_stats))
            if opt.logical_steps >= 4:
                break
    log["transforms"] = [type(t).__name__ for t in opt.dp_step.spec.transforms]
    log["ledger"] = engine.ledger.to_json()
    log["epsilon"] = engine.get_epsilon(1e-3)
    log["weights"] = {n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()}
    log["world_size"] = dl.world_size
    engine.detach()
    return log


def run_trainer_job(job: dict, out_dir: Path) -> dict:
    """A reproducible DPTrainer run (3 logical steps) with ``DPArguments.methods = job["methods"]``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import PrinterCallback, TrainerCallback, TrainingArguments
    import torch.distributed as dist

    from dpft.audit.ways_in_ddp import make_rows, pad_collate, tiny_model
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    model = tiny_model()
    fsdp: dict = {}
    if job.get("fsdp_args"):  # TrainingArguments.fsdp: DPTrainer shards the model itself (integrations/hf/fsdp.py)
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}}
    else:  # the caller sharded it
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model.modules():
            if type(m).__name__ == "BertLayer":
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=3, learning_rate=0.5, lr_scheduler_type="constant",
                             optim="sgd", weight_decay=0.0, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, label_names=["labels"],
                             **fsdp)
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=6,
                     reproducible_seed=3, max_physical_batch_size=2, methods=job["methods"])
    tr = DPTrainer(model=model, args=args, train_dataset=make_rows(30, None), data_collator=pad_collate, dp_args=dp)
    tr.remove_callback(PrinterCallback)
    log: dict = {"method_stats": [], "released": [], "sharded": tr.sharded}
    den = [t.denoiser for t in tr.dp_step.spec.transforms if hasattr(t, "denoiser")]

    class Stats(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            log["method_stats"].append(dict(tr.method_stats))
            log["released"].append(den[0].summary() if den else {})

    tr.add_callback(Stats())
    tr.train()
    log["transforms"] = [type(t).__name__ for t in tr.dp_step.spec.transforms]
    log["ledger"] = tr.ledger.to_json()
    log["weights"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                      for n, p in tr.engine.params.items()}
    log["world_size"] = tr.world.world_size
    return log


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: (run_trainer_job(job, Path(cfg.get("out", "."), f"{name}-{rank}")) if job.get("trainer")
                           else run_api_job(job)) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (FSDP2 needs it before make_private)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
