"""``DPTrainer`` (and the TRL trainers built on it) on a model the user sharded with FSDP2
(``fully_shard`` on its blocks and root, before ``DPTrainer(...)``): the same sharded DP step as
``dpft train``'s ``perf.sharding: fsdp`` and ``make_private`` (dpft/placement/fsdp.py, api/sharded.py).

``training_step`` hands the rank's share of the logical batch to :meth:`~dpft.placement.fsdp.FSDPStep.run`:
every rank runs the same number of physical batches (a short rank runs a *placeholder* one — row 0
of the training set, collated by the trainer's collator — whose clipped sum is replaced by zeros
before the reduce-scatter), the clipped sums are reduce-scattered per parameter as the engine makes
them, the private counts are all-reduced, each shard gets its slice of the noise (one draw for the
world), one ledger event is recorded per logical step, and the noisy gradient is left in each
sharded parameter's ``.grad`` for ``Trainer``'s optimizer. accelerate prepares the model in
``evaluation_mode`` (DPTrainer's rule): no DDP or FSDP wrapper of its own.

``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2, ...})`` and accelerate's FSDP2 plugin
(``accelerate launch`` with ``distributed_type: FSDP``, ``fsdp_version: 2``: ``ACCELERATE_USE_FSDP=true``,
``FSDP_VERSION=2``) come here too: :func:`shard_requested` reads the settings through accelerate's own
:class:`~accelerate.utils.FullyShardedDataParallelPlugin` (exactly what ``Trainer`` / accelerate would
build), shards the model itself with :func:`dpft.placement.fsdp.shard_model` (what ``dpft train`` runs) and
hands ``Trainer`` arguments with ``fsdp`` cleared, and :func:`accelerate_fsdp_off` keeps accelerate's
plugin off while ``Trainer`` builds its accelerator: accelerate's ``fsdp2_prepare_model`` would shard
the model with gradient hooks that reduce-scatter the *unclipped* gradient of every backward. From
there on it is the path above (the same :class:`~dpft.placement.fsdp.FSDPStep`, the one privacy plan). Mapped:
the wrap policy (``TRANSFORMER_BASED_WRAP`` with ``transformer_layer_cls_to_wrap``, default the model's
``_no_split_modules`` as accelerate; ``NO_WRAP``: the root alone), ``reshard_after_forward`` (the
blocks'), mixed precision (``bf16=True`` or a bf16 ``mixed_precision_policy``: bf16 gathers, fp32
shards, sums and noise), ``activation_checkpointing`` (Hugging Face's gradient checkpointing, which the
book-keeping engine runs). ``state_dict_type`` has no effect: ``save_model`` and checkpoints always
hold the gathered full model (:func:`full_model_state`; PEFT: the adapter), the format ``from_pretrained``
loads, and the full optimizer state by parameter name (:func:`full_optimizer_state`);
``resume_from_checkpoint`` loads both back into the shards (:func:`load_full_checkpoint`,
:func:`load_full_optimizer`): straight into the shards (:func:`load_full_into_shards`; a checkpoint without
safetensors of a model DPTrainer sharded: through a plain copy on rank 0 alone); rank 0 alone reads the
weights and every ``optimizer.pt``, broadcast one tensor at a time (``broadcast_from_rank0``). In one
process nothing is sharded but the step is still the sharded one (its noise layout), so a 1-process
run equals a K-process one, as ``dpft train``'s. Banded MF runs sharded (:class:`~dpft.placement.fsdp.ShardedBandedMFMechanism`:
each rank keeps the noise buffers of its own shards); a checkpoint gathers every rank's slices and rank 0
writes the one 0600 ``noise_state.secret.pt`` a 1-process run writes (outside ``checkpoint-*``), and a
resume broadcasts it and each rank keeps its slices (hf_state.py; the same gather as ``make_private``'s,
api/state.py).

Refused (:func:`fsdp_settings`), each naming the fix: FSDP1 (``fsdp_version: 1``, FSDP1-only sharding
strategies, ``use_orig_params: false``: flat parameters whose unclipped gradients FSDP1 reduce-scatters
in its hooks, and no per-parameter ``DTensor`` shard for the per-example engine), XLA FSDP,
``cpu_offload`` (not verified: the step builds the noisy gradient shards on the compute device while
the shards and optimizer would live on the CPU; on a CPU-only machine FSDP2 accepts ``CPUOffloadPolicy``
only with ``pin_memory=False`` and offloading is a no-op there, so nothing can be checked without a GPU),
``SIZE_BASED_WRAP`` (no equivalent in dpft's sharding: units are whole transformer blocks),
``ignored_modules`` (their parameters would not be sharded: their clipped sums never reduced),
``activation_checkpointing_offload``, an fp16 mixed-precision policy, and ``fsdp`` together with a
model already sharded with ``fully_shard``. Source: issue 38 item 1.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, Iterator, Optional

import torch

from dpft.placement import world as ddp
from dpft.placement import fsdp
from dpft.api.sharded import check_fsdp2_model, is_fsdp2_model
from dpft.placement.fsdp_methods import refusal_message
from dpft.step.guard import restoring_optimizer_state
from dpft.methods.python import python_methods

__all__ = ["is_fsdp2_model", "check_fsdp2_model", "check_sharded_model", "check_still_sharded", "refuse_sharded_methods",
           "trainer_placeholder", "sharded_training_step", "fsdp_requested", "fsdp_settings", "shard_requested",
           "accelerate_fsdp_off", "full_model_state", "full_optimizer_state", "load_full_checkpoint",
           "load_full_into_shards", "load_full_optimizer"]

_TRUE = ("1", "true", "yes")


def _env_on(name: str) -> bool:
    return str(os.environ.get(name, "")).lower() in _TRUE


def fsdp_requested(args) -> Optional[str]:
    """Where FSDP was asked for: ``"TrainingArguments.fsdp"``, ``"accelerate's FSDP plugin"``
    (``ACCELERATE_USE_FSDP=true``) or None."""
    if getattr(args, "fsdp", None):
        return "TrainingArguments.fsdp"
    if _env_on("ACCELERATE_USE_FSDP"):
        return "accelerate's FSDP plugin (ACCELERATE_USE_FSDP=true)"
    return None


def _refuse(where: str, source: str, msg: str) -> None:
    raise ValueError(f"{where}: {source}: {msg}")


def fsdp_settings(args, where: str = "DPTrainer") -> Optional[dict[str, Any]]:
    """The FSDP2 settings the caller asked ``Trainer`` / accelerate for, as :func:`dpft.placement.fsdp.shard_model`
    runs them: ``{"source", "blocks" (None: the model's ``_no_split_modules``), "reshard_after_forward",
    "dtype" ("bf16" | "fp32"), "activation_checkpointing"}``; None when FSDP was not asked for. Fast:
    nothing is loaded or sharded.

    Raises:
        ValueError: an option that would change the DP step or that dpft's sharding has no equivalent
            for (see the module docstring), naming the fix."""
    source = fsdp_requested(args)
    if source is None:
        return None
    conf = dict(getattr(args, "fsdp_config", None) or {}) if source.startswith("TrainingArguments") else {}
    if conf.get("xla") or conf.get("xla_fsdp_v2"):
        _refuse(where, source, "XLA FSDP shards and reduces the unclipped gradient in its own wrapper; set xla: false "
                "(dpft shards with FSDP2 on torch.distributed)")
    plugin_args = None
    if source.startswith("TrainingArguments"):
        plugin_args = getattr(args, "fsdp_plugin_args", None)
        if plugin_args is None:  # fsdp set after TrainingArguments was built: transformers' own translation
            late = copy.copy(args)
            late.fsdp_config = copy.deepcopy(getattr(args, "fsdp_config", None))
            plugin_args = late._process_fsdp_args() or {}
    version = int(plugin_args.get("fsdp_version", 2)) if plugin_args is not None else int(os.environ.get("FSDP_VERSION", "1"))
    fix2 = ("fsdp_config={'fsdp_version': 2}" if plugin_args is not None else
            "FSDP_VERSION=2 (fsdp_version: 2 in the accelerate config)")
    if version != 2:
        _refuse(where, source, f"FSDP{version} (FullyShardedDataParallel) flattens parameters into FlatParameters and "
                "reduce-scatters their unclipped gradient in its backward hooks; dpft's per-example engine needs each "
                "parameter whole in the forward and backward and reduces only clipped sums, which FSDP2's per-parameter "
                f"DTensor shards allow. Use FSDP2: {fix2}")
    if str(conf.get("use_orig_params", "true")).lower() == "false":
        _refuse(where, source, "use_orig_params: false is FSDP1's flat-parameter mode (no per-parameter gradient for the "
                "per-example engine); FSDP2 always keeps the original parameters: remove use_orig_params")
    from accelerate.utils import FullyShardedDataParallelPlugin

    # accelerate's own parsing of the same settings (fsdp_config or the FSDP_* environment)
    plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args is not None else FullyShardedDataParallelPlugin()
    if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
        _refuse(where, source, "cpu_offload (FSDP2 CPUOffloadPolicy) is not supported yet: it keeps the parameter shards "
                "and the optimizer on the CPU, while dpft's sharded step reduce-scatters the clipped sums, draws the "
                "noise and writes each noisy gradient shard on the device where the engine computed them (a GPU "
                "tensor as the .grad of a CPU shard), a path not verified on a GPU; on a CPU-only machine offloading "
                "does nothing (and FSDP2 accepts it there only with pin_memory=False: accelerate's default pinned "
                "policy fails with 'Cannot access accelerator device'), so it cannot be checked there either. Set "
                "cpu_offload false (FSDP_OFFLOAD_PARAMS=false)")
    if getattr(plugin, "activation_checkpointing_offload", False):
        _refuse(where, source, "activation_checkpointing_offload is not supported; set it false (activation checkpointing "
                "itself runs: Hugging Face's gradient checkpointing under the book-keeping engine)")
    if getattr(plugin, "ignored_modules", None):
        _refuse(where, source, "ignored_modules leaves parameters outside FSDP: their clipped sums would never be reduced "
                "over the ranks; remove ignored_modules (freeze those parameters instead)")
    policy = getattr(plugin.auto_wrap_policy, "__name__", plugin.auto_wrap_policy)
    if policy is None:
        blocks: Optional[set[str]] = set()  # NO_WRAP: the root alone, as accelerate
    elif policy == "transformer_auto_wrap_policy":
        names = plugin.transformer_cls_names_to_wrap
        blocks = set(names) if names else None
    else:
        shown = "SIZE_BASED_WRAP" if "size_based" in str(policy) else repr(policy)
        _refuse(where, source, f"auto_wrap_policy {shown} has no equivalent in dpft's sharding (its FSDP units are "
                "whole transformer blocks); use TRANSFORMER_BASED_WRAP (optionally with transformer_layer_cls_to_wrap) "
                "or NO_WRAP")
    mp = getattr(plugin, "mixed_precision_policy", None)
    dtype = "bf16" if getattr(args, "bf16", False) else "fp32"
    if mp is not None and getattr(mp, "param_dtype", None) is not None:
        if mp.param_dtype != torch.bfloat16 or getattr(mp, "reduce_dtype", None) not in (None, torch.float32):
            _refuse(where, source, f"mixed_precision_policy (param_dtype {mp.param_dtype}, reduce_dtype "
                    f"{getattr(mp, 'reduce_dtype', None)}): dpft gathers bf16 parameters at most and sums, reduces and "
                    "noises the clipped gradients in fp32 (fp16 needs a dynamic loss scaler that DPTrainer refuses); "
                    "use bf16=True")
        dtype = "bf16"
    return {"source": source, "blocks": blocks, "reshard_after_forward": bool(plugin.reshard_after_forward),
            "dtype": dtype, "activation_checkpointing": bool(plugin.activation_checkpointing)}


def shard_requested(model, args, where: str = "DPTrainer", methods=None):
    """``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin, run by dpft: the model sharded with
    :func:`dpft.placement.fsdp.shard_model` (after rank 0's weights are broadcast, on ``args.device``) and a copy of
    ``args`` with ``fsdp`` cleared (so ``Trainer`` and accelerate never wrap the model).

    Returns:
        ``(model, args, requested)``: ``requested`` is whether FSDP was asked for (then the trainer
        runs the sharded step, in one process too); unchanged ``model`` and ``args`` when it was not.

    Every mechanism the plan builds runs sharded (no check here): it has a sharded counterpart
    (:func:`dpft.placement.fsdp.shard_mechanism`; banded MF keeps each shard's buffers and the checkpoint
    gathers them, hf_state.py).

    Raises:
        ValueError: :func:`fsdp_settings`'s refusals; ``methods`` (:func:`refuse_sharded_methods`); ``fsdp``
            with a model already sharded."""
    settings = fsdp_settings(args, where)
    if settings is None:
        return model, args, False
    refuse_sharded_methods(where, methods)
    source = settings["source"]
    if model is None or not isinstance(model, torch.nn.Module):
        _refuse(where, source, "pass model= (an nn.Module); DPTrainer shards it with FSDP2 itself")
    if is_fsdp2_model(model):
        _refuse(where, source, "the model is already sharded with fully_shard; either pass the unsharded model (DPTrainer "
                "shards it) or remove fsdp from the arguments / the accelerate config")
    if any(p.is_meta for p in model.parameters()):
        _refuse(where, source, "the model has parameters on the meta device (cpu_ram_efficient_loading); load the model "
                "on every rank (DPTrainer broadcasts rank 0's weights before sharding)")
    blocks = settings["blocks"]
    if blocks:
        missing = sorted(set(blocks) - {type(m).__name__ for m in model.modules()})
        if missing:
            _refuse(where, source, f"transformer_layer_cls_to_wrap names {missing}, which the model does not have; name its "
                    f"block classes (e.g. {sorted(fsdp.block_classes(model))})")
    world = ddp.init_from_env()
    if world.distributed:
        if next(model.parameters()).device != args.device:
            model = model.to(args.device)  # FSDP2's mesh is on the device the shards live on
        ddp.broadcast_module(world, model)  # the world starts from rank 0's weights, as under DDP
        model = fsdp.shard_model(model, world, settings["dtype"], blocks=blocks,
                                 reshard_after_forward=settings["reshard_after_forward"])
    args = copy.copy(args)
    args.fsdp, args.fsdp_config, args.fsdp_plugin_args = None, None, None
    if settings["activation_checkpointing"]:
        args.gradient_checkpointing = True
    return model, args, True


@contextlib.contextmanager
def accelerate_fsdp_off(requested: bool) -> Iterator[None]:
    """``ACCELERATE_USE_FSDP`` off while ``Trainer`` builds its accelerator (when DPTrainer runs
    the FSDP request itself): accelerate would otherwise build its FSDP plugin from the environment
    and shard the model with hooks that reduce-scatter unclipped gradients. Restored afterwards."""
    if not requested or "ACCELERATE_USE_FSDP" not in os.environ:
        yield
        return
    was = os.environ["ACCELERATE_USE_FSDP"]
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    try:
        yield
    finally:
        os.environ["ACCELERATE_USE_FSDP"] = was


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The gathered, full state dict of an FSDP2 ``model`` on rank 0 (CPU tensors; ``{}`` on the
    other ranks), through ``torch.distributed.checkpoint.state_dict`` (a collective: every rank calls
    it). What ``save_pretrained`` writes: no ``DTensor`` in the released files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict:
    """The gathered, full optimizer state of an FSDP2 ``model`` on rank 0 (``{}`` elsewhere; a
    collective), keyed by parameter name (``torch.distributed.checkpoint.state_dict``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check_sharded_model(model, where: str, methods=None) -> bool:
    """Whether ``model`` runs the sharded step (FSDP2, ``fully_shard`` on its root), refusing FSDP1,
    an FSDP2 model the sharded step cannot run (:func:`~dpft.api.sharded.check_fsdp2_model`) and
    ``DPArguments.methods`` on it (:func:`refuse_sharded_methods`), before ``Trainer`` is built. Every
    mechanism runs sharded (banded MF: the checkpoint gathers each shard's buffers, hf_state.py).

    Raises:
        dpft.placement.world.DistributedError, ValueError: naming the fix."""
    ddp.refuse_sharded_model(model, where, allow_fsdp2=True)
    sharded = is_fsdp2_model(model)
    if sharded:
        refuse_sharded_methods(where, methods)
        check_fsdp2_model(model, where)
    return sharded


def check_still_sharded(model, sharded: bool, world, where: str) -> None:
    """After ``Trainer`` (and TRL) prepared the model: under several processes every trainable
    parameter of a sharded run must still be an FSDP2 shard. A parameter added after sharding (TRL's
    ``peft_config`` wraps the model inside ``SFTTrainer.__init__``) is a plain tensor on each rank, whose
    clipped sum the step would never reduce over the ranks (each rank would apply its own update).

    Raises:
        dpft.placement.world.DistributedError: naming the parameters and the fix."""
    if not (sharded and world.distributed):
        return
    plain = [n for n, p in model.named_parameters() if p.requires_grad and not fsdp.is_sharded(p)]
    if plain:
        raise ddp.DistributedError(
            f"{where}: trainable parameters {plain[:3]} were added after the model was sharded (e.g. by peft_config) "
            "and are not FSDP2 shards: their clipped sums would not be reduced over the ranks. Wrap the model with "
            "peft.get_peft_model before building the trainer (and drop peft_config)")


def refuse_sharded_methods(where: str, methods: list) -> None:
    """Refuse the ``DPArguments.methods`` that cannot run on the sharded step, each named with its reason
    (methods/base.py ``sharded_refusal``; RMT and DP-Adam-AC's adaptive clipping run: dpft/placement/fsdp_methods.py).
    ``methods``: plug-ins (methods/python.py ``python_methods``) or their specs (validated here first).

    Raises:
        ValueError: naming the method, its reason and the fix."""
    if not methods:
        return
    plugins = methods if all(hasattr(m, "sharded_refusal") and hasattr(m, "cfg") for m in methods) \
        else python_methods(methods, where)
    why = refusal_message(where, plugins)
    if why:
        raise ValueError(why)


def trainer_placeholder(trainer):
    """The placeholder micro-batch of a DPTrainer whose model is FSDP2-sharded (session/step.py ``step_for``:
    the :class:`~dpft.placement.fsdp.FSDPStep`): the trainer's own first physical batch of training row 0 (the
    trainer's ``_micro_batches``: its collator, DPO's pairs with their reference log-probabilities, user
    groups), built on every rank alike (the rank's share taken as the whole one-row batch).

    The step releases through its sharded copy of the plan's mechanism (:func:`dpft.placement.fsdp.shard_mechanism`
    copies its attributes): DPTrainer's ``mechanism`` is that copy (``dp_step.spec.mechanism``), whose ``rng``
    each training loop renews (hf_data.py), whose banded-MF buffers (this rank's slices) the checkpoint
    gathers and the resume restores (hf_state.py)."""

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

    return placeholder


def sharded_training_step(trainer, t: int, idx: torch.Tensor) -> torch.Tensor:
    """``DPTrainer.training_step`` on the sharded step: the rank's share of logical batch ``idx``
    (step ``t``) through :meth:`~dpft.placement.fsdp.FSDPStep.run` (placeholders, reduce-scatter, sharded noise,
    one ledger event), then the per-step digest of the logical batch (the ranks hold different
    shards, so the weights are not compared). Returns 0, or the un-noised loss when
    ``log_private_train_loss``."""
    with trainer.compute_loss_context_manager():
        out = trainer.dp_step.run(t, trainer._micro_batches(idx))
    ddp.check_step_digest(trainer.world, t, idx, {})  # the ranks hold different shards: the batch only
    trainer.last_private_stats = dict(out.private)
    trainer._pending_update = out if trainer.methods else None  # the methods' after_update: once applied
    if trainer.dp_args.log_private_train_loss:
        return torch.tensor(float(out.private["train_loss"]), device=trainer.args.device)
    return torch.zeros((), device=trainer.args.device)


def load_full_checkpoint(model, ckpt: str, load) -> None:
    """Load the full weights of checkpoint ``ckpt`` (written by :func:`full_model_state`) into the
    FSDP2 ``model`` (a collective: every rank calls it); each rank keeps its slice. A checkpoint with
    safetensors weights (what DPTrainer writes), whoever sharded the model:
    :func:`load_full_into_shards` (rank 0 alone reads the file; broadcast one tensor at a time). A
    checkpoint without (``pytorch_model.bin``, as an older transformers wrote) of a model DPTrainer sharded (``fsdp=``): rank 0 alone
    builds a plain copy (:func:`dpft.placement.fsdp.materialise`; the other ranks join its gathers and drop each
    tensor) and loads it with ``load(ckpt, plain)`` — ``Trainer``'s own loader — then
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (was: a plain copy loaded on
    every rank, the full model's host memory on each; measured: benchmarks/resume_memory.py).

    Raises:
        ValueError, RuntimeError: as :func:`load_full_into_shards` (on every rank)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if fsdp._TEMPLATES.get(model) is None or _has_safetensors(model, ckpt):
        load_full_into_shards(model, ckpt)
        return
    main = not dist.is_initialized() or dist.get_rank() == 0
    plain = fsdp.materialise(model, keep=main)  # rank 0: the plain copy; the others: ``model``, nothing kept

    def read() -> dict[str, torch.Tensor]:
        load(ckpt, plain)
        return plain.state_dict()

    full = _read_on_rank0(read, ckpt)
    plain = None  # free rank 0's copy before the broadcast
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _has_safetensors(model, ckpt: str) -> bool:
    """Whether ``ckpt`` holds the safetensors weights :func:`_checkpoint_weights` reads for ``model``
    (PEFT: ``adapter_model``; else ``model``; one file or an index)."""
    stem = "adapter_model" if hasattr(model, "peft_config") and hasattr(model, "active_adapter") else "model"
    return any(os.path.isfile(os.path.join(ckpt, stem + ext)) for ext in (".safetensors", ".safetensors.index.json"))


def _read_safetensors(ckpt: str, stem: str) -> Optional[dict[str, torch.Tensor]]:
    """The tensors of ``ckpt/{stem}.safetensors`` or of the files its ``.index.json`` names (CPU); None: none."""
    import json

    from safetensors.torch import load_file

    one, index = os.path.join(ckpt, f"{stem}.safetensors"), os.path.join(ckpt, f"{stem}.safetensors.index.json")
    if os.path.isfile(one):
        return load_file(one, device="cpu")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(ckpt, name), device="cpu"))
    return out


def load_full_into_shards(model, ckpt: str) -> None:
    """Load checkpoint ``ckpt``'s full tensors straight into the shards of an FSDP2 ``model`` the caller
    sharded with ``fully_shard`` (``Trainer``'s loader cannot load into ``DTensor`` parameters and there is
    no plain copy). Rank 0 alone reads ``model.safetensors`` (or its index's files) or, for a PEFT model, the
    adapter's ``adapter_model.safetensors`` (keys renamed to the model's by PEFT's own
    ``set_peft_model_state_dict``); ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True,
    strict=False)`` broadcasts one tensor at a time and each rank keeps its slice (a collective; the other
    ranks pass an empty dict). Host memory while it loads: rank 0 the checkpoint's tensors (safetensors maps
    the file: its pages resident as they are read), every other rank at most one full tensor at a time (the
    broadcast's receive buffer) and no read of the file (measured: benchmarks/resume_memory.py).

    Raises:
        ValueError: on every rank (rank 0's reason sent to all, so none waits in the broadcast): no
            safetensors weights in ``ckpt``, or a trainable parameter the checkpoint does not hold (another
            model's checkpoint: resuming would train from the wrong weights). Any other error reading the
            checkpoint on rank 0 is raised there and as ``RuntimeError`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = _read_on_rank0(lambda: _checkpoint_weights(model, ckpt), ckpt)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))


def _read_on_rank0(read: Callable[[], dict], ckpt: str) -> dict:
    """``read()`` on rank 0 of the default group only: its dict there, ``{}`` on the other ranks (what
    ``StateDictOptions(broadcast_from_rank0=True)`` wants). An error raised by ``read`` is raised on every
    rank (rank 0's reason sent to the others, so none waits in the broadcast that follows): a ``ValueError``
    as itself, anything else as ``RuntimeError`` naming ``ckpt`` on the other ranks."""
    import torch.distributed as dist

    if not dist.is_initialized():  # pragma: no cover - an FSDP2 model lives in a process group
        return read()
    out: dict = {}
    failure: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            out = read()
        except Exception as exc:  # noqa: BLE001 - re-raised below, its reason on every rank
            failure = exc
    box = [None if failure is None else (isinstance(failure, ValueError), str(failure))]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        is_value, why = box[0]
        raise ValueError(why) if is_value else RuntimeError(f"resume_from_checkpoint: rank 0 could not read {ckpt}: "
                                                            f"{why}")
    return out


def _checkpoint_weights(model, ckpt: str) -> dict[str, torch.Tensor]:
    """The full tensors of checkpoint ``ckpt`` under ``model``'s state-dict keys (PEFT: the adapter's file,
    renamed by ``set_peft_model_state_dict``), checked to hold every trainable parameter (rank 0 runs it).

    Raises:
        ValueError: no safetensors weights in ``ckpt``, or a trainable parameter it does not hold."""
    peft = hasattr(model, "peft_config") and hasattr(model, "active_adapter")
    full = _read_safetensors(ckpt, "adapter_model" if peft else "model")
    if full is None:
        raise ValueError(f"resume_from_checkpoint: {ckpt} holds no {'adapter_model' if peft else 'model'}.safetensors "
                         "(DPTrainer writes one at every checkpoint); resume from a checkpoint DPTrainer wrote")
    if peft:
        full = _peft_renamed(model, full)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in full]
    if missing:  # checked before loading (set_model_state_dict adds the model's own entries to the dict it is given)
        raise ValueError(f"resume_from_checkpoint: {ckpt} holds no weights for the trainable parameters {missing[:3]} "
                         "of this model: it was written for another model. Resume with the model that wrote it")
    return full


def _peft_renamed(model, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter file's tensors under the PEFT ``model``'s keys: what PEFT's own ``set_peft_model_state_dict``
    hands ``model.load_state_dict`` (the adapter name put back, modules-to-save mapped), captured, with its
    resharding for transformers' tensor parallelism switched off (PEFT 0.21 cuts a tensor whose parameter is a
    ``DTensor`` into this rank's shard, a ``DTensor`` holding rank 0's slice only; here rank 0 alone reads, and
    the broadcast wants the full tensors).

    Raises:
        RuntimeError: PEFT still handed back a ``DTensor`` (a PEFT release that reshards otherwise)."""
    from unittest import mock

    import peft.utils.save_and_load as peft_io

    renamed: dict[str, torch.Tensor] = {}

    def capture(sd, strict=False, assign=False):  # what PEFT's loader hands model.load_state_dict, renamed
        renamed.update(sd)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    no_tp = (mock.patch.object(peft_io, "is_transformers_dtensor_tp", False)
             if hasattr(peft_io, "is_transformers_dtensor_tp") else contextlib.nullcontext())
    model.load_state_dict = capture
    try:
        with no_tp:
            peft_io.set_peft_model_state_dict(model, adapter, adapter_name=model.active_adapter)
    finally:
        del model.load_state_dict
    sharded = [k for k, v in renamed.items() if fsdp.is_sharded(v)]
    if sharded:
        raise RuntimeError(f"resume_from_checkpoint: PEFT's set_peft_model_state_dict returned sharded tensors for "
                           f"{sharded[:3]} (this PEFT release reshards adapters on load in a way dpft does not switch off); "
                           "resume with peft 0.21, or report the PEFT version to dpft")
    return renamed


def load_full_optimizer(model, optimizer, ckpt: str) -> None:
    """Set the FSDP2 ``optimizer``'s shards from the full state :func:`full_optimizer_state` wrote to
    ``ckpt/optimizer.pt``: rank 0 alone reads it (``torch.load``), ``set_optimizer_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` broadcasts one tensor at a time and each rank keeps its slice (the other ranks
    pass ``{}``; was: every rank read the whole file).

    Raises:
        RuntimeError: on the other ranks, when rank 0 could not read the file (rank 0 raises its own error)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from transformers.trainer import OPTIMIZER_NAME

    full = _read_on_rank0(lambda: torch.load(os.path.join(ckpt, OPTIMIZER_NAME), map_location="cpu",
                                             weights_only=True), ckpt)
    with restoring_optimizer_state(optimizer):  # torch's state initialisation is a step at lr 0, not an update
        set_optimizer_state_dict(model, optimizer, full,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
