"""Audit check: LP-FT's two phases are in the one ledger and end at the target ε (issue 45 item 3).

A tiny LP-FT run (a random 2-layer BERT, 40 rows, methods/lpft.py): the run's ledger must hold the probe
phase's releases (phase ``probe``) and the fine-tuning phase's, and the ε the run reports — computed from
that ledger — must be at most the target and at least the probe phase's ε alone (the composition, not the
second phase alone).

Planted ``lpft_probe_own_ledger``: the probe phase records its releases in a ledger of its own (the run's
ledger never sees them), so the fine-tuning phase is calibrated for the whole target on its own and the run
reports the second phase's ε only; the check must FAIL.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from dpft.accounting.ledger import PrivacyLedger
from dpft.audit.checks_tune_release import _WORDS, _screen, _tiny_classifier_dir
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.config.recipe import load_recipe
from dpft.methods import lpft
from dpft.run.loop import Trainer

__all__ = ["PLANTED", "lpft_checks", "planted_bug"]

PLANTED = ("lpft_probe_own_ledger",)


def _plant_own_ledger(p) -> None:
    real = lpft.LPFT.prepare

    def prepare(self, run):
        phase = run.train_phase

        def own_ledger(rec, d, **kw):
            kw.pop("ledger", None), kw.pop("phase", None), kw.pop("live_ledger_path", None)
            return phase(rec, d, **kw)

        run.train_phase = own_ledger
        try:
            return real(self, run)
        finally:
            run.train_phase = phase

    p.set(lpft.LPFT, "prepare", prepare)


planted_bug = bug_planter(PLANTED, {"lpft_probe_own_ledger": _plant_own_ledger})


def _run(d: Path, planted: Optional[str]) -> tuple[dict, PrivacyLedger, float]:

    with _screen(d / "setup.txt"):
        model = _tiny_classifier_dir(d / "model")
    rows = "\n".join(f"a {_WORDS[1 + i % 4]} film number {i},{int(i % 4 < 2)}" for i in range(40))
    (d / "train.csv").write_text("text,label\n" + rows + "\n")
    target = 4.0
    r = load_recipe(None, {
        "model.name": str(model), "model.max_length": 8, "model.pooling": "mean",
        "task.name": "files", "task.train_file": str(d / "train.csv"), "task.dev_file": str(d / "train.csv"),
        "trainable.mode": "last_k", "trainable.last_k": 1, "batch.expected_batch_size": 8,
        "batch.max_physical_batch_size": 8, "schedule.steps": 2, "eval.every_steps": 50, "checkpoint_every": 50,
        "privacy.target_epsilon": target, "privacy.delta": 1e-3, "perf.device": "cpu",
        "methods": [{"name": "lpft", "share": 0.5, "epochs": 2, "sampling_rate": 0.5, "lr": 0.05}]})
    with planted_bug(planted), _screen(d / "run.txt"):
        rep = Trainer(r, d / "run", progress=False).run()
    return rep, PrivacyLedger.load(d / "run" / "ledger.json"), target


def lpft_checks(planted: Optional[str] = None) -> list[Check]:
    """One check (a tiny two-phase run, seconds); ``planted`` one of :data:`PLANTED` (or None)."""
    with tempfile.TemporaryDirectory() as d:
        rep, ledger, target = _run(Path(d), planted if planted in PLANTED else None)
    info = rep.get("lpft", {})
    probe_steps = int(info.get("probe_steps", 0))
    eps = ledger.epsilon(1e-3).epsilon
    in_ledger = len(ledger.events(lpft.PHASE))
    ok = (probe_steps > 0 and in_ledger > 0 and ledger.steps >= probe_steps + 2 and eps <= target + 1e-6
          and abs(rep["privacy"]["epsilon"] - eps) < 1e-6 and eps > info.get("probe_target_epsilon", 0) - 1e-6)
    msg = (f"ledger: {ledger.steps} releases (probe {probe_steps}, {in_ledger} event(s) of phase probe; + fine-tuning); ε = {eps:.4g} ≤ target {target:g}, "
           f"above the probe's ε₁ = {info.get('probe_target_epsilon', float('nan')):.3g} alone; report ε "
           f"{rep['privacy']['epsilon']:.4g}")
    return [Check("lpft: both phases in the one ledger, the run ending at the target ε", ok, msg,
                  {"releases": ledger.steps, "probe_steps": probe_steps, "epsilon": eps})]
