"""The DP training loop: Poisson sampling → per-example engine → clip → noise → post-process
→ optimizer, one ledger event per logical step, evaluation, checkpoints and resume.

Methods (``methods/``) customise a run through the hooks of :class:`Trainer` (trainable
selection, engine, transforms, extra ledger phases) — they never copy the loop.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from dpft.accounting.io import atomic_write_text
from dpft.accounting.ledger import PrivacyLedger
from dpft.config.recipe import Recipe, dump_recipe
from dpft.data.tokenize import collate
from dpft.methods.base import register_phase_runner
from dpft.grads.groups import GROUP_KEY
from dpft.privacy.randomness import Randomness
from dpft.placement import world as ddp
from dpft.placement import fsdp
from dpft.run.interrupt import StopOnSignal, TrainingInterrupted, _Abandon, _HardStop  # noqa: F401 (re-exported)
from dpft.run.checkpoint import cap_resumed_run, check_world_size, load_checkpoint, release_checkpoints, save_checkpoint
from dpft.run.plan import build_plan
from dpft.run.session_args import evaluate_with_methods
from dpft.outputs.release import DiagnosticsLog, split_row
from dpft.session import PrivateSession
from dpft.step.clip import NonFiniteGradientError
from dpft.step.postprocess import Transform  # noqa: F401 (Transform: public type)
from dpft.step.sample import PoissonSampler
from dpft.run.errors import TrainingError  # noqa: F401  (public here since issue 1)
from dpft.eval.generate import generation_eval
from dpft.eval.lm import sample_generations
from dpft.eval.paired import write_predictions
from dpft.placement.fsdp import gathered, materialise
from dpft.placement.fsdp_checkpoint import load_checkpoint as load_sharded, save_checkpoint as save_sharded
from dpft.outputs.report import write_report
from dpft.outputs.model import after_report, save_run_model
from dpft.run.predict import evaluate_test_file
from dpft.run.tracking import Trackers, public_config
from dpft.step.correlated import load_noise_state, write_noise_state
from dpft.step.truncated import fixed_micro_batches, fixed_shape_batches


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
                 phase: str = "train", live_ledger_path: Optional[str | Path] = None,
                 on_step: Optional[Callable[[int, dict], None]] = None, allow_overspend: bool = False,
                 extra_rows: Optional[Callable] = None,  # run/plan.py build_plan's hook (audit canaries)
                 features=None):  # a FeatureCache to reuse (run/features.py; tune trials)
        t0 = time.time()
        #: A resumed run may end above the target ε (issue 36: by default it stops within it).
        self.allow_overspend = allow_overspend
        #: The resume's budget (run/checkpoint.py ``cap_resumed_run``), for the report; None: not resumed.
        self.resume_cap: Optional[dict] = None
        #: Called as ``on_step(done, params)`` after each completed step (a method's phase hook).
        self.on_step = on_step
        #: Everything the run is, resolved once before the loop (run/plan.py).
        self.plan = p = build_plan(recipe, run_dir, resume=resume, transforms=transforms, progress=progress,
                                   ledger=ledger, rng=rng, phase=phase, live_ledger_path=live_ledger_path,
                                   train_phase=train_phase, extra_rows=extra_rows, features=features)
        self.recipe, self.run_dir, self.resume, self.phase = recipe, p.run_dir, resume, p.phase
        self.world, self.rng, self.progress, self.private = p.world, p.rng, p.progress, p.private
        #: The ledger is appended to, never replaced (run/checkpoint.py ``continue_ledger``).
        self.ledger, self.ledger_notes, self.live_ledger_path = p.ledger, list(p.ledger_notes), p.live_ledger_path
        self.device, self.precision = p.placement.device, p.placement.precision
        d = p.data
        self.task, self.tokenizer, self.dev_tok, self.causal = d.task, p.ctx.tokenizer, d.dev_tok, d.causal
        self.pad_id, self.with_token_types, self.train_lengths = d.pad_id, d.with_token_types, d.train_lengths
        self.model, self.loss_fn, self.train_tok = p.model, p.loss_fn, p.train_tok
        u = p.unit
        self.sampler, self.n, self.q, self.user_level, self.privacy_unit = u.sampler, u.n, u.q, u.user_level, u.info
        self.total_steps, self.sigma = p.total_steps, p.sigma
        #: The recipe's methods (methods/base.py), composed in order; the driver names none.
        self.methods, self.ctx = p.methods, p.ctx
        self.params, self.optimizer, self.scheduler = p.params, p.optimizer, p.scheduler
        # the session's step for this world (session/step.py); FSDP2: a rank short of micro-batches runs a
        # placeholder one
        self.dp_step = p.session.step(p.privacy, sharded=p.sharded, on_release=self.save_live_ledger,
                                      dummy_batch=lambda: collate(
                                          list(self.train_tok.select(range(min(2, len(self.train_tok))))),
                                          self.pad_id, self.with_token_types, device=self.device))
        #: Checkpoint at every release (config ``checkpoint_every_release``): cheap when the trainable
        #: part is small, and a crash then leaves nothing to replay (issue 36 item 3).
        self.release_checkpoints = release_checkpoints(recipe, self.private, p.sharded, self.params)
        self.start_step = 0
        #: Step of the last checkpoint written or resumed from (None: none yet).
        self._last_checkpoint: Optional[int] = None
        #: Releases made again after a resume: ``[{"from_step", "to_step", "releases"}]`` (report).
        self.replays: list[dict[str, int]] = []
        self.diagnostics: Optional[DiagnosticsLog] = None
        self.history = History()
        self.elapsed_before = 0.0
        self.setup_seconds = time.time() - t0

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

    @property
    def _stateful(self) -> bool:
        """The mechanism carries secret state beyond the key (banded_mf's noise buffers)."""
        return self.mechanism is not None and self.mechanism.stateful

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Dev accuracy and mean loss (nats); no gradients, model in eval mode. ``text`` task:
        dev loss (nats/token) and perplexity. A method may replace it (e.g. an EMA's weights)."""
        return evaluate_with_methods(self.methods, self.ctx, self._evaluate_model)

    @torch.no_grad()
    def _evaluate_model(self) -> dict[str, float]:
        if self.plan.sharded:  # FSDP: parameters gathered, so ranks may run different numbers of batches

            with gathered(self.model):
                return self.plan.evaluator(self.model)
        return self.plan.evaluator(self.model)

    @property
    def dev_predictions(self) -> Optional[list[dict]]:
        """The latest dev evaluation's predictions (``eval.save_predictions``), else None."""
        return self.plan.evaluator.dev_predictions

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        """One logical step through :class:`~dpft.step.DPStep`. Returns the row's fields (the
        private ones are split off by outputs/release.py before anything is written)."""
        torch.manual_seed(ddp.dropout_seed(self.rng, step, self.world))  # dropout masks: per step (and rank), secret
        idx = self.dp_step.indices(step)
        for m in self.methods:
            m.before_step(step, self.ctx)
        self.model.train()
        if self.plan.prefix is not None:  # the frozen prefix: eval mode (no dropout), cached or not
            self.plan.prefix.eval_prefix()
        idx = self.logical_order(idx)
        micro_batches = self.micro_batches(idx)
        try:
            res = self.dp_step.run(step, micro_batches)
            # DDP: same batch and noise, every step (FSDP: the ranks hold different shards: the batch only)
            ddp.check_step_digest(self.world, step, idx, {} if self.plan.sharded else self.params)
        except NonFiniteGradientError as exc:
            raise TrainingError(f"step {step}: {exc}. The last checkpoint in {self.run_dir} is intact; "
                                "fix the recipe and --resume") from None
        self.scheduler.step()
        out = {**res.private, **res.released}
        out.pop("loss_sum", None)
        out.pop("clipped", None)
        for m in self.methods:
            out.update(m.after_update(res, self.ctx))
        if self.causal and self.plan.data.seq2seq:  # every target token is predicted (data/seq2seq.py)
            if getattr(self, "_target_lengths", None) is None:
                self._target_lengths = torch.tensor([len(x) for x in self.train_tok["target_ids"]])
            out["train_loss_per_token"] = res.private["loss_sum"] / max(1, int(self._target_lengths[idx].sum()))
        elif self.causal:
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
            # DDP: this rank's share is whole users (every K-th user of the logical batch), so a
            # user's rows are clipped together on one rank.
            mine = ddp.shard_units(idx, self.sampler.users[idx], self.world)
            micros = self.sampler.micro_batches(mine, r.batch.max_physical_batch_size)
        else:
            mine = ddp.shard(idx, self.world)  # DDP: this rank's share of the world's logical batch
            micros = PoissonSampler.micro_batches(mine, r.batch.max_physical_batch_size)
        groups = self.user_level and r.task.user_clipping == "group"
        if getattr(self.sampler, "max_batch_size", None) is not None:  # truncated Poisson: fixed shapes

            yield from fixed_shape_batches(fixed_micro_batches(ddp.shard(idx, self.world),
                                                               r.batch.max_physical_batch_size),
                                           self.train_tok, self.pad_id, self.with_token_types, r.model.max_length,
                                           self.device, collate=collate)
            return
        feats = self.plan.features.store.train if self.plan.features is not None else None
        for micro in micros:
            if feats is not None:  # frozen features computed once (run/features.py)
                batch = feats.batch(micro, self.device)
            else:
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
        if self.plan.sharded:  # FSDP: gathered weights and optimizer state, written by rank 0
            return save_sharded(self, step, save_checkpoint)
        ddp.check_in_sync(self.world, self.params)  # DDP: the ranks still hold one set of weights
        self._last_checkpoint = step
        if not self.world.is_main:  # DDP: rank 0 alone writes the checkpoint
            return
        save_checkpoint(self.run_dir, step=step, params=self.params, optimizer=self.optimizer,
                        scheduler=self.scheduler, ledger_json=self.ledger.to_json(), state=self._state())
        if self._stateful:  # banded_mf: secret noise state (the session's one format), outside the release set
            write_noise_state(self.run_dir, PrivateSession.secret_state(self.dp_step, at=step))

    def _comparable(self, d: dict) -> dict:
        d = json.loads(json.dumps(d))
        d.pop("output_dir", None)
        d.pop("perf", None)  # device/precision may change on resume: they never change the guarantee
        return d

    def load(self) -> None:
        live = self.live_ledger_path

        def read():  # DDP: rank 0 reads checkpoint and live ledger; every rank gets them
            ck = load_checkpoint(self.run_dir)
            ck["live_ledger"] = PrivacyLedger.load(live).to_json() if live.is_file() else None
            if self._stateful:  # banded_mf: the secret noise buffers (or refuse)

                try:
                    ck["noise_state"] = load_noise_state(self.run_dir)
                except FileNotFoundError as exc:
                    raise TrainingError(str(exc)) from None
            return ck

        ck = ddp.on_rank0(self.world, read)
        st = ck["state"]
        if self._comparable(st["recipe"]) != self._comparable(self.recipe.model_dump(mode="json")):
            raise TrainingError(
                f"--resume: the recipe differs from the one that wrote {self.run_dir}/checkpoint; "
                "resume with the same recipe and flags, or use a new --output-dir")
        # FSDP resumes on any number of ranks (per-rank DCP shards, resharded; fsdp_state.py checks the names)
        problem = None if self.plan.sharded else check_world_size(st, self.world.world_size, self.run_dir)
        if problem:
            raise TrainingError(problem)
        missing = set() if self.plan.sharded else set(self.params) - set(ck["params"])
        if missing:
            raise TrainingError(f"--resume: checkpoint lacks parameters {sorted(missing)[:3]}…")
        if self.plan.sharded:  # FSDP: each rank loads its shards (dpft/placement/fsdp_checkpoint.py)
            load_sharded(self, ck)
        else:
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
        if self._stateful:  # the session's one restore path (refuses replays, another step, other rows)
            try:
                PrivateSession.restore_secret_state(self.dp_step, ck.get("noise_state"), "--resume", at=st["step"],
                                                    replayed=extra, fresh="--output-dir")
            except ValueError as exc:
                raise TrainingError(str(exc)) from None
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
        """Train to ``total_steps`` (from the checkpoint with ``resume``); write the report. Cached
        features this run built are removed at the end, however it ends (unless kept)."""
        try:
            return self._run()
        finally:
            if self.plan.features is not None:
                self.plan.features.close()

    def _run(self) -> dict[str, Any]:
        r = self.recipe
        if r.eval.save_predictions and self.world.distributed:  # refused before training, not after
            raise TrainingError("eval.save_predictions is not supported with DDP yet; run on one process")
        main = self.world.is_main  # DDP: rank 0 alone reads and writes the run directory
        if main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._t_run = time.time()
        if self.resume:
            self.load()

            # The target ε is a hard cap across crashes: said before the first step (issue 36).
            self.resume_cap = cap_resumed_run(self, self.allow_overspend, lambda m: tqdm.write(m, file=sys.stderr))
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
                    # DDP: one stop decision for the world before the eval/checkpoint decisions
                    # (both collective): a signal reaching one rank first must not make it
                    # checkpoint while the others go on (a collective mismatch).
                    stopping = self._stop_requested(stop)
                    if self.on_step is not None:
                        self.on_step(done, self.params)
                    row: dict[str, Any] = {"step": done, **out, "lr": self.scheduler.get_last_lr()[0]}
                    if done == self.total_steps or (done % r.eval.every_steps == 0 and not stopping):
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
                    if (done % r.checkpoint_every == 0 or done == self.total_steps or stopping
                            or self.release_checkpoints):
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
                e = r.eval
                with contextlib.ExitStack() as stack:  # a method's weights of record (e.g. the EMA)
                    for m in self.methods:
                        stack.enter_context(m.weights())
                    self.samples = sample_generations(self.model, self.tokenizer, e.prompts, e.max_new_tokens,
                                                      seed=r.seed)
            if getattr(self.task, "groups", None) and r.eval.generate:  # instruct: BLEU/ROUGE-L on dev prompts

                e = r.eval
                with contextlib.ExitStack() as stack:
                    for m in self.methods:
                        stack.enter_context(m.weights())
                    self.generation = generation_eval(self.model, self.tokenizer, self.task.groups, e.max_new_tokens,
                                                      e.num_beams, e.batch_size, e.max_generate_prompts,
                                                      e.num_samples, stop_ids=getattr(self.task, "stop_ids", None))
                last_eval.update(self.generation["metrics"])
            elapsed = self.elapsed_before + (time.time() - self._t_run)
            self.save_model()

            self.test_metrics = evaluate_test_file(self)  # task.test_file: once, after the last step
            if r.eval.save_predictions and getattr(self, "dev_predictions", None):
                write_predictions(self.run_dir / "dev_predictions.jsonl", self.dev_predictions)
            rep = write_report(self, last_eval, elapsed)

            after_report(self, rep)  # model card from the written report
            return rep

        if self.plan.sharded:  # FSDP: rank 0 alone saves and generates, on a plain copy of the weights; the
            # other ranks join each tensor's gather and drop it (they keep their shards: no full copy)
            self.model = self.ctx.model = materialise(self.model, keep=self.world.is_main)
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
        ranks stop at the same step). A rank not signalled itself takes the world's signal
        (``stop.signum``), so it too checkpoints and raises :class:`TrainingInterrupted`."""
        if not self.world.distributed:
            return stop.requested
        sig = ddp.all_max(self.world, stop.signum or 0)
        if sig and stop.signum is None:
            stop.signum = sig
        return bool(sig)

    def save_model(self) -> None:
        """The model and tokenizer in ``model/`` as ``AutoModelFor…``/``pipeline`` load them, with
        ``id2label`` (LoRA: the adapter; ``model_merged/`` on request) — outputs/model.py."""
        save_run_model(self)
        for m in self.methods:  # e.g. EMA weights beside the raw ones
            m.finish(self.ctx)


def train_phase(recipe: Recipe, run_dir: str | Path, *, phase: str = "train", ledger: Optional[PrivacyLedger] = None,
                rng: Optional[Randomness] = None, live_ledger_path: Optional[str | Path] = None,
                on_step: Optional[Callable[[int, dict], None]] = None, progress: bool = True) -> Trainer:
    """The driver's phase runner (methods/base.py ``PhaseRunner``): a method's training phase as a
    :class:`Trainer` in ``run_dir``, appending to ``ledger`` under ``phase`` (a fresh ledger when
    None). Methods get it as ``run.train_phase`` or :func:`dpft.methods.base.phase_runner`."""
    return Trainer(recipe, run_dir, progress=progress, ledger=ledger, rng=rng, phase=phase,
                   live_ledger_path=live_ledger_path, on_step=on_step)


register_phase_runner(train_phase)
