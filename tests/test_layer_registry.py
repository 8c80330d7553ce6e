"""The open layer registry (issue 15, item 3): a user's module gets a book-keeping rule with
``@register_layer(cls)`` from outside dpft; without one it falls back to torch.func with a
warning naming its class."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpft.grads._hooks import LayerKind, Outer, save_input
from dpft.grads.bookkeeping import KINDS, BookKeepingEngine, FallbackKind
from dpft.grads.linear import LinearKind
from dpft.grads.reference import ReferenceEngine
from dpft.grads.registry import register_layer, rule_for, rules_for, unregister_layer
from dpft.step.clip import make_clip_policy

V, D, B, T = 30, 8, 5, 6


class ScaledLinear(nn.Module):
    """``y = s * (x @ W.T)`` with a trainable ``W: (d_out, d_in)`` and a fixed scale ``s``."""

    def __init__(self, d_in, d_out, s=2.5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.s = s

    def forward(self, x):
        return self.s * (x @ self.weight.t())


class ScaledLinearKind(LayerKind):
    """Per-example gradient ``s G_iᵀ X_i`` kept factored (ghost norm, one matmul for the sum)."""

    name = "scaled_linear"

    def roles(self, module):
        return ("weight",)

    def save(self, module, args, kwargs, output, batch):
        return save_input(args, kwargs, batch, "ScaledLinear input")

    def contributions(self, module, x, grads, roles):
        g = grads[0]
        if g is None:
            return {}
        g = g.reshape(g.shape[0], -1, g.shape[-1])
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        return {"weight": Outer(module.s * g, x, module.weight.shape)}


class Net(nn.Module):
    def __init__(self, scaled_cls=ScaledLinear):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = scaled_cls(D, D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, input_ids):
        h = torch.tanh(self.mid(self.emb(input_ids)))
        return self.head(self.ln(h).mean(1))


def loss_fn(forward, batch):
    return F.cross_entropy(forward(input_ids=batch["input_ids"]), batch["labels"], reduction="none")


def batch():
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, V, (B, T), generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}


def compare(model, clip):
    bk = BookKeepingEngine(model, loss_fn, clip).clipped_sum(batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(model, loss_fn, clip).clipped_sum(batch())
    torch.testing.assert_close(bk.sq_norms, ref.sq_norms, rtol=2e-4, atol=1e-8)
    for n, g in ref.grad_sum.items():
        torch.testing.assert_close(bk.grad_sum[n], g, rtol=2e-4, atol=1e-6, msg=n)
    return bk


@pytest.fixture
def registered():
    kind = register_layer(ScaledLinear)(ScaledLinearKind)
    yield kind
    unregister_layer(ScaledLinear)


@pytest.mark.parametrize("style", ["flat", "per_layer"])
def test_registered_custom_module_matches_reference_without_fallback(registered, style):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        eng = BookKeepingEngine(model, loss_fn, make_clip_policy(style, 0.3))
    kinds = {u.label: type(u.kind) for u in eng.units}
    assert kinds["mid"] is ScaledLinearKind
    assert not any(isinstance(u.kind, FallbackKind) for u in eng.units)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compare(model, make_clip_policy(style, 0.3))
    assert any(isinstance(k, ScaledLinearKind) for k in KINDS)  # KINDS is a view of the registry


def test_unregistered_custom_module_falls_back_with_warning_naming_class():
    class ScaledLinearNoRule(ScaledLinear):  # a class no rule knows (and never warned about)
        pass

    torch.manual_seed(0)
    model = Net(ScaledLinearNoRule)
    with pytest.warns(UserWarning, match="ScaledLinearNoRule"):
        eng = BookKeepingEngine(model, loss_fn, make_clip_policy("flat", 0.3))
    assert isinstance({u.label: u.kind for u in eng.units}["mid"], FallbackKind)
    compare(model, make_clip_policy("flat", 0.3))  # the fallback is exact, only slower


def test_lookup_order_most_specific_then_user_over_builtin():
    class MyLinear(nn.Linear):  # keeps nn.Linear.forward: the built-in rule matches it
        pass

    lin = MyLinear(3, 2)
    assert isinstance(rules_for(lin)[0], LinearKind)

    class Override(LinearKind):
        pass

    register_layer(nn.Linear)(Override)  # a user rule for the same class wins over the built-in
    try:
        assert type(rule_for(nn.Linear(3, 2), ["weight", "bias"])) is Override
        assert type(rule_for(lin, ["weight"])) is Override
        inst = register_layer(MyLinear)(LinearKind())  # an instance; more specific class wins
        assert rule_for(lin, ["weight"]) is inst
        assert type(rule_for(nn.Linear(3, 2), ["weight"])) is Override
        assert unregister_layer(MyLinear) == 1
    finally:
        unregister_layer(nn.Linear)
    assert type(rule_for(nn.Linear(3, 2), ["weight"])) is LinearKind  # built-in back
    assert rule_for(nn.Conv2d(1, 1, 1), ["weight"]) is None


def test_register_layer_refuses_non_modules_and_non_rules():
    with pytest.raises(TypeError, match="nn.Module"):
        register_layer(int)
    with pytest.raises(TypeError, match="LayerKind"):
        register_layer(ScaledLinear)(object)
    with pytest.raises(TypeError, match="at least one"):
        register_layer()
