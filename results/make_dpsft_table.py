#!/usr/bin/env python
"""Build results/dpsft_sst2_minilm.md from the run folders of results/dpsft_sst2_minilm.sh.

Every ε here is read from the run's report (the PLD accountant over its ledger.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = [
    ("Non-private (top-2 blocks + head)", "nonprivate"),
    ("Full-DP (DP-AdamW, top-2 blocks + head)", "fulldp_e1"), ("Full-DP (DP-AdamW, top-2 blocks + head)", "fulldp_e4"),
    ("DP-LoRA r=16 (query, value + head)", "lora_e1"), ("DP-LoRA r=16 (query, value + head)", "lora_e4"),
    ("DP-SFT, public subspace (IMDB), start Θ*", "sft_public_e1"), ("DP-SFT, public subspace (IMDB), start Θ*", "sft_public_e4"),
    ("DP-SFT, public subspace (IMDB), start Θ0", "sft_public_init_e1"), ("DP-SFT, public subspace (IMDB), start Θ0", "sft_public_init_e4"),
    ("DP-SFT, private subspace (accounted), B1 = 32", "sft_private_e1"),
    ("DP-SFT, private subspace (accounted), B1 = 32", "sft_private_e4"),
    ("DP-SFT, private subspace (accounted), B1 = 256", "sft_private_b256_e4"),
    ("Full-DP, 60 steps", "fulldp_long_e4"),
    ("DP-SFT, public subspace (IMDB), start Θ0, 60 steps", "sft_public_init_long_e4"),
]

#: Session 3 (mean pooling, no dropout, head_body clipping and head lr 1e-2 for the baselines;
#: B = 256, 40 steps; recipes in benchmarks/recipes/i4_*.yaml).
RUNS_V2 = [
    ("Non-private (top-2 blocks + head)", "i4_nodp"),
    ("Full-DP (DP-AdamW, top-2 blocks + head)", "i4_full_e1"), ("Full-DP (DP-AdamW, top-2 blocks + head)", "i4_full_e4"),
    ("Full-DP, 72 steps (as many private examples as DP-SFT private)", "i4_full72_e4"),
    ("Full-DP from the public IMDB Θ* (warm start, no subspace)", "i4_fullwarm_e4"),
    ("DP-LoRA r=16 (query, value + head)", "i4_lora_e1"), ("DP-LoRA r=16 (query, value + head)", "i4_lora_e4"),
    ("DP-SFT, public subspace (IMDB), start Θ*", "i4_sft_pub_e1"), ("DP-SFT, public subspace (IMDB), start Θ*", "i4_sft_pub_e4"),
    ("DP-SFT, private subspace (accounted), B1 = 256", "i4_sft_priv_e1"),
    ("DP-SFT, private subspace (accounted), B1 = 256", "i4_sft_priv_e4"),
]


def main(out_dir: str, runs=None) -> str:
    d = Path(out_dir)
    rows = ["| method | run | target ε | certified ε (PLD, whole ledger) | σ stage 2 | stage-1 examples (expected) "
            "| stage-2 examples (expected) | trainable / spanned d | dev acc at start | dev acc (SST-2 dev, 872) | dev loss (nats) | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, name in runs or RUNS:
        f = d / name / "report.json"
        if not f.is_file():
            rows.append(f"| {label} | {name} | – | not run / not finished | | | | | | | | |")
            continue
        rep = json.loads(f.read_text())
        dp, pr, sub = rep["dp"], rep["privacy"], rep.get("subspace") or {}
        eps = f"{pr['epsilon']:.3f}" if dp["private"] and pr.get("epsilon") is not None else ("none" if not dp["private"] else pr.get("guarantee"))
        if dp["private"] and sub.get("source") == "private":
            eps += f" (stage 1 alone {sub['stage1_epsilon_alone']:.3f}, σ1 = {sub['stage1_noise_multiplier']:.3f})"
        st1 = sub.get("stage1_examples_expected", "") if sub else ""
        if sub.get("source") == "public" and sub.get("from_file"):
            st1 = f"{st1} (public basis reused)"
        ex2 = dp["steps"] * dp["expected_batch_size"]
        d_txt = f"{sub['d']:,} (k = {sub['k']})" if sub else f"{rep['model']['trainable_parameters']:,}"
        start = f"{sub['start_dev_accuracy']:.4f}" if "start_dev_accuracy" in sub else ""
        target = name.rsplit("_e", 1)[-1] if "_e" in name else "–"
        rows.append(f"| {label} | {name} | {target} | {eps} | {dp['noise_multiplier']:.3f} | {st1} | {ex2} | {d_txt} | "
                    f"{start} | {rep['metrics']['dev_accuracy']:.4f} | {rep['metrics']['dev_loss']:.4f} | {rep['time_seconds']:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    # python results/make_dpsft_table.py RUN_ROOT [v2]
    v2 = len(sys.argv) > 2 and sys.argv[2] == "v2"
    print(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/issue4_runs", RUNS_V2 if v2 else None))
