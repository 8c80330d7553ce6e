"""Rows' frozen features, computed once and held in memory or on disk (issue 45 item 1).

A :class:`FeatureSplit` holds one split's features: ``(N, d)`` pooled embeddings, or ragged
``(T_i, d)`` hidden states stored flat as ``(Σ T_i, d)`` with row offsets. Below a memory limit
it is a torch tensor in RAM; above, a numpy memmap in a private folder (mode 0700) that the
owner removes (:meth:`FeatureStore.close`). The features are *private data at rest*: the folder
is never in a run directory, never pushed, never carried into ``model/``.

This module knows nothing of models: it is handed ``prefix(batch) -> tensor``
(dpft/models/features.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

__all__ = ["FeatureSplit", "FeatureStore", "compute_split"]


@dataclass
class FeatureSplit:
    """One split's cached features.

    Attributes:
        values: ``(N, d)`` (pooled) or ``(Σ T_i, d)`` (hidden) float32: a tensor or a memmap.
        offsets: ``(N+1,)`` int64 row starts in ``values`` (hidden), or None (pooled).
        labels: ``(N,)`` int64.
    """

    values: object
    offsets: Optional[torch.Tensor]
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.values.shape)) * 4

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        v = self.values[lo:hi]
        return v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))

    def batch(self, idx, device=None) -> dict[str, torch.Tensor]:
        """The collated batch of rows ``idx``: ``features`` ``(B, d)`` or ``(B, T, d)`` (zeros
        past each row's length, T = the longest row: the padded length of the token batch),
        ``attention_mask``/``position_ids`` ``(B, T)`` (hidden), ``labels (B,)``."""
        idx = torch.as_tensor(idx, dtype=torch.long).reshape(-1)
        if self.offsets is None:
            if isinstance(self.values, torch.Tensor):
                feats = self.values.index_select(0, idx)
            else:
                feats = torch.from_numpy(np.array(self.values[idx.numpy()]))
            out = {"features": feats, "labels": self.labels[idx]}
        else:
            starts, ends = self.offsets[idx], self.offsets[idx + 1]
            lens = (ends - starts).tolist()
            b, t = len(lens), max(lens) if lens else 1
            d = self.values.shape[1]
            feats = torch.zeros(b, t, d, dtype=torch.float32)
            mask = torch.zeros(b, t, dtype=torch.long)
            for i, (s, n) in enumerate(zip(starts.tolist(), lens)):
                feats[i, :n] = self._rows(s, s + n)
                mask[i, :n] = 1
            out = {"features": feats, "attention_mask": mask,
                   "position_ids": torch.arange(t).unsqueeze(0).expand(b, t).contiguous(),
                   "labels": self.labels[idx]}
        if device is not None and torch.device(device).type != "cpu":
            out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
        return out


@dataclass
class FeatureStore:
    """Train and dev features of one run (or of many tune trials: one store, one key).

    Attributes:
        key: SHA-256 of the frozen weights, the split, the tokenised rows and the settings.
        train, dev: the splits.
        folder: the private folder of a disk-backed or kept store (None: RAM only).
        keep: the folder outlives the store (``perf.keep_feature_cache``).
        seconds: wall time spent computing (0 when loaded from a kept folder).
    """

    key: str
    train: FeatureSplit
    dev: FeatureSplit
    folder: Optional[Path] = None
    keep: bool = False
    seconds: float = 0.0
    loaded: bool = False
    _finalizer: Optional[weakref.finalize] = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.train.nbytes + self.dev.nbytes

    @property
    def on_disk(self) -> bool:
        return not isinstance(self.train.values, torch.Tensor)

    def close(self) -> None:
        """Remove the private folder unless it is kept (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()

    def arm_removal(self) -> None:
        """Remove the folder when the store is closed, collected, or the process exits."""
        if self.folder is not None and not self.keep and self._finalizer is None:
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.folder), True)


def private_folder(parent: Optional[Path] = None, name: Optional[str] = None) -> Path:
    """A folder only this user can read (0700): a fresh temp folder, or ``parent/name``."""
    if parent is None:
        return Path(tempfile.mkdtemp(prefix="dpft-features-"))
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(parent, 0o700)
    f = parent / name
    f.mkdir(exist_ok=True, mode=0o700)
    os.chmod(f, 0o700)
    return f


def compute_split(prefix: Callable[[dict], torch.Tensor], rows, collate: Callable[[list], dict], *, pooled: bool,
                  dim: int, batch_size: int, device=None, autocast: Optional[Callable] = None,
                  disk: Optional[Path] = None, name: str = "train", progress: bool = False) -> FeatureSplit:
    """Run ``prefix`` over tokenised ``rows`` once (batches sorted by length, no gradients).

    Args:
        prefix: collated batch → ``(B, d)`` or ``(B, T, d)`` tensor.
        rows: a tokenised ``datasets.Dataset`` (``input_ids``, ``label``).
        collate: list of rows → batch on ``device``.
        pooled: the prefix returns ``(B, d)``; else ``(B, T, d)``, stored ragged.
        dim: d.
        disk: write a memmap ``<disk>/<name>.f32`` instead of holding a tensor.
    """
    from tqdm.auto import tqdm

    n = len(rows)
    lengths = [len(x) for x in rows["input_ids"]]
    labels = torch.tensor(rows["label"], dtype=torch.long) if n else torch.zeros(0, dtype=torch.long)
    offsets = None if pooled else torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.long)
    total = n if pooled else int(offsets[-1])
    if disk is not None:
        values = np.lib.format.open_memmap(str(disk / f"{name}.npy"), mode="w+", dtype=np.float32,
                                           shape=(total, dim))
    else:
        values = torch.empty(total, dim, dtype=torch.float32)
    order = sorted(range(n), key=lambda i: lengths[i])
    bar = tqdm(total=n, desc=f"features ({name})", disable=not progress, file=sys.stderr, unit="row", leave=False)
    try:
        for k in range(0, n, batch_size):
            idx = order[k:k + batch_size]
            batch = collate(list(rows.select(idx)))
            with (autocast() if autocast else contextlib.nullcontext()):
                out = prefix(batch).float().cpu()
            for j, i in enumerate(idx):
                if pooled:
                    row, lo = out[j:j + 1], i
                else:
                    row, lo = out[j, :lengths[i]], int(offsets[i])
                if disk is not None:
                    values[lo:lo + row.shape[0]] = row.numpy()
                else:
                    values[lo:lo + row.shape[0]] = row
            bar.update(len(idx))
    finally:
        bar.close()
    if disk is not None:
        values.flush()
        np.save(disk / f"{name}_labels.npy", labels.numpy())
        if offsets is not None:
            np.save(disk / f"{name}_offsets.npy", offsets.numpy())
    return FeatureSplit(values, offsets, labels)


def load_split(folder: Path, name: str) -> Optional[FeatureSplit]:
    """A split written by :func:`compute_split` in ``folder`` (memmapped), or None."""
    f = folder / f"{name}.npy"
    lab = folder / f"{name}_labels.npy"
    if not (f.is_file() and lab.is_file()):
        return None
    off = folder / f"{name}_offsets.npy"
    return FeatureSplit(np.load(f, mmap_mode="r"), torch.from_numpy(np.load(off)) if off.is_file() else None,
                        torch.from_numpy(np.load(lab)))
