"""Audit checks of the methods on the device and across processes (issue 26, item 5).

* **forward LDP across ranks** — under DDP every rank holds the run's one secret key and
  releases the rows of its share of the logical batch. Each release must carry its own noise:
  two ranks releasing the same clean matrix at the same step must send different noisy
  matrices (else anyone who sees both releases subtracts them and learns the difference of the
  clean inputs exactly). Runs the real stream choice of ``methods/ewft/method.py`` (:func:`ldp_stream`)
  and the real noise layer (:class:`~dpft.privacy.ldp.GaussianLDP`) for ranks 0 and 1 of a
  2-process world, and checks that one process alone keeps its stream names (so a 1-process run
  is unchanged). Planted ``"shared_rank_ldp_noise"``: the stream without the rank, i.e. the same
  draw on every rank.
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

from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.methods.ewft import parts as ewft_parts
from dpft.methods.ewft.method import ldp_stream
from dpft.privacy.ldp import GaussianLDP
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


def _release(run: _RunStub, step: int, h: torch.Tensor) -> torch.Tensor:
    layer = GaussianLDP(max_norm=1.0, sigma=1.0, generator=ldp_stream(run, step))
    return layer.release(h)


def _ranks(planted: Optional[str]) -> Check:
    key = Randomness()  # one secret key, as every rank holds after distributed.shared_randomness
    h = torch.zeros(2, 4, 8)  # the same clean matrices on both ranks: any difference is the noise
    with _planted(planted):
        z0 = _release(_RunStub(key, 0, 2), 3, h)
        z1 = _release(_RunStub(key, 1, 2), 3, h)
        alone = _release(_RunStub(key, 0, 1), 3, h)
    same_across = bool(torch.equal(z0, z1))
    # one process: the stream is ("ldp", step), as before DDP support (reproducible runs unchanged)
    unchanged = bool(torch.equal(alone, key.stream("ldp", 3).normal(tuple(h.shape)) * 2.0))
    ok = not same_across and unchanged
    msg = ("ranks 0 and 1 release the same clean matrix with different noise; one process keeps stream (ldp, t)"
           if ok else
           ("ranks 0 and 1 added the SAME noise to their releases: their difference is the difference of the clean "
            "inputs" if same_across else "the 1-process stream changed (reproducible runs would differ)"))
    return Check("device: forward-LDP noise is independent across DDP ranks", ok, msg)


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
    """Run the device/DDP checks (well under a second on a CPU).

    Args:
        planted: None (the real code) or ``"shared_rank_ldp_noise"``.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in PLANTED:
        raise ValueError(f"unknown planted device bug {planted!r}; known: {PLANTED}")
    return [_ranks(planted), _on_device()]
