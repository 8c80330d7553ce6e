"""Forward-pass LDP: Frobenius clipping, sensitivity 2C, analytic-Gaussian local ε, the
stacked autoencoder and the split BERT classifier (privacy/ldp.py)."""

import math

import pytest
import torch

from conftest import tiny_classifier
from dpft.privacy.randomness import Randomness
from dpft.privacy.ldp import (GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, clip_frobenius,
                              local_epsilon, local_epsilon_composed, parse_position, pretrain_autoencoder)


def test_clip_frobenius_bound_and_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 4, generator=g) * torch.tensor([0.01, 0.1, 1, 3, 10, 100]).view(6, 1, 1)
    y = clip_frobenius(x, 1.0)
    norms = y.flatten(1).norm(dim=1)
    assert (norms <= 1.0 + 1e-6).all()
    small = x.flatten(1).norm(dim=1) <= 1.0
    assert torch.allclose(y[small], x[small])  # below C: untouched
    assert torch.allclose(clip_frobenius(x, 2.0, normalize=True).flatten(1).norm(dim=1), torch.full((6,), 2.0))
    with pytest.raises(LDPError, match="C must be > 0"):
        clip_frobenius(x, 0.0)


def test_sensitivity_is_2c_and_noise_std():
    layer = GaussianLDP(max_norm=0.5, sigma=1.5, generator=Randomness(1).stream("ldp"))
    assert layer.sensitivity == 1.0
    z = layer.release(torch.zeros(64, 32, 16))
    assert z.std().item() == pytest.approx(1.5 * 2 * 0.5, rel=0.02)
    # two worst-case inputs after clipping are 2C apart: the noise is σ relative to that
    a, b = clip_frobenius(torch.full((1, 4, 4), 9.0), 0.5), clip_frobenius(torch.full((1, 4, 4), -9.0), 0.5)
    assert (a - b).norm().item() == pytest.approx(layer.sensitivity, rel=1e-6)
    layer.eval()
    layer.eval_noise = False
    x = torch.randn(2, 3, 4)
    assert torch.allclose(layer.release(x), clip_frobenius(x, 0.5))


def test_local_epsilon_analytic_matches_pld_replace_one():
    for s in (0.8, 2.0):
        assert local_epsilon_composed([s], 1e-5) == pytest.approx(local_epsilon(s, 1e-5), abs=2e-3)
    # k identical releases = one release at σ/√k (Gaussian composition)
    assert local_epsilon_composed([2.0] * 4, 1e-5) == pytest.approx(local_epsilon(1.0, 1e-5), abs=1e-9)
    # the closed form equals dp_accounting's replace-one PLD composition (GaussianDpEvent(2σ):
    # inputs at ±1, std 2σ) up to the PLD's pessimistic discretisation, and never exceeds it
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    for sig in ([0.8, 1.2, 2.0], [0.5] * 5):
        acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                                   value_discretization_interval=1e-4)
        acc.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0 * s) for s in sig]))
        pld = acc.get_epsilon(1e-5)
        assert local_epsilon_composed(sig, 1e-5) == pytest.approx(pld, rel=1e-6)
    assert math.isinf(local_epsilon(0.0, 1e-5))
    # textbook bound σ ≥ √(2 ln(1.25/δ))/ε is looser than the analytic one
    eps = 1.0
    sigma_classic = math.sqrt(2 * math.log(1.25 / 1e-5)) / eps
    assert local_epsilon(sigma_classic, 1e-5) < eps


def test_autoencoder_shapes_and_pretraining_reduces_loss():
    ae = StackedAutoencoder([16, 8, 4])
    h = torch.randn(3, 5, 16)
    assert ae.encode(h).shape == (3, 5, 4) and ae.decode(ae.encode(h)).shape == (3, 5, 16)
    torch.manual_seed(0)
    basis = torch.randn(4, 16)
    data = [(torch.randn(8, 5, 4) @ basis * 0.05, torch.ones(8, 5)) for _ in range(4)]
    hist = pretrain_autoencoder(ae, data, max_norm=1.0, epochs=30, lr=3e-3)
    assert hist[-1] < 0.5 * hist[0]
    with pytest.raises(LDPError):
        StackedAutoencoder([16])


def test_release_is_detached_and_encoder_side():
    ae = StackedAutoencoder([16, 4])
    layer = GaussianLDP(1.0, 0.3, autoencoder=ae)
    h = torch.randn(2, 5, 16, requires_grad=True)
    z = layer.release(h)
    assert z.shape == (2, 5, 4) and not z.requires_grad
    out = layer(h)
    assert out.shape == (2, 5, 16) and out.requires_grad  # the decoder trains (server side)


@pytest.mark.parametrize("position", ["embeddings", "encoder:1", "output"])
def test_split_classifier_equals_model_without_noise(position):
    m = tiny_classifier("bert")
    ids = torch.randint(3, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    split = SplitClassifier(m, position, GaussianLDP(max_norm=1e9, sigma=0.0), max_length=8).eval()
    with torch.no_grad():
        out = split(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.allclose(out, ref, atol=1e-5)


def test_split_classifier_freezes_pre_and_pads():
    m = tiny_classifier("bert")
    split = SplitClassifier(m, "encoder:1", GaussianLDP(1.0, 0.5, StackedAutoencoder([16, 4])), max_length=12)
    trainable = {n for n, p in split.named_parameters() if p.requires_grad}
    assert not any("embeddings" in n or "layer.0." in n or "autoencoder.encoder" in n for n in trainable)
    assert any("layer.1." in n for n in trainable) and any("classifier" in n for n in trainable)
    assert any("autoencoder.decoder" in n for n in trainable)
    ids = torch.randint(3, 64, (2, 7))
    z = split.release(ids, torch.ones_like(ids))
    assert z.shape == (2, 12, 4)  # fixed length T = max_length: the token count is not released
    assert (z.flatten(1).norm(dim=1) > 0).all()
    split.train()
    loss = split(input_ids=ids).logits.sum()
    loss.backward()
    assert m.classifier.weight.grad is not None and m.bert.embeddings.word_embeddings.weight.grad is None


def test_parse_position_errors():
    assert parse_position("embeddings", 6) == 0 and parse_position("output", 6) == 6
    assert parse_position("encoder:3", 6) == 3
    for bad in ("encoder:0", "encoder:7", "middle"):
        with pytest.raises(LDPError, match="ldp.position"):
            parse_position(bad, 6)


def test_pre_cache_gives_identical_hidden_states():
    m = tiny_classifier("bert")
    split = SplitClassifier(m, "encoder:1", GaussianLDP(1.0, 0.0), max_length=10)
    ids = torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ref = split.pre(ids, mask)
    split.pre_cache = {}
    part = split.pre(ids[:2], mask[:2])  # fills two rows
    full = split.pre(ids, mask)  # two hits, two misses
    assert torch.allclose(part, ref[:2], atol=1e-6) and torch.allclose(full, ref, atol=1e-6)
    assert len(split.pre_cache) == 4
