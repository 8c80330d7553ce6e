"""``DPTrainer`` (and the TRL trainers built on it) on a model the user sharded with FSDP2
(``fully_shard`` on its blocks and root, before ``DPTrainer(...)``): the same sharded DP step as
``dpft train``'s ``perf.sharding: fsdp`` and ``make_private`` (dpft/fsdp.py, api/sharded.py).

``training_step`` hands the rank's share of the logical batch to :meth:`~dpft.fsdp.FSDPStep.run`:
every rank runs the same number of physical batches (a short rank runs a *placeholder* one — row 0
of the training set, collated by the trainer's collator — whose clipped sum is replaced by zeros
before the reduce-scatter), the clipped sums are reduce-scattered per parameter as the engine makes
them, the private counts are all-reduced, each shard gets its slice of the noise (one draw for the
world), one ledger event is recorded per logical step, and the noisy gradient is left in each
sharded parameter's ``.grad`` for ``Trainer``'s optimizer. accelerate prepares the model in
``evaluation_mode`` (DPTrainer's rule): no DDP or FSDP wrapper of its own.

Not here: ``TrainingArguments.fsdp`` / accelerate's FSDP plugin (accelerate would shard the model
itself and reduce-scatter unclipped gradients in its hooks); shard the model with ``fully_shard``
before building the trainer instead. Source: issue 38 item 1.
"""

from __future__ import annotations

import torch

from dpft import distributed as ddp
from dpft import fsdp
from dpft.api.sharded import check_fsdp2_model, is_fsdp2_model

__all__ = ["is_fsdp2_model", "check_fsdp2_model", "check_sharded_model", "refuse_sharded_methods",
           "sharded_trainer_step", "sharded_training_step"]


def check_sharded_model(model, where: str, mechanism=None) -> bool:
    """Whether ``model`` runs the sharded step (FSDP2, ``fully_shard`` on its root), refusing FSDP1
    and an FSDP2 model the sharded step cannot run (:func:`~dpft.api.sharded.check_fsdp2_model`).

    Raises:
        dpft.distributed.DistributedError: naming the fix."""
    ddp.refuse_sharded_model(model, where, allow_fsdp2=True)
    sharded = is_fsdp2_model(model)
    if sharded:
        check_fsdp2_model(model, where, mechanism)
    return sharded


def refuse_sharded_methods(where: str, methods: list) -> None:
    """Refuse ``DPArguments.methods`` on the sharded step, which runs no method hooks (as ``dpft
    train`` under ``perf.sharding: fsdp``: dpft/fsdp.py ``check_recipe``).

    Raises:
        ValueError: naming the fix."""
    if methods:
        raise ValueError(f"{where}: DPArguments.methods with an FSDP2 (fully_shard) model is not supported: the "
                         "sharded step runs no method hooks; drop methods or train unsharded (DDP)")


def sharded_trainer_step(trainer, spec) -> "fsdp.FSDPStep":
    """The :class:`~dpft.fsdp.FSDPStep` of a DPTrainer whose model is FSDP2-sharded; its placeholder
    micro-batch is the trainer's own first physical batch of training row 0 (the trainer's
    ``_micro_batches``: its collator, DPO's pairs with their reference log-probabilities, user
    groups), built on every rank alike (the rank's share taken as the whole one-row batch)."""

    def placeholder():
        own = trainer.__dict__.get("_share")
        trainer._share = lambda idx: idx  # every rank the same row, not its share of it
        try:
            return next(iter(trainer._micro_batches(torch.tensor([0]))))
        finally:
            if own is None:
                del trainer.__dict__["_share"]
            else:
                trainer._share = own

    return fsdp.FSDPStep(spec, trainer.ledger, trainer.n, trainer.world, placeholder,
                         on_release=trainer._save_live_ledger)


def sharded_training_step(trainer, t: int, idx: torch.Tensor) -> torch.Tensor:
    """``DPTrainer.training_step`` on the sharded step: the rank's share of logical batch ``idx``
    (step ``t``) through :meth:`~dpft.fsdp.FSDPStep.run` (placeholders, reduce-scatter, sharded noise,
    one ledger event), then the per-step digest of the logical batch (the ranks hold different
    shards, so the weights are not compared). Returns 0, or the un-noised loss when
    ``log_private_train_loss``."""
    with trainer.compute_loss_context_manager():
        out = trainer.dp_step.run(t, trainer._micro_batches(idx))
    ddp.check_step_digest(trainer.world, t, idx, {})  # the ranks hold different shards: the batch only
    trainer.last_private_stats = dict(out.private)
    if trainer.dp_args.log_private_train_loss:
        return torch.tensor(float(out.private["train_loss"]), device=trainer.args.device)
    return torch.zeros((), device=trainer.args.device)
