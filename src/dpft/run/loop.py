"""The DP training loop: Poisson sampling → per-example engine → clip → noise → post-process
→ optimizer, one ledger event per logical step, evaluation, checkpoints and resume.

Methods (``methods/``) customise a run through the hooks of :class:`Trainer` (trainable
selection, engine, transforms, extra ledger phases) — they never copy the loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import dp_accounting as dpa
import torch
from tqdm.auto import tqdm

from dpft.accounting.calibrate import calibrate_sigma, check_delta
from dpft.accounting.io import atomic_write_text
from dpft.accounting.ledger import PrivacyLedger
from dpft.config import Recipe, dump_recipe
from dpft.data.tasks import load_task
from dpft.data.tokenize import collate, tokenize_task
from dpft.grads.base import NonPrivateEngine, PerExampleEngine
from dpft.models.load import count_parameters, head_param_groups, is_head_param, load_classifier, select_trainable, set_dropout
from dpft.models.losses import causal_lm_loss, classification_loss, model_inputs
from dpft.step import DPStep, StepSpec
from dpft.step.postprocess import Transform, rmt_transform  # noqa: F401 (Transform: public type)
from dpft.step.sample import PoissonSampler
from dpft.grads.groups import GROUP_KEY, PerExampleOverK
from dpft.step.clip import NonFiniteGradientError, make_clip_policy
from dpft.step.noise import GaussianMechanism
from dpft.methods.base import Run, active_methods
from dpft.perf import (COMPILE_REFUSAL, DEFAULT_FP16_LOSS_SCALE, Precision, check_dtype_on,
                       enable_activation_checkpointing, resolve_device)
from dpft.privacy.randomness import Randomness
from dpft.run import distributed as ddp
from dpft.run.interrupt import StopOnSignal, TrainingInterrupted, _Abandon, _HardStop  # noqa: F401 (re-exported)
from dpft.run.release import DiagnosticsLog, split_row


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, mismatched resume…); message names the fix."""


def make_engine(kind: str, model, loss_fn, clip) -> PerExampleEngine:
    """``bookkeeping`` (fast path, issue 3) · ``reference`` (torch.func) · ``auto``."""
    from dpft.grads.reference import ReferenceEngine

    if kind in ("auto", "bookkeeping"):
        try:
            from dpft.grads.bookkeeping import BookKeepingEngine
        except ImportError:
            if kind == "bookkeeping":
                raise TrainingError("the book-keeping engine is not available in this install") from None
            return ReferenceEngine(model, loss_fn, clip)
        return BookKeepingEngine(model, loss_fn, clip)
    return ReferenceEngine(model, loss_fn, clip)


def _lr_lambda(warmup: int, total: int, decay: str):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup))

    return f


@dataclass
class History:
    """Per-step and per-eval metrics (also streamed to ``metrics.jsonl``)."""

    rows: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """One run of a recipe in ``run_dir``.

    Raises (from ``__init__``/``run``): ``DataError``, ``ModelError``, ``CalibrationError``,
    ``TrainingError`` — each with a message that names the fix.
    """

    def __init__(self, recipe: Recipe, run_dir: str | Path, resume: bool = False,
                 transforms: Optional[list[Transform]] = None, progress: bool = True,
                 ledger: Optional[PrivacyLedger] = None, rng: Optional[Randomness] = None,
                 phase: str = "train", live_ledger_path: Optional[str | Path] = None):
        self.recipe = r = recipe
        self.run_dir = Path(run_dir)
        self.resume = resume
        self._user_transforms = list(transforms or [])
        # --- DDP (run/distributed.py): this process's rank; rank 0 alone shows progress ---
        #: This process's place in a torchrun world (rank 0 of 1 without one).
        self.world = ddp.init_from_env()
        ddp.check_same_recipe(self.world, r.model_dump(mode="json"))
        progress = progress and self.world.is_main
        # --- end DDP ---
        self.progress = progress
        self.private = r.privacy.enabled
        t0 = time.time()
        #: The run's one secret randomness source (privacy/randomness.py): secret unless
        #: privacy.reproducible, in which case it is derived from the recorded seed. Under DDP
        #: rank 0 draws the key and broadcasts it, so the world draws one logical batch.
        self.rng = rng if rng is not None else ddp.shared_randomness(self.world, r.seed if r.privacy.reproducible
                                                                     else None)
        ddp.check_same_randomness(self.world, self.rng)  # DDP: a caller's rng must be the world's
        #: The ledger is appended to, never replaced: it starts from the phases a caller already
        #: spent (e.g. a synthetic-data phase) and from any releases a crashed run of this
        #: directory recorded before its first checkpoint (``ledger.json`` is written live).
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        #: Ledger phase of this loop's steps, and the file its live ledger is saved to (a
        #: sub-run such as DP-SFT's stage 1 writes into its parent's ledger).
        self.phase = phase
        self.live_ledger_path = Path(live_ledger_path) if live_ledger_path else self.run_dir / "ledger.json"
        live = self.live_ledger_path

        def earlier_ledger():  # DDP: rank 0 reads the run directory, every rank gets its answer
            if not resume and live.is_file() and not (self.run_dir / "checkpoint").exists():
                return PrivacyLedger.load(live).to_json()
            return None

        earlier_json = ddp.on_rank0(self.world, earlier_ledger)
        if earlier_json is not None:
            earlier = PrivacyLedger.from_json(earlier_json)
            self.ledger = PrivacyLedger(earlier.entries + self.ledger.entries,
                                        certified=earlier.certified and self.ledger.certified,
                                        not_certified_reason=earlier.not_certified_reason or self.ledger.not_certified_reason)
            self.ledger_notes = [f"{live} held {earlier.steps} releases of an earlier attempt in this "
                                 "directory (crashed before its first checkpoint); they are carried in this ledger"]
        else:
            self.ledger_notes = []

        # ---- perf (issue 16): where the step runs; checked before any data or model is loaded.
        #: The device of the model, the batches, the clipped sums and the noise.
        self.device = resolve_device(r.perf.device,
                                     local_rank=self.world.local_rank if self.world.distributed else None)
        check_dtype_on(r.perf.dtype, self.device)
        #: Autocast dtype and static fp16 loss scale of the per-example engine.
        scale = r.perf.loss_scale or (DEFAULT_FP16_LOSS_SCALE if r.perf.dtype == "fp16" else 1.0)
        self.precision = Precision(r.perf.dtype, float(scale), self.device.type)
        self._check_perf()
        if r.task.user_column and self.private:  # refusals that need no data, before any loading
            self._check_user_level()

        #: ``text`` task: causal-LM fine-tuning on blocks of a corpus (data/text.py).
        #: ``instruct`` task: prompt/completion or chat rows, completion-only loss (data/instruct.py).
        self.causal = r.task.name in ("text", "instruct")
        self.loss_fn = causal_lm_loss if self.causal else classification_loss
        if self.causal:
            from dpft.data.instruct import load_instruct_task
            from dpft.data.text import load_text_task
            from dpft.models.causal import load_causal_lm

            self.tokenizer, model = load_causal_lm(r.model.name, seed=r.seed)
            if r.task.name == "instruct":
                hide = self.private or bool(active_methods(r))  # the training count is private
                self.task = load_instruct_task(r.task, self.tokenizer, r.model.max_length, seed=r.seed, private=hide)
                if hide and self.task.truncated["train"] and progress:
                    print(f"{self.task.truncated['train']} training rows were truncated to model.max_length = "
                          f"{r.model.max_length} tokens (private statistic: shown here only, not written to the "
                          "run directory)", file=sys.stderr)
            else:
                self.task = load_text_task(r.task, self.tokenizer, r.model.max_length, seed=r.seed)
            self.train_tok, self.dev_tok = self.task.train, self.task.dev
        else:
            self.task = load_task(r.task, seed=r.seed)
            if self.private:  # δ < 1/N before the model is loaded (N users ≤ rows: necessary at user level too)
                check_delta(r.privacy.delta, len(self.task.train))
            self.tokenizer, model = load_classifier(r.model.name, self.task.num_labels, seed=r.seed,
                                                    pooling=r.model.pooling, head_dropout=r.model.head_dropout)
        self.n = len(self.task.train)
        if r.model.dropout is not None:
            set_dropout(model, r.model.dropout)
        self.model = select_trainable(model, r.trainable)
        self._place_model()
        self.with_token_types = "token_type_ids" in self.tokenizer.model_input_names and not self.causal
        if not self.causal:
            # Dev truncation count goes in the report's notes; the training count is private.
            self.train_tok, self.dev_tok = tokenize_task(self.task, self.tokenizer, r.model.max_length,
                                                         private=self.private or bool(active_methods(r)))
            n_cut = getattr(self.task, "truncated", {}).get("train", 0)
            if n_cut and progress and (self.private or bool(active_methods(r))):
                print(f"{n_cut} training examples were truncated to model.max_length = {r.model.max_length} "
                      "tokens (private statistic: shown here only, not written to the run directory)",
                      file=sys.stderr)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.train_lengths = torch.tensor([len(x) for x in self.train_tok["input_ids"]])

        #: Privacy unit (issue 17): ``example`` (a row) by default; ``user`` with task.user_column
        #: — Poisson sampling over users, ≤ k rows per sampled user, a user's summed gradient
        #: clipped to C (step/sample.py UserPoissonSampler, grads/groups.py).
        self.user_level = bool(r.task.user_column) and self.private
        if r.task.user_column and not self.private:
            self.task.notes.append(f"task.user_column {r.task.user_column!r} ignored: a non-private run has no "
                                   "privacy unit")
        if self.user_level:
            self._check_user_level()
            self.sampler = self._user_sampler()
            self.n = self.sampler.n  # N = number of users: the ledger's q, δ check and epochs count users
            self.privacy_unit = {"unit": "user", "column": r.task.user_column, "n_units": self.n,
                                 "max_rows_per_user": self.sampler.k, "user_clipping": r.task.user_clipping}
        elif r.batch.schedule:
            from dpft.data.schedule import ScheduledPoissonSampler

            self.sampler = ScheduledPoissonSampler(self.n, r.batch.schedule, self.rng)
            if self.private and r.privacy.noise_multiplier is None:
                raise TrainingError("batch.schedule: set privacy.noise_multiplier (σ calibration for a "
                                    "variable q is not implemented; `dpft report` gives the certified ε)")
        else:
            self.sampler = PoissonSampler(self.n, r.batch.expected_batch_size, self.rng)
        if not self.user_level:
            self.privacy_unit = {"unit": "example", "n_units": self.n}
        self.q = self.sampler.q
        s = r.schedule
        self.total_steps = s.steps or max(1, math.ceil(s.epochs * self.n / r.batch.expected_batch_size))

        self.sigma = 0.0
        #: The recipe's methods (methods/base.py), composed in order; the driver names none.
        self.methods = active_methods(r)
        ddp.check_methods(self.world, self.methods)  # DDP: only methods correct across ranks
        #: What the methods see of this run (methods/base.py ``Run``).
        self.ctx = Run(recipe=r, run_dir=self.run_dir, resume=resume, progress=progress, private=self.private,
                       rng=self.rng, ledger=self.ledger, live_ledger_path=self.live_ledger_path, task=self.task,
                       tokenizer=self.tokenizer, model=self.model, loss_fn=self.loss_fn, train_tok=self.train_tok,
                       dev_tok=self.dev_tok, n=self.n, q=self.q, sampler=self.sampler, total_steps=self.total_steps,
                       evaluate=lambda: self.evaluate(), make_optimizer=self._make_optimizer)
        for m in self.methods:  # earlier private phases; model / loss / data wrapping
            m.prepare(self.ctx)
        self.model, self.loss_fn, self.train_tok = self.ctx.model, self.ctx.loss_fn, self.ctx.train_tok
        ddp.broadcast_module(self.world, self.model)  # DDP: the world starts from rank 0's weights
        self.total_steps = self.ctx.total_steps
        if self.private:
            check_delta(r.privacy.delta, self.n)
            if r.privacy.noise_multiplier is not None:
                self.sigma = float(r.privacy.noise_multiplier)
            else:
                # DDP: rank 0 calibrates and every rank gets its σ (one value for the world).
                self.sigma = ddp.on_rank0(self.world, lambda: calibrate_sigma(
                    r.privacy.target_epsilon, r.privacy.delta, self.q, self.total_steps, prior=self.prior_events()))
            clip = make_clip_policy(r.privacy.clipping.style, r.privacy.clipping.max_norm, r.privacy.clipping.gamma,
                                    r.privacy.clipping.head_fraction)
            if self.user_level and r.task.user_clipping == "per_example_over_k":
                # Conservative user-level clipping: each row to C/k; ≤ k rows per user ⇒ ≤ C per user.
                k = r.task.max_rows_per_user
                clip = PerExampleOverK(make_clip_policy(r.privacy.clipping.style, r.privacy.clipping.max_norm / k,
                                                        r.privacy.clipping.gamma, r.privacy.clipping.head_fraction), k)
            engine = make_engine(r.privacy.engine, self.model, self.loss_fn, clip)
            if hasattr(clip, "set_head_mask"):
                clip.set_head_mask([is_head_param(n) for n in engine.params])
            mechanism = GaussianMechanism(self.sigma, clip.sensitivity, self.rng, hardened=r.privacy.hardened_noise)
        else:
            engine = NonPrivateEngine(self.model, self.loss_fn, make_clip_policy("flat", 1.0))
            clip, mechanism = engine.clip, None
        self.ctx.sigma = self.sigma
        spec = StepSpec(engine=engine, clip=clip, mechanism=mechanism, sampler=self.sampler,
                        optimizer=self._make_optimizer(engine.params), transforms=list(self._user_transforms),
                        params=engine.params, phase=self.phase)
        for m in self.methods:  # each returns a changed copy of the step's parts
            spec = m.build(spec, self.ctx)
        self._set_precision(spec.engine)
        if self.user_level and r.task.user_clipping == "group" and not getattr(spec.engine, "supports_groups", False):
            raise TrainingError(f"user-level group clipping needs privacy.engine: bookkeeping or reference "
                                f"(got {type(spec.engine).__name__}); or set task.user_clipping: per_example_over_k")
        ddp.check_methods(self.world, [], keep_norms=spec.keep_norms)  # DDP: no raw norms across ranks
        self.params = spec.params if spec.params is not None else spec.engine.params
        self.optimizer = spec.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(s.warmup_steps, self.total_steps, s.decay))
        self.dp_step = DPStep(spec, self.ledger, self.n, on_release=self.save_live_ledger,
                              world_group=self.world.group)
        self.start_step = 0
        #: Step of the last checkpoint written or resumed from (None: none yet).
        self._last_checkpoint: Optional[int] = None
        #: Releases made again after a resume: ``[{"from_step", "to_step", "releases"}]`` (report).
        self.replays: list[dict[str, int]] = []
        self.diagnostics: Optional[DiagnosticsLog] = None
        self.history = History()
        self.elapsed_before = 0.0
        self.setup_seconds = time.time() - t0

    # ------------------------------------------------------------------ perf (issue 16)
    def _check_perf(self) -> None:
        """Refuse perf settings this run cannot honour (before anything is loaded)."""
        r = self.recipe
        p = r.perf
        if p.compile and r.privacy.enabled:
            raise TrainingError(COMPILE_REFUSAL)
        if p.activation_checkpointing and r.privacy.enabled and r.privacy.engine == "reference":
            raise TrainingError("perf.activation_checkpointing needs privacy.engine: bookkeeping (or auto): the "
                                "reference engine's torch.func transforms cannot run Hugging Face's checkpointing "
                                "hooks (they call requires_grad_ inside the transform)")
        if self.device.type != "cpu":
            # A method that runs its own forwards (scoring, split forward noise, stage-1 sub-runs) must say
            # it moves its tensors to the model's device; the driver names no method.
            from dpft.methods.base import get_method, method_name

            names = [method_name(c) for c in r.methods]
            bad = [n for n, c in zip(names, r.methods)
                   if get_method(n).enabled(c) and not getattr(get_method(n), "supports_device", False)]
            if bad and r.perf.device == "auto":  # auto: the best device this run supports
                self.device = torch.device("cpu")
                self.precision = Precision(self.precision.dtype, self.precision.loss_scale, "cpu")
                if self.progress:
                    print(f"perf.device auto: CPU, because methods {bad} are not device-aware yet", file=sys.stderr)
            elif bad:
                raise TrainingError(f"methods {bad} have not been made device-aware; run them with "
                                    "--device cpu (perf.device: cpu)")

    def _place_model(self) -> None:
        """Move the model to the device; activation checkpointing; compile (no-dp only)."""
        p = self.recipe.perf
        self.model.to(self.device)
        if p.activation_checkpointing:
            try:
                enable_activation_checkpointing(self.model)
            except ValueError as exc:
                raise TrainingError(str(exc)) from None
        if p.compile:
            self.model.compile()

    def _set_precision(self, engine) -> None:
        """Give the step's final engine the run's precision (refused if it cannot apply it)."""
        if self.precision.mixed and not getattr(engine, "supports_precision", False):
            raise TrainingError(f"perf.dtype {self.precision.dtype}: the {type(engine).__name__} of this recipe "
                                "does not apply autocast; use perf.dtype: fp32")
        engine.precision = self.precision

    # ------------------------------------------------------------------ user level (issue 17)
    def _check_user_level(self) -> None:
        """Refuse what user-level DP does not support yet, each with the reason and the fix."""
        r = self.recipe
        why = []
        if active_methods(r):
            names = [m.name for m in active_methods(r)]
            why.append(f"methods {names} assume example-level privacy (their phases, statistics and accounting "
                       "count rows); run them without task.user_column")
        if r.batch.schedule:
            why.append("batch.schedule (a variable q) is not supported over users; use batch.expected_batch_size")
        if self.world.distributed:
            why.append("DDP: the world's logical batch is sharded by row, which would split a user's rows across "
                       "ranks; run user level in one process")
        if r.perf.dtype == "fp16":
            why.append("perf.dtype fp16: an overflowed row would change its user's clipped contribution; use bf16 "
                       "or fp32")
        if getattr(r.task, "packing", False):
            why.append("task.packing mixes privacy units in one row; turn packing off")
        if why:
            raise TrainingError("user-level privacy (task.user_column) cannot run this recipe: " + "; ".join(why))

    def _user_sampler(self):
        """The :class:`~dpft.step.sample.UserPoissonSampler` over the users of the training rows."""
        from dpft.data.tasks import USER_COLUMN, DataError, _col
        from dpft.step.sample import UserPoissonSampler, user_index

        r = self.recipe
        # A loader renames the column to USER_COLUMN (classification, text) or keeps it under its
        # own name (instruction data keeps every extra column per row).
        cols = self.train_tok.column_names
        col = r.task.user_column if r.task.user_column in cols else USER_COLUMN
        if col not in cols:
            raise DataError(f"task.user_column {r.task.user_column!r}: the training rows carry no user id (this "
                            f"task's loader kept no {USER_COLUMN!r} or {r.task.user_column!r} column); give a file "
                            "with that column")
        try:
            users, _ = user_index(_col(self.train_tok, col))
            return UserPoissonSampler(users, r.batch.expected_batch_size, r.task.max_rows_per_user, self.rng)
        except ValueError as exc:
            raise DataError(f"user-level privacy (task.user_column {r.task.user_column!r}): {exc}") from None

    # ------------------------------------------------------------------ parts
    def method(self, name: str):
        """The active method plug-in called ``name`` (methods/base.py).

        Raises:
            KeyError: the recipe does not use that method."""
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"this run has no method {name!r} (active: {[m.name for m in self.methods]})")

    @property
    def engine(self):
        """The per-example engine in force (the DP step's spec)."""
        return self.dp_step.spec.engine

    @property
    def clip(self):
        """The clip policy in force."""
        return self.dp_step.spec.clip

    @property
    def transforms(self):
        """The post-processing transforms in force, in order."""
        return self.dp_step.spec.transforms

    @property
    def mechanism(self):
        """The Gaussian mechanism (None for a non-private run)."""
        return self.dp_step.spec.mechanism

    def prior_events(self) -> list:
        """Events spent before training (e.g. a private subspace); composed into calibration."""
        return self.ledger.events()

    def _make_optimizer(self, params: dict) -> torch.optim.Optimizer:
        """The recipe's optimizer over ``params`` (head and body groups when ``head_lr`` is set)."""
        o = self.recipe.optimizer
        groups: Any = head_param_groups(params, o.head_lr)
        if o.name == "sgd":
            return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
        if o.name == "adam":
            return torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Dev accuracy and mean loss (nats); no gradients, model in eval mode. ``text`` task:
        dev loss (nats/token) and perplexity. A method may replace it (e.g. an EMA's weights)."""
        for m in getattr(self, "methods", []):
            out = m.evaluate(self.ctx, self._evaluate_model)
            if out is not None:
                return out
        return self._evaluate_model()

    @torch.no_grad()
    def _evaluate_model(self) -> dict[str, float]:
        if self.causal:
            from dpft.eval.lm import lm_eval

            w = self.world  # DDP: each rank evaluates every K-th dev row; the sums are all-reduced
            out = lm_eval(self.model, list(self.dev_tok)[w.rank::w.world_size], self.pad_id,
                          self.recipe.eval.batch_size)
            if w.distributed:
                total, count = ddp.all_sum(w, [out["dev_loss"] * out["dev_tokens"], out["dev_tokens"]])
                loss = total / max(count, 1)
                out = {"dev_loss": loss, "dev_perplexity": math.exp(min(loss, 50.0)), "dev_tokens": int(count)}
            return out
        return self._evaluate_classifier()

    @torch.no_grad()
    def _evaluate_classifier(self) -> dict[str, float]:
        self.model.eval()
        bs = self.recipe.eval.batch_size
        order = sorted(range(len(self.dev_tok)), key=lambda i: len(self.dev_tok[i]["input_ids"]))
        order = order[self.world.rank::self.world.world_size]  # DDP: this rank's share of the dev set
        correct, loss, n = 0, 0.0, 0
        keep = self.recipe.eval.save_predictions
        if keep and self.world.distributed:
            raise TrainingError("eval.save_predictions is not supported with DDP yet; run on one process")
        preds: dict[int, tuple[int, bool]] = {}
        for k in range(0, len(order), bs):
            rows = self.dev_tok.select(order[k:k + bs])
            batch = collate(list(rows), self.pad_id, self.with_token_types, device=self.device)
            with self.precision.autocast():
                logits = self.model(**model_inputs(batch)).logits.float()
            loss += float(torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"))
            hit = logits.argmax(-1) == batch["labels"]
            correct += int(hit.sum())
            n += len(rows)
            if keep:
                for i, p, h in zip(order[k:k + bs], logits.argmax(-1).tolist(), hit.tolist()):
                    preds[int(i)] = (int(p), bool(h))
        if keep:  # the latest evaluation's (a method evaluating twice runs its headline last)
            self.dev_predictions = [{"index": i, "prediction": p, "correct": h} for i, (p, h) in sorted(preds.items())]
        if self.world.distributed:  # DDP: the world's sums, the same on every rank
            c, loss, m = ddp.all_sum(self.world, [correct, loss, n])
            correct, n = int(c), int(m)
        self.model.train()
        return {"dev_accuracy": correct / n, "dev_loss": loss / n}

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        """One logical step through :class:`~dpft.step.DPStep`. Returns the row's fields (the
        private ones are split off by run/release.py before anything is written)."""
        torch.manual_seed(ddp.dropout_seed(self.rng, step, self.world))  # dropout masks: per step (and rank), secret
        idx = self.dp_step.indices(step)
        for m in self.methods:
            m.before_step(step, self.ctx)
        self.model.train()
        idx = self.logical_order(idx)
        micro_batches = self.micro_batches(idx)
        try:
            res = self.dp_step.run(step, micro_batches)
            ddp.check_step_digest(self.world, step, idx, self.params)  # DDP: same batch and noise, every step
        except NonFiniteGradientError as exc:
            raise TrainingError(f"step {step}: {exc}. The last checkpoint in {self.run_dir} is intact; "
                                "fix the recipe and --resume") from None
        self.scheduler.step()
        out = {**res.private, **res.released}
        out.pop("loss_sum", None)
        out.pop("clipped", None)
        for m in self.methods:
            out.update(m.after_update(res, self.ctx))
        if self.causal:
            out["train_loss_per_token"] = res.private["loss_sum"] / max(1, int((self.train_lengths[idx] - 1).sum()))
        return out

    def logical_order(self, idx: torch.Tensor) -> torch.Tensor:
        """The order the step runs logical batch ``idx`` in (the order DDP shards it by)."""
        if self.user_level:
            return idx  # grouped by user by the sampler
        # Order the logical batch by length so micro-batches carry little padding; the set of
        # examples (all that privacy depends on) is unchanged.
        return idx[torch.argsort(self.train_lengths[idx], stable=True)] if len(idx) else idx

    def micro_batches(self, idx: torch.Tensor):
        """The physical micro-batches of logical batch ``idx`` (row indices in
        :meth:`logical_order`), as the step runs them: this rank's DDP share, at most
        ``batch.max_physical_batch_size`` rows each, collated on the device; at user level whole
        users per micro-batch, with their local user ids under ``GROUP_KEY`` for group clipping.
        A generator (one micro-batch in memory at a time); ``dpft audit`` walks it too."""
        r = self.recipe
        if self.user_level:
            # Micro-batches of whole users (grouped by the sampler); with group clipping each
            # carries its rows' local user ids, so a user's summed gradient is clipped as one.
            micros = self.sampler.micro_batches(idx, r.batch.max_physical_batch_size)
        else:
            mine = ddp.shard(idx, self.world)  # DDP: this rank's share of the world's logical batch
            micros = PoissonSampler.micro_batches(mine, r.batch.max_physical_batch_size)
        groups = self.user_level and r.task.user_clipping == "group"
        for micro in micros:
            batch = collate(list(self.train_tok.select(micro.tolist())), self.pad_id, self.with_token_types,
                            device=self.device)
            if groups:
                batch[GROUP_KEY] = self.sampler.groups(micro).to(self.device)
            yield batch

    def save_live_ledger(self) -> None:
        """Write the ledger to its live file (after every release; never shrinks it). Rank 0 only."""
        if not self.world.is_main:
            return
        self.live_ledger_path.parent.mkdir(parents=True, exist_ok=True)
        self.ledger.save(self.live_ledger_path)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "q": self.q, "n": self.n, "total_steps": self.total_steps,
                "recipe": json.loads(json.dumps(self.recipe.model_dump(mode="json"))),
                "elapsed": self.elapsed_before + (time.time() - self._t_run),
                "history": self.history.rows, "world_size": self.world.world_size, "replays": self.replays}

    def save(self, step: int) -> None:
        from dpft.run.checkpoint import save_checkpoint

        ddp.check_in_sync(self.world, self.params)  # DDP: the ranks still hold one set of weights
        self._last_checkpoint = step
        if not self.world.is_main:  # DDP: rank 0 alone writes the checkpoint
            return
        save_checkpoint(self.run_dir, step=step, params=self.params, optimizer=self.optimizer,
                        scheduler=self.scheduler, ledger_json=self.ledger.to_json(), state=self._state())

    def _comparable(self, d: dict) -> dict:
        d = json.loads(json.dumps(d))
        d.pop("output_dir", None)
        d.pop("perf", None)  # device/precision may change on resume: they never change the guarantee
        return d

    def load(self) -> None:
        from dpft.run.checkpoint import check_world_size, load_checkpoint

        live = self.live_ledger_path

        def read():  # DDP: rank 0 reads checkpoint and live ledger; every rank gets them
            ck = load_checkpoint(self.run_dir)
            ck["live_ledger"] = PrivacyLedger.load(live).to_json() if live.is_file() else None
            return ck

        ck = ddp.on_rank0(self.world, read)
        st = ck["state"]
        if self._comparable(st["recipe"]) != self._comparable(self.recipe.model_dump(mode="json")):
            raise TrainingError(
                f"--resume: the recipe differs from the one that wrote {self.run_dir}/checkpoint; "
                "resume with the same recipe and flags, or use a new --output-dir")
        problem = check_world_size(st, self.world.world_size, self.run_dir)
        if problem:
            raise TrainingError(problem)
        missing = set(self.params) - set(ck["params"])
        if missing:
            raise TrainingError(f"--resume: checkpoint lacks parameters {sorted(missing)[:3]}…")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(ck["params"][n])
        self.optimizer.load_state_dict(ck["optim"]["optimizer"])
        self.scheduler.load_state_dict(ck["optim"]["scheduler"])
        self.sigma = st["sigma"]
        ck_ledger = PrivacyLedger.from_json(ck["ledger"])
        # The live ledger holds every release ever made in this directory, including steps past
        # the checkpoint that the resumed run replays with fresh secret randomness (new
        # releases). It is continued, never replaced; the checkpoint's copy is a fallback.
        self.ledger = PrivacyLedger.from_json(ck["live_ledger"]) if ck["live_ledger"] is not None else ck_ledger
        if not ck_ledger.certified:
            self.ledger.mark_not_certified(ck_ledger.not_certified_reason or "run marked not certified")
        self.dp_step.ledger = self.ctx.ledger = self.ledger
        self.start_step = self._last_checkpoint = st["step"]
        self.replays = list(st.get("replays", []))
        # Releases past the checkpoint (a hard stop or crash after it): this run releases those
        # steps again, and the report says so (normally none: an interrupt checkpoints its step).
        extra = (sum(e.count for e in self.ledger.entries if e.phase == self.phase)
                 - sum(e.count for e in ck_ledger.entries if e.phase == self.phase))
        if extra > 0 and self.private:
            self.replays.append({"from_step": st["step"] + 1, "to_step": min(st["step"] + extra, self.total_steps),
                                 "releases": extra})
        self.history.rows = st.get("history", [])
        self.elapsed_before = st.get("elapsed", 0.0)

    # ------------------------------------------------------------------ the run
    def _emit(self, row: dict[str, Any]) -> None:
        """Released part of a row → history and metrics.jsonl; private part → diagnostics only."""
        released, private = split_row(row)
        self.history.rows.append(released)
        if not self.world.is_main:  # DDP: rank 0 alone writes
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(released) + "\n")
        if getattr(self, "trackers", None) is not None:
            self.trackers.log(released)
        if self.diagnostics is not None:
            self.diagnostics.write(private)

    def epsilon_now(self) -> Optional[float]:
        for m in self.methods:  # a method with its own guarantee (e.g. a forward-pass mechanism)
            eps = m.epsilon(self.ctx)
            if eps is not None:
                return eps
        if not self.private or not self.ledger.certified:
            return None
        return self.ledger.epsilon(self.recipe.privacy.delta).epsilon

    def run(self) -> dict[str, Any]:
        """Train to ``total_steps`` (from the checkpoint with ``resume``); write the report."""
        from dpft.report.report import write_report

        r = self.recipe
        if r.eval.save_predictions and self.world.distributed:  # refused before training, not after
            raise TrainingError("eval.save_predictions is not supported with DDP yet; run on one process")
        main = self.world.is_main  # DDP: rank 0 alone reads and writes the run directory
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._t_run = time.time()
        if self.resume:
            self.load()
            # metrics.jsonl may hold rows past the checkpoint: rewrite it from the checkpoint.
            if main:
                atomic_write_text(self.run_dir / "metrics.jsonl",
                                  "".join(json.dumps(x) + "\n" for x in self.history.rows))
        else:
            if ddp.on_rank0(self.world, lambda: (self.run_dir / "checkpoint").exists()):
                raise TrainingError(f"{self.run_dir} already holds a run; pass --resume to continue it "
                                    "or choose another --output-dir (nothing was overwritten)")
            if main:
                atomic_write_text(self.run_dir / "metrics.jsonl", "")
        if main:
            atomic_write_text(self.run_dir / "recipe.yaml", dump_recipe(r))
        self.diagnostics = DiagnosticsLog(self.run_dir) if r.log.private_diagnostics and main else None
        if r.log.report_to and main:  # log.report_to: released quantities only (run/tracking.py)
            from dpft.run.tracking import Trackers, public_config

            self.trackers = Trackers(r.log.report_to, self.run_dir, r.name, public_config(r))
        if self.private or self.ledger.entries:
            self.save_live_ledger()  # phases spent before training (stage 1, synthetic data)
        bar = tqdm(total=self.total_steps, initial=self.start_step, desc=r.name, disable=not self.progress,
                   dynamic_ncols=True, file=sys.stderr)
        last_eval: dict[str, float] = {}
        # SIGINT/SIGTERM (run/interrupt.py): finish or abandon the step in flight, checkpoint at
        # the last release, raise TrainingInterrupted; a resume then replays nothing.
        stop = StopOnSignal(self._can_abandon, lambda m: tqdm.write(m, file=sys.stderr))
        done, abandoned, hard, in_flight = self.start_step, False, False, False
        self._hook_optimizer()
        with stop:
            try:
                for step in range(self.start_step, self.total_steps):
                    if self._stop_requested(stop):
                        break
                    self._step_mark = (step, self.ledger.steps)
                    self._updating = False
                    out = self.step(step)
                    self._step_mark = None
                    done = step + 1
                    row: dict[str, Any] = {"step": done, **out, "lr": self.scheduler.get_last_lr()[0]}
                    if done == self.total_steps or (done % r.eval.every_steps == 0 and not stop.requested):
                        last_eval = self.evaluate()
                        row.update(last_eval)
                        row["epsilon"] = self.epsilon_now() if self.world.is_main else None  # DDP: rank 0 reports ε
                    self._emit(row)
                    post = {}  # released quantities only: no train loss or batch size on the screen either
                    if last_eval and "dev_accuracy" in last_eval:
                        post["dev_acc"] = f"{last_eval['dev_accuracy']:.3f}"
                    if self.private and row.get("epsilon") is not None:
                        post["ε"] = f"{row['epsilon']:.3g}"
                    bar.set_postfix(post)
                    bar.update(1)
                    if done % r.checkpoint_every == 0 or done == self.total_steps or stop.requested:
                        self.save(done)
            except _Abandon:
                abandoned = True  # nothing of step `done` was released and no weight changed
            except _HardStop:  # no checkpoint: the weights may be half updated
                hard = True
                in_flight = self._step_mark is not None and self.ledger.steps > self._step_mark[1]
            finally:
                self._step_mark = None
            if stop.requested and (done < self.total_steps or abandoned or hard):
                if not hard and self._last_checkpoint != done:
                    self.save(done)  # the last release is in this checkpoint: a resume replays nothing
                if self.private or self.ledger.entries:
                    self.save_live_ledger()
                bar.close()
                raise TrainingInterrupted(stop.signum, done, self._last_checkpoint, self.total_steps, self.run_dir,
                                          abandoned=abandoned, hard=hard, released=done + int(in_flight))
        bar.close()
        if self.private or self.ledger.entries:
            self.save_live_ledger()
        if not last_eval:
            last_eval = self.evaluate()

        def finish() -> dict[str, Any]:  # DDP: rank 0 alone; every rank returns its report
            if self.causal and r.eval.prompts:
                from dpft.eval.lm import sample_generations

                e = r.eval
                with contextlib.ExitStack() as stack:  # a method's weights of record (e.g. the EMA)
                    for m in self.methods:
                        stack.enter_context(m.weights())
                    self.samples = sample_generations(self.model, self.tokenizer, e.prompts, e.max_new_tokens,
                                                      seed=r.seed)
            if getattr(self.task, "groups", None) and r.eval.generate:  # instruct: BLEU/ROUGE-L on dev prompts
                from dpft.eval.generate import generation_eval

                e = r.eval
                with contextlib.ExitStack() as stack:
                    for m in self.methods:
                        stack.enter_context(m.weights())
                    self.generation = generation_eval(self.model, self.tokenizer, self.task.groups, e.max_new_tokens,
                                                      e.num_beams, e.batch_size, e.max_generate_prompts,
                                                      e.num_samples)
                last_eval.update(self.generation["metrics"])
            elapsed = self.elapsed_before + (time.time() - self._t_run)
            self.save_model()
            from dpft.run.predict import evaluate_test_file

            self.test_metrics = evaluate_test_file(self)  # task.test_file: once, after the last step
            if r.eval.save_predictions and getattr(self, "dev_predictions", None):
                from dpft.eval.paired import write_predictions

                write_predictions(self.run_dir / "dev_predictions.jsonl", self.dev_predictions)
            rep = write_report(self, last_eval, elapsed)
            from dpft.run.outputs import after_report

            after_report(self, rep)  # model card from the written report
            return rep

        return ddp.on_rank0(self.world, finish)

    # ------------------------------------------------------------------ interrupts (run/interrupt.py)
    def _hook_optimizer(self) -> None:
        """Mark the start of each optimizer update (a step is not abandoned once it has begun)."""
        self._step_mark: Optional[tuple[int, int]] = None
        self._updating = False
        if not getattr(self, "_update_hooked", False) and hasattr(self.optimizer, "register_step_pre_hook"):
            self.optimizer.register_step_pre_hook(lambda *a: setattr(self, "_updating", True))
            self._update_hooked = True

    def _can_abandon(self) -> bool:
        """True while the step in flight has released nothing and not begun its update (one
        process only: under DDP every rank must finish the step the others are in)."""
        mark = self._step_mark
        return (mark is not None and not self.world.distributed and self.ledger.steps == mark[1]
                and not self._updating and getattr(self, "_update_hooked", False))

    def _stop_requested(self, stop: StopOnSignal) -> bool:
        """Whether to stop before the next step; under DDP, whether any rank was signalled (all
        ranks stop at the same step)."""
        if not self.world.distributed:
            return stop.requested
        return ddp.all_sum(self.world, [float(stop.requested)])[0] > 0

    def save_model(self) -> None:
        """The model and tokenizer in ``model/`` as ``AutoModelFor…``/``pipeline`` load them, with
        ``id2label`` (LoRA: the adapter; ``model_merged/`` on request) — run/outputs.py."""
        from dpft.run.outputs import save_run_model

        save_run_model(self)
        for m in self.methods:  # e.g. EMA weights beside the raw ones
            m.finish(self.ctx)
