"""Audit checks of the mechanisms beyond independent-Gaussian DP-SGD (issue 28): truncated
Poisson with fixed shapes (step/truncated.py) and banded matrix factorization (step/correlated.py).

White-box checks on the real classes:

* **truncation bound** — a truncated batch never exceeds B_max, is a subset of the step's
  Poisson draw, and is a *uniformly random* subset (the kept share of the draw's lower half is
  ≈ ½; taking the first rows, planted ``truncate_first_rows``, keeps only the lower half);
* **padding contributes nothing** — a fixed-shape micro-batch with padded rows gives exactly
  the clipped sum, count and loss of its real rows alone (planted ``padding_contributes``: the
  mask ignored);
* **events, min-separation** — the events a truncated or banded step records (equal to those σ is calibrated
  on) and the ≥ b steps between an example's participations under cyclic Poisson are checked on the session
  plan's loops (audit/ways_in_mechanisms.py: planted ``truncation_not_in_ledger``, ``no_min_separation`` there);
* **banded noise structure** — reproducible streams: C·Y = σC_clip·Z exactly (the released
  noises are C⁻¹Z) and the empirical covariance across steps matches σ²C_clip²·C⁻¹C⁻ᵀ
  (planted ``banded_buffers_reset``: the buffers cleared every step);
* **multi-step canary game** — a canary gradient of norm C_clip in one step; the adversary sees
  every step's noisy sum and combines b of them (C·x̂ over the canary's band): the optimal
  statistic's shift must not exceed 1/σ_event of the ledger's event, and without the canary it is
  N(0, 1). One step's release alone is not the whole story: the released noises are correlated,
  and the combined statistic is what the accounting bounds (planted ``banded_unnormalised``:
  coefficients ×2, i.e. sensitivity per participation 2C_clip).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check, tiny_classifier
from dpft.privacy.randomness import Randomness
from dpft.step.correlated import BandedMFMechanism, banded_coefficients, strategy_matrix
from dpft.grads.reference import ReferenceEngine
from dpft.models.losses import classification_loss
from dpft.step import correlated, truncated
from dpft.step.clip import FlatClip
from dpft.step.truncated import EXAMPLE_MASK, MaskedEngine, TruncatedPoissonSampler

__all__ = ["PLANTED", "mechanism_checks"]

#: Planted bugs :func:`mechanism_checks` must catch.
PLANTED = ("truncate_first_rows", "padding_contributes", "banded_buffers_reset", "banded_unnormalised")


def _no_mask(self, batch, orig=truncated.MaskedEngine.clipped_sum):  # padding_contributes
    if truncated.EXAMPLE_MASK in batch:
        batch = {**batch, truncated.EXAMPLE_MASK: torch.ones_like(batch[truncated.EXAMPLE_MASK])}
    return orig(self, batch)


def _reset(self, grad_sum, step, orig=correlated.BandedMFMechanism.add_noise):  # banded_buffers_reset
    self.buffers = []
    return orig(self, grad_sum, step)


def _unnormalised(self, *a, orig=correlated.BandedMFMechanism.__init__, **k):  # banded_unnormalised
    orig(self, *a, **k)
    self.coeffs = [2 * x for x in self.coeffs]


#: Patch the real classes for the duration of the checks (undone on exit).
_planted = bug_planter(PLANTED, {
    "truncate_first_rows": lambda p: p.set(truncated.TruncatedPoissonSampler, "truncate",
                                           lambda self, idx, step: idx[: self.max_batch_size]),
    "padding_contributes": lambda p: p.set(truncated.MaskedEngine, "clipped_sum", _no_mask),
    "banded_buffers_reset": lambda p: p.set(correlated.BandedMFMechanism, "add_noise", _reset),
    "banded_unnormalised": lambda p: p.set(correlated.BandedMFMechanism, "__init__", _unnormalised),
})


# ----------------------------------------------------------------------------- truncation
def _truncation_bound() -> Check:
    n, b_max, steps = 400, 20, 40
    s = TruncatedPoissonSampler(n, 100, Randomness(), b_max)
    over, not_subset, lower_share = 0, 0, []
    for t in range(steps):
        drawn = s.draw(t, s.q)
        kept = s.indices(t)
        over += int(len(kept) > b_max)
        not_subset += int(not bool(torch.isin(kept, drawn).all()))
        if len(drawn) > b_max:
            half = drawn[len(drawn) // 2]
            lower_share.append(float((kept < half).float().mean()))
    share = float(np.mean(lower_share)) if lower_share else 0.5
    ok = over == 0 and not_subset == 0 and abs(share - 0.5) < 0.15
    return Check("truncation: bound, subset, uniform", ok,
                 f"{steps} steps at q·N = 100, B_max = {b_max}: {over} over the bound, {not_subset} not a subset "
                 f"of the Poisson draw; kept share from the draw's lower half {share:.2f} (uniform: 0.5)",
                 {"over": over, "lower_half_share": share})


def _padding_zero() -> Check:
    model = tiny_classifier("bert")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (6, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (6,), generator=g)}
    eng = MaskedEngine(ReferenceEngine(model, classification_loss, FlatClip(0.1)))
    real = {k: v[:4] for k, v in batch.items()}
    ref = eng.clipped_sum(real)
    padded = eng.clipped_sum({**batch, EXAMPLE_MASK: torch.tensor([True] * 4 + [False] * 2)})
    diff = max(float((ref.grad_sum[k] - padded.grad_sum[k]).abs().max()) for k in ref.grad_sum)
    ok = diff < 1e-6 and padded.n == 4 and abs(padded.loss_sum - ref.loss_sum) < 1e-5
    return Check("truncation: padded rows contribute nothing", ok,
                 f"4 real + 2 padded rows vs the 4 real rows: max |Δ clipped sum| = {diff:.2e}, n = {padded.n}, "
                 f"Δ loss = {abs(padded.loss_sum - ref.loss_sum):.2e}", {"max_diff": diff})


# ----------------------------------------------------------------------------- banded MF
def _run_noise(coeffs, sigma, c_clip, steps, dim, rng, canary_step=None, canary=None):
    """Released noisy sums x̂_t (steps × dim) of zero gradients (plus a canary at one step)."""
    m = BandedMFMechanism(sigma, c_clip, rng, coeffs, 0.5)
    out = []
    for t in range(steps):
        g = canary.clone() if (canary is not None and t == canary_step) else torch.zeros(dim)
        noisy, _ = m.release({"w": g}, c_clip, 0.5, t)
        out.append(noisy["w"].double())
    return torch.stack(out), m


def _noise_structure() -> Check:
    steps, bands, dim, sigma, c_clip = 8, 3, 4000, 0.7, 2.0
    c = banded_coefficients(steps, bands)
    rng = Randomness(seed=11)
    y, m = _run_noise(c, sigma, c_clip, steps, dim, rng)
    z = torch.stack([rng.stream("noise", t, "w").normal((dim,)).double() for t in range(steps)]) * (sigma * c_clip)
    cm = strategy_matrix(m.coeffs, steps)
    exact = float((torch.from_numpy(cm) @ y - z).abs().max())
    emp = (y @ y.T / dim).numpy()
    ci = np.linalg.inv(strategy_matrix(c, steps))
    theory = (sigma * c_clip) ** 2 * ci @ ci.T
    err = float(np.abs(emp - theory).max() / np.abs(theory).max())
    ok = exact < 1e-4 * sigma * c_clip and err < 0.15
    return Check("banded: noise is C⁻¹Z (covariance across steps)", ok,
                 f"reproducible streams: max |C·Y − σC·Z| = {exact:.2e}; empirical covariance across {steps} steps vs "
                 f"σ²C²·C⁻¹C⁻ᵀ: max relative error {err:.3f} (tolerance 0.15)", {"exact": exact, "cov_err": err})


def _canary_game(rounds: int = 150) -> Check:
    steps, bands, dim, sigma, c_clip, s = 8, 3, 16, 1.0, 1.0, 3
    c = banded_coefficients(steps, bands)
    g = torch.zeros(dim)
    g[0] = c_clip
    stats = {False: [], True: []}
    single = {False: [], True: []}
    for r in range(rounds):
        for present in (False, True):
            y, m = _run_noise(c, sigma, c_clip, steps, dim, Randomness(), s if present else None, g if present else None)
            mcm = torch.from_numpy(strategy_matrix(m.coeffs, steps))  # the adversary knows the mechanism's C
            u = mcm @ y  # = C·x + σC·z: one block per participation
            mcol = mcm[:, s]
            stats[present].append(float(u[:, 0] @ mcol) / (sigma * c_clip * float(mcol.norm())))
            single[present].append(float(y[s, 0]))
    null = np.array(stats[False])
    shift = float(np.mean(stats[True]) - np.mean(stats[False]))
    bound = 1.0 / sigma  # the ledger's event: Gaussian(σ) per participation, sensitivity 1 after ‖c‖ = 1
    tol = 4.0 * math.sqrt(2.0 / rounds)
    ok = bool(shift <= bound + tol and abs(null.mean()) < 4 / math.sqrt(rounds) and 0.75 < null.std() < 1.3)
    sd1 = float(np.std(single[False])) or 1.0
    one = float(np.mean(single[True]) - np.mean(single[False])) / sd1
    return Check("banded: multi-step canary game", ok,
                 f"canary of norm C at step {s} of {steps}, b = {bands}, σ = {sigma}: the statistic combining the "
                 f"canary's band of releases shifts by {shift:.2f} (accounted bound 1/σ = {bound:.2f} + {tol:.2f}); "
                 f"null mean {null.mean():.2f}, sd {null.std():.2f}; step {s}'s release alone shifts by {one:.2f}",
                 {"shift": shift, "bound": bound, "single_step_shift": one})


def mechanism_checks(planted: str | None = None) -> list[Check]:
    """Run the checks (a few seconds on a CPU).

    Args:
        planted: None (the real code) or one of :data:`PLANTED` (at least one check must fail).

    Raises:
        ValueError: an unknown planted bug."""
    with _planted(planted):
        return [_truncation_bound(), _padding_zero(), _noise_structure(), _canary_game()]
