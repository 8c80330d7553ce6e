"""Banded-MF ε against numbers the mechanism's authors published (issue 28's must-show
cross-check) → benchmarks/results/banded_mf_published.md.

The NeurIPS 2023 paper (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu,
arXiv:2306.08153) is not readable offline here, so its appendix tables could not be copied. Two
sets of numbers by the same authors are, with their code:

1. **Production DP-BandMF (Gboard)**: google-research/federated, ``mf_dpftrl_matrices/README.md``
   and ``privacy_accounting.ipynb`` (stored outputs): the Portuguese (pt-BR) and Spanish (es-US)
   language models, n = 2,000 rounds, a b̂ = 1,000-banded C with unit column norms, noise multiplier
   8.35, at most 2 participations at least b̂ rounds apart, δ = 1e-10 → ε = 0.9935500950539097
   (zCDP ρ = 0.014342572340349278); sensitivity by "Algorithm 5 of 2306.08153". dpft's version of
   that participation is ``banded_mf`` with b = 1,000 and partition rate p = 1 (every example of
   the round's partition participates: b-min-separation without sampling). Checked: the
   sensitivity² of dpft's own banded C under that pattern (the notebook's recursion, re-written
   here) and the ε of the ledger that the real :class:`BandedMFMechanism` fills over 2,000 steps.
2. **Amplified DP-BandMF (jax_privacy)**: ``jax_privacy/accounting.py`` (McKenna; cites
   2306.08153 and 2405.15913) pins, in doctests, ``dpsgd_event(σ = 3, 512 iterations, q = 0.1)``
   → ε = 3.769686577205207 at δ = 1e-6 and the σ calibrated to ε = 1 → 9.661830157637436, and
   defines ``amplified_bandmf_event(σ, n, num_bands=b, sampling_prob=p)`` as exactly that
   ``dpsgd_event`` with ⌈n/b⌉ iterations. So b = 4, n = 2,048, p = 0.1 must give the same two
   numbers: checked with the ledger of the real mechanism and dpft's σ calibration.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/banded_mf_published.py
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from banded_mf_accounting import ledger_of_run  # noqa: E402
from dpft.accounting.calibrate import calibrate_sigma  # noqa: E402
from dpft.step.correlated import (banded_coefficients, banded_phase_event, square_root_coefficients,  # noqa: E402
                                  strategy_matrix)


def square_sensitivity(c_matrix: np.ndarray, separation: int, max_participation: int) -> float:
    """max over participation patterns (≥ ``separation`` rounds apart, ≤ k of them) of
    Σ_j ‖C[:, j]‖²: the notebook's recursion (Algorithm 5 of 2306.08153; valid when the band
    b̂ ≤ separation, so participations touch disjoint rows)."""
    col = (c_matrix ** 2).sum(axis=0)
    n = len(col)

    @functools.lru_cache(maxsize=None)
    def rec(k: int, start: int) -> float:
        if k == 0:
            return 0.0
        if start + separation * (k - 1) >= n:
            return -math.inf
        return max(col[start] + rec(k - 1, start + separation), rec(k, start + 1))

    sys.setrecursionlimit(max(10_000, 4 * n))
    return rec(max_participation, 0)


def ledger_epsilon(sigma: float, p: float, steps: int, coeffs: np.ndarray, delta: float) -> tuple[float, int]:
    """ε (PLD) of the ledger the real mechanism fills over ``steps`` releases
    (banded_mf_accounting.ledger_of_run), and its number of non-no-op events."""
    led = ledger_of_run(sigma, p, steps, len(coeffs), coeffs)
    return led.epsilon(delta).epsilon, sum(1 for t in range(steps) if t % len(coeffs) == 0)


def main():
    t0 = time.time()
    out = ["# Banded MF: ε against the authors' published numbers", "",
           "Command: `PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/banded_mf_published.py` "
           "(sources and semantics in the script's docstring). The NeurIPS 2023 paper's own appendix "
           "tables were not reachable offline; these are numbers its authors published with their code.", ""]

    # 1. Gboard pt-BR / es-US
    n, b, sigma, delta = 2000, 1000, 8.35, 1e-10
    pub_eps, pub_rho = 0.9935500950539097, 0.014342572340349278
    coeffs = square_root_coefficients(b)  # accounting needs only the column norms and the band
    sens2 = square_sensitivity(strategy_matrix(coeffs, n), b, 2)
    eps, k = ledger_epsilon(sigma, 1.0, n, coeffs, delta)
    rho = sens2 / (2 * sigma ** 2)
    out += ["## 1. Production DP-BandMF (Gboard pt-BR and es-US; google-research/federated "
            "`mf_dpftrl_matrices/privacy_accounting.ipynb`)", "",
            "n = 2,000 rounds, b̂ = 1,000 bands, σ = 8.35, ≤ 2 participations ≥ b̂ apart, δ = 1e-10. "
            "dpft: `banded_mf`, b = 1,000, partition rate p = 1 (participation without sampling), its own "
            "banded C (‖c‖ = 1).", "",
            "| quantity | published | dpft | rel. diff |", "|---|---|---|---|",
            f"| sensitivity² (Σ column norms² over the worst pattern) | 2 (unit columns) | {sens2:.12f} | "
            f"{abs(sens2 - 2) / 2:.1e} |",
            f"| zCDP ρ = sens²/(2σ²) | {pub_rho:.15g} | {rho:.15g} | {abs(rho - pub_rho) / pub_rho:.1e} |",
            f"| ε at δ = 1e-10 (PLD; dpft: the ledger, {k} non-no-op events) | {pub_eps:.10f} | {eps:.10f} | "
            f"{abs(eps - pub_eps) / pub_eps:.1e} |", ""]

    # 2. jax_privacy doctests via amplified_bandmf_event's definition
    b, n, p, delta = 4, 2048, 0.1, 1e-6
    pub_eps, pub_sigma = 3.769686577205207, 9.661830157637436
    coeffs = banded_coefficients(n, b)
    eps, k = ledger_epsilon(3.0, p, n, coeffs, delta)
    sig = calibrate_sigma(1.0, delta, p, n, phase_event=lambda s: banded_phase_event(s, p, n, b))
    eps_pub_sigma, _ = ledger_epsilon(pub_sigma, p, n, coeffs, delta)
    out += ["## 2. Amplified DP-BandMF (jax_privacy `accounting.py` doctests; "
            "`amplified_bandmf_event` = `dpsgd_event` over ⌈n/b⌉ iterations)", "",
            "b = 4, n = 2,048 steps (⌈n/b⌉ = 512 participation rounds), p = 0.1, δ = 1e-6.", "",
            "| quantity | published | dpft | rel. diff |", "|---|---|---|---|",
            f"| ε at σ = 3 (dpft: the ledger, {k} non-no-op events) | {pub_eps:.10f} | {eps:.10f} | "
            f"{abs(eps - pub_eps) / pub_eps:.1e} |",
            f"| σ calibrated to ε = 1 (dpft: `calibrate_sigma` on the run's events) | {pub_sigma:.10f} | "
            f"{sig:.10f} | {abs(sig - pub_sigma) / pub_sigma:.1e} |",
            f"| ε of dpft's ledger at the published σ = {pub_sigma:.6f} | 1 | {eps_pub_sigma:.10f} | "
            f"{abs(eps_pub_sigma - 1):.1e} |", "",
            "dpft's calibration searches σ on a coarser (pessimistic) PLD grid and then steps σ up until "
            "the certified ε ≤ target, so its σ sits slightly above the published one: more noise, never less.", "",
            "Not reproduced: the Gboard es-ES model (b̂ = 400, σ = 1.411, 3 participations, published ε = 3.424): "
            "its C is learning-rate scaled (sensitivity² ≈ 0.600, not unit columns), and the matrix is not "
            "available offline. The paper's CIFAR-10 σ-per-ε tables: not available offline.", "",
            f"({time.time() - t0:.0f} s)"]
    path = ROOT / "benchmarks" / "results" / "banded_mf_published.md"
    path.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
