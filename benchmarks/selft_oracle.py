"""DP-SelFT scoring study on an oracle synthetic set (issue 18): is the unit selection or the DP
synthetic labels the bottleneck?

Oracle synthetic set: ``--oracle`` (600) held-out real training sentences with their TRUE
labels (no DP select-and-label), split 70 / 30 into synthetic train / validation. The rest of
the training set (``--n`` of it) is the private set of the ground-truth runs.

Scorers (selection/scoring.py, Eq. 21 scorer unless ``--score-update adamw``), one score per
unit of ``--granularity``:

* ``none`` — clean one-step update, accuracy (ties: lower val loss);
* ``random`` — Gaussian ξ of the downstream scale;
* ``worst`` — worst-case ξ* (DP-SelFT);
* ``loss`` — clean update, lowest synthetic val loss;
* ``gradient`` — mean clipped gradient norm per √d.

Ground truth: one DP fine-tune per unit (``trainable.mode: units``, the unit + head) at
``--eps`` (default 5) on the private set, ``--seeds`` seeds each; dev accuracy on the task's
dev split. Spearman's ρ of each scorer against the mean ground truth (scipy), with its p-value.

    python benchmarks/selft_oracle.py --seeds 3 --n 4000 --out runs/selft_oracle --md benchmarks/results/selft_oracle.md
    python benchmarks/selft_oracle.py --smoke --seeds 2    # tiny model and data: plumbing only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _experiment import Arm, run_experiment, seeds_arg, smoke_assets, smoke_overrides, table, write  # noqa: E402

RECIPE = "recipes/sst2-minilm.yaml"
SCORERS = ("none", "random", "worst", "loss", "gradient")


def split_data(task_cfg, oracle: int, n: int | None, out: Path, seed: int = 0):
    """Hold out ``oracle`` training rows (seeded) as the oracle synthetic set; write the rest (first
    ``n``) and the dev split to CSV for the ground-truth runs. Returns (oracle rows, private
    train CSV, dev CSV, num_labels)."""
    import random

    from dpft.data.tasks import load_task

    task = load_task(task_cfg, seed=seed)
    idx = list(range(len(task.train)))
    random.Random(seed).shuffle(idx)
    if oracle >= len(idx):
        raise SystemExit(f"--oracle {oracle} leaves no private training rows (train has {len(idx)})")
    orc = [(task.train[i]["text"], int(task.train[i]["label"])) for i in idx[:oracle]]
    rest = idx[oracle:][: n or None]
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    pd.DataFrame({"text": [task.train[i]["text"] for i in rest],
                  "label": [int(task.train[i]["label"]) for i in rest]}).to_csv(out / "private_train.csv", index=False)
    pd.DataFrame({"text": list(task.dev["text"]), "label": [int(y) for y in task.dev["label"]]}).to_csv(
        out / "dev.csv", index=False)
    return orc, out / "private_train.csv", out / "dev.csv", task.num_labels, len(rest)


def score_all(rec, num_labels: int, orc, sigma: float, update: str,
              granularity: str) -> dict[str, dict[str, float]]:
    """{scorer: {unit: score}} (higher = better) on the oracle set, with the model, clipping and
    learning rates of the ground-truth recipe ``rec`` (as DP-SelFT scores: methods/selft.py)."""
    import datasets

    from dpft.data.tokenize import tokenize_split
    from dpft.models.load import load_classifier, set_dropout
    from dpft.models.units import unit_map
    from dpft.selection.scoring import ScoreSettings, score_units

    seed, max_length = rec.seed, rec.model.max_length
    tok, model = load_classifier(rec.model.name, num_labels, seed=seed, pooling=rec.model.pooling,
                                 head_dropout=rec.model.head_dropout)
    if rec.model.dropout is not None:
        set_dropout(model, rec.model.dropout)
    clip = rec.privacy.clipping
    k = int(0.7 * len(orc))

    def rows(pairs):
        ds = datasets.Dataset.from_dict({"text": [t for t, _ in pairs], "label": [y for _, y in pairs]})
        return list(tokenize_split(ds, tok, max_length))

    tr, va = rows(orc[:k]), rows(orc[k:])
    units = [u for u in unit_map(model, granularity) if u != "head"]
    wtt = "token_type_ids" in tok.model_input_names
    out: dict[str, dict[str, float]] = {}
    cache: dict[str, dict] = {}
    for pert in ("none", "random", "worst"):
        s = ScoreSettings(perturbation=pert, update=update, lr=rec.optimizer.lr, clip_norm=clip.max_norm, sigma=sigma,
                          downstream_batch=rec.batch.expected_batch_size, max_length=max_length, seed=seed,
                          clip_style=clip.style, head_fraction=clip.head_fraction, head_lr=rec.optimizer.head_lr)
        cache[pert] = score_units(model, tr, va, s, granularity, units=units, pad_id=tok.pad_token_id or 0,
                                  with_token_types=wtt)
    for pert in ("none", "random", "worst"):  # accuracy, ties broken by lower val loss
        out[pert] = {u: v.accuracy - 1e-6 * v.val_loss for u, v in cache[pert].items()}
    out["loss"] = {u: -v.val_loss for u, v in cache["none"].items()}
    out["gradient"] = {u: v.grad_norm / max(v.dim, 1) ** 0.5 for u, v in cache["none"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="3")
    ap.add_argument("--eps", type=float, default=5.0)
    ap.add_argument("--oracle", type=int, default=600)
    ap.add_argument("--n", type=int, default=None, help="private training rows (default: all the rest)")
    ap.add_argument("--steps", type=int, default=None, help="schedule.steps of the ground-truth runs (default: recipe's)")
    ap.add_argument("--batch", type=int, default=None, help="expected batch of the ground-truth runs (default: recipe's)")
    ap.add_argument("--granularity", default="block")
    ap.add_argument("--score-update", default="eq21", choices=["eq21", "adamw"])
    ap.add_argument("--out", default="runs/selft_oracle")
    ap.add_argument("--md", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from scipy.stats import spearmanr

    from dpft.accounting.calibrate import calibrate_sigma
    from dpft.config.recipe import load_recipe

    out = Path(a.out)
    common: dict = {"privacy.target_epsilon": a.eps}
    if a.steps:
        common.update({"schedule.steps": a.steps, "eval.every_steps": a.steps, "checkpoint_every": a.steps})
    if a.batch:
        common["batch.expected_batch_size"] = a.batch
    if a.smoke:
        assets = smoke_assets(Path(tempfile.gettempdir()) / "dpft_smoke")
        common.update(smoke_overrides(assets))
        common.update({"privacy.delta": 1e-3, "schedule.steps": 3, "eval.every_steps": 3, "checkpoint_every": 3,
                       "batch.expected_batch_size": 16})
        a.oracle = min(a.oracle, 20)
    rec = load_recipe(RECIPE, {**common, **({"task.train_file": common["task.train_file"]} if a.smoke else {})})
    orc, train_csv, dev_csv, k_labels, n_priv = split_data(rec.task, a.oracle, a.n, out / "data")
    common.update({"task.name": "files", "task.train_file": str(train_csv.resolve()),
                   "task.dev_file": str(dev_csv.resolve()), "task.max_train_examples": None})
    b, steps = rec.batch.expected_batch_size, rec.schedule.steps
    sigma = calibrate_sigma(a.eps, rec.privacy.delta, b / n_priv, steps)
    t0 = time.time()
    scores = score_all(rec, k_labels, orc, sigma, a.score_update, a.granularity)
    t_score = time.time() - t0
    units = list(scores["none"])
    arms = [Arm(f"unit-{u}", RECIPE, {"trainable.mode": "units", "trainable.units": [u]}) for u in units]
    rows = run_experiment(arms, seeds_arg(a.seeds), out, common=common, jobs=a.jobs)
    gt = {u: statistics.fmean(r["value"] for r in rows if r["arm"] == f"unit-{u}" and "error" not in r)
          for u in units if any(r["arm"] == f"unit-{u}" and "error" not in r for r in rows)}
    md = [f"## DP-SelFT scoring on an oracle synthetic set ({len(orc)} held-out true-labelled sentences)", "",
          f"Ground truth: per-unit DP fine-tunes at ε = {a.eps:g} (σ = {sigma:.4g}, B = {b}, {steps} steps, "
          f"N = {n_priv}), {len(seeds_arg(a.seeds))} seeds. Scorer update: {a.score_update}; scoring took "
          f"{t_score:.0f} s.", "",
          "| scorer | Spearman ρ vs ground truth | p | top unit | " + " | ".join(units) + " |",
          "|---|---|---|---|" + "---|" * len(units)]
    common_units = [u for u in units if u in gt]
    for sc in SCORERS:
        v = scores[sc]
        if len(common_units) >= 3:
            rho, p = spearmanr([v[u] for u in common_units], [gt[u] for u in common_units])
            rs, ps = f"{rho:+.3f}", f"{p:.3g}"
        else:
            rs, ps = "—", "— (need ≥ 3 units)"
        md.append(f"| {sc} | {rs} | {ps} | {max(v, key=v.get)} | " + " | ".join(f"{v[u]:.4g}" for u in units) + " |")
    md.append("| **ground truth** (dev acc) | | | " + (max(gt, key=gt.get) if gt else "—") + " | "
              + " | ".join(f"{gt[u]:.4f}" if u in gt else "—" for u in units) + " |")
    md += ["", table(rows, title="Ground-truth runs (paired against the first unit)")]
    (out / "scores.json").write_text(json.dumps({"scores": scores, "ground_truth": gt, "sigma": sigma}, indent=1))
    text = "\n".join(md) + "\n"
    print(text)
    if a.md:
        write(text, a.md)


if __name__ == "__main__":
    main()
