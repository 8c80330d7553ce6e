"""Tests for the RMT gradient denoiser (dpft.transforms.rmt).

Synthetic model, in the denoiser's own units: ``G̃ = S + E`` with ``E_ij ~ N(0, s²)`` and a
low-rank signal ``S = s √n Σ_k x_k a_k b_kᵀ`` (``x_k`` in normalised units, BBP threshold
``x > β^{1/4}``). What is compared, and why it is fair:

* with the norm correction, ``‖Ĝ‖_F = ‖G̃‖_F``, so ``‖Ĝ - S‖`` vs ``‖G̃ - S‖`` compares two
  estimates of the same norm — equivalent to comparing cosines with ``S``;
* without it (plain Gavish–Donoho), comparing with ``G̃`` itself would be unfair to ``G̃``
  (its norm is inflated by the noise), so the baseline is the *oracle* best rescaling
  ``min_c ‖c G̃ - S‖`` (which uses the unknown ``S``) and the unshrunk truncated SVD at the
  bulk edge; the raw error is also checked against the asymptotic risk of the shrinker.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dpft.transforms.rmt import (
    DEFAULT_KAPPA,
    MatrixParam,
    RMTDenoiser,
    averaged_noise_std,
    bulk_edge,
    cosine_report,
    matrix_param_names,
    optimal_shrinkage,
)

S_NOISE = 1e-3


def spiked(m, n, xs, s=S_NOISE, seed=0, dtype=torch.float32):
    """Return (signal, noisy) of shape (m, n); ``xs`` in normalised units of the oriented
    matrix (long side ``max(m, n)``)."""
    g = torch.Generator().manual_seed(seed)
    long = max(m, n)
    if xs:
        a = torch.linalg.qr(torch.randn(m, len(xs), generator=g, dtype=torch.float64)).Q
        b = torch.linalg.qr(torch.randn(n, len(xs), generator=g, dtype=torch.float64)).Q
        sig = s * math.sqrt(long) * (a * torch.tensor(xs, dtype=torch.float64)) @ b.T
    else:
        sig = torch.zeros(m, n, dtype=torch.float64)
    noisy = sig + s * torch.randn(m, n, generator=g, dtype=torch.float64)
    return sig.to(dtype), noisy.to(dtype)


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def denoise(g, s=S_NOISE, **kw):
    return RMTDenoiser(targets="all-2d", **kw)({"w": g}, s)["w"]


# (m, n, signal strengths in units of the BBP threshold β^{1/4})
CASES = [
    (64, 64, [2.0]),
    (64, 64, [2.5, 1.6]),
    (32, 128, [3.0, 2.0, 1.6]),
    (128, 48, [3.0, 2.2, 1.8, 1.5]),
    (48, 128, [2.5]),
]


def _xs(m, n, rel):
    beta = min(m, n) / max(m, n)
    return [r * beta**0.25 for r in rel]


# ------------------------------------------------------------------------------ formulas


@pytest.mark.parametrize("beta", [1.0, 0.375, 0.25, 0.01])
def test_shrinker_equals_shabalin_nobel_form(beta):
    # Gavish & Donoho (2017) Eq. (7) closed form == x(y) c(y) c̃(y) (Shabalin & Nobel 2013).
    x = beta**0.25 * torch.linspace(1.01, 20.0, 200, dtype=torch.float64)
    y = torch.sqrt((1 + x**2) * (beta + x**2)) / x  # spike location (BBP)
    c2 = (x**4 - beta) / (x**4 + beta * x**2)
    ct2 = (x**4 - beta) / (x**4 + x**2)
    expected = x * torch.sqrt(c2 * ct2)
    torch.testing.assert_close(optimal_shrinkage(y, beta), expected, rtol=1e-9, atol=1e-12)
    assert bool((y > bulk_edge(beta)).all())


def test_shrinker_zero_at_and_below_edge_and_shrinks():
    beta = 0.25
    edge = bulk_edge(beta)
    y = torch.tensor([0.0, 0.5, 1.0, edge, edge + 1e-9, 2.0, 10.0], dtype=torch.float64)
    eta = optimal_shrinkage(y, beta)
    assert eta[:4].eq(0).all()
    assert bool((eta >= 0).all()) and bool((eta <= y).all())
    assert bool((eta[4:].diff() > 0).all())


def test_averaged_noise_std():
    assert averaged_noise_std(1.0, 2.0, 0.01, 1000) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        averaged_noise_std(1.0, 1.0, 0.0, 1000)
    with pytest.raises(ValueError):
        averaged_noise_std(-1.0, 1.0, 0.1, 1000)


# ------------------------------------------------------------------------------ denoising quality


@pytest.mark.parametrize("m,n,rel", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_denoiser_improves_alignment_at_equal_norm(m, n, rel, seed):
    sig, noisy = spiked(m, n, _xs(m, n, rel), seed=seed)
    den = RMTDenoiser(targets="all-2d")
    out = den({"w": noisy}, S_NOISE)["w"]
    st_ = den.last_stats["w"]
    # weak planted spikes (1.5-1.8 x BBP) may fall back into the bulk at these small sizes
    assert st_.touched and 1 <= st_.n_spikes <= len(rel)
    assert out.norm().item() == pytest.approx(noisy.norm().item(), rel=1e-5)
    assert cos(out, sig) > cos(noisy, sig) + 0.05
    assert (out - sig).norm() < (noisy - sig).norm()  # same norm: a fair comparison


@pytest.mark.parametrize("m,n", [(64, 64), (32, 128), (128, 48)])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_spike_count_recorded(m, n, k):
    _, noisy = spiked(m, n, _xs(m, n, [4.0, 3.5, 3.0, 2.6][:k]), seed=k)
    den = RMTDenoiser(targets="all-2d")
    den({"w": noisy}, S_NOISE)
    st_ = den.last_stats["w"]
    assert st_.touched and st_.n_spikes == k and st_.top_over_edge > den.kappa
    assert (st_.m, st_.n) == (min(m, n), max(m, n)) and st_.shape == (m, n)


@pytest.mark.parametrize("m,n,rel", CASES)
def test_plain_estimator_beats_oracle_rescaled_noisy_and_tsvd(m, n, rel):
    raw_err, oracle_err, tsvd_err = [], [], []
    for seed in range(4):
        sig, noisy = spiked(m, n, _xs(m, n, rel), seed=seed, dtype=torch.float64)
        raw = denoise(noisy, norm_correction=False)
        raw_err.append(float((raw - sig).norm()))
        # best scalar multiple of the noisy matrix, chosen with the (unknown) signal
        c = float((noisy * sig).sum() / (noisy * noisy).sum())
        oracle_err.append(float((c * noisy - sig).norm()))
        # hard threshold at the bulk edge, no shrinkage
        mm, nn_ = min(m, n), max(m, n)
        U, Sv, Vh = torch.linalg.svd(noisy, full_matrices=False)
        keep = Sv / (S_NOISE * math.sqrt(nn_)) > bulk_edge(mm / nn_)
        tsvd = (U[:, keep] * Sv[keep]) @ Vh[keep]
        tsvd_err.append(float((tsvd - sig).norm()))
        assert raw_err[-1] < oracle_err[-1]
    assert sum(raw_err) < sum(tsvd_err)


@pytest.mark.parametrize(
    "m,n,xs", [(256, 512, [3.0, 2.0, 1.2]), (128, 128, [2.5, 1.5]), (100, 400, [2.0, 1.0, 0.8])]
)
def test_plain_estimator_risk_matches_asymptotic_theory(m, n, xs):
    # Asymptotic loss of the optimal shrinker (normalised units): Σ_k x_k² (1 - c_k² c̃_k²)
    # for detectable spikes (Gavish & Donoho 2017, Sec. 3); it depends on η being right.
    beta = m / n
    theory = 0.0
    for x in xs:
        c2 = (x**4 - beta) / (x**4 + beta * x**2)
        ct2 = (x**4 - beta) / (x**4 + x**2)
        theory += x**2 * (1 - c2 * ct2)
    losses = []
    for seed in range(4):
        sig, noisy = spiked(m, n, xs, seed=seed, dtype=torch.float64)
        raw = denoise(noisy, norm_correction=False)
        losses.append(float(((raw - sig) / (S_NOISE * math.sqrt(n))).pow(2).sum()))
    assert sum(losses) / len(losses) == pytest.approx(theory, rel=0.12)


# ------------------------------------------------------------------------------ untouched cases


@pytest.mark.parametrize("m,n", [(64, 64), (32, 128), (128, 48), (8, 768)])
@pytest.mark.parametrize("rank", [None, 4])
def test_pure_noise_is_returned_unchanged(m, n, rank):
    for seed in range(3):
        _, noisy = spiked(m, n, [], seed=seed)
        keep = noisy.clone()
        den = RMTDenoiser(targets="all-2d", rank=rank)
        out = den({"w": noisy}, S_NOISE)
        assert out["w"] is noisy and torch.equal(out["w"], keep)
        st_ = den.last_stats["w"]
        assert not st_.touched and st_.top_sv <= st_.threshold


def test_sub_bbp_signal_is_returned_unchanged():
    _, noisy = spiked(64, 64, [0.5], seed=3)  # x = 0.5 < β^{1/4} = 1: undetectable
    out = RMTDenoiser(targets="all-2d")({"w": noisy}, S_NOISE)["w"]
    assert out is noisy


def test_zero_noise_is_identity_and_bad_noise_raises():
    _, g = spiked(16, 32, [3.0])
    den = RMTDenoiser(targets="all-2d")
    assert den({"w": g}, 0.0)["w"] is g
    assert not den.last_stats["w"].touched
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            den({"w": g}, bad)


def test_constructor_validation():
    with pytest.raises(ValueError):
        RMTDenoiser(kappa=0.9)
    with pytest.raises(ValueError):
        RMTDenoiser(rank=0)
    with pytest.raises(ValueError):
        RMTDenoiser(targets="everything")
    assert RMTDenoiser().kappa == DEFAULT_KAPPA >= 1


# ------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("rank", [None, 6])
def test_norm_preserved(dtype, rel, rank):
    for m, n, r in CASES:
        _, noisy = spiked(m, n, _xs(m, n, r), dtype=dtype)
        out = denoise(noisy, rank=rank)
        assert out.dtype == dtype and out.shape == noisy.shape
        assert out.norm().item() == pytest.approx(noisy.norm().item(), rel=rel)


def test_low_precision_dtype_roundtrip():
    _, noisy = spiked(64, 96, [3.0, 2.0])
    g = noisy.to(torch.bfloat16)
    out = denoise(g)
    assert out.dtype == torch.bfloat16
    assert out.float().norm().item() == pytest.approx(g.float().norm().item(), rel=1e-2)


def test_batched_equals_per_matrix_and_transpose_equivariance():
    mats = {}
    for i, rel in enumerate([[3.0], [2.0, 1.6], [], [2.5, 2.0, 1.7]]):
        mats[f"w{i}"] = spiked(48, 128, _xs(48, 128, rel), seed=10 + i, dtype=torch.float64)[1]
    # a tall one joins the same (48, 128) group after orientation
    mats["t"] = spiked(128, 48, _xs(128, 48, [2.2]), seed=20, dtype=torch.float64)[1]
    den = RMTDenoiser(targets="all-2d")
    batched = den(mats, S_NOISE)
    for name, g in mats.items():
        single = RMTDenoiser(targets="all-2d")({name: g}, S_NOISE)[name]
        torch.testing.assert_close(batched[name], single, rtol=1e-9, atol=1e-12)
        tr = RMTDenoiser(targets="all-2d")({name: g.T.contiguous()}, S_NOISE)[name]
        torch.testing.assert_close(tr.T, single, rtol=1e-9, atol=1e-12)
    assert batched["w2"] is mats["w2"]  # the pure-noise member stays untouched


@pytest.mark.parametrize("m,n,rel", CASES)
def test_randomized_top_r_matches_full_svd(m, n, rel):
    sig, noisy = spiked(m, n, _xs(m, n, rel), seed=5)
    full_den = RMTDenoiser(targets="all-2d")
    rnd_den = RMTDenoiser(targets="all-2d", rank=4 if min(m, n) > 20 else 2, oversample=8)
    full = full_den({"w": noisy}, S_NOISE)["w"]
    rnd = rnd_den({"w": noisy}, S_NOISE)["w"]
    assert rnd_den.last_stats["w"].n_spikes == full_den.last_stats["w"].n_spikes == len(rel)
    assert rnd_den.last_stats["w"].top_sv == pytest.approx(full_den.last_stats["w"].top_sv, rel=1e-4)
    assert float((rnd - full).norm() / full.norm()) < 2e-2
    assert cos(rnd, sig) == pytest.approx(cos(full, sig), abs=5e-3)


def test_randomized_flags_saturation_and_keeps_global_rng():
    _, noisy = spiked(64, 256, _xs(64, 256, [3.0, 2.5, 2.0, 1.8]), seed=7)
    state = torch.get_rng_state()
    den = RMTDenoiser(targets="all-2d", rank=2)
    den({"w": noisy}, S_NOISE)
    assert torch.equal(state, torch.get_rng_state())
    st_ = den.last_stats["w"]
    assert st_.touched and st_.rank_saturated and st_.n_spikes == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(2, 40),
    n=st.integers(2, 40),
    strength=st.floats(0.0, 6.0),
    log_s=st.floats(-6, 2),
    seed=st.integers(0, 2**16),
)
def test_property_untouched_is_identical_touched_keeps_norm(m, n, strength, log_s, seed):
    s = 10.0**log_s
    beta = min(m, n) / max(m, n)
    _, g = spiked(m, n, [strength * beta**0.25], s=s, seed=seed)
    den = RMTDenoiser(targets="all-2d")
    out = den({"w": g}, s)["w"]
    st_ = den.last_stats["w"]
    assert st_.touched == (st_.top_sv > DEFAULT_KAPPA * bulk_edge(beta))
    if st_.touched:
        assert out.norm().item() == pytest.approx(g.norm().item(), rel=1e-4)
        assert st_.n_spikes >= 1
    else:
        assert out is g


# ------------------------------------------------------------------------------ selection / API


def test_non_matrix_params_pass_through():
    _, w = spiked(64, 64, [3.0])
    grads = {
        "lin.weight": w,
        "lin.bias": torch.randn(64),
        "ln.weight": torch.randn(64),
        "emb.weight": spiked(100, 64, _xs(100, 64, [3.0]))[1],
        "conv.weight": torch.randn(2, 3, 4),
    }
    den = RMTDenoiser()
    out = den(grads, S_NOISE, matrix_names={"lin.weight"})
    assert list(out) == list(grads)
    for k in ("lin.bias", "ln.weight", "emb.weight", "conv.weight"):
        assert out[k] is grads[k]
    assert out["lin.weight"] is not w and set(den.last_stats) == {"lin.weight"}
    # explicit selection of the embedding
    out2 = RMTDenoiser(targets=["emb.weight"])(grads, S_NOISE)
    assert out2["emb.weight"] is not grads["emb.weight"] and out2["lin.weight"] is w
    out3 = RMTDenoiser(targets=lambda name, t: name.startswith("lin") and t.ndim == 2)(
        grads, S_NOISE
    )
    assert out3["lin.weight"] is not w and out3["emb.weight"] is grads["emb.weight"]


def test_selection_errors():
    grads = {"a": torch.randn(8, 8), "b": torch.randn(8)}
    with pytest.raises(ValueError, match="matrix_names"):
        RMTDenoiser()(grads, 1.0)
    with pytest.raises(ValueError, match="2-D"):
        RMTDenoiser()(grads, 1.0, matrix_names=["a", "b"])


def test_matrix_param_names_linear_conv1d_embedding():
    from transformers.pytorch_utils import Conv1D

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.lin = nn.Linear(6, 5)
            self.frozen = nn.Linear(5, 5)
            self.conv = Conv1D(7, 5)  # weight stored (in=5, out=7)
            self.ln = nn.LayerNorm(7)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight  # tied to the embedding

    model = Tiny()
    model.frozen.requires_grad_(False)
    names = matrix_param_names(model)
    assert names == {
        "lin.weight": MatrixParam("linear", False),
        "conv.weight": MatrixParam("conv1d", True),
    }
    with_emb = matrix_param_names(model, include_embeddings=True)
    assert with_emb["emb.weight"] == MatrixParam("embedding", False)
    assert "head.weight" not in with_emb  # de-duplicated tied weight
    assert "frozen.weight" in matrix_param_names(
        model, trainable_names=[n for n, _ in model.named_parameters()]
    )


def test_matrix_param_names_gpt2_conv1d():
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = GPT2Model(cfg)
    names = matrix_param_names(model)
    assert set(names) == {
        "h.0.attn.c_attn.weight",
        "h.0.attn.c_proj.weight",
        "h.0.mlp.c_fc.weight",
        "h.0.mlp.c_proj.weight",
    }
    assert all(v == MatrixParam("conv1d", True) for v in names.values())


def test_matrix_param_names_peft_lora():
    from peft import LoraConfig, get_peft_model

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(12, 16)
            self.fc2 = nn.Linear(16, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    model = get_peft_model(Net(), LoraConfig(r=4, target_modules=["fc1"], lora_alpha=8))
    names = matrix_param_names(model)
    kinds = {k: v.kind for k, v in names.items()}
    assert sorted(kinds.values()) == ["lora_A", "lora_B"]
    a = next(k for k, v in kinds.items() if v == "lora_A")
    b = next(k for k, v in kinds.items() if v == "lora_B")
    params = dict(model.named_parameters())
    assert params[a].shape == (4, 12) and params[b].shape == (16, 4)
    # the denoiser accepts the LoRA gradients through these names
    grads = {k: torch.randn_like(p) for k, p in params.items() if p.requires_grad}
    out = RMTDenoiser()(grads, 1.0, names)
    assert set(out) == set(grads)


# ------------------------------------------------------------------------------ diagnostics


def test_cosine_report_and_diagnostics_guard():
    clean, noisy = {}, {}
    for i, (m, n, rel) in enumerate(CASES):
        clean[f"l{i}"], noisy[f"l{i}"] = spiked(m, n, _xs(m, n, rel), seed=30 + i)
    clean["pure"], noisy["pure"] = spiked(32, 32, [], seed=99)
    clean["pure"] = clean["pure"] + 1e-4  # nonzero clean, untouched layer
    clean["bias"], noisy["bias"] = torch.randn(5), torch.randn(5)

    with pytest.raises(ValueError, match="non-private"):
        RMTDenoiser(targets="all-2d")(noisy, S_NOISE, clean_grads=clean)

    den = RMTDenoiser(targets="all-2d", diagnostics=True)
    out = den(noisy, S_NOISE, clean_grads=clean)
    rep = den.last_cosine_report
    assert rep == cosine_report(noisy, out, clean)
    assert set(rep["layers"]) == set(clean)
    for i in range(len(CASES)):
        assert rep["layers"][f"l{i}"]["gain"] > 0
    assert rep["layers"]["pure"]["gain"] == 0 and rep["layers"]["bias"]["gain"] == 0
    # Theorem 1: per-layer gains >= 0 at equal per-layer norms => whole-gradient gain >= 0
    assert rep["total"]["gain"] > 0
    assert rep["total"]["denoised"] == pytest.approx(cos(
        torch.cat([out[k].flatten() for k in clean]), torch.cat([clean[k].flatten() for k in clean])
    ))
    assert den.summary()["rmt/touched"] == len(CASES)
