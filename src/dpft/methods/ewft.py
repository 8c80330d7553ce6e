"""EW-FT and DP-Forward as a recipe: forward-pass LDP wired into the Trainer (no loop of its own).

EW-FT (Zhang et al. 2026) = stacked autoencoder + noise layer (privacy/ldp.py) + EWPBA σ
schedule (accounting/ewpba.py). DP-Forward (Du et al. 2023) = the same layer without the
autoencoder and with one σ (``ldp.schedule: uniform``). Selected by the recipe section
``ldp:`` with ``privacy.enabled: false`` — the noise is on the forward pass, so the optimizer
step on post(·) is post-processing and needs no per-example gradient clipping.

The Trainer calls :meth:`LDPRun.before_step` (sets the epoch's σ_e) and
:meth:`LDPRun.after_step` (records ``PoissonSampled(q, Gaussian(σ_e))`` in the ledger,
phase ``ldp-forward``). This file holds wiring and reporting only, no math.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpft.accounting.calibrate import check_delta
from dpft.accounting.ewpba import SIGMA_FLOOR, NoiseSchedule, make_schedule, schedule_epsilon
from dpft.privacy.ldp import (GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, local_epsilon,
                              local_epsilon_composed, pretrain_autoencoder)

PHASE = "ldp-forward"

STREAM_STATEMENT = (
    "Example level, training stream (the paper's accounting): PLD composition of one "
    "PoissonSampled(q, Gaussian(σ_e)) event per step, σ_e relative to the replace-one sensitivity "
    "2C (add/remove neighbouring, as DP-SGD). It assumes what subsampling amplification assumes: "
    "the observer does not learn which examples a step used nor which row is whose. A server that "
    "knows which user sent which row gets no amplification; against it only the local guarantee holds.")
LOCAL_STATEMENT = (
    "Local, per release: one noisy matrix is (ε_loc, δ)-DP for any two inputs of one user "
    "(analytic Gaussian mechanism, Balle & Wang 2018, σ_e relative to sensitivity 2C). "
    "'per example, all releases' composes the largest number of releases any training example "
    "made in each epoch (PLD, replace-one). Labels are sent in the clear and are not covered.")


class LDPRun:
    """The forward-LDP part of one Trainer run (built by ``Trainer.__init__`` when ``ldp.enabled``).

    Side effects on the trainer: wraps ``trainer.model`` in a :class:`SplitClassifier` and
    sets ``trainer.total_steps = E · ⌈N/B⌉``.

    Raises:
        LDPError: ``privacy.enabled`` is true, ``schedule.epochs`` is not a whole number,
            autoencoder width ≠ hidden size, public task = private task.
        ScheduleError / CalibrationError: unreachable (ε, δ).
    """

    def __init__(self, trainer) -> None:
        r = trainer.recipe
        c = r.ldp
        self.trainer = trainer
        self.cfg = c
        if r.privacy.enabled:
            raise LDPError("ldp.enabled needs privacy.enabled: false — the noise is on the forward pass; "
                           "DP-SGD on top of it is not wired (set privacy.enabled: false)")
        e = r.schedule.epochs
        if e is None or r.schedule.steps is not None or e != int(e) or e < 1:
            raise LDPError("ldp needs schedule.epochs = a whole number E ≥ 1 and no schedule.steps "
                           "(σ changes per epoch)")
        self.epochs = int(e)
        self.steps_per_epoch = math.ceil(trainer.n / r.batch.expected_batch_size)
        trainer.total_steps = self.epochs * self.steps_per_epoch
        check_delta(c.delta, trainer.n)
        q = trainer.q
        if c.noise_multiplier is not None:
            s = [float(c.noise_multiplier)] * self.epochs
            eps = schedule_epsilon(s, q, self.steps_per_epoch, c.delta) if s[0] > 0 else math.inf
            self.schedule = NoiseSchedule(s, q, self.steps_per_epoch, c.delta, eps, eps, "fixed")
        else:
            if c.target_epsilon is None:
                raise LDPError("ldp: set target_epsilon (σ's are calibrated) or noise_multiplier")
            self.schedule = make_schedule(c.schedule, c.target_epsilon, c.delta, q, self.steps_per_epoch,
                                          self.epochs, c.step_distance)
        model = trainer.model
        hidden = int(model.config.hidden_size)
        ae = None
        if c.autoencoder.sizes:
            if c.autoencoder.sizes[0] != hidden:
                raise LDPError(f"ldp.autoencoder.sizes must start with the hidden size {hidden}, got "
                               f"{c.autoencoder.sizes} (e.g. [{hidden}, 64])")
            torch.manual_seed(r.seed)
            ae = StackedAutoencoder(c.autoencoder.sizes)
        self.layer = GaussianLDP(c.max_norm, self.schedule.sigmas[0], ae, normalize=c.normalize,
                                 eval_noise=c.eval_noise)
        self.split = SplitClassifier(model, c.position, self.layer, r.model.max_length)
        self.split.pre_cache = {}  # frozen pre(·): computed once per example (speed only)
        self.pretrain_loss: list[float] = []
        self.pretrain_baseline: float | None = None
        if ae is not None and c.autoencoder.pretrain_epochs > 0:
            self.pretrain_loss = self._pretrain(ae)
        trainer.model = self.split

    # ------------------------------------------------------------------ public pre-training
    def _pretrain(self, ae: StackedAutoencoder) -> list[float]:
        from dpft.config import TaskCfg
        from dpft.data.tasks import load_task

        t, a = self.trainer, self.cfg.autoencoder
        if a.public_task == t.recipe.task.name:
            raise LDPError(f"ldp.autoencoder.public_task must be public text other than the private task "
                           f"({t.recipe.task.name!r}); e.g. 'imdb' for sst2")
        pub = load_task(TaskCfg(name=a.public_task, max_train_examples=a.public_examples), seed=t.recipe.seed)
        texts = list(pub.train["text"])
        batches = []
        for k in range(0, len(texts), a.pretrain_batch_size):
            enc = t.tokenizer(texts[k:k + a.pretrain_batch_size], truncation=True,
                              max_length=t.recipe.model.max_length, padding=True, return_tensors="pt")
            h = self.split.pre(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
            batches.append((h, torch.ones(h.shape[:2])))  # every position is part of the release
        # MSE of predicting 0: the scale against which the reconstruction loss is read
        self.pretrain_baseline = float(torch.stack([(h ** 2).mean() for h, _ in batches]).mean())
        return pretrain_autoencoder(ae, batches, self.cfg.max_norm, epochs=a.pretrain_epochs,
                                    lr=a.pretrain_lr, seed=t.recipe.seed)

    # ------------------------------------------------------------------ trainer hooks
    def before_step(self, step: int) -> None:
        self.layer.set_sigma(self.schedule.sigma_at(step))

    def after_step(self, step: int) -> None:
        # One event per step, empty batch or not: the step's release is the Poisson-sampled set.
        self.trainer.ledger.record(PHASE, self.schedule.step_event(step))

    def _below_floor(self) -> bool:
        # σ < SIGMA_FLOOR (but > 0): the PLD of so little noise takes minutes and the ε is
        # meaningless anyway; report ∞ (an upper bound: never in the user's favour).
        return 0 < min(self.schedule.sigmas) < SIGMA_FLOOR

    def epsilon(self) -> float:
        if self._below_floor():
            return math.inf
        return self.trainer.ledger.epsilon(self.cfg.delta).epsilon

    # ------------------------------------------------------------------ report
    def max_releases_per_epoch(self, upto: int) -> list[int]:
        """Largest number of releases of one example in each epoch (from the seeded sampler:
        data-independent, so this statistic is public)."""
        t = self.trainer
        out = []
        for e in range(self.epochs):
            counts = torch.zeros(t.n, dtype=torch.long)
            for step in range(e * self.steps_per_epoch, min((e + 1) * self.steps_per_epoch, upto)):
                counts[t.sampler.indices(step)] += 1
            out.append(int(counts.max()) if t.n else 0)
        return out

    def privacy_section(self, steps_done: int) -> dict[str, Any]:
        """The two guarantees, each with its statement; ε's from the ledger / dp_accounting."""
        d = self.cfg.delta
        if self._below_floor():
            from dpft.accounting.ledger import PrivacyReport

            rep = PrivacyReport(math.inf, d, math.inf, accountant=f"not computed: σ < {SIGMA_FLOOR} (reported as ∞)")
        else:
            rep = self.trainer.ledger.epsilon(d)
        per_epoch = self.max_releases_per_epoch(steps_done)
        seq = [s for s, k in zip(self.schedule.sigmas, per_epoch) for _ in range(k)]
        return {
            "guarantee": "certified", **rep.as_dict(),
            "statement": STREAM_STATEMENT,
            "ledger": [{"phase": e.phase, "count": e.count, "event": repr(e.event)}
                       for e in self.trainer.ledger.entries],
            "local": {
                "statement": LOCAL_STATEMENT,
                "delta": d,
                "epsilon_per_release_by_epoch": [local_epsilon(s, d) for s in self.schedule.sigmas],
                "max_releases_per_example_by_epoch": per_epoch,
                "epsilon_per_example_all_releases": local_epsilon_composed(seq, d),
            },
        }

    def summary(self) -> dict[str, Any]:
        c = self.cfg
        return {"position": c.position, "max_norm": c.max_norm, "sensitivity": self.layer.sensitivity,
                "noise_std_by_epoch": [s * self.layer.sensitivity for s in self.schedule.sigmas],
                "autoencoder": c.autoencoder.sizes or None, "pretrain_loss": self.pretrain_loss,
                "pretrain_mse_of_zero": self.pretrain_baseline,
                "eval_noise": c.eval_noise, **self.schedule.as_dict(),
                "release_shape": [self.trainer.recipe.model.max_length,
                                  (c.autoencoder.sizes[-1] if c.autoencoder.sizes
                                   else int(self.split.model.config.hidden_size))]}
