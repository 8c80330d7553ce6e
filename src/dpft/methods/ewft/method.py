"""EW-FT and DP-Forward as a recipe: forward-pass LDP wired into the Trainer (no loop of its own).

EW-FT (Zhang et al. 2026) = stacked autoencoder + noise layer (privacy/ldp.py) + EWPBA σ
schedule (accounting/ewpba.py). DP-Forward (Du et al. 2023) = the same layer without the
autoencoder and with one σ (``ldp.schedule: uniform``). Selected by the recipe section
``ldp:`` with ``privacy.enabled: false`` — the noise is on the forward pass, so the optimizer
step on post(·) is post-processing and needs no per-example gradient clipping.

The Trainer calls :meth:`LDPRun.before_step` (sets the epoch's σ_e) and
:meth:`LDPRun.after_step` (records ``PoissonSampled(q, Gaussian(σ_e))`` in the ledger,
phase ``ldp-forward``). With ``ldp.label_epsilon`` = ε₂ the training labels are replaced once,
before training, by randomized response (privacy/label_rr.py) and the loss is the
forward-corrected one; the label guarantee (ε₂, δ = 0, replace-one) is reported beside the
ledger's, not in it. This file holds wiring and reporting only, no math.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import dp_accounting as dpa
import torch
from dpft.methods.base import Method, register_method

from dpft.accounting.calibrate import check_delta
from dpft.accounting.ewpba import SIGMA_FLOOR, NoiseSchedule, make_schedule, schedule_epsilon
from dpft.models.losses import make_corrected_classification_loss
from dpft.privacy.label_rr import rr_transition_matrix
from dpft.privacy.ldp import (GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, local_epsilon,
                              local_epsilon_composed, parse_position, pretrain_autoencoder)

from dpft.methods.ewft import parts as ewft_parts
from dpft.methods.ewft import fsdp as ldp_fsdp
from dpft.methods.ewft.parts import (  # noqa: F401 (public here: the ldp: section's models and statements)
    PHASE,
    LdpAutoencoderCfg,
    LdpTrainPreCfg,
    LdpCfg,
    STREAM_STATEMENT,
    LOCAL_STATEMENT,
    LINKED_STATEMENT,
    LABEL_STATEMENT,
    LABEL_CLEAR_STATEMENT,
    COMBINED_STATEMENT,
    REPRO_FLAWS,
    REPRO_REASON,
    dp_forward_code_sigma,
    TRAIN_PRE_STATEMENT,
    LABELS_NOT_PROTECTED,
    LENGTH_NOT_PROTECTED,
    INFERENCE_STATEMENT,
    ldp_stream,
    rank_parts,
    pre_cache_allowed,
    privatize_labels,
    max_releases_per_epoch,
    linked_section,
    label_section,
)
from dpft.methods.ewft.parts import ldp_markdown
from dpft.accounting.ledger import PrivacyReport
from dpft.config.recipe import TaskCfg
from dpft.methods.ewft.train_pre import (
    PHASE_TRAIN_PRE, TrainPreEngine, TrainPreMechanism, calibrate, check_trainable, combined_event, effective_sigma,
    pre_parameters
)
from dpft.step.clip import make_clip_policy


class LDPRun:
    """The forward-LDP part of one Trainer run (built by ``Trainer.__init__`` when ``ldp.enabled``).

    Side effects on the trainer: wraps ``trainer.model`` in a :class:`SplitClassifier` and
    sets ``trainer.total_steps = E · ⌈N/B⌉``; with ``ldp.label_epsilon`` also replaces the
    ``label`` column of ``trainer.train_tok`` by its randomized-response draw and (with
    ``ldp.label_loss_correction``) ``trainer.loss_fn`` by the forward-corrected loss.

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
        if r.batch.schedule:
            raise LDPError("ldp with batch.schedule is not supported: the forward-LDP accounting assumes one "
                           "sampling rate q for every step; remove batch.schedule")
        e = r.schedule.epochs
        if e is None or r.schedule.steps is not None or e != int(e) or e < 1:
            raise LDPError("ldp needs schedule.epochs = a whole number E ≥ 1 and no schedule.steps "
                           "(σ changes per epoch)")
        self.epochs = int(e)
        self.steps_per_epoch = math.ceil(trainer.n / r.batch.expected_batch_size)
        trainer.total_steps = self.epochs * self.steps_per_epoch
        check_delta(c.delta, trainer.n)
        q = trainer.q
        if c.reproduce and c.reproduce_flaws:
            raise LDPError("set one of ldp.reproduce (every flaw) or ldp.reproduce_flaws (a subset), not both")
        #: The NOT CERTIFIED deviations this run makes (REPRO_FLAWS ids); empty = certified.
        self.flaws = set(REPRO_FLAWS) if c.reproduce == "dp_forward_code" else set(c.reproduce_flaws or ())
        self.repro = bool(self.flaws)
        tp = c.train_pre
        #: ldp.train_pre: σ_grad of pre(·)'s DP-SGD (None = pre(·) frozen).
        self.sigma_grad: Optional[float] = None
        if tp.enabled:
            self._train_pre_schedule(trainer, q)
        elif "iii" in self.flaws and c.noise_multiplier is None:
            if c.target_epsilon is None:
                raise LDPError("ldp.reproduce needs target_epsilon (σ is calibrated as the code does) or "
                               "noise_multiplier")
            s = [dp_forward_code_sigma(c.target_epsilon, c.delta, trainer.n, self.epochs)] * self.epochs
            self.schedule = NoiseSchedule(s, q, self.steps_per_epoch, c.delta, c.target_epsilon, c.target_epsilon,
                                          "dp_forward_code",
                                          notes=["σ calibrated as DP-Forward's code: q = 1/N over N·E "
                                                 "compositions (NOT CERTIFIED)"])
        elif c.noise_multiplier is not None:
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
            # Built on the CPU (the same initial weights on every device), then on the model's device.
            ae = StackedAutoencoder(c.autoencoder.sizes).to(trainer.device)
        at_output = c.position == "output"
        # The certified mechanism, with each NOT CERTIFIED flaw of the run (self.flaws) swapped in:
        # (i) no detach, (ii) std σ·C, (iv) pooled vector, (v) mask, (vii) no inference noise;
        # (iii) is the σ above, (vi) the skipped pre-training below. No flaws = certified.
        f = self.flaws
        self.layer = GaussianLDP(c.max_norm, self.schedule.sigmas[0], ae, normalize=c.normalize,
                                 eval_noise=c.eval_noise and "vii" not in f,
                                 std_factor=1.0 if "ii" in f else 2.0, detach="i" not in f)
        pooled = at_output and "iv" in f
        self.split = SplitClassifier(model, c.position, self.layer, r.model.max_length,
                                     pass_mask=c.mask_after_noise or "v" in f, pooled_release=pooled,
                                     release_cls=at_output and not pooled, train_pre="i" in f)
        if tp.enabled:
            if tp.blocks is not None and tp.blocks > self.split.cut:
                raise LDPError(f"ldp.train_pre.blocks = {tp.blocks} > the {self.split.cut} blocks of pre(·) at "
                               f"position {c.position!r}; lower it or leave it unset (all)")
            if tp.embeddings and tp.blocks not in (None, self.split.cut):
                raise LDPError("ldp.train_pre.embeddings needs every block of pre(·) trained: unset train_pre.blocks")
            #: first trained block of pre(·) (ldp.train_pre)
            self.first_block = self.split.cut - (tp.blocks or self.split.cut)
            params = pre_parameters(self.split, self.first_block, tp.embeddings)
            check_trainable(params, f"pre(·) at {c.position!r}")
            for p in params:  # the split froze them; DP-SGD trains them (no pre(·) cache: it changes)
                p.requires_grad_(True)
        elif "i" not in f and pre_cache_allowed(trainer):
            # frozen pre(·): computed once per example (speed only); off under FSDP2 on K > 1 ranks,
            # where pre(·)'s forwards are collectives every rank must run alike (ewft_parts.pre_cache_allowed)
            self.split.pre_cache = {}
        if self.repro:
            trainer.ledger.mark_not_certified(self.repro_reason())
        self.pretrain_loss: list[float] = []
        self.pretrain_baseline: float | None = None
        if ae is not None and c.autoencoder.pretrain_epochs > 0 and "vi" not in self.flaws:
            self.pretrain_loss = self._pretrain(ae)
        trainer.model = self.split
        #: Label privacy (ldp.label_epsilon): RR labels drawn once here, before training.
        self.num_labels = int(trainer.task.num_labels)
        self.noisy_labels: torch.Tensor | None = None
        if c.label_epsilon is not None:
            # RR draws from the run's secret randomness (stream label_rr); nothing is recorded.
            trainer.train_tok, self.noisy_labels = privatize_labels(trainer.train_tok, c.label_epsilon,
                                                                    self.num_labels, trainer.rng.stream("label_rr"))
            if c.label_loss_correction:
                # the Trainer builds its engine from trainer.loss_fn after this constructor
                trainer.loss_fn = make_corrected_classification_loss(
                    rr_transition_matrix(c.label_epsilon, self.num_labels))

    def _train_pre_schedule(self, trainer, q: float) -> None:
        """σ_rep (the layer's, per epoch) and σ_grad of ``ldp.train_pre``, calibrated jointly."""
        c, tp = self.cfg, self.cfg.train_pre
        if self.repro:
            raise LDPError("ldp.train_pre is the certified alternative to flaw (i): remove ldp.reproduce / "
                           "ldp.reproduce_flaws (the reproduction trains pre(·) without clipping or noise)")
        if c.noise_multiplier is None and c.schedule != "uniform":
            raise LDPError("ldp.train_pre calibrates one (σ_rep, σ_grad) pair for the run: set ldp.schedule: "
                           "uniform (EWPBA's per-epoch σ is not wired with DP-SGD on pre(·)) or ldp.noise_multiplier")
        n_blocks = len(trainer.model.bert.encoder.layer) if hasattr(trainer.model, "bert") else None
        cut = parse_position(c.position, n_blocks) if n_blocks is not None else None
        if cut is not None and tp.blocks is not None and tp.blocks > cut:
            raise LDPError(f"ldp.train_pre.blocks = {tp.blocks} > the {cut} blocks of pre(·) at position "
                           f"{c.position!r}; lower it or leave it unset (all)")
        if tp.embeddings and tp.blocks not in (None, cut):
            raise LDPError("ldp.train_pre.embeddings needs every block of pre(·) trained: unset train_pre.blocks")
        steps = self.epochs * self.steps_per_epoch
        if c.noise_multiplier is not None:
            s_rep, s_grad = float(c.noise_multiplier), float(c.noise_multiplier) * tp.noise_ratio
            s_eff = effective_sigma(s_rep, s_grad)
        else:
            if c.target_epsilon is None:
                raise LDPError("ldp.train_pre: set ldp.target_epsilon (σ's are calibrated) or ldp.noise_multiplier")
            s_rep, s_grad, s_eff = calibrate(c.target_epsilon, c.delta, q, steps, tp.noise_ratio,
                                             prior=trainer.ledger.events())
        self.sigma_grad = s_grad
        self.sigma_eff = s_eff
        eps = schedule_epsilon([s_eff] * self.epochs, q, self.steps_per_epoch, c.delta) if s_eff > 0 else math.inf
        self.schedule = NoiseSchedule([s_rep] * self.epochs, q, self.steps_per_epoch, c.delta,
                                      c.target_epsilon if c.target_epsilon is not None else eps, eps, "train_pre",
                                      notes=[f"ldp.train_pre: σ_rep = {s_rep:.4g} (codes, sensitivity 2C), σ_grad = "
                                             f"{s_grad:.4g} (pre(·) gradients, sensitivity C_g = {tp.max_grad_norm:g}), "
                                             f"one event per step at σ_eff = {s_eff:.4g}"])

    def repro_reason(self) -> str:
        """Why the run is NOT CERTIFIED: the flaws it makes, each named."""
        if self.flaws == set(REPRO_FLAWS):
            return REPRO_REASON
        return ("ldp.reproduce_flaws (ablation of DP-Forward's code, NOT CERTIFIED): "
                + "; ".join(f"({k}) {v}" for k, v in REPRO_FLAWS.items() if k in self.flaws))

    # ------------------------------------------------------------------ public pre-training
    def _pretrain(self, ae: StackedAutoencoder) -> list[float]:
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
            enc = {k: v.to(t.device) for k, v in enc.items()}
            h = self.split.pre(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
            batches.append((h, torch.ones(h.shape[:2], device=h.device)))  # every position is part of the release
        # MSE of predicting 0: the scale against which the reconstruction loss is read
        self.pretrain_baseline = float(torch.stack([(h ** 2).mean() for h, _ in batches]).mean())
        return pretrain_autoencoder(ae, batches, self.cfg.max_norm, epochs=a.pretrain_epochs,
                                    lr=a.pretrain_lr, seed=t.recipe.seed)

    # ------------------------------------------------------------------ trainer hooks
    def before_step(self, step: int) -> None:
        self.layer.set_sigma(self.schedule.sigma_at(step))
        # The noise of this step's releases: the run's secret randomness, stream ldp, step (and
        # the rank under DDP: each rank releases other examples, which need independent noise).
        self.layer.generator = ldp_stream(self.trainer, step)

    def after_step(self, step: int) -> None:
        # One event per step, empty batch or not: the step's release is the Poisson-sampled set.
        if self.sigma_grad is not None:
            return  # ldp.train_pre: the step's mechanism recorded both releases as one event
        if self.repro:
            # what was actually released: std σ·C (flaw ii) or σ·2C against sensitivity 2C, i.e.
            # multiplier σ/2 or σ (the ledger is marked NOT CERTIFIED anyway)
            mult = self.schedule.sigma_at(step) * self.layer.std_factor / 2
            ev = dpa.PoissonSampledDpEvent(self.schedule.q, dpa.GaussianDpEvent(mult))
            self.trainer.record(PHASE, ev)
            return
        self.trainer.record(PHASE, self.schedule.step_event(step))

    def _below_floor(self) -> bool:
        # σ < SIGMA_FLOOR (but > 0): the PLD of so little noise takes minutes and the ε is
        # meaningless anyway; report ∞ (an upper bound: never in the user's favour).
        return 0 < min(self.schedule.sigmas + ([self.sigma_eff] if self.sigma_grad is not None else [])) < SIGMA_FLOOR

    def epsilon(self) -> float | None:
        if self.repro:
            return None  # NOT CERTIFIED: no ε is shown
        if self._below_floor():
            return math.inf
        return self.trainer.ledger.epsilon(self.cfg.delta).epsilon

    # ------------------------------------------------------------------ report
    def max_releases_per_epoch(self, upto: int) -> list[int]:
        """Largest number of releases of one example in each epoch (from the seeded sampler:
        data-independent, so this statistic is public)."""
        t = self.trainer
        return max_releases_per_epoch(t.sampler, t.n, self.epochs, self.steps_per_epoch, upto)

    def privacy_section(self, steps_done: int) -> dict[str, Any]:
        """The two guarantees, each with its statement; ε's from the ledger / dp_accounting."""
        d = self.cfg.delta
        if self.repro:
            every = self.flaws == set(REPRO_FLAWS)
            return {"guarantee": "NOT CERTIFIED", "reason": self.repro_reason(), "epsilon": None,
                    "reproduce": "dp_forward_code" if every else "flaws " + ",".join(sorted(self.flaws)),
                    "flaws": {k: v for k, v in REPRO_FLAWS.items() if k in self.flaws},
                    "claimed_by_the_code": {"epsilon": self.cfg.target_epsilon, "delta": d,
                                            "sigma": self.schedule.sigmas[0],
                                            "calibration": ("q = 1/N over N·E compositions" if "iii" in self.flaws
                                                            else "the certified calibration (q = B/N, PLD)")
                                            + (", sensitivity 1" if "ii" in self.flaws else ", sensitivity 2C")},
                    "ledger": [{"phase": e.phase, "count": e.count, "event": repr(e.event)}
                               for e in self.trainer.ledger.entries]}
        if self._below_floor():
            rep = PrivacyReport(math.inf, d, math.inf, accountant=f"not computed: σ < {SIGMA_FLOOR} (reported as ∞)")
        else:
            rep = self.trainer.ledger.epsilon(d)
        per_epoch = self.max_releases_per_epoch(steps_done)
        seq = [s for s, k in zip(self.schedule.sigmas, per_epoch) for _ in range(k)]
        scope = [] if self.cfg.label_epsilon is not None else [LABELS_NOT_PROTECTED]
        if self.cfg.mask_after_noise:
            scope.append(LENGTH_NOT_PROTECTED)
        return {
            "guarantee": "certified", **rep.as_dict(),
            # Without label RR the labels are used in the clear: the ε covers the inputs only;
            # with the mask after the noise, the token counts are in the clear too.
            "scope": "; ".join(scope) or None,
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
            "linked_rows": linked_section(seq, d, self.cfg.label_epsilon, self.num_labels),
            "label": label_section(self.cfg.label_epsilon, self.num_labels, self.cfg.label_loss_correction,
                                   rep.epsilon, d),
            **({"train_pre": self.train_pre_section(seq, d)} if self.sigma_grad is not None else {}),
        }

    def train_pre_section(self, rep_sigmas: list[float], delta: float) -> dict[str, Any]:
        """What ``ldp.train_pre`` releases and what each part protects; the linked-rows ε with the
        gradient releases (PLD replace-one, no amplification: G(2σ_rep) and G(σ_grad) per release)."""
        tp = self.cfg.train_pre
        k = len(rep_sigmas)
        linked = None
        if k and self.sigma_grad and min(rep_sigmas) > 0:
            from dp_accounting.pld import pld_privacy_accountant

            acc = pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                                       value_discretization_interval=1e-4)
            # k × (G(2σ_rep), G(σ_grad)) without sampling is one Gaussian, σ = (Σ σ_j⁻²)^(-1/2) (exact)
            inv = sum((2.0 * s) ** -2 + self.sigma_grad ** -2 for s in rep_sigmas)
            acc.compose(dpa.GaussianDpEvent(inv ** -0.5))
            linked = float(acc.get_epsilon(delta))
        return {"statement": TRAIN_PRE_STATEMENT, "sigma_rep": self.schedule.sigmas[0], "sigma_grad": self.sigma_grad,
                "sigma_eff": self.sigma_eff, "noise_ratio": tp.noise_ratio, "max_grad_norm": tp.max_grad_norm,
                "gradient_noise_std": self.sigma_grad * tp.max_grad_norm,
                "trained_blocks_of_pre": [self.first_block + 1, self.split.cut], "embeddings": tp.embeddings,
                "step_event": repr(combined_event(self.schedule.q, self.schedule.sigmas[0], self.sigma_grad)),
                "recorded_as": f"PoissonSampled(q, Gaussian(σ_eff = {self.sigma_eff:.6g})) per step",
                "linked_rows_epsilon_with_gradients": linked}

    def summary(self) -> dict[str, Any]:
        c = self.cfg
        return {"position": c.position, "max_norm": c.max_norm, "sensitivity": self.layer.sensitivity,
                "reproduce": c.reproduce, "reproduce_flaws": sorted(self.flaws) or None,
                "mask_after_noise": bool(self.split.pass_mask),
                "release": ("pooled [CLS] vector" if self.split.pooled_release else
                            "[CLS] row of the last block" if self.split.release_cls else "hidden matrix"),
                "inference": INFERENCE_STATEMENT,
                "noise_std_by_epoch": [s * self.layer.sensitivity for s in self.schedule.sigmas],
                "autoencoder": c.autoencoder.sizes or None, "pretrain_loss": self.pretrain_loss,
                "pretrain_mse_of_zero": self.pretrain_baseline,
                "eval_noise": self.layer.eval_noise, **self.schedule.as_dict(),
                "label_epsilon": c.label_epsilon,
                "train_pre": ({"sigma_rep": self.schedule.sigmas[0], "sigma_grad": self.sigma_grad,
                               "sigma_eff": self.sigma_eff, "max_grad_norm": c.train_pre.max_grad_norm,
                               "blocks": [self.first_block + 1, self.split.cut], "embeddings": c.train_pre.embeddings}
                              if self.sigma_grad is not None else None),
                "label_loss_correction": bool(c.label_epsilon is not None and c.label_loss_correction),
                "release_shape": [1 if self.split.release_cls else self.trainer.recipe.model.max_length,
                                  (c.autoencoder.sizes[-1] if c.autoencoder.sizes
                                   else int(self.split.model.config.hidden_size))]}


@register_method
class ForwardLDP(Method):
    """EW-FT / DP-Forward as a plug-in: the noise layer wraps the model in ``prepare``; each
    step's release is recorded in ``after_update``; the report's privacy section is this
    method's (stream, local, linked-rows and label guarantees)."""

    name = "ewft"
    config = LdpCfg
    legacy_section = "ldp"
    report_key = "ldp"
    order = 20
    #: The layer, the autoencoder, its public pre-training and every noise draw follow the
    #: model's device (``SecretStream.normal(..., device=z.device)``).
    supports_device = True
    #: Under DDP each rank releases the rows of its share of the logical batch with noise from
    #: its own stream (``ldp``, step, rank): independent draws for different examples, as in one
    #: process; the world records one event per step (the same Poisson-sampled release set).
    supports_ddp = True
    #: Under FSDP2 (issue 38), with a frozen pre(·) (the default): the recipe is
    #: ``privacy.enabled: false``, so the step is the non-private FSDP step (dpft/placement/fsdp_plain.py) on the split
    #: model — post(·), the decoder and the head get plain gradients (post-processing of the released codes),
    #: reduce-scattered by FSDP2 and summed over the ranks; each rank releases its share's codes with
    #: noise from its own stream (``ldp``, step, rank: as under DDP, ewft_parts.rank_parts); the world
    #: records one event per step (:meth:`LDPRun.after_step`, as in one process); pre(·)'s cache is off
    #: (its forwards are collectives: ewft_parts.pre_cache_allowed). ``ldp.train_pre`` runs its own sharded
    #: step (methods/ewft/fsdp.py ``TrainPreFSDPStep``: the engine on a plain copy gathered once per step,
    #: clipped sums reduce-scattered, DDP's gradient noise sliced per shard, one joint event per step).
    supports_fsdp = True

    @classmethod
    def enabled(cls, cfg: LdpCfg) -> bool:
        return cfg.enabled

    def prepare(self, run) -> None:
        self.ldp = LDPRun(run)

    @classmethod
    def card_mechanism(cls, rep) -> Optional[str]:
        if not rep.get(cls.report_key):
            return None
        return "| mechanism | forward-pass local DP (EW-FT / DP-Forward); see `report.md` of the run |"

    @classmethod
    def card_usage(cls, rep) -> Optional[list[str]]:
        if not rep.get(cls.report_key):
            return None
        return ["This run's model has a forward-pass noise layer (EW-FT / DP-Forward) between its blocks: the "
                "folder holds the inner model and the autoencoder, which a plain `pipeline` would run without that "
                "layer. Serve it with dpft's split deployment (`dpft ldp-server` / `dpft ldp-client`).", ""]

    def build(self, spec, run):
        """``ldp.train_pre``: the step's engine gives pre(·)'s per-example clipped gradients through
        the noise layer (and post(·)'s plain ones) and its mechanism noises pre(·)'s sum and records
        the combined event (methods/ewft/train_pre.py). Frozen pre(·): the step unchanged."""
        tp = self.cfg.train_pre
        if not tp.enabled:
            return spec

        clip = make_clip_policy("flat", tp.max_grad_norm)
        eng = TrainPreEngine(self.ldp.split, run.loss_fn, clip, self.ldp.first_block, tp.embeddings, tp.engine)
        mech = TrainPreMechanism(self.ldp.schedule.sigmas[0], self.ldp.sigma_grad, clip.sensitivity, run.rng,
                                 eng.pre_names)
        eng.fsdp_step = ldp_fsdp.make_step  # perf.sharding: fsdp (dpft/session/step.py step_for)
        return spec.replace(engine=eng, clip=clip, mechanism=mech, phase=PHASE_TRAIN_PRE)

    def before_step(self, step, run) -> None:
        self.ldp.before_step(step)

    def after_update(self, out, run) -> dict:
        self.ldp.after_step(out.step)
        return {}

    def epsilon(self, run):
        return self.ldp.epsilon()

    def evaluate(self, run, evaluate):
        """Dev metrics with and without inference noise (``*_noisy_inference`` /
        ``*_clean_inference``); ``dev_accuracy`` / ``dev_loss`` are the ones ``ldp.eval_noise``
        selects (always clean in the reproduction, as the code). Eval noise comes from its own
        secret stream ``ldp_eval`` (never a training step's)."""
        layer = self._eval_layer(run)
        keep, gen = layer.eval_noise, layer.generator
        self._n_eval = getattr(self, "_n_eval", 0) + 1
        out: dict = {}
        try:
            for noisy in (not keep, keep):  # the headline last (its predictions are the ones kept)
                layer.eval_noise = noisy
                layer.generator = run.rng.stream("ldp_eval", self._n_eval, *ewft_parts.rank_parts(run), device=run.device)
                res = evaluate()
                tag = "noisy" if noisy else "clean"
                out.update({f"{k}_{tag}_inference": v for k, v in res.items()})
                if noisy == keep:
                    out.update(res)
        finally:
            layer.eval_noise, layer.generator = keep, gen
        return out

    def _eval_layer(self, run) -> GaussianLDP:
        """The noise layer of the model evaluated now. Under FSDP2 the driver evaluates the test file
        on a plain copy of the sharded model (dpft/placement/fsdp.py ``materialise``, made from a template taken
        at sharding time), whose layer is a copy: it gets the training layer's current σ (the last
        epoch's) and switches, so the copy evaluates as the trained model does (its stream is set
        by :meth:`evaluate`)."""
        lay = getattr(run.model, "noise", None)
        if isinstance(lay, GaussianLDP) and lay is not self.ldp.layer:
            lay.set_sigma(self.ldp.layer.sigma)
            lay.eval_noise = self.ldp.layer.eval_noise
            return lay
        return self.ldp.layer

    def privacy_section(self, run):
        return self.ldp.privacy_section(run.total_steps)

    def report(self, run) -> dict:
        return self.ldp.summary()

    @classmethod
    def markdown(cls, rep) -> list[str]:
        x, p, met = rep["ldp"], rep["privacy"], rep.get("metrics", {})
        acc = [f"- Dev accuracy with inference noise {met['dev_accuracy_noisy_inference']:.4f}, without "
               f"{met['dev_accuracy_clean_inference']:.4f}. {x.get('inference', '')}"] \
            if "dev_accuracy_noisy_inference" in met else []
        if p.get("guarantee") == "NOT CERTIFIED":  # ldp.reproduce: no ε, each flaw named
            return ["## Forward-pass LDP: NOT CERTIFIED reproduction of DP-Forward's code", "",
                    f"- σ = {x['sigmas'][0]:.4g} (noise std {x['noise_std_by_epoch'][0]:.4g}); the code "
                    f"claims ε = {p['claimed_by_the_code']['epsilon']} at δ = {p['claimed_by_the_code']['delta']:g}, "
                    "which does not hold:",
                    *[f"  - ({k}) {v}" for k, v in p["flaws"].items()], *acc, ""]
        return ldp_markdown(rep)[:-1] + acc + [""]


# ---------------------------------------------------------------------------- shared helpers
