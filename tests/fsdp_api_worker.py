"""One rank of a ``PrivacyEngine.make_private`` loop on an FSDP2 (``fully_shard``) model, for
tests/test_fsdp_api.py (not a test file); also run in-process, on a 1-process gloo group, as the
reference.

:func:`run_job`: a reproducible make_private loop on a tiny MLP (the same seed on every rank: FSDP2
keeps one weight per parameter for the world, there is nothing to broadcast) whose two Linear layers
and root are ``fully_shard``-ed (uneven dim-0 chunks: 3 rows on 2 ranks), at example level, with
truncated Poisson (``max_batch_size``) or at user level; logs the world's logical batch, this rank's
share and micro-batch count per step, the ledger, ε and the gathered weights. With banded MF
(``mechanism``/``bands``) a job may stop after step ``stop_at``, save (``save_noise_state`` and
``torch.distributed.checkpoint`` of the sharded weights, every rank) and resume in fresh objects.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry
from ddp_api_worker import D, N, _data, _model  # noqa: F401 (D: test_fsdp_api.py reads worker.D; the data and MLP of the DDP tests)


def sharded_model():
    """ddp_api_worker's tiny MLP (the same seed on every rank), its two Linear layers and root sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

    model = _model(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(job: dict, model, upto: int, log: dict, resume_from=None):
    """One make_private loop over ``model`` up to logical step ``upto`` (of ``job["steps"]``
    planned); ``resume_from``: a state path to continue (``load_noise_state``, every rank)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from dpft import PrivacyEngine

    x, y, users = _data()
    user_level = job.get("user_level", False)
    rows = [{"x": x[i], "y": y[i], "user": users[i]} for i in range(N)]
    engine = PrivacyEngine(reproducible_seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    module, opt, crit, dl = engine.make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(rows, batch_size=3 if user_level else 8),
        noise_multiplier=0.8, max_grad_norm=0.5, steps=job.get("steps", 4), max_physical_batch_size=3,
        user_ids="user" if user_level else None, max_rows_per_user=2, max_batch_size=job.get("max_batch_size"),
        mechanism=job.get("mechanism", "gaussian"), bands=job.get("bands"))
    if resume_from is not None:
        engine.load_noise_state(resume_from)
    while opt.logical_steps < upto:
        for b in dl:
            t = str(opt.current_step)
            log["micro"][t] = log["micro"].get(t, 0) + 1
            opt.zero_grad()
            crit(module(b["x"]), b["y"]).backward()
            opt.step()
            if opt.logical_steps >= upto:
                break
    return engine, dl


def run_job(job: dict, out_dir: Path = Path(".")) -> dict:
    """``job["stop_at"]`` = k: the loop saves after step k (the noise state with
    ``save_noise_state`` and the sharded weights with ``torch.distributed.checkpoint``, every rank),
    and a fresh model, engine and ``make_private`` resume it (``load_noise_state``) to the end.
    ``job["save_only"]``: stop after that save. ``job["resume"]``: the folder of such a save (another
    world's) to resume from instead."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from dpft.api import loader as loader_mod

    model = sharded_model()
    log: dict = {"batches": {}, "shares": {}, "micro": {}}
    real_share = loader_mod._PoissonMicroBatches.share

    def share(self, idx):
        mine = real_share(self, idx)
        t = str(self.next_step - 1)
        log["batches"][t] = [int(i) for i in idx]
        log["shares"][t] = [int(i) for i in mine]
        return mine

    def restore(folder: Path):
        fresh = sharded_model()  # the same initial weights, then the saved ones
        sd = get_model_state_dict(fresh)
        dcp.load({"model": sd}, checkpoint_id=str(folder / "model"))
        set_model_state_dict(fresh, sd)
        return fresh

    loader_mod._PoissonMicroBatches.share = share
    steps, stop = job.get("steps", 4), job.get("stop_at")
    try:
        if job.get("resume"):
            model = restore(Path(job["resume"]))
            engine, dl = _train(job, model, steps, log, resume_from=Path(job["resume"], "noise.pt"))
        elif stop:
            engine, dl = _train(job, model, stop, log)
            engine.save_noise_state(out_dir / "noise.pt")  # every rank: the buffers are gathered
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out_dir / "model"))
            log["state_mode"] = (out_dir / "noise.pt").stat().st_mode & 0o777 if (out_dir / "noise.pt").exists() \
                else None
            if not job.get("save_only"):  # else another world resumes it (job["resume"])
                engine.detach()
                model = restore(out_dir)
                engine, dl = _train(job, model, steps, log, resume_from=out_dir / "noise.pt")
        else:
            engine, dl = _train(job, model, steps, log)
    finally:
        loader_mod._PoissonMicroBatches.share = real_share
    log["ledger"] = engine.ledger.to_json()
    log["epsilon"] = engine.get_epsilon(1e-3)
    log["weights"] = {n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()}
    log["world_size"], log["rank"] = dl.world_size, dl.rank
    engine.detach()
    return log


def run_trainer_job(job: dict, out_dir: Path) -> dict:
    """A reproducible DPTrainer run (tiny BERT of the audit, ``fully_shard`` on each ``BertLayer``
    and the root) — at example or user level; logs the ledger, the shares and the gathered weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import PrinterCallback, TrainingArguments
    import torch.distributed as dist

    from dpft.audit.ways_in_ddp import USER_COLUMN, make_rows, pad_collate, record_shares, tiny_model
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    model = tiny_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if type(m).__name__ == "BertLayer":
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    users = [i % 7 for i in range(30)] if job.get("user_level") else None
    rows = make_rows(30, users)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=3, learning_rate=0.5, lr_scheduler_type="constant",
                             optim="sgd", weight_decay=0.0, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, label_names=["labels"])
    dp = DPArguments(target_delta=1e-3, noise_multiplier=0.8, max_grad_norm=0.5, expected_batch_size=6,
                     reproducible_seed=3, max_physical_batch_size=2, user_column=USER_COLUMN if users else None,
                     max_rows_per_user=2)
    tr = DPTrainer(model=model, args=args, train_dataset=rows, data_collator=pad_collate, dp_args=dp)
    tr.remove_callback(PrinterCallback)
    log: dict = {"batches": {}, "shares": {}, "sharded": tr.sharded}
    record_shares(tr, log)
    tr.train()
    log["ledger"] = tr.ledger.to_json()
    log["weights"] = {n: p.full_tensor().detach().flatten().tolist() for n, p in tr.engine.params.items()}
    log["world_size"] = tr.world.world_size
    return log


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: (run_trainer_job(job, Path(cfg.get("out", "."), f"{name}-{rank}")) if job.get("trainer")
                           else run_job(job, Path(cfg.get("out", "."), name))) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (FSDP2 needs it before make_private)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
