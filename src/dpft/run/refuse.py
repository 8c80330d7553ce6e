"""What ``dpft train`` refuses from the recipe alone, before any data or model is loaded, and the
run's placement (device and precision, itself refused first where it cannot be honoured).

run/plan.py ``build_plan`` calls these first, so a recipe that cannot run fails in seconds with a
message naming the fix, not after minutes of loading.
"""

from __future__ import annotations

from dpft.errors import PlanError, TrainingError
from dpft.models.quant import check_recipe as check_quantization
from dpft.placement import world as ddp
from dpft.placement.device import Placement, build_placement
from dpft.placement.fsdp import check_recipe as check_sharding
from dpft.run.auto import has_auto
from dpft.run.unit import check_user_level
from dpft.step.mechanisms import Mechanism, mechanism_of_recipe

__all__ = ["refuse_unresolved", "refuse_and_place", "recipe_mechanism"]


def refuse_unresolved(recipe) -> None:
    """Refuse a recipe whose ``auto`` settings are not resolved yet (every way in resolves them
    first: ``dpft train``, ``dpft.train``, ``dpft audit``).

    Raises:
        TrainingError: naming ``dpft.run.auto.resolve_auto``."""
    if has_auto(recipe):
        raise TrainingError("batch.expected_batch_size / schedule.steps 'auto': resolve them with "
                            "dpft.run.auto.resolve_auto(recipe) before building the plan")


def refuse_and_place(recipe, world, methods: list, resume: bool, progress: bool) -> tuple[Placement, Mechanism]:
    """The refusals that need no data, in order — processes without ``perf.sharding``, quantization
    (QLoRA), FSDP2's, the placement's own (device, precision), user level's, the mechanism's — and
    the run's :class:`~dpft.placement.device.Placement` and mechanism part.

    Args:
        world: this process's world (session/world.py); methods: the recipe's active methods.
        resume: the run resumes (FSDP2 refuses what it cannot resume); progress: this process
            prints (the placement's fallback message).

    Returns:
        ``(placement, mechanism)``.

    Raises:
        DistributedError, TrainingError, PlanError, DeviceError, ValueError: each naming the fix."""
    r, private = recipe, recipe.privacy.enabled
    if world.distributed and r.perf.sharding == "none":
        raise ddp.DistributedError(f"perf.sharding: none but this run has {world.world_size} processes; run "
                                   "without torchrun, or set perf.sharding: ddp or fsdp")
    check_quantization(r)  # model.quantization (QLoRA): bitsandbytes installed, LoRA only
    if r.perf.sharding == "fsdp":
        check_sharding(r, world.world_size, methods, private, resume)
    placement = build_placement(r, world.local_rank if world.distributed else None, progress,
                                [m.name for m in methods if not getattr(m, "supports_device", False)])
    if r.task.user_column and private:
        check_user_level(r, [m.name for m in methods])
    return placement, recipe_mechanism(r, private, [m.name for m in methods])


def recipe_mechanism(r, private: bool, method_names: list[str]) -> Mechanism:
    """The recipe's mechanism part (step/mechanisms.py), after its refusals (from the recipe alone).

    Raises:
        PlanError: naming the reason and the fix."""
    try:
        mechanism = mechanism_of_recipe(r)
    except PlanError as exc:
        raise PlanError(f"cannot certify this recipe: {exc}") from None
    why = mechanism.refusals(user_level=bool(r.task.user_column) and private,
                             methods=method_names if private else (), schedule=bool(r.batch.schedule))
    if why:
        raise PlanError("cannot certify this recipe: " + "; ".join(why))
    return mechanism
