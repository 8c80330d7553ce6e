"""The refusals of :class:`~dpft.integrations.hf.trainer.DPTrainer`'s front end: ``TrainingArguments`` and
``Trainer`` features that would break Poisson sampling, per-example clipping or the noise."""

from __future__ import annotations

import os

from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from dpft.api.arguments import batchnorm_modules
from dpft.config.refusals import refuse as refuse_shared
from dpft.placement import world as ddp

__all__ = ["check_training_arguments", "check_trainer", "check_training_path", "refuse", "LOOP_METHODS"]

#: ``transformers.Trainer``'s path from ``train()`` to the optimizer's step (transformers 5:
#: ``train`` → ``_inner_training_loop`` → ``_run_epoch`` → ``training_step``, then
#: ``optimizer.step()``). An override of any of them by a class the DP step does not own replaces
#: the code that runs the DP step (or runs a stock backward): refused. The sampling overrides
#: (``get_train_dataloader``, ``_get_train_sampler``) are refused by :func:`check_trainer`.
LOOP_METHODS = ("train", "_inner_training_loop", "_run_epoch", "training_step")
#: dpft's definitions that end the chain (they do not call the next class's version).
_TERMINAL = ("training_step",)
_LOOP_FIX = ("keep transformers' training loop (override compute_loss via loss_fn=, evaluation, logging or "
             "callbacks instead), or write your own loop with dpft.PrivacyEngine().make_private(...), whose "
             "optimizer.step() runs the DP step")


def refuse(msg: str) -> None:
    """Raise the front end's ``ValueError`` (``DPTrainer: …``)."""
    raise ValueError(f"DPTrainer: {msg}")


def check_training_arguments(args: TrainingArguments) -> None:
    """Refuse ``TrainingArguments`` that would break Poisson sampling, per-example clipping or the
    noise (each message names the setting and the fix)."""
    ga = getattr(args, "gradient_accumulation_steps", 1)
    if ga != 1:
        refuse(f"gradient_accumulation_steps = {ga}: the logical batch is drawn by Poisson sampling and "
               "processed in physical batches by DPTrainer itself. Set gradient_accumulation_steps=1 and "
               "choose DPArguments.expected_batch_size (the logical batch) and "
               "DPArguments.max_physical_batch_size (memory) instead")
    mgn = getattr(args, "max_grad_norm", 0.0)
    if mgn not in (None, 0, 0.0, 1.0):
        refuse(f"TrainingArguments.max_grad_norm = {mgn} clips the already-noised average gradient, not "
               "each example's. Set the per-example clip norm with DPArguments.max_grad_norm and leave "
               "TrainingArguments.max_grad_norm at its default (DPTrainer switches it off)")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in (None, "random") or getattr(args, "group_by_length", False):
        raise refuse_shared("poisson_sampling:not_poisson", "DPTrainer",
                            got="group_by_length" if strategy in (None, "random") else strategy)
    tokens = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens not in (None, False, "no"):
        refuse("include_num_input_tokens_seen counts the tokens of the private sampled batches (not "
               "covered by ε); leave it off")
    if getattr(args, "fp16", False):
        # accelerate's fp16 path wraps the optimizer in a *dynamic* GradScaler: its step()
        # divides p.grad (here the already-unscaled noisy gradient) by the scale and skips
        # steps after overflows, and the scale it keeps is a function of which private
        # examples overflowed (dpft/placement/device.py). bf16 needs no scaler.
        refuse("fp16=True: Trainer's fp16 uses a dynamic GradScaler, whose optimizer step would divide the "
               "noisy gradient by its scale and skip steps on overflow, and whose scale follows the private "
               "examples' overflow history (not covered by ε). Use bf16=True, or the dpft CLI with "
               "perf.dtype: fp16 and a static perf.loss_scale")
    if getattr(args, "auto_find_batch_size", False):
        refuse("auto_find_batch_size restarts training after an out-of-memory error, releasing noisy "
               "gradients again; set DPArguments.max_physical_batch_size instead")
    if getattr(args, "label_smoothing_factor", 0.0):
        refuse("label_smoothing_factor applies to Trainer's batch loss, which DPTrainer does not use; "
               "pass DPTrainer(loss_fn=...) with a per-example smoothed loss")
    if "lomo" in str(getattr(args, "optim", "")).lower():
        refuse("LOMO optimizers fuse the update into the backward pass; choose another optim")
    if getattr(args, "fsdp", None):  # DPTrainer runs it (integrations/hf/fsdp.py shard_requested) and clears it
        refuse("TrainingArguments.fsdp reached Trainer: accelerate's FSDP would shard the model and reduce-scatter the "
               "unclipped gradient in its hooks. Build DPTrainer with it (DPTrainer shards with dpft's FSDP2 step and "
               f"clears it), or {ddp.SHARDED_FIX}")
    if getattr(args, "deepspeed", None) or str(os.environ.get("ACCELERATE_USE_DEEPSPEED", "")).lower() in (
            "1", "true", "yes"):
        refuse("DeepSpeed is not supported (ZeRO partitions and reduces the unclipped gradient); train on one "
               "device per process (DDP: torchrun or accelerate launch), or use `dpft train` with "
               "perf.sharding: fsdp for a model beyond one device")
    if getattr(args, "world_size", 1) > 1:
        from transformers.training_args import ParallelMode

        if args.parallel_mode != ParallelMode.DISTRIBUTED:
            refuse(f"world_size = {args.world_size} in parallel mode {args.parallel_mode}: DPTrainer runs "
                   "several processes only under torch.distributed data parallelism; launch with torchrun "
                   "--nproc_per_node=K or accelerate launch --multi_gpu --num_processes K")
    if getattr(args, "n_gpu", 1) > 1:
        refuse(f"{args.n_gpu} GPUs visible (torch.nn.DataParallel); expose one device, e.g. "
               "CUDA_VISIBLE_DEVICES=0")

def _owned(klass: type) -> bool:
    """A class whose loop methods are the DP step's (dpft's trainers) or transformers' stock ones."""
    from transformers import Trainer

    return klass is Trainer or _dpft_trainer(klass)


def _dpft_trainer(klass: type) -> bool:
    return klass.__module__.startswith("dpft.integrations.")


def loop_overrides(cls: type) -> list[str]:
    """``Class.method`` for every :data:`LOOP_METHODS` override in ``cls``'s method order that would
    run (before dpft's terminal definition, if any) and is not dpft's or ``transformers.Trainer``'s."""
    out = []
    for meth in LOOP_METHODS:
        for klass in cls.__mro__:
            if meth not in klass.__dict__:
                continue
            if not _owned(klass):
                out.append(f"{klass.__name__}.{meth}")
                break
            if _dpft_trainer(klass) and meth in _TERMINAL:
                break  # dpft's training_step never calls the next class's
    return out


def check_training_path(cls: type, where: str) -> None:
    """Refuse a trainer class whose training loop is not transformers' stock loop around the DP
    step (:data:`LOOP_METHODS` overridden by the user's class or a third-party base).

    Raises:
        ValueError: naming the overrides and the fix."""
    own = loop_overrides(cls)
    if own:
        raise ValueError(f"{where}: {', '.join(own)} overrides transformers' training loop, which must run the DP "
                         "step (Poisson batch, per-example clipping, noise, ledger) before every optimizer update; "
                         f"its own loop would update the weights outside the DP step and ε would cover nothing. "
                         f"Remove the override: {_LOOP_FIX}")


def check_trainer(self, loss_fn, base) -> None:
    """Refuse a trainer whose sampling, training loop, loss or plugins break the DP step (``base``:
    DPTrainer); the training loop is checked before (:func:`check_training_path`)."""
    for meth in ("get_train_dataloader", "_get_train_sampler"):
        if getattr(type(self), meth) is not getattr(base, meth):
            refuse(f"{type(self).__name__}.{meth} is overridden: a custom (shuffled, fixed-size) train "
                   "sampler or dataloader breaks the Poisson sampling DPTrainer's ε assumes; remove the "
                   "override (DPTrainer samples every logical batch itself)")
    if self.model_init is not None:
        refuse("model_init re-creates the model in train(); pass model= instead")
    if self.compute_loss_func is not None and loss_fn is None:
        refuse("compute_loss_func returns a batch loss; DPTrainer needs one loss per example: pass "
               "loss_fn=lambda forward, batch: ... returning a (B,) tensor")
    if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
        refuse("DeepSpeed and FSDP are not supported (accelerate's plugin shards the model and reduces the "
               f"unclipped gradient); train on one device per process, or {ddp.SHARDED_FIX}")
    bn = batchnorm_modules(self.model) if isinstance(self.model, nn.Module) else []
    if bn:
        raise refuse_shared("model.name:batchnorm", "DPTrainer", modules=bn[:3])
    ds = self.train_dataset
    if ds is None:
        refuse("train_dataset is required")
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
        refuse("train_dataset must support len() and indexing (Poisson sampling picks rows by index); "
               "convert an IterableDataset to a map-style dataset")
    if len(ds) == 0:
        refuse("train_dataset is empty")
