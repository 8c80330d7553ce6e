"""Moved to :mod:`dpft.step.sample` (the DP step's first stage); kept importable."""

from dpft.step.sample import PoissonSampler, hash_seed  # noqa: F401
