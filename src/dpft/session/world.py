"""The one world builder of every way in: this process's place in the world and the run's secret key.

``dpft train`` (run/plan.py), ``make_private`` (api/engine.py) and ``DPTrainer``
(integrations/hf/trainer.py) all reach it through ``PrivateSession.open`` (session/core.py);
DESIGN.md "Randomness" and "Distributed". The collectives it runs are placement/world.py's.
"""

from __future__ import annotations

from typing import Any, Optional

from dpft.placement import world as ddp
from dpft.placement.world import World
from dpft.privacy.randomness import Randomness

__all__ = ["session_world"]


def session_world(seed: Optional[int], rng: Optional[Randomness] = None, *, same: Optional[Any] = None,
                  made_for: Optional[World] = None, where: str = "dpft") -> tuple[World, Randomness]:
    """The world (torchrun's, or one process alone) and the run's one secret randomness.

    Joins an initialised process group or torchrun's environment (``init_from_env``; a 1-process
    world without one); with ``same`` (a JSON-able recipe or settings), checks that every rank
    holds the same; gives ``rng`` when the caller already has the run's key (a sub-run such as
    DP-SFT's stage 1, a ``PrivacyEngine``'s second loop), else a fresh key: drawn by rank 0 from
    the OS CSPRNG and broadcast (``seed`` None) or derived from ``seed`` on every rank
    (reproducible mode, NOT CERTIFIED for release); and checks that every rank holds the same key.

    Args:
        seed: None (secure) or the recorded seed (reproducible mode).
        rng: the run's randomness when it already exists (then ``seed`` is not used).
        same: what every rank must agree on (compared by SHA-256 across ranks), or None.
        made_for: the world ``rng`` was made in (a key made by one process alone is not a world's);
            ``where``: the way in, for the message.

    Returns:
        ``(world, rng)``.

    Raises:
        DistributedError: a bad torchrun environment (``init_from_env``), ranks with different
            ``same`` or different secret keys, or ``rng`` made in a world of another size.
    """
    world = ddp.init_from_env()
    if rng is not None and made_for is not None and made_for.world_size != world.world_size:
        raise ddp.DistributedError(
            f"{where}: this session's secret key was made in a world of {made_for.world_size} process(es) and is "
            f"asked for in one of {world.world_size}; start a new session (a new PrivacyEngine) in this world")
    if same is not None:
        ddp.check_same_recipe(world, same)
    rng = rng if rng is not None else ddp.shared_randomness(world, seed)
    ddp.check_same_randomness(world, rng)  # a caller's rng must be the world's
    return world, rng
