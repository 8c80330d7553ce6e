"""TRL integration: :class:`DPSFTTrainer`, supervised fine-tuning with TRL's ``SFTTrainer`` under DP.

A TRL user keeps ``SFTConfig``, the model (or its name), the tokenizer and its chat template,
the dataset in any of TRL's formats (language modeling ``text``, prompt/completion, or
conversational ``messages`` / ``prompt``+``completion`` lists of turns), ``peft_config``,
evaluation and callbacks, and adds the privacy settings::

    from peft import LoraConfig
    from trl import SFTConfig
    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPSFTTrainer

    trainer = DPSFTTrainer(model=model, args=SFTConfig(output_dir="out", num_train_epochs=1,
                                                       learning_rate=1e-3, per_device_train_batch_size=8,
                                                       report_to=[]),
                           train_dataset=ds, processing_class=tokenizer,
                           peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                           dp_args=DPArguments(target_epsilon=8, target_delta=1e-5, max_grad_norm=1.0,
                                               expected_batch_size=64))
    trainer.train()
    trainer.get_epsilon()

How it is built: ``class DPSFTTrainer(DPTrainer, SFTTrainer)``. ``SFTTrainer.__init__`` does
what it does for every TRL user (loads the model from a name, wraps it with ``peft_config``,
renders chat templates, tokenizes, builds ``labels`` with ``-100`` on the prompt tokens when
``completion_only_loss`` is on (the default for prompt/completion data) and outside the
assistant turns with ``assistant_only_loss=True``, truncates to ``max_length``, picks its
padding collator). Everything after that is :class:`~dpft.integrations.hf.trainer.DPTrainer`'s, by
the method resolution order: the Poisson sampler replaces the train dataloader, the per-example
engine clips each row's gradient in ``training_step``, ``DPStep`` adds the noise once per
logical batch and writes the ledger, ``ledger.json``/``dp_state.json`` are written as
``DPTrainer`` writes them, resume continues the ledger, the un-noised loss is not logged, and
distributed training is whatever ``DPTrainer`` does. ``SFTTrainer.compute_loss`` (a batch mean
over tokens) is never used for training.

* **Privacy unit:** one row of ``train_dataset`` after TRL's preparation = one conversation or
  one prompt/completion pair (``N`` is the row count after preparation: TRL drops rows whose
  labels truncation left empty, a decision on that row alone). Packing (``packing=True``) and
  padding-free batches (``padding_free=True``, ``packing_strategy='bfd'``) put several rows in
  one batch row, so they are refused before the dataset is prepared, as is a dataset that
  already carries TRL's packing column ``seq_lengths``; a packed batch met during training is
  refused by ``DPTrainer`` (:class:`~dpft.api.PackedBatchError`).
* **Per-example loss** (:func:`sft_per_example_loss`): the next-token negative log-likelihood
  **summed** over the row's label tokens (``labels != -100``: the completion / assistant tokens
  under completion-only or assistant-only loss; prompt and padding tokens contribute nothing,
  to the loss or to the gradient); ``loss_type='dft'`` weights each token by its detached
  probability (Wu et al. 2025, "On the Generalization of SFT", DFT).
* **PEFT:** ``peft_config=LoraConfig(...)`` as TRL users pass it; the engine clips and noises
  exactly the trainable parameters (the adapters), the frozen base model gets no gradient.

Refused before any slow work, with a message naming the fix: packing / padding-free,
``activation_offloading`` (its saved-tensor hooks are untested with the per-example engine),
``loss_type`` other than ``nll``/``dft``, ``compute_loss_func`` without a per-example
``loss_fn``, an iterable ``train_dataset``, a Mixture-of-Experts router auxiliary loss (a batch
statistic coupling the examples: set ``router_aux_loss_coef=0.0``), and everything
``DPTrainer`` refuses (gradient accumulation, fp16, label smoothing, ...).

:class:`DPDPOTrainer`: TRL's ``DPOTrainer`` with the same step, one preference pair as the
privacy unit (its chosen and rejected sequences clipped as one group; reference log-probabilities
precomputed from the public reference model); docs/trl.md, "Preference optimisation (DPO)".

Source: Abadi et al. 2016 (DP-SGD) with Poisson sampling; TRL's ``SFTTrainer`` (von Werra et
al., huggingface/trl 1.16).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from trl import SFTConfig, SFTTrainer

from dpft.accounting.ledger import PrivacyLedger
from dpft.api import PackedBatchError
from dpft.grads.base import PerExampleLoss
from dpft.data.stop import check_prepared_rows, set_generation_stop
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.integrations.hf.loss import logits_of as _logits
from dpft.step.postprocess import Transform
from dpft.placement import world as ddp
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf.fsdp import fsdp_requested
from dpft.integrations.trl.user import user_pair_chunks
from dpft.integrations.trl.fsdp import (add_reference_adapter, check_reference_adapter, hashable_sharded,
                                       reference_adapter_kept, score_all_ranks, scored_by_every_rank)
from dpft.api.sharded import is_fsdp2_model
from dpft.config.refusals import refuse

__all__ = ["DPSFTTrainer", "sft_per_example_loss", "check_sft_config", "DPDPOTrainer", "dpo_per_pair_loss",
           "pair_rows", "check_dpo_config"]

#: The fix named by every packing / padding-free refusal.
PACKING_FIX = "SFTConfig(packing=False, padding_free=False)"


def _refuse(msg: str) -> None:
    raise ValueError(f"DPSFTTrainer: {msg}")


def sft_per_example_loss(loss_type: str = "nll") -> PerExampleLoss:
    """The per-example SFT loss ``loss_fn(forward, batch) -> (B,)`` (nats).

    ``batch``: ``input_ids (B, T)``, ``attention_mask (B, T)``, ``labels (B, T)`` as TRL's
    ``DataCollatorForLanguageModeling`` pads them (``-100`` on prompt, non-assistant and padding
    tokens); every key but ``labels`` goes to the model, with ``use_cache=False``. Without
    ``labels``, ``input_ids`` where ``attention_mask`` is 1 are the targets.

    Returns per example ``Σ_t w_t · (−log p(y_{t+1} | y_{≤t}))`` over its label tokens, with
    ``w_t = 1`` (``nll``) or ``w_t = p(y_{t+1} | y_{≤t})`` detached (``dft``: Wu et al. 2025,
    eq. 9). Summed, not averaged: clipping bounds each example's whole gradient whatever its
    length, as for dpft's causal-LM loss.

    Raises:
        ValueError: ``loss_type`` other than ``nll``/``dft``.
    """
    if loss_type not in ("nll", "dft"):
        raise ValueError(f"sft_per_example_loss: loss_type must be 'nll' or 'dft', got {loss_type!r}")

    def loss_fn(forward: Callable[..., Any], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"]
            if "attention_mask" in batch:
                labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        logits = _logits(forward(**inputs, use_cache=False))
        logp = -torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:],
                                                  ignore_index=-100, reduction="none")  # 0 where ignored
        tok = -logp if loss_type == "nll" else -logp * logp.detach().exp()
        return tok.sum(dim=1)

    return loss_fn


def check_sft_config(args: Any, train_dataset: Any = None) -> None:
    """Refuse the SFT settings whose batches are not one privacy unit per row, before any work.

    Raises:
        ValueError: packing, padding-free (also implied by ``packing_strategy`` ``bfd``/
            ``bfd_split`` with packing), a pre-packed dataset (a ``seq_lengths`` column),
            ``activation_offloading``, ``loss_type`` other than ``nll``/``dft``, an iterable
            ``train_dataset``; each message names the fix.
    """
    if getattr(args, "packing", False):
        _refuse(f"packing=True concatenates several rows (conversations) into one sequence, which would be "
                f"clipped as one example and reshuffled when one row is removed: the privacy unit would not be "
                f"one row. Use {PACKING_FIX}")
    if getattr(args, "padding_free", False):
        _refuse(f"padding_free=True flattens the batch into one row, so the per-example engine would clip all of its "
                f"rows as one example. Use {PACKING_FIX}")
    if getattr(args, "activation_offloading", False):
        _refuse("activation_offloading=True is not supported (its saved-tensor hooks are untested with the "
                "per-example engine); use gradient_checkpointing=True to save memory instead")
    lt = getattr(args, "loss_type", "nll")
    if lt not in ("nll", "dft"):
        _refuse(f"loss_type={lt!r} has no per-example form here; use loss_type='nll' or 'dft', or pass "
                "loss_fn=... returning one loss per example")
    check_rows(train_dataset)


def check_rows(train_dataset: Any, where: str = "DPSFTTrainer") -> None:
    """Refuse a streaming dataset or one already packed by TRL (a ``seq_lengths`` column).

    Raises:
        ValueError: with the fix."""
    if train_dataset is None:
        return
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        datasets = None
    if datasets is not None and isinstance(train_dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset)):
        raise ValueError(f"{where}: train_dataset is an IterableDataset (streaming); Poisson sampling picks rows "
                         "by index, so load a map-style datasets.Dataset (e.g. load_dataset(..., streaming=False))")
    cols = getattr(train_dataset, "column_names", None) or []
    if "seq_lengths" in cols:
        raise ValueError(f"{where}: train_dataset has a 'seq_lengths' column: its rows are packed sequences of "
                         f"several examples (trl.pack_dataset). Pass the unpacked rows and {PACKING_FIX}")


class DPSFTTrainer(DPTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with :class:`~dpft.integrations.hf.trainer.DPTrainer`'s DP step (see the
    module docstring).

    Args:
        model: as for ``SFTTrainer``: a model name/path, a causal LM or a ``PeftModel``.
        args: an ``SFTConfig`` (a plain ``TrainingArguments`` is converted by TRL); copied, the copy
            gets ``max_steps`` and ``max_grad_norm = 0``. Default: ``SFTConfig("trainer_output")``.
        data_collator, train_dataset, eval_dataset, processing_class, **sft_kwargs: as for
            ``SFTTrainer`` (``peft_config``, ``formatting_func``, ``callbacks``, ``optimizers``...).
        dp_args: the privacy settings (required, keyword): :class:`~dpft.integrations.hf.trainer.DPArguments`.
        loss_fn: per-example loss ``loss_fn(forward, batch) -> (B,)``; default
            :func:`sft_per_example_loss` of ``args.loss_type``.
        ledger, transforms: as for ``DPTrainer``.

    Attributes: those of ``DPTrainer`` (``sigma``, ``q``, ``n``, ``total_steps``, ``ledger``,
    ``engine``, ``dp_step``...) and of ``SFTTrainer`` (``completion_only_loss``...).

    Raises:
        TypeError: no ``dp_args``.
        ValueError: a setting that cannot be certified (packing, padding-free...; the message
            names the fix), before the dataset is prepared where the setting says so.
        dpft.accounting.calibrate.CalibrationError: the target ε cannot be met.
    """

    def __init__(self, model, args: Optional[Any] = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, dp_args: Optional[DPArguments] = None,
                 loss_fn: Optional[PerExampleLoss] = None, ledger: Optional[PrivacyLedger] = None,
                 transforms: Optional[list[Transform]] = None, **sft_kwargs):
        if not isinstance(dp_args, DPArguments):
            raise TypeError("DPSFTTrainer needs dp_args=DPArguments(target_epsilon=..., target_delta=..., "
                            "max_grad_norm=..., expected_batch_size=...)")
        if args is None:
            args = SFTConfig(output_dir="trainer_output")
        # Before SFTTrainer.__init__ loads the model and prepares (tokenizes, packs) the dataset.
        check_sft_config(args, train_dataset)
        if sft_kwargs.get("compute_loss_func") is not None and loss_fn is None:
            _refuse("compute_loss_func returns a batch loss; DPSFTTrainer needs one loss per example: pass "
                    "loss_fn=lambda forward, batch: ... returning a (B,) tensor")
        self._check_router_aux_loss(model, args)
        if loss_fn is None:
            loss_fn = sft_per_example_loss(getattr(args, "loss_type", "nll"))
        super().__init__(model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, dp_args=dp_args,
                         loss_fn=loss_fn, ledger=ledger, transforms=transforms, **sft_kwargs)
        self._check_prepared()
        if getattr(self, "aux_loss_enabled", False):
            self._check_router_aux_loss(self.model, self.args, enabled=True)

    def _check_prepared(self) -> None:
        """After TRL's preparation: rows are unpacked and the collator pads (one row per example)."""
        if getattr(self, "padding_free", False):  # set by SFTTrainer (packing_strategy etc.)
            raise PackedBatchError(f"DPSFTTrainer: SFTTrainer chose padding-free batches; use {PACKING_FIX}")
        if "seq_lengths" in (getattr(self.train_dataset, "column_names", None) or []):
            raise PackedBatchError(f"DPSFTTrainer: the prepared train_dataset holds packed rows; use {PACKING_FIX}")
        # Every complete completion must end in a stop token among its targets, and generation must
        # stop at the one the data taught (ChatML's <|im_end|>, not only </s>): issue 36 item 9.
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        stop = check_prepared_rows(self.train_dataset, tok, max_length=getattr(self.args, "max_length", None))
        set_generation_stop(self.model, stop)

    @staticmethod
    def _check_router_aux_loss(model: Any, args: Any, enabled: bool = False) -> None:
        """A Mixture-of-Experts load-balancing loss is a statistic of the whole batch (the share of
        tokens routed to each expert), so one example's gradient would depend on the others'."""
        coef = getattr(args, "router_aux_loss_coef", None)
        if not enabled:
            cfg = getattr(model, "config", None)
            text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
            if text is None or not hasattr(text, "output_router_logits"):
                return
            enabled = (getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef) != 0.0
        if enabled:
            _refuse("the model's Mixture-of-Experts router auxiliary loss is computed over the whole batch, which "
                    "couples the examples' gradients; set SFTConfig(router_aux_loss_coef=0.0)")

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """``DPTrainer.log`` (ε added, the un-noised loss removed). SFTTrainer's training metrics
        (token accuracy, entropy, token counts) would be private statistics; they are never
        gathered in training (``compute_loss`` is not called there) and cleared here for safety."""
        if self.model is not None and self.model.training and hasattr(self, "_metrics"):
            self._metrics["train"].clear()
        super().log(logs, *args, **kwargs)


# --------------------------------------------------------------------------- DP-DPO

#: DPO losses of TRL written per pair here (each a function of one pair alone).
DPO_LOSSES = ("sigmoid", "hinge", "ipo")


def dpo_per_pair_loss(beta: float, loss_type: str = "sigmoid") -> PerExampleLoss:
    """The DPO loss of each preference pair, as per-row losses ``loss_fn(forward, batch) -> (2P,)``.

    ``batch``: ``2P`` rows interleaved ``[chosen_0, rejected_0, chosen_1, ...]`` (``input_ids``,
    ``attention_mask``, ``completion_mask (2P, T)``) and ``ref_logps (2P,)``, the reference model's
    summed completion log-probabilities. With ``s = log π_θ(y|x) − log π_ref(y|x)`` summed over the
    completion tokens and ``Δ = s_chosen − s_rejected``, the pair loss is ``−log σ(βΔ)``
    (``sigmoid``: Rafailov et al. 2023, eq. 7), ``max(0, 1 − βΔ)`` (``hinge``: SLiC, Zhao et al.
    2023) or ``(Δ̄ − 1/(2β))²`` with per-token averaged log-ratios (``ipo``: Azar et al. 2023, eq.
    17, as TRL normalises it). The pair's loss is returned on its chosen row and 0 on its rejected
    row: the engine differentiates the sum, and the pair's two rows are one clipping group.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo_per_pair_loss: loss_type must be one of {DPO_LOSSES}, got {loss_type!r}")

    def loss_fn(forward: Callable[..., Any], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in ("completion_mask", "ref_logps")}
        logits = _logits(forward(**inputs, use_cache=False))
        ids, mask = batch["input_ids"], batch["completion_mask"][:, 1:].float()
        tok = -torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                                                 reduction="none") * mask
        s = tok.sum(dim=1) - batch["ref_logps"].float()
        if loss_type == "ipo":
            s = s / mask.sum(dim=1).clamp(min=1.0)
        s = s.view(-1, 2)
        delta = s[:, 0] - s[:, 1]
        if loss_type == "sigmoid":
            pair = -torch.nn.functional.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            pair = torch.relu(1 - beta * delta)
        else:
            pair = (delta - 1 / (2 * beta)) ** 2
        return torch.stack([pair, torch.zeros_like(pair)], dim=1).reshape(-1)

    return loss_fn


def pair_rows(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's preference batch (``DataCollatorForPreference``: ``P`` chosen rows then ``P`` rejected
    rows, ``ref_chosen_logps``/``ref_rejected_logps (P,)``) → the rows interleaved pair by pair,
    ``ref_logps (2P,)`` and the clipping group of each row (``GROUP_KEY``: ``[0, 0, 1, 1, ...]``).

    Raises:
        ValueError: no precomputed reference log-probabilities in the batch.
    """
    if "ref_chosen_logps" not in batch or "ref_rejected_logps" not in batch:
        raise ValueError("DPDPOTrainer: the preference batch holds no precomputed reference log-probabilities "
                         "(ref_chosen_logps / ref_rejected_logps)")
    p = batch["ref_chosen_logps"].shape[0]
    order = torch.stack([torch.arange(p), torch.arange(p) + p], dim=1).reshape(-1)
    out = {k: v[order] for k, v in batch.items()
           if k not in ("ref_chosen_logps", "ref_rejected_logps") and isinstance(v, torch.Tensor) and v.dim() > 0
           and v.shape[0] == 2 * p}
    out["ref_logps"] = torch.stack([batch["ref_chosen_logps"], batch["ref_rejected_logps"]], dim=1).reshape(-1)
    out[GROUP_KEY] = torch.arange(p).repeat_interleave(2)
    return out


def check_dpo_config(args: Any) -> None:
    """Refuse the DPO settings that are not a function of one pair, or not supported per pair.

    Raises:
        ValueError: padding-free, a loss type outside :data:`DPO_LOSSES` (``aot``/``aot_unpaired``
            sort the log-ratios across the batch; ``sft`` is a batch mean), loss weights,
            ``ld_alpha``, an f-divergence other than reverse KL, WPO weighting, ``sync_ref_model``
            (the reference then moves with the private training), ``activation_offloading``,
            a MoE router loss; each message names the fix."""
    if getattr(args, "padding_free", False):
        raise ValueError("DPDPOTrainer: padding_free=True flattens the pairs into one row; use "
                         "DPOConfig(padding_free=False)")
    losses = list(getattr(args, "loss_type", ["sigmoid"]) or ["sigmoid"])
    if isinstance(getattr(args, "loss_type", None), str):
        losses = [args.loss_type]
    if len(losses) != 1 or losses[0] not in DPO_LOSSES:
        why = (" ('aot'/'aot_unpaired' sort the log-ratios across the batch, so one pair's loss depends on the "
               "others'; 'sft' is one batch mean)") if set(losses) & {"aot", "aot_unpaired", "sft"} else ""
        raise ValueError(f"DPDPOTrainer: loss_type={losses} is not supported per pair{why}; use one of "
                         f"{list(DPO_LOSSES)}")
    for attr, default, fix in (("loss_weights", None, "loss_weights=None"), ("ld_alpha", None, "ld_alpha=None"),
                               ("f_divergence_type", "reverse_kl", "f_divergence_type='reverse_kl'"),
                               ("use_weighting", False, "use_weighting=False"),
                               ("sync_ref_model", False, "sync_ref_model=False (a fixed, public reference)"),
                               ("activation_offloading", False, "activation_offloading=False")):
        v = getattr(args, attr, default)
        if v not in (default, [1.0]) and not (attr == "f_divergence_type" and str(v).endswith("reverse_kl")):
            raise ValueError(f"DPDPOTrainer: {attr}={v!r} is not supported; use DPOConfig({fix})")
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef:
        raise ValueError("DPDPOTrainer: a Mixture-of-Experts router loss is a batch statistic; set "
                         "DPOConfig(router_aux_loss_coef=0.0)")


def _dpo_base():
    from trl import DPOTrainer

    class _DPOArgs(DPOTrainer):
        """``DPTrainer.__init__`` passes ``(model, args)`` positionally; ``DPOTrainer`` takes
        ``(model, ref_model, args)``: this layer of the MRO puts them in place."""

        def __init__(self, model, args=None, *rest, ref_model=None, **kw):
            DPOTrainer.__init__(self, model, ref_model, args, *rest, **kw)

    return _DPOArgs


try:
    _DPOArgs = _dpo_base()
except ImportError:  # pragma: no cover - trl without DPO
    _DPOArgs = None


class DPDPOTrainer(DPTrainer, _DPOArgs):
    """TRL's ``DPOTrainer`` with :class:`~dpft.integrations.hf.trainer.DPTrainer`'s DP step; one preference
    pair (prompt, chosen, rejected) is the privacy unit.

    TRL prepares the data (tokenizing, chat templates) and the reference model as for every TRL
    user, and computes the reference log-probabilities once before training
    (``precompute_ref_log_probs`` is switched on: the reference weights are public, so these are
    per-pair inputs of the loss, not releases). Each logical step then Poisson-samples pairs; a
    physical batch of ``P`` pairs is ``2P`` rows (chosen and rejected interleaved), the pair's two
    rows form one clipping group (``grads/groups.py``: the norm of their *summed* gradient, cross
    term included, is clipped to C), the loss of a pair is :func:`dpo_per_pair_loss`, and the rest
    (noise, ledger, files, logging, resume) is ``DPTrainer``'s. Sensitivity: add/remove one pair
    changes the clipped sum by at most C.

    User level (``DPArguments(user_column=...)``, a user id per pair): DPTrainer's user sampling
    over pairs (``q = expected_batch_size / U``, at most ``max_rows_per_user`` pairs per sampled
    user, whole users per rank); with ``user_clipping='group'`` all of a user's chosen and
    rejected rows are one clipping group (integrations/trl/user.py). Add/remove one user changes
    the clipped sum by at most C; the ledger counts users.

    Under FSDP2 (``DPOConfig(fsdp=True, fsdp_config={"fsdp_version": 2})``, accelerate's FSDP2 plugin,
    or a policy sharded with ``fully_shard``; integrations/trl/fsdp.py): the reference is the policy
    before training, scored on every rank together when it is sharded (rank 0's values kept); a PEFT
    policy's frozen ``ref`` adapter is made before DPTrainer shards it; an unsharded ``ref_model`` is
    scored by rank 0 alone.

    Args:
        model, args (a ``DPOConfig``; copied), ref_model, data_collator, train_dataset,
        eval_dataset, processing_class, **dpo_kwargs (``peft_config``, ``callbacks``...): as for
            ``DPOTrainer``. ``DPArguments.max_physical_batch_size`` counts pairs.
        dp_args, loss_fn, ledger, transforms: as for :class:`DPSFTTrainer`; the default loss is
            :func:`dpo_per_pair_loss` of ``args.beta`` and ``args.loss_type``.

    Raises:
        TypeError: no ``dp_args``.
        ValueError: a setting that is not per pair (:func:`check_dpo_config`); a non-group engine
            (config/refusals.py ``privacy.engine:pair_groups``, a ``PlanError``).
    """

    def __init__(self, model, ref_model=None, args: Optional[Any] = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, dp_args: Optional[DPArguments] = None,
                 loss_fn: Optional[PerExampleLoss] = None, ledger: Optional[PrivacyLedger] = None,
                 transforms: Optional[list[Transform]] = None, **dpo_kwargs):
        import copy

        from trl import DPOConfig

        if not isinstance(dp_args, DPArguments):
            raise TypeError("DPDPOTrainer needs dp_args=DPArguments(target_epsilon=..., target_delta=..., "
                            "max_grad_norm=..., expected_batch_size=...)")
        args = copy.copy(args) if args is not None else DPOConfig(output_dir="trainer_output")
        check_dpo_config(args)
        check_rows(train_dataset, "DPDPOTrainer")
        args.precompute_ref_log_probs = True
        if loss_fn is None:
            loss_fn = dpo_per_pair_loss(float(args.beta), list(args.loss_type)[0] if not isinstance(args.loss_type, str)
                                        else args.loss_type)
        # A sharded policy (fsdp= shards it inside DPTrainer.__init__, or the caller did): TRL's fingerprint
        # of the reference gathers DTensors instead of refusing them (integrations/trl/fsdp.py).
        # A PEFT policy's reference adapter is made before DPTrainer shards the policy (TRL's would be plain).
        check_reference_adapter(model, ref_model)
        if fsdp_requested(args) is not None and ref_model is None:
            add_reference_adapter(model)
        with hashable_sharded(fsdp_requested(args) is not None or is_fsdp2_model(model)), \
                reference_adapter_kept(model):
            super().__init__(model, args, ref_model=ref_model, data_collator=data_collator,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             dp_args=dp_args, loss_fn=loss_fn, ledger=ledger, transforms=transforms, **dpo_kwargs)
        if not getattr(self.engine, "supports_groups", False):  # a pair is one group at example level too
            raise refuse("privacy.engine:pair_groups", "DPTrainer", got=type(self.engine).__name__)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference log-probabilities of every pair, as columns ``ref_chosen_logps`` /
        ``ref_rejected_logps`` of ``dataset``. One process: TRL's own. Several (torchrun /
        accelerate launch): TRL's version shards the pass, gathers, and has rank 0 write an Arrow
        cache file that the other ranks then open, which fails for an in-memory dataset (each
        process has its own temporary cache directory), and each shard would be scored with its
        rank's own initial weights. Here rank 0 broadcasts its weights (DPTrainer broadcasts them
        again later), scores every pair alone and broadcasts the values: the same bits on every
        rank, no file. The reference weights are public, so these are inputs, not releases.

        A sharded scoring model (FSDP2: the policy under ``fsdp=``, its adapters disabled for PEFT, or a
        sharded ``ref_model``) cannot run on rank 0 alone: every rank scores every pair together and
        rank 0's values are broadcast (:func:`~dpft.integrations.trl.fsdp.score_all_ranks`); sharded
        modules are not broadcast (DPTrainer broadcast rank 0's weights before sharding them)."""
        from torch.utils.data import DataLoader

        world = ddp.init_from_env()
        if not world.distributed:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        for m in {id(m): m for m in (self.model, self.ref_model) if isinstance(m, torch.nn.Module)}.values():
            if not is_fsdp2_model(m):
                ddp.broadcast_module(world, m)
        scorer = self.ref_model or self.model

        def score() -> tuple[torch.Tensor, torch.Tensor]:
            chosen, rejected = [], []
            for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False):
                c, r = self.compute_ref_log_probs(scorer, self._prepare_inputs(batch))
                chosen.append(c.detach().float().cpu())
                rejected.append(r.detach().float().cpu())
            return torch.cat(chosen), torch.cat(rejected)

        chosen, rejected = (score_all_ranks(world, scorer, score) if scored_by_every_rank(scorer)
                            else ddp.on_rank0(world, score))
        return dataset.add_column("ref_chosen_logps", chosen.tolist()).add_column("ref_rejected_logps",
                                                                                 rejected.tolist())

    def _micro_batches(self, idx: torch.Tensor):
        """Physical batches of the sampled pairs: ``2P`` rows each, a pair's rows one group."""
        mine = self._share(idx)  # DDP: this rank's pairs only (each rank clipping all would count a pair K times)
        if not len(mine):
            return
        if self.user_level:  # whole users per batch, a user's pairs one group (integrations/trl/user.py)
            chunks = user_pair_chunks(self, mine)
        else:
            rows = self._rows(mine)
            p = self.physical_batch_size
            chunks = ((rows[k:k + p], None) for k in range(0, len(rows), p))
        for chunk, users in chunks:
            batch = pair_rows(self._dp_collator(chunk))
            # One sampled pair must be exactly two rows of one group.
            hf_data.check_unpacked_batch(batch, 2 * len(chunk), "DPDPOTrainer")
            if not torch.equal(batch[GROUP_KEY], torch.arange(len(chunk)).repeat_interleave(2)):
                raise PackedBatchError("DPDPOTrainer: the collated batch is not two rows per sampled pair")
            if users is not None:  # user level: both rows of each pair take the pair's user's group
                batch[GROUP_KEY] = users.repeat_interleave(2)
            yield self._prepare_inputs(batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """``DPTrainer.log``; DPOTrainer's training metrics (rewards, margins, accuracies: private
        statistics) are never gathered in training and cleared here for safety."""
        if self.model is not None and self.model.training and hasattr(self, "_metrics"):
            self._metrics["train"].clear()
        super().log(logs, *args, **kwargs)

