"""One rank of ``PrivacyEngine.make_private`` loops under ``torch.distributed``, for
tests/test_ddp_api.py (not a test file). Also run in-process as the 1-process reference.

:func:`run_jobs` runs, in one world, each job of ``cfg["jobs"]``: a reproducible make_private loop
on a tiny MLP (rank r initialises it from seed ``r``: the world must start from rank 0's weights),
at example level or at user level (``user_ids`` a field of dict rows), or with banded-MF noise
(``mechanism``/``bands``: the secret buffers and partition are logged), logging per logical step the
world's batch and this rank's share, and at the end the ledger, ε, the weights and whether
``save_ledger`` wrote (each rank saves into its own directory: only rank 0's may fill). With
``probe`` it also checks that a ``DistributedDataParallel``-wrapped model is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import torchrun_env

N, D, CLASSES = 40, 6, 3


def _data():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    x[3] *= 30.0  # a large input: a clipped example
    y = torch.randint(0, CLASSES, (N,), generator=g)
    users = [int(i * 7 % 9) for i in range(N)]  # 9 users of 4-5 rows, not contiguous
    return x, y, users


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, CLASSES))


def run_job(job: dict, rank: int, out_dir: Path) -> dict:
    """One make_private loop; returns its log (see the module docstring)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from dpft import PrivacyEngine
    from dpft.api import loader as loader_mod

    x, y, users = _data()
    user_level = job.get("user_level", False)
    rows = [{"x": x[i], "y": y[i], "user": users[i]} for i in range(N)]
    model = _model(rank)
    log: dict = {"batches": {}, "shares": {}}
    real_share = loader_mod._PoissonMicroBatches.share

    def share(self, idx):
        mine = real_share(self, idx)
        t = str(self.next_step - 1)
        log["batches"][t] = [int(i) for i in idx]
        log["shares"][t] = [int(i) for i in mine]
        return mine

    loader_mod._PoissonMicroBatches.share = share
    try:
        engine = PrivacyEngine(reproducible_seed=job.get("seed", 7))  # "seed": None = secure mode
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        module, opt, crit, dl = engine.make_private(
            module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(rows, batch_size=3 if user_level else 8),
            noise_multiplier=job.get("sigma", 0.8), max_grad_norm=0.5, steps=job.get("steps", 5),
            max_physical_batch_size=3, user_ids="user" if user_level else None, max_rows_per_user=2,
            user_clipping=job.get("user_clipping", "group"), mechanism=job.get("mechanism", "gaussian"),
            bands=job.get("bands"))
        while opt.logical_steps < job.get("steps", 5):
            for b in dl:
                opt.zero_grad()
                crit(module(b["x"]), b["y"]).backward()
                opt.step()
    finally:
        loader_mod._PoissonMicroBatches.share = real_share
    mech = opt.dp_step.spec.mechanism  # banded_mf: the secret noise buffers (must agree across ranks)
    log["buffers"] = [{k: v.flatten().tolist() for k, v in b.items()} for b in getattr(mech, "buffers", [])]
    log["partition"] = getattr(getattr(mech, "sampler", None), "partition", torch.zeros(0)).tolist()
    log["ledger"] = engine.ledger.to_json()
    log["epsilon"] = engine.get_epsilon(1e-3)
    log["weights"] = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    log["wrote"] = engine.save_ledger(out_dir / "ledger.json")
    log["world_size"], log["rank"] = dl.world_size, dl.rank
    engine.detach()
    return log


def probe_ddp_wrapper() -> str:
    """make_private on a DistributedDataParallel-wrapped model: the error message ("" if accepted)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from dpft import PrivacyEngine

    model = DistributedDataParallel(_model(0))
    x, y, _ = _data()
    try:
        PrivacyEngine(reproducible_seed=0).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
            noise_multiplier=1.0, max_grad_norm=1.0, steps=1)
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return ""


def run_jobs(cfg: dict, rank: int) -> dict:
    """Every job of ``cfg`` on this rank; writes ``log_dir/rank<r>.json`` and returns it."""
    out = {"jobs": {}}
    cwd = Path(cfg["cwds"][rank])
    cwd.mkdir(parents=True, exist_ok=True)
    for name, job in cfg["jobs"].items():
        out["jobs"][name] = run_job(job, rank, cwd / name)
    if cfg.get("probe"):
        out["ddp_wrapper"] = probe_ddp_wrapper()
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: the environment torchrun sets, then the jobs (make_private creates the group)."""
    torchrun_env(i, port, world_size)
    try:
        run_jobs(cfg, i)
    finally:
        from dpft.placement import world as ddp

        ddp.shutdown()
