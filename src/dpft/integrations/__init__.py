"""Integrations of dpft's DP step with other training front ends.

``dpft.integrations.hf``: :class:`~dpft.integrations.hf.DPTrainer`, a ``transformers.Trainer``
that trains with DP-SGD / DP-Adam (Poisson sampling, per-example clipping, Gaussian noise, one
ledger), and :class:`~dpft.integrations.hf.DPArguments`, its privacy settings.
``dpft.integrations.trl``: :class:`~dpft.integrations.trl.DPSFTTrainer` and
:class:`~dpft.integrations.trl.DPDPOTrainer`, TRL's SFT and DPO trainers with the same DP step
(docs/trl.md).

Imported lazily so that ``import dpft.integrations`` does not import ``transformers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DPArguments", "DPTrainer", "DPSFTTrainer", "DPDPOTrainer"]


def __getattr__(name: str) -> Any:
    if name in ("DPSFTTrainer", "DPDPOTrainer"):  # dpft.integrations.trl (needs trl)
        from dpft.integrations import trl

        return getattr(trl, name)
    if name in __all__:
        from dpft.integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'dpft.integrations' has no attribute {name!r}")
