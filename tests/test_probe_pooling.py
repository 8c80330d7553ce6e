"""``benchmarks/probe_pooling.py``: its batched DP-Adam probe computes what a plain per-run loop over the
sampled rows computes (clipping, noise, the qN divisor, Adam), and the pooling candidates are built as
described (per-row, per-block L2 normalisation). Tiny random arrays; milliseconds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def pp(monkeypatch):
    spec = importlib.util.spec_from_file_location("_probe_pooling_under_test", ROOT / "benchmarks" / "probe_pooling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_probe_pooling_under_test"] = mod
    try:
        spec.loader.exec_module(mod)
        monkeypatch.setattr(mod, "STEPS", 6)
        yield mod
    finally:
        sys.modules.pop("_probe_pooling_under_test", None)


def _reference(pp, x, y, k, sigma, lr, seed):
    """One run, the obvious way: gather the Poisson batch, clip each example's gradient, add noise."""
    n, d = x.shape
    xt = torch.cat([x, torch.ones(n, 1)], 1)
    masks = torch.rand(pp.STEPS, n, generator=torch.Generator().manual_seed(10_000 + seed)) < pp.Q
    w = (torch.rand(k, d + 1, generator=torch.Generator().manual_seed(seed)) * 2 - 1) / d ** 0.5
    gen = torch.Generator().manual_seed(20_000 + seed)
    m1, m2 = torch.zeros_like(w), torch.zeros_like(w)
    for t in range(pp.STEPS):
        g = torch.zeros_like(w)
        for i in masks[t].nonzero().squeeze(1).tolist():
            r = torch.softmax(xt[i] @ w.T, -1) - torch.nn.functional.one_hot(y[i], k).float()
            gi = torch.outer(r, xt[i])
            if sigma is not None:
                gi = gi * min(1.0, pp.CLIP / (float(gi.norm()) + 1e-6))
            g += gi
        if sigma is not None:
            g = g + sigma * pp.CLIP * torch.randn(k, d + 1, generator=gen)
        g = g / (pp.Q * n)
        m1 = 0.9 * m1 + 0.1 * g
        m2 = 0.999 * m2 + 0.001 * g * g
        w = w - lr * (1 - t / pp.STEPS) * (m1 / (1 - 0.9 ** (t + 1))) / ((m2 / (1 - 0.999 ** (t + 1))).sqrt() + 1e-8)
    return w


@pytest.mark.parametrize("sigma", [0.7, None])
def test_batched_runs_equal_the_plain_loop(pp, sigma):
    torch.manual_seed(0)
    x, y = torch.randn(40, 5) * 3, torch.randint(0, 3, (40,))
    lrs, seeds = (0.01, 0.1), (0, 3)
    w = pp.dp_adam(x, y, 3, sigma, lrs, seeds)
    assert w.shape == (4, 3, 6)
    for j in range(4):
        ref = _reference(pp, x, y, 3, sigma, lrs[j // 2], seeds[j % 2])
        torch.testing.assert_close(w[j], ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(w[0], w[1])  # different seeds: different masks and noise
    assert len(pp.accuracy(w, x, y)) == 4


def test_candidates_and_per_block_l2(pp, tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "CACHE", tmp_path)
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(7, 7, 4)).astype(np.float32)  # (N, L+1, d)
    mx = rng.normal(size=(7, 4)).astype(np.float32)
    np.save(tmp_path / "t_train_mean.npy", mean)
    np.save(tmp_path / "t_train_max.npy", mx)
    np.save(tmp_path / "t_train_y.npy", np.zeros(7, np.int64))
    x, _ = pp.features("t", "train", "c", "raw")
    np.testing.assert_allclose(x.numpy(), mean[:, -4:].mean(1), rtol=1e-6)
    x, _ = pp.features("t", "train", "e", "raw")
    np.testing.assert_allclose(x.numpy(), np.concatenate([mean[:, -1], mean[:, 0]], 1))
    x, _ = pp.features("t", "train", "b4", "l2")
    assert x.shape == (7, 16)
    np.testing.assert_allclose(x.reshape(7, 4, 4).norm(dim=-1).numpy(), 1.0, rtol=1e-5)
