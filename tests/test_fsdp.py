"""FSDP2 (``perf.sharding: fsdp``, dpft/placement/fsdp.py): 2 CPU processes (gloo), forked from pytest as in
tests/test_ddp.py (its ``launch_worker`` and tests/ddp_worker.py), against 1 process of the same
recipe, in reproducible mode:

- tiny random GPT-2 LM with tied embeddings (full fine-tuning) and tiny random Llama with LoRA and
  activation checkpointing: same ledger, same logical batches (the shares are disjoint and cover
  each), trainable weights within float tolerance, the same gathered weights on both ranks; rank 0
  alone writes;
- the audit's FSDP checks pass, and catch their planted bugs;
- refusals: ``perf.sharding: none`` with 2 processes, and what FSDP does not run (another engine than
  book-keeping, a non-private run, method plug-ins).
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer

from dpft.placement.fsdp_checkpoint import read_trainable
from test_ddp import files_under, launch_worker  # noqa: E402 (tests/ helpers)

# The ranks' fork server also preloads what a causal-LM run imports (peft is imported to save the model).
multiprocessing.set_forkserver_preload(["ddp_worker", "dpft.run.loop", "dpft.outputs.report", "matplotlib.pyplot",
                                        "transformers.models.bert.modeling_bert",
                                        "transformers.models.bert.tokenization_bert", "dpft.placement.fsdp", "peft",
                                        "transformers.models.gpt2.modeling_gpt2",
                                        "transformers.models.llama.modeling_llama"])

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lm_dirs(tmp_path_factory) -> dict[str, Path]:
    from test_instruct import tiny_tokenizer

    root = tmp_path_factory.mktemp("fsdp_models")
    tok = tiny_tokenizer()
    ids = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2,
                                                                n_positions=32, **ids))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, **ids))
    out = {}
    for name, m in (("gpt2", gpt2), ("llama", llama)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    words = ["the", "cheap", "pub", "near", "river", "serves", "french", "food", "family", "friendly"]
    lines = [" ".join(words[(i * 7 + k) % 10] for k in range(5 + i % 9)) + "." for i in range(60)]
    (root / "corpus.txt").write_text("\n".join(lines))
    out["corpus"] = root / "corpus.txt"
    return out


def fsdp_recipe(dirs, kind: str, **extra) -> dict:
    ov = {"task.name": "text", "task.train_file": str(dirs["corpus"]), "model.name": str(dirs[kind]),
          "model.max_length": 8, "model.dropout": 0.0, "privacy.noise_multiplier": 4.0, "privacy.target_epsilon": None,
          "privacy.delta": 1e-3, "privacy.reproducible": True,  # privacy.engine: auto = book-keeping
          "schedule.steps": 3, "batch.expected_batch_size": 9, "batch.max_physical_batch_size": 2,
          "eval.every_steps": 3, "checkpoint_every": 3, "perf.sharding": "fsdp", "optimizer.name": "sgd", "optimizer.lr": 0.05}
    ov.update(extra)
    return ov


CASES = {
    "gpt2-tied-full": ("gpt2", {}),
    "llama-lora-checkpointing": ("llama", {"trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj"],
                                           "perf.activation_checkpointing": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_two_processes_equal_one(lm_dirs, tmp_path, case):
    kind, extra = CASES[case]
    ov = fsdp_recipe(lm_dirs, kind, **extra)
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    # One ledger event per logical step, identical to one process.
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    r0, r1 = logs
    for t in ("0", "1", "2"):
        assert r0["batches"][t] == r1["batches"][t]
        assert not set(r0["shares"][t]) & set(r1["shares"][t])
        assert sorted(r0["shares"][t] + r1["shares"][t]) == r0["batches"][t]
    # At some step one rank had a micro-batch more than the other: the other ran a placeholder one.
    assert any(-(-len(r0["shares"][t]) // 2) != -(-len(r1["shares"][t]) // 2) for t in ("0", "1", "2"))
    assert r0["digest"] == r1["digest"]  # the gathered weights agree on both ranks
    pa, pb = read_trainable(one), read_trainable(two, tmp_path / "two" / "rank1" / "run")  # per-rank DCP shards
    assert pa.keys() == pb.keys() and pa
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)
    base = load_file(str(lm_dirs[kind] / "model.safetensors"))  # the steps did update the weights
    assert [n for n in pa if (n in base and not torch.equal(pa[n], base[n])) or ("lora_B" in n and pa[n].any())]
    # Rank 0 alone writes; the saved model (the adapter for LoRA) is the one-process model.
    # rank 1 writes only its shards of the checkpoint (dpft/placement/fsdp_checkpoint.py); rank 0 the rest of the run
    assert all(f == "run" or f.startswith("run/checkpoint_shards") for f in files_under(tmp_path / "two" / "rank1"))
    fn = "adapter_model.safetensors" if "lora" in case else "model.safetensors"
    ma, mb = load_file(str(one / "model" / fn)), load_file(str(two / "model" / fn))
    assert ma.keys() == mb.keys()
    for n in ma:
        torch.testing.assert_close(mb[n], ma[n], rtol=1e-5, atol=1e-6)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_fsdp_audit_checks_pass_and_catch_planted_bugs():
    from dpft.audit.checks_fsdp import PLANTED, fsdp_checks

    honest = fsdp_checks()
    assert honest and all(c.passed for c in honest), [c.row() for c in honest if not c.passed]
    for name in PLANTED:
        assert any(not c.passed for c in fsdp_checks(name)), name


def test_sharded_noise_layout_is_world_size_invariant():
    from dpft.placement import fsdp
    from dpft.privacy.randomness import Randomness
    from dpft.step.noise import GaussianMechanism

    mech = GaussianMechanism(1.0, 1.0, Randomness(3))
    n = fsdp.NOISE_BLOCK + 7
    whole = fsdp.shard_noise(mech, 0, "w", n, 0, n, torch.device("cpu"))
    for k in (2, 5):
        parts = [fsdp.shard_noise(mech, 0, "w", n, *fsdp.chunk_range((n,), r, k), torch.device("cpu"))
                 for r in range(k)]
        assert torch.equal(torch.cat(parts), whole)
    assert fsdp.chunk_range((5, 3), 1, 2) == (9, 6) and fsdp.chunk_range((1, 4), 1, 2) == (4, 0)


def test_sharding_refusals(lm_dirs, tmp_path, monkeypatch):
    from dpft.placement import world as ddp
    from dpft.placement.fsdp import FSDPError
    from dpft.privacy.randomness import Randomness
    from dpft.session import core as session_core

    assert load_recipe(None, {}).perf.sharding == "ddp"  # today's recipes: DDP under torchrun
    monkeypatch.setattr(session_core, "session_world", lambda *a, **k: (ddp.World(rank=0, world_size=2), Randomness(0)))
    with pytest.raises(ddp.DistributedError, match="perf.sharding: none"):
        Trainer(load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **{"perf.sharding": "none"})), tmp_path / "a")
    monkeypatch.undo()
    from dpft.placement.fsdp import check_recipe

    check_recipe(load_recipe(None, fsdp_recipe(lm_dirs, "gpt2")), 2, [], True, False)  # engine auto: runs
    with pytest.raises(FSDPError, match="privacy.engine"):
        Trainer(load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **{"privacy.engine": "reference"})), tmp_path / "b")
    check_recipe(load_recipe(None, fsdp_recipe(lm_dirs, "gpt2")), 2, [], True, True)  # --resume runs (fsdp_state.py)
    # banded MF and truncated Poisson run sharded (tests/test_fsdp_mechanisms.py)
    for extra in ({"privacy.mechanism": "banded_mf", "privacy.bands": 2}, {"batch.max_batch_size": 8}):
        check_recipe(load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **extra)), 2, [], True, False)
