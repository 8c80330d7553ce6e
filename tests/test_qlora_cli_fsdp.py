"""QLoRA under FSDP2 (issue 38 item 2): ``model.quantization: nf4`` with ``perf.sharding: fsdp`` —
the NF4 base's packed weights stored as the compute dtype (``bnb_4bit_quant_storage``) are sharded by
``fully_shard`` like every other parameter, the LoRA adapters train through the FSDP step. 2 CPU
processes (gloo, bitsandbytes' CPU backend) against 1 process of the same reproducible recipe.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import ProcessException

from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer

import ddp_worker  # noqa: E402 (tests/ helpers)
from dpft.placement.fsdp_checkpoint import read_trainable
from test_ddp import files_under, free_port  # noqa: E402

multiprocessing.set_forkserver_preload(["ddp_worker", "dpft.run.loop", "dpft.outputs.report", "matplotlib.pyplot",
                                        "dpft.placement.fsdp", "peft", "bitsandbytes", "transformers.models.llama.modeling_llama"])

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install 'dpft[quant]')")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    from test_instruct import tiny_tokenizer

    root = tmp_path_factory.mktemp("qlora_fsdp")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3))
    llama.save_pretrained(root / "llama")
    tok.save_pretrained(root / "llama")
    words = ["the", "cheap", "pub", "near", "river", "serves", "french", "food", "family", "friendly"]
    lines = [" ".join(words[(i * 7 + k) % 10] for k in range(5 + i % 9)) + "." for i in range(60)]
    (root / "corpus.txt").write_text("\n".join(lines))
    return {"llama": root / "llama", "corpus": root / "corpus.txt"}


def recipe(dirs, **extra) -> dict:
    ov = {"task.name": "text", "task.train_file": str(dirs["corpus"]), "model.name": str(dirs["llama"]),
          "model.max_length": 8, "model.dropout": 0.0, "model.quantization": "nf4", "perf.device": "cpu",
          "trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj", "down_proj"],
          "trainable.lora.r": 2, "privacy.noise_multiplier": 4.0, "privacy.target_epsilon": None,
          "privacy.delta": 1e-3, "privacy.reproducible": True, "privacy.engine": "bookkeeping",
          "schedule.steps": 3, "batch.expected_batch_size": 9, "batch.max_physical_batch_size": 2,
          "eval.every_steps": 3, "checkpoint_every": 3, "perf.sharding": "fsdp", "optimizer.name": "sgd",
          "optimizer.lr": 0.05}
    ov.update(extra)
    return ov


def sharded_entry(i: int, cfg: dict, port: int) -> None:
    """tests/ddp_worker.py's rank ``i``, and after ``fully_shard`` a record of every NF4 layer's weight
    (a DTensor? its local and global shapes, dtype) and of this rank's parameter bytes."""
    from dpft.placement import fsdp

    real = fsdp.shard_model

    def spy(model, world, dtype="fp32"):
        out = real(model, world, dtype)
        rows = [{"name": n, "dtensor": fsdp.is_sharded(m.weight), "local": list(fsdp.local(m.weight).shape),
                 "global": list(m.weight.shape), "dtype": str(m.weight.dtype)}
                for n, m in out.named_modules() if type(m).__module__.startswith("bitsandbytes.")]
        seen, local_bytes, full_bytes = set(), 0, 0
        for p in out.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                local_bytes += fsdp.local(p).numel() * p.element_size()
                full_bytes += p.numel() * p.element_size()
        Path(cfg["log_dir"], f"shards{i}.json").write_text(json.dumps(
            {"nf4": rows, "local_bytes": local_bytes, "full_bytes": full_bytes}))
        return out

    import dpft.run.step_model as step_model

    fsdp.shard_model = step_model.shard_model = spy  # the driver calls the name it imported (run/step_model.py)
    ddp_worker.forked_entry(i, cfg, port)


def launch(tmp: Path, recipe: dict):
    """2 ranks of :func:`sharded_entry` (as test_ddp.launch_worker): (failure, rank logs, shard records)."""
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    conf = {"recipe": recipe, "output_dir": "run", "cwds": [str(tmp / "rank0"), str(tmp / "rank1")],
            "log_dir": str(logs)}
    failure = None
    try:
        torch.multiprocessing.start_processes(sharded_entry, args=(conf, free_port()), nprocs=2, join=True,
                                              start_method="forkserver")
    except ProcessException as exc:
        failure = exc
    read = lambda f: json.loads(f.read_text()) if f.is_file() else {}  # noqa: E731
    return (failure, [read(logs / f"rank{r}.json") for r in range(2)],
            [read(logs / f"shards{r}.json") for r in range(2)])


@pytest.mark.slow  # about 90 s on 2 shared cores (1 process, then 2)
def test_qlora_fsdp_two_processes_equal_one(dirs, tmp_path):
    ov = recipe(dirs)
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs, shards = launch(tmp_path / "two", ov)
    assert failure is None, failure
    # fully_shard sharded the NF4 base: every packed weight (float32 storage, (out·in/2/4, 1)) is a DTensor
    # whose local shard is half its rows on each rank, and each rank holds ~half the parameter bytes.
    for rec in shards:
        assert len(rec["nf4"]) == 2 * 7  # 7 Linear4bit per block, 2 blocks
        for w in rec["nf4"]:
            assert w["dtensor"] and w["dtype"] == "torch.float32" and w["global"][1] == 1
            assert w["local"] == [w["global"][0] // 2, 1], w
        assert 0.49 < rec["local_bytes"] / rec["full_bytes"] < 0.51, rec
    two = tmp_path / "two" / "rank0" / "run"
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    r0, r1 = logs
    assert r0["digest"] == r1["digest"]
    pa, pb = read_trainable(one), read_trainable(two, tmp_path / "two" / "rank1" / "run")  # per-rank DCP shards
    assert pa.keys() == pb.keys() and pa
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)
    assert all("lora_" in n for n in pa) and any("lora_B" in n and pa[n].any() for n in pa)  # the adapters trained
    # rank 1 writes only its shards of the checkpoint (dpft/placement/fsdp_checkpoint.py); rank 0 the rest of the run
    assert all(f == "run" or f.startswith("run/checkpoint_shards") for f in files_under(tmp_path / "two" / "rank1"))


def test_int8_under_fsdp_is_refused_before_loading(dirs, tmp_path):
    """LLM.int8 weights do not survive FSDP2's all-gather: the gathered parameter is a plain tensor
    without bitsandbytes' ``CB``/``SCB`` row statistics, and Linear8bitLt's forward fails with
    "AttributeError: 'Parameter' object has no attribute 'CB'" (bitsandbytes 0.50.2, 2 gloo ranks)."""
    from dpft.models.quant import QuantizationError

    with pytest.raises(QuantizationError, match=r"int8 .*perf\.sharding fsdp.*use model\.quantization: nf4"):
        Trainer(load_recipe(None, recipe(dirs, **{"model.quantization": "int8"})), tmp_path / "r")
