"""Banded MF vs DP-SGD, and truncated vs plain Poisson, on SST-2 with MiniLM (issue 28)
→ benchmarks/results/banded_mf.md.

Arms (the top ``--last-k`` blocks + head trained, so the b − 1 noise buffers are small; several
epochs over a ``--n``-example subset, where correlated noise can help; same ε, δ = 1e-5, σ
calibrated per arm on its own ledger events):

* ``dpsgd``: plain Poisson, independent noise (the reference);
* ``banded_b{b}``: ``privacy.mechanism: banded_mf`` with b bands (cyclic Poisson, p = bB/N);
* ``truncated``: plain noise, ``batch.max_batch_size`` = B + 4√B (check steps × P[truncation] ≪ δ first: docs/mechanisms.md; truncation probability ≈ 3e-5,
  its ε cost negligible) — utility should equal ``dpsgd``.

Every arm runs once per seed (≥ 3), paired on the same dev examples (McNemar, paired bootstrap):
``benchmarks/_experiment.py``. Optimizer SGD with momentum 0 (the factorization targets SGD's
running sum; Adam would dilute the cancellation).

    PYTHONPATH=src DPFT_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \\
      python benchmarks/banded_mf_sst2.py --seeds 0,1,2 --eps 8 --bands 4,8 --n 4000 --epochs 4

(CPU: about 2 × n·epochs / 3000 minutes per run with 2 threads; a GPU: ``--set perf.device=cuda``.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _experiment import Arm, run_experiment, seeds_arg, table, write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=seeds_arg, default=[0, 1, 2])
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--bands", default="4,8")
    ap.add_argument("--n", type=int, default=4000, help="training examples (subset of SST-2 train)")
    ap.add_argument("--epochs", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--last-k", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--max-dev", type=int, default=872)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None, help="run folder (default runs/banded_mf_sst2_eps<ε>)")
    ap.add_argument("--results", default=None, help="table (default benchmarks/results/banded_mf_sst2_eps<ε>.md)")
    ap.add_argument("--no-truncated", action="store_true")
    ap.add_argument("--eval-every", type=int, default=1000000,
                    help="dev evaluation every this many steps (metrics.jsonl: the accuracy-vs-steps plot)")
    a = ap.parse_args()
    a.out = a.out or str(ROOT / "runs" / f"banded_mf_sst2_eps{a.eps:g}")
    a.results = a.results or str(ROOT / "benchmarks" / "results" / f"banded_mf_sst2_eps{a.eps:g}.md")
    common = {"task.max_train_examples": a.n, "task.max_dev_examples": a.max_dev, "privacy.target_epsilon": a.eps,
              "privacy.delta": 1e-5, "schedule.epochs": a.epochs, "schedule.steps": None,
              "batch.expected_batch_size": a.batch, "batch.max_physical_batch_size": 64,
              "trainable.mode": "last_k", "trainable.last_k": a.last_k, "optimizer.name": "sgd",
              "optimizer.lr": a.lr, "optimizer.head_lr": None, "schedule.warmup_steps": 0,
              "eval.every_steps": a.eval_every, "checkpoint_every": 1000000, "eval.save_predictions": True}
    recipe = "recipes/sst2-minilm.yaml"
    arms = [Arm("dpsgd", recipe)]
    for b in [int(x) for x in a.bands.split(",") if x]:
        arms.append(Arm(f"banded_b{b}", recipe, {"privacy.mechanism": "banded_mf", "privacy.bands": b}))
    if not a.no_truncated:
        arms.append(Arm("truncated", recipe, {"batch.max_batch_size": int(a.batch + 4 * math.sqrt(a.batch))}))
    rows = run_experiment(arms, a.seeds, a.out, common=common, jobs=a.jobs)
    md = table(rows, reference="dpsgd", title=f"SST-2, MiniLM top {a.last_k} block(s) + head, N = {a.n}, "
                                              f"{a.epochs:g} epochs, B = {a.batch}, ε = {a.eps:g}",
               note="Command: `python benchmarks/banded_mf_sst2.py " + " ".join(sys.argv[1:]) + "`")
    write("# Banded MF vs DP-SGD; truncated vs plain Poisson\n\n" + md, a.results)
    print(md)


if __name__ == "__main__":
    main()
