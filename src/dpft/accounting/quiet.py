"""Quiet absl's RDP notes (dp-accounting logs "failed to converge … Excluding this order" through absl;
an excluded order is +inf in the RDP curve, so every bound stays valid)."""

from __future__ import annotations

import contextlib
import logging

__all__ = ["quiet_absl"]


class _DropWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING


@contextlib.contextmanager
def quiet_absl():
    """Drop absl warnings (dp-accounting's RDP code logs "failed to converge … Excluding this
    order" through absl): the RDP value is a cross-check only, PLD is the reported one."""
    logger, flt = logging.getLogger("absl"), _DropWarnings()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


