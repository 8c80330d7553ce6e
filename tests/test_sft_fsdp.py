"""DPSFTTrainer (TRL) under FSDP2 on 2 CPU processes (gloo) against 1 process (issue 38 item 1; the cells of
docs/ways_in.md that were only run sharded in one process or not at all): ``SFTConfig(fsdp=True,
fsdp_config={"fsdp_version": 2})`` at example level and at user level (``DPArguments(user_column=...)``),
and a policy the caller sharded with ``fully_shard`` (no ``fsdp=``) at both units, compared with the
``fsdp=`` run of one process (the same step and noise layout: nothing is sharded in one process).

The same ledger (q over users at user level), the same logical batches, disjoint covering shares (whole
users per rank at user level, at most k = 2 rows per sampled user), FSDPStep on every rank with dpft's
FSDP units (the tiny Llama's decoder layer + root) and no accelerate FSDP, the gathered trainable weights
within float tolerance (1e-5 relative, 1e-6 absolute: the reduce-scatter's summation order).
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist

import sft_fsdp_worker as worker  # tests/sft_fsdp_worker.py: the run each rank makes
from test_ddp import free_port

pytest.importorskip("trl")
multiprocessing.set_forkserver_preload(["sft_fsdp_worker", "hf_fsdp_worker", "dpft", "dpft.integrations.trl",
                                        "torch.distributed.fsdp"])

JOBS = {"sft": {}, "sft_user": {"user_level": True},
        "caller_sharded": {"caller_sharded": True},
        "caller_sharded_user": {"caller_sharded": True, "user_level": True}}
#: Jobs that run on 2 processes only, and the 1-process fsdp= job each is compared with.
TWO_ONLY = {"caller_sharded": "sft", "caller_sharded_user": "sft_user"}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("sft_fsdp")
    one = worker.run_jobs({"jobs": {k: v for k, v in JOBS.items() if k not in TWO_ONLY}, "out": str(root / "one")}, 0)
    for job, same in TWO_ONLY.items():
        one["jobs"][job] = one["jobs"][same]
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": JOBS, "log_dir": str(logs), "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return one, two


@pytest.mark.slow  # about 60–90 s on 2 shared cores (2 trainers in 1 process, then 4 in 2)
@pytest.mark.parametrize("job", list(JOBS))
def test_dpsfttrainer_fsdp2_two_processes_equal_one(one_and_two, job):
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    for log in (a, r0, r1):
        assert log["sharded"] and log["fsdp_step"] and log["step"] == "FSDPStep"
        assert not log["accelerate_fsdp"] and not log["args_fsdp"]
        assert log["user_level"] == job.endswith("_user")
    assert a["fsdp_units"] == 0 and r0["fsdp_units"] == r1["fsdp_units"] == 2  # 1 LlamaDecoderLayer + root
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    entries = a["ledger"]["entries"]
    assert sum(e["count"] for e in entries) == 3
    q = entries[0]["event"]["sampling_probability"]
    users = worker.USERS
    assert q == pytest.approx(3 / len(set(users)) if job.endswith("_user") else 4 / len(users))
    both = False
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        both = both or bool(s0 and s1)
        if job.endswith("_user"):  # whole users per rank, at most k = 2 rows per sampled user
            assert not {users[i] for i in s0} & {users[i] for i in s1}
            assert max(sum(users[i] == u for i in full) for u in set(users)) <= 2
    assert both  # both ranks clipped rows in some step
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    assert a["weights"] and a["weights"].keys() == r0["weights"].keys()
    moved = False
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)
        moved = moved or any(x != 0 for x in w)
    assert moved
