"""Paired comparison of two runs on the same dev examples (issue 18: "paired tests on the same
dev predictions").

A run with ``eval.save_predictions: true`` writes ``dev_predictions.jsonl`` (one line per dev
example: ``index``, ``prediction``, ``correct``). Two such runs on the same dev split give, per
example, a pair of correctness bits; from them:

* :func:`mcnemar_exact` — McNemar's exact test (two-sided binomial test of the discordant
  pairs, b = A right & B wrong, c = A wrong & B right, H0: b ~ Bin(b + c, 1/2));
  p = min(1, 2·P[X ≤ min(b, c)]), X ~ Bin(b + c, 1/2) (McNemar 1947; exact form as in
  statsmodels' ``mcnemar(exact=True)``).
* :func:`paired_bootstrap` — percentile bootstrap CI of acc(A) − acc(B), resampling dev
  examples (the pair stays together), Efron & Tibshirani 1993 ch. 13.

Paired tests see the dev-set sampling noise only once: far more sensitive than comparing two
accuracies each ± 1.4 points (872 SST-2 dev sentences). They say nothing of seed-to-seed
variation of training; that needs several seeds per arm (benchmarks/_experiment.py).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from dpft.accounting.io import atomic_write_text

PREDICTIONS_FILE = "dev_predictions.jsonl"


class PairedError(ValueError):
    """Predictions that cannot be paired; the message names the fix."""


def write_predictions(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (dicts with ``index``, ``prediction``, ``correct``) as JSON lines."""
    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(dict(r)) + "\n" for r in rows))
    return path


def load_correct(path: str | Path) -> dict[int, bool]:
    """``{dev index: correct}`` from a predictions file or a run directory holding one.

    Raises:
        PairedError: no file (run with ``eval.save_predictions: true``), or a malformed line.
    """
    p = Path(path)
    if p.is_dir():
        p = p / PREDICTIONS_FILE
    if not p.is_file():
        raise PairedError(f"no predictions at {p}: run with eval.save_predictions: true")
    out = {}
    for k, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out[int(row["index"])] = bool(row["correct"])
        except (ValueError, KeyError, TypeError):
            raise PairedError(f"{p}:{k + 1} is not a prediction line (index, prediction, correct)") from None
    return out


def pair(a: Mapping[int, bool] | Sequence[bool], b: Mapping[int, bool] | Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """Align two runs' correctness on the same dev examples.

    Raises:
        PairedError: the two runs did not predict the same dev examples.
    """
    if not isinstance(a, Mapping):
        a = dict(enumerate(a))
    if not isinstance(b, Mapping):
        b = dict(enumerate(b))
    if set(a) != set(b):
        raise PairedError(f"the runs predicted different dev examples ({len(a)} vs {len(b)}; "
                          f"{len(set(a) ^ set(b))} not shared): compare runs on the same dev split")
    if not a:
        raise PairedError("no predictions to compare")
    keys = sorted(a)
    return [bool(a[k]) for k in keys], [bool(b[k]) for k in keys]


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float]:
    """McNemar's exact two-sided test of paired correctness bits ``a``, ``b`` (same length).

    Returns:
        ``{"n", "b" (a right, b wrong), "c" (a wrong, b right), "p_value"}``; p = 1 when no
        pair is discordant. Exact (rational arithmetic), any n.
    """
    if len(a) != len(b):
        raise PairedError(f"paired bits of different lengths {len(a)} and {len(b)}")
    nb = sum(1 for x, y in zip(a, b) if x and not y)
    nc = sum(1 for x, y in zip(a, b) if y and not x)
    m = nb + nc
    if m == 0:
        p = 1.0
    else:
        tail = Fraction(sum(math.comb(m, k) for k in range(min(nb, nc) + 1)), 2 ** m)
        p = float(min(Fraction(1), 2 * tail))
    return {"n": len(a), "b": nb, "c": nc, "p_value": p}


def paired_bootstrap(a: Sequence[bool], b: Sequence[bool], n_boot: int = 10000, level: float = 0.95,
                     seed: int = 0) -> dict[str, float]:
    """Percentile bootstrap CI of acc(a) − acc(b), resampling examples with their pair.

    Returns:
        ``{"diff", "lo", "hi", "level", "n_boot"}`` (accuracy differences as fractions).
    """
    import numpy as np

    if len(a) != len(b) or not len(a):
        raise PairedError("paired_bootstrap needs two non-empty bit sequences of the same length")
    if not 0 < level < 1 or n_boot < 1:
        raise PairedError("paired_bootstrap needs 0 < level < 1 and n_boot ≥ 1")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(n_boot, len(d)))
    boots = d[idx].mean(axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "level": level, "n_boot": n_boot}


def compare_runs(run_a: str | Path, run_b: str | Path, n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Accuracies, McNemar's exact test and the paired bootstrap CI of two runs' dev predictions
    (run directories or predictions files)."""
    a, b = pair(load_correct(run_a), load_correct(run_b))
    return {"acc_a": sum(a) / len(a), "acc_b": sum(b) / len(b), "mcnemar": mcnemar_exact(a, b),
            "bootstrap": paired_bootstrap(a, b, n_boot=n_boot, seed=seed)}
