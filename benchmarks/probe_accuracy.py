#!/usr/bin/env python
"""DP linear probing on SST-2 at 5,000 rows (issue 45 item 2): dev accuracy of
``recipes/probe-minilm.yaml`` at several ε, several runs each (fresh secret randomness and head
seed per run), and the time per run.

All runs share one feature cache (run/features.py ``feature_cache``: the seam ``dpft tune``
trials use): the first run computes the frozen encoder's pooled features once, the others reuse
them (their key — frozen weights, tokenised rows, settings — matches). "run s" is each run's
``Trainer.run`` (steps, evaluations, report, model save); setup (model load, tokenisation, the one
feature pass for the first run) is listed apart.

Usage::

    python benchmarks/probe_accuracy.py --eps 8 3 --seeds 0 1 2 --rows 5000
    python benchmarks/probe_accuracy.py --eps 8 --seeds 0 --set optimizer.lr=0.05   # a variant

Writes ``benchmarks/results/probe_minilm.md`` (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _value(v: str):
    import yaml

    return yaml.safe_load(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", nargs="+", type=float, default=[8.0, 3.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="key=value recipe overrides")
    ap.add_argument("--nonprivate", action="store_true", help="also one run with privacy.enabled: false")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "probe_minilm.md"))
    args = ap.parse_args()
    import torch

    from dpft.config.recipe import load_recipe
    from dpft.run.loop import Trainer

    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    extra = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    cache = None
    rows = []
    arms = [(e, s) for e in args.eps for s in args.seeds] + ([(None, 0)] if args.nonprivate else [])
    for eps, seed in arms:
        ov = {"task.max_train_examples": args.rows, "seed": seed, **extra}
        if eps is None:
            ov["privacy.enabled"] = False
        else:
            ov["privacy.target_epsilon"] = eps
        rec = load_recipe(str(root / "recipes" / "probe-minilm.yaml"), ov)
        out = Path(tempfile.mkdtemp(prefix="probe-")) / "run"
        t0 = time.perf_counter()
        tr = Trainer(rec, out, progress=False, features=cache)
        setup = time.perf_counter() - t0
        if cache is None:
            cache = tr.plan.features
            line = cache.describe()
        t1 = time.perf_counter()
        rep = tr.run()
        run = time.perf_counter() - t1
        acc = rep["metrics"]["dev_accuracy"]
        r = {"eps": eps, "seed": seed, "acc": acc, "setup": setup, "run": run, "steps": tr.total_steps,
             "sigma": tr.sigma, "eps_spent": tr.epsilon_now()}
        print(r, file=sys.stderr, flush=True)
        rows.append(r)
    if cache is not None:
        cache.store.close()
    lines = [f"# DP linear probe, all-MiniLM-L6-v2 mean-pooled features, SST-2 {args.rows} rows ({_dt.date.today()})",
             "", "Recipe `recipes/probe-minilm.yaml`" + (f" with {extra}" if extra else "") +
             f"; dev = SST-2 validation (872 rows); CPU, {args.threads} threads, machine shared with other "
             "sessions. Command: `python benchmarks/probe_accuracy.py " + " ".join(sys.argv[1:]) + "`", "",
             f"Feature cache: {line}", "",
             "| ε | seed | σ | steps | dev acc | setup s | run s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        e = "∞ (no DP)" if r["eps"] is None else f"{r['eps']:g}"
        lines.append(f"| {e} | {r['seed']} | {r['sigma']:.3g} | {r['steps']} | {r['acc']:.4f} | {r['setup']:.1f} | "
                     f"{r['run']:.1f} |")
    lines.append("")
    for e in args.eps:
        a = [r["acc"] for r in rows if r["eps"] == e]
        sd = statistics.stdev(a) if len(a) > 1 else 0.0
        lines.append(f"- ε = {e:g}: dev accuracy {statistics.mean(a):.4f} ± {sd:.4f} (mean ± sd over {len(a)} runs)")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
