"""The audit walks the code ``dpft train`` runs: a :class:`~dpft.run.loop.Trainer` built from
the recipe itself (its model, data, tokenisation, privacy unit, sampler, clip policy, engine,
precision, methods' earlier ledger phases and calibrated σ), and checks through its own step.

* :func:`trainer_plan` — what the run will be accounted as: the privacy unit, N, q, σ, T, C,
  δ and the certified ε of the whole run (the earlier phases of the Trainer's ledger composed
  with T events of the kind the Trainer's step records, dp_accounting PLD).
* :func:`trainer_sensitivity_check` — leave-one-out (leave-one-*user*-out at user level) change
  of the clipped sum the Trainer's mechanism receives, on an adversarial logical batch run
  through :meth:`Trainer.step` itself (length sort, DDP shard, micro-batches of
  ``batch.max_physical_batch_size``, user groups and group clipping, autocast / loss scale):
  ≤ C, the sensitivity the ledger assumes.
* :func:`trainer_noise_check` — the noise the Trainer's mechanism adds to that sum (released
  minus clipped sum): per-coordinate std σC (χ² and KS tests), fresh across steps, and the
  ledger event the step records equals ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` of the
  plan.
* :func:`trainer_sampling_check` — the Trainer's sampler: the inclusion rate of the privacy
  unit (users at user level) equals the plan's q (exact binomial test), at most k rows per
  sampled user.

The audit's Trainer never writes: it runs in a scratch directory, its ledger is a scratch copy,
its optimizer a no-op (SGD at lr 0), and dropout is off (a coupled leave-one-out comparison
needs the same network on both batches).
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
import warnings
from typing import Optional

import numpy as np
import torch
from scipy import stats

from dpft.audit.whitebox import LEVEL, Check
from dpft.accounting.calibrate import calibrate_sigma, epsilon_for_sigma
from dpft.accounting.ledger import PrivacyLedger
from dpft.step.correlated import BandedMFMechanism
from dpft.step.plan import planned_steps
from dpft.step.truncated import TruncatedPoissonSampler

#: Planted bug of this module: the audit's plan computed over rows for a user-level recipe
#: (the calibration ``dpft audit`` used before it walked the Trainer).
ROW_LEVEL_USER_RECIPE = "row_level_user_recipe"
#: Planted bug: user-level group clipping broken (each row its own group: a user of k rows
#: contributes up to kC).
USER_CLIPPING_BROKEN = "user_clipping_broken"
PLANTED = (ROW_LEVEL_USER_RECIPE, USER_CLIPPING_BROKEN)


def build_trainer(recipe, run_dir: Optional[str] = None):
    """The :class:`~dpft.run.loop.Trainer` of ``recipe`` in a scratch directory (nothing of the
    recipe's own output directory is read or written)."""
    from dpft.run.loop import Trainer

    d = run_dir or tempfile.mkdtemp(prefix="dpft-audit-")
    return Trainer(recipe, d, progress=False)


def row_level_plan(trainer) -> dict:
    """PLANTED BUG ``row_level_user_recipe``: the plan computed over the training *rows* whatever
    the privacy unit (N = rows, q = expected batch / rows, σ calibrated for that q) — how
    ``dpft audit`` calibrated before it walked the Trainer."""
    r = trainer.recipe
    n = len(trainer.train_tok)
    b = r.batch.expected_batch_size
    q = b / n
    steps = planned_steps(n, b, r.schedule.steps, r.schedule.epochs)
    p = r.privacy
    sigma = float(p.noise_multiplier) if p.noise_multiplier is not None else calibrate_sigma(
        p.target_epsilon, p.delta, q, steps)
    return {"unit": "example", "n": n, "q": q, "sigma": sigma, "noise_sigma": sigma, "steps": steps,
            "C": float(p.clipping.max_norm), "delta": float(p.delta),
            "epsilon": epsilon_for_sigma(sigma, q, steps, p.delta), "prior_phases": []}


def trainer_plan(trainer) -> dict:
    """The run's accounting as the Trainer will do it: unit, N, q, σ (ledger), noise σ (the
    mechanism's; larger than the ledger's only with adaptive clipping's split), T, C, δ and
    the certified ε of the whole run (earlier phases + T events of its step)."""
    t = trainer
    mech = t.mechanism
    if mech is None:
        raise ValueError("the recipe's run is not private: nothing to audit")
    led = PrivacyLedger(list(t.ledger.entries))
    extra = {}
    events = [mech.event_at(s, t.q) for s in range(t.total_steps)]
    if all(e == events[0] for e in events):  # independent noise: one event T times (composed at once)
        led.record(t.phase, events[0], count=t.total_steps)
    else:  # banded_mf (step/correlated.py): the event depends on the step
        for e in events:
            led.record(t.phase, e)
    if isinstance(mech, BandedMFMechanism):
        extra = {"bands": int(mech.bands), "partition_rate": float(mech.partition_rate)}
    if isinstance(t.sampler, TruncatedPoissonSampler):  # truncated Poisson (step/truncated.py)
        extra = {"max_batch_size": int(t.sampler.truncation[1])}
    return {**extra, "unit": t.privacy_unit["unit"], "n": int(t.n), "q": float(t.q), "sigma": float(mech.accounted_sigma),
            "noise_sigma": float(mech.sigma), "steps": int(t.total_steps), "C": float(t.clip.sensitivity),
            "delta": float(t.recipe.privacy.delta), "epsilon": float(led.epsilon(t.recipe.privacy.delta).epsilon),
            "prior_phases": sorted({e.phase for e in t.ledger.entries}),
            "max_rows_per_user": getattr(t.sampler, "k", None) if t.user_level else None,
            "world_size": int(t.world.world_size)}


class _Capture:
    """Wraps the Trainer's mechanism's ``release`` (an instance attribute, removed on exit):
    records the clipped sum it receives, the noisy sum it returns, the sensitivity and event."""

    def __init__(self, mechanism):
        self.mech, self.calls = mechanism, []

    def __enter__(self):
        orig = type(self.mech).release.__get__(self.mech)

        def release(grad_sum, sensitivity, q, step):
            noisy, event = orig(grad_sum, sensitivity, q, step)
            self.calls.append({"sum": {k: v.detach().double().cpu() for k, v in grad_sum.items()},
                               "noisy": {k: v.detach().double().cpu() for k, v in noisy.items()},
                               "sensitivity": float(sensitivity), "event": event, "step": step})
            return noisy, event

        self.mech.release = release
        return self

    def __exit__(self, *exc):
        del self.mech.release


@contextlib.contextmanager
def audit_mode(trainer):
    """The Trainer made harmless for the audit: scratch ledger, no live-ledger writes, a no-op
    optimizer (the weights never move), dropout off; restored on exit."""
    from dpft.models.load import set_dropout

    t = trainer
    dp = t.dp_step
    saved = (dp.ledger, dp.on_release, dp.spec, [(m, m.p) for m in t.model.modules() if isinstance(m, torch.nn.Dropout)])
    params = list(dp.params.values())
    dp.ledger, dp.on_release = PrivacyLedger(), None
    dp.spec = dp.spec.replace(optimizer=torch.optim.SGD(params, lr=0.0))
    set_dropout(t.model, 0.0)
    mech = dp.spec.mechanism
    banded = mech is not None and mech.stateful
    if banded:  # banded_mf: the audit replays step 0; each replay starts from empty noise buffers
        state = (mech.buffers, mech.next_step)
        orig_add = type(mech).add_noise.__get__(mech)

        def add_noise(grad_sum, step):
            if step == 0:
                mech.buffers, mech.next_step = [], 0
            return orig_add(grad_sum, step)

        mech.add_noise = add_noise
    try:
        with warnings.catch_warnings():  # the no-op optimizer never steps: the scheduler warns
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            yield t
    finally:
        if banded:
            del mech.add_noise
            mech.buffers, mech.next_step = state
        dp.ledger, dp.on_release, dp.spec = saved[0], saved[1], saved[2]
        for m, p in saved[3]:
            m.p = p


def run_batch(trainer, step: int, idx: torch.Tensor) -> dict:
    """Run :meth:`Trainer.step` on the logical batch ``idx`` (row indices) at step ``step``;
    returns what its mechanism received and released (see :class:`_Capture`)."""
    t = trainer
    dp = t.dp_step
    dp.indices = lambda s: idx.clone()  # the step's own code from here on; only the draw is fixed
    try:
        with _Capture(t.mechanism) as cap:
            t.step(step)
    finally:
        del dp.indices
    if len(cap.calls) != 1:
        raise AssertionError(f"the Trainer's step released {len(cap.calls)} times (one expected)")
    return cap.calls[0]


def _adversarial_units(trainer, size: int, seed: int = 0) -> list[torch.Tensor]:
    """Units of an adversarial logical batch, each a tensor of its row indices: at example level
    the longest and the shortest rows and random ones; at user level the users with most rows
    (more than k: the row subset matters), single-row users and random users."""
    t = trainer
    g = torch.Generator().manual_seed(seed)
    if t.user_level:
        s = t.sampler
        order = torch.argsort(s.counts, descending=True, stable=True)
        pick = list(dict.fromkeys(order[: size // 2].tolist() + order[-(size // 4 or 1):].tolist()
                                  + torch.randperm(s.n, generator=g)[:size].tolist()))[:size]
        return [torch.nonzero(s.users == u).flatten()[: s.k] for u in pick]
    lens = t.train_lengths
    order = torch.argsort(lens, descending=True, stable=True)
    pick = list(dict.fromkeys(order[: size // 3].tolist() + order[-(size // 3 or 1):].tolist()
                              + torch.randperm(len(lens), generator=g)[:size].tolist()))[:size]
    return [torch.tensor([i]) for i in pick]


def trainer_sensitivity_check(trainer, plan: dict, batch_units: Optional[int] = None, leave_out: int = 4,
                              step: int = 0, tol: float = 1e-4) -> Check:
    """Leave-one-unit-out change of the clipped sum through :meth:`Trainer.step`: ``max ‖S(B) −
    S(B∖u)‖ ≤ C(1 + tol)`` for ``leave_out`` units ``u`` of an adversarial batch of
    ``batch_units`` units (default: 1.5 micro-batches' worth, so removing a unit moves the
    micro-batch boundaries). The noise of both runs is the same draw (same key and step) and
    is not part of the compared sums."""
    t = trainer
    phys = t.recipe.batch.max_physical_batch_size
    size = batch_units or max(3, phys + phys // 2)
    units = _adversarial_units(t, size)
    full_idx = torch.cat(units)
    full = run_batch(t, step, full_idx)
    g = torch.Generator().manual_seed(1)
    # the longest / most rows first, the shortest last, one from the middle (a boundary mover)
    cand = [0, len(units) - 1, len(units) // 2] + torch.randperm(len(units), generator=g).tolist()
    cand = list(dict.fromkeys(cand))[:max(leave_out, 3)]
    worst, sens = 0.0, full["sensitivity"]
    for u in cand:
        rest = torch.cat([x for j, x in enumerate(units) if j != u])
        part = run_batch(t, step, rest)
        d = math.sqrt(sum(float((full["sum"][k] - part["sum"][k]).pow(2).sum()) for k in full["sum"]))
        worst = max(worst, d)
        sens = max(sens, part["sensitivity"])
    c = plan["C"]
    ok = worst <= c * (1 + tol) and sens <= c * (1 + tol)
    unit = "user" if t.user_level else "example"
    return Check(f"Trainer step: leave-one-{unit}-out sensitivity", ok,
                 f"max change of the clipped sum {worst:.6g} over {len(cand)} {unit}s left out of an adversarial "
                 f"batch of {len(units)} ({len(full_idx)} rows, micro-batches ≤ {phys}) vs C = {c:g}; "
                 f"mechanism sensitivity {sens:.6g}",
                 {"max_change": worst, "C": c, "mechanism_sensitivity": sens, "units": len(units),
                  "rows": int(len(full_idx))})


def trainer_noise_check(trainer, plan: dict, steps: tuple = (0, 1), level: float = LEVEL,
                        ks_points: int = 200_000) -> list[Check]:
    """The noise of the Trainer's mechanism on its own step (an empty Poisson batch, which
    still releases noise): std σC per coordinate, fresh across steps, and the ledger event."""
    import dp_accounting as dpa

    t = trainer
    calls = [run_batch(t, s, torch.zeros(0, dtype=torch.long)) for s in steps]
    std_exp = plan["noise_sigma"] * plan["C"]
    zs = []
    for c in calls:
        z = torch.cat([(c["noisy"][k] - c["sum"][k]).flatten() for k in sorted(c["sum"])])
        zs.append((z / std_exp).numpy())
    coeffs = getattr(t.mechanism, "coeffs", None)
    if coeffs is not None:  # banded_mf: the released noises are C⁻¹Z; C·Y is the iid σC·Z tested below
        assert list(steps) == list(range(len(steps))), "banded noise check needs steps 0, 1, …"
        zs = [sum(coeffs[j] * zs[i - j] for j in range(min(i + 1, len(coeffs)))) for i in range(len(zs))]
    z = zs[0]
    ss, df = float((z ** 2).sum()), z.size
    p_var = 2 * min(stats.chi2.cdf(ss, df), stats.chi2.sf(ss, df))
    sub = z[np.random.default_rng(0).permutation(df)[:ks_points]] if df > ks_points else z
    p_ks = float(stats.kstest(sub, "norm").pvalue)
    std = math.sqrt(ss / df) * std_exp
    out = [Check("Trainer step: noise std σC", p_var > level and p_ks > level,
                 f"empirical std {std:.5g} over {df} coordinates vs σC = {plan['noise_sigma']:.4g}·{plan['C']:g} = "
                 f"{std_exp:.5g} (χ² p = {p_var:.3g}, KS p = {p_ks:.3g})",
                 {"std": std, "expected": std_exp, "p_chi2": p_var, "p_ks": p_ks, "coordinates": df})]
    if len(zs) > 1:
        r = float(np.corrcoef(zs[0], zs[1])[0, 1])
        p = float(2 * stats.norm.sf(abs(r) * math.sqrt(df)))
        out.append(Check("Trainer step: noise fresh across steps", p > level,
                         f"correlation of steps {steps[0]} and {steps[1]}'s noise {r:.3g} (p = {p:.3g})",
                         {"corr": r, "p": p}))
    want = dpa.PoissonSampledDpEvent(plan["q"], dpa.GaussianDpEvent(plan["sigma"]))
    if "max_batch_size" in plan:  # truncated Poisson
        want = dpa.TruncatedSubsampledGaussianDpEvent(plan["n"], plan["q"], plan["max_batch_size"], plan["sigma"])
    if "bands" in plan:  # banded_mf, step 0: a participation block starts
        want = dpa.PoissonSampledDpEvent(plan["partition_rate"], dpa.GaussianDpEvent(plan["sigma"]))
    got = calls[0]["event"]
    out.append(Check("Trainer step: ledger event = plan", got == want,
                     f"the step records {got} ; the audit's plan (ε = {plan['epsilon']:.4g}) assumes {want}"))
    return out


def trainer_sampling_check(trainer, plan: dict, steps: int = 100, level: float = LEVEL) -> list[Check]:
    """Inclusion rate of the privacy unit in the Trainer's own draws (``dp_step.indices``):
    users at user level (and at most k rows each), rows otherwise."""
    t = trainer
    n_units = t.sampler.n
    hits, over_k = 0, 0
    bands = int(plan.get("bands", 1))
    steps = bands * math.ceil(steps / bands)  # cyclic Poisson: whole cycles, every partition equally often
    bound = plan.get("max_batch_size")
    over_bound = 0
    for s in range(steps):
        idx = t.dp_step.indices(s)
        if t.user_level:
            users, counts = torch.unique(t.sampler.users[idx], return_counts=True)
            hits += len(users)
            over_k += int((counts > t.sampler.k).sum())
        else:
            hits += len(torch.unique(idx))
            over_bound += int(bound is not None and len(idx) > bound)
    q = plan["q"]
    trials = n_units * steps
    # truncated Poisson can only lower the rate: test "not above q" (one-sided), and the bound
    alt = "greater" if bound is not None else "two-sided"
    p = float(stats.binomtest(hits, trials, q, alternative=alt).pvalue) if 0 < q < 1 else float(hits == trials * q)
    if over_bound:
        p = 0.0
    unit = "user" if t.user_level else "example"
    out = [Check(f"Trainer step: {unit} sampling rate q", p > level and n_units == plan["n"],
                 f"{unit} inclusion rate {hits / trials:.4g} over {steps} steps of the Trainer's sampler (N = "
                 f"{n_units} {unit}s) vs the plan's q = {q:.4g}, N = {plan['n']} (binomial p = {p:.3g})",
                 {"rate": hits / trials, "q": q, "p": p, "n_sampler": n_units, "n_plan": plan["n"]})]
    if t.user_level:
        out.append(Check("Trainer step: at most k rows per sampled user", over_k == 0,
                         f"{over_k} sampled users had more than k = {t.sampler.k} rows in a logical batch"))
    return out


def trainer_checks(trainer, plan: dict, quick: bool = True, progress=None) -> list[Check]:
    """Every check of this module through ``trainer``'s own step (in :func:`audit_mode`). (That ``dpft train``
    reaches the session unchanged is audit/ways_in_session.py's ``train_check``, one check for every way in.)"""
    out = []
    with audit_mode(trainer):
        out.append(trainer_sensitivity_check(trainer, plan, leave_out=3 if quick else 8))
        if progress is not None:
            progress.update(1)
        out += trainer_noise_check(trainer, plan)
        out += trainer_sampling_check(trainer, plan, steps=100 if quick else 400)
        if progress is not None:
            progress.update(1)
    return out
