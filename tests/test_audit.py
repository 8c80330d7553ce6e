"""Issue 14: the auditor catches every planted bug and passes the honest step.

The planted bugs are those of ``dpft.audit.planted`` (``dpft audit --plant NAME``, hidden),
applied here with pytest's monkeypatch."""

from __future__ import annotations

import math

import pytest

from dpft.audit import planted, stats
from dpft.audit.blackbox import CanarySetup, one_step_game
from dpft.audit.suite import run_audit

SIGMA = 2.0  # one full-batch step: certified ε ≈ 1.99 at δ = 1e-5
KNOWN_SEED = planted.KNOWN_SEED


def plant(bug: str, monkeypatch) -> dict:
    """Apply a planted bug of ``dpft.audit.planted`` (undone with ``monkeypatch``); returns extra
    audit arguments (the seed the auditor is given)."""
    return planted.apply(bug, monkeypatch.setattr)


BUGS = list(planted.MECHANISM_PLANTED)


# --------------------------------------------------------------------------- statistics


def test_clopper_pearson_and_caps():
    assert stats.clopper_pearson_upper(0, 1000, 0.025) == pytest.approx(1 - 0.025 ** (1 / 1000), rel=1e-6)
    assert stats.eps_from_error_rates(500, 1000, 500, 1000, 1e-5) == 0.0
    cap = stats.eps_cap_game(5000, 5000, 1e-5)
    assert 6.5 < cap < 8
    # Steinke et al.: all r guesses right → ε̂ with p_ε^r = α; more guesses, larger cap
    e = stats.one_run_epsilon(1000, 100, 100, 0.0, 0.05)
    p = 0.05 ** (1 / 100)
    assert e == pytest.approx(math.log(p / (1 - p)), rel=1e-4)
    assert stats.one_run_epsilon(1000, 400, 400, 0.0, 0.05) > e
    assert stats.one_run_epsilon(1000, 100, 50, 0.0, 0.05) == 0.0
    assert stats.one_run_epsilon(1000, 100, 100, 1e-5, 0.05) <= e


# --------------------------------------------------------------------------- honest and bugs


@pytest.mark.slow  # the whole quick audit: ~45 s CPU
def test_honest_step_passes():
    rep = run_audit(SIGMA, q=0.05, quick=True)
    failed = [c.row() for c in rep.checks if not c.passed] + [r.row() for r in rep.results if not r.passed]
    assert rep.passed, failed
    for r in rep.results:
        assert r.cap > r.certified_eps  # the trial count could have shown a violation


#: The parts of the audit each bug must fail (the full audit runs them all, and fails if any
#: fails; running only these keeps the suite fast). (clip styles swept, canary audits)
PARTS = {
    "noise/4": ((), ("one-step game", "one-run audit")),
    "clipping off": (("flat",), ("one-step game", "one-run audit")),
    "per-layer without 1/sqrt(G)": (("per_layer",), ()),
    "clip at 2C": (("flat",), ()),
    "same noise every step": ((), ()),
    "no subsampling": ((), ("multi-step game",)),
    "known seed": ((), ("one-step game", "one-run audit", "multi-step game")),
}


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_caught(bug, monkeypatch):
    extra = plant(bug, monkeypatch)
    styles, which = PARTS[bug]
    # the optional modules' checks (other ways in, other planted bugs) run in test_honest_step_passes
    rep = run_audit(SIGMA, q=0.05, quick=True, style="per_layer" if "per-layer" in bug else "flat",
                    styles=styles, which=which, optional=False, **extra)
    assert not rep.passed, bug
    by_name = {r.name: r for r in rep.results}
    if bug in ("noise/4", "clipping off", "known seed"):
        assert not by_name["one-step game"].passed and not by_name["one-run audit"].passed
    if bug in ("no subsampling", "known seed"):
        assert not by_name["multi-step game"].passed
    if bug in ("per-layer without 1/sqrt(G)", "clip at 2C", "clipping off"):
        assert any(not c.passed for c in rep.checks if c.name.startswith("sensitivity"))
    if bug == "same noise every step":
        assert any(not c.passed for c in rep.checks if c.name == "noise fresh across steps")


def test_secure_mode_auditor_with_a_guessed_seed_learns_nothing():
    """Honest secret randomness: an auditor who subtracts the noise of a guessed seed gains nothing."""
    r = one_step_game(CanarySetup(sigma=SIGMA, known_seed=KNOWN_SEED, slots=1024), rounds=4)
    assert r.passed


def test_cli_registers_audit():
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    res = CliRunner().invoke(app, ["audit", "--help"])
    assert res.exit_code == 0 and "--quick" in res.output


# --------------------------------------------------------------------------- optional check modules


def test_optional_check_modules_are_routed_or_skipped_with_a_note(monkeypatch):
    """checks_randomness / ways_in join the suite when installed (the planted name routed to
    the module that plants it); when absent they are skipped with a note, never a passing row."""
    import sys
    import types

    from dpft.audit import suite
    from dpft.audit.whitebox import Check

    for mod, _, _ in suite.OPTIONAL_CHECKS:
        monkeypatch.setitem(sys.modules, mod, None)  # None in sys.modules: ImportError
    checks, notes = suite.optional_checks(None)
    assert checks == [] and len(notes) == len(suite.OPTIONAL_CHECKS) and all("skipped, not passed" in n for n in notes)
    with pytest.raises(ValueError, match="seed32.*lacks"):
        suite.optional_checks("seed32")
    seen = []
    fake = types.ModuleType("dpft.audit.checks_randomness")
    fake.randomness_checks = lambda planted=None: seen.append(planted) or [Check("rand", planted is None, "x")]
    monkeypatch.setitem(sys.modules, "dpft.audit.checks_randomness", fake)
    rep = run_audit(SIGMA, q=0.05, quick=True, styles=(), which=(), planted="seed32")
    assert seen == ["seed32"] and not rep.passed and rep.as_dict()["planted"] == "seed32"
    assert [c.name for c in rep.checks if not c.passed] == ["rand"] and len(rep.notes) == len(suite.OPTIONAL_CHECKS) - 1
    checks, _ = suite.optional_checks(None)
    assert seen[-1] is None and [c.name for c in checks] == ["rand"]
    assert set(planted.RANDOMNESS_PLANTED + planted.API_PLANTED + ("row_level_user_recipe",)) <= set(planted.ALL)
