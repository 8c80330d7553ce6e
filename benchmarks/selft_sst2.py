"""DP-SelFT vs full and LoRA DP fine-tuning on SST-2 at CPU scale (issue 7 must-show; the shape
of the paper's Table 1). One seed, MiniLM, private train set = 1,024 SST-2 records, B = 64,
C = 1, δ = 1e-5; every ε from the run's ledger (PLD).

Candidate pool: sentences of IMDB *train* reviews (5–25 words, seeded sample) — public text
from another movie-review corpus. SST-5 is not used: it shares its sentences with SST-2.

    PYTHONPATH=src DPFT_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \\
      python benchmarks/selft_sst2.py --steps 100 --methods full,lora,selft --eps 1,5,10

Each finished run appends one JSON line to ``<runs>/results.jsonl``; the Markdown table is
rebuilt from all lines at the end of every run (partial sweeps still give a table).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import shutil
import time
from pathlib import Path

import torch

from dpft.config.recipe import load_recipe
from dpft.methods.selft import SelFTCfg, run_selft
from dpft.run.loop import Trainer


def build_imdb_candidates(data_dir: Path, out: Path, n: int, seed: int = 0) -> Path:
    """``n`` distinct IMDB-train sentences of 5–25 words, one per line."""
    if out.is_file():
        return out
    sents = []
    with gzip.open(data_dir / "imdb" / "train.jsonl.gz", "rt") as f:
        for line in f:
            text = re.sub(r"<br\s*/?>", " ", json.loads(line)["text"])
            for s in re.split(r"(?<=[.!?])\s+", text):
                s = " ".join(s.split())
                if 5 <= len(s.split()) <= 25:
                    sents.append(s)
    sents = list(dict.fromkeys(sents))
    random.Random(seed).shuffle(sents)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(sents[:n]) + "\n")
    return out


LR = {"full": 5e-4, "lora": 2e-3, "selft": 5e-4, "attention": 5e-4, "selft_lora": 2e-3,
      "random_noise": 5e-4, "no_noise": 5e-4}


def recipe_for(method: str, eps: float, a) -> object:
    o = {"name": f"{method}-eps{eps:g}", "model.name": "minilm", "model.max_length": 64, "task.name": "sst2",
         "task.max_train_examples": 1024, "privacy.target_epsilon": eps, "privacy.delta": 1e-5,
         "privacy.clipping.max_norm": 1.0, "optimizer.name": "adamw", "optimizer.lr": LR[method],
         "schedule.steps": a.steps, "schedule.warmup_steps": 0, "batch.expected_batch_size": 64,
         # The demo's fixes for a fresh head under DP (README, issue 2): mean pooling, no dropout,
         # head and body clipped separately, a larger head lr. --plain drops them (the first table).
         **({} if a.plain else {"model.pooling": "mean", "model.dropout": 0.0,
                                "privacy.clipping.style": "head_body", "optimizer.head_lr": a.head_lr}),
         "batch.max_physical_batch_size": 64, "eval.every_steps": a.steps, "eval.batch_size": 256,
         "checkpoint_every": a.steps, "seed": a.seed}
    if method == "full":
        o["trainable.mode"] = "full"
    elif method == "lora":
        o.update({"trainable.mode": "lora", "trainable.lora.r": 8, "trainable.lora.target_modules": ["query", "value"]})
    return load_recipe(None, o)


def table(rows: list[dict], a) -> str:
    by = {}
    for r in rows:
        by[(r["method"], r["eps"])] = r
    methods = [m for m in ["full", "lora", "attention", "selft", "selft_lora", "random_noise", "no_noise"]
               if any(k[0] == m for k in by)]
    epss = sorted({k[1] for k in by})
    names = {"full": "Full (DP-AdamW)", "lora": "DP-LoRA (q,v; r=8)", "attention": "Heuristic (attention only)",
             "selft": "DP-SelFT", "selft_lora": "DP-SelFT+LoRA", "random_noise": "Selection w/ random noise",
             "no_noise": "Selection w/o noise"}
    lines = ["| method | " + " | ".join(f"ε={e:g}" for e in epss) + " |", "|---|" + "---|" * len(epss)]
    for m in methods:
        cells = []
        for e in epss:
            r = by.get((m, e))
            cells.append("—" if r is None else f"{100 * r['acc']:.2f} (ε̂={r['eps_ledger']:.3f}, σ={r['sigma']:.3g})")
        lines.append(f"| {names[m]} | " + " | ".join(cells) + " |")
    sel = [f"- {names[r['method']]}, ε={r['eps']:g}: selected {r['units']} (trainable {r['trainable']:,} params)"
           for r in rows if r.get("units")]
    return "\n".join(lines) + "\n\nSelected units:\n" + "\n".join(sel) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--methods", default="full,lora,selft")
    ap.add_argument("--eps", default="1,5,10")
    ap.add_argument("--eps-syn", type=float, default=0.3)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--score-steps", type=int, default=20)
    ap.add_argument("--n-candidates", type=int, default=4000)
    ap.add_argument("--n-select", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-lr", type=float, default=1e-2)
    ap.add_argument("--plain", action="store_true", help="flat clipping, [CLS] pooler, one lr (the first table)")
    ap.add_argument("--runs", default="runs/selft")
    ap.add_argument("--out", default="results/selft_sst2.md")
    ap.add_argument("--data", default="/work/shared/data")
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    cand = build_imdb_candidates(Path(a.data), runs / "imdb_candidates.txt", a.n_candidates, a.seed)
    res_path = runs / "results.jsonl"
    for eps in [float(x) for x in a.eps.split(",")]:
        for method in a.methods.split(","):
            d = runs / f"{method}-eps{eps:g}-s{a.steps}"
            if d.exists():
                shutil.rmtree(d)
            r = recipe_for(method, eps, a)
            t0 = time.time()
            units = None
            if method in ("selft", "attention", "selft_lora", "random_noise", "no_noise"):
                sel = {"selft": "selft", "selft_lora": "selft"}.get(method, method)
                cfg = SelFTCfg(epsilon_syn=a.eps_syn, candidates_file=str(cand), n_select=a.n_select,
                               selector=sel, top_k=a.top_k, score_steps=a.score_steps, score_batch_size=32,
                               lora=method == "selft_lora", cache_dir=str(runs / "score_cache"))
                rep = run_selft(r, cfg, d, progress=False, log=lambda m: print(m, flush=True))
                units = rep["selft"]["selected_units"]
            else:
                rep = Trainer(r, d, progress=False).run()
            row = {"method": method, "eps": eps, "steps": a.steps, "eps_syn": a.eps_syn, "acc": rep["metrics"]["dev_accuracy"],
                   "eps_ledger": rep["privacy"]["epsilon"], "sigma": rep["dp"]["noise_multiplier"],
                   "trainable": rep["model"]["trainable_parameters"], "units": units,
                   "ledger": rep["privacy"]["ledger"], "seconds": round(time.time() - t0, 1),
                   "scores": rep.get("selft", {}).get("scores")}
            print(json.dumps({k: v for k, v in row.items() if k not in ("ledger", "scores")}), flush=True)
            with open(res_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows = [json.loads(x) for x in res_path.read_text().splitlines() if x.strip()]
            rows = [x for x in rows if x["steps"] == a.steps]
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(table(rows, a))


if __name__ == "__main__":
    main()
