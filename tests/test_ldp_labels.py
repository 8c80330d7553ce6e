"""Label privacy by K-ary randomized response (privacy/label_rr.py) and its wiring into the
forward-LDP Trainer run and report (methods/ewft/method.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpft.models.losses import make_corrected_classification_loss
from dpft.privacy.label_rr import (example_epsilon_with_label, forward_corrected_loss, label_epsilon,
                                   randomized_response, rr_keep_probability, rr_noise_parameter, rr_transition_matrix)
from dpft.privacy.ldp import LDPError, local_epsilon_composed
from dpft.privacy.randomness import Randomness

torch.set_num_threads(1)


def test_rr_frequencies_match_transition_matrix():
    eps, k, n = 1.0, 3, 30000
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, k, (n,), generator=g)
    noisy = randomized_response(y, eps, k, Randomness(1).stream("label_rr"))
    assert noisy.dtype == torch.long and int(noisy.min()) >= 0 and int(noisy.max()) < k
    t = rr_transition_matrix(eps, k)
    assert torch.allclose(t.sum(1), torch.ones(k, dtype=torch.float64))
    assert t[0, 0].item() == pytest.approx(math.e / (math.e + 2))
    for i in range(k):
        rows = noisy[y == i]
        freq = torch.bincount(rows, minlength=k).double() / len(rows)
        assert torch.allclose(freq, t[i], atol=0.02), (i, freq, t[i])
    # same seed, same draw (the draw is made once and recorded)
    assert torch.equal(noisy, randomized_response(y, eps, k, Randomness(1).stream("label_rr")))
    # dp_accounting's noise parameter gives the same keep probability: 1 − p + p/K
    p = rr_noise_parameter(eps, k)
    assert 1 - p + p / k == pytest.approx(rr_keep_probability(eps, k))


def test_rr_is_pure_eps2_dp_and_dp_accounting_agrees():
    for eps, k in [(0.3, 2), (1.0, 2), (2.0, 5), (6.0, 3)]:
        t = rr_transition_matrix(eps, k)
        # definition: max over outputs and pairs of inputs of P(ỹ|y)/P(ỹ|y′) = e^ε₂
        ratio = (t.unsqueeze(1) / t.unsqueeze(0)).max().item()
        assert math.log(ratio) == pytest.approx(eps, rel=1e-9)
        e = label_epsilon(eps, k)  # through RandomizedResponseDpEvent, PLD replace-one, δ = 0
        assert eps - 1e-9 <= e <= eps + 1e-3
    with pytest.raises(LDPError, match="label_epsilon"):
        randomized_response(torch.tensor([0, 1]), 0.0, 2)
    with pytest.raises(LDPError, match="≥ 2 labels"):
        rr_transition_matrix(1.0, 1)
    with pytest.raises(LDPError, match=r"\[0, 2\)"):
        randomized_response(torch.tensor([0, 2]), 1.0, 2)


def test_label_composes_with_releases_in_replace_one_pld():
    sig = [1.0, 1.0, 1.5]
    without = example_epsilon_with_label(sig, 1e-5, None, 2)
    assert without == pytest.approx(local_epsilon_composed(sig, 1e-5), abs=1e-9)
    with_label = example_epsilon_with_label(sig, 1e-5, 1.0, 2)
    # adding a pure 1-DP release costs more than nothing and at most ε₂ (basic composition)
    assert without < with_label <= without + 1.0 + 1e-3


def test_corrected_loss_is_cross_entropy_when_eps2_is_large():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 4, generator=g, requires_grad=True)
    y = torch.randint(0, 4, (16,), generator=g)
    t = rr_transition_matrix(60.0, 4)  # keep probability 1 − 3e−60
    a = forward_corrected_loss(logits, y, t)
    b = F.cross_entropy(logits, y, reduction="none")
    assert a.shape == (16,) and torch.allclose(a, b, atol=1e-6)
    ga, = torch.autograd.grad(a.sum(), logits)
    gb, = torch.autograd.grad(b.sum(), logits)
    assert torch.allclose(ga, gb, atol=1e-6)
    # the loss_fn wrapper has classification_loss's signature
    fn = make_corrected_classification_loss(t)
    out = fn(lambda **kw: logits, {"input_ids": torch.zeros(16, 3, dtype=torch.long), "labels": y})
    assert torch.allclose(out, b, atol=1e-6)


def _fit(x, y, loss, steps=60):
    w = torch.zeros(x.shape[1], 3, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        v = loss(x @ w + b, y).mean()
        v.backward()
        return v

    opt.step(closure)
    return w.detach(), b.detach()


def test_corrected_loss_recovers_clean_classifier_on_toy_problem():
    """Well-specified 3-class softmax model, labels through RR at ε₂ = 0.7 (keep ≈ 0.50):
    the corrected loss recovers the true weights and clean posteriors; plain cross-entropy on
    the noisy labels learns flattened ones (much smaller weights, worse clean NLL)."""
    g = torch.Generator().manual_seed(3)
    n, eps, k = 20000, 0.7, 3
    w_true = torch.tensor([[2.0, -1.0, -1.0], [0.0, 1.5, -1.5]], dtype=torch.float64)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(x @ w_true, -1), 1, generator=g).squeeze(1)
    noisy = randomized_response(y, eps, k, Randomness(4).stream("label_rr"))
    t = rr_transition_matrix(eps, k)
    ce = lambda lg, yy: F.cross_entropy(lg, yy, reduction="none")  # noqa: E731
    w_c, b_c = _fit(x, noisy, lambda lg, yy: forward_corrected_loss(lg, yy, t))
    w_u, b_u = _fit(x, noisy, ce)
    w_0, b_0 = _fit(x, y, ce)
    err_c, err_u = (w_c - w_true).norm().item(), (w_u - w_true).norm().item()
    assert err_c < 0.5 * err_u, (err_c, err_u)
    xt = torch.randn(5000, 2, generator=g, dtype=torch.float64)
    yt = torch.multinomial(torch.softmax(xt @ w_true, -1), 1, generator=g).squeeze(1)
    nll = lambda w, b: ce(xt @ w + b, yt).mean().item()  # noqa: E731
    assert nll(w_c, b_c) < nll(w_u, b_u) - 0.05
    assert nll(w_c, b_c) < nll(w_0, b_0) + 0.05  # close to training on the clean labels


# ------------------------------------------------------------------ Trainer wiring and report
def _recipe(model_dir, files, **extra):
    """The shared tiny LDP recipe at a fixed σ = 1 (no calibration: fast)."""
    from conftest import ldp_recipe

    return ldp_recipe(model_dir, files, **{"ldp.target_epsilon": None, "ldp.noise_multiplier": 1.0, **extra})


def test_trainer_uses_rr_labels_drawn_once_and_reports_three_guarantees(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    from dpft.privacy.randomness import Randomness

    rec = _recipe(tiny_model_dir, sst_like_files, **{"ldp.label_epsilon": 0.2, "privacy.reproducible": True})
    t = Trainer(rec, tmp_path / "r", progress=False)
    true = torch.tensor([int(v) for v in t.task.train["label"]])
    noisy = t.method("ewft").ldp.noisy_labels
    # the training split carries the noisy labels, drawn from the run's randomness (stream label_rr)
    assert torch.equal(torch.tensor(t.train_tok["label"]), noisy)
    assert torch.equal(noisy, randomized_response(true, 0.2, 2, Randomness(rec.seed).stream("label_rr")))
    assert (noisy != true).any()  # ε₂ = 0.2: keep probability 0.55
    assert t.loss_fn.__name__ == "corrected_classification_loss" and t.engine.loss_fn is t.loss_fn
    rep = t.run()
    assert torch.equal(torch.tensor(t.train_tok["label"]), noisy)  # not redrawn by training
    p = rep["privacy"]
    lab = p["label"]
    assert lab["privacy"] == "randomized response" and lab["delta"] == 0.0
    assert lab["epsilon"] == pytest.approx(0.2, abs=1e-3)
    assert lab["combined_upper_bound"]["epsilon"] == pytest.approx(p["epsilon"] + lab["epsilon"])
    assert lab["combined_upper_bound"]["delta"] == p["delta"] and "upper bound" in lab["combined_upper_bound"]["method"]
    # linked rows (no amplification) = the local composed number; its label adds ≤ ε₂
    lk = p["linked_rows"]
    assert lk["epsilon"] == pytest.approx(p["local"]["epsilon_per_example_all_releases"], abs=1e-12)
    assert lk["epsilon"] < lk["epsilon_with_label"] <= lk["epsilon"] + 0.2 + 1e-3
    assert not any(e.phase != "ldp-forward" for e in t.ledger.entries)  # RR is not in the add/remove ledger
    assert rep["ldp"]["label_loss_correction"] is True and "label_rr_seed" not in rep["ldp"]
    assert "REPRODUCIBLE MODE" in (tmp_path / "r" / "report.md").read_text()
    md = (tmp_path / "r" / "report.md").read_text()
    assert "label ε₂ (randomized response, K = 2)" in md and "upper bound (basic composition)" in md
    assert "server links rows to users" in md and "post-processing" in md


def test_trainer_without_label_privacy_says_labels_in_clear(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, **{"schedule.epochs": 1, "ldp.label_loss_correction": False,
                                                      "ldp.label_epsilon": None})
    t = Trainer(rec, tmp_path / "c", progress=False)
    assert t.method("ewft").ldp.noisy_labels is None and t.loss_fn.__name__ == "classification_loss"
    rep = t.run()
    assert rep["privacy"]["label"]["privacy"] == "none"
    assert rep["privacy"]["linked_rows"]["epsilon_with_label"] is None
    md = (tmp_path / "c" / "report.md").read_text()
    assert "labels | in the clear" in md
    # the headline says the ε covers the inputs only
    headline = next(line for line in md.splitlines() if line.startswith("**Privacy:**"))
    assert "ε covers the inputs only; labels are not protected" in headline


def test_uncorrected_option_keeps_cross_entropy(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, **{"ldp.label_epsilon": 1.0, "ldp.label_loss_correction": False})
    t = Trainer(rec, tmp_path / "u", progress=False)
    assert t.method("ewft").ldp.noisy_labels is not None and t.loss_fn.__name__ == "classification_loss"
