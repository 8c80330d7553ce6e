"""The final-model audit's headline (issue 44 item 6): the estimator valid for any mechanism
(Steinke, Nasr & Jagielski 2023) heads the record, report, card and CLI; the f-DP one is shown
"assuming a Gaussian trade-off curve" and counts in the verdict only when the run's ledger holds
Gaussian releases only — so a planted noise/4 run at ε = 4 fails."""

from __future__ import annotations

import dp_accounting as dpa
import torch

from dpft.audit import final_model as fm
from dpft.audit.estimators import GAUSSIAN_ASSUMPTION, gaussian_events


def _set(m: int = 400) -> fm.CanarySet:
    inc = torch.arange(m) % 2 == 0
    g = torch.Generator().manual_seed(0)
    final = torch.where(inc, torch.zeros(m), torch.ones(m)) + 0.3 * torch.randn(m, generator=g)
    return fm.CanarySet("random", [], inc, ref_loss=torch.ones(m), final_loss=final)


def _record(eps: float, gaussian: bool) -> dict:
    return fm.audit_record(recipe="r", planted=None, private=True, certified_epsilon=eps, delta=1e-5, confidence=0.95,
                           n=100, steps=10, sigma=1.0, sets=[_set()], seconds=0.0, gaussian=gaussian)


def test_the_headline_is_steinke_and_the_f_dp_bound_counts_only_for_a_gaussian_mechanism():
    b = fm.design_result("random", _set().scores, _set().included, 1e-5, 0.95)["bounds"]
    st, fd = b["steinke"]["epsilon"], b["fdp"]["epsilon"]
    assert fd > st > 0.5, (st, fd)
    between = (st + fd) / 2
    gauss = _record(between, gaussian=True)
    assert gauss["headline"]["method"] == "steinke" and gauss["headline"]["epsilon_hat"] == st
    assert gauss["headline"]["gaussian"] == {"epsilon_hat": fd, "method": "fdp", "assumption": GAUSSIAN_ASSUMPTION}
    assert gauss["violation"] and gauss["violation_by"] == ["fdp"]  # Steinke < ε < f-DP, Gaussian: FAIL
    other = _record(between, gaussian=False)  # e.g. randomized response in the ledger: f-DP does not count
    assert not other["violation"] and other["gaussian_curve_rejected"] and other["violation_by"] == []
    below = _record(st * 0.9, gaussian=False)
    assert below["violation"] and below["violation_by"] == ["steinke"]
    assert "FAIL" in fm.verdict_line(gauss) and "f-DP" in fm.verdict_line(gauss)
    assert fm.verdict_line(other).startswith("pass") and "not Gaussian" in fm.verdict_line(other)


def test_report_and_audit_page_headline_steinke_and_qualify_f_dp():
    from dpft.outputs.report import audited_lines

    rec = _record(100.0, gaussian=True)
    summary = fm.audit_summary(rec, same_run=True)
    assert summary["method"].startswith("one-run, valid for any mechanism (Steinke")
    line = audited_lines({"final_model_audit": summary})[0]
    assert f"ε̂ ≥ {rec['headline']['epsilon_hat']:.3g} at 95% confidence" in line
    assert "valid for any mechanism (Steinke" in line and f"{GAUSSIAN_ASSUMPTION} (f-DP" in line
    assert line.index("Steinke") < line.index(GAUSSIAN_ASSUMPTION)
    page = fm.render_audit_md(rec)
    assert "**Headline:**" in page and GAUSSIAN_ASSUMPTION in page and "**Verdict: pass" in page
    assert "ε̂ Steinke (any mechanism) | ε̂ f-DP (assuming a Gaussian trade-off curve)" in page


def test_gaussian_events_are_the_gaussian_family_only():
    sub = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 50)
    assert gaussian_events([sub, dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0), dpa.NoOpDpEvent()])])
    assert not gaussian_events([sub, dpa.RandomizedResponseDpEvent(0.3, 2)])
    assert not gaussian_events([dpa.LaplaceDpEvent(1.0)]) and not gaussian_events([])
