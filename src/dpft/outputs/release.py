"""The release set: which files a run writes for release, and what each may hold.

Everything in the release set is covered by the run's ledger or is public: the model and its
checkpoints (post-processing of the noisy releases), the ledger and ε, dev metrics (see
``DEV_STATEMENT``: covered only when the dev set is public), noised statistics (the privatised
clip rate of adaptive clipping), learning rates and post-processing diagnostics of the noisy
gradient (RMT denoiser counts).

Per-step private diagnostics — the un-noised training loss, the realised Poisson batch size,
the raw clip fraction, per-step wall times (they grow with the batch size) — are *not* covered.
They never enter ``metrics.jsonl``, ``report.json``, checkpoints, ``training.png`` or the
progress bar. With ``log.private_diagnostics: true`` they go to :data:`DIAGNOSTICS_FILE`, mode
0600, whose first line says it is not covered; that file is for the data holder only.

Source: DESIGN.md "The release set"; issue 13.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Files of a run directory that are released, and what each holds.
RELEASE_SET: dict[str, str] = {
    "model/": "fine-tuned model and tokenizer (post-processing of the noisy updates)",
    "model_ema/": "EMA of the weights, when kept (post-processing)",
    "checkpoint/": "trainable weights, optimizer state, ledger, step and released metrics",
    "checkpoint_shards/": ("FSDP runs: per-rank shards (torch.distributed.checkpoint) of the trainable weights and "
                           "optimizer state (post-processing)"),
    "ledger.json": "every private release of the run (dp_accounting events), appended to live",
    "metrics.jsonl": "per step: learning rate and post-processing statistics; per evaluation: dev metrics and ε",
    "report.json": "the run's settings, privacy section, final dev metrics, released history",
    "report.md": "the same for people",
    "training.png": "dev metric and ε against steps (released quantities only)",
    "recipe.yaml": "the recipe as run (public settings; no mechanism seed unless privacy.reproducible)",
    "subspace/": "DP-SFT basis (covered by the ledger's stage-1 phase, or public)",
    "model_merged/": "LoRA runs with output.merge_lora: the adapter merged into the weights (post-processing)",
}

#: The data holder's file of per-step private statistics (off by default).
DIAGNOSTICS_FILE = "private_diagnostics.jsonl"

DIAGNOSTICS_HEADER = {
    "NOT_COVERED": "This file holds per-step statistics computed on the private training data "
                   "without noise (training loss, realised batch size, clip fraction, step times). "
                   "They are NOT covered by the run's ε. Do not share or publish this file."
}

#: Row keys that are private (un-noised functions of the training data or of the secret sampling).
PRIVATE_KEYS = frozenset({
    "train_loss", "train_loss_per_token", "batch_size", "clip_fraction", "step_seconds",
    "transform_seconds", "clip_rate_raw", "overflowed",
})


def split_row(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(released, private)`` parts of one metrics row (``step`` goes in both)."""
    rel = {k: v for k, v in row.items() if k not in PRIVATE_KEYS}
    prv = {k: v for k, v in row.items() if k in PRIVATE_KEYS or k == "step"}
    return rel, prv


class DiagnosticsLog:
    """Appends private rows to ``run_dir/private_diagnostics.jsonl`` (0600, header first)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / DIAGNOSTICS_FILE
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "a") as f:
            if new:
                f.write(json.dumps(DIAGNOSTICS_HEADER) + "\n")

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def dev_statement(dev_public: bool, dev_source: str) -> str:
    """What the report may say about the dev metrics."""
    if dev_public:
        return (f"Dev metrics are computed on {dev_source}, public benchmark data: they reveal nothing about "
                "the training examples beyond what the released model does.")
    return (f"Dev metrics are computed on {dev_source}, which is your data and not part of training: "
            "they are exact statistics of those dev examples and are NOT covered by ε. Share them only if "
            "the dev examples may be disclosed, or evaluate on public data.")


def read_diagnostics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The private rows of a run (``private_diagnostics.jsonl`` without its header); [] if absent.

    For the data holder's own analysis (benchmarks); never part of a release."""
    path = Path(run_dir) / DIAGNOSTICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if "NOT_COVERED" not in r]
