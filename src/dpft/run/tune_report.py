"""What a private search says: its report, its model card, its one tracker record and its lines on the screen.

Split from run/tune.py (which runs the search): every function here formats or writes what the search
releases — the search's ε by each bound, the chosen hyperparameters and their noisy score, the released
model's test score — or what it says before the first trial (the law of K, never K). Nothing here draws
noise or touches the ledger.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dpft.accounting.selection import KDistribution
from dpft.config.recipe import Recipe
from dpft.outputs.report import NOT_FOR_RELEASE, REPRODUCIBLE_WARNING
from dpft.run import tracking
from dpft.run.auto import describe_seconds

__all__ = ["summary", "markdown", "write_card", "track_search", "k_law_message", "score_on_test_file",
           "K_QUANTILES"]


#: Quantiles of K printed before the first trial (K itself is never shown).
K_QUANTILES = (0.5, 0.9, 0.99)


def k_law_message(r: Recipe, dist: KDistribution, plans: list, n_fit: int, n_score: int, num_labels: int,
                  combos: list, timing=None) -> str:
    """What a search may take, said before its first trial (issue 44 item 9): the law of K as quantiles
    of trials, and of time when a step time is known (a time budget's probe, or a probe here on synthetic
    rows: run/timing.py, no private data). K itself stays private: it is never printed."""
    qs = [(p, max(1, dist.tail_quantile(1.0 - p)) if dist.kind != "poisson" else dist.tail_quantile(1.0 - p))
          for p in K_QUANTILES]
    lines = [f"search: K trials, K ~ {dist.kind} with E[K] = {dist.mean():.3g}; K is private and never shown — "
             "trials run silently (no progress bar, score or tracker record of their own); one record at the end",
             "  law of K: " + ", ".join(f"{p:.0%} of searches run ≤ {k} trials" for p, k in qs)]
    if timing is None:
        try:
            from dpft.run.timing import probe_step_time
            from dpft.run.tune_space import _probe_recipe

            timing = probe_step_time(_probe_recipe(r, combos), num_labels)
        except Exception as exc:  # noqa: BLE001 - an estimate only: the search runs without it
            lines.append(f"  (no time estimate: the timing probe failed: {type(exc).__name__})")
            return "\n".join(lines)
    per = max(timing.setup_seconds + steps * timing.step_seconds(int(round(q * n_fit)), n_fit)
              + 2 * timing.eval_seconds(n_score) for q, steps in plans)

    lines.append(f"  estimated time (a trial ≈ {describe_seconds(per)} on this machine, the slowest configuration; "
                 "timed on synthetic rows): " + ", ".join(f"{p:.0%}: ≤ {describe_seconds(k * per)}" for p, k in qs))
    lines.append("  never restart a search because it runs long: a restart redraws K, and the ε of both is spent "
                 "(docs/tune.md)")
    return "\n".join(lines)


def track_search(r: Recipe, run_dir: Path, rep: dict) -> None:
    """``log.report_to``: ONE record for the whole search (issue 44 item 1) — its ε, the chosen
    hyperparameters (as the run's config) and the noisy score (and the released model's test accuracy);
    never a trial's. Nothing without trackers."""
    if not r.log.report_to:
        return

    c = rep.get("chosen") or {}
    config = {"search": "dpft tune", "chosen": c.get("hyperparameters"), "target_epsilon": r.privacy.target_epsilon,
              "delta": r.privacy.delta, "certified": not r.privacy.reproducible}
    row: dict[str, Any] = {"step": 0, "epsilon": rep["epsilon"]}
    if c:
        row["noisy_score"] = c["noisy_score"]
    if rep.get("test"):
        row["test_accuracy"] = rep["test"]["test_accuracy"]
    tr = tracking.Trackers(r.log.report_to, run_dir, r.name, config)
    try:
        tr.log(row)
    finally:
        tr.close()


def score_on_test_file(run_dir: Path, test_file: str, device: str, private_dir: Path) -> dict:
    """Accuracy of the released ``run_dir/model`` on ``test_file``, once (``dpft predict``'s path); the
    per-row predictions go to ``private_dir`` (the search's private folder) and are deleted.

    Returns:
        ``{"file", "n", "test_accuracy"}`` (accuracy in [0, 1], None where the task has none)."""
    import torch

    from dpft.run.predict import predict

    dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    out = private_dir / "test_predictions.jsonl"
    res = predict(run_dir, test_file, out, device=dev, progress=False)
    out.unlink(missing_ok=True)
    return {"file": str(test_file), "n": res["n"], "test_accuracy": res.get("accuracy")}


def write_card(r: Recipe, run_dir: Path, trial_report: Path, total, private_dev: bool, n_private: int,
          certified_by: str = "") -> None:
    """The released model's card from its trial's report, with the SEARCH's ε (the trial's own ε is not the
    guarantee of a selected model) and without dev metrics computed on private scoring rows."""
    from dpft.outputs.card import write_model_cards

    if not trial_report.is_file():
        return
    rep = json.loads(trial_report.read_text())
    rep["name"] = r.name
    if n_private:  # the guarantee covers the fit AND the scoring rows: N of the private data
        rep["task"]["n_train"] = n_private
        if isinstance((rep.get("dp") or {}).get("privacy_unit"), dict):
            rep["dp"]["privacy_unit"]["n_units"] = n_private
    rep["task"].update({"name": r.task.name, "train_file": r.task.train_file,
                        "source": f"files: {r.task.train_file}" if r.task.train_file else "its training split"})
    rep["privacy"].update({"epsilon": total.epsilon, "epsilon_rdp": total.epsilon_rdp,
                           "accountant": f"random-K selection, certified by {certified_by}"})
    if private_dev:
        rep["metrics"] = {}  # the trial's dev rows were the private scoring rows: never released
        cov = rep.get("coverage") or {}
        cov["dev"] = ("Trials were scored by a noisy count of correct predictions on held-out private rows; the "
                      "counts' noise is in the search's ε. No exact dev metric on private rows is released.")
        rep["coverage"] = cov
    write_model_cards(run_dir, rep)
    card = run_dir / "model" / "README.md"
    text = card.read_text() if card.is_file() else ""
    start = text.find("ε is computed by the PLD accountant")
    if start >= 0:  # the card's sentence about a training run's ledger, said of the search instead
        end = text.find("\n\n", start)
        card.write_text(text[:start] + (
            "ε is computed from the search's ledger (`ledger.json`): one random-K selection event holding every "
            "configuration's per-trial events (each Poisson-subsampled Gaussian step and the noisy score) and the "
            "law of K, bounded by the smaller of Papernot & Steinke (2022) on dp-accounting's RDP curves and a "
            f"privacy-profile bound on dp-accounting's PLD (accounting/selection_profile.py); certified by "
            f"{certified_by}.") + text[end:])


def summary(rep: dict) -> str:
    """The lines ``dpft tune`` prints: the search's ε by each bound, and the choice."""
    s = rep["selection"]
    out = (f"search ε = {rep['epsilon']:.4g} at δ = {rep['delta']:g} (target {rep['target_epsilon']:g}), certified "
           f"by {rep.get('certified_by', s.get('certified_by_name', 'RDP'))}: RDP bound {s['epsilon_rdp']:.4g}; "
           f"privacy-profile bound {s.get('epsilon_profile', math.inf):.4g}; naive composition of k* = "
           f"{s['naive_k']} trials {s['epsilon_naive']:.4g}; one trial {s['per_trial_epsilon']:.4g}; "
           f"E[K] = {s['mean_k']:.3g}")
    c = rep.get("chosen")
    a = rep.get("auto")
    if a:  # batch/steps auto: the (B, T) every trial ran, chosen before K was drawn
        out += (f"\nauto: B = {a['batch']}, T = {a['steps']} per trial (σ_trial = {a['sigma']:.4g}, learning rate "
                f"× {a['lr_scale']:.4g})")
    if rep.get("reproducible"):
        out = f"{NOT_FOR_RELEASE} — {out} — {REPRODUCIBLE_WARNING}"
    if rep.get("earlier_searches"):
        out += (f"\nthis folder held {len(rep['earlier_searches'])} earlier search(es): their ledger entries stay and "
                "compose with this one (the ε above is of all of them)")
    out += ("\nK = 0: no model released (the ε above is spent)" if not c else
            f"\nchosen: {json.dumps(c['hyperparameters'])} (noisy score {c['noisy_score']:.1f})")
    t = rep.get("test")
    if t and t.get("test_accuracy") is not None:
        out += f"\ntest accuracy: {t['test_accuracy']:.4f} ({t['n']} examples; the released model, once)"
    return out


def markdown(rep: dict) -> str:
    """``report.md`` of a search from its ``report.json`` dict."""
    s = rep["selection"]
    lines = ["# dpft tune", "", f"**ε = {rep['epsilon']:.4g} at δ = {rep['delta']:g}** for the whole search "
             f"(target {rep['target_epsilon']:g}), certified by {rep.get('certified_by', rep['accountant'])}.", "",
             *([f"**{rep['reproducible']}**", ""] if rep.get("reproducible") else []),
             "| bound | ε |", "|---|---|",
             f"| Papernot & Steinke 2022 (RDP → (ε, δ), dp-accounting) | {s['epsilon_rdp']:.4g} |",
             f"| naive composition of k* = {s['naive_k']} trials (P[K > k*] ≤ δ/2) | {s['epsilon_naive']:.4g}"
             f"{'' if s['naive_valid'] else ' (comparison only: configurations differ)'} |",
             f"| {s['profile_bound']} | {s.get('epsilon_profile', math.inf):.4g} |",
             f"| one trial (PLD) | {s['per_trial_epsilon']:.4g} |", "",
             f"K ~ {json.dumps(rep['k_distribution'])}; score: {rep['score']}.", ""]
    if rep.get("auto"):
        a = rep["auto"]
        lines += [f"batch/steps auto: B = {a['batch']}, T = {a['steps']} per trial (B·T ≈ {a['budget']}), the smallest "
                  f"σ_trial/B among {len(a.get('rows', []))} candidate(s), σ_trial calibrated for the whole search; "
                  f"learning rate × {a['lr_scale']:.4g}.", ""]
    if rep.get("chosen"):
        c = rep["chosen"]
        lines += [f"Chosen: {json.dumps(c['hyperparameters'])}, noisy score {c['noisy_score']:.1f}, σ = "
                  f"{c['sigma']:.4f}.", ""]
        if rep.get("test") and rep["test"].get("test_accuracy") is not None:
            lines += [f"Test accuracy of the released model: {rep['test']['test_accuracy']:.4f} ({rep['test']['n']} "
                      f"rows of {rep['test']['file']}, evaluated once).", ""]
    else:
        lines += ["K = 0 (Poisson): no model was released; the ε above is spent all the same.", ""]
    lines += [f"Not released: {rep['not_released']}."]
    return "\n".join(lines) + "\n"
