"""Issue 45 follow-up: do richer frozen features from the SAME encoder (all-MiniLM-L6-v2) raise the DP linear
probe's non-private ceiling and its DP accuracy at about 5,000 rows?

Standalone (does not go through ``dpft train``), modelled on benchmarks/probe_encoders.py but with the step of
``recipes/probe-minilm.yaml`` (what ``trainable.mode: auto`` picks at N ≤ 20,000): Poisson sampling q = 1/4,
T = 100 steps (25 epochs), per-example flat clipping at C = 1, Gaussian noise N(0, σ²C²) on the clipped sum,
divided by the public expected batch qN, AdamW (lr 0.02, no weight decay, linear decay to 0, no warm-up),
head initialised like ``nn.Linear`` (uniform ±1/√d, seeded), max_length 64, the recipe's training rows
(``load_task(sst2, max_train_examples=5000, seed=0)``: dpft's own seeded subset) and the whole dev split.

Features (one forward pass per row, eval mode, ``output_hidden_states=True``; masked pooling over non-padding
tokens; cached as .npy under $PROBE_POOL_CACHE or /tmp/dpft_probe_pooling, private data: never committed):

- ``a``  mean-pool of the last layer (today's ``model.pooling: mean``), d = 384
- ``b2`` / ``b4``  concatenated mean-pools of the last 2 / last 4 layers, d = 768 / 1,536
- ``c``  mean-pool of the average of the last 4 layers (= the average of their mean-pools: pooling is linear), 384
- ``d``  last-layer mean ‖ last-layer max (masked), 768
- ``e``  last-layer mean ‖ embedding-layer (hidden_states[0]) mean, 768

Normalisation (data-independent only: per-feature standardisation would use statistics of the private rows):
``raw`` (as dpft today) or ``l2`` (each concatenated block L2-normalised per row, per example: no privacy cost).

Accounting (the project's way): T × PoissonSampledDpEvent(q, Gaussian(σ)), add/remove neighbours, δ = 1e-5;
σ from dpft.accounting.calibrate.calibrate_sigma (PLD, never rounded in our favour) and ε re-checked with
dpft.accounting.ledger.epsilon_of on the same events. ε = ∞: the same loop without clipping and noise.

Usage (PYTHONPATH=src HF_HUB_OFFLINE=1 DPFT_DATA_DIR=../shared/data; 2 torch threads)::

    nice -n 5 python benchmarks/probe_pooling.py embed [sst2 sst5]   # one forward pass per task, ~2-4 min each
    nice -n 5 python benchmarks/probe_pooling.py probe [sst2 sst5]   # minutes; writes benchmarks/results/probe_pooling.md
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
CACHE = Path(os.environ.get("PROBE_POOL_CACHE", "/tmp/dpft_probe_pooling"))
OUT = Path(os.environ.get("PROBE_POOL_OUT", ROOT / "benchmarks" / "results" / "probe_pooling.md"))

ENCODER = "minilm"
MAX_LEN = 64          # recipes/probe-minilm.yaml
N_TRAIN = 5000
SUBSET_SEED = 0       # dpft's load_task(seed = recipe seed 0): the recipe's rows
BATCH = 64
TASKS = ("sst2", "sst5")

# ------------------------------------------------------------------------------------------- features


def embed(task: str, threads: int = 2) -> None:
    """One forward pass over the task's training subset and dev split: per row the masked mean of every
    hidden state (embeddings + each block) → ``{task}_{split}_mean.npy`` (N, L+1, d), the masked max of the last
    one → ``{task}_{split}_max.npy`` (N, d), labels → ``{task}_{split}_y.npy``; timing → ``{task}_timing.json``."""
    from transformers import AutoModel, AutoTokenizer

    from dpft.config.recipe import TaskCfg
    from dpft.data.tasks import load_task
    from dpft.models.hf_mean_pool import masked_mean
    from dpft.models.load import resolve_model_path

    torch.set_num_threads(threads)
    CACHE.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = resolve_model_path(ENCODER)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, add_pooling_layer=False).eval()
    data = load_task(TaskCfg(name=task, max_train_examples=N_TRAIN), seed=SUBSET_SEED)
    timing = {}
    for split, ds in (("train", data.train), ("dev", data.dev)):
        texts, y = list(ds["text"]), np.asarray(ds["label"], dtype=np.int64)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # length-sorted: little padding
        means = np.zeros((len(texts), model.config.num_hidden_layers + 1, model.config.hidden_size), np.float32)
        maxes = np.zeros((len(texts), model.config.hidden_size), np.float32)
        t0, c0 = time.time(), time.process_time()
        with torch.no_grad():
            for i in range(0, len(order), BATCH):
                idx = order[i:i + BATCH]
                enc = tok([texts[j] for j in idx], truncation=True, max_length=MAX_LEN, padding=True, return_tensors="pt")
                hs = model(**enc, output_hidden_states=True).hidden_states  # L+1 × (B, T, d)
                m = enc["attention_mask"]
                means[idx] = torch.stack([masked_mean(h, m) for h in hs], 1).numpy()
                last = hs[-1].masked_fill(m[..., None] == 0, float("-inf"))
                maxes[idx] = last.max(1).values.numpy()
        timing[split] = {"rows": len(texts), "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
                         "load_avg_1m": os.getloadavg()[0]}
        for name, arr in (("mean", means), ("max", maxes), ("y", y)):
            np.save(CACHE / f"{task}_{split}_{name}.npy", arr)
        print(task, split, timing[split], flush=True)
    timing["num_labels"] = data.num_labels
    (CACHE / f"{task}_timing.json").write_text(json.dumps(timing, indent=1))


CANDIDATES = {  # name -> (description, blocks from (mean (N, L+1, d), max (N, d)))
    "a": ("mean of last layer (today)", lambda mn, mx: [mn[:, -1]]),
    "b2": ("means of last 2 layers, concatenated", lambda mn, mx: [mn[:, -1], mn[:, -2]]),
    "b4": ("means of last 4 layers, concatenated", lambda mn, mx: [mn[:, -1], mn[:, -2], mn[:, -3], mn[:, -4]]),
    "c": ("mean of the average of last 4 layers", lambda mn, mx: [mn[:, -4:].mean(1)]),
    "d": ("last-layer mean ‖ max", lambda mn, mx: [mn[:, -1], mx]),
    "e": ("last-layer mean ‖ embedding-layer mean", lambda mn, mx: [mn[:, -1], mn[:, 0]]),
}
NORMS = ("raw", "l2")


def features(task: str, split: str, cand: str, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    mn, mx = (np.load(CACHE / f"{task}_{split}_{k}.npy") for k in ("mean", "max"))
    blocks = CANDIDATES[cand][1](mn, mx)
    if norm == "l2":  # per row, per block: data-independent (no statistic of other rows)
        blocks = [b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12) for b in blocks]
    x = np.concatenate(blocks, 1).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(np.load(CACHE / f"{task}_{split}_y.npy"))


# ------------------------------------------------------------------------------------------- probe
DELTA = 1e-5
CLIP = 1.0
Q = 0.25              # recipes/probe-minilm.yaml: B = 1,250 at N = 5,000
STEPS = 100           # 25 epochs at q = 1/4
LR = 0.02             # the recipe's AdamW lr (fixed a priori, not tuned here)
LR_GRID = (0.005, 0.02, 0.08)  # reported for every arm as a sensitivity check, never used to pick
EPSILONS = (1.0, 3.0, 8.0, float("inf"))
SEEDS = (0, 1, 2, 3, 4)


def sigma_for(eps: float) -> tuple[float, float]:
    from dpft.accounting.calibrate import calibrate_sigma, dp_sgd_event
    from dpft.accounting.ledger import epsilon_of

    sigma = calibrate_sigma(eps, DELTA, q=Q, steps=STEPS)
    spent = epsilon_of([dp_sgd_event(sigma, Q, STEPS)], DELTA).epsilon
    assert spent <= eps + 1e-9, (spent, eps)
    return sigma, spent


def dp_adam(x, y, k: int, sigma: float | None, lrs, seeds) -> torch.Tensor:
    """DP-Adam logistic regression on [x, 1]: R = len(lrs) × len(seeds) independent runs batched (run j has
    step size ``lrs[j // len(seeds)]`` and seed ``seeds[j % len(seeds)]``) → W (R, k, D). Seed s fixes the head
    init, the Poisson masks (drawn before anything that depends on the feature width, so every arm sees the
    same batches) and the noise stream; runs that share a seed share all three. ``sigma=None``: ε = ∞ (no
    clipping, no noise). Every row's logits are computed each step and the unsampled rows' residuals zeroed
    (the same sums as gathering the batch, in one matmul)."""
    n, d = x.shape
    S, R = len(seeds), len(lrs) * len(seeds)
    xt = torch.cat([x, torch.ones(n, 1)], 1)                               # (n, D)
    yo = torch.nn.functional.one_hot(y, k).float()[:, None, :]             # (n, 1, k)
    masks = torch.stack([torch.rand(STEPS, n, generator=torch.Generator().manual_seed(10_000 + s)) < Q
                         for s in seeds], -1).float()                       # (T, n, S)
    bound = 1 / d ** 0.5  # nn.Linear's default init range
    w0 = torch.stack([(torch.rand(k, d + 1, generator=torch.Generator().manual_seed(s)) * 2 - 1) * bound for s in seeds])
    w = w0.repeat(len(lrs), 1, 1)                                          # (R, k, D)
    lr = torch.tensor([l for l in lrs for _ in seeds], dtype=torch.float32)[:, None, None]
    g_noise = [torch.Generator().manual_seed(20_000 + s) for s in seeds]
    m1, m2 = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2, eps_adam = 0.9, 0.999, 1e-8
    xn = xt.norm(dim=1)[:, None]                                           # (n, 1)
    for t in range(STEPS):
        logits = (xt @ w.reshape(R * k, d + 1).T).reshape(n, R, k)
        r = (torch.softmax(logits, -1) - yo) * masks[t].repeat(1, len(lrs))[..., None]  # per-example grad r_i ⊗ x_i
        if sigma is not None:
            r = r * torch.clamp(CLIP / (r.norm(dim=-1) * xn + 1e-6), max=1.0)[..., None]
        g = (r.reshape(n, R * k).T @ xt).reshape(R, k, d + 1)
        if sigma is not None:
            z = torch.stack([torch.randn(k, d + 1, generator=gen) for gen in g_noise])  # (S, k, D): one per seed
            g = g + sigma * CLIP * z.repeat(len(lrs), 1, 1)
        g = g / (Q * n)                                                    # the public expected batch
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b2 * m2 + (1 - b2) * g * g
        lr_t = lr * (1 - t / STEPS)                                        # linear decay, no warm-up
        w = w - lr_t * (m1 / (1 - b1 ** (t + 1))) / ((m2 / (1 - b2 ** (t + 1))).sqrt() + eps_adam)
    return w


def accuracy(w, x, y) -> list[float]:
    """Dev accuracy of each run of W (R, k, D)."""
    xt = torch.cat([x, torch.ones(len(x), 1)], 1)
    return [float(v) for v in (torch.einsum("nd,rkd->rnk", xt, w).argmax(-1) == y).double().mean(-1)]


def nonprivate(x, y, xd, yd) -> float:
    from sklearn.linear_model import LogisticRegression

    m = LogisticRegression(C=1.0, max_iter=5000).fit(x.numpy(), y.numpy())
    return float((m.predict(xd.numpy()) == yd.numpy()).mean())


def probe(tasks=TASKS) -> dict:
    torch.set_num_threads(2)
    sig = {eps: sigma_for(eps) if eps != float("inf") else (None, float("inf")) for eps in EPSILONS}
    res = {"sigma": {str(e): s for e, s in sig.items()}, "runs": [], "np": [], "norms": []}
    for task in tasks:
        if not (CACHE / f"{task}_train_y.npy").exists():
            print("no features for", task, "- run embed first", flush=True)
            continue
        k = json.loads((CACHE / f"{task}_timing.json").read_text())["num_labels"]
        for cand in CANDIDATES:
            for norm in NORMS:
                x, y = features(task, "train", cand, norm)
                xd, yd = features(task, "dev", cand, norm)
                res["np"].append(dict(task=task, cand=cand, norm=norm, d=x.shape[1], acc=nonprivate(x, y, xd, yd)))
                res["norms"].append(dict(task=task, cand=cand, norm=norm, median=float(x.norm(dim=1).median())))
                for eps in EPSILONS:
                    accs = accuracy(dp_adam(x, y, k, sig[eps][0], LR_GRID, SEEDS), xd, yd)
                    for i, lr in enumerate(LR_GRID):
                        res["runs"].append(dict(task=task, cand=cand, norm=norm, eps=eps, lr=lr,
                                                accs=accs[i * len(SEEDS):(i + 1) * len(SEEDS)]))
                print(task, cand, norm, "done", time.strftime("%H:%M:%S"), flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "probe_pooling_results.json").write_text(json.dumps(res, indent=0))
    return res


# ------------------------------------------------------------------------------------------- report


def mean_sd(v) -> str:
    v = np.asarray(v, float)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}"


def write_report(res: dict) -> None:
    from scipy import stats

    runs = {(r["task"], r["cand"], r["norm"], r["eps"], r["lr"]): r["accs"] for r in res["runs"]}
    npacc = {(r["task"], r["cand"], r["norm"]): (r["acc"], r["d"]) for r in res["np"]}
    tasks = sorted({r["task"] for r in res["runs"]}, key=TASKS.index)
    arms = [(c, nm) for c in CANDIDATES for nm in NORMS]
    fin = [e for e in EPSILONS if e != float("inf")]
    ename = lambda e: "∞" if e == float("inf") else f"{e:g}"  # noqa: E731
    L = ["# Richer frozen features from the same encoder: pooling variants for the DP linear probe (issue 45)", "",
         "Produced by `benchmarks/probe_pooling.py` (`embed`, then `probe`). Standalone script, not `dpft train`; "
         "the step mirrors `recipes/probe-minilm.yaml`. Commands (PYTHONPATH=src HF_HUB_OFFLINE=1 "
         "DPFT_DATA_DIR=../shared/data, 2 torch threads, `nice -n 5`): `python benchmarks/probe_pooling.py embed sst2 sst5` "
         "then `python benchmarks/probe_pooling.py probe sst2 sst5` (~30 min on 2 shared cores; `report` rewrites this "
         "file from the saved results).", "",
         "## Setup (fixed before looking at dev accuracy)", "",
         f"- Encoder all-MiniLM-L6-v2 (embedded `minilm`, 6 blocks, d = 384), eval mode, max_length {MAX_LEN}, one "
         "forward pass with `output_hidden_states=True`; masked pooling over non-padding tokens; features cached "
         "as .npy under /tmp (private data: never committed).",
         f"- Data: `load_task(<task>, max_train_examples={N_TRAIN}, seed={SUBSET_SEED})` (the recipe's seeded subset of "
         "the training rows), the whole dev split (SST-2 872, SST-5 1,101 rows).",
         f"- Probe: multinomial logistic regression on [x, 1]; Poisson sampling q = {Q:g}, T = {STEPS} steps (25 epochs); "
         f"per-example flat clipping C = {CLIP:g}; Gaussian noise N(0, σ²C²) on the clipped sum; divided by qN; AdamW "
         f"lr {LR:g} (the recipe's), no weight decay, linear decay, no warm-up; nn.Linear-style seeded init. "
         f"ε = ∞: the same loop without clipping or noise. The same lr for every arm (not tuned per arm); "
         f"lr ∈ {{{', '.join(f'{v:g}' for v in LR_GRID)}}} shown below as a sensitivity check only.",
         f"- Seeds {', '.join(map(str, SEEDS))}: seed s fixes the head init, the Poisson masks (identical across arms) "
         "and the noise stream; mean ± sd over seeds; paired t-test against `a raw` (today) by seed.",
         f"- Accounting: T × PoissonSampled(q, Gaussian(σ)), add/remove, δ = {DELTA:g}; σ by "
         "`dpft.accounting.calibrate.calibrate_sigma` (PLD), ε re-checked by `dpft.accounting.ledger.epsilon_of`.",
         "- Normalisation: `raw` (as dpft today) or `l2` (each concatenated block L2-normalised per row: per "
         "example, no privacy cost). No per-feature standardisation (it would use private statistics).",
         "- Non-private ceiling: scikit-learn `LogisticRegression(C=1)` (L-BFGS) on the same features, C fixed a priori.",
         "", "| ε | σ | ε spent (PLD) |", "|---|---|---|"]
    for e in fin:
        s, spent = res["sigma"][str(e)]
        L.append(f"| {e:g} | {s:.4f} | {spent:.4f} |")
    L += ["", "Candidates:", "", "| arm | features | d |", "|---|---|---|"]
    for c, (desc, _) in CANDIDATES.items():
        d = next(v[1] for kk, v in npacc.items() if kk[1] == c)
        L.append(f"| {c} | {desc} | {d} |")
    for task in tasks:
        L += ["", f"## {task.upper()} (N = {N_TRAIN:,}): dev accuracy at lr {LR:g}, mean ± sd over {len(SEEDS)} seeds", "",
              "| arm | " + " | ".join(f"ε = {ename(e)}" for e in EPSILONS) + " | non-private L-BFGS C=1 | median ‖x‖ |",
              "|---|" + "---|" * (len(EPSILONS) + 2)]
        for c, nm in arms:
            if (task, c, nm, EPSILONS[0], LR) not in runs:
                continue
            med = next(r["median"] for r in res["norms"] if (r["task"], r["cand"], r["norm"]) == (task, c, nm))
            L.append(f"| {c} {nm} | " + " | ".join(mean_sd(runs[(task, c, nm, e, LR)]) for e in EPSILONS)
                     + f" | {npacc[(task, c, nm)][0]:.3f} | {med:.2f} |")
        L += ["", f"Paired differences against `a raw` (today), lr {LR:g}: mean Δ in points (wins/seeds, paired t-test p).", "",
              "| arm | " + " | ".join(f"ε = {ename(e)}" for e in EPSILONS) + " |", "|---|" + "---|" * len(EPSILONS)]
        for c, nm in arms:
            if (c, nm) == ("a", "raw") or (task, c, nm, EPSILONS[0], LR) not in runs:
                continue
            cells = []
            for e in EPSILONS:
                a, b = np.array(runs[(task, "a", "raw", e, LR)]), np.array(runs[(task, c, nm, e, LR)])
                dlt = b - a
                p = float(stats.ttest_rel(b, a).pvalue) if dlt.std() > 0 else float("nan")
                cells.append(f"{100 * dlt.mean():+.1f} ({(dlt > 0).sum()}/{len(dlt)}, p={p:.2g})")
            L.append(f"| {c} {nm} | " + " | ".join(cells) + " |")
        L += ["", "Step-size sensitivity (not used to choose anything): dev accuracy, mean over seeds, "
              f"lr = {' / '.join(f'{v:g}' for v in LR_GRID)}.", "",
              "| arm | " + " | ".join(f"ε = {ename(e)}" for e in EPSILONS) + " |", "|---|" + "---|" * len(EPSILONS)]
        for c, nm in arms:
            if (task, c, nm, EPSILONS[0], LR) not in runs:
                continue
            L.append(f"| {c} {nm} | " + " | ".join(
                " / ".join(f"{np.mean(runs[(task, c, nm, e, lr)]):.3f}" for lr in LR_GRID) for e in EPSILONS) + " |")
    L += ["", "## Embedding cost", "", "| task | split | rows | wall s | CPU s | load avg |", "|---|---|---|---|---|---|"]
    for task in tasks:
        t = json.loads((CACHE / f"{task}_timing.json").read_text())
        for sp in ("train", "dev"):
            L.append(f"| {task} | {sp} | {t[sp]['rows']:,} | {t[sp]['wall_s']:.0f} | {t[sp]['cpu_s']:.0f} | "
                     f"{t[sp]['load_avg_1m']:.1f} |")
    L += ["", "## Reading", "", "CONCLUSIONS_PLACEHOLDER", ""]
    OUT.write_text("\n".join(L))
    print(OUT.read_text())


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "embed":
    for t in sys.argv[2:] or TASKS:
        embed(t)
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "probe":
    write_report(probe(tuple(sys.argv[2:]) or TASKS))
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "report":
    write_report(json.loads((CACHE / "probe_pooling_results.json").read_text()))
