"""DP select-and-label (DP-SelFT Eq. 5–10): sensitivity, ledger events, labels, split."""

from __future__ import annotations

import dp_accounting as dpa
import pytest
import torch

from dpft.accounting.ledger import PrivacyLedger
from dpft.synth.select_label import (PHASE_LABEL, PHASE_SELECT, SelectLabelError, calibrate_select_label,
                                     class_vote_histogram, dp_select_and_label, embed_texts,
                                     nearest_candidate, vote_histogram)


def _clustered(n_per=20, m=6, d=8, seed=0):
    """Private points near candidates 0..2; class = candidate index % 2."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.nn.functional.normalize(torch.randn(m, d, generator=g), dim=-1)
    priv, labels = [], []
    for j in range(3):
        for _ in range(n_per * (j + 1)):
            priv.append(cand[j] + 0.01 * torch.randn(d, generator=g))
            labels.append(j % 2)
    return torch.stack(priv), torch.tensor(labels), cand


def test_histograms_have_sensitivity_one_under_add_remove():
    priv, labels, cand = _clustered()
    nn = nearest_candidate(priv, cand)
    m, k = len(cand), 2
    h, hc = vote_histogram(nn, m), class_vote_histogram(nn, labels, m, k)
    assert h.sum() == len(priv) and hc.sum() == len(priv)
    assert torch.equal(hc.sum(1), h)
    for drop in range(0, len(priv), 7):  # remove one example: exactly one bin / cell moves by 1
        keep = torch.arange(len(priv)) != drop
        nn2 = nearest_candidate(priv[keep], cand)
        d1 = h - vote_histogram(nn2, m)
        d2 = hc - class_vote_histogram(nn2, labels[keep], m, k)
        assert d1.norm().item() == pytest.approx(1.0) and d1.abs().sum() == 1
        assert d2.norm().item() == pytest.approx(1.0) and d2.abs().sum() == 1
        # the removed example's vote does not depend on the others
        assert torch.equal(nn2, nn[keep])


def test_two_ledger_events_compose_to_eps_syn():
    priv, labels, cand = _clustered()
    ledger = PrivacyLedger()
    syn = dp_select_and_label(["x"] * len(priv), labels.tolist(), [f"c{j}" for j in range(len(cand))], 2,
                              epsilon_syn=0.3, delta=1e-5, n_select=4, ledger=ledger,
                              private_emb=priv, cand_emb=cand)
    assert [e.phase for e in ledger.entries] == [PHASE_SELECT, PHASE_LABEL]
    evs = [e.event for e in ledger.entries]
    assert all(isinstance(e, dpa.GaussianDpEvent) for e in evs)
    assert evs[0].noise_multiplier == pytest.approx(syn.sigma_select)
    assert evs[1].noise_multiplier == pytest.approx(syn.sigma_label)
    eps = ledger.epsilon(1e-5).epsilon
    assert 0.295 <= eps <= 0.3  # calibrated tightly, never above the target
    # a single release at the same σ spends strictly less: both releases are counted
    single = PrivacyLedger()
    single.record("x", evs[0])
    assert single.epsilon(1e-5).epsilon < eps - 0.05


def test_label_ratio_and_bad_input():
    s1, s2 = calibrate_select_label(1.0, 1e-5, label_ratio=2.0)
    assert s2 == pytest.approx(2 * s1)
    with pytest.raises(SelectLabelError, match="n_select"):
        dp_select_and_label(["a"], [0], ["b"], 2, 1.0, 1e-5, n_select=5,
                            private_emb=torch.ones(1, 2), cand_emb=torch.ones(1, 2))
    with pytest.raises(SelectLabelError, match="ε_syn"):
        calibrate_select_label(0.0, 1e-5)


def test_large_budget_selects_voted_candidates_with_majority_labels_and_splits_7_3():
    priv, labels, cand = _clustered(n_per=40)
    texts = [f"c{j}" for j in range(len(cand))]
    syn = dp_select_and_label(["x"] * len(priv), labels.tolist(), texts, 2, epsilon_syn=8.0, delta=1e-5,
                              n_select=3, private_emb=priv, cand_emb=cand)
    assert sorted(syn.selected) == [0, 1, 2]  # the voted candidates, by noisy count
    got = dict(syn.train + syn.val)
    assert got == {"c0": 0, "c1": 1, "c2": 0}
    assert len(syn.val) == 1 and len(syn.train) == 2
    syn10 = dp_select_and_label(["x"] * len(priv), labels.tolist(), texts, 2, 8.0, 1e-5, n_select=6,
                                private_emb=priv, cand_emb=cand)
    assert (len(syn10.train), len(syn10.val)) == (4, 2)  # 7:3 of 6, rounded


def test_embed_texts_mean_pooled_unit_norm_order_independent(tiny_model_dir):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModel.from_pretrained(tiny_model_dir)
    texts = ["a good film", "a really long and rather dull film about nothing", "bad"]
    e = embed_texts(texts, model=model, tokenizer=tok, batch_size=2)
    assert e.shape == (3, 16)
    assert torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)
    alone = embed_texts([texts[1]], model=model, tokenizer=tok)
    assert torch.allclose(alone[0], e[1], atol=1e-5)  # padding does not change the pooled vector
