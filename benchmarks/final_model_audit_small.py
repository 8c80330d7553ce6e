"""Final-model audit on a small classifier (issue 37 items 3 and 5): black-box and white-box ε̂/ε
for ε ∈ {1, 4, 8} with several runs each, a non-private run, and the planted bugs (``noise/4``,
``clipping off``, ``counted twice``) — sized for a shared 2-core CPU (each run 10–60 s).

Each row is one ``dpft audit RECIPE --final-model`` run (audit/final_model.py ``audit_final_model``,
the Trainer of ``dpft train``): a tiny random-initialised BERT classifier (1 layer, hidden 16, a
word-piece vocabulary of 8 000 ids of which the data use 25) on synthetic sentiment-like rows,
m ``random`` canaries (random unused tokens with a random label, each in with a secret fair coin)
scored on the final model (log-odds loss drop), and M white-box Dirac canaries on every release of
the same run. ε̂ at 95 % confidence. Writes benchmarks/results/final_model_audit_small.{md,json}.

    PYTHONPATH=src nice -n 19 python benchmarks/final_model_audit_small.py [--seeds 3] [--eps 1 4 8 inf]
        [--plant noise/4 "clipping off" "counted twice"] [--m 200] [--dirac 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpft.audit.final_model import audit_final_model
from dpft.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull", "a", "film", "number"]


def build_model_and_data(d: Path, rows: int) -> tuple[Path, Path]:
    """The tiny BERT (saved untrained: every run starts from the same random weights) and the CSV."""
    import pandas as pd
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [str(i) for i in range(10)]
    vocab += [f"w{i}" for i in range(8000 - len(vocab))]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizer(str(d / "vocab.txt"))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    BertForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    data = [{"text": f"a {WORDS[i % 8]} film number {i % 10}", "label": int(i % 8 % 2 == 0)} for i in range(rows)]
    pd.DataFrame(data).to_csv(d / "d.csv", index=False)
    return d, d / "d.csv"


def recipe(model_dir: Path, csv: Path, eps: float, a):
    ov = {"name": f"tinybert-eps{eps}", "model.name": str(model_dir), "model.max_length": 16, "task.name": "files",
          "task.train_file": str(csv), "batch.expected_batch_size": a.batch, "batch.max_physical_batch_size": 256,
          "schedule.steps": a.steps, "eval.every_steps": 10 ** 6, "checkpoint_every": 10 ** 6,
          "privacy.delta": 1e-5, "optimizer.lr": a.lr}
    if math.isinf(eps):
        ov["privacy.enabled"] = False
    else:
        ov["privacy.target_epsilon"] = eps
    return load_recipe(None, ov)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=200)
    ap.add_argument("--dirac", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eps", type=float, nargs="*", default=[1.0, 4.0, 8.0, math.inf])
    ap.add_argument("--plant", nargs="*", default=[], help="planted bugs, run at ε = 4")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "final_model_audit_small"))
    ap.add_argument("--append", nargs="*", default=[], help="JSON files of earlier invocations (same sizes)")
    a = ap.parse_args()
    rows = [row for f in a.append for row in json.loads(Path(f).read_text())["rows"]]
    work = Path(tempfile.mkdtemp(prefix="fmas-"))
    model_dir, csv = build_model_and_data(work, a.rows)
    runs = [(e, None) for e in a.eps] + [(4.0, bug) for bug in a.plant]
    for eps, bug in runs:
        for seed in range(a.seeds):
            d = work / f"run-{eps}-{bug}-{seed}".replace(" ", "_").replace("/", "_")
            t0 = time.perf_counter()
            res = audit_final_model(recipe(model_dir, csv, eps, a), d, m=a.m, designs=["random"], planted=bug,
                                    progress=False, dirac=a.dirac)
            wb = res.get("whitebox") or {}
            b = res["designs"][0]["bounds"]
            row = {"eps_target": eps, "planted": bug, "seed": seed, "certified": res["certified_epsilon"],
                   "sigma": res["sigma"], "n": res["n_train_with_canaries"], "seconds": time.perf_counter() - t0,
                   "bb_fdp": b["fdp"]["epsilon"], "bb_steinke": b["steinke"]["epsilon"],
                   "gap": res["designs"][0]["mean_score_in"] - res["designs"][0]["mean_score_out"],
                   "wb_fdp": (wb.get("bounds") or {}).get("fdp", {}).get("epsilon"),
                   "wb_steinke": (wb.get("bounds") or {}).get("steinke", {}).get("epsilon")}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(d, ignore_errors=True)
            write(a, rows)
    shutil.rmtree(work, ignore_errors=True)


def _ms(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def write(a, rows: list) -> None:
    """The tables so far (rewritten after every run: a stopped benchmark keeps its rows)."""
    Path(a.out + ".json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    cmd = "PYTHONPATH=src nice -n 19 python benchmarks/final_model_audit_small.py " + " ".join(
        f'"{x}"' if " " in x else x for x in sys.argv[1:])
    lines = ["# Final-model audit on a small classifier (issue 37): ε̂ / ε, black-box and white-box", "",
             f"Command: `{cmd}`", "",
             f"Way in: `dpft train` (`dpft audit RECIPE --final-model`). Model: a tiny random-initialised BERT "
             f"classifier (1 layer, hidden 16, 8 000-id vocabulary; as tests/test_audit_final_model.py), data: "
             f"{a.rows} synthetic rows (90 % train), Poisson B = {a.batch}, T = {a.steps} steps, lr {a.lr}, C = 1, "
             f"δ = 1e-5; m = {a.m} `random` canaries (black-box, final model only, log-odds loss drop) and "
             f"{a.dirac} Dirac canaries (white-box, every release) in the same run; ε̂ at 95 % confidence (f-DP "
             "estimator of Mahloujifar et al. 2025; Steinke et al. 2023 in the per-run table). Every run has "
             "fresh secret randomness (seeds are indices, not reproducible by design). CPU, 2 shared cores.", "",
             "| ε target | planted | runs | certified ε | black-box ε̂ (mean ± sd) | black-box ε̂/ε | white-box ε̂ "
             "(mean ± sd) | white-box ε̂/ε | seen (some run ε̂ > ε) | s / run |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["eps_target"], r["planted"]) for r in rows))
    for eps, bug in keys:
        rs = [r for r in rows if r["eps_target"] == eps and r["planted"] == bug]
        cert = rs[0]["certified"]
        bb, wb = [r["bb_fdp"] for r in rs], [r["wb_fdp"] for r in rs]
        ratio = lambda xs: "—" if cert is None or not [x for x in xs if x is not None] else _ms([x / cert for x in xs if x is not None])  # noqa: E731
        seen = "—" if cert is None else ", ".join(
            n for n, xs in (("black-box", bb), ("white-box", wb)) if any(x is not None and x > cert for x in xs)) or "neither"
        lines.append(f"| {'∞ (non-private)' if math.isinf(eps) else eps} | {bug or '—'} | {len(rs)} | "
                     f"{'none' if cert is None else f'{cert:.3f}'} | {_ms(bb)} | {ratio(bb)} | {_ms(wb)} | {ratio(wb)} | "
                     f"{seen} | {statistics.mean(r['seconds'] for r in rs):.0f} |")
    lines += ["", "Per run:", "", "| ε target | planted | seed | certified ε | σ | N | black-box f-DP / Steinke | "
              "white-box f-DP / Steinke | mean score gap in − out (nats) | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wbs = "—" if r["wb_fdp"] is None else f"{r['wb_fdp']:.3f} / {r['wb_steinke']:.3f}"
        cert = "none" if r["certified"] is None else f"{r['certified']:.3f}"
        lines.append(f"| {r['eps_target']} | {r['planted'] or '—'} | {r['seed']} | {cert} | {r['sigma']:.3g} | {r['n']} | "
                     f"{r['bb_fdp']:.3f} / {r['bb_steinke']:.3f} | {wbs} | {r['gap']:.3g} | {r['seconds']:.0f} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
