"""Evidence for issue 35: three arms at the same ε and compute per final model, seeds × arms.

* ``tune``:  ``dpft tune`` at total ε (the whole search charged: every trial, its noisy score and
  the selection; Papernot & Steinke 2022), the released model evaluated once on the test file;
* ``hand``:  the hand-tuned recipe (``recipes/sst2-minilm.yaml`` by default) trained once at ε,
  tuning NOT charged (what users do today);
* ``nodp``:  non-private search over the SAME K hyperparameter draws as the ``tune`` arm's seed
  (exact dev accuracy on a split held out of the training rows), the best evaluated once.

Usage (sizes are arguments; the full evidence needs a GPU or hours of CPU)::

    python benchmarks/tune_evidence.py --recipe recipes/tune-sst2-minilm.yaml --seeds 0 1 2 \\
        --max-train-examples 5000 --test-file $DPFT_DATA_DIR/sst2/dev.tsv --out benchmarks/results/tune

Writes ``<out>/table.md`` and ``<out>/runs.json``: test accuracy mean ± sd per arm, paired
differences against ``tune`` (mean over seeds and a paired t-test over seeds), the ε of each arm.
What the table does NOT show: the variance of K (each seed draws its own K), the cost in compute of
the search (E[K] trials vs one run), and any other task or model than the one run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from dpft import train, tune  # noqa: E402
from dpft.config.recipe import load_recipe  # noqa: E402
from dpft.run.predict import predict, read_rows  # noqa: E402


def _test_accuracy(run_dir: Path, test_file: str) -> float:
    """Test accuracy of a run's model. A model whose class ids are a permutation of the task's (a search
    released before its trials kept the task's class order: SST-5's names sorted alphabetically) is
    scored by class name against the test file's labels, not by id."""
    res = predict(run_dir, test_file, output=run_dir / "test_predictions.jsonl", progress=False)
    rec = load_recipe(run_dir / "recipe.yaml")
    from dpft.data.tasks import REGISTRY

    spec = REGISTRY.get(rec.task.name)
    names, got = (spec.label_names if spec else None), res.get("labels")
    if not names or not got or got == names or sorted(got) != sorted(names):
        return float(res["accuracy"])
    gold = read_rows(test_file, spec.text, spec.pair, spec.label, names)["label"]
    lines = [json.loads(x) for x in (run_dir / "test_predictions.jsonl").read_text().splitlines()]
    return sum(names.index(x["label"]) == g for x, g in zip(lines, gold)) / len(gold)


def _held_out_dev(rec) -> dict:
    """Overrides that make a registered task read its training file as ``files`` with a dev split held out
    of it (dev_fraction), so that the non-private search never selects on the test file."""
    from dpft.data.tasks import REGISTRY, data_dir

    spec = REGISTRY.get(rec.task.name)
    if spec is None or spec.train_file is None or data_dir() is None:
        return {}
    return {"task.name": "files", "task.train_file": str(data_dir() / spec.train_file), "task.dev_file": None,
            "task.text_column": spec.text, "task.text_pair_column": spec.pair, "task.label_column": spec.label}


def run_seed(args, seed: int, out: Path) -> dict:
    base = {"seed": seed, "privacy.target_epsilon": args.epsilon}
    if args.max_train_examples:
        base["task.max_train_examples"] = args.max_train_examples
    for kv in args.set or []:
        k, v = kv.split("=", 1)
        base[k] = json.loads(v) if v[:1] in "[{0123456789-tfn" else v
    row = {"seed": seed}
    # (a) the private search, charged
    rec = load_recipe(args.recipe, base)
    d = out / f"tune-s{seed}"
    if not (d / "report.json").exists():
        shutil.rmtree(d, ignore_errors=True)
        tune(rec, d, progress=False)
    rep = json.loads((d / "report.json").read_text())
    k = json.loads((d / "tune_private" / "state.json").read_text())["k"]
    row.update(tune_eps=rep["epsilon"], k=k, tune_acc=_test_accuracy(d, args.test_file) if rep.get("chosen") else None)
    # (b) the hand-tuned recipe, tuning not charged
    hand = load_recipe(args.hand_recipe, {k2: v for k2, v in base.items() if not k2.startswith("tune.")})
    for k2, v in rec.model_dump(mode="json")["model"].items():  # same model as the search
        setattr(hand.model, k2, v)
    d = out / f"hand-s{seed}"
    if not (d / "report.json").exists():
        shutil.rmtree(d, ignore_errors=True)
        train(hand, d, progress=False)
    row.update(hand_eps=json.loads((d / "report.json").read_text())["privacy"].get("epsilon"),
               hand_acc=_test_accuracy(d, args.test_file))
    if args.auto:  # (d) the hand recipe with budget-aware defaults: B and T chosen by the accountant
        epochs, n = base.get("schedule.epochs"), args.max_train_examples
        budget = int(round(float(epochs) * n)) if epochs and n else None  # None: auto's default (3 epochs)
        auto = load_recipe(args.hand_recipe, {**{k2: v for k2, v in base.items() if not k2.startswith(("tune.", "schedule.steps", "schedule.epochs"))},
                                              "batch.expected_batch_size": "auto", "schedule.steps": "auto",
                                              **({"schedule.compute_budget": budget} if budget else {})})
        for k2, v in rec.model_dump(mode="json")["model"].items():
            setattr(auto.model, k2, v)
        d = out / f"auto-s{seed}"
        if not (d / "report.json").exists():
            shutil.rmtree(d, ignore_errors=True)
            train(auto, d, progress=False)
        rep = json.loads((d / "report.json").read_text())
        row.update(auto_eps=rep["privacy"].get("epsilon"), auto_acc=_test_accuracy(d, args.test_file),
                   auto_choice={"B": rep["dp"].get("expected_batch_size"), "T": rep["dp"].get("steps")})
    # (c) non-private search over the same K hyperparameter draws as (a), scored exactly on a dev split
    # held out of the TRAINING rows (never on the test file)
    state = json.loads((out / f"tune-s{seed}" / "tune_private" / "state.json").read_text())
    best = None
    for i, tr in enumerate(state["trials"]):
        ov = {**base, **tr["hyperparameters"], "privacy.enabled": False, **_held_out_dev(rec)}
        if state.get("auto"):  # the search chose one (B, T) (batch/steps auto): the same numbers, typed in
            ov.update({"batch.expected_batch_size": state["auto"]["batch"], "schedule.steps": state["auto"]["steps"],
                       "schedule.epochs": None, "schedule.compute_budget": None})
        r2 = load_recipe(args.recipe, ov)
        r2.tune = None
        d = out / f"nodp-s{seed}-t{i}"
        if not (d / "report.json").exists():
            shutil.rmtree(d, ignore_errors=True)
            train(r2, d, progress=False)
        dev = json.loads((d / "report.json").read_text())["metrics"]["dev_accuracy"]
        if best is None or dev > best[0]:
            best = (dev, d)
    row["nodp_acc"] = _test_accuracy(best[1], args.test_file) if best else None
    return row


def _ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def _paired(a, b):
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 2:
        return "n/a (fewer than 2 seeds)"
    diff = [x - y for x, y in pairs]
    m, s = statistics.mean(diff), statistics.stdev(diff)
    if s == 0:
        return f"{m:+.4f} (sd 0)"
    from scipy.stats import t as student

    tstat = m / (s / math.sqrt(len(diff)))
    p = 2 * student.sf(abs(tstat), len(diff) - 1)
    return f"{m:+.4f} (paired t = {tstat:.2f}, p = {p:.3g}, n = {len(diff)})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "tune-sst2-minilm.yaml"))
    ap.add_argument("--hand-recipe", default=str(ROOT / "recipes" / "sst2-minilm.yaml"))
    ap.add_argument("--test-file", required=True)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-train-examples", type=int, default=None)
    ap.add_argument("--auto", action="store_true",
                    help="also the hand recipe with batch.expected_batch_size/schedule.steps: auto at the same "
                         "compute (schedule.compute_budget = epochs × N when --set schedule.epochs is given)")
    ap.add_argument("--set", nargs="*", help="extra recipe overrides key=value for every arm")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tune"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_seed(args, s, out) for s in args.seeds]
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    col = {a: [r[f"{a}_acc"] for r in rows] for a in ("tune", "hand", "nodp")}
    lines = [f"# dpft tune evidence ({args.recipe}; ε = {args.epsilon:g}; seeds {args.seeds}; "
             f"N = {args.max_train_examples or 'all'})", "",
             "| arm | test accuracy (mean ± sd) | ε | vs tune (paired) |", "|---|---|---|---|",
             f"| tune (search charged) | {_ms(col['tune'])} | {_ms([r['tune_eps'] for r in rows])} | — |",
             f"| hand-tuned recipe (tuning not charged) | {_ms(col['hand'])} | "
             f"{_ms([r['hand_eps'] for r in rows])} | {_paired(col['hand'], col['tune'])} |",
             f"| non-private search (same K) | {_ms(col['nodp'])} | ∞ | {_paired(col['nodp'], col['tune'])} |",
             *([f"| hand recipe, B and T `auto` (tuning not charged) | {_ms([r.get('auto_acc') for r in rows])} | "
                f"{_ms([r.get('auto_eps') for r in rows])} | {_paired([r.get('auto_acc') for r in rows], col['tune'])} "
                f"(vs hand: {_paired([r.get('auto_acc') for r in rows], col['hand'])}) |"] if args.auto else []), "",
             *([f"auto's choice per seed (B, T): {[r.get('auto_choice') for r in rows]}.", ""] if args.auto else []),
             f"K drawn per seed: {[r['k'] for r in rows]}.", "",
             "Not shown: the variance of K across seeds beyond these draws; the compute of the search (E[K] "
             "trials against one hand-tuned run); other tasks and models."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
