"""``dpft audit RECIPE``: audit the code ``dpft train RECIPE`` runs, at the recipe's own plan.

The recipe's :class:`~dpft.run.loop.Trainer` is built (its data, model, privacy unit, sampler,
clip policy, engine and σ, exactly as ``dpft train`` builds them): the plan (unit, N, q, σ, T,
C, δ, ε of the run) is the Trainer's, and leave-one-unit-out sensitivity, the noise law, the
ledger event and the unit's sampling rate are checked through :meth:`Trainer.step` itself
(``audit/trainer_walk.py``). The white-box sweep of every clip style and engine runs on a tiny
random model of the recipe's architecture family (BERT / RoBERTa / GPT-2), the canary audits on
the slot model of ``audit/harness.py`` at the plan's σ and q; the check modules
``checks_randomness`` and ``ways_in`` join when installed (skipped with a note otherwise).
A reproducible recipe (``privacy.reproducible``) is audited with the seed given to the auditor,
who regenerates and subtracts the noise: its ε holds only while the seed is secret, and the
audit says so by failing. ``--plant NAME`` (hidden) is the auditor's self-test
(``audit/planted.py``): the audit must fail. Writes ``audit.json``, ``audit.md`` and
``audit_scores.png``; exits 1 when ε̂ > ε for a canary audit or a check fails, 2 for a recipe
or flag it cannot audit. Not walked yet: DDP (a recipe's ``perf`` world size; the Trainer is
built in one process).

``--final-model`` (issue 37, ``audit/final_model.py``) instead trains the recipe once through the
Trainer with secret-coin canaries and audits the final model only (one-run ε̂ of Steinke et al.
2023 and Mahloujifar et al. 2025 at ``--confidence``); it writes ``final_model_audit.json`` /
``.md`` and the run (report, model card with the audited line) in the output folder, attaches
the audited line to ``--attach RUN_DIR`` too, and exits 1 when a Steinke ε̂ (the test of the
(ε, δ) claim itself) exceeds the certified ε.
A non-private recipe is accepted here (the calibration: its ε̂ must be large).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from dpft.audit.planted import ALL
from dpft.audit.suite import audit_recipe, total_units
from dpft.config.recipe import load_recipe


def plot_scores(results, path: Path) -> None:
    """Histograms of the canary scores (canary absent vs present) of each canary audit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        ax.hist(r.null_scores, bins=60, alpha=0.6, density=True, label="canary out")
        ax.hist(r.canary_scores, bins=60, alpha=0.6, density=True, label="canary in")
        ax.set_title(f"{r.name}: ε̂={r.eps_hat:.2f} (cap {r.cap:.1f}) vs ε={r.certified_eps:.2f}", fontsize=8)
        ax.set_xlabel("score (projection / C)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_md(cal: dict, rep) -> str:
    d = rep.as_dict()
    lines = [f"# dpft audit — verdict: **{d['verdict']}**", ""]
    if d.get("planted"):
        lines += [f"**PLANTED BUG `{d['planted']}`: a self-test of the auditor (it must FAIL); this is not an "
                  "audit of the recipe.**", ""]
    unit = cal.get("unit", "example")
    lines += [f"Plan of the run (the Trainer's): privacy unit {unit}, N = {cal['n']} {unit}s, q = {cal['q']:.4g}, "
              f"σ = {cal['sigma']:.4g}, T = {cal['steps']}, C = {cal['C']:g}, δ = {cal['delta']:g}, certified ε of "
              f"the run = {cal['epsilon']:.3f}"
              + (f" (earlier ledger phases: {', '.join(cal['prior_phases'])})" if cal.get("prior_phases") else "")
              + ".", ""]
    if cal.get("reproducible"):
        lines += ["Reproducible recipe: the seed is in the recipe, the auditor is given it (the ε holds only while "
                  "the seed stays secret: NOT CERTIFIED for release).", ""]
    lines += [
             "## Canary audits (empirical lower bound ε̂ at 95 % confidence)", "",
             "Certified ε here is the ε of what each audit ran (the ledger's events of one trial). "
             "The cap is the largest ε̂ the trial count could certify: ε̂ ≤ ε is evidence of no "
             "violation only below the cap, never of tightness.", "",
             "| test | σ | q | steps | certified ε | ε̂ (95 %) | cap | trials | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in d["canary"]:
        lines.append(f"| {r['test']} | {r['sigma']:.3g} | {r['q']:.3g} | {r['steps']} | {r['certified_eps']:.3f} | "
                     f"{r['eps_hat']:.3f} | {r['cap']:.2f} | {r['trials']} | {r['verdict']} |")
    lines += ["", "## White-box checks", "", "| check | verdict | detail |", "|---|---|---|"]
    for c in d["whitebox"]:
        lines.append(f"| {c['check']} | {c['verdict']} | {c['message']} |")
    if d.get("notes"):
        lines += ["", "## Not run", ""] + [f"- {n}" for n in d["notes"]]
    lines += ["", "![scores](audit_scores.png)", ""]
    return "\n".join(lines)


def audit(
    recipe: Path = typer.Argument(..., help="YAML recipe to audit."),
    quick: bool = typer.Option(False, "--quick", help="CI sizes (fewer trials, one engine)."),
    full: bool = typer.Option(False, "--full", help="Larger trial counts and every engine/norm mode."),
    out: Optional[Path] = typer.Option(None, "--output-dir", "-o", "--out",
                                       help="Output folder (default: audit-<recipe name>); --out is an alias."),
    plant: Optional[str] = typer.Option(None, "--plant", hidden=True,
                                        help="Self-test: plant a bug (dpft.audit.planted.ALL); the audit must FAIL."),
    final_model: bool = typer.Option(False, "--final-model",
                                     help="Train the recipe once with secret-coin canaries and audit the final "
                                          "model only (one-run ε̂, black-box)."),
    canaries: int = typer.Option(500, "--canaries", "-m", help="--final-model: canaries per design."),
    canary_design: Optional[List[str]] = typer.Option(
        None, "--canary-design", help="--final-model: classifier random|mislabel, causal LM rare|random "
                                      "(repeat to compare designs in one run; default random / rare)."),
    confidence: float = typer.Option(0.95, "--confidence", help="--final-model: confidence of each ε̂."),
    dirac: Optional[int] = typer.Option(None, "--dirac", help="--final-model: Dirac gradient canaries of the "
                                        "white-box audit on the same run (default: as many as --canaries; 0: none)."),
    attach: Optional[Path] = typer.Option(None, "--attach",
                                          help="--final-model: also put the audited line in this finished run's "
                                               "report and model card."),
) -> None:
    """Audit the DP step empirically: white-box checks and canary audits (ε̂ vs certified ε)."""
    import time

    if final_model:
        return _final_model(recipe, out, canaries, canary_design, confidence, attach, plant, dirac)

    from tqdm.auto import tqdm

    try:  # a bad recipe, missing data (offline without DPFT_DATA_DIR), an unusable δ: one line, no traceback
        r = load_recipe(recipe)
        from dpft.run.auto import resolve_auto

        r, chosen = resolve_auto(r)  # batch/steps auto: the audit checks the plan dpft train would run
        if chosen:
            typer.echo(chosen, err=True)
        if not r.privacy.enabled:
            typer.secho("error: the recipe is not private (privacy.enabled: false); nothing to audit", fg="red",
                        err=True)
            raise typer.Exit(2)
    except (ValueError, OSError) as exc:  # RecipeError, DataError, CalibrationError are ValueErrors
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    if plant is not None and plant not in ALL:
        typer.secho(f"error: unknown planted bug {plant!r}; one of {list(ALL)}", fg="red", err=True)
        raise typer.Exit(2)
    quick_sizes = quick or not full
    out = Path(out or f"audit-{r.name}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with tqdm(total=total_units(quick_sizes), desc="audit", unit="part") as bar:
            cal, rep = audit_recipe(r, quick=quick_sizes, planted=plant, progress=bar)
    except (ValueError, OSError) as exc:  # missing data offline, an unusable δ: one line, no traceback
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    seconds = time.perf_counter() - t0
    payload = {"recipe": str(recipe), "calibration": cal, "seconds": seconds, **rep.as_dict()}
    (out / "audit.json").write_text(json.dumps(payload, indent=2, default=float))
    plot_scores(rep.results, out / "audit_scores.png")
    (out / "audit.md").write_text(render_md(cal, rep))
    unit = cal["unit"]
    typer.echo(f"audit: {payload['verdict']}{' (PLANTED ' + plant + ')' if plant else ''} — {out / 'audit.md'} "
               f"({seconds:.0f} s)")
    typer.echo(f"  plan: unit {unit}, N = {cal['n']}, q = {cal['q']:.4g}, σ = {cal['sigma']:.4g}, T = {cal['steps']}, "
               f"C = {cal['C']:g}, δ = {cal['delta']:g}, ε = {cal['epsilon']:.3f}")
    for row in payload["canary"]:
        typer.echo(f"  {row['test']}: ε̂ = {row['eps_hat']:.3f} (cap {row['cap']:.2f}) vs ε = {row['certified_eps']:.3f}")
    bad = [c["check"] for c in payload["whitebox"] if c["verdict"] != "pass"]
    if bad:
        typer.echo("  failed checks: " + ", ".join(bad))
    for n in rep.notes:
        typer.echo(f"  not run: {n}")
    if not rep.passed:
        raise typer.Exit(1)


def _final_model(recipe: Path, out: Optional[Path], m: int, designs: Optional[List[str]], confidence: float,
                 attach: Optional[Path], plant: Optional[str], dirac: Optional[int] = None) -> None:
    """``dpft audit RECIPE --final-model`` (audit/final_model.py)."""
    from dpft.audit.estimators import GAUSSIAN_ASSUMPTION
    from dpft.audit.final_model import attach_audit, audit_final_model, eps_ratio, render_audit_md, verdict_line

    if attach is not None and not (attach / "report.json").is_file():
        typer.secho(f"error: --attach {attach}: no report.json there (give a finished `dpft train` run folder)",
                    fg="red", err=True)
        raise typer.Exit(2)
    try:
        r = load_recipe(recipe)
        out = Path(out or f"audit-final-{r.name}")
        if (out / "checkpoint").exists():
            raise ValueError(f"{out} already holds a run; choose another --output-dir")
        res = audit_final_model(r, out, m=m, designs=designs, confidence=confidence, planted=plant, dirac=dirac)
    except (ValueError, OSError) as exc:  # bad recipe or option, missing data: one line, no traceback
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    (out / "final_model_audit.md").write_text(render_audit_md(res))
    if attach is not None:
        attach_audit(attach, res, same_run=False)
    eps = res["certified_epsilon"]
    typer.echo(f"final-model audit{' (PLANTED ' + plant + ')' if plant else ''}: {out / 'final_model_audit.md'} "
               f"({res['seconds']:.0f} s); certified ε = {'none' if eps is None else f'{eps:.3f}'}")
    for x in res["designs"]:
        b = x["bounds"]
        typer.echo(f"  {x['design']} canaries (m = {x['m']}): ε̂ ≥ {b['steinke']['epsilon']:.3f} (Steinke, any "
                   f"mechanism), ≥ {b['fdp']['epsilon']:.3f} (f-DP, {GAUSSIAN_ASSUMPTION}) at {confidence:.0%} "
                   "confidence")
    if res.get("whitebox"):
        b = res["whitebox"]["bounds"]
        typer.echo(f"  white-box, {res['whitebox']['m']} Dirac canaries on every release: "
                   f"ε̂ ≥ {b['steinke']['epsilon']:.3f} (Steinke), ≥ {b['fdp']['epsilon']:.3f} (f-DP, "
                   f"{GAUSSIAN_ASSUMPTION})")
    ratio = eps_ratio(res)
    if ratio is not None:
        typer.echo(f"  ε̂/ε = {ratio:.2f} (Steinke headline)")
    if res.get("gaussian_curve_rejected") and not res.get("gaussian_mechanism") and not res["violation"]:
        typer.secho("  an f-DP ε̂ exceeds the certified ε, but this run's ledger holds releases that are not Gaussian "
                    "(e.g. randomized response), so the Gaussian trade-off curve is not assumed and only the Steinke "
                    "ε̂ counts (a warning; the (ε, δ) claim itself is not rejected)", fg="yellow")
    typer.echo(f"  verdict: {verdict_line(res)}")
    if res["violation"]:
        typer.secho("  ε̂ exceeds the certified ε: the training code leaks more than it certifies", fg="red")
        raise typer.Exit(1)
