"""audit/checks_guard.py (issue 44 item 2): the checks pass as shipped, each planted bug makes the check
it targets fail (and only it), the module is registered in the suite, and the patches are undone."""

from __future__ import annotations

import pytest

from dpft.audit import planted, suite
from dpft.audit.checks_guard import PLANTED, guard_checks, planted_bug

NAMES = {"loop": "guard: a Trainer subclass with its own training loop is refused",
         "trainer": "guard: DPTrainer optimizer updates = ledger training releases",
         "raw": "guard: make_private refuses an update without a DP release (raw optimizer step)",
         "moved": "guard: DPTrainer whose loop writes the weights itself is stopped at the end of train()"}
TARGET = {"trainer_step_skips_release": "trainer", "custom_loop_accepted": "loop", "raw_update_accepted": "raw",
          "weights_moved_unreleased": "moved"}


@pytest.fixture(autouse=True)
def _fast_gc():
    """Trainer.train ends with accelerate's gc.collect(); frozen objects are skipped. Speed only."""
    import gc

    gc.freeze()
    yield
    gc.unfreeze()


def test_registered_in_the_suite_and_the_planted_list():
    assert set(PLANTED) <= set(planted.ALL) and set(PLANTED) == set(TARGET)
    assert ("dpft.audit.checks_guard", "guard_checks", PLANTED) in suite.OPTIONAL_CHECKS
    with pytest.raises(ValueError, match="unknown planted bug"):
        with planted_bug("no_such_bug"):
            pass


@pytest.mark.slow  # imports and builds a tiny BERT and a make_private loop: ~35 s on 2 busy cores
def test_untrained_checks_catch_their_planted_bugs():
    """The two checks that train nothing: pass as shipped, fail with their bug planted."""
    from dpft.audit.checks_guard import _custom_loop_check, _raw_update_check

    for check, name in ((_custom_loop_check, "custom_loop_accepted"), (_raw_update_check, "raw_update_accepted")):
        assert check().passed, check().row()
        with planted_bug(name):
            bad = check()
        assert not bad.passed and bad.name == NAMES[TARGET[name]], bad.row()


@pytest.mark.slow  # four short DPTrainer runs (about a minute on 2 busy cores)
def test_honest_checks_pass():
    checks = guard_checks()
    assert [c.name for c in checks] == list(NAMES.values())
    assert all(c.passed for c in checks), [c.row() for c in checks if not c.passed]
    assert checks[1].stats == {"updates": 3, "releases": 3}


@pytest.mark.slow  # the four checks per planted bug
@pytest.mark.parametrize("name", PLANTED)
def test_each_planted_bug_fails_its_check(name):
    checks = guard_checks(name)
    assert [c.name for c in checks if not c.passed] == [NAMES[TARGET[name]]], [c.row() for c in checks]


def test_planted_patches_are_undone():
    from dpft.integrations.hf import trainer as hf
    from dpft.integrations.hf import checks as hf_checks
    from dpft.step.guard import ReleaseGuard

    saved = (hf.DPTrainer.training_step, hf_checks.loop_overrides, ReleaseGuard._before_step, ReleaseGuard.check_end)
    for name in PLANTED:
        with planted_bug(name):
            pass
    assert (hf.DPTrainer.training_step, hf_checks.loop_overrides, ReleaseGuard._before_step,
            ReleaseGuard.check_end) == saved
