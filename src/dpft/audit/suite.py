"""One audit: the white-box checks and the three canary audits at a given (σ, C, q, δ).

Sizes: ``quick`` (CI: seconds to a minute on one core) or the default (more trials, every
engine); the canary counts set the cap (the largest ε̂ certifiable), reported with every ε̂.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dpft.audit import whitebox as wb
from dpft.audit.blackbox import AuditResult, CanarySetup, multi_step_game, one_run_audit, one_step_game


@dataclass
class AuditReport:
    sigma: float
    c: float
    q: float
    delta: float
    checks: list = field(default_factory=list)
    results: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and all(r.passed for r in self.results)

    def as_dict(self) -> dict:
        return {"sigma": self.sigma, "C": self.c, "q": self.q, "delta": self.delta,
                "verdict": "pass" if self.passed else "FAIL",
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
              styles: tuple = wb.STYLES) -> AuditReport:
    """Run the audit; ``progress`` is a tqdm-like bar (``update(n)``) or None. ``which`` and
    ``styles`` (clip styles of the sensitivity sweep; () skips it) select parts of it."""
    sz = sizes(quick)
    rep = AuditReport(sigma, c, q, delta)
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


def total_units(quick: bool, whitebox: bool = True) -> int:
    """Progress-bar length of :func:`run_audit`."""
    sz = sizes(quick)
    n = len(wb.STYLES) * len(sz["engines"]) * 2 if whitebox else 0
    return n + sz["game_rounds"] + 1 + sz["ms_rounds"]
