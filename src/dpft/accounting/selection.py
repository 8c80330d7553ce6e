"""The privacy cost of private selection with a random number of trials K (hyperparameter search).

A search runs K independent trials of a DP base mechanism Q (draw hyperparameters, train with
DP-SGD, release a noisy score) and releases only the best trial; K itself is random and secret.
Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Rényi differential privacy") bound
the Rényi DP of that selection from Q's RDP curve:

* Theorem 2, K ~ truncated negative binomial D_{η,γ} (η > −1, 0 < γ < 1; η = 1 geometric,
  η = 0 logarithmic):  for every λ > 1 and λ̂ ≥ 1,
  ε'(λ) = ε(λ) + (1+η)(1 − 1/λ̂) ε(λ̂) + (1+η) log(1/γ)/λ̂ + log E[K] / (λ − 1),
  E[K] = η(1−γ) / (γ(1−γ^η))  (η ≠ 0),  (1/γ − 1)/log(1/γ)  (η = 0).
* Theorem 6, K ~ Poisson(μ): if Q is also (ε̂, δ̂)-DP with e^ε̂ ≤ 1 + 1/(λ−1),
  ε'(λ) = ε(λ) + μ δ̂ + log(μ) / (λ − 1).

Q's RDP curve ε(λ) comes from ``dp_accounting``'s RDP accountant on Q's events and its privacy
profile δ̂(ε̂) from the PLD accountant (never an accountant of our own); the selection's RDP
curve is converted to (ε, δ) by ``dp_accounting``'s RDP conversion. λ̂ is minimised over the
accountant's orders (any λ̂ ≥ 1 is allowed, so a minimum over a subset is still a valid bound).

Beside it, *naive composition at the K quantile*: with k* the smallest k with P[K > k*] ≤ δ/2,
the search is (ε_{k*}(δ/2), δ/2 + P[K > k*])-DP, ε_{k*} the PLD ε of k* trials. It is valid
(and used when tighter) only when every trial has the same events; with several hyperparameter
configurations of different privacy cost it is shown for comparison only.

Several configurations: Q draws its hyperparameters at random (independently of the data), so Q
is a mixture of the configurations' mechanisms with data-independent weights; Rényi divergence
is jointly quasi-convex, so Q's RDP curve is bounded by the pointwise maximum of the
configurations' curves — which is what :func:`base_rdp` returns.

Beside it, a *privacy-profile bound* (accounting/selection_profile.py: derived there, with its
proof, along the route of Koskela, Redberg & Wang, ICML 2024, "Privacy profiles for private
selection"): δ(ε₁ + (η+1) log R) ≤ E[K] R^{η+1} δ_Q(ε₁), δ_Q the PLD privacy profile of Q from
dp-accounting. The search's ε is the smallest of the valid bounds, and the report names it.

The selection is recorded in the ledger as one :class:`RandomKSelectionDpEvent` (an event that
``dp_accounting`` does not know): accounting/ledger.py composes it with the run's other events
through :func:`selection_rdp_curve` (RDP) or by basic composition, whichever is smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpft.accounting import selection_profile as _prof
from dpft.accounting.quiet import quiet_absl

__all__ = ["KDistribution", "RandomKSelectionDpEvent", "SelectionBound", "ORDERS", "rdp_curve", "base_rdp",
           "selection_rdp_curve", "selection_epsilon", "naive_epsilon", "calibrate_search", "PROFILE_BOUND",
           "candidate_event", "check_trials_covered", "gdp_sigma", "SelectionError", "profile_epsilon", "profile_grid",
           "BOUND_NAMES"]

#: RDP orders λ (and λ̂) used throughout: dp-accounting's defaults.
ORDERS: tuple[float, ...] = tuple(float(x) for x in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

#: What the privacy-profile column is (accounting/selection_profile.py).
PROFILE_BOUND = _prof.THEOREM
#: Names of the bounds, as reports state which one certified a search.
BOUND_NAMES = {"rdp": "Papernot & Steinke 2022 (RDP, Theorem 2 / Theorem 6; dp-accounting conversion)",
               "profile": "privacy profile (accounting/selection_profile.py; PLD from dp-accounting)",
               "naive": "naive composition at the 1−δ/2 quantile of K (PLD)"}

_ADD_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


class SelectionError(ValueError):
    """A search whose privacy cannot be bounded as asked; the message says what to change."""


@dataclass(frozen=True)
class KDistribution:
    """The law of the number of trials K.

    ``kind``: ``truncated_negative_binomial`` (parameters η > −1, 0 < γ < 1; support K ≥ 1;
    P[K=k] ∝ (1−γ)^k Π_{l<k} (l+η)/(l+1)) or ``poisson`` (μ > 0; K = 0 releases nothing).
    Source: Papernot & Steinke 2022, §3 (Definition of D_{η,γ}) and Theorem 6.
    """

    kind: str
    eta: float = 1.0
    gamma: float = 0.5
    mu: float = 1.0

    def __post_init__(self):
        if self.kind == "truncated_negative_binomial":
            if not (self.eta > -1 and 0 < self.gamma < 1):
                raise SelectionError(f"truncated negative binomial needs η > −1 and 0 < γ < 1 (got η = {self.eta}, "
                                     f"γ = {self.gamma})")
        elif self.kind == "poisson":
            if not self.mu > 0:
                raise SelectionError(f"Poisson K needs μ > 0 (got {self.mu})")
        else:
            raise SelectionError(f"unknown K distribution {self.kind!r}: truncated_negative_binomial or poisson")

    @classmethod
    def with_mean(cls, kind: str, mean: float, eta: float = 1.0) -> "KDistribution":
        """The distribution of ``kind`` with E[K] = ``mean`` (γ found by bisection for the truncated
        negative binomial, E[K] being decreasing in γ; μ = mean for Poisson).

        Raises:
            SelectionError: mean ≤ 1 for the truncated negative binomial (K ≥ 1 always), or ≤ 0."""
        if kind == "poisson":
            return cls("poisson", mu=float(mean))
        if not mean > 1:
            raise SelectionError(f"a truncated negative binomial K has E[K] > 1; got mean {mean}")
        lo, hi = 1e-12, 1 - 1e-12
        for _ in range(200):
            mid = (lo + hi) / 2
            if cls(kind, eta=eta, gamma=mid).mean() > mean:
                lo = mid
            else:
                hi = mid
        return cls(kind, eta=eta, gamma=(lo + hi) / 2)

    def as_dict(self) -> dict:
        if self.kind == "poisson":
            return {"kind": "poisson", "mu": self.mu, "mean": self.mean()}
        return {"kind": self.kind, "eta": self.eta, "gamma": self.gamma, "mean": self.mean()}

    def mean(self) -> float:
        """E[K] (Papernot & Steinke 2022, Theorem 2)."""
        if self.kind == "poisson":
            return self.mu
        g, e = self.gamma, self.eta
        if e == 0:
            return (1 / g - 1) / math.log(1 / g)
        return e * (1 - g) / (g * (1 - g ** e))

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.kind == "poisson":
            return math.exp(k * math.log(self.mu) - self.mu - math.lgamma(k + 1)) if k >= 0 else 0.0
        if k < 1:
            return 0.0
        g, e = self.gamma, self.eta
        if e == 0:  # logarithmic
            return (1 - g) ** k / (k * math.log(1 / g))
        # (1−γ)^k / (γ^{−η} − 1) · Γ(k+η) / (Γ(η) k!), in logs (Γ(η) < 0 for −1 < η < 0: signs cancel)
        log_ratio = math.lgamma(k + e) - math.lgamma(e) - math.lgamma(k + 1)  # lgamma = log|Γ|
        return math.exp(k * math.log(1 - g) + log_ratio) / abs(g ** (-e) - 1)

    def cdf(self, k: int) -> float:
        """P[K ≤ k] (summed pmf; 0 below the support)."""
        return min(1.0, sum(self.pmf(j) for j in range(0, k + 1)))

    def tail_quantile(self, tail: float, k_max: int = 1_000_000) -> int:
        """Smallest k with P[K > k] ≤ ``tail`` (the pmf summed up to k)."""
        total, k = 0.0, 0
        while k < k_max:
            total += self.pmf(k)
            if 1.0 - total <= tail:
                return k
            k += 1
        raise SelectionError(f"P[K > k] stays above {tail:g} up to k = {k_max}")

    def sample(self, u: float) -> int:
        """K from one uniform ``u`` in [0, 1) by inversion of the CDF (``u`` from the run's secret
        randomness: privacy/randomness.py)."""
        if not 0 <= u < 1:
            raise ValueError(f"u must be in [0, 1), got {u}")
        total, k = 0.0, 0
        while True:
            total += self.pmf(k)
            if u < total or k > 10_000_000:
                return k
            k += 1


@attr.define(frozen=True)
class RandomKSelectionDpEvent(dpa.DpEvent):
    """Ledger event of a random-K private selection (``dp_accounting`` has none).

    Attributes:
        candidates: the per-trial events of every hyperparameter configuration the search can draw
            (the base mechanism Q is their data-independent mixture); the bound uses their
            pointwise maximum RDP.
        kind, eta, gamma, mu: the law of K (:class:`KDistribution`).
        trials: the events each trial actually spent (for audit; every one must be covered by a
            candidate, which :func:`check_trials_covered` checks).
    """

    candidates: list = attr.field(factory=list)
    kind: str = "truncated_negative_binomial"
    eta: float = 1.0
    gamma: float = 0.5
    mu: float = 1.0
    trials: list = attr.field(factory=list)

    @property
    def distribution(self) -> KDistribution:
        return KDistribution(self.kind, self.eta, self.gamma, self.mu)


def rdp_curve(event: dpa.DpEvent, orders: Sequence[float] = ORDERS) -> np.ndarray:
    """RDP ε(λ) of ``event`` at ``orders`` from dp-accounting's RDP accountant (add/remove-one).

    Raises:
        SelectionError: the RDP accountant does not support the event (e.g. truncated Poisson)."""
    acc = rdp_privacy_accountant.RdpAccountant(list(orders), _ADD_REMOVE)
    if not acc.supports(event):
        raise SelectionError(f"the RDP accountant does not support {type(event).__name__}; a search over it "
                             "cannot be bounded by Papernot & Steinke's theorem")
    with quiet_absl():
        acc.compose(event)
    return np.asarray(acc._rdp, dtype=float)  # noqa: SLF001 - the accountant's own curve, no copy of its maths


def base_rdp(candidates: Sequence[dpa.DpEvent], orders: Sequence[float] = ORDERS) -> np.ndarray:
    """Pointwise maximum of the candidates' RDP curves (joint quasi-convexity; module docstring)."""
    if not candidates:
        raise SelectionError("a selection needs at least one candidate trial event")
    return np.max(np.stack([rdp_curve(c, orders) for c in candidates]), axis=0)


_PLD_CACHE: dict[str, object] = {}


#: PLD discretisation of the profile bound's δ_Q (coarser than the per-trial 1e-4: a large-σ·small-T
#: PLD at 1e-4 takes ~10 s to build; a coarser pessimistic PLD only loosens the bound).
PROFILE_PLD_INTERVAL = 1e-3


def _pld(event: dpa.DpEvent, interval: float = 1e-4):
    """The PLD of ``event`` (dp-accounting, pessimistic, grid ``interval``), cached by the event's repr
    (events are values: equal reprs are equal events); at most 32 kept."""
    key = f"{interval}|{event!r}"
    if key not in _PLD_CACHE:
        acc = pld_privacy_accountant.PLDAccountant(_ADD_REMOVE, value_discretization_interval=interval)
        acc.compose(event)
        if len(_PLD_CACHE) >= 32:
            _PLD_CACHE.pop(next(iter(_PLD_CACHE)))
        _PLD_CACHE[key] = acc._pld  # noqa: SLF001 - the accountant's own distribution
    return _PLD_CACHE[key]


def selection_rdp_curve(candidates: Sequence[dpa.DpEvent], dist: KDistribution,
                        orders: Sequence[float] = ORDERS, base: Optional[np.ndarray] = None) -> np.ndarray:
    """RDP ε'(λ) of the selection at each λ in ``orders`` (λ > 1; Papernot & Steinke 2022,
    Theorem 2 for the truncated negative binomial, Theorem 6 for Poisson). ``inf`` where the
    theorem gives nothing."""
    lam = np.asarray(orders, dtype=float)
    eps = base_rdp(candidates, orders) if base is None else np.asarray(base, dtype=float)
    if dist.kind == "poisson":
        out = np.full_like(lam, math.inf)
        plds = [_pld(c) for c in candidates]  # Q's privacy profile δ̂(ε̂): worst over the candidates
        ok = lam > 1
        eps_hat = np.log1p(1.0 / (lam[ok] - 1.0))  # e^ε̂ = 1 + 1/(λ−1), the theorem's largest ε̂
        order = np.argsort(eps_hat)  # dp-accounting's vectorised δ(ε) wants ascending ε
        delta_hat = np.empty_like(eps_hat)
        delta_hat[order] = np.max(np.stack([np.asarray(p.get_delta_for_epsilon(eps_hat[order]), dtype=float)
                                            for p in plds]), axis=0)
        out[ok] = eps[ok] + dist.mu * delta_hat + math.log(dist.mu) / (lam[ok] - 1.0)
        return out
    eta, gamma = dist.eta, dist.gamma
    # min over λ̂ of (1+η)(1 − 1/λ̂) ε(λ̂) + (1+η) log(1/γ)/λ̂
    hat = np.min((1 + eta) * (1 - 1 / lam) * eps + (1 + eta) * math.log(1 / gamma) / lam)
    return eps + hat + math.log(dist.mean()) / (lam - 1.0)


@dataclass
class SelectionBound:
    """ε at δ of a search, by each bound; ``epsilon`` is the smallest valid one."""

    epsilon: float
    delta: float
    epsilon_rdp: float
    epsilon_naive: float
    naive_k: int
    naive_valid: bool
    per_trial_epsilon: float
    mean_k: float
    epsilon_profile: float = math.inf
    certified_by: str = "rdp"
    profile_detail: Optional[dict] = None
    profile_bound: str = PROFILE_BOUND

    @property
    def certified_by_name(self) -> str:
        return BOUND_NAMES[self.certified_by]

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("epsilon", "delta", "epsilon_rdp", "epsilon_profile", "epsilon_naive",
                                             "naive_k", "naive_valid", "per_trial_epsilon", "mean_k", "certified_by",
                                             "profile_detail", "profile_bound")}
        out["certified_by_name"] = self.certified_by_name
        return out


def _pld_epsilon(event: dpa.DpEvent, delta: float) -> float:
    return float(_pld(event).get_epsilon_for_delta(delta))


def naive_epsilon(candidates: Sequence[dpa.DpEvent], dist: KDistribution, delta: float) -> tuple[float, int]:
    """(ε, k*) of naive composition at the quantile: k* = smallest k with P[K > k] ≤ δ/2, ε = the
    PLD ε at δ/2 of k* compositions of the most expensive candidate (module docstring)."""
    k = dist.tail_quantile(delta / 2)
    if k == 0:
        return 0.0, 0
    worst = max(candidates, key=lambda c: _pld_epsilon(c, delta / 2))
    return float(_pld(worst).self_compose(k).get_epsilon_for_delta(delta / 2)), k


def profile_grid(candidates: Sequence[dpa.DpEvent], dist: KDistribution, delta: float,
                 cap: float = 100.0) -> "_prof.ProfileGrid":
    """The base mechanism's privacy profile (pointwise maximum over the candidates' PLDs) on a grid
    reaching the ε at the smallest δ the bound can ask of Q (δ / (E[K]·max R^{η+1})), at most ``cap``."""
    plds = [_pld(c, PROFILE_PLD_INTERVAL) for c in candidates]
    if dist.kind == "poisson":
        tv = max(float(p.get_delta_for_epsilon(0.0)) for p in plds)
        worst = dist.mean() * math.exp(dist.mu * tv)
    else:
        worst = dist.mean() * dist.gamma ** (-(dist.eta + 1.0))
    d_min = max(delta / worst / 2.0, 1e-300)
    top = min(cap, max(float(p.get_epsilon_for_delta(d_min)) for p in plds) + 0.01)
    return _prof.profile_grid(plds, top)


def profile_epsilon(candidates: Sequence[dpa.DpEvent], dist: KDistribution, delta: float) -> tuple[float, dict]:
    """ε(δ) of the selection by the privacy-profile bound (accounting/selection_profile.py) and the
    (ε₁, ε₂) attaining it."""
    return _prof.profile_epsilon(dist, profile_grid(candidates, dist, delta), delta)


def selection_epsilon(candidates: Sequence[dpa.DpEvent], dist: KDistribution, delta: float,
                      naive: bool = True, profile: bool = True) -> SelectionBound:
    """ε(δ) of the random-K selection over ``candidates`` by each bound — RDP (Papernot & Steinke)
    converted by dp-accounting, the privacy-profile bound (accounting/selection_profile.py), naive
    composition at the K quantile — and the smallest valid one, with the bound that gave it.

    Raises:
        SelectionError: δ not in (0, 1), no candidates, or events without an RDP curve."""
    if not 0 < delta < 1:
        raise SelectionError(f"δ must be in (0, 1), got {delta}")
    curve = selection_rdp_curve(candidates, dist)
    eps_rdp = float(rdp_privacy_accountant.compute_epsilon(list(ORDERS), list(curve), delta)[0])
    per_trial = max(_pld_epsilon(c, delta) for c in candidates)
    eps_prof, detail = profile_epsilon(candidates, dist, delta) if profile else (math.inf, None)
    eps_naive, k = naive_epsilon(candidates, dist, delta) if naive else (math.inf, 0)
    valid = len({repr(c) for c in candidates}) == 1
    options = {"rdp": eps_rdp, "profile": eps_prof} | ({"naive": eps_naive} if valid else {})
    by = min(options, key=options.get)
    return SelectionBound(options[by], delta, eps_rdp, eps_naive, k, valid, per_trial, dist.mean(),
                          epsilon_profile=eps_prof, certified_by=by, profile_detail=detail or None)


def check_trials_covered(event: RandomKSelectionDpEvent, rtol: float = 1e-9) -> list[int]:
    """Indices of recorded trials whose RDP curve exceeds every candidate's (not covered by the
    bound; the ledger then composes them on top)."""
    if not event.trials:
        return []
    base = base_rdp(event.candidates)
    return [i for i, t in enumerate(event.trials) if np.any(rdp_curve(t) > base * (1 + rtol) + 1e-12)]


def gdp_sigma(mu: float, q: float, steps: int) -> float:
    """σ with q√T·√(e^{1/σ²} − 1) = μ (the CLT μ-GDP of Poisson-subsampled Gaussian steps; Bu et al.
    2020): used only to give every configuration a *similar* privacy cost inside the calibration
    below; the certified ε is always recomputed from the accountants."""
    x = mu / (q * math.sqrt(steps))
    return 1.0 / math.sqrt(math.log1p(x * x))


def calibrate_search(target_epsilon: float, delta: float, dist: KDistribution, configs: Sequence[tuple[float, int]],
                     score_sigma: Optional[float], rel_tol: float = 2e-3,
                     bound: str = "best") -> tuple[list[float], SelectionBound]:
    """Per-trial σ of each (q, steps) configuration such that the whole search spends ``target_epsilon``.

    Bisection on a common μ (each configuration's σ from :func:`gdp_sigma`, so that their costs are
    alike); each candidate's event is ``steps`` × PoissonSampled(q, Gaussian(σ)) composed with the
    score's ``Gaussian(score_sigma)`` (None: a public dev set, no score event). ``bound``: "rdp"
    calibrates under Papernot & Steinke's RDP bound only; "best" (default) then continues the
    bisection under the smaller of the RDP and privacy-profile bounds (both valid; the RDP result is
    the lower end of the bracket). The returned σ's satisfy selection ε ≤ target under the bound that
    the returned :class:`SelectionBound` names (the bracket's safe end, recomputed).

    Raises:
        SelectionError: the target cannot be met even with σ = 500 on every configuration (the score
            alone, or log E[K]/(λ−1) terms, exceed it): raise ε, lower E[K] or raise the score's σ."""
    if bound not in ("rdp", "best"):
        raise SelectionError(f"calibrate_search: bound must be 'rdp' or 'best', got {bound!r}")

    def events(mu):
        sig = [min(500.0, max(0.3, gdp_sigma(mu, q, t))) for q, t in configs]
        return sig, [candidate_event(s, q, t, score_sigma) for s, (q, t) in zip(sig, configs)]

    def eps_rdp(mu):
        curve = selection_rdp_curve(events(mu)[1], dist)
        return float(rdp_privacy_accountant.compute_epsilon(list(ORDERS), list(curve), delta)[0])

    def eps_best(mu):
        r = eps_rdp(mu)
        return min(r, profile_epsilon(events(mu)[1], dist, delta)[0]) if bound == "best" else r

    def bisect(f, lo, hi):
        while f(hi) <= target_epsilon and hi < 1e4:
            lo, hi = hi, hi * 2
        while (hi - lo) > rel_tol * lo:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) <= target_epsilon else (lo, mid)
        return lo

    lo = 1e-4
    if eps_rdp(lo) <= target_epsilon:
        lo = bisect(eps_rdp, lo, 1.0)
    elif eps_best(lo) > target_epsilon:
        raise SelectionError(f"a search with E[K] = {dist.mean():.3g} cannot meet ε = {target_epsilon:g} at δ = "
                             f"{delta:g} even with very large noise; raise ε, lower the mean number of trials, or "
                             "raise tune.score_noise_multiplier")
    if bound == "best":  # the profile bound may allow less noise: continue from the RDP-feasible μ
        lo = bisect(eps_best, lo, lo * 1.25)
    sig, evs = events(lo)
    return sig, selection_epsilon(evs, dist, delta, profile=(bound == "best"))


def candidate_event(sigma: float, q: float, steps: int, score_sigma: Optional[float]) -> dpa.DpEvent:
    """One trial's events: ``steps`` DP-SGD steps at (σ, q), then the noisy score count (sensitivity 1
    under add/remove of one row of the scoring split: noise std = ``score_sigma``)."""
    train = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    if score_sigma is None:
        return train
    return dpa.ComposedDpEvent([train, dpa.GaussianDpEvent(score_sigma)])
