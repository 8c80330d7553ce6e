"""audit/ways_in_trl.py: DPDPOTrainer at user level in ``dpft audit`` (issue 38) — the checks pass as
shipped, each planted bug makes the check it targets fail, and the module is registered in the suite."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("dp_accounting")

from dpft.audit import planted, suite  # noqa: E402
from dpft.audit.ways_in_trl import DPO_USER_PLANTED as PLANTED, dpo_user_checks, planted_bug  # noqa: E402

NAMES = {"louo": "trl user level: DPDPOTrainer leave-one-user-out",
         "ledger": "trl user level: DPDPOTrainer's ledger counts users"}


@pytest.fixture(autouse=True)
def _fast_gc():
    """Trainer.train ends with accelerate's gc.collect(), which scans the whole heap; frozen objects are
    skipped. Speed only."""
    import gc

    gc.freeze()
    yield
    gc.unfreeze()


def test_registered_in_the_suite_and_the_planted_list():
    assert set(PLANTED) <= set(planted.ALL)
    assert ("dpft.audit.ways_in_trl", "dpo_user_checks", PLANTED) in suite.OPTIONAL_CHECKS
    with pytest.raises(ValueError, match="unknown planted bug"):
        with planted_bug("no_such_bug"):
            pass


def test_honest_checks_pass_with_a_user_clipped_at_c():
    """As shipped: both checks pass; removing the two-pair user moves the release by C (its summed
    gradient is far above C), never more."""
    checks = dpo_user_checks()
    assert [c.name for c in checks] == [NAMES["louo"], NAMES["ledger"]]
    assert all(c.passed for c in checks), [c.row() for c in checks if not c.passed]
    louo, ledger = checks
    assert louo.stats["user_grad_over_C"] > 2 and louo.stats["loo_over_C"] == pytest.approx(1.0, rel=1e-3)
    assert ledger.stats["n"] == 3 and ledger.stats["q"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("name,target", [("dpo_user_pair_groups", "louo"), ("dpo_user_ledger_counts_pairs", "ledger")])
def test_each_planted_bug_fails_its_check(name, target):
    checks = dpo_user_checks(name)
    assert [c.name for c in checks if not c.passed] == [NAMES[target]], [c.row() for c in checks]
    if name == "dpo_user_pair_groups":  # each pair clipped to C alone: a two-pair user moves the release past C
        assert checks[0].stats["loo_over_C"] > 1.2
    else:  # N over the 5 pairs: q = 2/5 recorded for a sampler over 3 users
        assert checks[0].stats["q"] == pytest.approx(2 / 5)


def test_planted_patches_are_undone():
    from dpft.session import core as session_core  # the one plan call of every way in (dpft/session/core.py)
    from dpft.step.sample import UserPoissonSampler

    groups, plan = UserPoissonSampler.groups, session_core.build_privacy_plan
    for name in PLANTED:
        with planted_bug(name):
            pass
    assert UserPoissonSampler.groups is groups and session_core.build_privacy_plan is plan
