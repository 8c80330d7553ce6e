"""FSDP2 against DDP on CPU: a random-initialised Qwen2-0.5B-shaped causal LM, 2 processes (gloo).

The same reproducible DP recipe (``dpft train`` path: text task, book-keeping engine, Adam, flat
clipping, fixed σ) is run three times:

- ``perf.sharding: ddp``  with 2 processes (torchrun): every rank holds the whole model;
- ``perf.sharding: fsdp`` with 2 processes (torchrun): FSDP2 ``fully_shard`` per decoder layer + root;
- ``perf.sharding: fsdp`` in 1 process (the reference the 2-process run must equal).

Each rank reports, measured inside the run: the bytes of its parameters (its local shards under FSDP,
frozen ones included) and of its optimizer state after the first step, the peak resident set size
(``ru_maxrss``) at the end of the last training step (before the final evaluation and saving, which
gather the full model), and the wall time of every logical step (``Trainer.step``: sampling, the
micro-batches' forward/backward/clip, the reduce-scatter or all-reduce, noise, optimizer). The
table compares the runs' ledgers and trained weights.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/fsdp_cpu.py [--layers 24] [--steps 3]

Writes benchmarks/results/fsdp_cpu.md. Model: Qwen2Config(hidden 896, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings) with ``--layers`` of its 24 decoder layers; a
word-level tokenizer of ~60 tokens (the ids it emits are a small part of the vocabulary; the
embedding and head are still full size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the cheap pub near river serves french food family friendly a restaurant called green man is in city "
         "centre with high prices and low rating coffee shop kids not allowed").split()


# -------------------------------------------------------------------------------- worker (one rank)
def worker(cfg_path: str) -> None:
    import torch

    from dpft.config.recipe import load_recipe
    from dpft.placement.fsdp import local
    from dpft.run.loop import Trainer

    cfg = json.loads(Path(cfg_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    tr = Trainer(load_recipe(None, cfg["recipe"]), cfg["run_dir"], progress=False)
    stats: dict = {"rank": rank, "world": tr.world.world_size, "sharding": cfg["recipe"]["perf.sharding"],
                   "step_s": []}
    real = tr.step

    def step(t):
        t0 = time.perf_counter()
        out = real(t)
        stats["step_s"].append(time.perf_counter() - t0)
        stats["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if "param_bytes" not in stats:
            stats["param_bytes"] = sum(local(p).numel() * p.element_size() for p in tr.model.parameters())
            stats["optim_bytes"] = sum(local(v).numel() * v.element_size() for st in tr.optimizer.state.values()
                                       for v in st.values() if isinstance(v, torch.Tensor))
            stats["n_params"] = sum(p.numel() for p in tr.model.parameters())
        return out

    tr.step = step
    tr.run()
    Path(cfg["log"].format(rank=rank)).write_text(json.dumps(stats))


# -------------------------------------------------------------------------------- driver
def make_model(d: Path, layers: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special + ["."] + sorted(set(WORDS)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
                                   bos_token_id=2, eos_token_id=3)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)


def launch(cmd: list[str]) -> float:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fsdp_cpu.md"))
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    from safetensors.torch import load_file

    tmp = Path(tempfile.mkdtemp(prefix="fsdp_cpu_"))
    try:
        make_model(tmp / "model", a.layers)
        lines = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(8 + i % 13)) + " ." for i in range(400)]
        (tmp / "corpus.txt").write_text("\n".join(lines))
        recipe = {"task.name": "text", "task.train_file": str(tmp / "corpus.txt"), "model.name": str(tmp / "model"),
                  "model.max_length": a.seq, "model.dropout": 0.0, "privacy.noise_multiplier": 1.0,
                  "privacy.target_epsilon": None, "privacy.delta": 1e-5, "privacy.reproducible": True,
                  "privacy.engine": "bookkeeping", "optimizer.name": "adam", "optimizer.lr": 1e-4,
                  "schedule.steps": a.steps, "batch.expected_batch_size": a.batch,
                  "batch.max_physical_batch_size": max(1, a.batch // 2), "eval.every_steps": a.steps,
                  "eval.batch_size": 4, "checkpoint_every": a.steps}
        runs = {"ddp-2": ("ddp", 2), "fsdp-2": ("fsdp", 2), "fsdp-1": ("fsdp", 1)}
        res: dict = {}
        for name, (sharding, k) in runs.items():
            cfg = {"recipe": {**recipe, "perf.sharding": sharding}, "run_dir": str(tmp / name),
                   "log": str(tmp / f"{name}.rank{{rank}}.json")}
            (tmp / f"{name}.json").write_text(json.dumps(cfg))
            me = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tmp / f"{name}.json")]
            cmd = me if k == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc_per_node={k}", *me[1:]]
            load0 = os.getloadavg()[0]
            wall = launch(cmd)
            res[name] = {"wall": wall, "load": (load0, os.getloadavg()[0]),
                         "ranks": [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(k)]}
            print(name, f"{wall:.0f}s", file=sys.stderr)
        led = {n: json.loads((tmp / n / "ledger.json").read_text()) for n in runs}
        w = {n: load_file(str(tmp / n / "checkpoint" / "trainable.safetensors")) for n in runs}
        diff_fsdp = max(float((w["fsdp-2"][n] - w["fsdp-1"][n]).abs().max()) for n in w["fsdp-1"])
        write(a, res, led, diff_fsdp, w)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write(a, res, led, diff_fsdp, w) -> None:
    import platform

    import torch

    gb = 1024 ** 3
    n_params = res["ddp-2"]["ranks"][0]["n_params"]
    rows = []
    for name, label in (("ddp-2", "DDP, 2 processes"), ("fsdp-2", "FSDP2, 2 processes"),
                        ("fsdp-1", "FSDP layout, 1 process")):
        r = res[name]
        for s in r["ranks"]:
            later = s["step_s"][1:] or s["step_s"]
            rows.append(f"| {label} | {s['rank']} | {s['param_bytes'] / gb:.3f} | {s['optim_bytes'] / gb:.3f} | "
                        f"{(s['param_bytes'] + s['optim_bytes']) / gb:.3f} | {s['rss_peak_mb'] / 1024:.2f} | "
                        f"{statistics.mean(later):.1f} | {' / '.join(f'{x:.1f}' for x in s['step_s'])} | "
                        f"{r['load'][0]:.1f} → {r['load'][1]:.1f} |")
    d0 = res["ddp-2"]["ranks"][0]
    f0 = res["fsdp-2"]["ranks"]
    ratio = max((s["param_bytes"] + s["optim_bytes"]) for s in f0) / (d0["param_bytes"] + d0["optim_bytes"])
    cmd = (f"OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/fsdp_cpu.py --layers {a.layers} "
           f"--steps {a.steps} --batch {a.batch} --seq {a.seq}")
    text = f"""# FSDP2 vs DDP on CPU (2 processes, gloo): a Qwen2-0.5B-shaped model

Command: `{cmd}`; each run is `dpft train`'s Trainer (rank processes started by `python -m torch.distributed.run
--standalone --nproc_per_node=2`), one torch thread per process.

Model: random-initialised Qwen2 (hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936, tied
embeddings), **{a.layers} of Qwen2-0.5B's 24 decoder layers**, {n_params:,} parameters, all trainable (full
fine-tuning), fp32.{"" if a.layers >= 24 else " Fewer layers than 24 because the DDP and 1-process runs hold the whole model with Adam, the clipped sum and `.grad` (about 6 × 2 GiB per process for all 24 layers) on a 23 GiB machine shared with other jobs; the embedding/head (136M parameters) is the same as the full model's."} Recipe: text task, {a.seq}-token blocks, expected logical batch {a.batch}, micro-batches of
{max(1, a.batch // 2)}, {a.steps} logical steps, book-keeping engine, flat clipping, σ = 1.0, Adam, reproducible
mode. Machine: {platform.machine()}, {os.cpu_count()} CPU cores **shared with other jobs** (load average in
the table), torch {torch.__version__}.

| run | rank | parameters (GiB) | optimizer state (GiB) | parameters + optimizer (GiB) | peak RSS at the last step (GiB) | time per logical step, steps 2… (s) | every step (s) | load avg before → after |
|---|---:|---:|---:|---:|---:|---:|---|---|
{chr(10).join(rows)}

**Parameter + optimizer memory per rank, FSDP2 / DDP: {ratio:.3f}** (goal: about 1/2). Parameters and optimizer
state are the tensors each rank holds between steps (FSDP2: its dim-0 shards; the optimizer state, Adam's two
moments, is created on the shards). The peak RSS also holds what a step allocates for a moment (under FSDP2 one
gathered decoder layer at a time, the rank's activations and its full-size clipped sum of one parameter before
it is reduce-scattered; under DDP the whole clipped sum, the all-reduce buffers and `.grad`) and the Python/torch
runtime.

| equality | result |
|---|---|
| ledger.json, FSDP2 2 processes vs 1 process | {"identical" if led["fsdp-2"] == led["fsdp-1"] else "DIFFERENT"} ({sum(e["count"] for e in led["fsdp-2"]["entries"])} releases) |
| ledger.json, FSDP2 vs DDP (2 processes) | {"identical" if led["fsdp-2"] == led["ddp-2"] else "DIFFERENT"} |
| trained weights, FSDP2 2 processes vs 1 process, max abs difference | {diff_fsdp:.2e} |

FSDP2 draws its noise in a fixed block layout (`dpft/placement/fsdp.py` `shard_noise`: blocks of 65,536 elements, each
from its own secret stream), the same values with 1 or K ranks, so the 2-process FSDP2 run equals the 1-process
one up to the order of float sums; DDP draws one stream per tensor, so its weights differ from FSDP2's by other
(equally distributed) noise, while the ledgers are the same.

Generated by `benchmarks/fsdp_cpu.py`.
"""
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
