"""Hugging Face ``transformers.Trainer`` with the DP step: :class:`DPTrainer` and :class:`DPArguments`
(trainer.py), :func:`privatize_trainer` (privatize.py); docs/ways_in.md. The public path
``dpft.integrations.hf`` is kept here."""

from dpft.integrations.hf.privatize import privatize_trainer
from dpft.integrations.hf.trainer import *  # noqa: F401,F403  (the public path dpft.integrations.hf)
from dpft.integrations.hf.trainer import __all__ as _trainer_all

__all__ = [*_trainer_all, "privatize_trainer"]
