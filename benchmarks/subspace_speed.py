#!/usr/bin/env python
"""DP-SFT stage-2 step time as a ratio to a non-private step, and the memory of P.

One process, round-robin timing (so the methods share the machine's noise), median of
``--repeats`` after ``--warmup``. Timed per method on the same real SST-2 micro-batch
(all-MiniLM-L6-v2, B examples padded to T tokens):

* ``nonprivate``  ``NonPrivateEngine.clipped_sum`` (forward + ``loss.sum().backward()``), the denominator;
* ``dp-full``     ``BookKeepingEngine.clipped_sum`` (per-example clipped sum over d, Full-DP);
* ``dp-sft``      ``SubspaceEngine.clipped_sum`` (coordinates Pᵀg_i in R^k, clip) + the
                  unprojection ``P s`` (Algorithm 2 lines 5-13); noise on k numbers is negligible.

The optimizer update is not timed for anyone. P is a random orthonormal basis (k columns) over
the trainable parameters, built with ``basis_from_snapshots`` from k random snapshots; its
memory is d·k·(4 bytes float32 | 2 bytes bfloat16).

Usage::

    python benchmarks/subspace_speed.py --cases last2 --repeats 10
    python benchmarks/subspace_speed.py --cases last2,full-noemb --k 32 --threads 1

Writes ``results/subspace_speed.md`` (appends a section) and prints it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dpft.config.recipe import TrainableCfg  # noqa: E402
from dpft.grads.base import NonPrivateEngine  # noqa: E402
from dpft.grads.bookkeeping import BookKeepingEngine  # noqa: E402
from dpft.grads.subspace import COORDS, SubspaceEngine  # noqa: E402
from dpft.models.load import load_classifier, select_trainable  # noqa: E402
from dpft.models.losses import classification_loss  # noqa: E402
from dpft.step.clip import FlatClip  # noqa: E402
from dpft.transforms.subspace import basis_from_snapshots, format_bytes  # noqa: E402

CASES = {
    "last2": TrainableCfg(mode="last_k", last_k=2),
    "full-noemb": TrainableCfg(mode="full", freeze_embeddings=True),
}


def sst2_batch(tok, b: int, t: int):
    import csv

    data = Path(os.environ.get("DPFT_DATA_DIR", ROOT.parent / "shared" / "data")) / "sst2" / "train.tsv"
    with open(data) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:b]
    enc = tok([r["sentence"] for r in rows], padding="max_length", truncation=True, max_length=t,
              return_tensors="pt")
    enc = {k: v for k, v in enc.items()}
    enc["labels"] = torch.tensor([int(r["label"]) for r in rows])
    return enc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="last2")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="physical batches per logical step (the unprojection P·s runs once per logical step)")
    ap.add_argument("--out", default=str(ROOT / "results" / "subspace_speed.md"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lines = [f"## subspace_speed — {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", f"`python benchmarks/subspace_speed.py --cases {a.cases} --k {a.k} --batch {a.batch} "
             f"--seq {a.seq} --repeats {a.repeats} --warmup {a.warmup} --threads {a.threads} "
             f"--micro-batches {a.micro_batches}`",
             "", f"CPU, {a.threads} thread(s), all-MiniLM-L6-v2, real SST-2 batch B={a.batch} padded to T={a.seq}; "
             f"median of {a.repeats} round-robin repeats; one logical step = {a.micro_batches} such batch(es).", "",
             "| case | d (spanned) | k | P fp32 | P bf16 | non-private s | Full-DP (BK) s | DP-SFT s | Full-DP / NP | DP-SFT / NP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in a.cases.split(","):
        tok, model = load_classifier("minilm", 2, seed=0)
        model = select_trainable(model, CASES[case])
        model.train()
        for m in model.modules():  # dropout off: identical work in every method
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        batch = sst2_batch(tok, a.batch, a.seq)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        g = torch.Generator().manual_seed(0)
        snaps = {n: torch.randn(a.k, *p.shape, generator=g) for n, p in params.items()}
        basis = basis_from_snapshots(snaps, a.k)
        del snaps
        clip = FlatClip(1.0)
        engines = {"nonprivate": NonPrivateEngine(model, classification_loss, clip),
                   "dp-full": BookKeepingEngine(model, classification_loss, clip),
                   "dp-sft": SubspaceEngine(model, classification_loss, clip, basis)}

        def run(name):  # one logical step of --micro-batches physical batches
            total = None
            for _ in range(a.micro_batches):
                res = engines[name].clipped_sum(batch)
                if name == "dp-sft":
                    g = res.grad_sum[COORDS]
                    total = g if total is None else total + g
            if name == "dp-sft":  # Algorithm 2 line 12: once per logical step
                basis.unproject(total / (a.batch * a.micro_batches))

        times = {n: [] for n in engines}
        for _ in range(a.warmup):
            for n in engines:
                run(n)
        for _ in range(a.repeats):
            for n in engines:
                t0 = time.perf_counter()
                run(n)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) for n, v in times.items()}
        lines.append(
            f"| {case} | {basis.dim:,} | {a.k} | {format_bytes(basis.nbytes)} | {format_bytes(basis.nbytes // 2)} | "
            f"{med['nonprivate']:.3f} | {med['dp-full']:.3f} | {med['dp-sft']:.3f} | "
            f"{med['dp-full'] / med['nonprivate']:.2f}× | {med['dp-sft'] / med['nonprivate']:.2f}× |")
        print(lines[-1], flush=True)
        del engines, basis, model
    text = "\n".join(lines) + "\n\n"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
