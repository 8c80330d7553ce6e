"""The driver's error type, re-exported from :mod:`dpft.errors` (where methods import it from
without importing the driver); the plan builders of every room raise it."""

from dpft.errors import TrainingError  # noqa: F401 (public here since issue 25)

__all__ = ["TrainingError"]
