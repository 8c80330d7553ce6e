"""LoRA and QLoRA defaults that follow the architecture (issue 44 item 8): unset
``trainable.lora.target_modules`` takes PEFT's targets for the model type (BERT: query, value;
Llama: q_proj, v_proj; GPT-2: c_attn), else the attention's query/value projections; QLoRA on the
CPU leaves the layers whose shapes bitsandbytes' 4-bit kernel cannot take (stories260K's 172-wide
MLP) unquantized and frozen, as transformers leaves lm_head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpft.config.recipe import TrainableCfg  # noqa: E402
from dpft.models.arch import ModelError  # noqa: E402
from dpft.models.load import select_trainable  # noqa: E402
from dpft.models.lora_targets import default_lora_targets  # noqa: E402


def _llama(intermediate: int = 172):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))


def test_default_targets_follow_the_architecture():
    assert default_lora_targets(_llama()) == ["q_proj", "v_proj"]
    assert default_lora_targets(_bert()) == ["query", "value"]
    assert default_lora_targets(_gpt2()) == ["c_attn"]


def test_an_unknown_type_falls_back_to_its_attention_projections_or_names_the_setting():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_lin, self.k_lin, self.v_lin = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    m = nn.Sequential(Attn())
    assert default_lora_targets(m) == ["q_lin", "v_lin"]
    with pytest.raises(ModelError, match=r"set trainable.lora.target_modules .*\['0'\]"):
        default_lora_targets(nn.Sequential(nn.Linear(4, 4)))


def test_lora_on_a_llama_trains_with_no_target_modules_set():
    """Old: `LoRA target modules ['query', 'value'] not in this model` on every non-BERT model."""
    assert TrainableCfg(mode="lora").lora.target_modules is None
    m = select_trainable(_llama(), TrainableCfg(mode="lora"))
    trained = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "v_proj"}
    explicit = select_trainable(_llama(), TrainableCfg(mode="lora", lora={"target_modules": ["o_proj"]}))
    assert {n.split(".")[-4] for n, p in explicit.named_parameters() if p.requires_grad} == {"o_proj"}


def test_unquantizable_layers_on_the_cpu_are_the_unfit_shapes(tmp_path):
    from dpft.models.quant import unquantizable_layers

    _llama(172).save_pretrained(tmp_path / "odd")
    skip, unfit = unquantizable_layers(str(tmp_path / "odd"), "nf4", torch.device("cpu"))
    assert unfit == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    assert "lm_head" in skip and len(skip) == len(unfit) + 1  # transformers' default skip is kept
    assert unquantizable_layers(str(tmp_path / "odd"), "nf4", torch.device("cuda", 0)) == ([], [])
    assert unquantizable_layers(str(tmp_path / "odd"), "int8", torch.device("cpu")) == ([], [])
    _llama(128).save_pretrained(tmp_path / "fit")
    assert unquantizable_layers(str(tmp_path / "fit"), "nf4", torch.device("cpu")) == ([], [])


def test_qlora_loads_and_evaluates_a_model_with_odd_layer_shapes_on_the_cpu(tmp_path):
    """Old: `AssertionError: N must be divisible by block_n` inside bitsandbytes at evaluation."""
    pytest.importorskip("bitsandbytes")
    from dpft.models.quant import is_quantized, load_quantized_causal_lm

    d = tmp_path / "odd"
    _llama(172).save_pretrained(d)
    from test_instruct import tiny_tokenizer

    tiny_tokenizer().save_pretrained(d)
    _, model = load_quantized_causal_lm(str(d), "nf4", device=torch.device("cpu"))
    assert is_quantized(model) and model.dpft_unquantized == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    assert type(model.model.layers[0].mlp.gate_proj) is nn.Linear
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = select_trainable(model, TrainableCfg(mode="lora"))
    model.eval()
    with torch.no_grad():  # the path that failed: bitsandbytes' CPU packing in eval mode
        out = model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits
    assert out.shape == (1, 4, 64) and torch.isfinite(out).all()
