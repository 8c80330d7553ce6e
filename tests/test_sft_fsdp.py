"""DPSFTTrainer and DPDPOTrainer (TRL) under FSDP2 on 2 CPU processes (gloo) against 1 process (issue 38
item 1; the cells of docs/ways_in.md that were only run sharded in one process or not at all): ``SFTConfig(fsdp=True,
fsdp_config={"fsdp_version": 2})`` at example level and at user level (``DPArguments(user_column=...)``),
and a policy the caller sharded with ``fully_shard`` (no ``fsdp=``) at both units, compared with the
``fsdp=`` run of one process (the same step and noise layout: nothing is sharded in one process);
truncated Poisson (``max_batch_size``) for DPSFTTrainer and DPDPOTrainer; banded MF with AdamW stopped
after its checkpoint and resumed (``resume_from_checkpoint``) = the uninterrupted run, for both trainers.

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
multiprocessing.set_forkserver_preload(["sft_fsdp_worker", "hf_fsdp_worker", "dpft", "dpft.integrations.trl.trainer",
                                        "torch.distributed.fsdp"])

JOBS = {"sft": {}, "sft_user": {"user_level": True},
        "caller_sharded": {"caller_sharded": True},
        "caller_sharded_user": {"caller_sharded": True, "user_level": True},
        "sft_truncated": {"max_batch_size": 3}, "dpo_truncated": {"dpo": True, "max_batch_size": 3}}
#: No FSDP: DPSFTTrainer at user level in the DDP world (2 processes) against the plain 1-process step.
DDP = {"ddp_sft_user": {"ddp": True, "user_level": True}}
#: Banded MF (b = 2) with AdamW, stopped after the checkpoint at step 2 and resumed by a new trainer.
RESUME = {"sft_banded_resume": {"banded": True, "resume_test": True},
          "dpo_banded_resume": {"dpo": True, "banded": True, "resume_test": True}}
#: Jobs that run on 2 processes only, and the 1-process fsdp= job each is compared with.
TWO_ONLY = {"caller_sharded": "sft", "caller_sharded_user": "sft_user"}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("sft_fsdp")
    one = worker.run_jobs({"jobs": {**{k: v for k, v in JOBS.items() if k not in TWO_ONLY}, **RESUME, **DDP},
                           "out": str(root / "one")}, 0)
    for job, same in TWO_ONLY.items():
        one["jobs"][job] = one["jobs"][same]
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": {**JOBS, **RESUME, **DDP}, "log_dir": str(logs), "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return one, two


@pytest.mark.slow  # about 3 min on 2 shared cores for the module (10 trainers in 1 process, then 12 in 2)
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
    users = worker.USERS
    if job.endswith("_truncated"):  # the truncated event, q = 4/12 (rows or pairs), at most 3 units per batch
        assert entries[0]["event"]["type"] == "TruncatedSubsampledGaussianDpEvent"
        assert all(len(b) <= 3 for b in a["batches"].values())
    else:
        q = entries[0]["event"]["sampling_probability"]
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


#: AdamW across worlds (as tests/test_hf_fsdp.py ADAMW_ACROSS_WORLDS: the reduce-scatter's summation order,
#: amplified by m/√v where a noisy gradient coordinate is near zero); within one world the strict tolerance.
ADAMW_ACROSS_WORLDS = {"rtol": 1e-4, "atol": 5e-5}


def _close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a and set(a) == set(b)
    for n, w in a.items():
        torch.testing.assert_close(torch.tensor(b[n]), torch.tensor(w), rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("job", list(RESUME))
def test_trl_fsdp2_banded_resume_equals_the_uninterrupted_run(one_and_two, job):
    """Banded MF (b = 2) under fsdp=, AdamW, stopped after the checkpoint at step 2 and resumed by a new
    DPSFTTrainer / DPDPOTrainer (``resume_from_checkpoint``): the resumed run's ledger and weights equal the
    uninterrupted run's, in 1 process and on 2 (each rank keeping its slice of the gathered noise buffers),
    and the 2-process runs equal the 1-process one."""
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    kinds = [e["event"]["type"] for e in a["whole"]["ledger"]["entries"] for _ in range(e["count"])]
    assert kinds == ["PoissonSampledDpEvent", "NoOpDpEvent"] * 2  # b = 2: a participation every other step
    for r in (a, r0, r1):
        assert r["first_ledger"]["entries"][0]["count"] == 1 and len(r["first_ledger"]["entries"]) == 2
        assert r["resumed"]["mechanism"] == r["whole"]["mechanism"] == "ShardedBandedMFMechanism"
        assert r["resumed"]["fsdp_step"] and r["resumed"]["ledger"] == r["whole"]["ledger"] == a["whole"]["ledger"]
    assert r0["resumed"]["fsdp_units"] == r1["resumed"]["fsdp_units"] == 2
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    _close(a["whole"]["weights"], a["resumed"]["weights"])
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["whole"]["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)


@pytest.mark.slow
def test_dpsfttrainer_user_level_ddp_two_processes_equal_one(one_and_two):
    """DPSFTTrainer at user level under DDP (no FSDP; every rank the whole model): the same ledger over
    users, the same logical batches, whole users per rank, the ranks' weights identical and within float
    tolerance of the 1-process run's (DDP and one process draw the same noise streams)."""
    one, two = one_and_two
    a = one["jobs"]["ddp_sft_user"]
    r0, r1 = (log["jobs"]["ddp_sft_user"] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    for log in (a, r0, r1):
        assert log["user_level"] and not log["sharded"] and not log["fsdp_step"] and log["fsdp_units"] == 0
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert a["ledger"]["entries"][0]["event"]["sampling_probability"] == pytest.approx(3 / 5)
    users = worker.USERS
    both = False
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        assert not {users[i] for i in s0} & {users[i] for i in s1}
        both = both or bool(s0 and s1)
    assert both
    assert r0["weights"] == r1["weights"]
    _close(a["weights"], r0["weights"])


@pytest.mark.slow  # about 26 s on 2 shared cores (3 trainers)
def test_resume_of_a_model_the_caller_sharded_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """DPTrainer on a model the caller sharded with ``fully_shard`` (a 1-process gloo group: DTensor
    parameters, one rank holding every shard): ``resume_from_checkpoint`` loads the checkpoint's full
    tensors straight into the shards (hf_fsdp.py ``load_full_into_shards``) and the optimizer's full state;
    AdamW stopped after the checkpoint at step 2 of 4 and resumed = the uninterrupted run (the same ledger,
    weights within float tolerance, trained away from the initial weights). 2 processes:
    tests/test_resume_sharded.py. A checkpoint without the model's trainable weights is refused."""
    import resume_sharded_worker  # tests/resume_sharded_worker.py

    from dpft.audit import ways_in_ddp as hd
    from dpft.integrations.hf.fsdp import load_full_into_shards

    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        out = resume_sharded_worker.run_resume({}, tmp_path)
        other = torch.nn.Linear(2, 2)
        resume_sharded_worker._caller_shard(other)
        with pytest.raises(ValueError, match=r"holds no weights for the trainable parameters.*another model"):
            load_full_into_shards(other, str(tmp_path / "run" / "checkpoint-2"))
        with pytest.raises(ValueError, match=r"holds no model.safetensors"):
            load_full_into_shards(other, str(tmp_path))
    finally:
        dist.destroy_process_group()
    resumed, whole = out["resumed"], out["whole"]
    assert resumed["sharded"] and resumed["fsdp_step"] and not resumed["args_fsdp"]
    assert resumed["ledger"] == whole["ledger"] and sum(e["count"] for e in resumed["ledger"]["entries"]) == 4
    assert sum(e["count"] for e in out["first_ledger"]["entries"]) == 2
    _close(whole["weights"], resumed["weights"])
    init = dict(hd.tiny_model().named_parameters())
    assert not torch.allclose(init["classifier.weight"], torch.tensor(resumed["weights"]["classifier.weight"]).view_as(
        init["classifier.weight"]))


# -- fast -------------------------------------------------------------------------------------------------
def test_dpsfttrainer_user_level_in_one_process_counts_users(tmp_path):
    """DPSFTTrainer at user level with no FSDP and no process group (the plain 1-process step): the ledger's
    q counts users (3 of 5), every logical batch holds at most k = 2 rows of a user, the user ids ride
    through TRL's dataset preparation, and the step moves the weights."""
    from trl import SFTConfig

    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.trl.trainer import DPSFTTrainer

    tok = tiny_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, learning_rate=0.5, optim="sgd", report_to=[], use_cpu=True,
                     per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True, max_length=64,
                     dataset_num_proc=None, bf16=False)
    tr = DPSFTTrainer(model=tiny_llama(len(tok)), args=args, train_dataset=worker._rows(True), processing_class=tok,
                      dp_args=worker._dp_args({}, True))
    assert tr.user_level and type(tr.dp_step).__name__ != "FSDPStep"
    before = {n: p.detach().clone() for n, p in tr.engine.params.items()}
    log: dict = {"batches": {}, "shares": {}}
    from dpft.audit.ways_in_ddp import record_shares

    record_shares(tr, log)
    tr.train()
    ev = tr.ledger.to_json()["entries"]
    assert sum(e["count"] for e in ev) == 2 and ev[0]["event"]["sampling_probability"] == pytest.approx(3 / 5)
    users = worker.USERS
    assert len(log["batches"]) == 2
    for full in log["batches"].values():
        assert max(sum(users[i] == u for i in full) for u in set(users)) <= 2
    assert any(not torch.equal(p.detach(), before[n]) for n, p in tr.engine.params.items())
