"""Audit checks of the private hyperparameter search (``dpft tune``, issue 35).

* **K law** — 2,000 K's drawn through the search's own path (:func:`dpft.run.tune.draw_trials`,
  one secret key each) follow the declared law (chi-square on the cells with ≥ 5 expected);
  planted ``k_fixed`` (K = round(E[K]) every time) fails it.
* **selection ε** — the ledger's ε of a ``RandomKSelectionDpEvent`` equals an independent
  evaluation of Papernot & Steinke's theorem (E[K] summed from the pmf, not the closed form; λ̂
  scanned in a loop; Poisson δ̂ from a fresh PLD accountant) on 4 configurations (η = 1, 0, 0.5
  and Poisson).
* **noisy score** — the score of a trial on private rows carries Gaussian noise from the secret
  stream and records ``GaussianDpEvent(σ_s)`` before the draw; planted ``score_without_noise``
  (the exact count released) fails it.
* **one release** — after a search, the run directory holds the chosen trial's model only and no
  trial folder; planted ``losing_models_released`` (every trial's model copied into the run
  directory) fails it.
* **searched methods keep the events** — every registered method that declares
  ``search_events_unchanged`` (so ``tune.space`` may vary it, run/tune_space.py) is built, with its
  options on, into a stub DP step: its ``prepare`` records nothing in the ledger and the step's
  mechanism still records the same ``PoissonSampled(q, Gaussian(σ))`` event; a method declaring it
  without an entry here fails the check (a claim nobody audited).
* **uncovered trials are charged** — a trial whose recorded events exceed every candidate (e.g. a
  method adding a release) is composed on top of the selection in the released ledger, in full;
  planted ``uncovered_trial_hidden`` (the coverage test answering "all covered") fails it.
* **auto (B, T) in a search** — ``batch.expected_batch_size: auto`` / ``steps: auto`` in a search
  recipe (run/tune_space.py ``resolve_search_auto``): the chosen configuration's per-trial σ, put in the
  ledger's selection event, gives a search ε that equals an independent evaluation of both theorems
  for that (B, T) and is within the target; the choice is the smallest σ/B among its candidates.
  Planted ``auto_single_run_sigma`` ((B, T) and σ chosen against ONE run's ε instead of the search's
  bound, an overspend) fails it.
* **each scope a search may choose is charged as it runs** (issue 45) — ``tune.space.trainable.mode``'s
  candidates (head, last_k, full, lora) are accounted at the (q, T) their trial recipes run; planted
  ``scope_schedule_uncharged`` (a candidate accounted at the recipe's own batch and steps) fails it.
* **what a search lets out, its folder** (audit/checks_tune_release.py, issue 44): silent trials, the
  run lock, one ledger entry per search, one score per trial across crashes.
"""

from __future__ import annotations

import json
import math
import tempfile
import types
from pathlib import Path
from unittest import mock

import dp_accounting as dpa
import numpy as np
import torch

from dpft.accounting import selection_profile as _prof
from dpft.accounting.ledger import PrivacyLedger, event_to_dict
from dpft.accounting.selection import ORDERS, KDistribution, RandomKSelectionDpEvent, candidate_event, selection_epsilon
from dpft.accounting import budget as _budget
from dpft.audit.checks_tune_release import RELEASE_PLANTED, release_checks
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.methods.base import registered
from dpft.models.losses import classification_loss
from dpft.step.build import build_clip, build_step_spec, make_engine
from dpft.config.recipe import Recipe, load_recipe
from dpft.config.tune import SCOPE_CHOICES
from dpft.run.defaults import CLASSIFICATION
from dpft.step.plan import planned_steps
from dpft.privacy.randomness import Randomness
from dpft.run import tune as T
from dpft.run import tune_space as TS

__all__ = ["PLANTED", "tune_checks"]

#: Planted bugs :func:`tune_checks` must catch.
PLANTED = ("k_fixed", "score_without_noise", "losing_models_released", "profile_ratio_dropped",
           "uncovered_trial_hidden", "auto_single_run_sigma", "scope_schedule_uncharged") + RELEASE_PLANTED

#: The options that switch each search-safe built-in method fully on (audited by :func:`_method_events`).
METHOD_ON = {"rmt": {"method": "rmt", "kappa": 1.1},
             "dp_adam_ac": {"adaptive_clip": True, "count_noise": 50.0, "gamma_nudge": True, "ema_decay": 0.9,
                            "bias_correction": True}}


def _k_law(planted) -> Check:
    from scipy.stats import chisquare

    dist = KDistribution.with_mean("truncated_negative_binomial", 3.0, eta=1.0)
    r = Recipe.model_validate({"tune": {"trials": {"mean": 3.0}}})
    patch = (mock.patch.object(KDistribution, "sample", lambda self, u: int(round(self.mean())))
             if planted == "k_fixed" else mock.patch.object(T, "PRIVATE", T.PRIVATE))
    n = 2000
    with patch:
        ks = np.array([T.draw_trials(r, dist, Randomness(None))[0] for _ in range(n)])
    top = 8
    exp = np.array([n * dist.pmf(k) for k in range(1, top)] + [n * (1 - dist.cdf(top - 1))])
    obs = np.array([(ks == k).sum() for k in range(1, top)] + [(ks >= top).sum()])
    p = float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    ok = p > 1e-4
    return Check("tune: K drawn from the declared law", ok,
                 f"chi-square p = {p:.3g} on {n} draws of K (geometric, E[K] = 3; mean drawn {ks.mean():.3f})",
                 {"p_value": p, "mean": float(ks.mean())})


def _independent_rdp_epsilon(cand, dist: KDistribution, delta: float) -> float:
    """Papernot & Steinke 2022 Thm 2 / Thm 6 evaluated afresh (E[K] from the pmf; loops)."""
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant(list(ORDERS))
    acc.compose(cand)
    eps = [float(x) for x in acc._rdp]  # noqa: SLF001
    mean_k = sum(k * dist.pmf(k) for k in range(0, 200000))
    out = []
    if dist.kind == "poisson":
        pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        pld.compose(cand)
        for lam, e in zip(ORDERS, eps):
            out.append(e + dist.mu * float(pld.get_delta(math.log(1 + 1 / (lam - 1)))) + math.log(dist.mu) / (lam - 1))
    else:
        best = math.inf
        for lh, eh in zip(ORDERS, eps):
            best = min(best, (1 + dist.eta) * (1 - 1 / lh) * eh + (1 + dist.eta) * math.log(1 / dist.gamma) / lh)
        out = [e + best + math.log(mean_k) / (lam - 1) for lam, e in zip(ORDERS, eps)]
    return float(rdp_privacy_accountant.compute_epsilon(list(ORDERS), out, delta)[0])


def _independent_profile_epsilon(cand, dist: KDistribution, delta: float, extra_eps2: float = 0.0) -> float:
    """The privacy-profile bound (accounting/selection_profile.py) evaluated afresh: δ_Q from a new
    dp-accounting PLD, ε₁ by dp-accounting's own inversion (no ε grid), ε₂ over its own levels plus
    ``extra_eps2``; ε = min over ε₂ of ε₁ + (η+1) log R with δ_Q(ε₁) = δ / (E[K] R^{η+1})."""
    from dp_accounting.pld import pld_privacy_accountant

    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(cand)
    mean_k = sum(k * dist.pmf(k) for k in range(0, 200000))
    if dist.kind == "poisson":
        levels = [0.0]
    else:
        levels = sorted({0.0, extra_eps2} | {round(0.01 * i, 6) for i in range(1, 300)})
    best = math.inf
    for e2 in levels:
        d2 = float(pld.get_delta(e2))
        if dist.kind == "poisson":
            log_r = dist.mu * d2
        else:
            log_r = (1 + dist.eta) * math.log(min(1 / dist.gamma, math.exp(e2) + (1 - dist.gamma) * d2 / dist.gamma))
        e1 = max(0.0, float(pld.get_epsilon(delta / (mean_k * math.exp(log_r)))))
        best = min(best, e1 + log_r)
    return best


def _profile_without_ratio(dist, grid, delta):
    """Planted bug ``profile_ratio_dropped``: the profile bound with δ_Q asked at δ/E[K] instead of
    δ/(E[K]·R^{η+1}) (the R^{η+1} factor on δ forgotten: an ε in our favour)."""
    best, arg = math.inf, {}
    for i in _prof._inner_levels(dist, grid):  # noqa: SLF001 - the same levels as the real bound
        lr = _prof.log_ratio(dist, float(grid.eps[i]), float(grid.delta[i]))
        eps = grid.epsilon_for_delta(delta / dist.mean()) + lr
        if eps < best:
            best, arg = eps, {"eps1": eps - lr, "eps2": float(grid.eps[i]), "log_ratio": lr}
    return best, arg


def _selection_epsilon(planted=None) -> Check:
    delta = 1e-5
    # small step counts: the PLD of the naive bound and of the Poisson theorem's δ̂ stay fast
    configs = [(KDistribution("truncated_negative_binomial", 1.0, 0.1), candidate_event(1.2, 0.02, 60, 10.0)),
               (KDistribution("truncated_negative_binomial", 0.0, 0.05), candidate_event(0.9, 0.01, 80, 8.0)),
               (KDistribution("truncated_negative_binomial", 0.5, 0.2), candidate_event(2.0, 0.05, 40, None)),
               (KDistribution("poisson", mu=6.0), candidate_event(1.5, 0.02, 40, 10.0))]
    rows, ok = [], True
    patch = (mock.patch.object(_prof, "profile_epsilon", _profile_without_ratio) if planted == "profile_ratio_dropped"
             else mock.patch.object(T, "PRIVATE", T.PRIVATE))
    with patch:
        for dist, cand in configs:
            ok &= _one_selection(dist, cand, delta, rows)
    return Check("tune: selection ε equals an independent evaluation of both theorems", ok, "; ".join(rows))


def _one_selection(dist, cand, delta, rows) -> bool:
    """One configuration: the ledger's ε against independent evaluations of both bounds (appends a row)."""
    led = PrivacyLedger()
    led.record("tune", RandomKSelectionDpEvent(candidates=[cand], kind=dist.kind, eta=dist.eta, gamma=dist.gamma,
                                               mu=dist.mu))
    got = led.epsilon(delta).epsilon
    b = selection_epsilon([cand], dist, delta)
    ind_rdp = _independent_rdp_epsilon(cand, dist, delta)
    ind_prof = _independent_profile_epsilon(cand, dist, delta, (b.profile_detail or {}).get("eps2", 0.0))
    # each bound as computed by dpft equals its independent evaluation (the profile bound up to its
    # 1e-3 ε grid, rounded up), and the ledger certifies the smaller of the two
    good = (abs(b.epsilon_rdp - ind_rdp) <= 1e-6 * ind_rdp
            and -1e-9 <= b.epsilon_profile - ind_prof <= 2e-3 + 1e-4 * ind_prof
            and abs(got - min(b.epsilon_rdp, b.epsilon_profile)) <= 1e-9 * got)
    rows.append(f"{dist.kind}(η={dist.eta:g}, γ={dist.gamma:.3g}, μ={dist.mu:g}): ledger {got:.5f} "
                f"({b.certified_by}); RDP {b.epsilon_rdp:.5f} vs independent {ind_rdp:.5f}; profile "
                f"{b.epsilon_profile:.5f} vs independent {ind_prof:.5f}")
    return good


def _noisy_score(planted) -> Check:
    patch = (mock.patch.object(T, "private_score", lambda c, s, led, rng, i, path=None: float(c))
             if planted == "score_without_noise" else mock.patch.object(T, "PRIVATE", T.PRIVATE))
    with patch:
        leds = [PrivacyLedger(), PrivacyLedger()]
        a = T.private_score(40, 10.0, leds[0], Randomness(None), 0)
        b = T.private_score(40, 10.0, leds[1], Randomness(None), 0)
    events = [e.event for led in leds for e in led.entries]
    ok = a != b and a != 40.0 and events == [dpa.GaussianDpEvent(10.0)] * 2
    return Check("tune: private scores are noised and recorded", ok,
                 f"two keys gave scores {a:.3f}, {b:.3f} for the count 40; ledger events {len(events)}")


def _one_release(planted) -> Check:
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        priv = run / T.PRIVATE
        r = Recipe.model_validate({"privacy": {"target_epsilon": 8.0, "delta": 1e-5},
                                   "tune": {"trials": {"mean": 3.0}}})
        dist = KDistribution.with_mean("truncated_negative_binomial", 3.0)
        cand = candidate_event(1.0, 0.02, 50, 10.0)
        trials = []
        for i, score in enumerate([3.0, 9.0, 5.0]):
            (priv / f"trial_{i}" / "model").mkdir(parents=True)
            (priv / f"trial_{i}" / "model" / "weights.txt").write_text(f"trial {i}")
            trials.append({"index": i, "hyperparameters": {"optimizer.lr": 10.0 ** -i}, "score": score,
                           "sigma": 1.0, "trial_epsilon": 1.0,
                           "events": [json.loads(json.dumps(event_to_dict(cand)))]})
        state = {"k": 3, "trials": trials, "score_sigma": 10.0, "configurations": [{}], "sigmas": [1.0]}
        if planted == "losing_models_released":  # every trial's model beside the chosen one
            for t in trials:
                import shutil

                shutil.copytree(priv / f"trial_{t['index']}" / "model", run / f"model_trial_{t['index']}")
        priv.mkdir(parents=True, exist_ok=True)
        T.finish_search(r, run, state, dist, [cand], keep=False)
        models = sorted(p.relative_to(run).as_posix() for p in run.rglob("weights.txt"))
        ok = models == ["model/weights.txt"] and (run / "model" / "weights.txt").read_text() == "trial 1"
    return Check("tune: only the chosen trial's model is released", ok, f"model files left: {models}")


def _method_events(planted=None) -> Check:
    """Each method declaring ``search_events_unchanged``, on, in a stub step: no ledger entry from its
    ``prepare``, the same per-step event from the mechanism its ``build`` leaves."""
    rows, ok = [], True
    for name, cls in sorted(registered().items()):
        if not getattr(cls, "search_events_unchanged", False):
            continue
        if name not in METHOD_ON:
            ok = False
            rows.append(f"{name}: declares search_events_unchanged but has no audit entry (METHOD_ON)")
            continue
        r = Recipe.model_validate({"privacy": {"target_epsilon": 8.0}, "optimizer": {"name": "adamw"},
                                   "methods": [{"name": name, **METHOD_ON[name]}]})
        cfg = r.methods[0]
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
        clip = build_clip(r.privacy)
        engine = make_engine("reference", model, classification_loss, clip)
        sigma, q = 1.3, 0.05
        spec = build_step_spec(engine=engine, clip=clip, sigma=sigma, rng=Randomness(0), sampler=None,
                               optimizer=torch.optim.SGD(engine.params.values(), lr=0.1))
        before = spec.mechanism.event(q)
        led = PrivacyLedger()
        run = types.SimpleNamespace(recipe=r, private=True, resume=False, sigma=sigma, rng=Randomness(0), ledger=led,
                                    model=model, n=1000, q=q, run_dir=Path(tempfile.gettempdir()))
        m = cls(cfg, r)
        m.prepare(run)
        after = m.build(spec, run).mechanism.event(q)
        same = led.entries == [] and led.certified and after == before
        ok &= same
        rows.append(f"{name} on ({', '.join(METHOD_ON[name])}): ledger entries {len(led.entries)}, step event "
                    f"{'unchanged' if after == before else 'CHANGED'}")
    return Check("tune: methods a search may vary keep the step's privacy events", ok, "; ".join(rows))


def _scope_candidates(planted=None) -> Check:
    """Each scope a search may choose (``tune.space.trainable.mode``, issue 45) is charged at the (q, T) its
    trial runs: the candidate's accounted (q, T) (run/tune.py ``_steps_and_q``) equals the trial recipe's B / N
    and its steps by step/plan.py's one rule, for every scope. Planted ``scope_schedule_uncharged`` (the
    candidate accounted at the recipe's own batch and steps, not its scope's) fails it."""
    r = load_recipe(None, dict(CLASSIFICATION, **{
        "trainable.mode": "last_k", "privacy.target_epsilon": 8.0, "schedule.steps": 40,
        "tune": {"space": {"trainable.mode": {"choice": list(SCOPE_CHOICES)}}}}))
    n, rows, ok = 4000, [], True
    patch = (mock.patch.object(T, "_with_scope", lambda r, combo, n: combo) if planted == "scope_schedule_uncharged"
             else mock.patch.object(T, "_with_scope", T._with_scope))
    with patch, tempfile.TemporaryDirectory() as d:
        for combo in T.configurations(r):
            q, steps = T._steps_and_q(r, combo, n)
            rec = T._trial_recipe(r, combo, 1.0, Path(d) / "fit.jsonl", Path(d) / "score.jsonl", False, ["a", "b"], n)
            b = int(rec.batch.expected_batch_size)
            runs = (b / n, planned_steps(n, b, rec.schedule.steps, rec.schedule.epochs))
            ok &= math.isclose(q, runs[0]) and steps == runs[1]
            rows.append(f"{combo['trainable.mode']}: charged q = {q:.4g}, T = {steps}; runs q = {runs[0]:.4g}, "
                        f"T = {runs[1]}")
    return Check("tune: each scope a search may choose is charged at the (q, T) its trial runs", ok, "; ".join(rows))


def _uncovered_charged(planted=None) -> Check:
    """A trial spending more than every candidate (a method adding a release) is composed on top."""
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        priv = run / T.PRIVATE
        priv.mkdir(parents=True)
        r = Recipe.model_validate({"privacy": {"target_epsilon": 8.0, "delta": 1e-5},
                                   "tune": {"trials": {"mean": 3.0}}})
        dist = KDistribution.with_mean("truncated_negative_binomial", 3.0)
        cand = candidate_event(1.0, 0.02, 50, 10.0)
        extra = dpa.ComposedDpEvent([cand, dpa.GaussianDpEvent(2.0)])  # one more release than planned
        trials = [{"index": i, "hyperparameters": {}, "score": float(i), "sigma": 1.0, "trial_epsilon": 1.0,
                   "events": [json.loads(json.dumps(event_to_dict(ev)))]} for i, ev in enumerate([cand, extra])]
        for t in trials:
            (priv / f"trial_{t['index']}" / "model").mkdir(parents=True)
        state = {"k": 2, "trials": trials, "score_sigma": 10.0, "configurations": [{}], "sigmas": [1.0]}
        patch = (mock.patch.object(T, "check_trials_covered", lambda ev, rtol=1e-9: [])
                 if planted == "uncovered_trial_hidden" else mock.patch.object(T, "PRIVATE", T.PRIVATE))
        with patch:
            rep = T.finish_search(r, run, state, dist, [cand], keep=False)
        led = PrivacyLedger.load(run / "ledger.json")
        alone = selection_epsilon([cand], dist, 1e-5).epsilon
        phases = [e.phase.split(":")[0] for e in led.entries]
        ok = phases == ["tune", "tune_uncovered"] and rep["epsilon"] > alone + 1e-6
    return Check("tune: a trial outside the candidates is charged in full", ok,
                 f"ledger phases {phases}; ε {rep['epsilon']:.4f} against the selection alone {alone:.4f}")


def _plant_single_run_sigma(p) -> None:
    """Planted ``auto_single_run_sigma``: each candidate's σ is one run's σ at the search's ε (RDP), not
    the σ at which the whole search (K trials, scores, selection) spends it — smaller, so the search overspends."""
    def one_run(q, t, eps, delta, dist, score_sigma):
        return _budget._sigma_rdp(q, t, eps, delta)  # noqa: SLF001

    p.set(TS, "search_sigma", one_run)


_auto_bug = bug_planter(("auto_single_run_sigma",), {"auto_single_run_sigma": _plant_single_run_sigma})


def _auto_search(planted=None) -> Check:
    """batch/steps auto in a search: the ε the search's ledger certifies for the chosen (B, T) and its σ
    equals an independent evaluation of both bounds, within the target; the argmin of σ/B was chosen."""
    target, delta, n, score = 8.0, 1e-5, 1000, 10.0
    r = Recipe.model_validate({"privacy": {"target_epsilon": target, "delta": delta},
                               "batch": {"expected_batch_size": "auto"},
                               "schedule": {"steps": "auto", "compute_budget": 1600},  # candidates B = 8, 16
                               "tune": {"trials": {"mean": 3.0},
                                        "space": {"optimizer.lr": {"log_uniform": [1e-4, 1e-3]}}}})
    dist = KDistribution.with_mean("truncated_negative_binomial", 3.0)
    with _auto_bug(planted if planted == "auto_single_run_sigma" else None):
        r2, auto, _ = TS.resolve_search_auto(r, n, dist, score)
    b, t = int(r2.batch.expected_batch_size), int(r2.schedule.steps)
    cand = candidate_event(auto["sigma"], b / n, t, score)  # what dpft tune's ledger holds for this search
    led = PrivacyLedger()
    led.record("tune", RandomKSelectionDpEvent(candidates=[cand], kind=dist.kind, eta=dist.eta, gamma=dist.gamma,
                                               mu=dist.mu))
    got = led.epsilon(delta).epsilon
    bound = selection_epsilon([cand], dist, delta)
    ind = min(_independent_rdp_epsilon(cand, dist, delta),
              _independent_profile_epsilon(cand, dist, delta, (bound.profile_detail or {}).get("eps2", 0.0)))
    best = min(auto["rows"], key=lambda x: x["sigma"] / x["batch"])
    ok = (abs(got - ind) <= 2e-3 + 1e-4 * ind and got <= target * (1 + 1e-9) and ind <= target + 2e-3
          and (best["batch"], best["steps"]) == (b, t) and len(auto["rows"]) >= 2)
    return Check("tune: auto (B, T) is charged as the search's bound allows", ok,
                 f"chose B = {b}, T = {t}, σ_trial = {auto['sigma']:.4f} among {len(auto['rows'])} candidates; search "
                 f"ε {got:.4f} (ledger) vs independent {ind:.4f}; target {target:g}",
                 {"epsilon": got, "independent": ind, "batch": b, "steps": t})


def tune_checks(planted: str | None = None) -> list:
    """The search's checks (tens of seconds on a CPU). ``planted``: None or one of :data:`PLANTED`.

    Raises:
        ValueError: an unknown planted bug."""
    if planted is not None and planted not in PLANTED:
        raise ValueError(f"unknown planted tune bug {planted!r}; known: {PLANTED}")
    return [_k_law(planted), _selection_epsilon(planted), _noisy_score(planted), _one_release(planted),
            _method_events(planted), _uncovered_charged(planted), _auto_search(planted), _scope_candidates(planted),
            *release_checks(planted)]  # issue 44: silent trials, the lock, the ledger per search, one score
