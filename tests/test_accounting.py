"""The ledger's ε equals dp_accounting called directly; calibration round-trips."""

import json

import dp_accounting as dpa
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from typer.testing import CliRunner

from dpft.accounting.calibrate import CalibrationError, calibrate_sigma, check_delta, epsilon_for_sigma
from dpft.accounting.ledger import NotCertifiedError, PrivacyLedger, format_epsilon
from dpft.cli.commands import app


def direct(event, delta):
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(event)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(event)
    return pld.get_epsilon(delta), rdp.get_epsilon(delta)


def test_ledger_matches_dp_accounting_and_groups_steps():
    led = PrivacyLedger()
    ev = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0))
    for _ in range(1000):
        led.record("train", ev)
    assert len(led.entries) == 1 and led.entries[0].count == 1000
    rep = led.epsilon(1e-5)
    pld, rdp = direct(dpa.SelfComposedDpEvent(ev, 1000), 1e-5)
    assert rep.epsilon == pytest.approx(pld, rel=1e-12)
    assert rep.epsilon_rdp == pytest.approx(rdp, rel=1e-12)
    # the reference values
    assert f"{rep.epsilon:.4g}" == "1.828" and f"{rep.epsilon_rdp:.4g}" == "2.101"


def test_ledger_composes_phases_and_round_trips_json():
    led = PrivacyLedger()
    led.record("synthetic", dpa.GaussianDpEvent(5.0))
    led.record("train", dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(0.9)), count=300)
    led.record("train", dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.1)), count=200)
    composed = dpa.ComposedDpEvent([e.composed() for e in led.entries])
    assert led.epsilon(1e-6).epsilon == pytest.approx(direct(composed, 1e-6)[0], rel=1e-12)
    back = PrivacyLedger.from_json(json.loads(json.dumps(led.to_json())))
    assert back.epsilon(1e-6).epsilon == led.epsilon(1e-6).epsilon
    assert [e.count for e in back.entries] == [1, 300, 200]


def test_not_certified_ledger_refuses_epsilon():
    led = PrivacyLedger()
    led.record("train", dpa.GaussianDpEvent(1.0))
    led.mark_not_certified("clip norm from raw gradient norms")
    with pytest.raises(NotCertifiedError):
        led.epsilon(1e-5)
    assert "NOT CERTIFIED" in format_epsilon(led, 1e-5)


@pytest.mark.parametrize("target,q,steps", [(1.0, 0.01, 500), (8.0, 0.004, 300), (3.0, 0.05, 100)])
def test_calibration_round_trips(target, q, steps):
    sigma = calibrate_sigma(target, 1e-5, q, steps)
    eps = epsilon_for_sigma(sigma, q, steps, 1e-5)
    assert eps <= target  # never in our favour
    assert eps >= target * 0.995  # and not wastefully conservative
    assert epsilon_for_sigma(sigma * 0.99, q, steps, 1e-5) > eps


def test_calibration_with_prior_phase_spends_less():
    prior = [dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.5)), 200)]
    s0 = calibrate_sigma(4.0, 1e-5, 0.01, 500)
    s1 = calibrate_sigma(4.0, 1e-5, 0.01, 500, prior=prior)
    assert s1 > s0
    assert epsilon_for_sigma(s1, 0.01, 500, 1e-5, prior) <= 4.0


def test_unmeetable_targets_are_errors():
    with pytest.raises(CalibrationError, match="cannot be met"):
        calibrate_sigma(1e-6, 1e-10, 1.0, 100000, sigma_max=5.0)
    with pytest.raises(CalibrationError, match="1/N"):
        check_delta(1e-3, 5000)
    with pytest.raises(CalibrationError, match="already spent"):
        calibrate_sigma(0.5, 1e-5, 0.01, 10, prior=[dpa.GaussianDpEvent(0.5)])


def test_account_cli_both_ways():
    r = CliRunner().invoke(app, ["account", "-q", "0.01", "--steps", "1000", "--sigma", "1.0", "--delta", "1e-5"])
    assert r.exit_code == 0, r.output
    assert "ε = 1.82824 (PLD)" in r.output and "ε = 2.10137 (RDP)" in r.output
    r = CliRunner().invoke(app, ["account", "-q", "0.01", "--steps", "1000", "--epsilon", "1.828244"])
    assert r.exit_code == 0, r.output
    sigma = float(r.output.split("σ = ")[1].split()[0])
    assert sigma == pytest.approx(1.0, rel=2e-3)
    r = CliRunner().invoke(app, ["account", "-q", "0.01", "--steps", "10", "--epsilon", "1", "--n", "100", "--delta", "0.1"])
    assert r.exit_code != 0 and "1/N" in r.output
