"""Adapter-DP (Houlsby bottleneck adapters, Yu et al. 2022's baseline) vs DP-LoRA on SST-2 with
MiniLM at the same ε (issue 29): same data subset, steps, batch, clipping, learning rates and ε;
≥ 3 seeds per arm, paired tests on the dev predictions (benchmarks/_experiment.py).

    python benchmarks/adapter_dp.py --seeds 3 --out runs/adapter_dp --md benchmarks/results/adapter_dp.md
    python benchmarks/adapter_dp.py --smoke --seeds 2   # tiny model/data: plumbing only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _experiment import Arm, collected, run_experiment, seeds_arg, smoke_assets, smoke_overrides, table, write  # noqa: E402

RECIPE = "recipes/sst2-minilm-adapter.yaml"


def arms(extra: dict, lora_r: int) -> list[Arm]:
    """``adapter`` (the recipe) and ``lora`` (the same recipe without adapters, LoRA r on query/value)."""
    lora = {**extra, "model.adapter": None, "trainable.mode": "lora", "trainable.lora.r": lora_r,
            "trainable.lora.alpha": 2 * lora_r}
    return [Arm("adapter", RECIPE, dict(extra)), Arm("lora", RECIPE, lora)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="3")
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=None, help="schedule.steps (default: the recipe's 60)")
    ap.add_argument("--n", type=int, default=None, help="task.max_train_examples (default: the recipe's 4000)")
    ap.add_argument("--batch", type=int, default=None, help="batch.expected_batch_size (default: the recipe's 128)")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--out", default="runs/adapter_dp")
    ap.add_argument("--md", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--collect-only", action="store_true", help="tables from the finished runs in --out; run nothing")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    extra: dict = {"privacy.target_epsilon": a.eps}
    for key, v in (("schedule.steps", a.steps), ("task.max_train_examples", a.n),
                   ("batch.expected_batch_size", a.batch)):
        if v:
            extra[key] = v
    if a.steps:
        extra["eval.every_steps"] = a.steps
        extra["checkpoint_every"] = a.steps
    if a.smoke:
        extra.update(smoke_overrides(smoke_assets(Path(tempfile.gettempdir()) / "dpft_smoke")))
        extra.update({"privacy.delta": 1e-3, "schedule.steps": 2, "batch.expected_batch_size": 16})
    if a.collect_only:  # tables from the finished runs only (report.json present); nothing is run
        rows = collected(arms(extra, a.lora_r), seeds_arg(a.seeds), a.out)
    else:
        rows = run_experiment(arms(extra, a.lora_r), seeds_arg(a.seeds), a.out, jobs=a.jobs)
    out = table(rows, reference="adapter", title=f"SST-2, MiniLM, ε = {a.eps:g}: Adapter-DP vs DP-LoRA") + "\n"
    print(out)
    if a.md:
        write(out, a.md)


if __name__ == "__main__":
    main()
