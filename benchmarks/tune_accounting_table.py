"""The accounting table of a private search (issue 35): per-trial σ calibrated so that the whole search spends
ε = 8 at δ = 1e-5, for several laws of K, on the demo's plan (SST-2: N = 67,349, B = 512, T = 150, score
count noise σ_s = 10), for several laws of K. Two calibrations per law: under Papernot & Steinke's RDP
bound alone (the σ dpft used before the profile bound), and under the smaller of RDP and the privacy-
profile bound (accounting/selection_profile.py; what ``dpft tune`` uses now). Columns: the law and E[K];
σ per trial and one trial's ε (PLD) under each calibration; at the new σ, the search's ε by RDP → (ε, δ),
by the profile bound, the bound that certifies, and naive composition of k* trials (P[K > k*] ≤ δ/2).

    python benchmarks/tune_accounting_table.py [--n 67349 --batch 512 --steps 150 --epsilon 8]
      > benchmarks/results/tune_accounting_table.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from dpft.accounting.selection import KDistribution, calibrate_search  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=67349)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--score-sigma", type=float, default=10.0)
    ap.add_argument("--rows", type=int, nargs="*", default=None, help="indices of the laws to compute (default all)")
    a = ap.parse_args(argv)
    laws = [("truncated_negative_binomial", 4.0, 1.0), ("truncated_negative_binomial", 10.0, 1.0),
            ("truncated_negative_binomial", 4.0, 0.0), ("truncated_negative_binomial", 4.0, 3.0),
            ("poisson", 4.0, 1.0)]
    laws = [law for i, law in enumerate(laws) if a.rows is None or i in a.rows]
    print(f"N = {a.n}, B = {a.batch}, T = {a.steps}, σ_s = {a.score_sigma}, target ε = {a.epsilon} at δ = {a.delta}\n")
    print("| K law | E[K] | σ (RDP calib.) | one trial ε (RDP calib.) | σ per trial | one trial ε | search ε (RDP, "
          "P&S 2022) | search ε (profile) | certified by | naive k* | naive ε |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, mean, eta in laws:
        d = KDistribution.with_mean(kind, mean, eta)
        plan = [(a.batch / a.n, a.steps)]
        sig_r, b_r = calibrate_search(a.epsilon, a.delta, d, plan, a.score_sigma, bound="rdp")
        sig, b = calibrate_search(a.epsilon, a.delta, d, plan, a.score_sigma)
        law = f"Poisson(μ={d.mu:g})" if kind == "poisson" else f"TNB(η={eta:g}, γ={d.gamma:.4g})"
        print(f"| {law} | {d.mean():.3g} | {sig_r[0]:.4f} | {b_r.per_trial_epsilon:.3f} | {sig[0]:.4f} | "
              f"{b.per_trial_epsilon:.3f} | {b.epsilon_rdp:.3f} | {b.epsilon_profile:.3f} | {b.certified_by} | "
              f"{b.naive_k} | {b.epsilon_naive:.3f} |", flush=True)


if __name__ == "__main__":
    main()
