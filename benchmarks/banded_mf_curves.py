"""Dev accuracy against steps, banded MF vs DP-SGD at one ε (issue 28's must-show plot).

Reads the run folders that ``benchmarks/banded_mf_sst2.py --eval-every K`` wrote
(``<runs>/<arm>/seed<S>/metrics.jsonl``: one row per step, ``dev_accuracy`` at every K-th) and
writes a PNG (mean over seeds, ± 1 sample sd shaded) and a Markdown table of the same numbers::

    python benchmarks/banded_mf_curves.py runs/banded_mf_sst2_eps8 \\
        --out benchmarks/results/banded_mf_curve_eps8

Every run's own ledger gives the ε it printed at each evaluation (the ``epsilon`` column of
metrics.jsonl); the table reports the last one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load_arm(arm_dir: Path) -> dict[int, list[tuple[int, float, float]]]:
    """``{seed: [(step, dev_accuracy, epsilon), …]}`` for one arm's finished seeds.

    Raises:
        FileNotFoundError: no seed folder of this arm has a report.json (nothing finished).
    """
    out = {}
    for d in sorted(arm_dir.glob("seed*")):
        if not (d / "report.json").exists():
            continue  # unfinished: its curve would stop early
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        out[int(d.name[4:])] = [(r["step"], r["dev_accuracy"], r.get("epsilon", float("nan")))
                                for r in rows if "dev_accuracy" in r]
    if not out:
        raise FileNotFoundError(f"{arm_dir}: no finished seed (seed*/report.json)")
    return out


def summarise(runs: dict[int, list]) -> list[tuple[int, float, float, int]]:
    """Per evaluated step: (step, mean accuracy, sample sd (0 for one seed), seeds)."""
    by_step: dict[int, list[float]] = {}
    for rows in runs.values():
        for step, acc, _ in rows:
            by_step.setdefault(step, []).append(acc)
    return [(s, statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))
            for s, v in sorted(by_step.items())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", help="folder with one sub-folder per arm (dpsgd, banded_b4, …)")
    ap.add_argument("--arms", default=None, help="comma-separated arms (default: every arm found)")
    ap.add_argument("--out", required=True, help="output path without extension (.png and .md written)")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    root = Path(a.runs)
    names = a.arms.split(",") if a.arms else sorted(p.name for p in root.iterdir() if p.is_dir())
    arms = {}
    for n in names:
        try:
            arms[n] = load_arm(root / n)
        except FileNotFoundError as e:
            print("skipped:", e)
    if not arms:
        raise SystemExit(f"no finished runs under {root}")
    curves = {n: summarise(r) for n, r in arms.items()}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n, c in curves.items():
        steps = [s for s, *_ in c]
        mean = [m for _, m, _, _ in c]
        sd = [x for _, _, x, _ in c]
        seeds = max(k for *_, k in c)
        ax.plot(steps, mean, marker="o", ms=3, label=f"{n} ({seeds} seeds)")
        ax.fill_between(steps, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("SST-2 dev accuracy")
    ax.set_title(a.title or root.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)

    steps = sorted({s for c in curves.values() for s, *_ in c})
    lines = [f"# Dev accuracy against steps: {a.title or root.name}", "",
             f"Command: `python benchmarks/banded_mf_curves.py {a.runs} --out {a.out}`; plot: "
             f"`{out.with_suffix('.png').name}`. Mean ± sample sd over seeds at each evaluation.", "",
             "| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for s in steps:
        cells = []
        for c in curves.values():
            hit = [(m, x, k) for st, m, x, k in c if st == s]
            cells.append(f"{hit[0][0]:.3f} ± {hit[0][1]:.3f}" if hit else "–")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    eps = {n: [rows[-1][2] for rows in r.values() if rows] for n, r in arms.items()}
    lines += ["", "ε at the last evaluation (each run's ledger): "
              + "; ".join(f"{n}: {', '.join(f'{e:.3f}' for e in v)}" for n, v in eps.items())]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
