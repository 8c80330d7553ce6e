"""DP-Adam-AC (issue 6): text task, DP-Adam family, private adaptive clipping, paper flag, variable q."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import pytest
import torch

from dpft.privacy.randomness import Randomness

from dpft.accounting.calibrate import dp_sgd_event
from dpft.accounting.ledger import NotCertifiedError, epsilon_of, pld_accountant
from dpft.config.recipe import load_recipe
from dpft.data.text import chunk_blocks
from dpft.optim.dp_adam import DPAdam, GammaNudger, WeightEMA
from dpft.step.clip import AdaptiveQuantileClip, PaperPercentileClip, effective_noise_multiplier
from dpft.step.sample import ScheduledPoissonSampler

from conftest import SHARED_DATA

STORIES = SHARED_DATA / "models" / "stories260K"


# ------------------------------------------------------------------ chunking / privacy unit
def _docs(lengths):
    """Document i is made of the token i (so a row's tokens reveal which documents it mixes)."""
    return [[i] * n for i, n in enumerate(lengths)]


def test_document_unit_never_mixes_documents():
    docs = _docs([3, 70, 1, 5, 64, 65, 2])
    out = chunk_blocks(docs, 8, "document")
    assert out["input_ids"], "no rows"
    for row, d in zip(out["input_ids"], out["doc_id"]):
        assert set(row) == {d}, f"row mixes documents: {set(row)}"
        assert 2 <= len(row) <= 8
    # Every document with ≥ 2 tokens is exactly one example; the 1-token one has no target.
    assert out["doc_id"] == [0, 1, 3, 4, 5, 6]


def test_block_unit_is_the_concatenated_stream_cut_into_full_blocks():
    docs = _docs([3, 10, 5, 9])
    out = chunk_blocks(docs, 4, "block")
    stream = [t for d in docs for t in d]
    assert all(len(r) == 4 for r in out["input_ids"])
    assert [t for r in out["input_ids"] for t in r] == stream[: len(stream) // 4 * 4]
    assert out["doc_id"] == [r[0] for r in out["input_ids"]]
    with pytest.raises(ValueError, match="block size"):
        chunk_blocks(docs, 1)


# ------------------------------------------------------------------ adaptive clipping
@pytest.mark.parametrize("dist", ["lognormal", "uniform"])
def test_adaptive_clip_converges_to_target_quantile(dist):
    g = torch.Generator().manual_seed(1)
    n = 20000
    norms = torch.exp(torch.randn(n, generator=g) * 0.7 + 1.0) if dist == "lognormal" else torch.rand(n, generator=g) * 10
    target = 0.8
    true_q = float(torch.quantile(norms, target))
    clip = AdaptiveQuantileClip(0.5, target_unclipped=target, lr=0.2, count_noise=256 / 20, rng=Randomness(3))
    q = 256 / n
    for step in range(600):
        idx = torch.nonzero(torch.rand(n, generator=g) < q).flatten()
        # the policy's own factors decide "unclipped" exactly as in the loop
        scales = clip.scales(norms[idx, None] ** 2)
        unclipped = int((scales[:, 0] >= 1).sum())
        clip.update(clip.noisy_unclipped_fraction(unclipped, len(idx), q * n, step))
    frac = float((norms <= clip.max_norm).float().mean())
    assert abs(frac - target) < 0.05, (frac, clip.max_norm, true_q)
    assert abs(clip.max_norm / true_q - 1) < 0.15


def test_adaptive_clip_respects_bounds_and_noise_formula():
    clip = AdaptiveQuantileClip(1.0, 0.8, lr=5.0, count_noise=1.0, min_norm=0.5, max_norm=2.0)
    assert clip.update(0.0) == 2.0  # nothing unclipped → grow, clamped at C_max
    assert clip.update(1.0) == pytest.approx(2.0 * math.exp(-5 * 0.2))
    for _ in range(10):
        clip.update(1.0)
    assert clip.max_norm == 0.5
    # σ⁻² = σ_Δ⁻² + (2σ_b)⁻² (Andrew et al. 2021, Thm. 1)
    s, sb = 1.0, 3.2
    sd = effective_noise_multiplier(s, sb)
    assert sd > s and sd ** -2 + (2 * sb) ** -2 == pytest.approx(s ** -2)
    assert effective_noise_multiplier(0.0, 3.2) == 0.0
    with pytest.raises(ValueError, match="count_noise"):
        effective_noise_multiplier(1.0, 0.5)


def test_joint_release_is_accounted_by_one_gaussian_event():
    """The gradient (σ_Δ, sensitivity C) and the centred count (σ_b, sensitivity ½) compose, per
    step and under Poisson sampling, to exactly the Gaussian event with σ that the ledger records."""
    s, sb, q, steps, delta = 0.9, 2.0, 0.05, 40, 1e-5
    sd = effective_noise_multiplier(s, sb)
    # Two Gaussian mechanisms on the same sampled batch are one Gaussian on the stacked vector:
    # dp_accounting's PLD of the pair (normalised multipliers σ_Δ and σ_b/(½)) equals Gaussian(σ).
    pair = pld_accountant()
    pair.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(sd), dpa.GaussianDpEvent(2 * sb)]))
    one = pld_accountant()
    one.compose(dpa.GaussianDpEvent(s))
    assert pair.get_epsilon(delta) == pytest.approx(one.get_epsilon(delta), rel=2e-3)
    rep = epsilon_of([dp_sgd_event(s, q, steps)], delta)
    assert math.isfinite(rep.epsilon) and rep.epsilon > 0


# ------------------------------------------------------------------ optimizers
def test_adambc_matches_its_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
    ref = p.detach().clone()
    opt = DPAdam([p], lr=0.1, betas=(0.9, 0.99), bias_correction=True, bc_floor=1e-3)
    m = torch.zeros(3)
    v = torch.zeros(3)
    phi_ema = 0.0
    grads = [torch.tensor([0.3, -0.2, 0.1]), torch.tensor([0.5, 0.1, -0.4]), torch.tensor([-0.1, 0.2, 0.3])]
    phis = [0.01, 0.04, 0.02]
    for t, (gr, phi) in enumerate(zip(grads, phis), start=1):
        p.grad = gr.clone()
        opt.set_noise_variance(phi)
        opt.step()
        m = 0.9 * m + 0.1 * gr
        v = 0.99 * v + 0.01 * gr * gr
        phi_ema = 0.99 * phi_ema + 0.01 * phi
        m_hat, v_hat, phi_hat = m / (1 - 0.9 ** t), v / (1 - 0.99 ** t), phi_ema / (1 - 0.99 ** t)
        ref = ref - 0.1 * m_hat / torch.clamp(v_hat - phi_hat, min=1e-3).sqrt()
        assert torch.allclose(p.detach(), ref, atol=1e-6), t
    # constant Φ: Φ̂ is Φ itself
    assert phi_ema / (1 - 0.99 ** 3) != pytest.approx(0.0)
    with pytest.raises(RuntimeError, match="set_noise_variance"):
        p.grad = grads[0].clone()
        opt.step()


def test_dp_adam_equals_torch_adam_and_adamw():
    for wd in (0.0, 0.1):
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(5))
        b = torch.nn.Parameter(a.detach().clone())
        mine = DPAdam([a], lr=0.01, weight_decay=wd)
        theirs = torch.optim.AdamW([b], lr=0.01, weight_decay=wd)
        for _ in range(5):
            g = torch.randn(5)
            a.grad, b.grad = g.clone(), g.clone()
            mine.step()
            theirs.step()
        assert torch.allclose(a, b, atol=1e-6)


def test_gamma_nudger_and_ema():
    gn = GammaNudger(0.1, 0.3, 1.01, 0.995, 0.1, 2.0)
    assert gn.update(0.05) == pytest.approx(1.01)
    assert gn.update(0.2) == pytest.approx(1.01)
    assert gn.update(0.9) == pytest.approx(1.01 * 0.995)
    for _ in range(2000):
        gn.update(0.0)
    assert gn.gamma == 2.0
    for _ in range(5000):
        gn.update(1.0)
    assert gn.gamma == 0.1
    p = torch.nn.Parameter(torch.zeros(2))
    ema = WeightEMA({"w": p}, 0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    assert torch.allclose(ema.shadow["w"], torch.full((2,), 0.1))
    with ema.swap():
        assert torch.allclose(p, torch.full((2,), 0.1))
    assert torch.allclose(p, torch.ones(2))


def test_paper_percentile_rule():
    clip = PaperPercentileClip(3.0, target_clip_rate=0.2, history=5)
    c = clip.update_from_norms(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert clip.buffer == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert c == pytest.approx(float(torch.quantile(torch.tensor(clip.buffer), 0.8)))


# ------------------------------------------------------------------ variable q
def test_scheduled_sampler_and_heterogeneous_ledger():
    s = ScheduledPoissonSampler(1000, [(0, 10), (3, 50)], Randomness(0))
    assert [s.q_at(t) for t in range(5)] == [0.01, 0.01, 0.01, 0.05, 0.05]
    with pytest.raises(ValueError, match="step 0"):
        ScheduledPoissonSampler(1000, [(1, 10)], Randomness(0))
    with pytest.raises(ValueError, match="increase"):
        ScheduledPoissonSampler(1000, [(0, 10), (0, 20)], Randomness(0))
    sizes = [len(s.indices(t)) for t in range(40)]
    assert sum(sizes[3:]) > sum(sizes[:3])


# ------------------------------------------------------------------ trainer integration
def _tiny_lm_dir(tmp_path, family: str):
    import transformers
    from transformers import AutoTokenizer

    if not (STORIES / "tokenizer.json").is_file():
        pytest.skip("stories260K tokenizer not present")
    tok = AutoTokenizer.from_pretrained(STORIES)
    torch.manual_seed(0)
    common = dict(vocab_size=512)
    if family == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, **common))
    else:
        cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[family]
        m = cls(cfg(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=64, **common))
    d = tmp_path / f"tiny-{family}"
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _corpus(tmp_path):
    words = ["the", "cheap", "pub", "near", "river", "serves", "french", "food", "family", "friendly"]
    lines = [" ".join(words[(i * 7 + k) % 10] for k in range(5 + i % 9)) + "." for i in range(160)]
    p = tmp_path / "corpus.txt"
    p.write_text("\n".join(lines))
    return p


def _recipe(tmp_path, model_dir, **extra):
    ov = {"task.name": "text", "task.train_file": str(_corpus(tmp_path)), "model.name": str(model_dir),
          "model.max_length": 16, "privacy.noise_multiplier": 0.8, "privacy.target_epsilon": None,
          "privacy.delta": 1e-4, "privacy.clipping.max_norm": 3.0, "optimizer.name": "adam", "optimizer.lr": 1e-3,
          "schedule.steps": 4, "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 8,
          "eval.every_steps": 2, "eval.prompts": ["the pub"], "eval.max_new_tokens": 5}
    ov.update(extra)
    return load_recipe(None, ov)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_text_task_dp_adam_ac_end_to_end(tmp_path, family):
    from dpft.run.loop import Trainer

    rec = _recipe(tmp_path, _tiny_lm_dir(tmp_path, family), **{
        "adam_ac.adaptive_clip": True, "adam_ac.gamma_nudge": True, "adam_ac.ema_decay": 0.9,
        "adam_ac.bias_correction": family == "llama"})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    rep = tr.run()
    # one GaussianDpEvent(σ) per step, for gradient and count together; ε is dp_accounting's
    assert [e.event for e in tr.ledger.entries] == [dpa.PoissonSampledDpEvent(tr.q, dpa.GaussianDpEvent(0.8))]
    assert tr.ledger.steps == 4
    expect = epsilon_of([dp_sgd_event(0.8, tr.q, 4)], 1e-4).epsilon
    assert rep["privacy"]["epsilon"] == pytest.approx(expect)
    assert tr.method("dp_adam_ac").noise_sigma == pytest.approx(effective_noise_multiplier(0.8, 16 / 20))
    hist = rep["history"]
    assert all("clip_rate_private" in h and "gamma" in h and "clip_norm" in h for h in hist)
    assert hist[1]["clip_norm"] != hist[0]["clip_norm"]  # C moved
    m = rep["metrics"]
    assert m["dev_perplexity"] == pytest.approx(math.exp(m["dev_loss"]))
    assert "dev_loss_raw" in m
    assert rep["lm"]["samples"][0]["prompt"] == "the pub"
    assert (tmp_path / "run" / "model_ema" / "config.json").is_file()
    md = (tmp_path / "run" / "report.md").read_text()
    assert "privacy unit: one block of 16 tokens" in md and "Sampled generations" in md


def test_reproduction_flag_is_not_certified(tmp_path):
    from dpft.outputs.report import epsilon_line
    from dpft.run.loop import Trainer

    rec = _recipe(tmp_path, _tiny_lm_dir(tmp_path, "llama"), **{"adam_ac.reproduce_paper": True})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    rep = tr.run()
    assert rep["privacy"]["guarantee"] == "NOT CERTIFIED" and rep["privacy"]["epsilon"] is None
    assert epsilon_line(rep).startswith("ε: NOT CERTIFIED")
    assert "ε: NOT CERTIFIED" in (tmp_path / "run" / "report.md").read_text()
    assert "raw, un-noised" in rep["privacy"]["reason"]
    with pytest.raises(NotCertifiedError):
        tr.ledger.epsilon(1e-4)
    saved = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert saved["certified"] is False
    assert any("gamma" in h for h in rep["history"])


def test_variable_q_schedule_in_ledger(tmp_path):
    from dpft.run.loop import Trainer

    rec = _recipe(tmp_path, _tiny_lm_dir(tmp_path, "llama"), **{"batch.schedule": [[0, 8], [2, 24]]})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    rep = tr.run()
    n = tr.n
    events = [(e.event, e.count) for e in tr.ledger.entries]
    g = dpa.GaussianDpEvent(0.8)
    assert events == [(dpa.PoissonSampledDpEvent(8 / n, g), 2), (dpa.PoissonSampledDpEvent(24 / n, g), 2)]
    expect = epsilon_of([dp_sgd_event(0.8, 8 / n, 2), dp_sgd_event(0.8, 24 / n, 2)], 1e-4).epsilon
    assert rep["privacy"]["epsilon"] == pytest.approx(expect)
    with pytest.raises(Exception, match="noise_multiplier"):
        Trainer(_recipe(tmp_path, _tiny_lm_dir(tmp_path, "llama"), **{
            "batch.schedule": [[0, 8]], "privacy.noise_multiplier": None, "privacy.target_epsilon": 3.0}),
            tmp_path / "run2", progress=False)


def test_document_unit_and_config_errors(tmp_path):
    from dpft.run.loop import Trainer

    d = _tiny_lm_dir(tmp_path, "llama")
    tr = Trainer(_recipe(tmp_path, d, **{"task.unit": "document"}), tmp_path / "run", progress=False)
    assert all(len(x) <= 16 for x in tr.train_tok["input_ids"])
    assert len(set(tr.train_tok["doc_id"])) == len(tr.train_tok)  # one row per document
    with pytest.raises(ValueError, match="count_noise"):
        Trainer(_recipe(tmp_path, d, **{"adam_ac.adaptive_clip": True, "adam_ac.count_noise": 0.3}),
                tmp_path / "run3", progress=False)
    with pytest.raises(ValueError, match="gamma_nudge needs"):
        Trainer(_recipe(tmp_path, d, **{"adam_ac.gamma_nudge": True}), tmp_path / "run4", progress=False)


def test_causal_lm_keeps_the_named_tokenizer_class(tmp_path):
    """A Qwen2 model saved with stories260K's (Llama, sentencepiece) tokenizer keeps that tokenizer:
    transformers would otherwise pick Qwen2Tokenizer from the model type (different segmentation)."""
    from transformers import AutoTokenizer

    from dpft.models.causal import load_causal_lm

    d = _tiny_lm_dir(tmp_path, "qwen2")
    tok, _ = load_causal_lm(str(d))
    ref = AutoTokenizer.from_pretrained(STORIES)
    s = "The Eagle is a cheap pub near the river."
    assert tok(s)["input_ids"] == ref(s)["input_ids"]
    assert tok.decode(tok(s)["input_ids"], skip_special_tokens=True) == s
