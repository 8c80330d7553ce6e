"""Hugging Face ``Trainer`` integration: :class:`DPTrainer` and :class:`DPArguments`.

A Hugging Face user keeps ``TrainingArguments``, the model (PEFT models included), the dataset,
the collator, the optimizer, the LR scheduler, the callbacks and evaluation, and adds the
privacy settings::

    trainer = DPTrainer(model=model, args=TrainingArguments(output_dir="out", num_train_epochs=1,
                                                            learning_rate=5e-4,
                                                            per_device_train_batch_size=16,
                                                            report_to=[]),
                        train_dataset=ds, data_collator=collator,
                        dp_args=DPArguments(target_epsilon=8, target_delta=1e-5, max_grad_norm=1.0,
                                            expected_batch_size=64))
    trainer.train()
    trainer.get_epsilon()

What changes inside ``Trainer`` (DESIGN.md "The DP step, as data flows"):

* **Sampling.** The train dataloader is replaced: logical step ``t`` takes every row of
  ``train_dataset`` independently with probability ``q = expected_batch_size / N``
  (``N = len(train_dataset)``; :class:`~dpft.step.sample.PoissonSampler`, secret randomness).
  One row is one privacy unit. The logical batch (possibly empty) is cut into physical batches
  of at most ``max_physical_batch_size`` rows (default ``per_device_train_batch_size``), each
  collated by the ``data_collator`` only when it is processed (in the main process:
  ``dataloader_num_workers`` applies to evaluation only).
* **Gradients.** :meth:`DPTrainer.training_step` runs the per-example engine (book-keeping by
  default) on each physical batch: per-example clipped sums, accumulated in an
  :class:`~dpft.step.aggregate.Aggregator`. Once per logical batch,
  :meth:`DPStep.release_and_update <dpft.step.pipeline.DPStep.release_and_update>` adds
  ``N(0, σ²C²)`` (:class:`~dpft.step.noise.GaussianMechanism`), records the ``dp_accounting``
  event in the :class:`~dpft.accounting.ledger.PrivacyLedger`, divides by ``qN`` and runs the
  post-processing transforms; the noisy gradient is left in ``p.grad``.
* **Update.** ``Trainer`` then steps its own optimizer and LR scheduler (created by ``Trainer``
  over the trainable parameters) exactly once per logical batch. ``TrainingArguments.
  max_grad_norm`` (global clipping of the averaged gradient) is switched off: the DP clip norm
  is ``DPArguments.max_grad_norm``.
* **Steps.** ``max_steps`` if set, else ``ceil(num_train_epochs · N / expected_batch_size)``;
  written to ``trainer.args.max_steps`` (a copy of the caller's ``TrainingArguments``). σ is
  calibrated for that number of steps (PLD accountant), unless ``noise_multiplier`` is given.
* **Logging.** Every ``Trainer`` log gets an ``epsilon`` key (ε at ``target_delta`` of the
  ledger so far). The training loss ``Trainer`` logs is the *un-noised* loss of the sampled
  examples, a private statistic outside the guarantee: it is not logged (``loss``,
  ``train_loss``; ``TrainOutput.training_loss`` is NaN) unless ``log_private_train_loss=True``,
  and never the realised batch sizes or token counts. ``grad_norm`` is dropped too. Evaluation
  metrics are logged as usual: they are covered only if the evaluation data is public.
* **Several processes** (``torchrun``, ``accelerate launch``; docs/dp_trainer_distributed.md):
  one DP-SGD run for the world through ``dpft.placement.world`` as ``dpft train`` (rank 0's secret key
  broadcast; each rank clips its share; clipped sums all-reduced once per logical step; the same
  noise on every rank; one ledger; a per-step digest). The model is never wrapped in
  ``DistributedDataParallel`` (its buckets would all-reduce unclipped gradients). Rank 0 alone
  writes; a checkpoint resumes only with as many processes as wrote it.
* **User level** (``DPArguments(user_column=...)``): users are the privacy unit, sampled with
  ``q = expected_batch_size / U``, at most ``max_rows_per_user`` rows each per step, each user's
  summed gradient clipped to C (the CLI's ``task.user_column`` machinery: step/sample.py
  ``UserPoissonSampler``, grads/groups.py); N, q, δ < 1/N and the ledger count users.
* **Mechanisms** (issue 28, docs/mechanisms.md): ``DPArguments(max_batch_size=B)`` — truncated
  Poisson, ``TruncatedSubsampledGaussianDpEvent`` recorded and calibrated on;
  ``DPArguments(mechanism="banded_mf", bands=b)`` — banded matrix factorization (cyclic Poisson
  over secret partitions, noise C⁻¹Z, PoissonSampled(p, σ) every b-th step); its secret noise
  state goes to ``output_dir/noise_state.secret.pt`` (0600, outside ``checkpoint-*``) at every
  checkpoint and is required to resume. The same samplers and mechanism as ``dpft train``.
* **Ledger.** ``output_dir/ledger.json`` is rewritten after every release (rank 0), and each
  checkpoint (and ``save_model``) gets ``ledger.json`` and ``dp_state.json`` (σ, q, N, steps;
  never the seed). ``train(resume_from_checkpoint=...)`` continues the ledger of the output
  directory; a fresh run refuses an ``output_dir`` that already holds another run's ledger.

Refused, with a message naming the fix: gradient accumulation, ``TrainingArguments.
max_grad_norm`` other than its default, non-random ``train_sampling_strategy`` or a subclass's
own train sampler/dataloader, an iterable or empty ``train_dataset``, fp16 (its dynamic gradient
scaler; bf16 works: autocast forward, fp32 norms, sums, noise and optimizer state), activation
checkpointing with the reference engine (with the book-keeping engine it works), label smoothing or
``compute_loss_func`` without a per-example ``loss_fn``, ``model_init``, token counting,
``auto_find_batch_size``, hyperparameter search, a subclass's own training loop (``train``,
``_inner_training_loop``, ``_run_epoch``, ``training_step``), LOMO optimizers, DeepSpeed, FSDP1 and FSDP2 options
that would change the DP step (``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin and a model the
caller sharded with ``fully_shard`` run the sharded step: integrations/hf/fsdp.py), several GPUs in
one process (``DataParallel``) and resuming with another number of processes; packing / padding-free collators
(``DataCollatorWithFlattening``, packed SFT: a collated batch whose leading dimension is not the
number of sampled rows, ``position_ids`` restarting inside a row, ``cu_seq_lens`` keys:
:class:`~dpft.api.PackedBatchError`); and, checked at every step, a change of the trainable
parameters after construction, an optimizer update that applies no DP release (integrations/
hf_guard.py: the training stops, and no model card is written), or a gradient on an optimizer parameter outside the engine (a
user optimizer over all parameters with some unfrozen later; a model wrapped in DDP:
:class:`~dpft.api.UnclippedParameterError`).

Real models: ``DPArguments(clipping="head_body", head_learning_rate=...)`` for a pretrained encoder
with a fresh head (docs/snippets/sst2_dp_trainer.py). Source: Abadi et al. 2016 (DP-SGD), Poisson
sampling, division by the expected batch size; the interface follows Opacus and ``Trainer``.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict
from typing import Any, Mapping, Optional

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from dpft.placement import world as ddp
from dpft.placement.fsdp import reshard_all
from dpft.accounting.calibrate import check_delta
from dpft.api import UnclippedParameterError, prediction_summary
from dpft.accounting.ledger import PrivacyLedger
from dpft.grads.base import PerExampleEngine, PerExampleLoss
from dpft.step.aggregate import Aggregator
from dpft.step.clip import ClipPolicy, NonFiniteGradientError, build_clip_policy
from dpft.step.build import make_engine
from dpft.step.postprocess import Transform
from dpft.integrations.hf.args import DPArguments
from dpft.methods.python import PythonMethods, PythonRecipe, python_methods
from dpft.integrations.hf.data import TOKEN, PoissonData, user_ids
from dpft.integrations.hf.state import DP_STATE_NAME, LEDGER_NAME, CapStop, PrivateState
from dpft.integrations.hf.checks import check_trainer, check_training_arguments, check_training_path
from dpft.integrations.hf.guard import GuardedTraining
from dpft.integrations.hf.fsdp import (accelerate_fsdp_off, check_sharded_model, check_still_sharded,
                                       refuse_sharded_methods, shard_requested, sharded_training_step,
                                       trainer_placeholder)
from dpft.integrations.hf.loss import hf_per_example_loss, is_causal_lm as _is_causal_lm, is_seq2seq
from dpft.models.load import is_head_param
from dpft.session import PrivateSession

__all__ = ["DPArguments", "DPTrainer", "hf_per_example_loss", "LEDGER_NAME", "DP_STATE_NAME"]

# --------------------------------------------------------------------------- helpers


def _dp_training_arguments(model, args: Optional[TrainingArguments], where: str, methods):
    """The model and a copy of ``args`` as DPTrainer runs them (the caller's object is left as it was),
    whether FSDP was asked through them and whether the step is sharded.

    ``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin: dpft shards the model itself (integrations/hf/fsdp.py),
    before Trainer (and TRL) prepare anything; an FSDP2 root (``fully_shard``) runs the sharded step.
    ``max_grad_norm = 0``: HF's global clipping of the averaged gradient is off. ``average_tokens_across_devices
    = False``: Trainer's compute_loss multiplies a loss by the number of processes when this is on (its batch loss
    is then divided by the world's token count); DPTrainer's training never uses it, and for a model whose loss
    ignores num_items_in_batch (sequence classifiers) it doubled eval_loss under 2 processes (transformers 5.24).
    Off: evaluation is per batch as in one process.

    Raises:
        ValueError: what ``check_training_arguments`` / ``check_sharded_model`` refuse."""
    if args is None:
        args = TrainingArguments(output_dir="trainer_output")
    model, args, fsdp_asked = shard_requested(model, args, where, methods)
    check_training_arguments(args)
    sharded = check_sharded_model(model, where, methods) or fsdp_asked
    args = copy.copy(args)
    args.max_grad_norm = 0.0
    args.average_tokens_across_devices = False
    return model, args, fsdp_asked, sharded


class _TrainerStepsOptimizer:
    """The optimizer slot of :class:`~dpft.step.pipeline.StepSpec` under ``Trainer``.

    ``DPStep.release_and_update`` leaves the noisy averaged gradient in ``p.grad`` and calls
    ``step``/``zero_grad`` here, which do nothing: ``Trainer``'s own optimizer (and LR
    scheduler) steps right after ``training_step``, once per logical batch, and zeroes the
    gradients itself."""

    param_groups: list = []

    def step(self, closure=None):  # noqa: D401 - Trainer steps the real optimizer
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _refuse(msg: str) -> None:
    raise ValueError(f"DPTrainer: {msg}")


class _MethodsAfterUpdate(TrainerCallback):
    """Runs the methods' ``after_update`` once ``Trainer``'s optimizer has applied the noisy
    update of the step (``on_optimizer_step``), before the next step is sampled: DP-Adam-AC's C
    update from the step's noisy count is in force for the next release, as in ``dpft train``."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._after_update()


# --------------------------------------------------------------------------- the trainer


class DPTrainer(PoissonData, PrivateState, GuardedTraining, Trainer):
    """``transformers.Trainer`` with DP-SGD / DP-Adam: Poisson sampling, per-example clipping,
    Gaussian noise once per logical batch, one privacy ledger (see the module docstring).

    Args:
        model, args, *trainer_args, **trainer_kwargs: as for ``transformers.Trainer``
            (``args`` is copied; the copy gets ``max_steps`` and ``max_grad_norm = 0``).
        dp_args: the privacy settings (required, keyword).
        loss_fn: per-example loss ``loss_fn(forward, batch) -> (B,)``; default
            :func:`hf_per_example_loss` (causal LM or classification, from the model class).
        ledger: a ledger holding earlier releases of the same data (composed into calibration).
        transforms: post-processing of the noisy averaged gradient (``dpft.step.postprocess``).

    Attributes:
        sigma, q, n, total_steps: noise multiplier, sampling rate, N and logical steps.
        ledger: the run's :class:`~dpft.accounting.ledger.PrivacyLedger`.
        engine, clip, mechanism, sampler, dp_step: the parts of the DP step.
        methods, method_stats: ``DPArguments.methods`` (methods/python.py; their ``after_update`` runs
            after ``Trainer``'s optimizer step) and what they released at the last step.

    Raises:
        ValueError: a setting DPTrainer cannot certify (the message names the fix).
        dpft.accounting.calibrate.CalibrationError: the target ε cannot be met.
    """

    def __init__(self, model=None, args: Optional[TrainingArguments] = None, *trainer_args,
                 dp_args: Optional[DPArguments] = None, loss_fn: Optional[PerExampleLoss] = None,
                 ledger: Optional[PrivacyLedger] = None, transforms: Optional[list[Transform]] = None,
                 **trainer_kwargs):
        if not isinstance(dp_args, DPArguments):
            raise TypeError("DPTrainer needs dp_args=DPArguments(target_epsilon=..., target_delta=..., "
                            "max_grad_norm=..., expected_batch_size=...)")
        where = type(self).__name__
        check_training_path(type(self), where)  # its own training loop: before any loading
        model, args, fsdp_asked, self.sharded = _dp_training_arguments(model, args, where, dp_args.methods)
        with accelerate_fsdp_off(fsdp_asked):  # accelerate must not build its FSDP plugin from the environment
            super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self.dp_args = dp_args
        check_trainer(self, loss_fn, DPTrainer)
        #: The private session (dpft/session/): this process's world (the process group accelerate
        #: created; one process alone), the run's one secret key (DDP: rank 0's, broadcast; each
        #: training loop draws from its own child), the ledger, the unit, the methods, the plan, the step.
        self.session = PrivateSession.open(dp_args.reproducible_seed, ledger=ledger, where=where)
        self.world, self.rng, self.ledger = self.session.world, self.session.rng, self.session.ledger
        users = self._privacy_units()  # N units (rows, or users: one index per row) and the steps
        if self.rng.reproducible and self.world.is_main:
            warnings.warn("DPArguments.reproducible_seed is set: batches and noise can be regenerated from it, "
                          "so ε holds only while that seed stays secret", stacklevel=2)
        self._run_rng, self._loops = self.rng.child("hf-train-loop-0"), 0
        self.loss_fn = loss_fn if loss_fn is not None else hf_per_example_loss(
            _is_causal_lm(self.model), tuple(self.label_names or ()), seq2seq=is_seq2seq(self.model))
        meths = python_methods(dp_args.methods, "DPArguments")
        if self.sharded:
            refuse_sharded_methods(where, meths)
        self.plan = self.session.plan(  # the session checks that every rank runs the same (``same``: what else)
            dp_args.session_settings(*self._length), rows=self.train_dataset, n_rows=len(self.train_dataset),
            rng=self._run_rng, optimizer=_TrainerStepsOptimizer(), method_list=meths,
            users=None if users is None else (users.tolist(), dp_args.user_column),
            same=ddp.recipe_digest(self._world_config()), methods=self._methods_for(meths),
            parts=lambda sampler: self._clip_and_engine(build_clip_policy(dp_args.clip_settings())),
            transforms=list(transforms or []), head_mask=lambda names: [is_head_param(n) for n in names])
        self._after_plan()

    def _methods_for(self, meths: list):
        """The session's factory of ``DPArguments.methods`` over what DPTrainer knows (methods/python.py;
        their ``after_update`` runs after ``Trainer``'s optimizer step). The session calls it once every
        rank runs the same settings, before the methods prepare: under DDP the world first takes rank 0's
        weights (an FSDP2 model holds one weight per parameter for the world)."""
        dp = self.dp_args
        recipe = PythonRecipe(max_grad_norm=dp.max_grad_norm, clipping=dp.clipping,
                              expected_batch_size=int(dp.expected_batch_size), hardened_noise=dp.hardened_noise,
                              methods=meths)

        def methods(n: int, rng, user_level: bool) -> PythonMethods:
            if not self.sharded:
                ddp.broadcast_module(self.world, self.model)  # DDP: the world starts from rank 0's weights
            return PythonMethods(meths, model=self.model, n=n, ledger=self.ledger, rng=rng, where="DPTrainer",
                                 recipe=recipe, loss_fn=self.loss_fn, user_level=user_level)
        return methods

    def _privacy_units(self) -> Optional[torch.Tensor]:
        """N privacy units (rows, or users), the planned steps and the physical batch size (every rank's
        are compared by the session's plan). Returns the ``(N_rows,)`` user index of every row at user
        level, else None.

        Raises:
            ValueError: more expected units than units, δ ≥ 1/N, a missing user id, or
                TrainingArguments.world_size unlike torch.distributed's."""
        dp_args, ds = self.dp_args, self.train_dataset
        if self.world.world_size != int(getattr(self.args, "world_size", 1) or 1):
            _refuse(f"torch.distributed has {self.world.world_size} processes but TrainingArguments.world_size = "
                    f"{self.args.world_size}; launch with torchrun or accelerate launch and let Trainer join that world")
        check_still_sharded(self.model, self.sharded, self.world, type(self).__name__)  # after TRL's peft_config
        eb = int(dp_args.expected_batch_size)
        #: Row-level (None) or user-level: the privacy unit's sampler over the rows.
        self.user_level = dp_args.user_column is not None
        users = None
        if self.user_level:
            users = user_ids(ds, dp_args.user_column)
            self.n = int(users.max()) + 1  # U: the privacy units (ledger q, δ, epochs count users)
            if eb > self.n:
                _refuse(f"dp_args.expected_batch_size = {eb} exceeds the number of users U = {self.n} in column "
                        f"{dp_args.user_column!r} (at user level it counts users); lower expected_batch_size")
        else:
            self.n = len(ds)
            if eb > self.n:
                _refuse(f"dp_args.expected_batch_size = {eb} exceeds len(train_dataset) = {self.n}; "
                        "lower expected_batch_size")
        check_delta(dp_args.target_delta, self.n)
        self.steps_per_epoch = max(1, math.ceil(self.n / eb))
        max_steps = self.args.max_steps if self.args.max_steps is not None and self.args.max_steps > 0 else None
        #: (max_steps, or None and num_train_epochs): the session counts the logical steps (one rule)
        self._length = (max_steps, self.args.num_train_epochs)
        self.physical_batch_size = int(dp_args.max_physical_batch_size or self.args.per_device_train_batch_size)
        return users

    def _after_plan(self) -> None:
        """The plan's parts on the trainer, the step for this world (session/step.py), the release
        guard and the callbacks."""
        #: The method plug-ins of ``DPArguments.methods``; ``method_stats``: what they released at
        #: the last update (privatised statistics only, e.g. DP-Adam-AC's C and clip rate).
        self.methods, self.method_stats, self._pending_update = self.session.methods, {}, None
        self.sigma, self.q, self.sampler = self.plan.sigma, self.plan.q, self.plan.sampler
        # the session's count of logical steps (a method's prepare may change it); Trainer's loop runs that many
        self.total_steps = self.args.max_steps = self.session.planned
        self.engine, self.clip = self.plan.engine, self.plan.spec.clip  # the spec's clip (a method may swap it)
        self.dp_step = self.session.step(self.plan, sharded=self.sharded, on_release=self._save_live_ledger,
                                         dummy_batch=trainer_placeholder(self))
        self.mechanism = self.dp_step.spec.mechanism  # FSDP2: the step's sharded copy releases (hf/fsdp.py)
        self._init_release_guard()  # every optimizer update = one release of dp_step (hf_guard.py)
        self._live_written = False
        self._params_checked = False
        self._stop_at: Optional[int] = None  # a resumed run's ε cap (hf_state.py CapStop)
        self.add_callback(CapStop(self))
        if self.methods:
            self.add_callback(_MethodsAfterUpdate(self))
        if self.optimizer is not None:
            self._warn_frozen_in_optimizer(self.optimizer)
        #: Un-noised statistics of the last logical step (never logged; for the data holder).
        self.last_private_stats: dict[str, Any] = {}

    def _world_config(self) -> dict[str, Any]:
        """What every rank of a DDP world must agree on beyond the session's settings (its digest is
        the session's ``same``): else the all-reduce would add unlike sums, or hang."""
        dp = asdict(self.dp_args)
        dp.pop("max_physical_batch_size", None)  # memory only: ranks may differ
        dp.pop("log_private_train_loss", None)
        return {"dp_args": dp, "rows": len(self.train_dataset), "units": self.n, "length": list(self._length),
                "trainable": [[n, list(p.shape)] for n, p in self.model.named_parameters() if p.requires_grad]}

    def _clip_and_engine(self, clip: ClipPolicy) -> tuple[ClipPolicy, PerExampleEngine]:
        """The plan's parts: ``clip`` (from the one clip builder) and the per-example engine over it."""
        from dpft.placement.device import Precision

        ckpt = bool(getattr(self.args, "activation_checkpointing", False) or getattr(self.args, "gradient_checkpointing", False))
        if self.dp_args.engine == "reference" and ckpt:
            _refuse("activation (gradient) checkpointing needs DPArguments.engine='bookkeeping': the reference "
                    "engine's torch.func transforms cannot run Hugging Face's checkpointing hooks")
        engine = make_engine("reference" if self.dp_args.engine == "reference" else "bookkeeping", self.model,
                             self.loss_fn, clip)
        if getattr(self.args, "bf16", False):
            # bf16 autocast around the forward (accelerate also wraps the model's forward; nested
            # autocast of one dtype is the same). Norms, clipped sums, noise and the optimizer
            # state stay fp32 (dpft/placement/device.py).
            engine.precision = Precision("bf16", device_type=self.args.device.type)
        return clip, engine

    def _check_params(self) -> None:
        """The engine's parameters must still be the model's trainable parameters (checked at every
        step: a parameter unfrozen later would get its raw gradient from the backward)."""
        current = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        eng = self.dp_step.params  # what the step updates (DP-SFT: the spanned parameters, not its coordinates)
        if set(current) != set(eng) or any(current[n] is not p for n, p in eng.items()):
            changed = sorted(set(current) ^ set(eng))[:5]
            raise UnclippedParameterError(
                f"DPTrainer: the model's trainable parameters changed after DPTrainer was built ({changed}); "
                "their gradients would not be clipped or noised. Freeze/unfreeze parameters (or wrap with "
                "peft) before creating DPTrainer, or pass only the trainable parameters to the optimizer")
        self._params_checked = True

    def _engine_ids(self) -> set[int]:
        return {id(p) for p in self.dp_step.params.values()}

    def _warn_frozen_in_optimizer(self, optimizer) -> None:
        ids, names = self._engine_ids(), {id(p): n for n, p in self.model.named_parameters()}
        held = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"] if id(p) not in ids]
        if held:
            warnings.warn(
                f"DPTrainer: the optimizer holds {len(held)} parameter(s) the DP engine does not clip "
                f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); they must stay frozen (a gradient "
                "on them stops training). Pass only the trainable parameters to the optimizer", stacklevel=3)

    def _check_unclipped_grads(self) -> None:
        """Refuse optimizer parameters outside the engine that hold a gradient (raw, unclipped)."""
        opt = self.optimizer
        if opt is None:
            return
        ids, names = self._engine_ids(), {id(p): n for n, p in self.model.named_parameters()}
        bad = [names.get(id(p), f"<tensor {tuple(p.shape)}>") for g in opt.param_groups for p in g["params"]
               if id(p) not in ids and p.grad is not None]
        if bad:
            raise UnclippedParameterError(
                f"DPTrainer: the optimizer parameter(s) {bad[:5]} have a gradient but are not clipped or noised "
                "by the DP engine; the optimizer would apply their raw gradient. Set requires_grad before "
                "creating DPTrainer, or pass only the trainable parameters to the optimizer. Nothing was released")

    def create_optimizer(self, model=None):
        """``Trainer.create_optimizer``, with the head in its own group at
        ``DPArguments.head_learning_rate`` when that is set."""
        fresh = self.optimizer is None
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
        hl = self.dp_args.head_learning_rate
        if fresh and hl is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            extra = []
            for g in opt.param_groups:
                head = [p for p in g["params"] if is_head_param(names.get(id(p), ""))]
                if head:
                    g["params"] = [p for p in g["params"] if not is_head_param(names.get(id(p), ""))]
                    extra.append({**{k: v for k, v in g.items() if k != "params"}, "params": head, "lr": hl})
            if not extra:
                _refuse("head_learning_rate is set but no trainable parameter is named like a task head "
                        "(classifier/score/pooler/lm_head); pass optimizers=(opt, None) with your own param groups")
            for g in extra:
                opt.add_param_group(g)
        self._guard_optimizer(opt)  # each of its steps must apply one DP release
        return opt

    # ------------------------------------------------------------------ no DDP buckets
    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s accelerator, told never to wrap a model in ``DistributedDataParallel``.

        Under ``torchrun`` / ``accelerate launch`` ``Trainer._prepare_for_training`` calls
        ``accelerator.prepare(model, optimizer)``, whose ``prepare_model`` wraps any model with a
        trainable parameter in DDP; DDP's gradient buckets all-reduce the *unclipped* gradient of
        every backward (and hold a gradient-sized copy). DPTrainer all-reduces the clipped sums
        itself, once per logical step, so the accelerator prepares models in ``evaluation_mode``:
        device placement, mixed precision and compilation only, no DDP wrapper (the same call
        ``Trainer`` makes for a model that owns its gradient reduction)."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        if getattr(acc.prepare_model, "_dpft_no_ddp", False):
            return
        prepare_model = acc.prepare_model

        def prepare_model_without_ddp(model, device_placement=None, evaluation_mode=False):
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        prepare_model_without_ddp._dpft_no_ddp = True
        acc.prepare_model = prepare_model_without_ddp

    def _check_not_ddp(self, model: torch.nn.Module) -> None:
        """Refuse a model in ``DistributedDataParallel`` (ours or the user's): its buckets
        all-reduce unclipped gradients."""
        from torch.nn.parallel import DistributedDataParallel

        for m in (model, self.model_wrapped, self.model):
            ddp.refuse_sharded_model(m, type(self).__name__, allow_fsdp2=self.sharded)  # a wrapper added after __init__
            if isinstance(m, DistributedDataParallel) or any(isinstance(x, DistributedDataParallel)
                                                             for x in m.modules()):
                raise UnclippedParameterError(
                    "DPTrainer: the model is wrapped in torch.nn.parallel.DistributedDataParallel, whose gradient "
                    "buckets all-reduce the unclipped gradient of every backward; DPTrainer all-reduces the clipped "
                    "sums itself. Pass the bare model (no DDP wrapper); DPTrainer stops accelerate from adding one. "
                    "Nothing was released")

    # ------------------------------------------------------------------ the DP step
    def training_step(self, model: torch.nn.Module, inputs: Mapping[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One logical step: Poisson batch (one for the world under DDP) → this rank's share →
        per-example (user-level: per-user) clipped sums over physical batches → one all-reduce of
        the clipped sums → ``DPStep.release_and_update`` (noise once for the world, ledger event,
        ÷ qN, transforms) → a per-step digest check that every rank holds the same batch and noisy
        gradient. The noisy gradient is left in ``p.grad`` for ``Trainer``'s optimizer step.

        Returns 0 (the un-noised loss is private) unless ``log_private_train_loss``."""
        if not (isinstance(inputs, Mapping) and TOKEN in inputs):
            raise RuntimeError("DPTrainer.training_step got a batch that its Poisson sampler did not produce; "
                               "do not replace DPTrainer's train dataloader")
        self._check_not_ddp(model)
        self._guard_optimizer()  # idempotent; an optimizer swapped in since is hooked too
        if self.sharded:
            reshard_all(self.model)  # an evaluation since the last step left the root unit gathered
        self._check_params()
        self._check_unclipped_grads()
        t = int(self.state.global_step)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        # dropout masks: per step (and rank), secret
        torch.manual_seed(ddp.dropout_seed(self._run_rng, t, self.world))
        idx = self._logical_order(self.dp_step.indices(t))
        if self.sharded:  # FSDP2 (integrations/hf/fsdp.py): placeholders, reduce-scatter, sharded noise
            return sharded_training_step(self, t, idx)
        agg = Aggregator(self.engine.params)
        failure: Optional[NonFiniteGradientError] = None
        try:
            for batch in self._micro_batches(idx):
                with self.compute_loss_context_manager():
                    agg.add(self.engine.clipped_sum(batch))
        except NonFiniteGradientError as exc:
            if not self.world.distributed:
                raise NonFiniteGradientError(
                    f"DPTrainer, step {t}: {exc}. Nothing was released for this step; lower learning_rate or "
                    "check the data, and resume from the last checkpoint") from None
            failure = exc  # DDP: every rank hears of it in the all-reduce below, before any release
        if agg.all_reduce(self.world.group, failed=failure is not None):
            why = failure if failure is not None else "non-finite training loss on another rank"
            raise NonFiniteGradientError(
                f"DPTrainer, step {t}: {why}. Nothing was released for this step; lower learning_rate or "
                "check the data, and resume from the last checkpoint")
        self._check_unclipped_grads()  # a backward wrote a raw gradient on a parameter outside the engine
        out = self.dp_step.release_and_update(t, agg)
        # DDP: same logical batch (and order) and the same noisy gradient on every rank.
        ddp.check_step_digest(self.world, t, idx, self._digest_tensors())
        self.last_private_stats = dict(out.private)
        self._pending_update = out if self.methods else None  # the methods' after_update: once applied
        if self.dp_args.log_private_train_loss:
            return torch.tensor(float(out.private["train_loss"]), device=self.args.device)
        return torch.zeros((), device=self.args.device)

    def get_train_dataloader(self):
        """``PoissonData.get_train_dataloader`` (a new child of the secret randomness per training
        loop); the methods' secret draws follow it too (DP-Adam-AC's count noise: a second
        ``train()`` must not reuse the first loop's count noise)."""
        loader = super().get_train_dataloader()
        self.methods.ctx.rng = self._run_rng
        if getattr(self.clip, "rng", None) is not None:
            self.clip.rng = self._run_rng
        return loader

    def _after_update(self) -> None:
        """The methods' ``after_update`` on the step ``Trainer``'s optimizer has just applied."""
        out, self._pending_update = self._pending_update, None
        if out is not None:
            self.method_stats = self.methods.after_update(out)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` (ledger, lock and resume: integrations/hf/state.py).

        Raises:
            ValueError: ``resume_from_checkpoint`` with a method whose state between steps a
                checkpoint does not hold (DP-Adam-AC's C), as ``dpft train --resume`` refuses it."""
        if resume_from_checkpoint and self.methods.stateful:
            _refuse(f"resume_from_checkpoint with methods {self.methods.stateful}: their state between steps (the "
                    "adaptive clip norm C) is not in the checkpoint; start a new DPTrainer (its ledger composes)")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _digest_tensors(self) -> dict[str, torch.Tensor]:
        """The weights and the noisy gradient of this step (in ``p.grad``), for the DDP digest."""
        out = {}
        for n, p in self.dp_step.params.items():
            out[f"w:{n}"] = p
            if p.grad is not None:
                out[f"g:{n}"] = p.grad
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """``Trainer.evaluation_loop``; for a classifier it also gathers the predictions, adds
        ``{prefix}_top_class_share`` (share of the most predicted class) and warns when every
        prediction is one class (a DP run swamped by noise often ends there, and its accuracy is
        then that class's share)."""
        classify = not _is_causal_lm(self.model)
        if classify:  # (B, C) logits are small; gathered so that a constant classifier is caught
            prediction_loss_only = False
        out = super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        preds = out.predictions
        if isinstance(preds, (tuple, list)) and preds:
            preds = preds[0]
        if classify and preds is not None and getattr(preds, "ndim", 0) == 2 and preds.shape[1] >= 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary = prediction_summary(torch.as_tensor(preds).float(), warn=False)
            if summary.get("n"):
                out.metrics[f"{metric_key_prefix}_top_class_share"] = summary["top_class_share"]
                if summary["single_class"] and summary["n"] >= 2 and self.world.is_main:
                    warnings.warn(
                        f"DPTrainer.evaluate: every one of the {summary['n']} predictions is class "
                        f"{summary['top_class']}; the model has learnt a constant (its accuracy is that class's "
                        "share). Under DP this usually means the noise swamps the signal: try "
                        "DPArguments(clipping='head_body', head_learning_rate=...) (README, \"With the Hugging "
                        "Face Trainer\")", stacklevel=2)
        return out
