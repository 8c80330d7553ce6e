"""TRL integration: :class:`DPSFTTrainer`, supervised fine-tuning with TRL's ``SFTTrainer`` under DP.

A TRL user keeps ``SFTConfig``, the model (or its name), the tokenizer and its chat template,
the dataset in any of TRL's formats (language modeling ``text``, prompt/completion, or
conversational ``messages`` / ``prompt``+``completion`` lists of turns), ``peft_config``,
evaluation and callbacks, and adds the privacy settings::

    from peft import LoraConfig
    from trl import SFTConfig
    from dpft.integrations.hf import DPArguments
    from dpft.integrations.trl import DPSFTTrainer

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
padding collator). Everything after that is :class:`~dpft.integrations.hf.DPTrainer`'s, by
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

DPO: see docs/trl.md, "Preference optimisation (DPO)": it fits the same step with one
preference pair as the privacy unit (the pair's two sequences clipped as one group), but it is
not built here.

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
from dpft.integrations.hf import DPArguments, DPTrainer, _logits
from dpft.step.postprocess import Transform

__all__ = ["DPSFTTrainer", "sft_per_example_loss", "check_sft_config"]

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
    if train_dataset is not None:
        try:
            import datasets
        except ImportError:  # pragma: no cover - a dependency
            datasets = None
        if datasets is not None and isinstance(train_dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset)):
            _refuse("train_dataset is an IterableDataset (streaming); Poisson sampling picks rows by index, so "
                    "load a map-style datasets.Dataset (e.g. load_dataset(..., streaming=False))")
        cols = getattr(train_dataset, "column_names", None) or []
        if "seq_lengths" in cols:
            _refuse(f"train_dataset has a 'seq_lengths' column: its rows are packed sequences of several examples "
                    f"(trl.pack_dataset). Pass the unpacked rows and {PACKING_FIX}")


class DPSFTTrainer(DPTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with :class:`~dpft.integrations.hf.DPTrainer`'s DP step (see the
    module docstring).

    Args:
        model: as for ``SFTTrainer``: a model name/path, a causal LM or a ``PeftModel``.
        args: an ``SFTConfig`` (a plain ``TrainingArguments`` is converted by TRL); copied, the copy
            gets ``max_steps`` and ``max_grad_norm = 0``. Default: ``SFTConfig("trainer_output")``.
        data_collator, train_dataset, eval_dataset, processing_class, **sft_kwargs: as for
            ``SFTTrainer`` (``peft_config``, ``formatting_func``, ``callbacks``, ``optimizers``...).
        dp_args: the privacy settings (required, keyword): :class:`~dpft.integrations.hf.DPArguments`.
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
