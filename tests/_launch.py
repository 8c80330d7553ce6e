"""What every forked test rank does around its jobs (the 2-process workers: ddp_api_worker,
fsdp_api_worker, hf_fsdp_worker): torchrun's environment for rank ``i`` of a world on 127.0.0.1,
one thread per rank (the CI machine has 2 cores), and, for the FSDP workers, a gloo group that
FSDP2 needs before the model is sharded."""

from __future__ import annotations

import os
from typing import Callable


def torchrun_env(i: int, port: int, world_size: int) -> None:
    """The environment ``torchrun`` sets for rank ``i`` (and one intra-op thread)."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def gloo_entry(run_jobs: Callable[[dict, int], object], i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Rank ``i``: torchrun's environment, a gloo group, ``run_jobs(cfg, i)``, the group destroyed."""
    import torch.distributed as dist

    torchrun_env(i, port, world_size)
    dist.init_process_group("gloo", rank=i, world_size=world_size)
    try:
        run_jobs(cfg, i)
    finally:
        dist.destroy_process_group()
