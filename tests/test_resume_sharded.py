"""``resume_from_checkpoint`` on a model the caller sharded with ``fully_shard`` (no ``fsdp=``; issue 38
item 3): DPTrainer has no plain copy of such a model, so the checkpoint's full tensors go straight into
the shards (integrations/hf/fsdp.py ``load_full_into_shards``: ``model.safetensors``, or a PEFT adapter's
``adapter_model.safetensors`` with PEFT's own key renaming) and the optimizer's full state as under
``fsdp=`` (``set_optimizer_state_dict(full_state_dict=True)``).

2 CPU processes (gloo), AdamW, 4 logical steps stopped after the checkpoint at step 2 and resumed by a
new DPTrainer on a freshly sharded model: the resumed run's ledger equals the uninterrupted run's (4
releases) and its gathered trainable weights equal it within float tolerance (same world), and both
equal the 1-process ``fsdp=`` run (tests/hf_fsdp_worker.py) within the AdamW-across-worlds tolerance
of tests/test_hf_fsdp.py (``ADAMW_ACROSS_WORLDS``). Full model, LoRA and banded MF (b = 2: its noise
state restored to each rank's shards); DPSFTTrainer (TRL, the tiny Llama the caller sharded:
tests/sft_fsdp_worker.py's ``caller_sharded`` job) against its 1-process ``fsdp=`` run.
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist

import hf_fsdp_worker
import resume_sharded_worker as worker  # tests/resume_sharded_worker.py: the run each rank makes
import sft_fsdp_worker
from test_ddp import free_port
from test_hf_fsdp import ADAMW_ACROSS_WORLDS, _close

multiprocessing.set_forkserver_preload(["resume_sharded_worker", "hf_fsdp_worker", "sft_fsdp_worker", "dpft",
                                        "dpft.integrations.hf.trainer", "torch.distributed.fsdp"])

JOBS = {"full": {}, "lora": {"lora": True}, "banded": {"banded": True}}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("resume_sharded")
    base = {"steps": 4, "optim": "adamw_torch", "checkpoint": True}
    one = {name: hf_fsdp_worker.run_job({**base, **job}, root / "one" / name) for name, job in JOBS.items()}
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": JOBS, "log_dir": str(logs), "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    return one, [json.loads((logs / f"rank{r}.json").read_text())["jobs"] for r in range(2)]


@pytest.mark.slow  # about 2 min on 2 shared cores (3 trainers in 1 process, then 9 in 2)
@pytest.mark.parametrize("job", sorted(JOBS))
def test_caller_sharded_resume_equals_the_uninterrupted_run(one_and_two, job):
    one, two = one_and_two
    a = one[job]
    r0, r1 = (log[job] for log in two)
    ckpt_weights = "adapter_model.safetensors" if job == "lora" else "model.safetensors"
    for r in (r0, r1):
        assert ckpt_weights in r["ckpt_files"] and "optimizer.pt" in r["ckpt_files"]
        assert sum(e["count"] for e in r["first_ledger"]["entries"]) == 2  # the first run stopped at its checkpoint
        assert r["resumed"]["sharded"] and r["resumed"]["fsdp_step"] and not r["resumed"]["args_fsdp"]
        assert r["resumed"]["fsdp_units"] == 3  # the caller's: 2 BertLayers + root
        assert r["resumed"]["ledger"] == r["whole"]["ledger"] == a["ledger"]
        assert sum(e["count"] for e in r["resumed"]["ledger"]["entries"]) == 4
        assert r["resumed"]["mechanism"] == ("ShardedBandedMFMechanism" if job == "banded" else a["mechanism"])
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    assert set(r0["resumed"]["weights"]) == set(a["weights"])  # the same trainable parameters (LoRA: adapter + head)
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)
    _close(a["weights"], r0["whole"]["weights"], **ADAMW_ACROSS_WORLDS)


@pytest.mark.slow  # about 2 min on 2 shared cores (1 trainer in 1 process, then 3 in 2)
def test_caller_sharded_dpsfttrainer_resume_equals_the_uninterrupted_run(tmp_path):
    """DPSFTTrainer on a tiny Llama the caller sharded (decoder layer + root), AdamW stopped after the
    checkpoint at step 2 of 4 on 2 processes and resumed = its uninterrupted run = the 1-process ``fsdp=`` run."""
    pytest.importorskip("trl")
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    base = {"steps": 4, "optim": "adamw_torch", "checkpoint": True}
    a = sft_fsdp_worker.run_job(base, tmp_path / "one")
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = {"jobs": {"resume": {"caller_sharded": True, "resume_test": True}}, "log_dir": str(logs),
           "out": str(tmp_path / "two")}
    torch.multiprocessing.start_processes(sft_fsdp_worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    r0, r1 = (json.loads((logs / f"rank{r}.json").read_text())["jobs"]["resume"] for r in range(2))
    for r in (r0, r1):
        assert sum(e["count"] for e in r["first_ledger"]["entries"]) == 2
        assert r["resumed"]["sharded"] and r["resumed"]["fsdp_step"] and not r["resumed"]["args_fsdp"]
        assert r["resumed"]["ledger"] == r["whole"]["ledger"] == a["ledger"]
        assert sum(e["count"] for e in r["resumed"]["ledger"]["entries"]) == 4
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)
