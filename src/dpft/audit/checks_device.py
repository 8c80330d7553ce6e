"""Audit checks of forward LDP's noise across processes and on the device (issue 26 item 5, issue 38).

* **each rank's release noise is its own stream, under DDP and FSDP2** — every rank holds the run's one secret
  key and releases the rows of its share of the logical batch. Through a real ``LDPRun`` (audit/checks_fsdp_ewft.py
  ``ldp_run``) rank r's noise at step t is exactly the stream (``ldp``, t, ``rank``, r), the same under DDP and
  FSDP2, with std σ·2C; ranks 0 and 1 draw independent noise (two ranks releasing the same clean matrix with the
  same noise let anyone who sees both releases subtract them and learn the difference of the clean inputs
  exactly); one process alone keeps its stream names (a 1-process run unchanged). Planted
  ``shared_rank_ldp_noise``: the stream without the rank on every rank; ``ewft_fsdp_shared_stream``: under
  FSDP2 only (as if the FSDP world drew one stream, like the sharded gradient noise).
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

from dpft.audit.checks_fsdp_ewft import ldp_run
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.methods.ewft import parts as ewft_parts
from dpft.methods.ewft.method import ldp_stream
from dpft.privacy.randomness import Randomness

__all__ = ["PLANTED", "device_checks", "rank_stream_check"]

#: Planted bugs :func:`device_checks` must catch.
PLANTED = ("shared_rank_ldp_noise", "ewft_fsdp_shared_stream")


@dataclass
class _RunStub:
    """What :func:`dpft.methods.ewft.method.ldp_stream` reads of a run (methods/base.py ``Run``)."""

    rng: Any
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")


#: every rank draws the same stream (under FSDP2 only)
_planted = bug_planter(PLANTED, {
    "shared_rank_ldp_noise": lambda p: p.set(ewft_parts, "rank_parts", lambda run: ()),
    "ewft_fsdp_shared_stream": lambda p: p.set(ewft_parts, "rank_parts", lambda run, real=ewft_parts.rank_parts: (
        () if ewft_parts.fsdp_world(run) else real(run)))})


def rank_stream_check(shardings: tuple = ("fsdp", "ddp")) -> Check:
    """The one check of forward LDP's release noise across processes (module docstring): through a real
    ``LDPRun``, rank r's noise at step t is exactly the stream (ldp, t, rank, r), the same under every sharding
    of ``shardings``, with std σ·2C; ranks 0 and 1 draw independent noise (the same draw on two ranks lets
    anyone who sees both releases subtract it); one process keeps the stream (ldp, t)."""
    t, shape = 3, (3, 8, 4)  # (rows, tokens, code width)
    draws, why = {}, []
    for sharding, rank, world in [(s, r, 2) for s in shardings for r in (0, 1)] + [(shardings[-1], 0, 1)]:
        ldp, tr = ldp_run(rank, world, sharding=sharding)
        ldp.before_step(t)
        lay = ldp.layer
        got = lay.noise_like(torch.zeros(shape))
        parts = ("rank", rank) if world > 1 else ()
        want = tr.rng.stream("ldp", t, *parts).normal(shape, dtype=torch.float32) * lay.sigma * lay.sensitivity
        draws[sharding, rank, world] = got
        if not torch.equal(got, want):
            why.append(f"{sharding} rank {rank} of {world}: its noise is not the stream (ldp, {t}{', rank, ' * (world > 1)}"
                       f"{rank if world > 1 else ''})")
    first = shardings[0]
    if not all(torch.equal(draws[s, r, 2], draws[first, r, 2]) for s in shardings for r in (0, 1)):
        why.append(f"the ranks of {' and '.join(shardings)} draw other noise at the same rank number")
    corr = float(torch.corrcoef(torch.stack([draws[first, 0, 2].flatten(), draws[first, 1, 2].flatten()]))[0, 1])
    if torch.equal(draws[first, 0, 2], draws[first, 1, 2]) or abs(corr) > 0.3:
        why.insert(0, f"ranks 0 and 1 added the SAME noise (correlation {corr:.3f}) to different examples: the "
                      "difference of their releases is the difference of the clean inputs")
    std = float(draws[first, 0, 2].std())
    return Check(f"device: forward-LDP noise is each rank's own stream (ldp, t, rank) under {' and '.join(shardings)}",
                 not why, "; ".join(why) or f"ranks' draws are the streams (ldp, t, rank, r) under "
                 f"{' and '.join(shardings)}, independent (corr {corr:.3f}), std {std:.3f}; one process (ldp, t)")


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
    """Run the checks of the module docstring (a few seconds on a CPU: tiny random BERTs).

    Args:
        planted: None (the real code) or one of :data:`PLANTED`.

    Raises:
        ValueError: an unknown planted bug.
    """
    with _planted(planted):
        ranks = rank_stream_check(("fsdp", "ddp"))
    return [ranks, _on_device()]
