"""Sharded models at each way in (issues 26, 38): make_private takes an FSDP2 (``fully_shard``)
model whose root is sharded (api/sharded.py) and refuses one with only a submodule sharded;
DPTrainer and the TRL trainers refuse FSDP1 models, FSDP1 through TrainingArguments.fsdp or
accelerate's plugin, and DeepSpeed; each message names the fix (``dpft train`` with ``perf.sharding: fsdp``,
make_private with the root sharded, or DDP).

One process: a 1-process gloo group on a free port (FSDP2 needs a process group), destroyed after."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dpft.placement import world as ddp

from test_ddp import free_port

FIX = "perf.sharding: fsdp"


@pytest.fixture
def gloo_group(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(model: nn.Module, submodule: str | None = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model.get_submodule(submodule) if submodule else model, mesh=mesh)
    return model


def test_make_private_takes_fsdp2_root_and_refuses_a_sharded_submodule_only(gloo_group, monkeypatch):
    """make_private runs an FSDP2 model (api/sharded.py; tests/test_fsdp_api.py) when its root is
    sharded; a model with only a submodule sharded is refused naming the fix."""
    from dpft import PrivacyEngine

    def call(model, **kw):
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        return PrivacyEngine(reproducible_seed=0).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            data_loader=torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
            steps=1, **kw)

    with pytest.raises(ddp.DistributedError, match=r"make_private: only submodules .*apply fully_shard to the root"):
        call(_sharded(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), "0"))
    # a method that cannot run sharded is refused with its reason (RMT and DP-SFT on a given basis run:
    # tests/test_fsdp_methods_api.py, tests/test_fsdp_dpsft.py; a refusal stood in for the plumbing)
    from dpft.methods.dpsft.method import DPSFT

    monkeypatch.setattr(DPSFT, "sharded_refusal", classmethod(lambda cls, cfg: "a stand-in reason"))
    with pytest.raises(ValueError, match=r"make_private: with an FSDP2-sharded model, method 'dpsft': a stand-in"):
        call(_sharded(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))),
             methods=[{"name": "dpsft", "source": "file", "file": "/nonexistent/basis.safetensors", "k": 4}])
    model, opt, crit, loader = call(_sharded(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))))
    from dpft.api.sharded import ShardedDPOptimizer

    assert isinstance(opt, ShardedDPOptimizer)


def test_refuse_sharded_model_names_fsdp1_and_lets_plain_models_through(gloo_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    ddp.refuse_sharded_model(nn.Linear(2, 2), "x")  # unsharded: nothing
    ddp.refuse_sharded_model("gpt2", "x")  # a name (TRL loads it): nothing
    # FSDP1 wraps only on an accelerator: an instance built without its __init__ stands in (the
    # guard is an isinstance test).
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(fsdp1)
    with pytest.raises(ddp.DistributedError, match=r"x: the model is sharded by FSDP1 .*\(1\).*" + FIX):
        ddp.refuse_ddp_wrapper(nn.Sequential(nn.Linear(2, 2), fsdp1), "x")


def _hf_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                             label_names=["labels"], **kw)


def _dp():
    from dpft.integrations.hf.trainer import DPArguments

    return DPArguments(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0)


def test_dptrainer_refuses_a_sharded_submodule_only_and_takes_a_sharded_root(gloo_group, tmp_path):
    pytest.importorskip("transformers")
    from dpft.audit import ways_in_ddp as hd
    from dpft.integrations.hf.trainer import DPTrainer

    model = hd.tiny_model()
    _sharded(model, "bert.encoder")
    with pytest.raises(ddp.DistributedError, match=r"DPTrainer: only submodules of the model are sharded by FSDP2.*"
                                                   r"apply fully_shard to the root"):
        DPTrainer(model=model, args=_hf_args(tmp_path), train_dataset=hd.make_rows(6),
                  data_collator=hd.pad_collate, dp_args=_dp())
    tr = DPTrainer(model=_sharded(hd.tiny_model()), args=_hf_args(tmp_path), train_dataset=hd.make_rows(6),
                   data_collator=hd.pad_collate, dp_args=_dp())
    from dpft.placement.fsdp import FSDPStep

    assert tr.sharded and isinstance(tr.dp_step, FSDPStep)


def test_dpsfttrainer_refuses_fsdp2_model_before_trl_prepares(gloo_group, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
    from dpft.integrations.trl.trainer import DPSFTTrainer

    def boom(*a, **k):
        raise AssertionError("SFTTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(SFTTrainer, "__init__", boom)
    tok = tiny_tokenizer()
    model = _sharded(tiny_llama(len(tok)), "model.layers.0")  # the root not sharded: refused
    with pytest.raises(ddp.DistributedError, match=r"DPSFTTrainer: only submodules of the model are sharded by FSDP2"):
        DPSFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                     train_dataset=datasets.Dataset.from_list([{"prompt": "my phone", "completion": " restart"}] * 4),
                     processing_class=tok, dp_args=_dp())


def test_dptrainer_refuses_fsdp1_arguments_fsdp1_plugin_and_deepspeed(tmp_path, monkeypatch):
    """FSDP2 through TrainingArguments.fsdp / accelerate's plugin runs (tests/test_hf_fsdp.py); FSDP1
    (flat parameters) and DeepSpeed stay refused, naming the fix."""
    pytest.importorskip("transformers")
    from dpft.audit import ways_in_ddp as hd
    from dpft.integrations.hf.trainer import DPTrainer

    def build(args):
        return DPTrainer(model=hd.tiny_model(), args=args, train_dataset=hd.make_rows(6),
                         data_collator=hd.pad_collate, dp_args=_dp())

    args = _hf_args(tmp_path)
    args.fsdp, args.fsdp_config = "full_shard", {"fsdp_version": 1}  # set after __post_init__
    with pytest.raises(ValueError, match=r"TrainingArguments.fsdp: FSDP1 .*fsdp_version': 2"):
        build(args)
    # accelerate launch --use_fsdp / --use_deepspeed set these (the arguments are built before:
    # TrainingArguments itself needs deepspeed installed under the second)
    args = _hf_args(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"accelerate's FSDP plugin .*FSDP1 .*FSDP_VERSION=2"):
        build(args)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"DeepSpeed is not supported.*" + FIX):
        build(args)
