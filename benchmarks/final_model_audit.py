"""Final-model one-run audit (issue 37): ε̂ of the black-box audit for ε ∈ {1, 4, 8} and a
non-private run, on the real stories260K causal LM (Llama, 260K parameters, TinyStories
weights) fine-tuned on E2E NLG references, and calibration with planted bugs.

Each row is one `dpft audit RECIPE --final-model` run (audit/final_model.py): the recipe trained
once through the Trainer with m canaries per design (rare-token and random-token, each canary
in with a secret fair coin), scored on the final model only, ε̂ of both one-run estimators at
95 % confidence. Writes benchmarks/results/final_model_audit.md (and .json beside it).

    DPFT_DATA_DIR=../shared/data PYTHONPATH=src python benchmarks/final_model_audit.py \
        [--m 250] [--steps 100] [--rows 1000] [--seeds 1] [--eps 1 4 8 inf] [--plant]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dpft.audit.final_model import audit_final_model
from dpft.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("DPFT_DATA_DIR", ROOT.parent / "shared" / "data"))


def recipe(eps: float, a) -> object:
    ov = {"name": f"stories-e2e-eps{eps}", "model.name": str(DATA / "models" / "stories260K"),
          "model.max_length": a.max_length, "task.name": "text", "task.unit": "document",
          "task.train_file": str(DATA / "e2e" / "trainset.csv"), "task.text_column": "ref",
          "task.max_train_examples": a.rows, "task.max_dev_examples": 64,
          "batch.expected_batch_size": a.batch, "batch.max_physical_batch_size": a.batch,
          "schedule.steps": a.steps, "eval.every_steps": 10 ** 6, "checkpoint_every": 10 ** 6,
          "optimizer.name": "adam", "optimizer.lr": a.lr, "privacy.delta": 1e-5, "privacy.clipping.max_norm": 1.0}
    if math.isinf(eps):
        ov["privacy.enabled"] = False
    else:
        ov["privacy.target_epsilon"] = eps
    return load_recipe(None, ov)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=250)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--dirac", type=int, default=5000, help="white-box Dirac canaries on the same run")
    ap.add_argument("--eps", type=float, nargs="*", default=[1.0, 4.0, 8.0, math.inf])
    ap.add_argument("--plant", action="store_true", help="also noise/4 and clipping off at the first --eps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "final_model_audit"))
    ap.add_argument("--append", nargs="*", default=[],
                    help="JSON files of earlier invocations (same sizes) whose rows come first")
    a = ap.parse_args()
    runs = [(e, None) for e in a.eps]
    if a.plant:  # the planted bugs right after the first ε (the calibration comes before the sweep)
        runs[1:1] = [(a.eps[0], "noise/4"), (a.eps[0], "clipping off")]
    rows = [row for f in a.append for row in json.loads(Path(f).read_text())["rows"]]
    if not runs:  # only the table of earlier rows
        return write(a, rows)
    for eps, bug in runs:
        for seed in range(a.seeds):
            d = Path(tempfile.mkdtemp(prefix="fma-"))
            t0 = time.perf_counter()
            res = audit_final_model(recipe(eps, a), d / "run", m=a.m, designs=["rare", "random"], planted=bug,
                                    progress=False, dirac=a.dirac)
            row = {"eps_target": eps, "planted": bug, "seed": seed, "dirac": a.dirac if res.get("whitebox") else None,
                   "certified": res["certified_epsilon"],
                   "sigma": res["sigma"], "n": res["n_train_with_canaries"], "seconds": time.perf_counter() - t0,
                   **{f"{x['design']}_{k}": b["epsilon"] for x in res["designs"] for k, b in x["bounds"].items()},
                   **{f"{x['design']}_gap": x["mean_score_in"] - x["mean_score_out"] for x in res["designs"]},
                   **{f"wb_{k}": b["epsilon"] for k, b in ((res.get("whitebox") or {}).get("bounds") or {}).items()},
                   **{f"wb_sum_{k}": v for k, v in ((res.get("whitebox") or {}).get("bounds_sum") or {}).items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(d, ignore_errors=True)
            write(a, rows)


def write(a, rows: list) -> None:
    """The table so far (rewritten after every run: a stopped benchmark keeps its rows)."""
    Path(a.out + ".json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    cmd = "DPFT_DATA_DIR=../shared/data PYTHONPATH=src python benchmarks/final_model_audit.py " + " ".join(sys.argv[1:])
    lines = ["# Final-model one-run audit (issue 37): ε̂ / ε, black-box", "",
             f"Command: `{cmd}`", "",
             f"Way in: `dpft train` (the Trainer, via `dpft audit RECIPE --final-model`). Model: stories260K (real "
             f"Llama, 260K parameters, full fine-tuning), data: E2E NLG references, first {a.rows} rows (one document = "
             f"one example, ≤ {a.max_length} tokens), Poisson B = {a.batch}, T = {a.steps} steps, Adam lr {a.lr}, "
             f"C = 1, δ = 1e-5. m = {a.m} canaries per design, both designs in the same run (N grows by the "
             f"included ones). ε̂ at 95 % confidence each; seeds per row: {a.seeds}. CPU (2 shared cores).", "",
             "| ε target | planted | seed | certified ε | σ | rare ε̂ f-DP | rare ε̂ Steinke | random ε̂ f-DP | "
             "random ε̂ Steinke | white-box ε̂ f-DP / Steinke (Dirac m) | ε̂/ε (rare, f-DP) | white-box ε̂/ε | "
             "mean score gap rare / random (nats) | time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cert = r["certified"]
        ratio = "—" if cert is None else f"{r['rare_fdp'] / cert:.2f}"
        wb = "—" if r.get("wb_fdp") is None else f"{r['wb_fdp']:.3f} / {r['wb_steinke']:.3f} ({r.get('dirac', 200)}"
        if r.get("wb_fdp") is not None:  # score: log-likelihood ratio (sum of coordinates in older rows)
            wb += (f"; LR score, sum: {r['wb_sum_fdp']:.3f} / {r['wb_sum_steinke']:.3f})" if "wb_sum_fdp" in r
                   else "; sum score)")
        wratio = "—" if cert is None or r.get("wb_fdp") is None else f"{r['wb_fdp'] / cert:.2f}"
        lines.append(f"| {'∞ (non-private)' if math.isinf(r['eps_target']) else r['eps_target']:} | "
                     f"{r['planted'] or '—'} | {r['seed']} | {'none' if cert is None else f'{cert:.3f}'} | "
                     f"{r['sigma']:.3g} | {r['rare_fdp']:.3f} | {r['rare_steinke']:.3f} | {r['random_fdp']:.3f} | "
                     f"{r['random_steinke']:.3f} | {wb} | {ratio} | {wratio} | {r['rare_gap']:.3g} / {r['random_gap']:.3g} | "
                     f"{r['seconds']:.0f} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
