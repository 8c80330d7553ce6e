"""DPTrainer under ``TrainingArguments.fsdp`` and accelerate's FSDP2 plugin (integrations/hf/fsdp.py,
issue 38): DPTrainer shards the model itself with ``dpft.placement.fsdp.shard_model`` and hands ``Trainer`` the
arguments with ``fsdp`` cleared, so accelerate never wraps the model, and the step is dpft's FSDPStep.

2 CPU processes (gloo) against 1 process (no process group: nothing sharded, the same sharded step and
noise layout, as ``dpft train``) — the same ledger, the same logical batches (disjoint covering shares),
the gathered weights within float tolerance — at example level (with Trainer's evaluation after every
step), with truncated Poisson (blocks kept gathered after forward: ``reshard_after_forward: false``), at
user level (``NO_WRAP``: the root alone), with LoRA, DPSFTTrainer (TRL), bf16 (within bf16 rounding: one
process autocasts, FSDP2 gathers bf16 parameters) and through accelerate's environment; resume (AdamW,
stopped after its checkpoint and resumed = uninterrupted); ``save_model`` writes a full model (PEFT: the
adapter) that ``from_pretrained`` loads, equal to the 1-process one. Fast refusals (FSDP1, options that
change the DP step, methods) come before any model is touched or sharded; banded MF runs sharded (its
checkpointed noise state gathered from every rank's slices, resume = uninterrupted); the audit's
DPTrainer-under-FSDP checks pass and catch their planted bugs.
"""

from __future__ import annotations

import json
import math
import multiprocessing

import pytest
import torch
import torch.distributed as dist

import hf_fsdp_worker as worker  # tests/hf_fsdp_worker.py: the run each rank makes
from test_ddp import free_port

multiprocessing.set_forkserver_preload(["hf_fsdp_worker", "dpft", "dpft.integrations.hf.trainer", "torch.distributed.fsdp"])

JOBS = {"args": {"save": True, "eval": True}, "env": {"env": True},
        "truncated": {"max_batch_size": 5, "fsdp_config": {"reshard_after_forward": False}},
        "user": {"user_level": True, "fsdp_config": {"auto_wrap_policy": "NO_WRAP"}},
        "lora": {"lora": True, "save": True}, "sft": {"sft": True}, "bf16": {"bf16": True},
        "banded": {"banded": True}}
RESUME = {"resume": {"resume_test": True}, "resume_banded": {"resume_test": True, "banded": True}}
#: FSDP units under 2 processes: tiny BERT's 2 BertLayers + root; NO_WRAP: the root alone; tiny Llama's
#: 1 LlamaDecoderLayer + root.
UNITS = {"sft": 2, "user": 1}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    root = tmp_path_factory.mktemp("hf_fsdp")
    one = worker.run_jobs({"jobs": {**JOBS, **RESUME}, "out": str(root / "one")}, 0)
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": {**JOBS, **RESUME}, "log_dir": str(logs), "out": str(root / "two")}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return one, two


def _close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a and set(a) == set(b)
    for n, w in a.items():
        torch.testing.assert_close(torch.tensor(b[n]), torch.tensor(w), rtol=rtol, atol=atol)


#: AdamW across worlds (1 process against 2): the 2-process clipped sums are reduce-scattered (another
#: float summation order), and AdamW's m/√v amplifies that rounding where a coordinate's noisy gradient
#: is near zero: max |Δw| measured 1.1e-6 to 9.3e-6 over 4 steps depending on the noise draw (SGD stays
#: within 1e-6: the equality jobs above). The same world's resumed run against its uninterrupted one stays
#: at the strict tolerance.
ADAMW_ACROSS_WORLDS = {"rtol": 1e-4, "atol": 5e-5}


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_dptrainer_fsdp_arguments_two_processes_equal_one(one_and_two, job):
    """The same ledger and ε, disjoint covering shares (whole users at user level), FSDPStep with
    dpft's FSDP units and no accelerate FSDP, gathered weights within float tolerance."""
    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    for log in (a, r0, r1):
        assert log["sharded"] and log["fsdp_step"] and not log["accelerate_fsdp"] and not log["args_fsdp"]
    assert a["fsdp_units"] == 0 and r0["fsdp_units"] == r1["fsdp_units"] == UNITS.get(job, 3)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    entries = a["ledger"]["entries"]
    assert sum(e["count"] for e in entries) == 3
    if job == "sft":
        assert a["step"] == r0["step"] == "FSDPStep"  # DPSFTTrainer (TRL) through the same step
    if job == "truncated":
        assert entries[0]["event"]["type"] == "TruncatedSubsampledGaussianDpEvent"
    if job == "banded":  # b = 2: a participation at t = 0, 2 (cyclic Poisson), NoOp between
        assert [e["event"]["type"] for e in entries] == ["PoissonSampledDpEvent", "NoOpDpEvent",
                                                         "PoissonSampledDpEvent"]
        assert a["mechanism"] == r0["mechanism"] == r1["mechanism"] == "ShardedBandedMFMechanism"
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    if job == "bf16":  # one process autocasts fp32 weights; FSDP2 gathers bf16 parameters: bf16 rounding apart
        for n, w in a["weights"].items():
            torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=0, atol=1e-3)  # 2e-4 seen
        return
    if job == "args":  # Trainer evaluated after every step, between the sharded steps
        assert len(a["eval_losses"]) == len(r0["eval_losses"]) == 3
        assert all(math.isfinite(x) for x in r0["eval_losses"])
    _close(a["weights"], r0["weights"])


@pytest.mark.slow
def test_dptrainer_fsdp_accelerate_env_equals_arguments(one_and_two):
    """accelerate's FSDP2 environment runs the same step as TrainingArguments.fsdp (same settings)."""
    one, two = one_and_two
    for log in (one, *two):
        assert log["jobs"]["env"]["ledger"] == log["jobs"]["args"]["ledger"]
        assert log["jobs"]["env"]["weights"] == log["jobs"]["args"]["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["args", "lora"])
def test_dptrainer_fsdp_save_model_loads_with_from_pretrained(one_and_two, job):
    """save_model on the sharded model: rank 0 writes the gathered full weights (PEFT: the adapter and
    the trained head), no DTensor, with the ledger and dp_state; from_pretrained (PeftModel.from_pretrained
    over the same base) loads them, equal to the 1-process run's saved model and to the trained weights."""
    one, two = one_and_two
    a, r0 = one["jobs"][job], two[0]["jobs"][job]
    assert "loaded" not in two[1]["jobs"][job]  # rank 0 alone writes
    weights = "adapter_model.safetensors" if job == "lora" else "model.safetensors"
    for log in (a, r0):
        assert {weights, "ledger.json", "dp_state.json", "README.md"} <= set(log["saved_files"])
        assert "model.safetensors" not in log["saved_files"] or job != "lora"
        assert not log["saved_dtensor"]
    _close(a["loaded"], r0["loaded"])
    for n, w in r0["weights"].items():  # the saved (trainable) weights are the trained ones
        torch.testing.assert_close(torch.tensor(r0["loaded"][n]), torch.tensor(w))


@pytest.mark.slow
def test_dptrainer_fsdp_resume_equals_the_uninterrupted_run(one_and_two):
    """AdamW on 2 processes, stopped after the checkpoint at step 2 and resumed by a new DPTrainer: the
    checkpoint holds the full optimizer state (by parameter name, no DTensor), the resumed run's ledger
    and weights equal the uninterrupted run's, and both equal one process's."""
    one, two = one_and_two
    a = one["jobs"]["resume"]
    r0, r1 = (log["jobs"]["resume"] for log in two)
    assert r0["first_ledger"]["entries"][0]["count"] == 2
    for r in (r0, r1):
        assert r["resumed"]["ledger"] == r["whole"]["ledger"] == a["whole"]["ledger"]
        assert sum(e["count"] for e in r["resumed"]["ledger"]["entries"]) == 4
        assert r["resumed"]["fsdp_units"] == 3
    assert r0["optimizer_tensors"] > 0 and not r0["optimizer_dtensor"]
    assert all(isinstance(n, str) and n.startswith("bert.") for n in r0["optimizer_names"])
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["resumed"]["weights"], a["whole"]["weights"])
    _close(a["whole"]["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)


def _noise_state_ok(noise: dict, step: int) -> None:
    """The secret noise state rank 0 wrote at the checkpoint: owner-only (0600), in output_dir beside
    checkpoint-*/ (the release set) and not inside any, at the checkpoint's step, full tensors."""
    assert noise["mode"] == 0o600 and noise["in_checkpoints"] == []
    assert noise["next_step"] == step and len(noise["buffers"]) == 1  # b − 1 = 1 buffer


@pytest.mark.slow
def test_dptrainer_fsdp_banded_resume_equals_the_uninterrupted_run(one_and_two):
    """Banded MF (b = 2) under fsdp on 2 processes, AdamW, stopped after the checkpoint at step 2 and
    resumed by a new DPTrainer (each rank keeps its slice of the gathered buffers): the ledger and
    weights equal the uninterrupted run's and one process's; the noise state file rank 0 wrote holds
    the gathered buffers — the file one process writes (same shapes, same y noises)."""
    one, two = one_and_two
    a = one["jobs"]["resume_banded"]
    r0, r1 = (log["jobs"]["resume_banded"] for log in two)
    assert r1["noise"] is None  # rank 0 alone writes
    for noise in (a["noise"], r0["noise"]):
        _noise_state_ok(noise, 2)
    assert r0["noise"]["shapes"] == a["noise"]["shapes"]  # full tensors, not rank 0's shard
    for b0, b1 in zip(a["noise"]["buffers"], r0["noise"]["buffers"]):
        _close(b0, b1)
    for r in (r0, r1):
        assert r["resumed"]["mechanism"] == "ShardedBandedMFMechanism"
        assert r["resumed"]["ledger"] == r["whole"]["ledger"] == a["whole"]["ledger"]
        assert sum(e["count"] for e in r["resumed"]["ledger"]["entries"]) == 4
    assert r0["resumed"]["weights"] == r1["resumed"]["weights"]
    _close(r0["whole"]["weights"], r0["resumed"]["weights"])
    _close(a["resumed"]["weights"], a["whole"]["weights"])
    _close(a["whole"]["weights"], r0["resumed"]["weights"], **ADAMW_ACROSS_WORLDS)


@pytest.mark.slow  # 13–21 s on this 2-core machine (3 trainers): the construction check below is the fast one
def test_dptrainer_fsdp_banded_resume_one_process(tmp_path):
    """1 process, no process group (the sharded step and its banded mechanism, nothing sharded), no launch:
    DPTrainer(fsdp=...) with banded MF releases through the step's ShardedBandedMFMechanism, writes the
    0600 noise state outside checkpoint-*/ at the checkpoint, and a run stopped there and resumed equals
    the uninterrupted one (the buffers restored: zeroed buffers move the weights by ~0.3)."""
    out = worker.run_resume({"banded": True, "steps": 3}, tmp_path)  # checkpoint at 2, resumed for step 3
    _noise_state_ok(out["noise"], 2)
    resumed, whole = out["resumed"], out["whole"]
    assert resumed["mechanism"] == whole["mechanism"] == "ShardedBandedMFMechanism"
    assert resumed["sharded"] and resumed["fsdp_step"]
    assert resumed["ledger"] == whole["ledger"]
    assert [e["event"]["type"] for e in whole["ledger"]["entries"]] == ["PoissonSampledDpEvent", "NoOpDpEvent",
                                                                        "PoissonSampledDpEvent"]
    _close(whole["weights"], resumed["weights"])


# -- refusals: fast, before any model is touched -----------------------------------------------------------
def _dp(**kw):
    from dpft.integrations.hf.trainer import DPArguments

    return DPArguments(**{"target_delta": 1e-3, "noise_multiplier": 1.0, "max_grad_norm": 1.0,
                          "expected_batch_size": 4, **kw})


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, **kw)


class _Untouchable(torch.nn.Module):
    """A model whose parameters must not be read: the refusals come first."""

    def parameters(self, *a, **k):
        raise AssertionError("the model was touched before the refusal")

    named_parameters = modules = parameters


def test_fsdp_settings_map_what_dpft_shards_with(tmp_path, monkeypatch):
    """fsdp_config / accelerate's environment → dpft.placement.fsdp.shard_model's arguments (fast: nothing built)."""
    from dpft.integrations.hf.fsdp import fsdp_settings

    got = fsdp_settings(_args(tmp_path, fsdp=True, bf16=True, fsdp_config={
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": "BertLayer", "reshard_after_forward": False,
        "activation_checkpointing": True}))
    assert got == {"source": "TrainingArguments.fsdp", "blocks": {"BertLayer"}, "reshard_after_forward": False,
                   "dtype": "bf16", "activation_checkpointing": True}
    got = fsdp_settings(_args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP"}))
    assert got["blocks"] == set() and got["dtype"] == "fp32" and got["reshard_after_forward"]
    assert fsdp_settings(_args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2}))["blocks"] is None  # _no_split_modules
    assert fsdp_settings(_args(tmp_path)) is None
    for k, v in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                 "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer", "FSDP_RESHARD_AFTER_FORWARD": "false"}.items():
        monkeypatch.setenv(k, v)
    got = fsdp_settings(_args(tmp_path))
    assert got["source"].startswith("accelerate's FSDP plugin") and got["blocks"] == {"LlamaDecoderLayer"}
    assert not got["reshard_after_forward"]


def test_dptrainer_fsdp_activation_checkpointing_maps_to_gradient_checkpointing(tmp_path):
    """fsdp_config['activation_checkpointing'] becomes Hugging Face's gradient checkpointing (which the
    book-keeping engine runs); one process: the sharded step on the plain model."""
    from dpft.audit import ways_in_ddp as hd
    from dpft.placement.fsdp import FSDPStep
    from dpft.integrations.hf.trainer import DPTrainer

    args = _args(tmp_path, fsdp=True, label_names=["labels"],
                 fsdp_config={"fsdp_version": 2, "activation_checkpointing": True})
    tr = DPTrainer(model=hd.tiny_model(), args=args, train_dataset=hd.make_rows(6), data_collator=hd.pad_collate,
                   dp_args=_dp())
    assert tr.args.gradient_checkpointing and not tr.args.fsdp and tr.args.fsdp_plugin_args is None
    assert args.fsdp and tr.sharded and isinstance(tr.dp_step, FSDPStep)  # the caller's arguments unchanged


@pytest.mark.parametrize("fsdp, config, match", [
    ("full_shard", {"fsdp_version": 1}, r"FSDP1 .*flattens parameters.*fsdp_version': 2"),
    ("full_shard", {"fsdp_version": 2, "use_orig_params": False}, r"use_orig_params: false is FSDP1"),
    ("full_shard offload", {"fsdp_version": 2}, r"cpu_offload .*not supported yet"),
    ("full_shard", {"fsdp_version": 2, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10},
     r"auto_wrap_policy SIZE_BASED_WRAP has no equivalent.*TRANSFORMER_BASED_WRAP"),
])
def test_dptrainer_refuses_fsdp_options_that_change_the_step(tmp_path, fsdp, config, match):
    from dpft.integrations.hf.trainer import DPTrainer

    args = _args(tmp_path, fsdp=fsdp, fsdp_config=config)
    with pytest.raises(ValueError, match=r"DPTrainer: TrainingArguments.fsdp: " + match):
        DPTrainer(model=_Untouchable(), args=args, train_dataset=[{"x": 1}] * 4, dp_args=_dp())


def test_dptrainer_refuses_accelerate_fsdp1_env_and_offload(tmp_path, monkeypatch):
    from dpft.integrations.hf.trainer import DPTrainer

    args = _args(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch --use_fsdp, fsdp_version unset: FSDP1
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ValueError, match=r"accelerate's FSDP plugin .*FSDP1 .*FSDP_VERSION=2"):
        DPTrainer(model=_Untouchable(), args=args, train_dataset=[{"x": 1}] * 4, dp_args=_dp())
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match=r"cpu_offload .*FSDP_OFFLOAD_PARAMS=false"):
        DPTrainer(model=_Untouchable(), args=args, train_dataset=[{"x": 1}] * 4, dp_args=_dp())


def test_dptrainer_fsdp_refuses_unknown_block_class_and_a_presharded_model(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpft.audit import ways_in_ddp as hd
    from dpft.integrations.hf.trainer import DPTrainer

    args = _args(tmp_path, fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": "Nope"})
    with pytest.raises(ValueError, match=r"transformer_layer_cls_to_wrap names \['Nope'\].*BertLayer"):
        DPTrainer(model=hd.tiny_model(), args=args, train_dataset=hd.make_rows(6), dp_args=_dp())
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        model = hd.tiny_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        args = _args(tmp_path, fsdp="full_shard", fsdp_config={"fsdp_version": 2})
        with pytest.raises(ValueError, match=r"already sharded with fully_shard"):
            DPTrainer(model=model, args=args, train_dataset=hd.make_rows(6), dp_args=_dp())
        # a model the caller sharded, with banded MF: no longer refused; the step's sharded mechanism releases
        from dpft.placement.fsdp import ShardedBandedMFMechanism

        tr = DPTrainer(model=model, args=_args(tmp_path), train_dataset=hd.make_rows(16), data_collator=hd.pad_collate,
                       dp_args=_dp(mechanism="banded_mf", bands=2))
        assert tr.sharded and isinstance(tr.mechanism, ShardedBandedMFMechanism)
        assert tr.mechanism is tr.dp_step.spec.mechanism and tr.mechanism.world is tr.world
    finally:
        dist.destroy_process_group()


def test_dptrainer_fsdp_banded_mf_releases_through_the_sharded_mechanism(tmp_path):
    """banded MF under fsdp is no longer refused: the trainer's mechanism is the step's sharded copy
    (the one that releases, whose rng each training loop renews and whose buffers the checkpoint
    gathers), not the plan's unsharded one."""
    from dpft.audit import ways_in_ddp as hd
    from dpft.placement.fsdp import ShardedBandedMFMechanism
    from dpft.integrations.hf.trainer import DPTrainer

    args = _args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2})
    tr = DPTrainer(model=hd.tiny_model(), args=args, train_dataset=hd.make_rows(16),
                   data_collator=hd.pad_collate, dp_args=_dp(mechanism="banded_mf", bands=2))
    assert isinstance(tr.mechanism, ShardedBandedMFMechanism) and tr.mechanism is tr.dp_step.spec.mechanism
    tr.get_train_dataloader()  # a training loop: its fresh secret stream reaches the mechanism that releases
    assert tr.dp_step.spec.mechanism.rng is tr._run_rng is tr.sampler.rng


def test_dptrainer_refuses_methods_with_an_fsdp2_model(tmp_path, monkeypatch):
    """The twin of make_private's refusal (tests/test_sharded_refusal.py): a method that cannot run on
    shards is refused with its reason for a fully_shard-ed model and under fsdp (RMT, adaptive clipping and
    DP-SFT on a given basis run: tests/test_fsdp_methods_api.py, tests/test_fsdp_dpsft.py; a refusal
    stood in for the plumbing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpft.audit import ways_in_ddp as hd
    from dpft.integrations.hf.trainer import DPTrainer
    from dpft.methods.dpsft.method import DPSFT

    monkeypatch.setattr(DPSFT, "sharded_refusal", classmethod(lambda cls, cfg: "a stand-in reason"))

    meths = [{"name": "dpsft", "source": "file", "file": "/nonexistent/basis.safetensors", "k": 4}]
    args = _args(tmp_path, fsdp="full_shard", fsdp_config={"fsdp_version": 2}, label_names=["labels"])
    with pytest.raises(ValueError, match=r"DPTrainer: with an FSDP2-sharded model, method 'dpsft': a stand-in"):
        DPTrainer(model=_Untouchable(), args=args, train_dataset=hd.make_rows(6), data_collator=hd.pad_collate,
                  dp_args=_dp(methods=meths))  # before the model is sharded or Trainer built
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        model = hd.tiny_model()
        for m in model.modules():
            if type(m).__name__ == "BertLayer":
                fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"DPTrainer: with an FSDP2-sharded model, method 'dpsft'"):
            DPTrainer(model=model, args=_args(tmp_path, label_names=["labels"]), train_dataset=hd.make_rows(6),
                      data_collator=hd.pad_collate, dp_args=_dp(methods=meths))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_hf_fsdp_audit_checks_pass_and_catch_planted_bugs():
    """The audit's DPTrainer-under-FSDP ways in (audit/ways_in_fsdp.py hf_fsdp_checks, registered in
    audit/suite.py): pass as shipped; each planted bug of DPTrainer's two ways in (plugin arguments handed to
    accelerate, accelerate's FSDP environment left on) makes a check fail. The QLoRA and DPO ways in of the
    same table: tests/test_trl_fsdp.py."""
    from dpft.audit import planted, suite, ways_in_fsdp

    trainer_planted = ("hf_fsdp_args_kept", "hf_fsdp_env_kept")
    assert set(ways_in_fsdp.PLANTED) <= set(planted.ALL)
    assert ("dpft.audit.ways_in_fsdp", "hf_fsdp_checks", ways_in_fsdp.PLANTED) in suite.OPTIONAL_CHECKS
    honest = ways_in_fsdp.run_ways(ways_in_fsdp.WAYS[:2])
    assert len(honest) == 6 and all(c.passed for c in honest), [c.row() for c in honest if not c.passed]
    for name in trainer_planted:
        failed = [c for c in ways_in_fsdp.hf_fsdp_checks(name) if not c.passed]
        assert [c.name.split(": ")[1] for c in failed] == ["accelerate is never handed FSDP"], name


def test_parameters_added_after_sharding_are_refused():
    """TRL's peft_config wraps the model inside SFTTrainer.__init__, after DPTrainer sharded it: the new
    (plain) trainable parameters would never be reduced over the ranks, so a sharded world refuses them."""
    from dpft.placement import world as ddp
    from dpft.integrations.hf.fsdp import check_still_sharded

    model = torch.nn.Linear(3, 2)
    check_still_sharded(model, True, ddp.World(0, 1), "DPSFTTrainer")  # one process: nothing to reduce
    check_still_sharded(model, False, ddp.World(0, 2), "DPSFTTrainer")  # DDP: the clipped sums are all-reduced
    with pytest.raises(ddp.DistributedError, match=r"DPSFTTrainer: trainable parameters \['weight', 'bias'\] were "
                                                   r"added after the model was sharded.*peft.get_peft_model"):
        check_still_sharded(model, True, ddp.World(0, 2), "DPSFTTrainer")
