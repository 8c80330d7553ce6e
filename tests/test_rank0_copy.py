"""After FSDP2 training only rank 0 holds the full model (dpft/placement/fsdp.py ``materialise(keep=...)``,
dpft/placement/shards.py ``full_on_rank0``, integrations/hf/fsdp.py ``load_full_checkpoint``):

- one process (a 1-rank gloo group, so the parameters are real ``DTensor`` shards): the kept copy equals the
  weights, keeps the tied head, holds no ``DTensor``; ``keep=False`` hands back the sharded model itself;
- 2 gloo processes (tests/rank0_copy_worker.py): rank 1 holds no full tensor after ``materialise`` nor after
  ``full_on_rank0``; rank 0's saved model equals the weights (what every rank's copy held before); the
  ``fsdp=`` resume loads a safetensors checkpoint and a ``pytorch_model.bin`` one (the latter read by rank 0
  alone, through its plain copy) and a LoRA adapter's into both ranks' shards.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from dpft.placement import fsdp
from dpft.placement.world import World
from dpft.placement.shards import full_on_rank0

transformers = pytest.importorskip("transformers")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpt2(seed: int):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                                                n_positions=16))


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group (the default group), destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_materialise_keeps_the_copy_only_where_asked(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    want = {k: v.clone() for k, v in _gpt2(0).state_dict().items()}
    model = _gpt2(0)
    # shard_model returns a 1-process model as is; shard it as it does for K processes (mesh of one)
    fsdp._TEMPLATES[model] = fsdp._meta_template(model)
    mesh = init_device_mesh("cpu", (1,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(fsdp.is_sharded(p) for p in model.parameters())

    same = fsdp.materialise(model, keep=False)  # a rank that does not save: joins the gathers, keeps nothing
    assert same is model and all(fsdp.is_sharded(p) for p in same.parameters())

    plain = fsdp.materialise(model, keep=True)
    assert plain is not model and not any(fsdp.is_sharded(p) for p in plain.parameters())
    assert plain.lm_head.weight is plain.transformer.wte.weight  # the tie survives
    got = plain.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    with torch.no_grad():  # the copy owns its memory: changing it leaves the shards as they were
        plain.transformer.wte.weight.add_(1.0)
    torch.testing.assert_close(model.transformer.wte.weight.full_tensor(), want["transformer.wte.weight"])

    full = full_on_rank0(dict(model.named_parameters()))  # rank 0 of the default group: everything, gathered
    assert full is not None and sorted(full) == sorted(n for n, _ in model.named_parameters())
    assert not any(fsdp.is_sharded(t) for t in full.values())
    torch.testing.assert_close(full["transformer.h.0.attn.c_attn.weight"], want["transformer.h.0.attn.c_attn.weight"])


def test_unsharded_inputs_pass_through():
    """Outside FSDP: a model never sharded is returned as is; ``full_on_rank0`` outside a process group
    returns every tensor (each process is its own rank 0)."""
    model = _gpt2(0)
    assert fsdp.materialise(model, keep=False) is model and fsdp.materialise(model) is model
    if not dist.is_initialized():
        t = {"b": torch.ones(2), "a": torch.zeros(3)}
        out = full_on_rank0(t)
        assert list(out) == ["a", "b"] and out["b"] is not None and torch.equal(out["a"], t["a"])


@pytest.mark.slow
def test_two_processes_rank1_holds_no_full_copy(tmp_path):
    import rank0_copy_worker

    torch.multiprocessing.start_processes(rank0_copy_worker.entry, args=(str(tmp_path), _free_port()), nprocs=2,
                                          join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["sharded_before"] and r1["sharded_before"]
    # rank 1: the sharded model handed back, no full tensor kept, nothing gathered for it
    assert r1["returned_is_model"] and r1["full_params"] == [] and r1["gathered"] is None
    # rank 0: the plain copy (every parameter full, the head still tied), the gathered dict
    assert not r0["returned_is_model"] and r0["tied"] and r0["full_params"]
    assert r0["gathered"] and r0["gathered_shapes_ok"]
    # rank 0's saved model is the one every rank's copy held before: the weights, loadable by from_pretrained
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved").state_dict()
    want = _gpt2(0).state_dict()
    assert saved.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(saved[k], want[k], rtol=0, atol=0)
    # the fsdp= resume: the checkpoint's weights in both ranks' shards; a .bin checkpoint read by rank 0 alone
    for r in (r0, r1):
        assert r["safetensors_equal"] and r["bin_equal"] and r["safetensors_still_sharded"] and r["bin_still_sharded"]
        assert r["safetensors_loader_ranks"] == []  # safetensors: load_full_into_shards, no plain copy at all
    assert r0["bin_loader_ranks"] == [0] and r1["bin_loader_ranks"] == []
    for r in (r0, r1):  # a LoRA adapter's checkpoint into a PEFT model DPTrainer sharded (PEFT renames the keys)
        assert r["lora_equal"] and r["lora_params"] == 4  # A and B of c_attn in 2 blocks
