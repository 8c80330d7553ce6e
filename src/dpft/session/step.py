"""The one choice of the DP step for this world: :class:`~dpft.step.DPStep` in one process and under DDP
(its clipped sums all-reduced once per logical step), :class:`~dpft.placement.fsdp.FSDPStep` over an FSDP2
model (squared norms all-reduced, clipped sums reduce-scattered, sharded noise), the engine's own sharded
step (a method's engine that releases through its own mechanism) or the non-private FSDP2 step
(:class:`~dpft.placement.fsdp_plain.PlainFSDPStep`). ``dpft train`` (run/loop.py), ``make_private``
(api/engine.py) and ``DPTrainer`` (integrations/hf/trainer.py) all reach :func:`step_for` through
``PrivateSession.step`` (session/core.py; Opacus' one table of optimizer classes; DESIGN.md "Distributed").
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from dpft.accounting.ledger import PrivacyLedger
from dpft.placement.fsdp import FSDPError, FSDPStep
from dpft.placement.fsdp_plain import PlainFSDPStep
from dpft.placement.world import World
from dpft.step import DPStep

__all__ = ["step_for"]


def _driven_by_the_users_loop():  # pragma: no cover - FSDPStep.run is dpft train's; make_private never calls it
    raise RuntimeError("make_private's sharded step is driven by the user's loop")


def step_for(plan, world: World, ledger: PrivacyLedger, n: int, *, sharded: bool = False, private: bool = True,
             on_release: Optional[Callable[[], None]] = None,
             dummy_batch: Optional[Callable[[], Mapping[str, torch.Tensor]]] = None) -> DPStep:
    """The step of ``plan`` (anything with a ``spec``: step/plan.py's ``PrivacyPlan``) for this world.

    Args:
        world: this process's world (``session_world``); its group all-reduces the clipped sums.
        ledger: the run's ledger (the step is its only writer); n: N privacy units.
        sharded: the model is an FSDP2 (``fully_shard``) root: the sharded step.
        private: False for a non-private run (``dpft train --no-dp``): under FSDP2 the plain sharded step.
        on_release: called after every ledger append (the live ledger, the release record).
        dummy_batch: the sharded step's placeholder micro-batch, the same on every rank (None: a loop
            the user drives, which never runs the step's own ``run``).

    Returns:
        ``DPStep`` (one process, DDP), the engine's own ``fsdp_step(spec, ledger, n, world, on_release)``
        when it sets one, ``FSDPStep`` (private) or ``PlainFSDPStep`` (not private).

    Raises:
        FSDPError: a non-private sharded plan whose spec carries a mechanism but whose engine has no
            sharded step (it would run without noise); what ``FSDPStep`` refuses.
    """
    spec = plan.spec
    if not sharded:
        return DPStep(spec, ledger, n, on_release=on_release, world_group=world.group)
    own = getattr(spec.engine, "fsdp_step", None)
    if own is not None:  # a capability handed by the method's engine: this layer names no method
        return own(spec, ledger, n, world, on_release)
    if not private and spec.mechanism is not None:
        raise FSDPError(f"perf.sharding: fsdp: the step's mechanism {type(spec.mechanism).__name__} has no "
                        "sharded step (its engine sets no fsdp_step); use perf.sharding: ddp")
    if private:
        return FSDPStep(spec, ledger, n, world, dummy_batch or _driven_by_the_users_loop, on_release=on_release)
    return PlainFSDPStep(spec, ledger, n, world, dummy_batch, on_release=on_release)
