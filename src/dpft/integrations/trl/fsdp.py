"""``DPDPOTrainer`` on an FSDP2-sharded policy (``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin,
which DPTrainer runs itself, or a model the caller sharded with ``fully_shard``): the reference
log-probabilities that TRL precomputes before training, with a sharded model.

TRL (1.16) with ``precompute_ref_log_probs`` and no ``ref_model`` scores the pairs with the *policy
before training* (PEFT: the policy with its adapters disabled, ``use_adapter(model, None)``): exactly
the reference of a 1-process run, with no copy of the model kept. Two things in that path assume
whole tensors, and a sharded policy breaks them:

- ``DPOTrainer.__init__`` fingerprints the scoring model with ``trl.trainer.utils.hash_module``, which
  calls ``.numpy()`` on every state-dict tensor; a ``DTensor`` refuses. :func:`dtensor_hash` is the
  same SHA-256 over the *gathered* tensors (``full_tensor()``, one at a time: a collective every rank
  runs in the same sorted order), so the fingerprint equals the unsharded model's;
  :func:`hashable_sharded` puts it in place of TRL's while ``DPOTrainer.__init__`` runs.
- dpft's multi-process precompute (``DPDPOTrainer._precompute_ref_logps``) has rank 0 score every
  pair alone and broadcast the values. A sharded scoring model cannot run on one rank (each forward
  all-gathers its blocks over the world), so :func:`score_all_ranks` has *every* rank run the same
  batches of every pair (the same collectives in the same order; each rank then holds the gathered
  weights, so the same log-probabilities) and keeps rank 0's values, broadcast: the same bits on every
  rank, as the unsharded path. The reference weights are public (the initial policy), so the values
  are inputs of the loss, not releases.

An unsharded ``ref_model`` passed by the caller keeps the rank-0 path (its weights broadcast from rank
0). A sharded ``ref_model`` is scored by every rank, as the policy. Source: issue 38 item 1;
huggingface/trl 1.16 ``DPOTrainer`` (``precompute_ref_log_probs``, ``hash_module``).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator

import torch

from dpft.placement import world as ddp
from dpft.api.sharded import is_fsdp2_model
from dpft.placement.fsdp import is_sharded, reshard_all

__all__ = ["dtensor_hash", "hashable_sharded", "score_all_ranks", "scored_by_every_rank", "add_reference_adapter",
           "reference_adapter_kept", "check_reference_adapter"]

#: The adapter name TRL gives the frozen copy of a PEFT policy's adapter (its reference).
REF = "ref"


def _is_peft(model) -> bool:
    return isinstance(model, torch.nn.Module) and isinstance(getattr(model, "peft_config", None), dict) \
        and hasattr(model, "add_adapter")


def add_reference_adapter(model) -> bool:
    """TRL's reference for a PEFT policy without ``ref_model``, made *before* the policy is sharded: a
    frozen adapter ``"ref"`` with the active adapter's config and a copy of its weights (what
    ``DPOTrainer.__init__`` adds, on whole tensors). Sharded with the model afterwards, it is a frozen
    FSDP2 parameter like the base. TRL adds it after DPTrainer sharded the model otherwise: plain
    tensors that ``ref_param.data.copy_(param.data)`` cannot fill from a ``DTensor``.

    Returns whether it was added (False: not a PEFT model, or ``"ref"`` exists already)."""
    if not _is_peft(model) or REF in model.peft_config:
        return False
    active = getattr(model, "active_adapter", "default")
    model.add_adapter(REF, model.peft_config[active])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f".{active}." in name:
                model.get_parameter(name.replace(f".{active}.", f".{REF}.")).copy_(p)
    model.set_adapter(active)  # the policy's adapter stays the trainable, active one
    return True


@contextlib.contextmanager
def reference_adapter_kept(model) -> Iterator[None]:
    """While ``DPOTrainer.__init__`` runs: its ``model.add_adapter("ref", ...)`` keeps the reference
    adapter :func:`add_reference_adapter` made (PEFT raises on a second adapter of one name); TRL's copy
    of the policy's adapter into it then copies ``DTensor`` into ``DTensor``. A no-op for other models."""
    if not _is_peft(model) or REF not in model.peft_config:
        yield
        return
    own = model.add_adapter

    def add_adapter(adapter_name, *args, **kwargs):
        if adapter_name == REF and REF in model.peft_config:
            return None
        return own(adapter_name, *args, **kwargs)

    model.add_adapter = add_adapter
    try:
        yield
    finally:
        del model.add_adapter


def check_reference_adapter(model, ref_model, where: str = "DPDPOTrainer") -> None:
    """A PEFT policy the caller sharded (``fully_shard``) without ``ref_model`` needs its reference adapter
    made before sharding (TRL would add it after, as plain tensors it cannot copy the sharded adapter into).

    Raises:
        ValueError: naming the fix."""
    if ref_model is None and _is_peft(model) and is_fsdp2_model(model) and REF not in model.peft_config:
        raise ValueError(f"{where}: the PEFT policy is sharded with fully_shard and has no reference adapter: TRL copies "
                         "the policy's adapter into a new adapter 'ref' (its reference), which cannot be filled from "
                         "DTensor shards after sharding. Call dpft.integrations.trl.fsdp.add_reference_adapter(model) "
                         "before fully_shard, or pass the unsharded model with DPOConfig(fsdp=True, fsdp_config="
                         "{'fsdp_version': 2}) (DPDPOTrainer shards it), or pass ref_model")


def dtensor_hash(module: torch.nn.Module) -> str:
    """TRL's ``hash_module`` (SHA-256 of dtype and bytes of every state-dict tensor, in name order),
    with each ``DTensor`` gathered first (``full_tensor()``: a collective, so every rank calls it
    alike). Equals ``hash_module`` of the unsharded model."""
    h = hashlib.sha256()
    for _, tensor in sorted(module.state_dict().items()):
        if is_sharded(tensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach().cpu()
        h.update(str(tensor.dtype).encode())
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = tensor.to(torch.float32)
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def hashable_sharded(active: bool) -> Iterator[None]:
    """While ``active`` (the policy is or will be FSDP2-sharded): TRL's ``DPOTrainer`` fingerprints
    models with :func:`dtensor_hash` instead of ``hash_module`` (which refuses ``DTensor``s). Restored on
    exit; a no-op otherwise."""
    if not active:
        yield
        return
    import trl.trainer.dpo_trainer as dpo_module

    own = dpo_module.hash_module
    dpo_module.hash_module = dtensor_hash
    try:
        yield
    finally:
        dpo_module.hash_module = own


def scored_by_every_rank(model) -> bool:
    """Whether the reference pass must run on every rank: the scoring model is FSDP2-sharded."""
    return is_fsdp2_model(model)


def score_all_ranks(world, model: torch.nn.Module, score: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``score()`` (the reference log-probabilities of every pair, ``(N,)`` chosen and rejected, nats)
    run on every rank over the sharded ``model`` (its forwards all-gather over the world), rank 0's
    values broadcast to all; every FSDP unit resharded afterwards (the root keeps its parameters after a
    forward). An exception raised by ``score`` on any rank is raised on every rank after the pass
    (every rank runs the same batches, so a data or model error arises on each alike; a rank dying
    inside a forward's all-gather leaves the others to the process group's timeout, as any FSDP
    forward does)."""
    failure = None
    out = None
    try:
        out = score()
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
        failure = exc
    reshard_all(model)
    if ddp.any_rank(world, failure is not None):
        raise failure or RuntimeError("DPDPOTrainer: the reference pass failed on another rank")
    return ddp.broadcast_object(world, out)
