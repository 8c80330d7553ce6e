"""The ledger, ``dp_state.json``, checkpoints and resume of :class:`~dpft.integrations.hf.trainer.DPTrainer`
(a mixin): the live ledger after every release, the secret noise state of a stateful mechanism
outside ``checkpoint-*`` (FSDP2: gathered from every rank's shard slices, as make_private's,
api/state.py), and a resume that continues the ledger and refuses what would replay
releases, other settings or other rows (the session's one secret-state path, session/core.py)."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import asdict
from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from dpft.placement import world as ddp
from dpft.accounting.io import atomic_write_text
from dpft.accounting.cap import ledger_resume_cap
from dpft.accounting.ledger import PrivacyLedger
from dpft.integrations.hf.card import write_trainer_card
from dpft.integrations.hf.checks import refuse as _refuse
from dpft.integrations.hf.fsdp import (full_model_state, full_optimizer_state, is_fsdp2_model, load_full_checkpoint,
                                       load_full_optimizer)
from dpft.outputs.lock import RunLock
from dpft.outputs.report import plan_section
from dpft.session import PrivateSession
from dpft.step.correlated import load_noise_state, write_noise_state

__all__ = ["PrivateState", "CapStop", "LEDGER_NAME", "DP_STATE_NAME"]

#: The privacy ledger's file name, in ``output_dir`` and in every checkpoint.
LEDGER_NAME = "ledger.json"
#: σ, q, N, steps and the privacy settings of a run, in every checkpoint (resume checks them).
DP_STATE_NAME = "dp_state.json"
#: ``Trainer`` log keys that are private statistics (un-noised loss) or noise-dominated noise.
_LOSS_KEYS = ("loss", "train_loss")
#: How DPTrainer names its resume option and what to start anew (the CLI's messages' words).
_RESUME_WORDS = ("resume_from_checkpoint", "output_dir")


class CapStop(TrainerCallback):
    """Stops a resumed run at the step its ε cap allows (``trainer._stop_at``; None: no cap)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        stop = getattr(self.trainer, "_stop_at", None)
        if stop is not None and state.global_step >= stop:
            control.should_training_stop = True


class PrivateState:
    """Mixin of :class:`~dpft.integrations.hf.trainer.DPTrainer`: ε, files, checkpoints, train and resume."""

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε at ``delta`` (default ``target_delta``) of everything in the ledger (PLD accountant)."""
        return float(self.ledger.epsilon(self.dp_args.target_delta if delta is None else delta).epsilon)

    def dp_state(self) -> dict[str, Any]:
        """The run's privacy settings and spend (``dp_state.json``; never the seed), with the privacy
        plan as a value under ``plan`` (outputs/report.py ``plan_section``, as ``dpft train``'s report.json)."""
        dp = asdict(self.dp_args)
        dp["reproducible"] = dp.pop("reproducible_seed") is not None
        unit = "user" if self.user_level else "example"
        return {"sigma": self.sigma, "q": self.q, "n": self.n, "total_steps": self.total_steps,
                "global_step": int(self.state.global_step), "ledger_steps": self.ledger.steps,
                "epsilon": self.get_epsilon() if self.ledger.certified else None,
                "accountant": f"PLD (dp-accounting), add/remove-one {unit}", "unit": unit,
                "world_size": self.world.world_size, "dp_args": dp, **plan_section(self.plan)}

    def _write_dp_files(self, directory: str) -> None:
        if not self.is_world_process_zero():
            return
        os.makedirs(directory, exist_ok=True)
        self.ledger.save(os.path.join(directory, LEDGER_NAME))
        atomic_write_text(os.path.join(directory, DP_STATE_NAME), json.dumps(self.dp_state(), indent=1))

    def _save_live_ledger(self) -> None:
        """``output_dir/ledger.json`` after every release (rank 0; never shrinks)."""
        if not self.is_world_process_zero():
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.ledger.save(os.path.join(self.args.output_dir, LEDGER_NAME))
        self._live_written = True

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` plus ``ledger.json``, ``dp_state.json`` and dpft's model card
        (``README.md``, over PEFT's template for an adapter) — checkpoints too. An FSDP2 model is
        gathered first (every rank calls this: a collective) and rank 0 writes the full weights with
        ``save_pretrained`` (PEFT: the adapter), the files ``from_pretrained`` loads; no ``DTensor``."""
        directory = output_dir if output_dir is not None else self.args.output_dir
        self.check_releases("save_model and its model card")  # weights moved outside the DP step: nothing
        if is_fsdp2_model(self.model):
            state = full_model_state(self.model)  # rank 0: full CPU tensors; the other ranks: {}
            if self.args.should_save:
                self._save(directory, state_dict=state)
        else:
            super().save_model(output_dir, _internal_call)
        self._write_dp_files(directory)
        if self.is_world_process_zero():
            write_trainer_card(self, directory)

    def create_model_card(self, *args, **kwargs) -> None:
        """dpft's card in ``output_dir/README.md`` instead of ``Trainer``'s (``push_to_hub`` calls
        this before uploading, so the pushed card states the guarantee)."""
        self.check_releases("the model card")
        if self.is_world_process_zero():
            write_trainer_card(self, self.args.output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint`` (every rank calls it), after checking that the ranks still
        hold one set of trainable weights (rank 0's are broadcast if not: they are the ones saved)."""
        if not is_fsdp2_model(self.model):  # FSDP2: each rank holds its own shard, one weight for the world
            ddp.check_in_sync(self.world, self.dp_step.params)  # what the step updates (DP-SFT: not the k coordinates)
        super()._save_checkpoint(model, trial)
        if self._banded:
            # banded_mf: the secret noise buffers and partition (the session's one versioned format),
            # owner-only, outside checkpoint-*/ (the release set): output_dir/noise_state.secret.pt, at
            # this checkpoint's step. FSDP2: each rank holds its shards' slices; the session's
            # secret_state gathers them (a collective, every rank), so rank 0 writes the file one
            # process writes (api/state.py).
            if self.world.is_main or self.sharded:
                state = PrivateSession.secret_state(self.dp_step, at=int(self.state.global_step))
                if self.world.is_main:
                    write_noise_state(self.args.output_dir, state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``Trainer``'s, with an FSDP2 model's optimizer state gathered (every rank: a collective) and
        written by rank 0 as full tensors keyed by parameter name (not rank 0's DTensor shards)."""
        if not is_fsdp2_model(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        import torch
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds torch's
        state = full_optimizer_state(self.model, opt)
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """``Trainer``'s loader; an FSDP2 model loads the checkpoint's full weights and keeps its shards
        (hf_fsdp.py ``load_full_checkpoint``: rank 0 alone reads it, broadcast one tensor at a time)."""
        if not is_fsdp2_model(self.model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_full_checkpoint(self.model, resume_from_checkpoint, super()._load_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """``Trainer``'s; an FSDP2 model's optimizer shards are set from the full state in the checkpoint."""
        if checkpoint is None or not is_fsdp2_model(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch
        from transformers.trainer import SCHEDULER_NAME

        load_full_optimizer(self.model, getattr(self.optimizer, "optimizer", self.optimizer), checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _save_rng_state(self, output_dir: str) -> None:
        """``Trainer._save_rng_state`` on rank 0 only: rank 0 alone writes the run's files (the
        dropout masks are reseeded at every step from the secret stream, whatever this state)."""
        if self.world.is_main:
            super()._save_rng_state(output_dir)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """``Trainer.log`` with ``epsilon`` added and the un-noised loss and ``grad_norm`` removed."""
        logs = dict(logs)
        if not self.dp_args.log_private_train_loss:
            for k in _LOSS_KEYS:
                logs.pop(k, None)
        logs.pop("grad_norm", None)
        if self.ledger.certified:
            logs["epsilon"] = self.get_epsilon()
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ train / resume
    def train(self, resume_from_checkpoint: Optional[str | bool] = None, trial=None,
              ignore_keys_for_eval: Optional[list[str]] = None, **kwargs) -> TrainOutput:
        """``Trainer.train`` with the ledger continued on resume. The returned ``training_loss``
        is NaN unless ``log_private_train_loss`` (the un-noised loss is private)."""
        if trial is not None:
            _refuse("hyperparameter search trains on the private data once per trial, and the trials' "
                    "releases compose; it is not supported")
        # One process owns output_dir (outputs/lock.py; under torchrun / accelerate rank 0 holds it).
        lock = RunLock.for_dir(self.args.output_dir, fix="wait for that run to finish, stop it (kill PID), or "
                               "give this trainer another output_dir") if self.world.is_main else None
        if lock is not None:
            lock.acquire()
        try:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is None:
                    raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            if resume_from_checkpoint:
                self._resume_dp_state(str(resume_from_checkpoint))
            else:
                if self._banded and self.mechanism.next_step > 0:
                    _refuse(f"banded_mf: this DPTrainer already released {self.mechanism.next_step} correlated steps; "
                            "a new train() would restart at step 0 against its noise buffers. Make a new DPTrainer "
                            "(its ledger composes), or resume_from_checkpoint")
                self._check_fresh_output_dir()
            out = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=None,
                                ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            self._save_live_ledger()
        finally:
            if lock is not None:
                lock.release(remove=True)  # the folder keeps only the run's files
        if not self.dp_args.log_private_train_loss:
            metrics = {k: v for k, v in out.metrics.items() if k not in _LOSS_KEYS}
            out = TrainOutput(out.global_step, float("nan"), metrics)
        return out

    def hyperparameter_search(self, *args, **kwargs):
        _refuse("hyperparameter search trains on the private data once per trial, and the trials' releases "
                "compose; it is not supported")

    def _check_fresh_output_dir(self) -> None:
        live = os.path.join(self.args.output_dir, LEDGER_NAME)
        # DDP: rank 0 reads the output directory; every rank gets its answer (and raises alike).
        if ddp.on_rank0(self.world, lambda: os.path.isfile(live)) and not self._live_written:
            _refuse(f"{live} holds the privacy ledger of an earlier run in this output_dir. Pass "
                    "train(resume_from_checkpoint=True) to continue that run (its releases stay in the ledger), "
                    "or choose a new output_dir. Nothing was overwritten")
        if self.ledger.steps and any(e.phase == "train" for e in self.ledger.entries):
            warnings.warn(f"this DPTrainer already released {self.ledger.steps} noisy steps; a new train() adds "
                          "its releases to the same ledger, so ε will exceed the target it was calibrated for",
                          stacklevel=3)

    def _resume_dp_state(self, ckpt: str) -> None:
        live = os.path.join(self.args.output_dir, LEDGER_NAME)

        def read() -> dict:  # DDP: rank 0 reads the checkpoint and the live ledger; every rank gets them
            path = os.path.join(ckpt, DP_STATE_NAME)
            if not os.path.isfile(path) or not os.path.isfile(os.path.join(ckpt, LEDGER_NAME)):
                _refuse(f"{ckpt} holds no {DP_STATE_NAME}/{LEDGER_NAME}: it was not written by DPTrainer, so what "
                        "it released is unknown; start from the model weights with a new DPTrainer instead")
            with open(path) as f:
                st = json.load(f)
            ck = PrivacyLedger.load(os.path.join(ckpt, LEDGER_NAME)).to_json()
            lv = PrivacyLedger.load(live).to_json() if os.path.isfile(live) else None
            noise = None
            if self._banded:  # banded_mf: the secret noise state, or refuse (the CLI's reader)
                try:
                    noise = load_noise_state(self.args.output_dir, *_RESUME_WORDS)
                except FileNotFoundError as exc:
                    _refuse(str(exc))
            return {"state": st, "ledger": ck, "live": lv, "noise": noise}

        got = ddp.on_rank0(self.world, read)
        st = got["state"]
        was, now = int(st.get("world_size", 1)), self.world.world_size
        if was != now:
            how = ("in one process (python script.py)" if was == 1 else
                   f"with {was} processes (torchrun --nproc_per_node={was} script.py, or accelerate launch "
                   f"--num_processes {was} script.py)")
            _refuse(f"resume_from_checkpoint: {ckpt} was written by {was} process(es) but this run has {now}; "
                    f"each rank's share of a logical batch, its dropout stream and the order of the all-reduced sums "
                    f"depend on the world size. Resume it {how}, or start a new output_dir")
        ours = self.dp_state()
        diff = [k for k in ("n", "q", "total_steps") if st.get(k) != ours[k]]
        if not math.isclose(float(st.get("sigma", -1)), self.sigma, rel_tol=1e-9, abs_tol=1e-12):
            diff.append("sigma")
        for k in ("max_grad_norm", "clipping", "target_delta", "expected_batch_size"):
            if st.get("dp_args", {}).get(k) != ours["dp_args"][k]:
                diff.append(f"dp_args.{k}")
        for k, default in (("user_column", None), ("max_rows_per_user", 4), ("user_clipping", "group"),
                           ("max_batch_size", None), ("mechanism", "gaussian"), ("bands", None)):
            if st.get("dp_args", {}).get(k, default) != ours["dp_args"][k]:
                diff.append(f"dp_args.{k}")
        if diff:
            _refuse(f"resume_from_checkpoint: {ckpt} was written with other privacy settings ({', '.join(diff)} "
                    "differ); resume with the same DPArguments, max_steps / num_train_epochs and train_dataset, "
                    "or start a new output_dir")
        ck_ledger = PrivacyLedger.from_json(got["ledger"])
        ledger = ck_ledger
        if got["live"] is not None:
            live_ledger = PrivacyLedger.from_json(got["live"])
            # The live ledger holds every release made in this directory, including the steps after
            # the checkpoint that the resumed run replays (with fresh randomness: new releases).
            if live_ledger.steps >= ck_ledger.steps:
                ledger = live_ledger
        if not ck_ledger.certified:
            ledger.mark_not_certified(ck_ledger.not_certified_reason or "run marked not certified")
        if self._banded:
            self._resume_noise_state(got["noise"], int(st.get("global_step", -1)), ledger.steps - ck_ledger.steps)
        self.ledger = ledger
        self.dp_step.ledger = ledger
        self._live_written = True
        self._cap_resume(int(st.get("global_step", 0)))

    def _cap_resume(self, start: int) -> None:
        """The target ε as a hard cap across crashes (issue 36 item 3; accounting/cap.py): releases
        made after the checkpoint by an attempt that died are counted, and the resumed run stops
        early so that ε stays within the target (or within the plan's ε for a fixed σ) unless
        ``DPArguments.allow_overspend``. Says before the first step what it will do."""
        dp = self.dp_args
        target = dp.target_epsilon if dp.noise_multiplier is None else None
        cap = ddp.on_rank0(self.world, lambda: ledger_resume_cap(
            self.ledger, "train", self.mechanism, lambda s: self.q, start, self.total_steps, dp.target_delta, target))
        held = cap.held
        goal = f"the target ε = {cap.target:g}" if target is not None else f"the planned ε = {cap.target:.4g}"
        head = (f"DPTrainer resume: the ledger holds {held} training releases ({start} up to the checkpoint"
                + (f", {held - start} after it, run again as new releases)" if held > start else ")"))
        if dp.allow_overspend or cap.stop == cap.planned:
            self._stop_at = None
            line = (f"{head}; {cap.planned - start} steps remain; the run ends at ε = {cap.epsilon_planned:.4g} at "
                    f"δ = {dp.target_delta:g}" + (f", ABOVE {goal} (allow_overspend)"
                                                   if cap.epsilon_planned > cap.target * (1 + 1e-9) else ""))
        else:
            if cap.stop <= start:
                _refuse(f"{head}: no step fits within {goal} any more (the releases after the checkpoint spent it). "
                        "The model of the last run is what the budget bought; pass DPArguments(allow_overspend=True) "
                        "to run on above the target")
            self._stop_at = cap.stop
            line = (f"{head}; the run stops at step {cap.stop} of the {cap.planned} planned ({cap.early} early) so "
                    f"that ε stays within {goal}; it ends at ε = {cap.epsilon_end:.4g} at δ = {dp.target_delta:g} "
                    f"(DPArguments(allow_overspend=True) runs all {cap.planned} steps: ε = {cap.epsilon_planned:.4g})")
        self.resume_cap = {"start": start, "planned": cap.planned, "stop": cap.stop if self._stop_at else cap.planned,
                           "held": held, "allow_overspend": dp.allow_overspend}
        if self.world.is_main:
            print(line, file=sys.stderr)

    @property
    def _banded(self) -> bool:
        """A banded_mf run (secret noise state beyond the key)."""
        mech = getattr(self, "mechanism", None)  # set at the end of DPTrainer.__init__
        return mech is not None and mech.stateful

    def _resume_noise_state(self, state: Optional[dict], step: int, replayed: int) -> None:
        """Restore the banded-MF buffers and partition for a resume at checkpoint ``step`` through the
        session's one restore path (session/core.py ``PrivateSession.restore_secret_state``, the CLI's
        refusals): releases after the checkpoint, a state of another step (resume from the last
        checkpoint: the file holds the newest one's state), other coefficients or another N. ``state``
        is rank 0's read, broadcast to every rank; FSDP2: each rank keeps its shards' slices
        (``ShardedBandedMFMechanism.load_state``)."""
        try:
            PrivateSession.restore_secret_state(self.dp_step, state, _RESUME_WORDS[0], at=step, replayed=replayed,
                                                fresh=_RESUME_WORDS[1])
        except ValueError as exc:
            _refuse(str(exc))
