"""Issue 14: the auditor catches every planted bug and passes the honest step.

The planted bugs are monkeypatches of this test file (never a flag of the product)."""

from __future__ import annotations

import math

import pytest
import torch

from dpft.audit import stats
from dpft.audit.blackbox import CanarySetup, multi_step_game, one_run_audit, one_step_game
from dpft.audit.suite import run_audit
from dpft.privacy.randomness import Randomness
from dpft.step import clip as clipmod
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler

SIGMA = 2.0  # one full-batch step: certified ε ≈ 1.99 at δ = 1e-5
KNOWN_SEED = 1234


def _clip_2c(cls, monkeypatch):
    orig = cls.scales

    def scales(self, sq):
        c = self.max_norm
        self.max_norm = 2 * c
        try:
            return orig(self, sq)
        finally:
            self.max_norm = c

    monkeypatch.setattr(cls, "scales", scales)


def plant(bug: str, monkeypatch) -> dict:
    """Apply a planted bug; returns extra audit arguments (the seed the auditor is given)."""
    if bug == "noise/4":
        monkeypatch.setattr(GaussianMechanism, "std", property(lambda self: self.sigma * self.sensitivity / 4))
    elif bug == "clipping off":
        for cls in (clipmod.FlatClip, clipmod.PerLayerClip, clipmod.AutoClip, clipmod.HeadBodyClip):
            monkeypatch.setattr(cls, "scales", lambda self, sq: torch.ones_like(sq))
    elif bug == "per-layer without 1/sqrt(G)":
        monkeypatch.setattr(clipmod.PerLayerClip, "scales",
                            lambda self, sq: (self.max_norm / (sq.clamp_min(0).sqrt() + clipmod.EPS)).clamp(max=1.0))
    elif bug == "clip at 2C":
        for cls in (clipmod.FlatClip, clipmod.PerLayerClip, clipmod.AutoClip, clipmod.HeadBodyClip):
            _clip_2c(cls, monkeypatch)
    elif bug == "same noise every step":
        orig = GaussianMechanism.add_noise
        monkeypatch.setattr(GaussianMechanism, "add_noise", lambda self, s, step: orig(self, s, 0))
    elif bug == "no subsampling":
        orig = PoissonSampler.draw
        monkeypatch.setattr(PoissonSampler, "draw", lambda self, step, q: orig(self, step, 1.0))
    elif bug == "known seed":
        orig = Randomness.__init__

        def init(self, seed=None):
            orig(self, KNOWN_SEED if seed is None else seed)
            self.reproducible = seed is not None

        monkeypatch.setattr(Randomness, "__init__", init)
        return {"known_seed": KNOWN_SEED}
    elif bug != "honest":
        raise ValueError(bug)
    return {}


BUGS = ["noise/4", "clipping off", "per-layer without 1/sqrt(G)", "clip at 2C", "same noise every step",
        "no subsampling", "known seed"]


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
    rep = run_audit(SIGMA, q=0.05, quick=True, style="per_layer" if "per-layer" in bug else "flat",
                    styles=styles, which=which, **extra)
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

    from dpft.cli import app

    res = CliRunner().invoke(app, ["audit", "--help"])
    assert res.exit_code == 0 and "--quick" in res.output
