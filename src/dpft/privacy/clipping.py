"""Moved to :mod:`dpft.step.clip` (the DP step's clip stage); kept importable."""

from dpft.step.clip import *  # noqa: F401,F403
from dpft.step.clip import EPS, check_finite_norms, effective_noise_multiplier  # noqa: F401
