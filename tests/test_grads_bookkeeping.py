"""The book-keeping engine must reproduce the torch.func reference exactly (float32 tolerance):
per-example squared norms per parameter, clip factors, clipped sums and the loss, on tiny
random-initialised BERT, RoBERTa, GPT-2, Llama and Qwen2 models, full fine-tuning and LoRA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpft.grads.base import NonPrivateEngine
from dpft.grads.bookkeeping import BookKeepingEngine, UnattributedUseError
from dpft.grads.reference import ReferenceEngine
from dpft.models.losses import causal_lm_loss, classification_loss
from dpft.step.clip import NoClip, make_clip_policy

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, B, T = 50, 3, 8


# ----------------------------------------------------------------------------- models


def bert(**kw):
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=32, pad_token_id=0, **kw)
    return transformers.BertForSequenceClassification(cfg)


def roberta():
    cfg = transformers.RobertaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=T + 4, pad_token_id=1, type_vocab_size=1)
    return transformers.RobertaForSequenceClassification(cfg)


def gpt2_lm():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_cls():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(cfg)


def _decoder_cfg(cls, tied):
    return cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               tie_word_embeddings=tied, pad_token_id=0, bos_token_id=0, eos_token_id=0)


def llama(tied=False):
    return transformers.LlamaForCausalLM(_decoder_cfg(transformers.LlamaConfig, tied))


def qwen2(tied=False):
    return transformers.Qwen2ForCausalLM(_decoder_cfg(transformers.Qwen2Config, tied))


MODELS = {
    "bert": (bert, classification_loss),
    "roberta": (roberta, classification_loss),
    "gpt2_lm": (gpt2_lm, causal_lm_loss),
    "gpt2_cls": (gpt2_cls, classification_loss),
    "llama_untied": (lambda: llama(False), causal_lm_loss),
    "llama_tied": (lambda: llama(True), causal_lm_loss),
    "qwen2_untied": (lambda: qwen2(False), causal_lm_loss),
    "qwen2_tied": (lambda: qwen2(True), causal_lm_loss),
}


def make_batch(pad_id=0, explicit_pos=True, seed=0, token_types=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    ids[0, 3] = ids[0, 1] = ids[0, 6]  # repeated tokens within one example
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0  # padding
    mask[2, 7:] = 0
    ids[mask == 0] = pad_id
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}
    if explicit_pos:
        batch["position_ids"] = torch.arange(T).expand(B, T).contiguous()
        if token_types:
            batch["token_type_ids"] = torch.zeros(B, T, dtype=torch.long)
    return batch


def build(name, seed=0):
    torch.manual_seed(seed)
    ctor, loss = MODELS[name]
    model = ctor().eval()
    return model, loss


def batch_for(name, explicit_pos=True):
    pad = 1 if name == "roberta" else 0
    # RoBERTa computes its own padding-aware positions; GPT-2/Llama/Qwen take no token types.
    types = name in ("bert",)
    pos = explicit_pos and name != "roberta"
    b = make_batch(pad, explicit_pos=pos, token_types=types)
    return b


def assert_same(bk, ref):
    assert bk.n == ref.n
    assert bk.loss_sum == pytest.approx(ref.loss_sum, rel=1e-5)
    top = float(ref.sq_norms.max())
    torch.testing.assert_close(bk.sq_norms, ref.sq_norms, rtol=2e-4, atol=1e-7 * top)
    torch.testing.assert_close(bk.scales, ref.scales, rtol=2e-4, atol=1e-7)
    assert list(bk.grad_sum) == list(ref.grad_sum)
    gmax = max(float(g.abs().max()) for g in ref.grad_sum.values())
    for n, g in ref.grad_sum.items():
        assert bk.grad_sum[n].shape == g.shape, n
        torch.testing.assert_close(bk.grad_sum[n], g, rtol=2e-4, atol=2e-6 * gmax, msg=n)


def run_both(model, loss, batch, clip, **kw):
    bk = BookKeepingEngine(model, loss, clip, **kw).clipped_sum(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(model, loss, clip).clipped_sum(batch)
    return bk, ref


# ----------------------------------------------------------------------------- full fine-tuning


@pytest.mark.parametrize("name", list(MODELS))
def test_full_finetuning_matches_reference(name):
    model, loss = build(name)
    bk, ref = run_both(model, loss, batch_for(name), make_clip_policy("flat", 0.5))
    assert_same(bk, ref)
    assert (bk.scales < 1).any()  # clipping is active


@pytest.mark.parametrize("name", ["bert", "gpt2_lm", "llama_tied"])
def test_broadcast_position_ids_are_per_example(name):
    """Without position_ids HF BERT/GPT-2 look up positions with batch 1 and broadcast."""
    model, loss = build(name)
    batch = batch_for(name, explicit_pos=False)
    assert "position_ids" not in batch
    bk, ref = run_both(model, loss, batch, make_clip_policy("flat", 0.5))
    assert_same(bk, ref)


@pytest.mark.parametrize("style", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("name", ["bert", "gpt2_lm", "qwen2_untied"])
def test_clip_styles(name, style):
    model, loss = build(name)
    bk, ref = run_both(model, loss, batch_for(name), make_clip_policy(style, 0.3))
    assert_same(bk, ref)


@pytest.mark.parametrize("mode", ["ghost", "instantiate"])
@pytest.mark.parametrize("name", ["bert", "gpt2_lm", "llama_tied"])
def test_ghost_and_instantiated_norms_agree(name, mode):
    model, loss = build(name)
    bk, ref = run_both(model, loss, batch_for(name), make_clip_policy("flat", 0.5), norm_mode=mode)
    assert_same(bk, ref)


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_padding_idx_token_inside_attended_text_gets_no_gradient(name):
    """nn.Embedding never updates its padding_idx row, even where the pad id is attended."""
    model, loss = build(name)
    batch = batch_for(name)
    pad = 1 if name == "roberta" else 0
    batch["input_ids"][0, 2] = pad  # attention_mask stays 1 there
    bk, ref = run_both(model, loss, batch, make_clip_policy("flat", 0.5))
    assert_same(bk, ref)


def test_tied_lm_head_is_one_parameter_with_cross_term():
    model, loss = build("gpt2_lm")
    assert model.lm_head.weight is model.transformer.wte.weight
    eng = BookKeepingEngine(model, loss, make_clip_policy("flat", 1e6))
    assert "lm_head.weight" not in eng.param_names
    units = [u for u in eng.units if "transformer.wte.weight" in u.roles.values()]
    assert sorted(type(u.module).__name__ for u in units) == ["Embedding", "Linear"]
    bk = eng.clipped_sum(batch_for("gpt2_lm"))
    ref = ReferenceEngine(model, loss, make_clip_policy("flat", 1e6)).clipped_sum(
        batch_for("gpt2_lm"))
    assert_same(bk, ref)


# ----------------------------------------------------------------------------- LoRA


def lora(model, targets, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets,
                          init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg).eval()


@pytest.mark.parametrize(
    "name,targets,extra",
    [
        ("bert", ["query", "value"], {"modules_to_save": ["classifier"]}),
        ("bert", ["query", "value", "word_embeddings"], {}),
        ("roberta", ["query", "value"], {}),
        ("gpt2_lm", ["c_attn"], {"fan_in_fan_out": True}),
        ("llama_untied", ["q_proj", "v_proj"], {}),
        ("qwen2_tied", ["q_proj", "v_proj", "embed_tokens"], {}),
    ],
)
def test_lora_matches_reference(name, targets, extra):
    base, loss = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lora(base, targets, **extra)
    eng = BookKeepingEngine(model, loss, make_clip_policy("flat", 0.05))
    assert all(type(u.kind).__name__ != "FallbackKind" for u in eng.units)
    bk = eng.clipped_sum(batch_for(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(model, loss, make_clip_policy("flat", 0.05)).clipped_sum(
            batch_for(name))
    assert_same(bk, ref)
    assert all("lora_" in n or "classifier" in n for n in bk.grad_sum)


def test_lora_dropout_training_mode_sum_matches_nonprivate():
    """In train mode (LoRA and hidden dropout on) the unclipped sum equals the ordinary
    gradient under the same random masks, and for one example the norm is its norm."""
    base, loss = build("bert")
    base.config.hidden_dropout_prob = 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lora(base, ["query", "value"]).train()
    batch = batch_for("bert")
    eng = BookKeepingEngine(model, loss, NoClip())
    eng.check_usage(batch)  # consume the dry run's RNG before seeding
    torch.manual_seed(123)
    bk = eng.clipped_sum(batch)
    torch.manual_seed(123)
    ref = NonPrivateEngine(model, loss, NoClip()).clipped_sum(batch)
    for n, g in ref.grad_sum.items():
        torch.testing.assert_close(bk.grad_sum[n], g, rtol=1e-4, atol=1e-6)
    one = {k: v[:1] for k, v in batch.items()}
    torch.manual_seed(7)
    bk1 = eng.clipped_sum(one)
    torch.manual_seed(7)
    ref1 = NonPrivateEngine(model, loss, NoClip()).clipped_sum(one)
    for j, n in enumerate(eng.param_names):
        assert float(bk1.sq_norms[0, j]) == pytest.approx(
            float(ref1.grad_sum[n].pow(2).sum()), rel=1e-4, abs=1e-10)


# ----------------------------------------------------------------------------- engine contract


def test_param_grads_stay_none_and_flags_restored():
    model, loss = build("gpt2_lm")
    eng = BookKeepingEngine(model, loss, make_clip_policy("per_layer", 0.5))
    for _ in range(2):
        eng.clipped_sum(batch_for("gpt2_lm"))
    for p in model.parameters():
        assert p.grad is None
        assert p.requires_grad


def test_frozen_parameters_are_ignored():
    model, loss = build("bert")
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("classifier") or "layer.1." in n)
    bk, ref = run_both(model, loss, batch_for("bert"), make_clip_policy("flat", 0.5))
    assert_same(bk, ref)
    assert all(p.grad is None for p in model.parameters())


class Scaler(nn.Module):
    """A layer kind the engine has no rule for: y = x * gamma + beta * tanh(x)."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))
        self.beta = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gamma + self.beta * torch.tanh(x)


class TinyClassifier(nn.Module):
    def __init__(self, d=16, outside_use=False):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.scale = Scaler(d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d, bias=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)
        self.outside_use = outside_use

    def forward(self, input_ids, attention_mask=None, **_):
        h = self.scale(self.emb(input_ids))
        h = torch.relu(self.fc1(h)) + self.fc2(h)
        if self.outside_use:
            h = h + F.linear(h, self.fc2.weight)  # weight used outside its module
        h = self.ln(h)
        m = attention_mask[..., None].float()
        return self.head((h * m).sum(1) / m.sum(1))


def test_fallback_module_is_exact_and_warns_once():
    torch.manual_seed(0)
    model = TinyClassifier()
    with pytest.warns(UserWarning, match="Scaler"):
        bk, ref = run_both(model, classification_loss, make_batch(), make_clip_policy("flat", 0.5))
    assert_same(bk, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning for the same class
        BookKeepingEngine(model, classification_loss, make_clip_policy("flat", 0.5))


def test_use_outside_module_forward_is_refused():
    torch.manual_seed(0)
    model = TinyClassifier(outside_use=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = BookKeepingEngine(model, classification_loss, make_clip_policy("flat", 0.5))
    with pytest.raises(UnattributedUseError, match="fc2.weight"):
        eng.clipped_sum(make_batch())


def test_embedding_with_all_tokens_equal():
    """Worst case for repeated tokens: every position of an example hits the same row."""
    torch.manual_seed(0)
    model = TinyClassifier()
    model.scale.gamma.requires_grad_(False)
    model.scale.beta.requires_grad_(False)
    batch = make_batch()
    batch["input_ids"] = torch.tensor([[5] * T, [7] * T, [5, 7] * (T // 2)])
    bk, ref = run_both(model, classification_loss, batch, make_clip_policy("flat", 0.5))
    assert_same(bk, ref)


def test_two_dim_linear_inputs_and_unused_parameters():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 8)
            self.a = nn.Linear(8 * T, 12)
            self.b = nn.Linear(12, 2)
            self.unused = nn.Linear(3, 3)

        def forward(self, input_ids, **_):
            return self.b(torch.tanh(self.a(self.emb(input_ids).flatten(1))))

    torch.manual_seed(0)
    model = MLP()
    bk, ref = run_both(model, classification_loss, make_batch(), make_clip_policy("per_layer", 0.5))
    assert_same(bk, ref)
    assert float(bk.grad_sum["unused.weight"].abs().sum()) == 0.0


def test_bad_norm_mode_and_no_trainable_parameters():
    model, loss = build("bert")
    with pytest.raises(ValueError, match="norm_mode"):
        BookKeepingEngine(model, loss, make_clip_policy("flat", 1.0), norm_mode="fast")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        BookKeepingEngine(model, loss, make_clip_policy("flat", 1.0))


@pytest.mark.integration
def test_real_stories260k_tied_llama(shared_data):
    """Real pretrained weights (llama2.c stories260K, tied embeddings, vocab 512)."""
    path = shared_data / "models" / "stories260K"
    if not (path / "config.json").is_file():
        pytest.skip("stories260K not present")
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 18:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    bk, ref = run_both(model, causal_lm_loss, batch, make_clip_policy("flat", 1.0))
    assert_same(bk, ref)


def test_fallback_module_with_tuple_output_partly_unused():
    class Pair(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.w = nn.Parameter(torch.randn(d))

        def forward(self, x):
            return x * self.w, torch.sin(x * self.w)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 8)
            self.pair = Pair(8)
            self.head = nn.Linear(8, 2)

        def forward(self, input_ids, **_):
            a, _unused = self.pair(self.emb(input_ids))
            return self.head(a.mean(1))

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bk, ref = run_both(M(), classification_loss, make_batch(), make_clip_policy("flat", 0.5))
    assert_same(bk, ref)


def test_first_call_check_does_not_consume_the_global_rng():
    """Resume needs dropout masks to depend only on (seed, step): the one-time usage probe
    must not advance the global generator."""
    model, loss = build("bert")
    model.train()
    eng = BookKeepingEngine(model, loss, make_clip_policy("flat", 1.0))
    torch.manual_seed(123)
    eng.clipped_sum(batch_for("bert"))  # first call: probe + step
    after_first = torch.get_rng_state()
    torch.manual_seed(123)
    eng.clipped_sum(batch_for("bert"))  # checked already: step only
    assert torch.equal(after_first, torch.get_rng_state())


# ----------------------------------------------------------------------------- flattened layouts (issue 27)


class _Flat(nn.Module):
    """Embedding, then a LayerNorm + Linear + routed gate applied to the tokens flattened to
    (B*T, d): token-major (``x.reshape(-1, d)``, as OPT and MoE blocks do) or, with
    ``interleave``, time-major (``x.transpose(0, 1).reshape(-1, d)``: row r is example r % B)."""

    def __init__(self, interleave=False, d=8, v=30):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)
        self.interleave = interleave

    def forward(self, x):
        h = self.emb(x)
        b, t, d = h.shape
        f = h.transpose(0, 1).reshape(-1, d) if self.interleave else h.reshape(-1, d)
        f = torch.tanh(self.fc(self.ln(f)))
        h = f.reshape(t, b, d).transpose(0, 1) if self.interleave else f.reshape(b, t, d)
        return self.head(h.mean(1))


def _flat_loss(fwd, batch):
    return F.cross_entropy(fwd(x=batch["x"]), batch["y"], reduction="none")


def test_token_major_flattened_inputs_are_exact():
    torch.manual_seed(0)
    model = _Flat()
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randint(0, 30, (4, 6), generator=g), "y": torch.tensor([0, 1, 2, 1])}
    clip = make_clip_policy("flat", 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(model, _flat_loss, clip).clipped_sum(batch)
    bk = BookKeepingEngine(model, _flat_loss, clip).clipped_sum(batch)
    torch.testing.assert_close(bk.sq_norms.sum(1), ref.sq_norms.sum(1), rtol=1e-4, atol=1e-9)
    for n in ref.grad_sum:
        torch.testing.assert_close(bk.grad_sum[n], ref.grad_sum[n], rtol=1e-4, atol=1e-7, msg=n)


def test_flattened_inputs_in_another_layout_are_refused():
    """(B*T, d) rows laid out time-major: the first call's layout check sees rows it would give
    example i influence example j's loss, and refuses (naming the module)."""
    from dpft.grads._hooks import BatchLayoutError

    torch.manual_seed(0)
    model = _Flat(interleave=True)
    batch = {"x": torch.randint(0, 30, (4, 6)), "y": torch.tensor([0, 1, 2, 1])}
    with pytest.raises(BatchLayoutError, match="(ln|fc): its output .* not laid out example by example"):
        BookKeepingEngine(model, _flat_loss, make_clip_policy("flat", 0.05)).clipped_sum(batch)


def test_a_non_batch_first_call_is_an_error_only_if_a_gradient_reaches_it():
    """peft DoRA computes ``lora_B(lora_A(eye))`` (detached) inside its forward: that call has no
    batch dimension but receives no gradient, so it is harmless; the same call used in the loss
    raises."""
    from dpft.grads._hooks import BatchLayoutError

    class EyeUse(nn.Module):
        def __init__(self, used):
            super().__init__()
            self.emb = nn.Embedding(30, 5)
            self.fc = nn.Linear(5, 3)
            self.used = used

        def forward(self, x):
            w = self.fc(torch.eye(5))  # (5, 3): no example dimension (5 % 4 != 0)
            out = self.fc(self.emb(x)).mean(1)
            return out + (w.sum() if self.used else w.detach().sum())

    batch = {"x": torch.randint(0, 30, (4, 6)), "y": torch.tensor([0, 1, 2, 1])}
    clip = make_clip_policy("flat", 0.05)
    torch.manual_seed(0)
    model = EyeUse(used=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(model, _flat_loss, clip).clipped_sum(batch)
    bk = BookKeepingEngine(model, _flat_loss, clip).clipped_sum(batch)
    for n in ref.grad_sum:
        torch.testing.assert_close(bk.grad_sum[n], ref.grad_sum[n], rtol=1e-4, atol=1e-7, msg=n)
    with pytest.raises(BatchLayoutError, match="fc"):
        BookKeepingEngine(EyeUse(used=True), _flat_loss, clip).clipped_sum(batch)
