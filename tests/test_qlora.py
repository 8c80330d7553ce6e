"""QLoRA as its users run it (issue 27 item 5): a causal LM loaded with transformers'
``BitsAndBytesConfig`` (4-bit NF4 or 8-bit LLM.int8), ``prepare_model_for_kbit_training``, peft
LoRA on every Linear of the block. The quantized base layers stay frozen; the adapters' clipped sum
from the book-keeping engine equals one backward per example, clipped and summed (q = 1, σ = 0).
A trainable parameter inside a quantized layer, a LoRA variant over a quantized base, and a LoRA
layer over a base type the rules do not know are refused by name.

bitsandbytes ≥ 0.49 runs both kinds on the CPU (its CPU backend); without it these tests skip
with the reason, and ``benchmarks/gpu_suite.sh`` runs them on a GPU (``DPFT_QLORA_DEVICE=cuda``).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install 'dpft[quant]')")

from dpft.grads.bookkeeping import BookKeepingEngine  # noqa: E402
from dpft.grads.lora import UnknownAdapterError  # noqa: E402
from dpft.models.losses import causal_lm_loss  # noqa: E402
from dpft.step.clip import make_clip_policy  # noqa: E402

DEVICE = os.environ.get("DPFT_QLORA_DEVICE", "cpu")
V, B, T = 96, 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _quant_config(bits: int):
    if bits == 4:
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32)
    # threshold 0: no LLM.int8 outlier decomposition (its columns are chosen over the whole batch)
    return transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64: bitsandbytes' CPU 4-bit kernels want out_features % 32 == 0 and
    in_features ≥ its block size, 64)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                   pad_token_id=0)
    d = tmp_path_factory.mktemp("tiny-llama-q")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def qlora_model(path, bits: int, quant=None, **lora_kw):
    """The QLoRA recipe of the peft/bitsandbytes docs on the tiny model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant or _quant_config(bits),
                                                                 device_map=DEVICE, dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    kw = dict(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
              target_modules=TARGETS)
    kw.update(lora_kw)
    return peft.get_peft_model(base, peft.LoraConfig(**kw)).train()  # as trained (from_pretrained: eval)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, T - 3:] = 0
    ids[0, T - 3:] = 0
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE),
            "position_ids": torch.arange(T).expand(B, T).contiguous().to(DEVICE)}


def _per_example_grads(model, batch):
    """Per-example gradients of the trainable parameters (one backward per example, unpadded) and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(B):
        n = int(batch["attention_mask"][i].sum())
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        grads.append(torch.autograd.grad(causal_lm_loss(model, one).sum(), params))
    return torch.stack([torch.sqrt(sum(x.float().pow(2).sum() for x in g)) for g in grads]), grads


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_adapters_per_example_exact_over_a_frozen_quantized_base(llama_dir, bits):
    model = qlora_model(llama_dir, bits)
    q = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert len(q) == len(TARGETS)  # every target is a peft QLoRA layer over a bitsandbytes Linear
    qbase = q[0].get_base_layer()
    assert isinstance(qbase, bnb.nn.Linear4bit if bits == 4 else bnb.nn.Linear8bitLt)
    assert qbase.weight.dtype == (torch.uint8 if bits == 4 else torch.int8) and not qbase.weight.requires_grad
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    batch = _batch()
    norms, grads = _per_example_grads(model, batch)
    C = float(norms.sort().values[1:3].mean())  # between the 2nd and 3rd norms: two clipped, two not
    scale = (C / (norms + 1e-6)).clamp(max=1.0)
    ref = {n: sum(scale[i] * grads[i][k] for i in range(B)) for k, n in enumerate(trainable)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no torch.func fallback: every unit has its rule
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        out = BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", C)).clipped_sum(batch)
    torch.testing.assert_close(out.norms.cpu(), norms.cpu(), rtol=1e-4, atol=0)
    total = torch.sqrt(sum(r.pow(2).sum() for r in ref.values()))
    for n, r in ref.items():
        err = float((out.grad_sum[n] - r).norm() / max(float(r.norm()), 1e-3 * float(total)))
        assert err <= 1e-4, (n, err)


def test_a_trainable_parameter_of_a_quantized_layer_is_refused_by_name(llama_dir):
    model = qlora_model(llama_dir, 8, target_modules=["q_proj"])
    layer = model.base_model.model.model.layers[0].mlp.down_proj  # quantized, not adapted
    layer.weight.requires_grad_(False)
    layer.bias = nn.Parameter(torch.zeros(layer.out_features, device=DEVICE))  # a bias someone unfroze
    with pytest.raises(UnknownAdapterError, match=r"mlp\.down_proj is a bitsandbytes quantized layer .*Linear8bitLt"):
        BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 1.0))


def test_dora_over_a_quantized_base_is_refused(llama_dir):
    model = qlora_model(llama_dir, 8, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(UnknownAdapterError, match=r"q_proj is a peft LoRA variant \['DoraLinearVariant'\] over a "
                                                  r"quantized base"):
        BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 1.0))


def test_a_qlora_layer_over_a_base_of_another_type_is_refused_by_name(llama_dir):
    """A peft QLoRA layer whose base is not the bitsandbytes class it was written for (a future
    peft dispatch, simulated) is refused naming the module and the base class."""
    model = qlora_model(llama_dir, 8, target_modules=["q_proj"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    plain = nn.Linear(layer.in_features, layer.out_features, bias=False).to(DEVICE).requires_grad_(False)
    layer.base_layer = plain
    with pytest.raises(UnknownAdapterError, match=r"self_attn\.q_proj is a peft base layer torch\.nn\.modules\.linear\."
                                                  r"Linear under peft\.tuners\.lora\.bnb\.Linear8bitLt"):
        BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 1.0))


def test_llm_int8_outlier_decomposition_is_refused_it_mixes_examples(llama_dir):
    """transformers' default 8-bit config (llm_int8_threshold = 6.0): bitsandbytes picks the
    fp16 outlier columns over every row of the batch, so one example's activations change how
    another's output is computed. Refused, naming the module and the fix (threshold 0 or 4-bit)."""
    model = qlora_model(llama_dir, 8, quant=transformers.BitsAndBytesConfig(load_in_8bit=True),
                        target_modules=["q_proj"])
    with pytest.raises(UnknownAdapterError, match=r"q_proj\.base_layer is a bitsandbytes 8-bit Linear with "
                                                  r"llm_int8_threshold = 6.*llm_int8_threshold=0\.0"):
        BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 1.0))
    # The mixing is real: with an outlier in example 1 only, example 0's output changes. Shown on
    # bitsandbytes' MatMul8bitLt, the path CUDA training takes (on the CPU, training dequantizes
    # and runs a float matmul, MatMul8bitFp; its eval mode takes MatMul8bitLt, used here).
    layer = model.base_model.model.model.layers[0].self_attn.k_proj.eval()  # quantized, not adapted
    torch.manual_seed(1)
    x = torch.randn(2, 3, layer.in_features, device=DEVICE)
    alone = layer(x[:1]).detach()
    assert torch.equal(layer(x)[:1].detach(), alone)  # no outlier: example 0 computed as alone
    x[1, 0, 5] = 50.0  # above the threshold, in example 1
    assert (layer(x)[:1].detach() - alone).abs().max() > 1e-4
