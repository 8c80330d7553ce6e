"""Issue 18, DP-SelFT scorer per Eq. 21: ξ on the unit Λ only (not on the shared head), one SGD
step θ′_Λ = θ_Λ − η(g_Λ + ξ*), the head warmed up on the synthetic train split without ξ."""

import pytest
import torch

from conftest import tiny_classifier
from dpft.models.load import is_head_param
from dpft.models.units import resolve_units
from dpft.selection.scoring import ScoreSettings, noise_scale, score_unit, score_units, warm_up_head


def _rows(n=24, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        out.append({"input_ids": ids.tolist(), "label": int(ids[0] % 2)})
    return out


def test_eq21_is_one_sgd_step_with_xi_on_the_unit_only():
    m = tiny_classifier("bert")
    theta0 = {n: p.detach().clone() for n, p in m.named_parameters()}
    rows, val = _rows(24), _rows(12, seed=1)
    s = ScoreSettings(batch_size=8, lr=0.5, sigma=2.0, downstream_batch=8, head_warmup_steps=5)
    head = warm_up_head(m, rows, s)
    assert head and all(is_head_param(n) for n in head)
    assert any(not torch.equal(head[n], theta0[n]) for n in head)  # the head was trained…
    assert all(torch.equal(theta0[n], p) for n, p in m.named_parameters())  # …on a copy
    own = set(resolve_units(m, ["block.0"], with_head=False))
    seen = {}

    def on_step(step, g, xi):
        seen.update(step=step, g={n: t.clone() for n, t in g.items()}, xi={n: t.clone() for n, t in xi.items()},
                    before={n: p.detach().clone() for n, p in m.named_parameters()})

    orig_eval = __import__("dpft.selection.scoring", fromlist=["evaluate"]).evaluate
    after = {}

    import dpft.selection.scoring as sc_mod

    def spy(model, *a, **k):  # parameters at evaluation time = θ′
        after.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return orig_eval(model, *a, **k)

    sc_mod.evaluate = spy
    try:
        sc = score_unit(m, "block.0", rows, val, s, on_step=on_step, head_state=head)
    finally:
        sc_mod.evaluate = orig_eval
    assert seen["step"] == 0 and set(seen["g"]) == set(seen["xi"]) == own  # ξ on Λ only, no head
    xi_norm = torch.sqrt(sum(t.pow(2).sum() for t in seen["xi"].values()))
    assert float(xi_norm) == pytest.approx(sc.rho, rel=1e-5)
    assert sc.rho == pytest.approx(noise_scale(2.0, 1.0, sc.dim, 8))
    assert sc.dim == sum(p.numel() for n, p in m.named_parameters() if n in own)
    for n in after:  # θ′ = θ − η(g + ξ) on Λ; the warmed head and the rest unchanged
        if n in own:
            torch.testing.assert_close(after[n], seen["before"][n] - 0.5 * (seen["g"][n] + seen["xi"][n]))
        elif n in head:
            torch.testing.assert_close(after[n], head[n])
        else:
            assert torch.equal(after[n], theta0[n])
    assert all(torch.equal(theta0[n], p) for n, p in m.named_parameters())  # θ⁽⁰⁾ back
    assert all(p.requires_grad for p in m.parameters())


def test_eq21_worst_case_scores_no_higher_than_clean_and_score_units_shares_the_head():
    m = tiny_classifier("bert")
    rows, val = _rows(32), _rows(16, seed=1)
    base = dict(batch_size=16, lr=1.0, sigma=50.0, downstream_batch=4, head_warmup_steps=3)
    worst = score_unit(m, "block.1", rows, val, ScoreSettings(perturbation="worst", **base))
    clean = score_unit(m, "block.1", rows, val, ScoreSettings(perturbation="none", **base))
    assert worst.val_loss > clean.val_loss  # ξ* (large ρ) raises the synthetic val loss
    calls = []
    import dpft.selection.scoring as sc_mod

    orig = sc_mod.warm_up_head
    sc_mod.warm_up_head = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        out = score_units(m, rows, val, ScoreSettings(**base), units=["block.0", "block.1"])
    finally:
        sc_mod.warm_up_head = orig
    assert len(calls) == 1 and set(out) == {"block.0", "block.1"}
    with pytest.raises(ValueError, match="eq21"):
        ScoreSettings(update="sgd")
