"""EWPBA (EW-FT Algorithm 1) and the uniform DP-Forward schedule, against dp_accounting."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpft.accounting.ewpba import (ScheduleError, ewpba_schedule, schedule_epsilon, two_stage_list,
                                   uniform_schedule)
from dpft.accounting.ledger import PrivacyLedger

Q, STEPS, DELTA = 0.05, 10, 1e-5


@pytest.fixture(scope="module")
def sched6():
    return ewpba_schedule(4.0, DELTA, Q, STEPS, 6, step_distance=2.0)


def test_ewpba_meets_target_within_1e4(sched6):
    assert sched6.epsilon <= 4.0
    assert 4.0 - sched6.epsilon <= 1e-4
    # the reported ε is recomputed from the list, not copied from the search
    assert schedule_epsilon(sched6.sigmas, Q, STEPS, DELTA) == pytest.approx(sched6.epsilon, abs=1e-12)


def test_sigma_beg_is_uniform_at_eps_minus_one(sched6):
    e = schedule_epsilon([sched6.sigma_beg] * 6, Q, STEPS, DELTA)
    assert 3.0 - 1e-4 <= e <= 3.0


def test_ewpba_decreasing_by_two_stage_steps(sched6):
    s = sched6.sigmas
    diffs = [s[i] - s[i + 1] for i in range(5)]
    assert all(d > 0 for d in diffs)
    # E = 6: epoch_num = 1 is the only one with epoch_num < E/2 − 1 = 2, so in training order the
    # first four steps are S·Add_num and the last one Add_num (Eq. 10, reversed).
    add = diffs[-1]
    for d in diffs[:-1]:
        assert d == pytest.approx(2.0 * add, rel=1e-9)
    # Eq. (9): Add_num = 4(σ_beg − σ_fir)/((E−1)(S+1)), σ_fir = the last epoch's σ
    assert add == pytest.approx(4 * (sched6.sigma_beg - s[-1]) / (5 * 3), rel=1e-9)


def test_ledger_equals_dp_accounting(sched6):
    ledger = PrivacyLedger()
    for step in range(6 * STEPS):
        ledger.record("ldp-forward", sched6.step_event(step))
    assert len(ledger.entries) == 6  # one grouped entry per epoch's σ
    acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(sg)), STEPS)
        for sg in sched6.sigmas]))
    assert ledger.epsilon(DELTA).epsilon == pytest.approx(acc.get_epsilon(DELTA), abs=1e-9)
    assert ledger.epsilon(DELTA).epsilon == pytest.approx(sched6.epsilon, abs=1e-9)


def test_uniform_is_one_sigma_and_meets_target():
    u = uniform_schedule(4.0, DELTA, Q, STEPS, 6)
    assert len(set(u.sigmas)) == 1 and len(u.sigmas) == 6
    assert 0 <= 4.0 - u.epsilon <= 1e-4


def test_two_stage_list_small_e():
    # E = 3: the stage-2 test epoch_num < 0.5 never holds → both steps are S·Add_num
    lst = two_stage_list(1.0, 2.0, 3, 2.0)
    add = 4 * (2.0 - 1.0) / (2 * 3)
    assert lst == pytest.approx([1.0, 1.0 + 2 * add, 1.0 + 4 * add])
    assert two_stage_list(1.0, 2.0, 1, 2.0) == [1.0]


def test_errors_name_the_fix():
    with pytest.raises(ScheduleError, match="ε > 1"):
        ewpba_schedule(0.8, DELTA, Q, STEPS, 3)
    with pytest.raises(ScheduleError, match="step distance"):
        ewpba_schedule(4.0, DELTA, Q, STEPS, 3, step_distance=0)
    with pytest.raises(ScheduleError, match="cannot be met"):
        uniform_schedule(1e-3, DELTA, 1.0, 1000, 3)
    assert math.isinf(schedule_epsilon([0.01], Q, STEPS, DELTA))
