"""DDP on CPU: the same DP run with 1 and 2 processes (torchrun, gloo).

Runs the demo recipe (recipes/sst2-minilm.yaml: the real all-MiniLM-L6-v2, top 2 blocks + head,
head/body clipping, real SST-2 from ``DPFT_DATA_DIR``) for a few logical steps in reproducible
mode, once with ``torchrun --nproc_per_node=1`` and once with ``--nproc_per_node=2`` (one torch
thread per process), and with ``--threads-row`` once as a plain single process with 2 torch
threads (what the same 2 cores give without DDP). Reports:

- time per logical step: the ``step_seconds`` rank 0 records for each step (sampling, every
  micro-batch's forward/backward/clip on its share, the all-reduce, noise, optimizer), mean
  and median over the steps after the first (the first carries one-off allocations);
- the equality of the 1- and 2-process runs: the ledgers (every event), ε, the largest
  absolute difference of the trained weights (the checkpoints), the dev metrics.

    DPFT_DATA_DIR=../shared/data HF_HUB_OFFLINE=1 PYTHONPATH=src \\
        python benchmarks/ddp_cpu.py [--steps 8] [--batch 64] [--train-examples 4096] [--threads-row]

Writes benchmarks/results/ddp_cpu.md. The time per step of a shared machine varies with what
else runs on it; the table records the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], threads: int) -> tuple[float, tuple[float, float]]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-4000:]}")
    return wall, (load0, os.getloadavg()[0])


def step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "private_diagnostics.jsonl").read_text().splitlines()[1:]]
    return [r["step_seconds"] for r in rows if "step_seconds" in r]


def max_weight_diff(a: Path, b: Path) -> tuple[float, float]:
    from safetensors.torch import load_file

    pa, pb = load_file(str(a / "checkpoint" / "trainable.safetensors")), \
        load_file(str(b / "checkpoint" / "trainable.safetensors"))
    assert pa.keys() == pb.keys()
    diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    scale = max(float(pa[k].abs().max()) for k in pa)
    return diff, scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="expected logical batch q·N")
    ap.add_argument("--physical", type=int, default=16, help="max physical micro-batch")
    ap.add_argument("--train-examples", type=int, default=4096, help="task.max_train_examples (N)")
    ap.add_argument("--dev-examples", type=int, default=200)
    ap.add_argument("--threads-row", action="store_true",
                    help="also run 1 process with 2 torch threads (no DDP) as a reference")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ddp_cpu.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = ap.parse_args()
    if not os.environ.get("DPFT_DATA_DIR"):
        sys.exit("set DPFT_DATA_DIR to the shared data folder (../shared/data)")

    work = args.keep or Path(tempfile.mkdtemp(prefix="dpft-ddp-bench-"))
    flags = ["recipes/sst2-minilm.yaml", "--steps", str(args.steps), "--batch-size", str(args.batch),
             "--max-physical-batch-size", str(args.physical), "--max-train-examples", str(args.train_examples),
             "--max-dev-examples", str(args.dev_examples), "--eval-every", str(args.steps),
             "--checkpoint-every", str(args.steps), "--set", "privacy.reproducible=true",
             "--set", "log.private_diagnostics=true", "--quiet"]
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone"]
    runs = {
        "1 process (torchrun, 1 thread)": (torchrun + ["--nproc_per_node=1"], 1, work / "p1"),
        "2 processes (torchrun, gloo, 1 thread each)": (torchrun + ["--nproc_per_node=2"], 1, work / "p2"),
    }
    if args.threads_row:
        runs["1 process, 2 threads (no DDP, reference)"] = ([py], 2, work / "t2")
    results = {}
    for name, (launcher, threads, out) in runs.items():
        shutil.rmtree(out, ignore_errors=True)
        cmd = launcher + ["-m", "dpft", "train", *flags, "-o", str(out)]
        print(f"{name}: {shlex.join(cmd)}", file=sys.stderr)
        wall, load = run(cmd, threads)
        times = step_times(out)[1:]
        rep = json.loads((out / "report.json").read_text())
        results[name] = {"cmd": cmd, "wall": wall, "load": load, "mean": statistics.mean(times),
                         "median": statistics.median(times), "report": rep, "dir": out}

    one, two = results["1 process (torchrun, 1 thread)"], results["2 processes (torchrun, gloo, 1 thread each)"]
    same_ledger = json.loads((one["dir"] / "ledger.json").read_text()) == \
        json.loads((two["dir"] / "ledger.json").read_text())
    diff, scale = max_weight_diff(one["dir"], two["dir"])
    state2 = json.loads((two["dir"] / "checkpoint" / "state.json").read_text())

    import torch

    from dpft.accounting.ledger import PrivacyLedger

    r = one["report"]
    lines = [
        "# DDP on CPU: 1 vs 2 processes (torchrun, gloo)",
        "",
        f"Command (2 processes; `--nproc_per_node=1` for one): `OMP_NUM_THREADS=1 torchrun --standalone "
        f"--nproc_per_node=2 -m dpft train {shlex.join(flags)} -o RUN_DIR` "
        f"(run here as `python -m torch.distributed.run`, `PYTHONPATH=src`, `DPFT_DATA_DIR=../shared/data`).",
        "",
        f"Case: {r['model']['name']} ({r['model']['trainable']}: {r['model']['trainable_parameters']:,} trainable "
        f"of {r['model']['total_parameters']:,} parameters), SST-2 N = {r['task']['n_train']:,}, expected logical "
        f"batch q·N = {args.batch}, physical micro-batches ≤ {args.physical}, max_length "
        f"{r['model']['max_length']}, {args.steps} logical steps, σ = {r['dp']['noise_multiplier']:.4f}, "
        f"reproducible mode, dropout 0. Machine: {platform.machine()}, {os.cpu_count()} CPU cores "
        f"**shared with other jobs while this ran** (load average in the table), torch {torch.__version__}.",
        "",
        "| run | time per logical step, mean (s) | median (s) | × 1 process | wall incl. start-up and eval (s) "
        "| load avg before → after |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, res in results.items():
        lines.append(f"| {name} | {res['mean']:.3f} | {res['median']:.3f} | {res['mean'] / one['mean']:.2f} | "
                     f"{res['wall']:.1f} | {res['load'][0]:.1f} → {res['load'][1]:.1f} |")
    m1, m2 = one["report"]["metrics"], two["report"]["metrics"]
    lines += [
        "",
        "Time per logical step: rank 0's `step_seconds` (private diagnostics) for steps 2…"
        f"{args.steps} (step 1 carries one-off allocations): sampling, each rank's forward/backward/clip over "
        "its share, the one all-reduce of the clipped sums, noise and the optimizer step.",
        "",
        "| equality, 1 vs 2 processes | result |",
        "|---|---|",
        f"| ledger.json (every event) | {'identical' if same_ledger else 'DIFFERENT'} "
        f"({PrivacyLedger.load(two['dir'] / 'ledger.json').steps} releases) |",
        f"| ε (δ = {r['privacy'].get('delta', '')}) | {one['report']['privacy']['epsilon']!r} vs "
        f"{two['report']['privacy']['epsilon']!r} |",
        f"| trained weights, max abs difference | {diff:.3g} (largest weight {scale:.3g}) |",
        f"| dev accuracy | {m1.get('dev_accuracy')} vs {m2.get('dev_accuracy')} |",
        f"| dev loss | {m1.get('dev_loss')!r} vs {m2.get('dev_loss')!r} |",
        f"| checkpoint world_size | {state2.get('world_size')} |",
        "",
        *([f"The machine was oversubscribed while this ran (load average ≥ {min(x['load'][0] for x in results.values()):.1f} "
           f"on {os.cpu_count()} cores): the second process found no idle core (the cores are shared among all jobs), "
           "so these times do not measure scaling; they show that the 2-process step, with its all-reduce, is not "
           "slower here. On idle cores or GPUs each rank computes 1/K of the per-example gradients.", ""]
          if min(x["load"][0] for x in results.values()) >= (os.cpu_count() or 1) else []),
        "The weights differ only by the order of float sums (each rank sums its share before the all-reduce; "
        "the micro-batches hold different examples, so padding differs); the logical batches, σ, noise and "
        "ledger are the same.",
        "",
        "Generated by `benchmarks/ddp_cpu.py`.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
