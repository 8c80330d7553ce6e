"""``dpft audit RECIPE``: audit the DP step at the recipe's calibration.

σ, C, q, δ and the clip style come from the recipe (σ calibrated as ``dpft train`` does, or
``privacy.noise_multiplier``); the white-box checks run on a tiny random model of the recipe's
architecture family (BERT / RoBERTa / GPT-2), the canary audits on the slot model of
``audit/harness.py``. A reproducible recipe (``privacy.reproducible``) is audited with the
seed given to the auditor, who regenerates and subtracts the noise: its ε holds only while the
seed is secret, and the audit says so by failing. Writes ``audit.json``, ``audit.md`` and
``audit_scores.png``; exits 1 when ε̂ > ε for a canary audit or a white-box check fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer


def recipe_calibration(recipe) -> dict:
    """σ, C, q, T, δ, certified ε, clip style and model family of a recipe."""
    from dpft.accounting.calibrate import calibrate_sigma, epsilon_for_sigma
    from dpft.data.tasks import load_task

    r = recipe
    n = len(load_task(r.task, seed=r.seed).train)
    b = r.batch.expected_batch_size
    q = b / n
    steps = r.schedule.steps or max(1, math.ceil(r.schedule.epochs * n / b))
    p = r.privacy
    sigma = float(p.noise_multiplier) if p.noise_multiplier is not None else calibrate_sigma(p.target_epsilon, p.delta, q, steps)
    name = str(r.model.name).lower()
    family = "roberta" if "roberta" in name else "gpt2" if ("gpt" in name or r.task.name == "text") else "bert"
    return {"sigma": sigma, "C": float(p.clipping.max_norm), "q": q, "steps": steps, "n": n, "delta": float(p.delta),
            "epsilon": epsilon_for_sigma(sigma, q, steps, p.delta), "style": p.clipping.style, "family": family,
            "reproducible": bool(p.reproducible), "seed": int(r.seed), "hardened": bool(p.hardened_noise)}


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
    lines = [f"# dpft audit — verdict: **{d['verdict']}**", "",
             f"Recipe calibration: σ = {cal['sigma']:.4g}, C = {cal['C']:g}, q = {cal['q']:.4g}, T = {cal['steps']}, "
             f"δ = {cal['delta']:g}, certified ε of the run = {cal['epsilon']:.3f}.", "",
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
    lines += ["", "![scores](audit_scores.png)", ""]
    return "\n".join(lines)


def audit(
    recipe: Path = typer.Argument(..., help="YAML recipe to audit."),
    quick: bool = typer.Option(False, "--quick", help="CI sizes (fewer trials, one engine)."),
    full: bool = typer.Option(False, "--full", help="Larger trial counts and every engine/norm mode."),
    out: Optional[Path] = typer.Option(None, "--output-dir", "-o", "--out",
                                       help="Output folder (default: audit-<recipe name>); --out is an alias."),
) -> None:
    """Audit the DP step empirically: white-box checks and canary audits (ε̂ vs certified ε)."""
    from tqdm.auto import tqdm

    from dpft.audit.suite import run_audit, total_units
    from dpft.config import load_recipe

    try:  # a bad recipe, missing data (offline without DPFT_DATA_DIR), an unusable δ: one line, no traceback
        r = load_recipe(recipe)
        if not r.privacy.enabled:
            typer.secho("error: the recipe is not private (privacy.enabled: false); nothing to audit", fg="red",
                        err=True)
            raise typer.Exit(2)
        cal = recipe_calibration(r)
    except (ValueError, OSError) as exc:  # RecipeError, DataError, CalibrationError are ValueErrors
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2)
    quick_sizes = quick or not full
    out = Path(out or f"audit-{r.name}")
    out.mkdir(parents=True, exist_ok=True)
    known = cal["seed"] if cal["reproducible"] else None
    rng_factory = None
    if known is not None:
        from dpft.privacy.randomness import Randomness

        rng_factory = lambda: Randomness(known)  # noqa: E731 - the run's reproducible randomness
    with tqdm(total=total_units(quick_sizes), desc="audit", unit="part") as bar:
        rep = run_audit(cal["sigma"], cal["C"], cal["q"], cal["delta"], style=cal["style"], family=cal["family"],
                        quick=quick_sizes, known_seed=known, rng_factory=rng_factory, hardened=cal["hardened"],
                        progress=bar)
    payload = {"recipe": str(recipe), "calibration": cal, **rep.as_dict()}
    (out / "audit.json").write_text(json.dumps(payload, indent=2, default=float))
    plot_scores(rep.results, out / "audit_scores.png")
    (out / "audit.md").write_text(render_md(cal, rep))
    typer.echo(f"audit: {payload['verdict']} — {out / 'audit.md'}")
    for row in payload["canary"]:
        typer.echo(f"  {row['test']}: ε̂ = {row['eps_hat']:.3f} (cap {row['cap']:.2f}) vs ε = {row['certified_eps']:.3f}")
    bad = [c["check"] for c in payload["whitebox"] if c["verdict"] != "pass"]
    if bad:
        typer.echo("  failed checks: " + ", ".join(bad))
    if not rep.passed:
        raise typer.Exit(1)
