"""Table of the E2E instruct runs (results/e2e_stories260k.sh) for results/e2e_stories260k.md.

    PYTHONPATH=src python results/make_e2e_table.py /tmp/instr/e2e

ε is recomputed here from each run's ledger.json (PLD, dp-accounting) and must equal the
report's; wall times come from walltimes.txt written by the run script.
"""

import json
import sys
from pathlib import Path

from dpft.accounting.ledger import PrivacyLedger

ORDER = ["full-nodp", "full-eps8", "full-eps3", "lora-nodp", "lora-eps8", "lora-eps3"]


def main(root: str) -> None:
    root = Path(root)
    walls = {}
    wt = root / "walltimes.txt"
    if wt.is_file():
        for line in wt.read_text().splitlines():
            name, rc, wall = line.split()
            walls[name] = (rc, int(wall.split("=")[1]))
    rows, samples = [], []
    for name in ORDER:
        d = root / name
        if not (d / "report.json").is_file():
            rows.append(f"| {name} | (not finished) |")
            continue
        rep = json.loads((d / "report.json").read_text())
        m, dp, mod = rep["metrics"], rep["dp"], rep["model"]
        if dp["private"]:
            led = PrivacyLedger.load(d / "ledger.json")
            eps = led.epsilon(rep["privacy"]["delta"]).epsilon
            assert abs(eps - rep["privacy"]["epsilon"]) < 1e-9, (name, eps, rep["privacy"]["epsilon"])
            eps_s, sigma = f"{eps:.3f}", f"{dp['noise_multiplier']:.4f}"
        else:
            eps_s, sigma = "∞ (no DP)", "0"
        rc, wall = walls.get(name, ("?", None))
        rows.append(f"| {name} | {mod['trainable']} ({mod['trainable_parameters']:,}) | {sigma} | {eps_s} | "
                    f"{dp['steps']} | {m['dev_bleu']:.2f} | {m['dev_rouge_l']:.2f} | {m['dev_exact_match']:.1f} | "
                    f"{m['dev_loss']:.3f} | {wall if wall is not None else '?'} |")
        samples.append(f"**{name}** (ε = {eps_s})\n")
        for s in rep["generation"]["samples"]:
            samples.append(f"- *{s['prompt']}* → {s['generation'] or '(empty)'}")
        samples.append("")
    print("| run | trainable (parameters) | σ | ε (PLD, δ = 1e-5) | steps | BLEU | ROUGE-L | exact match % | "
          "dev loss (nats/completion token) | wall time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(samples))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/e2e-instruct")
