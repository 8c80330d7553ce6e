"""Moved to :mod:`dpft.step.noise` (the DP step's Gaussian mechanism); kept importable."""

from dpft.step.noise import GaussianMechanism  # noqa: F401
