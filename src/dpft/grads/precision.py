"""The number format of the per-example engine's forward and backward: autocast dtype and static
loss scale (:class:`Precision`). A performance setting (``perf.dtype``, ``perf.loss_scale``),
resolved for a run by placement/device.py (which re-exports it); why it cannot change the
guarantee, and how fp16 overflow keeps the sensitivity at C, is told there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

__all__ = ["DTYPES", "Precision", "FP32"]

#: Recipe names of the autocast dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """Autocast dtype and static loss scale of the forward/backward (placement/device.py tells why).

    Attributes:
        dtype: ``fp32`` (no autocast), ``bf16`` or ``fp16``.
        loss_scale: static factor S on the loss before the backward (fp16 only; 1 otherwise).
            Gradients reach the per-example engine multiplied by S and are divided by S in
            fp32 before norms are taken, so the clip sees each example's own gradient.
        device_type: ``cpu`` or ``cuda``: which autocast to enter.

    Raises:
        ValueError: unknown dtype; ``loss_scale`` ≤ 0 or not finite, or ≠ 1 without fp16.
    """

    dtype: str = "fp32"
    loss_scale: float = 1.0
    device_type: str = "cpu"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"precision dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        s = float(self.loss_scale)
        if not (s > 0 and s != float("inf")):
            raise ValueError(f"loss_scale must be a finite number > 0, got {self.loss_scale!r}")
        if self.dtype != "fp16" and s != 1.0:
            raise ValueError(f"loss_scale = {s:g} applies to fp16 only ({self.dtype} needs no loss scaling)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def mixed(self) -> bool:
        """Autocast is on (bf16 or fp16)."""
        return self.dtype != "fp32"

    @property
    def zero_nonfinite(self) -> bool:
        """An example whose loss or gradient overflowed contributes 0 instead of stopping the
        run (fp16: overflow is an expected event of the number format, see module docstring)."""
        return self.dtype == "fp16"

    def autocast(self) -> ContextManager:
        """``torch.autocast`` for the forward (a null context for fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.torch_dtype)


#: Full precision, no autocast, no scaling.
FP32 = Precision()
