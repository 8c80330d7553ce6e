"""audit/ways_in.py: the checks every way in passes, written once over the ways in's adapters (issue 46
item 4) — each way in reaches the private session unchanged, and the session's planted steps rule is caught."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dpft.audit import planted, suite, ways_in  # noqa: E402
from dpft.step.plan import planned_steps  # noqa: E402


def test_every_way_in_reaches_the_session_unchanged():
    checks = ways_in.session_check(ways_in.SESSION_WAYS)
    # each way in's plan is step/plan.py's for the settings (N, q, T, σ): the same plan for every way in
    assert [c.name for c in checks] == ["session: make_private reaches the session unchanged",
                                        "session: DPTrainer reaches the session unchanged"]
    assert all(c.passed for c in checks), [c.row() for c in checks if not c.passed]
    # issue 46's case: epochs 1.1, N 100, B 10 is 11 steps for every way in
    assert planned_steps(100, 10, None, 1.1) == 11 and "T = 11" in checks[0].message


def test_a_session_with_its_own_steps_rule_is_caught():
    assert "session_steps_rule" in planted.ALL
    assert ("dpft.audit.ways_in", "api_checks", ways_in.PLANTED) in suite.OPTIONAL_CHECKS
    with ways_in.planted_bug("session_steps_rule"):
        checks = ways_in.session_check(ways_in.SESSION_WAYS)
    failed = {c.name: c.message for c in checks if not c.passed}
    assert "session: make_private reaches the session unchanged" in failed
    assert "T = 12, σ" in failed["session: make_private reaches the session unchanged"]
    assert "T = 11, σ" in failed["session: make_private reaches the session unchanged"]  # step/plan.py's
    # DPTrainer hands the session its epochs too (the session counts T for every way in), so it is caught as well
    assert "T = 12, σ" in failed["session: DPTrainer reaches the session unchanged"]
    from dpft.session import core

    assert core.planned_steps is planned_steps  # undone afterwards


def test_one_property_many_ways_in():
    """leave_one_out is one function: over a toy way in whose release moves by exactly C per unit it passes, and
    one whose unit 0 counts twice fails naming the unit."""
    import torch

    def step(keep, sigma, c, double=False):
        s = sum((torch.tensor([c, 0.0]) * (2 if double and u == 0 else 1) for u in keep), torch.zeros(2))
        return s, None

    ok = ways_in.leave_one_out(ways_in.WayIn("toy", [0, 1, 2], step, unit="user"), "t")
    bad = ways_in.leave_one_out(ways_in.WayIn("toy", [0, 1, 2], lambda k, s, c: step(k, s, c, True), unit="user"),
                                "t")
    assert ok.name == "t: toy leave-one-user-out" and ok.passed
    assert not bad.passed and "one user moves the release by more than C" in bad.message


def test_a_way_in_whose_package_is_missing_is_a_note_not_a_pass(monkeypatch):
    pytest.importorskip("torch.distributed.fsdp")
    from dpft.audit import ways_in_fsdp

    way = ways_in_fsdp.FSDPWay("NoSuchTrainer", build=lambda tmp, seen: None, planted=("hf_fsdp_args_kept",),
                               needs="dpft_no_such_package")
    monkeypatch.setattr(ways_in_fsdp, "WAYS", (way,))
    got = ways_in_fsdp.hf_fsdp_checks()
    assert list(got) == [] and len(got.notes) == 1
    assert "NoSuchTrainer needs dpft_no_such_package" in got.notes[0] and "not passed" in got.notes[0]
    # the suite passes the note on to the report
    monkeypatch.setattr(suite, "OPTIONAL_CHECKS", (("dpft.audit.ways_in_fsdp", "hf_fsdp_checks", ()),))
    checks, notes = suite.optional_checks()
    assert checks == [] and notes == got.notes
    with pytest.raises(ValueError, match="needs dpft_no_such_package"):  # nothing to plant: refused
        ways_in_fsdp.hf_fsdp_checks(planted="hf_fsdp_args_kept")
