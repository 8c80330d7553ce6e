"""DPDPOTrainer and QLoRA through DPTrainer under ``TrainingArguments.fsdp`` (FSDP2; issue 38 items 1–2):
DPTrainer shards the policy itself (integrations/hf/fsdp.py) and the step is dpft's FSDPStep.

DPO (integrations/trl/fsdp.py): TRL scores the pairs with the policy before training (PEFT: a frozen
``ref`` copy of the adapter, made before sharding and sharded with the base); the sharded reference pass
runs on every rank together and rank 0's values are kept; an unsharded ``ref_model`` is scored by rank 0
alone; through accelerate's FSDP2 environment too, and on a LoRA policy the caller sharded with
``fully_shard`` (compared with the ``fsdp=`` run of one process). The pair is the privacy unit: its chosen and rejected rows one clipping group, the placeholder
micro-batch of a short rank a pair too. QLoRA: a 4-bit NF4 Llama (bitsandbytes' CPU backend, storage
dtype fp32) whose packed weights FSDP2 shards like any parameter, LoRA adapters trained.

2 CPU processes (gloo) against 1 process (nothing sharded, the same step and noise layout): the same
ledger, the same reference log-probabilities, the same logical batches (disjoint covering shares), the
gathered trainable weights within float tolerance (1e-5 relative, 1e-6 absolute: measured ≤ 6e-8, the
reduce-scatter's summation order; QLoRA too: the CPU NF4 kernel dequantizes the same gathered codes on
every rank, so it adds no rounding of its own).
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist

import trl_fsdp_worker as worker  # tests/trl_fsdp_worker.py: the run each rank makes
from test_ddp import free_port

pytest.importorskip("trl")
multiprocessing.set_forkserver_preload(["trl_fsdp_worker", "hf_fsdp_worker", "dpft", "dpft.integrations.trl.trainer",
                                        "torch.distributed.fsdp", "peft"])

JOBS = {"dpo": {"dpo": True}, "dpo_lora": {"dpo": True, "lora": True}, "dpo_ref": {"dpo": True, "ref_model": True},
        "dpo_env": {"dpo": True, "lora": True, "env": True}, "qlora": {},
        "dpo_user_sharded": {"dpo": True, "lora": True, "user_sharded": True}}
#: Jobs that run on 2 processes only, and the 1-process job each is compared with.
TWO_ONLY = {"dpo_user_sharded": "dpo_lora"}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("trl_fsdp")
    jobs = dict(JOBS)
    if importlib_ok("bitsandbytes"):
        jobs["qlora"] = {"llama_dir": str(worker.save_tiny_llama(root / "llama"))}
    else:  # pragma: no cover - the quant extra missing
        jobs.pop("qlora")
    one = worker.run_jobs({"jobs": {k: v for k, v in jobs.items() if k not in TWO_ONLY}, "out": str(root / "one")}, 0)
    for job, same in TWO_ONLY.items():  # a model the caller sharded: compared with the fsdp= run of one process
        one["jobs"][job] = one["jobs"][same]
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": jobs, "log_dir": str(logs), "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return one, two


def importlib_ok(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


#: FSDP units under 2 processes: the tiny DPO Llama's 1 decoder layer + root; the QLoRA Llama's 2 + root.
UNITS = {"qlora": 3}


@pytest.mark.slow  # about 95 s on 2 shared cores (5 trainers in 1 process, then 6 in 2)
@pytest.mark.parametrize("job", list(JOBS))
def test_trl_fsdp_two_processes_equal_one(one_and_two, job):
    one, two = one_and_two
    if job not in one["jobs"]:
        pytest.skip("bitsandbytes is not installed")
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    for log in (a, r0, r1):
        assert log["sharded"] and log["fsdp_step"] and not log["accelerate_fsdp"] and not log["args_fsdp"]
    if job in TWO_ONLY:  # no fsdp= asked: the caller's fully_shard model runs the sharded step all the same
        assert r0["step"] == "FSDPStep"
    assert a["fsdp_units"] == 0 and r0["fsdp_units"] == r1["fsdp_units"] == UNITS.get(job, 2)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert sum(e["count"] for e in a["ledger"]["entries"]) == 3
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
    if job.startswith("dpo"):  # the reference pass: rank 0's values everywhere, equal to one process's
        assert r0["ref_logps"] == r1["ref_logps"]
        torch.testing.assert_close(torch.tensor(r0["ref_logps"]), torch.tensor(a["ref_logps"]), rtol=1e-6, atol=1e-6)
    if job == "dpo_env":  # accelerate's FSDP2 environment runs the same step as DPOConfig.fsdp
        for log, ref in ((a, one["jobs"]["dpo_lora"]), (r0, two[0]["jobs"]["dpo_lora"])):
            assert log["ledger"] == ref["ledger"] and log["weights"] == ref["weights"]
    if job in ("dpo_lora", "dpo_user_sharded"):  # only the policy's adapter trains; the reference adapter is frozen
        assert a["weights"] and all(".default." in n for n in a["weights"])
    if job == "qlora":  # fully_shard sharded the NF4 base: each packed weight's local shard is half its rows
        assert a["nf4"]["layers"] and not any(w["dtensor"] for w in a["nf4"]["layers"])
        for rec in (r0["nf4"], r1["nf4"]):
            assert len(rec["layers"]) == 2 * 7  # 7 Linear4bit per block, 2 blocks
            for w in rec["layers"]:
                assert w["dtensor"] and w["dtype"] == "torch.float32" and w["local"] == [w["global"][0] // 2, 1], w
            assert 0.45 < rec["byte_share"] < 0.55, rec
        assert all("lora_" in n for n in a["weights"])
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    assert a["weights"].keys() == r0["weights"].keys()
    moved = False
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)
        moved = moved or any(x != 0 for x in w)
    assert moved


# -- fast: refusals and the pieces ------------------------------------------------------------------------
def test_dtensor_hash_equals_trl_hash_module_on_plain_modules():
    from trl.trainer.utils import hash_module

    from dpft.integrations.trl.fsdp import dtensor_hash

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    assert dtensor_hash(m) == hash_module(m)


def test_hashable_sharded_restores_trl_hash_module():
    import trl.trainer.dpo_trainer as dpo_module

    from dpft.integrations.trl.fsdp import dtensor_hash, hashable_sharded

    own = dpo_module.hash_module
    with hashable_sharded(False):
        assert dpo_module.hash_module is own
    with hashable_sharded(True):
        assert dpo_module.hash_module is dtensor_hash
    assert dpo_module.hash_module is own


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    from dpft.audit.ways_in_trl import tiny_llama

    return get_peft_model(tiny_llama(40), LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                     init_lora_weights=False, target_modules=["q_proj", "v_proj"]))


def test_reference_adapter_is_a_frozen_copy_kept_through_trl_add_adapter():
    from dpft.integrations.trl.fsdp import add_reference_adapter, reference_adapter_kept

    model = _lora_llama()
    assert add_reference_adapter(model) and not add_reference_adapter(model)  # once
    assert model.active_adapter == "default"
    params = dict(model.named_parameters())
    pairs = [(n, n.replace(".default.", ".ref.")) for n in params if ".default." in n]
    assert pairs
    for d, r in pairs:
        assert torch.equal(params[d], params[r]) and params[d].requires_grad and not params[r].requires_grad
    with reference_adapter_kept(model):  # TRL's add_adapter("ref", ...) keeps ours (PEFT would raise)
        model.add_adapter("ref", model.peft_config["default"])
    assert "add_adapter" not in model.__dict__
    with pytest.raises(ValueError, match="already exists"):
        model.add_adapter("ref", model.peft_config["default"])


def test_dpo_refuses_a_caller_sharded_peft_policy_without_reference_adapter(tmp_path):
    """A PEFT policy the caller sharded: TRL would add its reference adapter after sharding (plain tensors
    that cannot be filled from DTensor shards). Refused with the fix, before TRL prepares anything."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl import DPOConfig

    from dpft.audit.ways_in_ddp import trl_rows
    from dpft.audit.ways_in_trl import tiny_tokenizer
    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPDPOTrainer

    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        model = _lora_llama()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"DPDPOTrainer: the PEFT policy is sharded .*add_reference_adapter"):
            DPDPOTrainer(model=model, args=DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                         train_dataset=trl_rows({"trainer": "dpo", "rows": 4}), processing_class=tiny_tokenizer(),
                         dp_args=DPArguments(target_delta=1e-3, noise_multiplier=1.0, max_grad_norm=1.0,
                                             expected_batch_size=2))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # about 30 s: the honest checks, then each planted bug's
def test_fsdp_trl_audit_checks_pass_and_catch_planted_bugs():
    """audit/ways_in_fsdp.py's QLoRA and DPDPOTrainer ways in and audit/checks_fsdp.py's --no-dp step, registered
    in audit/suite.py: pass as shipped; each planted bug makes the check of its way in fail."""
    from dpft.audit import checks_fsdp, planted, suite, ways_in_fsdp

    names = ("dpo_fsdp_args_kept", "qlora_fsdp_env_kept", "fsdp_plain_dummy_counted")
    assert set(names) <= set(planted.ALL) and "fsdp_plain_dummy_counted" in checks_fsdp.PLANTED
    assert ("dpft.audit.ways_in_fsdp", "hf_fsdp_checks", ways_in_fsdp.PLANTED) in suite.OPTIONAL_CHECKS
    honest = ways_in_fsdp.run_ways(ways_in_fsdp.WAYS[2:])
    assert len(honest) == (9 if importlib_ok("bitsandbytes") else 5)
    assert all(c.passed for c in honest), [c.row() for c in honest if not c.passed]
    expect = {"dpo_fsdp_args_kept": "fsdp DPDPOTrainer: accelerate is never handed FSDP",
              "qlora_fsdp_env_kept": "fsdp QLoRA DPTrainer (accelerate's FSDP2 plugin): accelerate is never handed FSDP"}
    for name in expect:
        if name.startswith("qlora") and not importlib_ok("bitsandbytes"):  # pragma: no cover
            continue
        assert [c.name for c in ways_in_fsdp.hf_fsdp_checks(name) if not c.passed] == [expect[name]], name
    plain = "fsdp --no-dp step: a placeholder micro-batch adds nothing"
    assert [c.passed for c in checks_fsdp._plain_check()] == [True]
    assert plain in [c.name for c in checks_fsdp.fsdp_checks("fsdp_plain_dummy_counted") if not c.passed]


def test_cpu_offload_stays_refused_with_the_reason(tmp_path):
    """cpu_offload: FSDP2 on a CPU-only machine accepts CPUOffloadPolicy only unpinned, and offloading there
    does nothing, so the sharded step with CPU shards and GPU compute stays unverified: refused, naming why
    and the fix, before the model is touched."""
    from transformers import TrainingArguments

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    class Untouchable(torch.nn.Module):
        def parameters(self, *a, **k):
            raise AssertionError("the model was touched before the refusal")

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                             fsdp="full_shard offload", fsdp_config={"fsdp_version": 2})
    with pytest.raises(ValueError, match=r"cpu_offload .*not supported yet.*GPU tensor as the .grad of a CPU shard.*"
                                         r"pin_memory=False.*FSDP_OFFLOAD_PARAMS=false"):
        DPTrainer(model=Untouchable(), args=args, train_dataset=[{"x": 1}] * 4,
                  dp_args=DPArguments(target_delta=1e-3, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2))
