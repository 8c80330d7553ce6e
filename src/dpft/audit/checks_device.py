"""Audit checks of the methods on the device and across processes (issue 26, item 5).

* **forward LDP across ranks** — under DDP every rank holds the run's one secret key and
  releases the rows of its share of the logical batch. Each release must carry its own noise:
  two ranks releasing the same clean matrix at the same step must send different noisy
  matrices (else anyone who sees both releases subtracts them and learns the difference of the
  clean inputs exactly). The one check of this property (audit/checks_fsdp_ewft.py
  :func:`~dpft.audit.checks_fsdp_ewft.rank_stream_check`, there under FSDP2 and DDP), here for the DDP
  ranks 0 and 1 of a 2-process world through a real ``LDPRun`` and its noise layer, and one process alone
  keeping its stream names (so a 1-process run is unchanged). Planted ``"shared_rank_ldp_noise"``: the
  stream without the rank, i.e. the same draw on every rank.
* **noise drawn on the model's device** — the forward-LDP stream is asked for on the device of
  the model (checked with a stand-in device, ``meta``, on a CPU-only machine), so no host round
  trip or host-only draw can sit between the clean matrix and its noise.

Entry point :func:`device_checks` (wired into ``dpft audit`` through ``audit/suite.py``
``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from dpft.audit.checks_fsdp_ewft import rank_stream_check
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.methods.ewft import parts as ewft_parts
from dpft.methods.ewft.method import ldp_stream
from dpft.privacy.randomness import Randomness

__all__ = ["PLANTED", "device_checks"]

#: Planted bugs :func:`device_checks` must catch.
PLANTED = ("shared_rank_ldp_noise",)


@dataclass
class _RunStub:
    """What :func:`dpft.methods.ewft.method.ldp_stream` reads of a run (methods/base.py ``Run``)."""

    rng: Any
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")


#: every rank draws the same stream
_planted = bug_planter(PLANTED, {
    "shared_rank_ldp_noise": lambda p: p.set(ewft_parts, "rank_parts", lambda run: ())})


def _on_device() -> Check:
    seen = []

    class Spy(Randomness):
        def stream(self, name, *parts, device=None):
            seen.append(device)
            return super().stream(name, *parts, device=device)

    ldp_stream(_RunStub(Spy(), 0, 1, torch.device("meta")), 0)
    ok = seen == [torch.device("meta")]
    return Check("device: forward-LDP noise is drawn on the model's device", ok,
                 "stream asked for on the model's device" if ok else f"stream asked for on {seen}")


def device_checks(planted: Optional[str] = None) -> list[Check]:
    """Run the device/DDP checks (a few seconds on a CPU: tiny random BERTs).

    Args:
        planted: None (the real code) or ``"shared_rank_ldp_noise"``.

    Raises:
        ValueError: an unknown planted bug.
    """
    with _planted(planted):
        ranks = rank_stream_check(("ddp",), "device: forward-LDP noise is independent across DDP ranks")
    return [ranks, _on_device()]
