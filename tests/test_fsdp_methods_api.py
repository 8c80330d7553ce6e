"""Method plug-ins with ``make_private`` and ``DPTrainer`` on an FSDP2 (``fully_shard``) model (issue 38;
dpft/placement/fsdp_methods.py): RMT denoising (the noisy gradient's row shards gathered per matrix, denoised on
every rank, this rank's rows kept) and DP-Adam-AC's adaptive clipping (the noisy count from the world's
all-reduced counts and the shared key; its σ_Δ mechanism sharded). 2 CPU processes (gloo) against 1
process (a 1-process gloo group, the same sharded step): the same ledger and ε, the same released
statistics per step (RMT's touched layers, the C used, the private clip rate), the gathered weights
within float tolerance."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

import fsdp_methods_worker as worker  # tests/fsdp_methods_worker.py: what each rank runs
from test_ddp import one_then_two

multiprocessing.set_forkserver_preload(["fsdp_methods_worker", "dpft", "dpft.api", "torch.distributed.fsdp"])

RMT = [{"name": "rmt", "method": "rmt", "kappa": 1.0, "min_dim": 1}]
ADACLIP = [{"name": "dp_adam_ac", "adaptive_clip": True, "count_noise": 2.0, "clip_lr": 0.5}]
DPSFT_NONE = [{"name": "dpsft", "source": "none", "paper_noise_placement": True}]  # the σB Gaussian alone
JOBS = {"api_rmt": {"methods": RMT}, "api_adaclip": {"methods": ADACLIP}, "api_dpsft_none": {"methods": DPSFT_NONE},
        "trainer_rmt": {"methods": RMT, "trainer": True}, "trainer_adaclip": {"methods": ADACLIP, "trainer": True},
        # TrainingArguments.fsdp (FSDP2): DPTrainer shards the unsharded model itself (1 process: nothing to shard)
        "trainer_args_rmt": {"methods": RMT, "trainer": True, "fsdp_args": True},
        "trainer_args_adaclip": {"methods": ADACLIP, "trainer": True, "fsdp_args": True}}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    return one_then_two(worker, JOBS, tmp_path_factory.mktemp("fsdp_methods_api"))


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_methods_fsdp2_two_processes_equal_one(one_and_two, job):
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"]) == (1, 2)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert sum(e["count"] for e in a["ledger"]["entries"]) == (3 if "trainer" in job else 4)
    if "epsilon" in a:
        assert r0["epsilon"] == r1["epsilon"] == a["epsilon"]
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    assert a["weights"]
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)
    for key in ("method_stats", "released"):
        assert len(a[key]) == len(r0[key]) == len(r1[key]) > 0
        for x, y, z in zip(a[key], r0[key], r1[key]):
            _close(x, y)
            assert y == z
    if "rmt" in job:  # the sharded step gathers the rows for the SVD (fsdp_methods.WholeTensors)
        assert r0["transforms"] == ["WholeTensors"]
        assert a["transforms"] == (["function"] if "args" in job else ["WholeTensors"])
        assert sum(r.get("rmt/touched", 0) for r in a["released"]) > 0  # the denoiser changed a matrix
    if "adaclip" in job:
        assert all({"clip_norm", "clip_rate_private"} <= set(s) for s in a["method_stats"])
        assert len({s["clip_norm"] for s in a["method_stats"]}) > 1  # C moved
