"""DP-SFT 2 × 2 at ε = 4 (issue 18): start from θ₀ or from the public IMDB Θ*, × Full-DP
(DP-AdamW on the trainable parameters) or DP-SFT-public (k coordinates of a public IMDB basis).

Arms (recipes/sst2-minilm-dpsft.yaml for all, so every arm trains the same parameters):

* ``theta0-full``: Full-DP from θ₀ (``subspace.source: none``);
* ``theta0-sft``: DP-SFT-public, stage 2 from θ₀ (``subspace.start: initial``);
* ``imdb-sft``: DP-SFT-public from Θ* (Algorithm 3, the recipe's default);
* ``imdb-full``: Full-DP from Θ* — the model stage 1 of ``imdb-sft`` wrote for the same seed
  (``<imdb-sft>/seedS/subspace/stage1/model``), so the two Θ* arms share Θ*;
* with ``--paper-noise``: ``theta0-full-paper`` / ``imdb-full-paper``, the paper's noise
  placement (σC after averaging = σB on the sum, ``subspace.paper_noise_placement``; certified
  as an upper bound, see methods/dpsft/method.py) — does it explain the paper's weak Full-DP baseline?

* with ``--tuned``: ``theta0-full-tuned`` / ``imdb-full-tuned`` (and ``*-tuned-paper`` with
  ``--paper-noise``): Full-DP with the demo's fix for a fresh head (head_body clipping, head lr
  1e-2, body lr 3e-4), so the Full-DP baseline is not lost to the shared recipe's flat clip.
Every arm is paired against ``theta0-full``; the ledger's ε is in every row. Further paired
tables: each cell of the 2 × 2 against its neighbour (``imdb-sft`` vs ``imdb-full``,
``theta0-sft`` vs ``theta0-full-tuned`` …) and each paper-noise arm against its certified twin.

    python benchmarks/dpsft_2x2.py --seeds 3 --n 4000 --out runs/dpsft2x2 --md benchmarks/results/dpsft_2x2.md
    python benchmarks/dpsft_2x2.py --smoke --seeds 2       # tiny model and data: plumbing only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _experiment import Arm, run_experiment, seeds_arg, smoke_assets, smoke_overrides, table, write  # noqa: E402

RECIPE = "recipes/sst2-minilm-dpsft.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="3")
    ap.add_argument("--eps", type=float, default=4.0)
    ap.add_argument("--n", type=int, default=None, help="task.max_train_examples")
    ap.add_argument("--paper-noise", action="store_true", help="add the paper's noise placement arms")
    ap.add_argument("--tuned", action="store_true", help="add Full-DP arms with head_body clipping and a head lr")
    ap.add_argument("--out", default="runs/dpsft2x2")
    ap.add_argument("--md", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    common: dict = {"privacy.target_epsilon": a.eps}
    if a.n:
        common["task.max_train_examples"] = a.n
    if a.smoke:
        assets = smoke_assets(Path(tempfile.gettempdir()) / "dpft_smoke")
        common.update(smoke_overrides(assets))
        common.update({"privacy.delta": 1e-3, "schedule.steps": 3, "eval.every_steps": 3, "checkpoint_every": 3,
                       "batch.expected_batch_size": 16, "subspace.k": 4, "subspace.steps": 4,
                       "subspace.expected_batch_size": 8,
                       "subspace.public_task": {"name": "files", "train_file": assets["public"]}})
    seeds = seeds_arg(a.seeds)
    out = Path(a.out)
    stage1 = lambda s: {"model.name": str((out / "imdb-sft" / f"seed{s}" / "subspace" / "stage1" / "model").resolve())}  # noqa: E731
    full = {"subspace.source": "none"}
    first = [Arm("theta0-full", RECIPE, dict(full)),
             Arm("theta0-sft", RECIPE, {"subspace.start": "initial"}),
             Arm("imdb-sft", RECIPE, {})]
    if a.paper_noise:
        first.append(Arm("theta0-full-paper", RECIPE, {**full, "subspace.paper_noise_placement": True}))
    rows = run_experiment(first, seeds, out, common=common, jobs=a.jobs)
    second = [Arm("imdb-full", RECIPE, dict(full), per_seed=stage1)]  # needs imdb-sft's Θ* of the same seed
    if a.paper_noise:
        second.append(Arm("imdb-full-paper", RECIPE, {**full, "subspace.paper_noise_placement": True},
                          per_seed=stage1))
    tuned = {**full, "privacy.clipping.style": "head_body", "privacy.clipping.head_fraction": 0.5,
             "optimizer.lr": 3e-4, "optimizer.head_lr": 1e-2}
    if a.tuned:
        second += [Arm("theta0-full-tuned", RECIPE, dict(tuned)),
                   Arm("imdb-full-tuned", RECIPE, dict(tuned), per_seed=stage1)]
        if a.paper_noise:
            second += [Arm("theta0-full-tuned-paper", RECIPE, {**tuned, "subspace.paper_noise_placement": True})]
    rows += run_experiment(second, seeds, out, common=common, jobs=a.jobs)
    md = table(rows, reference="theta0-full", title=f"DP-SFT 2 × 2 at ε = {a.eps:g}",
               note="Θ* = stage 1 of imdb-sft (non-private fine-tuning on public IMDB; no privacy cost). "
                    "`*-paper`: noise σ·C·B on the sum (σC after averaging), ledger at σ (an upper bound).")
    have = {r["arm"] for r in rows}
    for ref, arm in (("imdb-full", "imdb-sft"), ("theta0-full-tuned", "theta0-sft"), ("imdb-full-tuned", "imdb-sft"),
                     ("theta0-full-tuned", "imdb-full-tuned"), ("imdb-full", "imdb-full-paper"),
                     ("theta0-full", "theta0-full-paper"), ("theta0-full-tuned", "theta0-full-tuned-paper")):
        if ref in have and arm in have:
            md += "\n" + table([r for r in rows if r["arm"] in (ref, arm)], reference=ref, title=f"{arm} vs {ref}")
    print(md)
    if a.md:
        write(md, a.md)


if __name__ == "__main__":
    main()
