"""DPDPOTrainer under FSDP2 in the three cells of docs/ways_in.md that ran through a tested path but had no
test of their own (issue 38 item 1):

- user level (``DPArguments(user_column=...)``, a user's pairs one privacy unit) on a policy the caller
  sharded with ``fully_shard`` (no ``fsdp=``), against the 1-process ``fsdp=`` run at user level;
- user level through accelerate's FSDP2 environment (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, the
  transformer wrap policy: what ``accelerate launch`` with an FSDP2 config sets), 2 processes against 1,
  and the 1-process run equal to the ``fsdp=`` one;
- ``resume_from_checkpoint`` of a DPDPOTrainer the caller sharded (pairs; AdamW stopped after its checkpoint
  at step 2 of 4 on 2 processes, resumed by a new trainer on a freshly sharded policy) against the
  uninterrupted run and the 1-process ``fsdp=`` run (integrations/hf/fsdp.py ``load_full_into_shards``:
  rank 0 reads the checkpoint and broadcasts it; a checkpoint it refuses is refused on every rank).

Workers reused: tests/trl_fsdp_worker.py (``user_level``, ``user_sharded``, ``env``) and
tests/sft_fsdp_worker.py (``run_resume`` with ``dpo`` and ``caller_sharded``), both in one 2-process launch.
2 CPU processes (gloo): the same ledger (q over users at user level), the same logical batches, disjoint
covering shares (whole users per rank), the gathered trainable weights within float tolerance (SGD: 1e-5
relative, 1e-6 absolute; AdamW across worlds: tests/test_sft_fsdp.py ``ADAMW_ACROSS_WORLDS``).
"""

from __future__ import annotations

import json
import multiprocessing
import re

import pytest
import torch
import torch.distributed as dist

import sft_fsdp_worker
import trl_fsdp_worker as worker  # tests/trl_fsdp_worker.py: the run each rank makes
from test_ddp import free_port
from test_sft_fsdp import ADAMW_ACROSS_WORLDS, _close

pytest.importorskip("trl")
multiprocessing.set_forkserver_preload(["trl_fsdp_worker", "sft_fsdp_worker", "hf_fsdp_worker", "dpft",
                                        "dpft.integrations.trl.trainer", "torch.distributed.fsdp"])

#: Equality jobs: the name of each 2-process run, its job, and the 1-process job it is compared with.
USER = {"dpo_user": {"dpo": True, "user_level": True},
        "dpo_user_env": {"dpo": True, "user_level": True, "env": True}}
CALLER_USER = {"dpo_user_caller_sharded": {"dpo": True, "user_level": True, "user_sharded": True}}
COMPARED_WITH = {"dpo_user_caller_sharded": "dpo_user", "dpo_user_env": "dpo_user_env"}
#: Resume of a DPDPOTrainer the caller sharded (pairs, AdamW, 4 steps, a checkpoint at 2).
RESUME = {"dpo_caller_resume": {"dpo": True, "caller_sharded": True, "resume_test": True}}
RESUME_BASE = {"dpo": True, "steps": 4, "optim": "adamw_torch", "checkpoint": True}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("dpo_fsdp_cells")
    one = worker.run_jobs({"jobs": USER, "out": str(root / "one")}, 0)["jobs"]
    one["dpo_caller_resume"] = sft_fsdp_worker.run_job(RESUME_BASE, root / "one" / "resume")  # fsdp=, 1 process
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": {**CALLER_USER, "dpo_user_env": USER["dpo_user_env"], **RESUME, "refusals": {"refusals": True}},
           "log_dir": str(logs),
           "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    return one, [json.loads((logs / f"rank{r}.json").read_text())["jobs"] for r in range(2)]


@pytest.mark.slow  # the module: about 4 min on 2 shared cores (3 trainers in 1 process, then 5 in 2)
@pytest.mark.parametrize("job", list(COMPARED_WITH))
def test_dpo_user_level_fsdp2_two_processes_equal_one(one_and_two, job):
    """User level on a policy the caller sharded (no ``fsdp=``) and through accelerate's FSDP2 environment:
    FSDPStep on every rank with the FSDP units (1 decoder layer + root), accelerate never handed FSDP, the
    same ledger over users (q = 3/5), the same logical batches, whole users per rank (disjoint, covering,
    at most k = 2 pairs per sampled user), the ranks' weights identical and within float tolerance of one
    process's."""
    one, two = one_and_two
    a = one[COMPARED_WITH[job]]
    r0, r1 = (log[job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    for log in (a, r0, r1):
        assert log["user_level"] and log["sharded"] and log["fsdp_step"] and log["step"] == "FSDPStep"
        assert not log["accelerate_fsdp"] and not log["args_fsdp"]
    assert a["fsdp_units"] == 0 and r0["fsdp_units"] == r1["fsdp_units"] == 2
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    entries = a["ledger"]["entries"]
    assert sum(e["count"] for e in entries) == 3
    assert entries[0]["event"]["sampling_probability"] == pytest.approx(3 / 5)  # users, not pairs
    users = sft_fsdp_worker.USERS
    both = False
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        assert not {users[i] for i in s0} & {users[i] for i in s1}  # whole users per rank
        assert max(sum(users[i] == u for i in full) for u in set(users)) <= 2
        both = both or bool(s0 and s1)
    assert both  # both ranks clipped users' pairs in some step
    assert r0["ref_logps"] == r1["ref_logps"]  # the reference pass: rank 0's values everywhere
    torch.testing.assert_close(torch.tensor(r0["ref_logps"]), torch.tensor(a["ref_logps"]), rtol=1e-6, atol=1e-6)
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    _close(a["weights"], r0["weights"])
    init = _initial_weights()
    assert set(init) == set(a["weights"])
    assert any(not torch.equal(torch.tensor(r0["weights"][n]), w) for n, w in init.items())  # trained
    if job == "dpo_user_env":  # accelerate's FSDP2 environment runs the step DPOConfig(fsdp=...) runs
        ref = one["dpo_user"]
        assert a["ledger"] == ref["ledger"] and a["batches"] == ref["batches"] and a["weights"] == ref["weights"]


def _initial_weights() -> dict:
    """The tiny Llama's initial weights (seeded: what every worker's policy starts from), flat."""
    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer

    return {n: p.detach().flatten() for n, p in tiny_llama(len(tiny_tokenizer())).named_parameters()}


@pytest.mark.slow
def test_caller_sharded_dpdpotrainer_resume_equals_the_uninterrupted_run(one_and_two):
    """DPDPOTrainer on a tiny Llama the caller sharded (decoder layer + root; pairs), AdamW stopped after the
    checkpoint at step 2 of 4 on 2 processes and resumed by a new trainer (``resume_from_checkpoint``: the
    policy's full tensors loaded straight into the shards, the optimizer's full state): the resumed run's
    ledger equals the uninterrupted run's and the 1-process ``fsdp=`` run's (4 releases), its weights equal
    the uninterrupted run's within float tolerance, both equal the 1-process run's within the AdamW-across-
    worlds tolerance, and the ranks agree."""
    one, two = one_and_two
    a = one["dpo_caller_resume"]
    r0, r1 = (log["dpo_caller_resume"] for log in two)
    assert sum(e["count"] for e in a["ledger"]["entries"]) == 4 and a["world_size"] == 1
    for r in (r0, r1):
        assert sum(e["count"] for e in r["first_ledger"]["entries"]) == 2  # the first run stopped at its checkpoint
        res = r["resumed"]
        assert res["sharded"] and res["fsdp_step"] and not res["args_fsdp"] and res["world_size"] == 2
        assert res["fsdp_units"] == 2  # the caller's: 1 decoder layer + root
        assert res["ledger"] == r["whole"]["ledger"] == a["ledger"]
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)
    _close(a["weights"], r0["whole"]["weights"], **ADAMW_ACROSS_WORLDS)


@pytest.mark.slow
def test_caller_sharded_resume_refusals_reach_every_rank(one_and_two):
    """Rank 0 alone reads the checkpoint (``load_full_into_shards``): a folder without weights and another
    model's checkpoint are refused on both ranks with rank 0's reason (rank 1 does not wait in the broadcast)."""
    _, two = one_and_two
    r0, r1 = (log["refusals"] for log in two)
    assert r0 == r1
    assert r0["empty"][0] == "ValueError" and "holds no model.safetensors" in r0["empty"][1]
    assert r0["foreign"][0] == "ValueError"
    assert re.search(r"holds no weights for the trainable parameters .*another model", r0["foreign"][1])
