"""Shared harness of the issue-18 experiments: arms × seeds of ``dpft train``, mean ± sd and
paired tests, one Markdown table.

An *arm* is a recipe plus ``--set`` overrides; every arm runs once per seed (``seed=S``: data
subset, initialisation; the noise comes from each run's secret randomness unless the recipe
sets ``privacy.reproducible``). Every run writes its dev predictions
(``eval.save_predictions=true``), so arms are compared *paired* on the same dev examples:

* per arm: dev accuracy mean ± sd over seeds (sample sd, n − 1), the ε of every run's ledger
  (or NOT CERTIFIED), wall time;
* against the reference arm: mean paired difference over seeds, McNemar's exact test on the
  discordant pairs pooled over seeds (seed i of A with seed i of B), and the paired bootstrap
  95 % CI of the seed-pooled accuracy difference (dpft.eval.paired).

Runs go through the CLI in subprocesses (1 thread each; ``jobs`` at a time: 2 on the 2-core
box); a run directory that already holds ``report.json`` is reused, so an interrupted
experiment resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # this checkout's dpft, as the subprocesses use (PYTHONPATH)
    sys.path.insert(0, str(ROOT / "src"))


@dataclass
class Arm:
    """One arm: ``recipe`` (path, relative to the repository root) + ``overrides`` (dotted
    keys → values, passed as ``--set k=v``) + extra CLI ``args``."""

    name: str
    recipe: str
    overrides: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    #: report.json metric this arm is judged on (e.g. dev_accuracy_noisy_inference).
    metric: str = "dev_accuracy"
    #: overrides that depend on the seed (e.g. the model another arm's seed-S run produced).
    per_seed: Optional[Callable[[int], dict[str, Any]]] = None


def _fmt_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def command(arm: Arm, seed: int, run_dir: Path, common: dict[str, Any], common_args: list[str]) -> list[str]:
    """The ``dpft train`` command line of one (arm, seed)."""
    sets = {**common, **arm.overrides, **(arm.per_seed(seed) if arm.per_seed else {}), "seed": seed,
            "eval.save_predictions": True}
    cmd = [sys.executable, "-m", "dpft.cli.commands", "train", arm.recipe, "-o", str(run_dir), "--quiet",
           *common_args, *arm.args]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={_fmt_value(v)}"]
    return cmd


def run_one(arm: Arm, seed: int, out: Path, common: dict[str, Any], common_args: list[str],
            env: dict[str, str], timeout: Optional[float] = None) -> dict[str, Any]:
    """Run (or reuse) one (arm, seed); returns its collected row. A failed run gives a row
    with ``error`` (its stderr tail) instead of raising, so one failure does not stop the rest."""
    d = out / arm.name / f"seed{seed}"
    cmd = command(arm, seed, d, common, common_args)
    if not (d / "report.json").is_file():
        if d.exists():
            import shutil

            shutil.rmtree(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        p = subprocess.run(["nice", "-n", "5", *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
        wall = time.time() - t0
        (d.parent / f"seed{seed}.log").write_text(shlex.join(cmd) + "\n\n" + p.stdout + p.stderr)
        if p.returncode != 0:
            return {"arm": arm.name, "seed": seed, "dir": str(d), "error": (p.stderr or p.stdout)[-2000:],
                    "command": shlex.join(cmd)}
        (d / "wall_seconds.txt").write_text(f"{wall:.1f}\n")
    return collect(d, arm, seed, shlex.join(cmd))


def collect(d: Path, arm: Arm, seed: int, cmd: str = "") -> dict[str, Any]:
    """The row of a finished run directory: metric, ε (or NOT CERTIFIED), wall time."""
    rep = json.loads((d / "report.json").read_text())
    p = rep["privacy"]
    eps = p.get("epsilon") if p.get("guarantee") == "certified" else None
    wall_f = d / "wall_seconds.txt"
    return {"arm": arm.name, "seed": seed, "dir": str(d), "metric": arm.metric,
            "value": rep["metrics"].get(arm.metric), "metrics": rep["metrics"],
            "guarantee": p.get("guarantee", "none"), "epsilon": eps, "delta": p.get("delta"),
            "wall_s": float(wall_f.read_text()) if wall_f.is_file() else rep.get("time_seconds"),
            "command": cmd}


def collected(arms: list[Arm], seeds: list[int], out: str | Path) -> list[dict[str, Any]]:
    """The rows of the (arm, seed) runs in ``out`` that finished (``report.json``); runs nothing."""
    out = Path(out)
    return [collect(out / a.name / f"seed{s}", a, s, shlex.join(command(a, s, out / a.name / f"seed{s}", {}, [])))
            for a in arms for s in seeds if (out / a.name / f"seed{s}" / "report.json").is_file()]


def _env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")})
    env.setdefault("DPFT_DATA_DIR", "/work/shared/data")
    return env


def run_experiment(arms: list[Arm], seeds: list[int], out: str | Path, common: Optional[dict[str, Any]] = None,
                   common_args: Optional[list[str]] = None, jobs: int = 2,
                   timeout: Optional[float] = None) -> list[dict[str, Any]]:
    """Every (arm, seed), ``jobs`` at a time; returns the rows (arm order, then seed order)."""
    out = Path(out)
    env = _env()
    work = [(a, s) for a in arms for s in seeds]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futs = [ex.submit(run_one, a, s, out, common or {}, common_args or [], env, timeout) for a, s in work]
        return [f.result() for f in futs]


def _paired_bits(row: dict[str, Any], metric_file: str = "dev_predictions.jsonl") -> Optional[dict[int, bool]]:
    from dpft.eval.paired import load_correct

    f = Path(row["dir"]) / metric_file
    return load_correct(f) if f.is_file() else None


def paired_row_losses(pairs: list[tuple[dict[int, tuple[float, int]], dict[int, tuple[float, int]]]],
                      n_boot: int = 5000, seed: int = 0) -> dict[str, Any]:
    """Paired comparison of a continuous per-example metric (generation tasks: the dev loss of
    each dev row), arm A against arm B.

    Args:
        pairs: one ``(A, B)`` per seed pair, each ``{dev row: (summed loss, tokens)}`` over the
            same rows (the token counts are the rows' own, equal in A and B).

    Returns:
        ``{"seed_pairs", "per_seed"`` (token-weighted loss(A) − loss(B) per seed), ``"t_p"`` (paired
        t-test of those over seeds, two-sided; nan with one pair), ``"pooled"``, ``"lo"``, ``"hi"``
        (the token-weighted difference pooled over (seed, row) pairs and its percentile bootstrap
        CI, rows resampled with their pair), ``"wilcoxon_p"`` (signed-rank test of the per-row
        mean-loss differences, pooled)}``. Pooled tests treat (seed, row) pairs as independent.
    """
    import numpy as np
    from scipy import stats

    from dpft.eval.paired import PairedError

    la, lb, tok, per_seed = [], [], [], []
    for a, b in pairs:
        if set(a) != set(b):
            raise PairedError("the runs scored different dev rows: compare runs of the same seed")
        keys = sorted(a)
        sa = np.array([a[k][0] for k in keys])
        sb = np.array([b[k][0] for k in keys])
        n = np.array([a[k][1] for k in keys], dtype=float)
        per_seed.append(float(sa.sum() / n.sum() - sb.sum() / n.sum()))
        la.append(sa)
        lb.append(sb)
        tok.append(n)
    sa, sb, n = np.concatenate(la), np.concatenate(lb), np.concatenate(tok)
    keep = n > 0
    sa, sb, n = sa[keep], sb[keep], n[keep]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(n_boot, len(n)))
    boots = (sa[idx].sum(1) - sb[idx].sum(1)) / n[idx].sum(1)
    lo, hi = np.quantile(boots, [0.025, 0.975])
    t_p = float(stats.ttest_1samp(per_seed, 0.0).pvalue) if len(per_seed) > 1 else float("nan")
    return {"seed_pairs": len(per_seed), "per_seed": per_seed, "t_p": t_p,
            "pooled": float((sa.sum() - sb.sum()) / n.sum()), "lo": float(lo), "hi": float(hi),
            "wilcoxon_p": float(stats.wilcoxon(sa / n, sb / n).pvalue)}


def _mean_sd(xs: list[float]) -> str:
    if not xs:
        return "—"
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else float("nan")
    return f"{m:.4f} ± {sd:.4f}" if not math.isnan(sd) else f"{m:.4f} (1 seed)"


def table(rows: list[dict[str, Any]], reference: Optional[str] = None, title: str = "",
          note: str = "") -> str:
    """Markdown: one line per arm (mean ± sd, ε per run, wall time) and the paired tests of
    every arm against ``reference`` (default: the first arm)."""
    from dpft.eval.paired import mcnemar_exact, pair, paired_bootstrap

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    reference = reference or (arms[0] if arms else None)
    by = {a: sorted([r for r in rows if r["arm"] == a and "error" not in r], key=lambda r: r["seed"]) for a in arms}
    lines = [f"## {title}", ""] if title else []
    lines += ["| arm | seeds | metric | mean ± sd | per seed | ε (δ) per run | wall s (mean) |",
              "|---|---|---|---|---|---|---|"]
    for a in arms:
        rs = by[a]
        vals = [r["value"] for r in rs if r["value"] is not None]
        eps = ", ".join("NOT CERTIFIED" if r["guarantee"] == "NOT CERTIFIED" else
                        (f"{r['epsilon']:.4g}" if r["epsilon"] is not None else str(r["guarantee"])[:12])
                        for r in rs)
        delta = next((r["delta"] for r in rs if r.get("delta")), None)
        walls = [r["wall_s"] for r in rs if r.get("wall_s")]
        lines.append(f"| {a} | {len(rs)} | {rs[0]['metric'] if rs else '—'} | {_mean_sd(vals)} | "
                     f"{', '.join(f'{v:.4f}' for v in vals)} | {eps}{f' (δ={delta:g})' if delta else ''} | "
                     f"{statistics.fmean(walls):.0f} |" if walls else
                     f"| {a} | {len(rs)} | — | {_mean_sd(vals)} | | {eps} | — |")
    if reference in by and len(arms) > 1:
        lines += ["", f"Paired against **{reference}** (same seeds, same dev examples):", "",
                  "| arm | seed pairs | mean diff (arm − ref) | McNemar exact p (pooled b/c) | "
                  "paired bootstrap 95 % CI (pooled) |", "|---|---|---|---|---|"]
        ref = {r["seed"]: r for r in by[reference]}
        for a in arms:
            if a == reference:
                continue
            A, B, diffs = [], [], []
            for r in by[a]:
                if r["seed"] not in ref:
                    continue
                ba, bb = _paired_bits(r), _paired_bits(ref[r["seed"]])
                if ba is None or bb is None:
                    continue
                x, y = pair(ba, bb)
                A += x
                B += y
                diffs.append(sum(x) / len(x) - sum(y) / len(y))
            if not diffs:
                lines.append(f"| {a} | 0 | — | — | — |")
                continue
            mc = mcnemar_exact(A, B)
            bs = paired_bootstrap(A, B, n_boot=5000)
            lines.append(f"| {a} | {len(diffs)} | {_mean_sd(diffs)} | {mc['p_value']:.3g} ({mc['b']}/{mc['c']}) | "
                         f"[{bs['lo']:+.4f}, {bs['hi']:+.4f}] |")
        lines += ["", "Pooled tests treat every (seed, dev example) pair as independent; the dev examples are "
                      "shared across seeds, so read them with the per-seed spread beside them."]
    bad = [r for r in rows if "error" in r]
    if bad:
        lines += ["", "Failed runs: " + "; ".join(f"{r['arm']} seed {r['seed']} ({r['error'].strip().splitlines()[-1][:160]})"
                                               for r in bad)]
    if note:
        lines += ["", note]
    cmds = [r["command"] for r in rows if r.get("command")]
    if cmds:
        lines += ["", "<details><summary>commands</summary>", "", *[f"    {c}" for c in cmds], "", "</details>"]
    return "\n".join(lines) + "\n"


def write(md: str, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(md)
    return p


def seeds_arg(s: str) -> list[int]:
    """``"0,1,2"`` or ``"3"`` (= 0, 1, 2) → list of seeds."""
    return [int(x) for x in s.split(",")] if "," in s else list(range(int(s)))


def smoke_assets(d: str | Path) -> dict[str, str]:
    """Tiny assets for smoke tests of the experiment scripts (seconds per run): a random BERT
    (hidden 16, 2 blocks) saved with the real MiniLM tokenizer, and two small labelled CSVs
    (``train``: 80 rows used as the private task; ``public``: 40 other rows). Returns
    ``{"model", "train", "public"}`` paths; ``--set`` overrides that point a recipe at them are
    :func:`smoke_overrides`."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from dpft.models.load import resolve_model_path

    d = Path(d)
    model = d / "tinybert"
    if not (model / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)
        BertForSequenceClassification(cfg).save_pretrained(model)
        tok.save_pretrained(model)
    words = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull"]
    for name, n, off in (("train", 80, 0), ("public", 40, 1000)):
        f = d / f"{name}.csv"
        if not f.is_file():
            f.write_text("text,label\n" + "".join(f"a {words[i % 8]} film number {i + off},{int(i % 8 % 2 == 0)}\n"
                                                  for i in range(n)))
    return {"model": str(model), "train": str(d / "train.csv"), "public": str(d / "public.csv")}


def smoke_overrides(assets: dict[str, str]) -> dict[str, Any]:
    """Recipe overrides that put any recipe on the smoke assets (tiny model, tiny task)."""
    return {"model.name": assets["model"], "model.max_length": 16, "task.name": "files",
            "task.train_file": assets["train"], "task.max_train_examples": None, "task.max_dev_examples": None,
            "batch.max_physical_batch_size": 16, "eval.batch_size": 64}
