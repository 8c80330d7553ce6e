"""Markdown table of the EW-FT / DP-Forward runs under a directory (report.json of each run).

Usage: python benchmarks/ewft_table.py runs/ewft > results/ewft_sst2.md
"""

import json
import math
import sys
from pathlib import Path


def fmt(v, p=3):
    if v is None:
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return f"{v:.{p}g}" if isinstance(v, float) else str(v)


def main(root: str) -> None:
    rows = []
    for rep_path in sorted(Path(root).glob("*/report.json")):
        r = json.loads(rep_path.read_text())
        x, p = r.get("ldp"), r["privacy"]
        if x:
            loc = p["local"]
            rows.append([rep_path.parent.name, x["method"], str(x["autoencoder"] or "none"), x["position"],
                         ", ".join(f"{s:.3f}" for s in x["sigmas"]), fmt(p.get("epsilon"), 4),
                         ", ".join(fmt(e) for e in loc["epsilon_per_release_by_epoch"]),
                         fmt(loc["epsilon_per_example_all_releases"]),
                         f"{r['metrics']['dev_accuracy']:.4f}", f"{r['time_seconds']:.0f}"])
        else:
            rows.append([rep_path.parent.name, "non-private full FT", "none", "—", "—", "∞ (no DP)", "—", "—",
                         f"{r['metrics']['dev_accuracy']:.4f}", f"{r['time_seconds']:.0f}"])
        n, nd = r["task"]["n_train"], r["task"]["n_dev"]
    print("| run | σ schedule | autoencoder | position | σ_e by epoch | ε stream (PLD, δ=1e-5) | "
          "local ε per release by epoch | local ε per example, all releases | dev acc | time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if rows:
        print(f"\nN = {n} SST-2 training examples (seeded subset), dev = {nd} (GLUE SST-2 dev).")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/ewft")
