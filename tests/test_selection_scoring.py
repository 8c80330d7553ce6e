"""DP-SelFT unit scoring: units, worst-case ξ (norm ρ, raises the loss vs random ξ), only the
scored unit moves and θ⁽⁰⁾ is restored, the score cache, and `trainable.mode: units`."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch, tiny_classifier
from dpft.config.recipe import TrainableCfg
from dpft.models.load import ModelError, select_trainable
from dpft.models.units import attention_units, lora_targets_in_units, resolve_units, unit_map
from dpft.selection.scoring import (ScoreCache, ScoreSettings, mean_loss, noise_scale, rank_units,
                                    score_unit, score_units, worst_case_perturbation)


def _rows(n=24, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = int(torch.randint(4, 10, (1,), generator=g))
        ids = torch.randint(3, vocab, (t,), generator=g)
        lab = int(ids[0] % 2)  # learnable rule: first token's parity
        rows.append({"input_ids": ids.tolist(), "label": lab})
    return rows


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_block_units_partition_parameters(kind):
    m = tiny_classifier(kind)
    um = unit_map(m)
    assert list(um)[0] == "embeddings" and list(um)[-1] == "head"
    allp = [n for u in um.values() for n in u]
    assert sorted(allp) == sorted(n for n, _ in m.named_parameters())  # a partition
    lin = unit_map(m, "linear")
    assert len(lin) > 4 and all(len(v) <= 2 for k, v in lin.items() if k not in ("embeddings", "head"))
    assert len(attention_units(m)) == 2
    with pytest.raises(ModelError, match="unknown unit"):
        resolve_units(m, ["block.7"])


def test_worst_case_xi_has_norm_rho_and_raises_loss_more_than_random():
    m = tiny_classifier("bert")
    params = {n: p for n, p in m.named_parameters() if n in set(resolve_units(m, ["block.1"], with_head=True))}
    for n, p in m.named_parameters():
        p.requires_grad_(n in params)
    batch = random_batch(b=8, t=9)
    g = dict(zip(params, torch.autograd.grad(mean_loss(m, batch), list(params.values()))))
    lr, rho = 0.5, 0.5
    before = {n: p.detach().clone() for n, p in params.items()}
    xi = worst_case_perturbation(m, params, batch, g, lr, rho)
    assert all(torch.equal(before[n], p) for n, p in params.items())  # θ restored
    assert math.sqrt(sum(float(v.pow(2).sum()) for v in xi.values())) == pytest.approx(rho, rel=1e-5)

    def loss_after(pert):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(before[n] - lr * (g[n] + pert[n]))
            out = float(mean_loss(m, batch))
            for n, p in params.items():
                p.copy_(before[n])
        return out

    worst = loss_after(xi)
    gen = torch.Generator().manual_seed(0)
    rand = []
    for _ in range(20):
        r = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        s = math.sqrt(sum(float(v.pow(2).sum()) for v in r.values()))
        rand.append(loss_after({n: rho * v / s for n, v in r.items()}))
    assert worst > max(rand)  # worst case beats every random direction of the same norm
    assert worst > loss_after({n: torch.zeros_like(v) for n, v in xi.items()})  # and no perturbation
    # the opposite sign (the "+ρ∇/‖∇‖" reading) would lower the loss instead
    assert loss_after({n: -v for n, v in xi.items()}) < loss_after({n: torch.zeros_like(v) for n, v in xi.items()})


def test_score_unit_updates_only_the_unit_and_restores_theta0():
    m = tiny_classifier("bert")
    theta0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    rows, val = _rows(24), _rows(12, seed=1)
    unit_names = set(resolve_units(m, ["block.0"], with_head=True))
    seen = []

    def on_step(step, g, xi):
        assert set(g) == unit_names == set(xi)
        seen.append({n: p.detach().clone() for n, p in m.named_parameters()})

    s = ScoreSettings(steps=4, batch_size=8, lr=1e-2, sigma=1.0, downstream_batch=8, update="adamw")
    sc = score_unit(m, "block.0", rows, val, s, on_step=on_step)
    assert len(seen) == 4
    moved = {n for n in theta0 if not torch.equal(seen[-1][n], seen[0][n])}
    assert moved and moved <= unit_names  # only the scored unit (+ head) got updates
    assert all(torch.equal(theta0[n], p) for n, p in m.named_parameters())  # θ⁽⁰⁾ back
    assert all(p.requires_grad for p in m.parameters())  # flags restored
    assert 0 <= sc.accuracy <= 1 and sc.dim == sum(p.numel() for n, p in m.named_parameters() if n in unit_names)
    assert sc.rho == pytest.approx(noise_scale(1.0, 1.0, sc.dim, 8))


def test_cache_makes_rescoring_free_and_rank(tmp_path):
    m = tiny_classifier("bert")
    rows, val = _rows(16), _rows(8, seed=1)
    s = ScoreSettings(steps=2, batch_size=8, perturbation="random")
    cache = ScoreCache(tmp_path)
    a = score_units(m, rows, val, s, cache=cache, model_name="tiny", data_digest="d1")
    assert set(a) == {"embeddings", "block.0", "block.1", "head"}
    calls = []
    import dpft.selection.scoring as sc_mod

    orig = sc_mod.score_unit
    sc_mod.score_unit = lambda *x, **k: calls.append(1) or orig(*x, **k)
    try:
        b = score_units(m, rows, val, s, cache=cache, model_name="tiny", data_digest="d1")
        assert not calls and {u: v.accuracy for u, v in a.items()} == {u: v.accuracy for u, v in b.items()}
        score_units(m, rows, val, s, cache=cache, model_name="tiny", data_digest="d2", units=["head"])
        assert len(calls) == 1  # other data → new key → scored again
    finally:
        sc_mod.score_unit = orig
    top = rank_units(a, 2)
    assert len(top) == 2 and a[top[0]].accuracy >= a[top[1]].accuracy
    assert len(rank_units(a, 3, "gradient", exclude=["head"])) == 3


def test_trainable_mode_units_and_units_lora():
    m = select_trainable(tiny_classifier("bert"), TrainableCfg(mode="units", units=["block.1"]))
    train = {n for n, p in m.named_parameters() if p.requires_grad}
    assert train == set(resolve_units(m, ["block.1"], with_head=True))
    m2 = select_trainable(tiny_classifier("bert"), TrainableCfg(mode="units", units=["block.1"], units_with_head=False))
    assert all(".layer.1." in n for n, p in m2.named_parameters() if p.requires_grad)
    base = tiny_classifier("bert")
    targets = lora_targets_in_units(base, resolve_units(base, ["block.1"]), ["query", "value"])
    assert targets == ["bert.encoder.layer.1.attention.self.query", "bert.encoder.layer.1.attention.self.value"]
    m3 = select_trainable(base, TrainableCfg(mode="units", units=["block.1"], units_lora=True))
    lora = [n for n, p in m3.named_parameters() if p.requires_grad and "lora_" in n]
    assert lora and all(".layer.1." in n for n in lora)
    with pytest.raises(ValueError, match="needs trainable.units"):
        TrainableCfg(mode="units")


def test_score_unit_uses_the_downstream_head_body_clip_and_head_lr():
    """Scoring clips as the final run will: head_body gives the head and the body the budgets
    C√f and C√(1−f)."""
    from dpft.models.load import is_head_param

    m = tiny_classifier("bert")
    theta0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    rows, val = _rows(24), _rows(12, seed=1)
    grads = []
    s = ScoreSettings(steps=2, batch_size=8, lr=1e-3, sigma=1.0, downstream_batch=8, perturbation="none", update="adamw",
                      clip_norm=0.01, clip_style="head_body", head_fraction=0.25, head_lr=1e-1)
    score_unit(m, "block.0", rows, val, s, on_step=lambda step, g, xi: grads.append(g))
    for g in grads:  # mean of per-example clipped grads: each part within its budget
        head = math.sqrt(sum(float(t.pow(2).sum()) for n, t in g.items() if is_head_param(n)))
        body = math.sqrt(sum(float(t.pow(2).sum()) for n, t in g.items() if not is_head_param(n)))
        assert head <= 0.01 * math.sqrt(0.25) * (1 + 1e-4)
        assert body <= 0.01 * math.sqrt(0.75) * (1 + 1e-4)
        assert head > 0 and body > 0
    assert all(torch.equal(theta0[n], p) for n, p in m.named_parameters())


def test_score_unit_head_lr_moves_the_head_further():
    from dpft.models.load import is_head_param

    def head_move(head_lr):
        m = tiny_classifier("bert")
        h0 = {n: p.detach().clone() for n, p in m.named_parameters() if is_head_param(n)}
        moved = []

        def on_step(step, g, xi):  # called before step `step`'s update: sees step-1's result
            if step == 1:
                moved.append(sum(float((p - h0[n]).norm()) for n, p in m.named_parameters() if n in h0))

        s = ScoreSettings(steps=2, batch_size=8, lr=1e-4, sigma=1.0, downstream_batch=8, perturbation="none",
                          clip_style="head_body", head_lr=head_lr, update="adamw")
        score_unit(m, "block.0", _rows(24), _rows(12, seed=1), s, on_step=on_step)
        return moved[0]

    assert head_move(1e-1) > 100 * head_move(None)
