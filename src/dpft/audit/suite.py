"""One audit: the white-box checks and the three canary audits at a given (σ, C, q, δ)
(:func:`run_audit`), and the audit of a recipe (:func:`audit_recipe`: the Trainer ``dpft
train`` would build, its plan, the checks through its own step, then :func:`run_audit` at the
plan's σ, C, q).

Checks written in other modules join the suite when they are installed
(:data:`OPTIONAL_CHECKS`: ``checks_randomness.randomness_checks``, ``ways_in.api_checks``: the checks every
way in passes, over its adapters);
a missing one is skipped with a note in the report, never counted as passed.

Sizes: ``quick`` (CI: seconds to a minute on one core) or the default (more trials, every
engine); the canary counts set the cap (the largest ε̂ certifiable), reported with every ε̂.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Optional

from dpft.audit import planted as pl, trainer_walk as tw, whitebox as wb
from dpft.audit.planted import OPTIONAL_CHECKS  # noqa: F401 - the one table, with the planted names
from dpft.audit.ways_in_session import planted_session, session_plans, train_check
from dpft.audit.blackbox import CanarySetup, multi_step_game, one_run_audit, one_step_game
from dpft.privacy.randomness import Randomness


@dataclass
class AuditReport:
    sigma: float
    c: float
    q: float
    delta: float
    checks: list = field(default_factory=list)
    results: list = field(default_factory=list)
    #: parts of the suite that did not run (a check module not installed), one line each
    notes: list = field(default_factory=list)
    #: the planted bug of a self-test run (None: a real audit)
    planted: Optional[str] = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and all(r.passed for r in self.results)

    def as_dict(self) -> dict:
        return {"sigma": self.sigma, "C": self.c, "q": self.q, "delta": self.delta,
                "verdict": "pass" if self.passed else "FAIL", "planted": self.planted, "notes": list(self.notes),
                "whitebox": [c.row() for c in self.checks], "canary": [r.row() for r in self.results]}


def sizes(quick: bool) -> dict:
    if quick:
        return dict(slots=2048, game_rounds=8, ms_rounds=2, engines=("bookkeeping:auto",), noise_draws=100,
                    sampling_steps=100)
    return dict(slots=4096, game_rounds=24, ms_rounds=4, engines=wb.ENGINES, noise_draws=400, sampling_steps=400)


def multi_step_plan(sigma: float, q: float) -> tuple[float, int]:
    """(q, T) of the multi-step game: q clamped to [0.01, 0.25]; T = 16σ² (a missing
    subsampling then shifts the summed score by ≥ 4 noise std), between 16 and 400."""
    qa = min(max(q, 0.01), 0.25)
    return qa, int(min(400, max(16, math.ceil(16 * sigma ** 2))))


def run_audit(sigma: float, c: float = 1.0, q: float = 0.01, delta: float = 1e-5, style: str = "flat",
              family: str = "bert", quick: bool = True, known_seed: Optional[int] = None,
              rng_factory=None, hardened: bool = True, whitebox: bool = True, progress=None,
              which: tuple = ("one-step game", "one-run audit", "multi-step game"),
              styles: tuple = wb.STYLES, planted: Optional[str] = None, optional: bool = True) -> AuditReport:
    """Run the audit; ``progress`` is a tqdm-like bar (``update(n)``) or None. ``which`` and
    ``styles`` (clip styles of the sensitivity sweep; () skips it) select parts of it.
    ``planted`` names the planted bug of a self-test (routed to the check module that plants
    it; the caller applies the patches of ``audit/planted.py``); ``optional`` runs the
    installed :data:`OPTIONAL_CHECKS`."""
    sz = sizes(quick)
    rep = AuditReport(sigma, c, q, delta, planted=planted)
    if optional:
        checks, notes = optional_checks(planted)
        rep.checks += checks
        rep.notes += notes
    if whitebox:
        if styles:
            rep.checks += wb.all_sensitivity_checks(c, family, styles=styles, engines=sz["engines"],
                                                    progress=progress)
        rep.checks += wb.noise_check(max(sigma, 1e-3), c, draws=sz["noise_draws"], hardened=hardened)
        rep.checks += wb.sampling_check(q=min(max(q, 0.01), 0.5), steps=sz["sampling_steps"])
    kw = dict(sigma=sigma, c=c, delta=delta, style=style if style != "adaptive" else "flat",
              slots=sz["slots"], hardened=hardened, known_seed=known_seed)
    if rng_factory is not None:
        kw["rng_factory"] = rng_factory
    s = CanarySetup(**kw)
    if "one-step game" in which:
        rep.results.append(one_step_game(s, sz["game_rounds"], progress))
    if "one-run audit" in which:
        rep.results.append(one_run_audit(s, progress=progress))
    if "multi-step game" in which:
        qa, t = multi_step_plan(sigma, q)
        rep.results.append(multi_step_game(s, qa, t, sz["ms_rounds"], progress))
    return rep


def optional_checks(planted: Optional[str] = None) -> tuple[list, list[str]]:
    """Run the installed :data:`OPTIONAL_CHECKS` (``planted`` passed to the module that plants
    it). Returns ``(checks, notes)``: a module that is not installed adds a note, no check.

    Raises:
        ValueError: ``planted`` belongs to a module that is not installed (nothing to plant)."""
    checks, notes = [], []
    for mod, fn, names in OPTIONAL_CHECKS:
        try:
            f = getattr(importlib.import_module(mod), fn)
        except ImportError:
            if planted in names:
                raise ValueError(f"planted bug {planted!r} is planted by {mod}, which this install lacks") from None
            notes.append(f"{mod}.{fn} is not in this install: its checks did not run (skipped, not passed)")
            continue
        got = f(planted=planted if planted in names else None)
        checks += list(got)
        notes += getattr(got, "notes", [])  # ways in skipped inside a module (a package they need is absent)
    return checks, notes


def audit_recipe(recipe, quick: bool = True, planted: Optional[str] = None, progress=None,
                 run_dir: Optional[str] = None) -> tuple[dict, AuditReport]:
    """Audit ``recipe`` (a :class:`~dpft.config.recipe.Recipe`) through the code ``dpft train`` runs.

    Builds the recipe's :class:`~dpft.run.loop.Trainer` (its data, model, privacy unit, sampler,
    clip policy, engine, precision, earlier ledger phases, calibrated σ), takes the plan (unit,
    N, q, σ, T, C, δ, ε of the run) from it, checks through the Trainer's own step
    (``audit/trainer_walk.py``), then runs :func:`run_audit` at the plan's σ, C, q (white-box
    checks of every clip style and engine on tiny models, the canary audits, the optional
    checks). ``planted``: a name of ``audit/planted.py`` (a self-test: the audit must FAIL).

    Returns ``(calibration dict, AuditReport)``. Raises ``ValueError`` for a non-private recipe.
    """
    r = recipe
    if not r.privacy.enabled:
        raise ValueError("the recipe is not private (privacy.enabled: false); nothing to audit")
    name = str(r.model.name).lower()
    family = "roberta" if "roberta" in name else "gpt2" if ("gpt" in name or r.task.name == "text") else "bert"
    p = r.privacy
    with pl.plant(planted) as extra:
        with session_plans() as seen, planted_session(planted):  # the session's steps rule: dpft train's row too
            trainer = tw.build_trainer(r, run_dir)
        plan = tw.row_level_plan(trainer) if planted == tw.ROW_LEVEL_USER_RECIPE else tw.trainer_plan(trainer)
        cal = {**plan, "style": p.clipping.style, "family": family, "reproducible": bool(p.reproducible),
               "seed": int(r.seed), "hardened": bool(p.hardened_noise)}
        walk = tw.trainer_checks(trainer, plan, quick=quick, progress=progress) + train_check(trainer, plan, seen)
        known = extra.get("known_seed", cal["seed"] if cal["reproducible"] else None)
        rng_factory = None
        if cal["reproducible"]:
            rng_factory = lambda: Randomness(known)  # noqa: E731 - the run's reproducible randomness
        rep = run_audit(plan["sigma"], plan["C"], plan["q"], plan["delta"], style=cal["style"], family=family,
                        quick=quick, known_seed=known, rng_factory=rng_factory, hardened=cal["hardened"],
                        progress=progress, planted=planted)
    rep.checks = walk + rep.checks
    return cal, rep


def total_units(quick: bool, whitebox: bool = True) -> int:
    """Progress-bar length of :func:`run_audit`."""
    sz = sizes(quick)
    n = len(wb.STYLES) * len(sz["engines"]) * 2 if whitebox else 0
    return n + sz["game_rounds"] + 1 + sz["ms_rounds"] + 2  # + 2: the Trainer walk
