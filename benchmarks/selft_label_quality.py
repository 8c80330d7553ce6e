"""Quality of DP select-and-label vs ε_syn and pool size (diagnostic for the Table 3 shape).

Candidates: IMDB-train sentences (5–25 words) carrying their source review's label as a weak
reference label (never used by the mechanism). Private set: the 1,024-record SST-2 subset of the
must-show. Reports the agreement of the DP labels with the reference labels, for several ε_syn and
pool sizes m (kept = min(600, m/2)). One seed.

    PYTHONPATH=src DPFT_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \\
      python benchmarks/selft_label_quality.py
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import torch

from dpft.config.recipe import TaskCfg
from dpft.data.tasks import load_task
from dpft.synth.select_label import dp_select_and_label, embed_texts


def imdb_sentences(data: Path, n: int, seed: int = 0):
    out = {}
    with gzip.open(data / "imdb" / "train.jsonl.gz", "rt") as f:
        for line in f:
            d = json.loads(line)
            for s in re.split(r"(?<=[.!?])\s+", re.sub(r"<br\s*/?>", " ", d["text"])):
                s = " ".join(s.split())
                if 5 <= len(s.split()) <= 25 and s not in out:
                    out[s] = int(d["label"])
    items = list(out.items())
    random.Random(seed).shuffle(items)
    return items[:n]


def main():
    torch.set_num_threads(1)
    data = Path("/work/shared/data")
    task = load_task(TaskCfg(name="sst2", max_train_examples=1024), seed=0)
    texts, labels = list(task.train["text"]), list(task.train["label"])
    pool = imdb_sentences(data, 4000)
    pe = embed_texts(texts)
    ce = embed_texts([t for t, _ in pool])
    print("| m (pool) | kept | ε_syn | σ_sel = σ_lab | label agreement with source review | share of kept with ≥1 true vote |")
    print("|---|---|---|---|---|---|")
    for m in (4000, 400, 40):
        sub = pool[:m]
        keep = min(600, m // 2)
        nn = (torch.nn.functional.normalize(pe, dim=-1) @ ce[:m].T).argmax(1)
        voted = set(nn.tolist())
        for eps in (0.1, 0.3, 0.5, 1.0, 5.0):
            syn = dp_select_and_label(texts, labels, [t for t, _ in sub], 2, eps, 1e-5, keep,
                                      private_emb=pe, cand_emb=ce[:m], seed=0)
            ref = dict(sub)
            rows = syn.train + syn.val
            agree = sum(ref[t] == y for t, y in rows) / len(rows)
            hit = sum(j in voted for j in syn.selected) / len(syn.selected)
            print(f"| {m} | {keep} | {eps} | {syn.sigma_select:.3g} | {100 * agree:.1f} % | {100 * hit:.1f} % |",
                  flush=True)


if __name__ == "__main__":
    main()
