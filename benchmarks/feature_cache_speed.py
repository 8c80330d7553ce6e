#!/usr/bin/env python
"""Frozen features computed once (issue 45 item 1): time per step and per run, cache off → on.

For each scope (``head``, ``last_k: 2``) on the real all-MiniLM-L6-v2 (mean pooling, dropout 0,
the demo recipe's settings) and the first ``--rows`` SST-2 training rows, one ``dpft train``
Trainer is built and run with ``perf.feature_cache: off`` and then ``on`` (the same recipe,
reproducible mode, so both runs make the same releases), and the script reports:

* setup: seconds to build the plan (model load, tokenisation; with the cache: the one forward
  pass over the training and dev rows);
* s/step: median wall time of the steps after the first (the first step carries the engine's
  one-time check);
* run: seconds of ``Trainer.run`` (steps, evaluations every ``--eval-every`` steps, checkpoints,
  report); total = setup + run.

Usage::

    python benchmarks/feature_cache_speed.py --rows 5000 --steps 6 --threads 2
    python benchmarks/feature_cache_speed.py --scopes head --rows 5000 --steps 20 --batch 1250
    python benchmarks/feature_cache_speed.py --scopes last_k2 --steps 4 --interleave 10   # ratio in one run

Writes ``benchmarks/results/feature_cache_speed.md`` (``--out``) and prints it.
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

SCOPES = {"head": {"trainable.mode": "head"},
          "last_k2": {"trainable.mode": "last_k", "trainable.last_k": 2}}


def _trainer(scope: str, cache: str, args, steps: int | None = None):
    """The ``dpft train`` Trainer of ``scope`` with the feature cache ``cache`` (built, not run)."""
    from dpft.config.recipe import load_recipe
    from dpft.run.loop import Trainer

    root = Path(__file__).resolve().parents[1]
    ov = {"task.max_train_examples": args.rows, "schedule.steps": steps or args.steps, "privacy.reproducible": True,
          "batch.expected_batch_size": args.batch, "batch.max_physical_batch_size": args.physical,
          "eval.every_steps": args.eval_every, "checkpoint_every": 10 ** 6, "perf.feature_cache": cache,
          "optimizer.head_lr": None, **SCOPES[scope]}
    if scope == "head":
        ov["privacy.clipping.style"] = "flat"
    rec = load_recipe(str(root / "recipes" / "sst2-minilm.yaml"), ov)
    return Trainer(rec, Path(tempfile.mkdtemp(prefix=f"fcs-{scope}-{cache}-")) / "run", progress=False)


def run_one(scope: str, cache: str, args) -> dict:
    t0 = time.perf_counter()
    tr = _trainer(scope, cache, args)
    setup = time.perf_counter() - t0
    times: list[float] = []
    inner = tr.step

    def timed(i):
        s = time.perf_counter()
        o = inner(i)
        times.append(time.perf_counter() - s)
        return o

    tr.step = timed
    t1 = time.perf_counter()
    rep = tr.run()
    run = time.perf_counter() - t1
    later = times[1:] or times
    acc = rep.get("metrics", {}).get("dev_accuracy") if isinstance(rep, dict) else None
    return {"scope": scope, "cache": cache, "setup": setup, "first": times[0], "step": statistics.median(later),
            "run": run, "total": setup + run, "steps": len(times), "acc": acc,
            "eps": tr.epsilon_now(), "cached": tr.plan.features is not None,
            "cache_line": tr.plan.features.describe() if tr.plan.features is not None else ""}


def interleaved(scope: str, args) -> dict:
    """Both Trainers built, then their steps alternate (off, on, off, on, …) so that a change of the machine's
    load hits both alike: the median of the paired ratios off / on over the steps after the first."""
    off, on = (_trainer(scope, c, args, max(args.steps, args.interleave)) for c in ("off", "on"))
    t_off, t_on = [], []
    for i in range(args.interleave):
        for tr, times in ((off, t_off), (on, t_on)):
            t0 = time.perf_counter()
            tr.step(i)
            times.append(time.perf_counter() - t0)
    pairs = [a / b for a, b in zip(t_off[1:], t_on[1:])]
    return {"scope": scope, "pairs": len(pairs), "ratio": statistics.median(pairs),
            "off": statistics.median(t_off[1:]), "on": statistics.median(t_on[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scopes", nargs="+", default=list(SCOPES), choices=list(SCOPES))
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--physical", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=10 ** 6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--interleave", type=int, default=0,
                    help="also alternate N steps of the two Trainers and report the median paired ratio")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "feature_cache_speed.md"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for scope in args.scopes:
        for cache in ("off", "on"):
            r = run_one(scope, cache, args)
            print(r, file=sys.stderr, flush=True)
            rows.append(r)
    lines = [f"# Frozen features computed once: cache off → on ({_dt.date.today()})", "",
             f"CPU, {args.threads} threads (machine shared with other sessions: expect noise), all-MiniLM-L6-v2, "
             f"mean pooling, dropout 0; first {args.rows} SST-2 training rows, 872 dev rows; "
             f"{args.steps} steps of expected batch {args.batch} (physical {args.physical}); reproducible mode. "
             "Command: `python benchmarks/feature_cache_speed.py " + " ".join(sys.argv[1:]) + "`", "",
             "| scope | cache | setup s | first step s | s/step (median, later steps) | run s | total s | ε | "
             "dev acc |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acc']:.4f}" if isinstance(r["acc"], float) else "–"
        lines.append(f"| {r['scope']} | {r['cache']} | {r['setup']:.1f} | {r['first']:.2f} | {r['step']:.3f} | "
                     f"{r['run']:.1f} | {r['total']:.1f} | {r['eps']:.3g} | {acc} |")
    lines.append("")
    for scope in args.scopes:
        off = next(r for r in rows if r["scope"] == scope and r["cache"] == "off")
        on = next(r for r in rows if r["scope"] == scope and r["cache"] == "on")
        lines.append(f"- {scope}: s/step {off['step']:.3f} → {on['step']:.3f} "
                     f"({off['step'] / max(on['step'], 1e-9):.1f}× faster); run {off['run']:.1f} → {on['run']:.1f} s; "
                     f"setup {off['setup']:.1f} → {on['setup']:.1f} s (the one feature pass). {on['cache_line']}")
    for scope in args.scopes if args.interleave > 1 else ():
        r = interleaved(scope, args)
        lines.append(f"- {scope}, interleaved ({r['pairs']} paired steps, off then on): median paired ratio "
                     f"**{r['ratio']:.2f}×** (median s/step {r['off']:.3f} off, {r['on']:.3f} on)")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
