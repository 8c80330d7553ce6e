"""Black-box canary audits: empirical lower bounds ε̂ at confidence 1 − α (95 % by default).

The adversary sees the released noisy update of each step (the strongest adversary DP-SGD's
analysis allows) and scores each gradient canary by the projection of the update on the
canary's known clipped direction (``harness.SlotModel``):

* :func:`one_step_game` — the distinguishing game of Nasr et al. 2021 ("Adversary
  instantiation", Sec. 3, Alg. 1 with a gradient canary): one full-batch step with / without the
  canary; threshold chosen on one half of the trials, ε̂ certified on the other half
  (``stats.eps_from_error_rates``).
* :func:`multi_step_game` — the same game over T steps at the Poisson rate q, the adversary
  summing the evidence of all steps: a missing subsampling (the canary in every step while the
  ledger says q) moves the score mean from qT to T and is caught, which a one-step game at
  q = ½ cannot do.
* :func:`one_run_audit` — Steinke, Nasr & Jagielski 2023 (Alg. 1, Thm. 3.1): m canaries, each
  included with probability ½, one run of T steps; guess the top k "in", the bottom k "out";
  ε̂ from the number of correct guesses (Bonferroni over the k grid).

Each result carries the cap: the ε̂ a perfect adversary could certify with that many trials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from dpft.accounting.ledger import epsilon_of
from dpft.audit.harness import SlotModel, build_step, canary_inputs, make_clip, released_sum, slot_loss
from dpft.audit.stats import eps_cap_game, eps_from_error_rates, one_run_epsilon
from dpft.privacy.randomness import Randomness
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler


@dataclass
class CanarySetup:
    """What the audited step looks like (σ, C, q from the recipe's calibration)."""

    sigma: float
    c: float = 1.0
    delta: float = 1e-5
    style: str = "flat"
    head_fraction: float = 0.5
    engine: str = "bookkeeping"
    slots: int = 2048
    groups: int = 4
    dim: int = 2
    fillers: int = 8
    physical: int = 4096
    hardened: bool = True
    alpha: float = 0.05
    #: the run's randomness (secret by default).
    rng_factory: Callable[[], Randomness] = Randomness
    #: a seed the auditor is given (reproducible mode): it regenerates the noise and subtracts it.
    known_seed: Optional[int] = None
    seed: int = 0


@dataclass
class AuditResult:
    name: str
    certified_eps: float
    eps_hat: float
    cap: float
    trials: int
    confidence: float
    sigma: float
    q: float
    steps: int
    details: dict = field(default_factory=dict)
    null_scores: Optional[np.ndarray] = None
    canary_scores: Optional[np.ndarray] = None

    @property
    def passed(self) -> bool:
        return self.eps_hat <= self.certified_eps

    def row(self) -> dict:
        return {"test": self.name, "sigma": self.sigma, "q": self.q, "steps": self.steps,
                "certified_eps": self.certified_eps, "eps_hat": self.eps_hat, "cap": self.cap,
                "trials": self.trials, "confidence": self.confidence,
                "verdict": "pass" if self.passed else "FAIL", **self.details}


def canary_scores(s: CanarySetup, q: float, steps: int, rounds: int, progress=None):
    """Run ``rounds`` independent runs of ``steps`` DP steps over fresh canary sets.

    Returns ``(scores (rounds·K,), labels (rounds·K,) bool, certified ε of one run, q used)``.
    Score of canary k: ``−Σ_t ⟨noisy_t[k], u_k⟩ / C`` (mean = number of steps it was sampled
    in, noise std σ√T); the auditor subtracts the regenerated noise when it knows the seed."""
    gen = torch.Generator().manual_seed(s.seed)
    rng = s.rng_factory()
    k_, scores, labels, cert, q_used = s.slots, [], [], None, q
    for r in range(rounds):
        member = torch.rand(k_, generator=gen) < 0.5
        x = canary_inputs(k_, s.groups, s.dim, s.c, s.style, s.head_fraction, gen)
        u = (x / x.flatten(1).norm(dim=1)[:, None, None]).double()
        fill = torch.randn(s.fillers, s.groups, s.dim, generator=gen) * (0.5 * s.c / math.sqrt(s.groups * s.dim))
        data_x = torch.cat([x[member], fill])
        data_slot = torch.cat([torch.nonzero(member).flatten(), torch.full((s.fillers,), k_)])
        n = len(data_slot)
        expected = n if q >= 1 else max(1, round(q * n))
        clip = make_clip(s.style, s.c, s.head_fraction)
        model = SlotModel(k_, s.groups, s.dim)
        head = [i == 0 for i in range(s.groups)]
        step = build_step(model, slot_loss, clip, s.engine, s.sigma, n, expected, rng, s.hardened, head_mask=head)
        q_used = step.q_at(0)
        total = torch.zeros(k_, dtype=torch.float64)
        for t in range(steps):
            tt = r * steps + t
            idx = step.indices(tt)
            mbs = [{"x": data_x[m], "slot": data_slot[m]} for m in PoissonSampler.micro_batches(idx, s.physical)]
            noisy = released_sum(step, tt, mbs)
            if s.known_seed is not None:
                mech = GaussianMechanism(s.sigma, s.c, Randomness(s.known_seed), hardened=s.hardened)
                guess = mech.add_noise({kk: torch.zeros_like(v, dtype=torch.float32) for kk, v in noisy.items()}, tt)
                noisy = {kk: v - guess[kk].double() * 1.0 for kk, v in noisy.items()}
            w = torch.stack([noisy[f"groups.{g}.weight"][:k_] for g in range(s.groups)], dim=1)  # (K, G, d)
            total += -(w * u).flatten(1).sum(1) / s.c
        if cert is None:
            cert = epsilon_of(step.ledger.events()[:steps], s.delta).epsilon
        scores.append(total.numpy())
        labels.append(member.numpy())
        if progress is not None:
            progress.update(1)
    return np.concatenate(scores), np.concatenate(labels), float(cert), float(q_used)


def game_epsilon(scores: np.ndarray, labels: np.ndarray, delta: float, alpha: float = 0.05,
                 seed: int = 0, grid: int = 200) -> dict:
    """Hypothesis-testing ε̂ with the threshold chosen on half A and certified on half B."""
    rs = np.random.default_rng(seed)
    perm = rs.permutation(len(scores))
    a, b = perm[: len(perm) // 2], perm[len(perm) // 2:]
    sa, la, sb, lb = scores[a], labels[a], scores[b], labels[b]
    best = (0.0, float("inf"), 1)
    taus = np.quantile(sa, np.linspace(0.0, 1.0, grid + 1))
    for sign in (1, -1):
        s0, s1 = np.sort(sign * sa[~la]), np.sort(sign * sa[la])
        for tau in sign * taus:
            fp = len(s0) - np.searchsorted(s0, tau, side="right")
            fn = np.searchsorted(s1, tau, side="right")
            e = eps_from_error_rates(int(fp), len(s0), int(fn), len(s1), delta, alpha)
            if e > best[0]:
                best = (e, float(tau), sign)
    _, tau, sign = best
    s0, s1 = sign * sb[~lb], sign * sb[lb]
    fp, fn = int((s0 > tau).sum()), int((s1 <= tau).sum())
    eps = eps_from_error_rates(fp, len(s0), fn, len(s1), delta, alpha) if math.isfinite(tau) else 0.0
    return {"eps_hat": eps, "cap": eps_cap_game(len(s0), len(s1), delta, alpha), "fp": fp, "fn": fn,
            "n_null": len(s0), "n_canary": len(s1), "threshold": tau * sign}


def _game(name: str, s: CanarySetup, q: float, steps: int, rounds: int, progress=None) -> AuditResult:
    sc, lab, cert, q_used = canary_scores(s, q, steps, rounds, progress)
    g = game_epsilon(sc, lab, s.delta, s.alpha, s.seed)
    return AuditResult(name, cert, g["eps_hat"], g["cap"], len(sc), 1 - s.alpha, s.sigma, q_used, steps,
                       {k: v for k, v in g.items() if k not in ("eps_hat", "cap")}, sc[~lab], sc[lab])


def one_step_game(s: CanarySetup, rounds: int = 12, progress=None) -> AuditResult:
    """Nasr et al. 2021 one-step game: ``rounds × K`` trials of one full-batch (q = 1) step."""
    return _game("one-step game", s, 1.0, 1, rounds, progress)


def multi_step_game(s: CanarySetup, q: float, steps: int, rounds: int = 4, progress=None) -> AuditResult:
    """The game over ``steps`` Poisson-sampled steps at rate ``q`` (evidence summed over steps)."""
    return _game("multi-step game", s, q, steps, rounds, progress)


def one_run_audit(s: CanarySetup, steps: int = 1, q: float = 1.0, ks: tuple = (16, 32, 64, 128, 256, 512),
                  progress=None) -> AuditResult:
    """Steinke, Nasr & Jagielski 2023: one run with m = K canaries (each in with prob. ½)."""
    sc, lab, cert, q_used = canary_scores(s, q, steps, 1, progress)
    m = len(sc)
    order = np.argsort(sc)
    ks = tuple(k for k in ks if 2 * k <= m) or (m // 2,)
    a = s.alpha / len(ks)
    best, cap, best_k = (0.0, 0, 0), 0.0, ks[0]
    for k in ks:
        v = int(lab[order[-k:]].sum() + (~lab[order[:k]]).sum())
        e = one_run_epsilon(m, 2 * k, v, s.delta, a)
        cap = max(cap, one_run_epsilon(m, 2 * k, 2 * k, s.delta, a))
        if e > best[0] or best_k == ks[0] and best[1] == 0:
            best, best_k = (e, 2 * k, v), k
    return AuditResult("one-run audit", cert, best[0], cap, m, 1 - s.alpha, s.sigma, q_used, steps,
                       {"guesses": best[1], "correct": best[2], "k": best_k}, sc[~lab], sc[lab])
