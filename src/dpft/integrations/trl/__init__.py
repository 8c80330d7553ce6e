"""TRL's trainers with the DP step: :class:`DPSFTTrainer` and :class:`DPDPOTrainer` (trainer.py;
docs/trl.md), their FSDP2 (fsdp.py) and user-level (user.py) parts. The public path
``dpft.integrations.trl`` is kept here (``pip install 'dpft[trl]'``)."""

from dpft.integrations.trl.trainer import *  # noqa: F401,F403  (the public path dpft.integrations.trl)
from dpft.integrations.trl.trainer import __all__
