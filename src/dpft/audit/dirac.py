"""White-box one-run audit on the same run (issue 37 item 2): Dirac gradient canaries on every
release, the upper reference for what the black-box final-model audit could see.

Steinke, Nasr & Jagielski 2023 (Sec. 6, white-box): m canaries, each a gradient of norm exactly
C on one coordinate of its own (a Dirac vector C·e_j; the coordinates are distinct and drawn at
random among the trainable parameters, where the data's clipped sum is ≈ C·√(B/d) ≪ σC), each
included with a secret fair coin. An included canary joins each logical step by its own
Poisson draw at the step's rate q, exactly as a training example of sensitivity C would; the
auditor sees every noised sum the step releases and scores canary i by

    score_i = Σ_t log(1 − q_t + q_t · exp((x_{t,i} − ½) / σ²)),   x_{t,i} = release_t[j_i] / C,

the log-likelihood ratio of "in" (each release carries C with probability q_t) against "out"
(noise alone), the Neyman–Pearson test of one canary's participation given all releases at the
claimed σ; :attr:`DiracCanaries.sums` keeps the plain Σ_t x_{t,i} too. ε̂ comes from
:mod:`dpft.audit.estimators` as for the black-box audit.

The canaries are added to the clipped sum just before the mechanism releases it, through the DP
step's release hook (step/pipeline.py :func:`~dpft.step.pipeline.observe_releases`), so every way
in is walked the same: ``dpft train``, a ``make_private`` loop, ``DPTrainer`` and the TRL
trainers. Each canary is one more unit of sensitivity C, so the run's (ε, δ) per unit holds for
them too. They are not counted in N (q stays the run's). What it cannot see: a bug before the
release that only changes how *data* gradients are clipped (``clipping off``: a canary already has
norm C) — the black-box audit's canaries go through the whole step and can. Only the independent
Gaussian mechanism (truncated Poisson included) is walked: under banded MF the releases' noise is
correlated and this score is not its likelihood ratio (:attr:`DiracCanaries.unsupported` names it;
no bound is reported).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch

from dpft.privacy.randomness import Randomness
from dpft.step.noise import GaussianMechanism
from dpft.step.pipeline import observe_releases

__all__ = ["DiracCanaries", "dirac_canaries"]


class DiracCanaries:
    """The state of one run's Dirac canaries.

    Args:
        m: canaries; rng: the run's randomness (coins: stream ``audit_dirac_coin``; per-step
            participation: ``audit_dirac_sample``).

    Attributes:
        included: ``(m,)`` bool secret coins. scores: ``(m,)`` float64 log-likelihood ratios
        (module docstring); sums: ``(m,)`` float64 Σ_t release_t[j_i] / C. releases: releases seen.
        unsupported: the name of a mechanism met that this audit cannot score (None: none).
    """

    def __init__(self, m: int, rng: Randomness):
        self.m = int(m)
        self.rng = rng
        self.included = rng.stream("audit_dirac_coin").bernoulli((self.m,), 0.5)
        self.scores = torch.zeros(self.m, dtype=torch.float64)
        self.sums = torch.zeros(self.m, dtype=torch.float64)
        self.releases = 0
        self.unsupported: Optional[str] = None
        self._where: Optional[list[tuple[str, torch.Tensor, torch.Tensor]]] = None

    def _place(self, grad_sum: dict[str, torch.Tensor]) -> None:
        """Distinct coordinates, uniform over the flattened trainable parameters (public: drawn
        from a stream of the run's key, but nothing depends on their secrecy)."""
        names = list(grad_sum)
        sizes = torch.tensor([grad_sum[n].numel() for n in names])
        total = int(sizes.sum())
        if total < self.m:
            raise ValueError(f"{self.m} Dirac canaries need as many trainable coordinates (have {total})")
        flat = self.rng.stream("audit_dirac_place").permutation(total)[:self.m]
        ends = torch.cumsum(sizes, 0)
        which = torch.searchsorted(ends, flat, right=True)
        starts = ends - sizes
        self._where = []
        for k, n in enumerate(names):
            sel = (which == k).nonzero().flatten()
            if len(sel):
                self._where.append((n, sel, flat[sel] - starts[k]))

    def inject(self, grad_sum: dict[str, torch.Tensor], sensitivity: float, q: float,
               step: int) -> dict[str, torch.Tensor]:
        """A copy of ``grad_sum`` with C at the coordinate of each included canary that this
        step's Poisson draw (rate q) selects."""
        if self._where is None:
            self._place(grad_sum)
        joins = self.included & self.rng.stream("audit_dirac_sample", int(step)).bernoulli((self.m,), q)
        out = dict(grad_sum)
        for name, idx, coord in self._where:
            add = joins[idx]
            if bool(add.any()):
                t = out[name].detach().clone()
                t.view(-1)[coord[add].to(t.device)] += sensitivity
                out[name] = t
        return out

    def observe(self, released: dict[str, torch.Tensor], sensitivity: float, q: float, sigma: float) -> None:
        """Add each canary's log-likelihood ratio for one release (rate q, claimed noise σ) to its
        score, and its coordinate (÷ C) to its sum."""
        x = torch.empty(self.m, dtype=torch.float64)
        for name, idx, coord in self._where:
            x[idx] = released[name].detach().reshape(-1)[coord.to(released[name].device)].double().cpu() / sensitivity
        self.sums += x
        if sigma > 0 and q > 0:  # log(1 − q + q·e^z) = logaddexp(log(1 − q), log q + z), stable for large z
            z = (x - 0.5) / sigma ** 2
            lo = torch.tensor(math.log1p(-q) if q < 1 else -math.inf, dtype=torch.float64)
            self.scores += torch.logaddexp(lo.expand_as(z), math.log(q) + z)
        else:
            self.scores += x
        self.releases += 1


    # -- the DP step's release hook (step/pipeline.py observe_releases) --------------------------
    def _walks(self, mechanism) -> bool:
        if type(mechanism) is not GaussianMechanism:  # banded MF: correlated noise (module docstring)
            self.unsupported = type(mechanism).__name__
        return self.unsupported is None

    def before_release(self, clipped, sensitivity, q, step, mechanism):
        return self.inject(clipped, float(sensitivity), float(q), step) if self._walks(mechanism) else clipped

    def after_release(self, noisy, sensitivity, q, step, mechanism) -> None:
        if self._walks(mechanism):
            self.observe(noisy, float(sensitivity), float(q), float(mechanism.sigma))


@contextlib.contextmanager
def dirac_canaries(m: int, rng: Randomness) -> Iterator[DiracCanaries]:
    """While active, every private release of this process (any way in) carries the Dirac
    canaries, and their coordinates of each release (the run's own noise, σ and C) are scored."""
    with observe_releases(DiracCanaries(m, rng)) as state:
        yield state
