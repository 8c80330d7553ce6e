"""Integrations of dpft's DP step with other training front ends.

``dpft.integrations.hf.trainer``: :class:`~dpft.integrations.hf.trainer.DPTrainer`, a ``transformers.Trainer``
that trains with DP-SGD / DP-Adam (Poisson sampling, per-example clipping, Gaussian noise, one
ledger), and :class:`~dpft.integrations.hf.trainer.DPArguments`, its privacy settings.
``dpft.integrations.trl.trainer``: :class:`~dpft.integrations.trl.trainer.DPSFTTrainer` and
:class:`~dpft.integrations.trl.trainer.DPDPOTrainer`, TRL's SFT and DPO trainers with the same DP step
(docs/trl.md).

Imported lazily so that ``import dpft.integrations`` does not import ``transformers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DPArguments", "DPTrainer", "DPSFTTrainer", "DPDPOTrainer"]


def __getattr__(name: str) -> Any:
    if name in ("DPSFTTrainer", "DPDPOTrainer"):  # dpft.integrations.trl.trainer (needs trl)
        from dpft.integrations.trl import trainer as trl

        return getattr(trl, name)
    if name in __all__:
        from dpft.integrations.hf import trainer as hf

        return getattr(hf, name)
    raise AttributeError(f"module 'dpft.integrations' has no attribute {name!r}")
