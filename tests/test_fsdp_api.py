"""``make_private`` on a model sharded with FSDP2 (``fully_shard``; api/sharded.py, issue 38 item 1):
2 CPU processes (gloo) against 1 process (a 1-process gloo group, the same sharded step) of the same
reproducible loop — the same ledger and ε, the same logical batches (the shares are disjoint and cover
each), every rank running the same number of micro-batches per step (a short rank runs placeholders),
and the gathered weights within float tolerance — at example level, with truncated Poisson and at
user level; banded MF (correlated noise, per-shard buffers) uninterrupted, and stopped after step 2,
saved (``save_noise_state`` on every rank, the weights by ``torch.distributed.checkpoint``) and resumed
— on 2 processes, and a 2-process save resumed by 1 process — equal to 1 process uninterrupted.
Refusal: a model whose root is not sharded."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_api_worker as worker  # tests/fsdp_api_worker.py: the loop each rank runs
from test_ddp import free_port

# The ranks' fork server imports torch and dpft once (not once per rank).
multiprocessing.set_forkserver_preload(["fsdp_api_worker", "dpft", "dpft.api", "torch.distributed.fsdp"])

JOBS = {"example": {}, "truncated": {"max_batch_size": 7}, "user": {"user_level": True}}
#: DPTrainer on a fully_shard-ed tiny BERT (integrations/hf/fsdp.py), in the same worlds.
TRAINER_JOBS = {"trainer": {"trainer": "hf"}, "trainer_user": {"trainer": "hf", "user_level": True}}
#: make_private + banded MF under FSDP2: uninterrupted; stopped after step 2, saved and resumed; saved only
#: (2 processes; resumed by 1 process in the test).
_BANDED = {"mechanism": "banded_mf", "bands": 2}
BANDED_JOBS = {"banded": _BANDED, "banded_resume": {**_BANDED, "stop_at": 2}}
SAVED_JOBS = {"banded_saved": {**_BANDED, "stop_at": 2, "save_only": True}}


def _one_process_group():
    port = free_port()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("fsdp_api")
    _one_process_group()
    try:
        one = worker.run_jobs({"jobs": {**JOBS, **TRAINER_JOBS, **BANDED_JOBS}, "out": str(root / "one")}, 0)
    finally:
        dist.destroy_process_group()
    one["root"] = str(root)
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": {**JOBS, **TRAINER_JOBS, **BANDED_JOBS, **SAVED_JOBS}, "log_dir": str(logs),
           "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return one, two


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_make_private_fsdp2_two_processes_equal_one(one_and_two, job):
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert sum(e["count"] for e in a["ledger"]["entries"]) == 4
    if job == "truncated":
        assert a["ledger"]["entries"][0]["event"]["type"] == "TruncatedSubsampledGaussianDpEvent"
    assert r0["epsilon"] == r1["epsilon"] == a["epsilon"]
    short = False
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        assert r0["micro"].get(t) == r1["micro"].get(t)  # the same number of forwards on every rank
        short |= -(-len(s0) // 3) != -(-len(s1) // 3) if job != "user" else len(s0) != len(s1)
    assert short  # some step ran a placeholder micro-batch on one rank
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("job", list(TRAINER_JOBS))
def test_dptrainer_fsdp2_two_processes_equal_one(one_and_two, job):
    """DPTrainer on an FSDP2 model: the same ledger, disjoint covering shares (whole users at user
    level), the gathered trainable weights within float tolerance of one process's."""
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert a["sharded"] and r0["sharded"] and (a["world_size"], r0["world_size"]) == (1, 2)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert sum(e["count"] for e in a["ledger"]["entries"]) == 3
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
    assert r0["weights"] == r1["weights"]
    assert a["weights"]
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)


def _assert_same_run(got: dict, ref: dict) -> None:
    assert got["ledger"] == ref["ledger"]
    assert got["epsilon"] == ref["epsilon"]
    assert ref["weights"]
    for n, w in ref["weights"].items():
        torch.testing.assert_close(torch.tensor(got["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)


def _banded_ledger_ok(ledger: dict) -> bool:
    """4 steps of banded MF with b = 2: PoissonSampled at t = 0, 2 and NoOp at t = 1, 3."""
    kinds = [e["event"]["type"] for e in ledger["entries"] for _ in range(e["count"])]
    return kinds == ["PoissonSampledDpEvent", "NoOpDpEvent"] * 2


@pytest.mark.slow
def test_make_private_fsdp2_banded_two_processes_equal_one_and_resume(one_and_two):
    """Banded MF through make_private on an FSDP2 model: 2 processes (each rank keeping the buffers of
    its shards) = 1 process; stopped after step 2, saved on every rank (the buffers gathered into one
    0600 file), resumed in fresh objects on 2 processes = 1 process uninterrupted; and a 2-process
    save resumed by 1 process (the gathered file re-sliced for another world) = the same run."""
    one, two = one_and_two
    ref = one["jobs"]["banded"]
    assert _banded_ledger_ok(ref["ledger"])
    _assert_same_run(one["jobs"]["banded_resume"], ref)
    for job in BANDED_JOBS:
        r0, r1 = (log["jobs"][job] for log in two)
        assert (r0["world_size"], r1["rank"]) == (2, 1)
        assert r0["weights"] == r1["weights"]
        _assert_same_run(r0, ref)
        _assert_same_run(r1, ref)
    assert two[0]["jobs"]["banded_resume"]["state_mode"] == 0o600
    saved = two[0]["jobs"]["banded_saved"]
    assert saved["state_mode"] == 0o600 and sum(e["count"] for e in saved["ledger"]["entries"]) == 2
    _one_process_group()
    try:
        from pathlib import Path

        folder = Path(one["root"], "two", "banded_saved")
        saved_files = {p.name for p in folder.iterdir()} - {"noise.pt.lock"}  # the lock of an exited process
        assert saved_files == {"model", "noise.pt", "noise.pt.releases.json"}
        resumed = worker.run_job({**_BANDED, "resume": str(folder)})
    finally:
        dist.destroy_process_group()
    _assert_same_run(resumed, ref)


def test_make_private_fsdp2_banded_resume_one_process(tmp_path):
    """Fast (1 process, a 1-process gloo group): banded MF on a fully_shard-ed MLP runs through the
    sharded step (the refusal is gone); stopped after step 2, saved (0600) and resumed in fresh objects
    it equals the uninterrupted loop (ledger equal, weights within float tolerance); a second
    load_noise_state of the same state after its releases is refused (stale)."""
    from dpft.placement.fsdp import ShardedBandedMFMechanism

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    _one_process_group()
    try:
        ref = worker.run_job(_BANDED, tmp_path / "ref")
        got = worker.run_job({**_BANDED, "stop_at": 2}, tmp_path / "resume")
        assert got["state_mode"] == 0o600
        with pytest.raises(ValueError, match="release.*made after this state was saved"):
            worker.run_job({**_BANDED, "resume": str(tmp_path / "resume")})
        # the loop's releasing mechanism is the sharded one
        from torch.utils.data import TensorDataset, DataLoader

        from dpft import PrivacyEngine

        model = worker.sharded_model()
        eng = PrivacyEngine(reproducible_seed=0)
        _, opt, _ = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(8, worker.D)), batch_size=4), noise_multiplier=1.0,
            max_grad_norm=1.0, steps=2, mechanism="banded_mf", bands=2)
        assert isinstance(opt.dp_step.spec.mechanism, ShardedBandedMFMechanism)
        eng.detach()
    finally:
        dist.destroy_process_group()
    assert _banded_ledger_ok(ref["ledger"])
    _assert_same_run(got, ref)


def test_make_private_refuses_unsharded_root(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpft import PrivacyEngine
    from dpft.placement import world as ddp

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    _one_process_group()
    try:
        def call(model, **kw):
            data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
            return PrivacyEngine(reproducible_seed=0).make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
                data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                steps=2, **kw)

        mesh = init_device_mesh("cpu", (1,))
        part = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(part[0], mesh=mesh)
        with pytest.raises(ddp.DistributedError, match="apply fully_shard to the root module"):
            call(part)
        whole = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(whole, mesh=mesh)
        call(whole)  # a sharded root: accepted
        banded = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        fully_shard(banded, mesh=mesh)
        call(banded, mechanism="banded_mf", bands=2)  # banded MF too (no longer refused)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_trainers_train_an_fsdp2_model_through_the_sharded_step(kind, tmp_path):
    """DPSFTTrainer and DPDPOTrainer (DPTrainer's sharded path) on a fully_shard-ed tiny Llama, one
    process: FSDPStep runs (DPO's placeholder is a pair with its reference log-probabilities), one
    ledger event per step, the sharded weights move. DPO takes an unsharded ``ref_model``: TRL hashes
    the reference model's tensors with ``.numpy()``, which DTensors refuse."""
    pytest.importorskip("trl")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl import DPOConfig, SFTConfig

    from dpft.audit import ways_in_ddp as hd
    from dpft.audit import ways_in_trl
    from dpft.placement.fsdp import FSDPStep
    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPDPOTrainer, DPSFTTrainer

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    _one_process_group()
    try:
        tok = ways_in_trl.tiny_tokenizer()
        model = ways_in_trl.tiny_llama(len(tok))
        mesh = init_device_mesh("cpu", (1,))
        for m in model.modules():
            if type(m).__name__ == "LlamaDecoderLayer":
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        common = dict(output_dir=str(tmp_path / kind), max_steps=2, report_to=[], use_cpu=True, bf16=False, optim="sgd",
                      learning_rate=0.5, per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
        dp = DPArguments(target_delta=1e-3, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                         reproducible_seed=0, max_physical_batch_size=2)
        rows = hd.trl_rows({"trainer": kind, "rows": 8})
        if kind == "sft":
            tr = DPSFTTrainer(model=model, args=SFTConfig(max_length=64, dataset_num_proc=None, **common),
                              train_dataset=rows, processing_class=tok, dp_args=dp)
        else:
            tr = DPDPOTrainer(model=model, ref_model=ways_in_trl.tiny_llama(len(tok)), args=DPOConfig(beta=0.5, **common),
                              train_dataset=rows, processing_class=tok, dp_args=dp)
        before = {n: p.full_tensor().clone() for n, p in tr.engine.params.items()}
        tr.train()
        assert tr.sharded and isinstance(tr.dp_step, FSDPStep)
        assert sum(e["count"] for e in tr.ledger.to_json()["entries"]) == 2
        assert any(not torch.equal(p.full_tensor(), before[n]) for n, p in tr.engine.params.items())
    finally:
        dist.destroy_process_group()
