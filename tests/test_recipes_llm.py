"""The LLM recipes (issue 38 item 4): chat SFT of Llama-3.2-1B / Llama-3.1-8B shapes with LoRA and
QLoRA at user level (recipes/chat-sft-llama-*.yaml, ``dpft train`` recipes) and DPO on preference
pairs (recipes/trl/dpo-*.yaml, a TRL recipe run by benchmarks/llm_jobs.py). Validated without the
real weights: the schema and every refusal ``dpft train`` applies before loading, for one GPU and for
the 8-GPU settings each states; the one-80-GB-GPU sizing against benchmarks/memory_plan.py; and one
run of the QLoRA recipe and of the DPO recipe on a tiny random model built in-process.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from dpft.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import llm_jobs  # noqa: E402
import memory_plan  # noqa: E402

SFT = sorted((ROOT / "recipes").glob("chat-sft-llama-*.yaml"))
DPO = sorted((ROOT / "recipes" / "trl").glob("dpo-*.yaml"))
SHAPE = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}


def eight_gpu_overrides(path: Path) -> dict:
    """The ``# 8 GPUs: --set k=v ...`` line of a recipe's header."""
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith("# 8 GPUs: --set"))
    return {k: v for k, _, v in (s.partition("=") for s in re.findall(r"--set (\S+)", line))}


def before_loading(r, world_size: int) -> None:
    """What ``dpft train`` refuses from the recipe alone (run/refuse.py, before any loading)."""
    from dpft.models.quant import check_recipe as quant
    from dpft.run.refuse import recipe_mechanism
    from dpft.run.unit import check_user_level

    quant(r)
    if r.task.user_column:
        check_user_level(r, [])
    recipe_mechanism(r, True, [])
    if r.perf.sharding == "fsdp":
        from dpft.placement.fsdp import check_recipe

        check_recipe(r, world_size, [], True, False)


def test_the_recipes_are_there():
    names = {p.name for p in SFT}
    assert {f"chat-sft-llama-{s}-{m}-user.yaml" for s in ("1b", "8b") for m in ("lora", "qlora")} <= names
    assert DPO


@pytest.mark.parametrize("path", SFT, ids=lambda p: p.stem)
def test_sft_recipe_validates_for_one_and_eight_gpus_and_fits_80gb(path):
    if "qlora" in path.name:
        pytest.importorskip("bitsandbytes", reason="QLoRA recipes need bitsandbytes (pip install 'dpft[quant]')")
    r = load_recipe(path)
    assert r.task.user_column and r.trainable.mode == "lora" and r.privacy.delta < 1e-5
    assert (r.model.quantization == "nf4") == ("qlora" in path.name)
    before_loading(r, 1)
    r8 = load_recipe(path, eight_gpu_overrides(path))
    before_loading(r8, 8)
    shape = SHAPE[re.search(r"llama-(\d+b)", path.name).group(1)]
    est = memory_plan.recipe_estimate(shape, "qlora" if r.model.quantization else "lora", 1, r.model.max_length,
                                      r.batch.max_physical_batch_size)
    assert est < 0.9 * 80e9, est / 1e9
    stated = re.search(r"about (\d+) GB per GPU", path.read_text())
    assert stated and abs(int(stated.group(1)) - est / 1e9) <= 1.0  # the header's number is the plan's


@pytest.mark.parametrize("path", DPO, ids=lambda p: p.stem)
def test_dpo_recipe_builds_its_trl_and_dp_arguments(path, tmp_path):
    pytest.importorskip("trl")
    rec = llm_jobs.load_trl_recipe(path)
    args, dp, lora = llm_jobs.dpo_parts(rec, tmp_path)
    assert list(args.loss_type) == ["sigmoid"] and args.beta == 0.1
    assert dp.target_delta < 1e-5 and dp.expected_batch_size == 256 and lora.r == 16
    assert llm_jobs.dpo_parts(rec, tmp_path, no_dp=True)[1] is None
    with pytest.raises(ValueError, match="aot"):
        llm_jobs.dpo_parts(llm_jobs.load_trl_recipe(path, {"dpo.loss_type": ["aot"]}), tmp_path)
    with pytest.raises(ValueError, match="unknown section"):
        llm_jobs.load_trl_recipe(path, {"trainer.x": 1})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 2-block Llama at hidden 64 (bitsandbytes' CPU NF4 kernels' smallest) with the chat
    tokenizer of test_instruct (ChatML template)."""
    transformers = pytest.importorskip("transformers")
    from test_instruct import CHATML, tiny_tokenizer

    tok = tiny_tokenizer(CHATML)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0, bos_token_id=2, eos_token_id=3)
    d = tmp_path_factory.mktemp("tiny-llama-recipes")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.slow  # ~35 s: load, quantize, 2 user-level steps with checkpointing, export (64 rows)
def test_the_8b_qlora_user_level_recipe_runs_on_a_tiny_model(tiny_dir, tmp_path, monkeypatch):
    """The recipe as shipped, with the model, data and sizes swapped for a tiny run on the CPU: NF4
    base, LoRA, user level, activation checkpointing (bf16 → fp32: the CPU run; no generation)."""
    pytest.importorskip("bitsandbytes")
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.run.loop import Trainer

    monkeypatch.chdir(ROOT)
    r = load_recipe(ROOT / "recipes/chat-sft-llama-8b-qlora-user.yaml", {
        "model.name": str(tiny_dir), "model.max_length": 64, "task.train_file": "examples/chat-support/train.jsonl",
        "task.dev_file": "examples/chat-support/dev.jsonl", "task.max_dev_examples": 4, "perf.dtype": "fp32",
        "perf.device": "cpu", "batch.expected_batch_size": 8, "schedule.steps": 2, "eval.every_steps": 2,
        "eval.generate": False, "checkpoint_every": 2, "privacy.delta": 1e-3,
        "task.max_train_examples": 64})
    rep = Trainer(r, tmp_path / "run", progress=False).run()
    led = PrivacyLedger.load(tmp_path / "run" / "ledger.json")
    assert led.steps == 2 and rep["privacy"]["epsilon"] <= 8.0 + 1e-6
    assert rep["model"]["trainable"] == "lora"


@pytest.mark.slow  # ~25 s: TRL's data preparation, reference log-probs, 1 DP step
def test_the_dpo_recipe_runs_on_a_tiny_model(tiny_dir, tmp_path):
    pytest.importorskip("trl")
    rec = llm_jobs.load_trl_recipe(DPO[0], {"dpo.max_steps": 1, "dpo.max_length": 64, "dpo.bf16": False,
                                            "dp.expected_batch_size": 4, "dp.target_delta": 1e-3,
                                            "dpo.per_device_train_batch_size": 2})
    pairs = llm_jobs.pairs_from_chats(ROOT / "examples/chat-support/train.jsonl", 16)
    out = llm_jobs.run_dpo(rec, tmp_path / "dpo", str(tiny_dir), pairs)
    assert out["steps"] == 1 and 0 < out["epsilon"] <= 8.0
    assert json.loads((tmp_path / "dpo" / "job.json").read_text())["private"] is True


def test_gpu_suite_dry_run_lists_the_llm_stages():
    import subprocess

    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for stage in ("make_llama_1b", "make_llama_8b", "sft_1b_lora_dp", "sft_1b_lora_nodp", "sft_1b_qlora_dp",
                  "sft_8b_lora_dp", "sft_8b_qlora_dp", "sft_8b_qlora_nodp", "dpo_8b_lora_dp", "dpo_8b_lora_nodp",
                  "opacus_fsdp_ghost_1b_lora"):
        assert f"+ [{stage}," in r.stdout, stage
    assert "recipes/chat-sft-llama-8b-qlora-user.yaml" in r.stdout and "--no-dp" in r.stdout
    skipped = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run", "--no-llm"],
                             capture_output=True, text=True, timeout=60)
    assert skipped.returncode == 0 and "sft_1b_lora_dp" not in skipped.stdout
