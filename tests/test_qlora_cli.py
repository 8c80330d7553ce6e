"""QLoRA from the command line (issue 38 item 2; models/quant.py): ``model.quantization: nf4 | int8``
in a recipe loads the causal LM's base through transformers' ``BitsAndBytesConfig`` and trains peft
LoRA on it; ``dpft train`` runs end to end on the CPU (bitsandbytes' CPU backend) on a tiny random
Llama saved in-process. Refusals come before any data or model is loaded: bitsandbytes missing
(naming the extra), ``trainable.mode`` other than lora, a non-causal task, bottleneck adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpft.config.recipe import RecipeError, load_recipe
from dpft.models import quant

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples/chat-support/recipe.yaml"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 2-block Llama (hidden 64: bitsandbytes' CPU 4-bit kernels want in_features ≥ its
    block size 64 and out_features % 32 == 0) with the word-level chat tokenizer of test_instruct."""
    from test_instruct import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, bos_token_id=2, eos_token_id=3)
    d = tmp_path_factory.mktemp("tiny-llama-qlora")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(RECIPE), "--quiet", "-o", str(out), "--model", str(model_dir), "--trainable", "lora",
            "--steps", "2", "--epsilon", "3", "--batch-size", "8", "--max-physical-batch-size", "4",
            "--max-length", "32", "--device", "cpu",
            "--set", "trainable.lora.target_modules=[q_proj,v_proj,down_proj]", "--set", "trainable.lora.r=2",
            "--set", "task.max_train_examples=32", "--set", "task.max_dev_examples=4",
            "--set", "eval.max_new_tokens=2", "--set", "eval.max_generate_prompts=2", *extra]


@pytest.mark.slow  # 20-27 s each on 2 shared cores (model load, 2 steps, generation, export)
@pytest.mark.parametrize("q", ["nf4", "int8"])
def test_dpft_train_runs_qlora_end_to_end_on_the_cpu(tiny_dir, tmp_path, monkeypatch, q):
    pytest.importorskip("bitsandbytes", reason=f"QLoRA needs bitsandbytes ({quant.EXTRA})")
    from typer.testing import CliRunner

    from dpft.accounting.ledger import PrivacyLedger
    from dpft.cli.commands import app

    loaded = []
    orig = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):  # the model dpft loads is quantized with the config models/quant.py builds
        m = orig(*a, **kw)
        loaded.append((kw.get("quantization_config"), m))
        return m

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, _args(tiny_dir, tmp_path / "run", "--set", f"model.quantization={q}"))
    assert res.exit_code == 0, res.output
    cfg, model = loaded[0]
    if q == "nf4":
        assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_quant_storage == torch.float32
    else:
        assert cfg.load_in_8bit and cfg.llm_int8_threshold == 0.0
    kinds = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("bitsandbytes.")}
    assert kinds == {"Linear4bit" if q == "nf4" else "Linear8bitLt"}  # every block Linear quantized
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    # r = 2 LoRA on q_proj (64→64), v_proj (64→64), down_proj (128→64) of 2 blocks; nothing else trains
    assert rep["model"]["trainable"] == "lora" and rep["model"]["quantization"] == q
    assert f"base quantized ({q}, bitsandbytes)" in (tmp_path / "run" / "report.md").read_text()
    assert f"base weights quantized to {q}" in (tmp_path / "run" / "model" / "README.md").read_text()
    assert rep["model"]["trainable_parameters"] == 2 * 2 * ((64 + 64) + (64 + 64) + (128 + 64))
    led = PrivacyLedger.load(tmp_path / "run" / "ledger.json")
    assert led.steps == 2 and rep["privacy"]["epsilon"] == pytest.approx(led.epsilon(rep["privacy"]["delta"]).epsilon)
    assert 0 < rep["privacy"]["epsilon"] <= 3.0 + 1e-6


def test_quantization_with_another_trainable_mode_is_refused_before_loading(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    def never(*a, **kw):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr("dpft.run.load.load_rows", never)
    monkeypatch.chdir(ROOT)
    args = _args(tiny_dir, tmp_path / "run", "--set", "model.quantization=nf4")
    args[args.index("--trainable") + 1] = "full"
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0
    assert "trainable.mode 'full'" in res.output and "set trainable.mode: lora" in res.output
    assert "AssertionError" not in res.output


def test_missing_bitsandbytes_names_the_extra_before_loading(tiny_dir, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else find(n, *a))
    rec = load_recipe(RECIPE, {"model.name": str(tiny_dir), "model.quantization": "int8", "trainable.mode": "lora"})
    with pytest.raises(quant.QuantizationError, match=r"needs bitsandbytes, which is not installed: pip install "
                                                      r"'dpft\[quant\]'"):
        quant.check_recipe(rec)


def test_other_refusals_and_the_schema(tiny_dir):
    rec = load_recipe(None, {"model.quantization": "nf4", "trainable.mode": "lora", "task.name": "sst2"})
    with pytest.raises(quant.QuantizationError, match=r"task 'sst2': QLoRA is verified on causal LMs only"):
        quant.check_recipe(rec)
    with pytest.raises(RecipeError, match=r"model\.quantization"):
        load_recipe(None, {"model.quantization": "int4"})
    with pytest.raises(RecipeError, match=r"bottleneck adapters are not verified over a quantized base"):
        load_recipe(None, {"model.quantization": "int8", "model.adapter": {"reduction_factor": 8}})
    merged = load_recipe(None, {"model.quantization": "nf4", "trainable.mode": "lora", "task.name": "text",
                                "output.merge_lora": True})
    with pytest.raises(quant.QuantizationError, match=r"output\.merge_lora: merging into a quantized base re-quantizes"):
        quant.check_recipe(merged)
    quant.check_recipe(load_recipe(None, {"trainable.mode": "full"}))  # no quantization: nothing to refuse


def test_bnb_config_int8_threshold_zero_and_nf4_storage_is_the_compute_dtype():
    pytest.importorskip("bitsandbytes")
    c8 = quant.bnb_config("int8")
    assert c8.load_in_8bit and c8.llm_int8_threshold == 0.0
    c4 = quant.bnb_config("nf4", torch.bfloat16)
    assert c4.bnb_4bit_compute_dtype == torch.bfloat16 and c4.bnb_4bit_quant_storage == torch.bfloat16
    assert c4.bnb_4bit_use_double_quant
