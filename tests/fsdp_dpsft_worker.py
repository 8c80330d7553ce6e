"""One rank of DP-SFT (``subspace.source: file``) through ``make_private`` and ``DPTrainer`` on an FSDP2 model,
for tests/test_fsdp_dpsft.py (not a test file); also run in-process, on a 1-process gloo group, as the reference.

The make_private job is tests/fsdp_methods_worker.py's (a ``fully_shard``-ed MLP; it logs the module's gathered
weights). The DPTrainer job is that worker's run too, but logs the weights the step updates
(``dp_step.params``: for DP-SFT the spanned model parameters, not the engine's k coordinates) and their
values before training, so the test can see that they moved.
"""

from __future__ import annotations

import json
from pathlib import Path

from _launch import gloo_entry
import fsdp_methods_worker as methods_worker


def _full(params) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
            for n, p in params.items()}


def run_trainer_job(job: dict, out_dir: Path) -> dict:
    """fsdp_methods_worker's DPTrainer run (3 logical steps), logging ``dp_step.params`` before and after."""
    from dpft.integrations.hf import trainer as hf

    seen: dict = {}
    real_train = hf.DPTrainer.train

    def train(self, *a, **kw):
        seen["trainer"], seen["init"] = self, _full(self.dp_step.params)  # a collective: every rank
        return real_train(self, *a, **kw)

    hf.DPTrainer.train = train
    try:
        log = methods_worker.run_trainer_job(job, out_dir)
    finally:
        hf.DPTrainer.train = real_train
    log["init"], log["weights"] = seen["init"], _full(seen["trainer"].dp_step.params)
    return log


def run_jobs(cfg: dict, rank: int) -> dict:
    out = {"jobs": {name: (run_trainer_job(job, Path(cfg.get("out", "."), f"{name}-{rank}")) if job.get("trainer")
                           else methods_worker.run_api_job(job)) for name, job in cfg["jobs"].items()}}
    if cfg.get("log_dir"):
        Path(cfg["log_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    return out


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment and a gloo group (FSDP2 needs it before make_private)."""
    gloo_entry(run_jobs, i, cfg, port, world_size)
