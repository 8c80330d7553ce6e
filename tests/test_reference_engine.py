"""The torch.func reference engine equals a naive per-example loop; clipping bounds hold."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_batch, tiny_classifier
from dpft.grads.base import NonPrivateEngine
from dpft.grads.reference import ReferenceEngine
from dpft.models.losses import classification_loss
from dpft.step.clip import AutoClip, FlatClip, PerLayerClip, make_clip_policy


def naive_per_example(model, batch):
    out = {}
    b = batch["input_ids"].shape[0]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for i in range(b):
        model.zero_grad()
        one = {k: v[i:i + 1] for k, v in batch.items()}
        classification_loss(lambda **kw: model(**kw), one).sum().backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                out.setdefault(n, []).append(p.grad.detach().clone())
    model.zero_grad()
    return {n: torch.stack(out[n]) for n in names}


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2"])
def test_reference_equals_naive_loop(kind):
    model = tiny_classifier(kind)
    pad = 1 if kind == "roberta" else 0
    batch = random_batch(pad=pad)
    if kind == "roberta":  # RoBERTa positions start after the padding index
        batch["position_ids"] = batch["position_ids"] + 2
    eng = ReferenceEngine(model, classification_loss, FlatClip(1e9))
    grads, _ = eng.per_example_grads(batch)
    ref = naive_per_example(model, batch)
    assert set(grads) == set(ref)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-6)


def test_clipped_sum_matches_manual_clipping():
    model = tiny_classifier("bert")
    batch = random_batch()
    eng = ReferenceEngine(model, classification_loss, FlatClip(0.05))
    res = eng.clipped_sum(batch)
    ref = naive_per_example(model, batch)
    norms = torch.sqrt(sum(ref[n].flatten(1).pow(2).sum(1) for n in ref))
    torch.testing.assert_close(res.norms, norms, rtol=1e-4, atol=1e-7)
    c = (0.05 / (norms + 1e-6)).clamp(max=1)
    for n in ref:
        torch.testing.assert_close(res.grad_sum[n], torch.einsum("b,b...->...", c, ref[n]), rtol=1e-4, atol=1e-7)


def test_non_private_engine_is_plain_gradient_sum():
    model = tiny_classifier("bert")
    batch = random_batch()
    res = NonPrivateEngine(model, classification_loss, FlatClip(1.0)).clipped_sum(batch)
    ref = naive_per_example(model, batch)
    for n in ref:
        torch.testing.assert_close(res.grad_sum[n], ref[n].sum(0), rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["flat", "per_layer", "automatic"]),
    st.floats(1e-3, 1e3),
    st.lists(st.floats(0, 1e6), min_size=3, max_size=12),
    st.integers(1, 5),
)
def test_clipped_contribution_never_exceeds_C(style, c, flat_sq, groups):
    """Property: ‖(c_ig) g_i‖ over all groups ≤ C for any norms (incl. zero and huge)."""
    groups = min(groups, len(flat_sq))
    b = len(flat_sq) // groups
    sq = torch.tensor(flat_sq[: b * groups], dtype=torch.float64).reshape(b, groups)
    policy = make_clip_policy(style, c)
    scales = policy.scales(sq)
    contrib = torch.sqrt((scales ** 2 * sq).sum(1))
    assert torch.all(contrib <= c * (1 + 1e-9))
    assert torch.all(scales >= 0)
    if style == "flat":
        small = sq.sum(1).sqrt() < c * 0.5
        assert torch.all(scales[small] > 0.99)  # small gradients are (almost) untouched


@settings(max_examples=10, deadline=None)
@given(st.floats(1e-2, 10.0), st.integers(0, 3))
def test_real_clipped_sum_contribution_bound(c, seed):
    """End to end on a model: each example's clipped gradient has norm ≤ C."""
    model = tiny_classifier("bert")
    batch = random_batch(b=3, seed=seed)
    eng = ReferenceEngine(model, classification_loss, FlatClip(c))
    grads, _ = eng.per_example_grads(batch)
    res = eng._finish(grads, 0.0)
    per_ex = torch.sqrt(sum((res.scales[:, j, None] * grads[n].flatten(1)).pow(2).sum(1)
                            for j, n in enumerate(eng.param_names)))
    assert torch.all(per_ex <= c * (1 + 1e-5))


def test_clip_policy_errors():
    with pytest.raises(ValueError, match="unknown clipping style"):
        make_clip_policy("nope", 1.0)
    with pytest.raises(ValueError, match="positive"):
        FlatClip(-1)
    assert PerLayerClip(2.0).sensitivity == 2.0 and AutoClip(3.0).sensitivity == 3.0
    assert math.isinf(make_clip_policy("flat", 1.0).max_norm) is False
