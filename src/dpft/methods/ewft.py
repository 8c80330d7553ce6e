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
from typing import Any, Literal, Optional

import dp_accounting as dpa
import torch
from pydantic import Field

from dpft.config import _Strict
from dpft.methods.base import Method, register_method

from dpft.accounting.calibrate import check_delta
from dpft.accounting.ewpba import SIGMA_FLOOR, NoiseSchedule, make_schedule, schedule_epsilon
from dpft.privacy.label_rr import (example_epsilon_with_label, label_epsilon, make_corrected_classification_loss,
                                   randomized_response, rr_keep_probability, rr_transition_matrix)
from dpft.privacy.ldp import (GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, local_epsilon,
                              local_epsilon_composed, parse_position, pretrain_autoencoder)

PHASE = "ldp-forward"


class LdpAutoencoderCfg(_Strict):
    """Stacked autoencoder around the forward noise (EW-FT Section 5.3), pre-trained on public text."""

    #: Widths, hidden size first: [384, 64] (MiniLM; the paper's 768×64), [384, 256, 64] …;
    #: empty = no autoencoder (DP-Forward: the whole T × h matrix is clipped and perturbed).
    sizes: list[int] = []
    #: Public text for reconstruction pre-training (a registered task; its *train* texts, not
    #: the private training set).
    public_task: str = "imdb"
    public_examples: int = Field(2000, ge=1)
    pretrain_epochs: int = Field(3, ge=0)
    pretrain_lr: float = Field(1e-3, gt=0)
    pretrain_batch_size: int = Field(32, ge=1)


class LdpTrainPreCfg(_Strict):
    """``ldp.train_pre``: pre(·) trained by DP-SGD through the noise layer (methods/ldp_train_pre.py).

    Each step releases the noisy codes (σ_rep, sensitivity 2C) and the noisy clipped sum of
    pre(·)'s per-example gradients (σ_grad, sensitivity ``max_grad_norm``) on the same sampled
    batch: one ledger event ``PoissonSampled(q, Gaussian(σ_eff))``, σ_eff⁻² = σ_rep⁻² + σ_grad⁻²."""

    enabled: bool = False
    #: C_g: per-example L2 clipping norm of pre(·)'s gradient (flat).
    max_grad_norm: float = Field(1.0, gt=0)
    #: ρ = σ_grad / σ_rep; the pair is calibrated jointly to ``ldp.target_epsilon``.
    noise_ratio: float = Field(1.0, gt=0)
    #: Train only the last ``blocks`` blocks of pre(·) (None = all of them); earlier blocks stay frozen.
    blocks: Optional[int] = Field(None, ge=1)
    #: Also train the embedding layer (needs ``blocks`` unset).
    embeddings: bool = False
    #: Per-example engine of pre(·)'s gradients (grads/).
    engine: Literal["bookkeeping", "reference"] = "bookkeeping"


class LdpCfg(_Strict):
    """Forward-pass local DP (EW-FT / DP-Forward; privacy/ldp.py, accounting/ewpba.py).

    The noise is on the forward pass (clip the hidden matrix to C, add N(0, σ_e²(2C)²)); the
    optimizer step on post(·) is then non-private post-processing, so ``privacy.enabled``
    must be false (no per-example gradient clipping)."""

    enabled: bool = False
    #: ``embeddings`` · ``encoder:l`` (after block l, 1-based) · ``output`` (before the head).
    position: str = "encoder:5"
    #: Frobenius clipping norm C of one example's (T × h) matrix or autoencoder code.
    max_norm: float = Field(1.0, gt=0)
    #: Scale every example to norm exactly C instead of clipping (Eq. 11, first option).
    normalize: bool = False
    #: ``ewpba`` (EW-FT Algorithm 1: decreasing σ per epoch) or ``uniform`` (DP-Forward).
    schedule: Literal["ewpba", "uniform"] = "ewpba"
    #: EWPBA step distance S.
    step_distance: float = Field(2.0, gt=0)
    #: ε of the training stream (example level, the paper's accounting) at ``delta``.
    target_epsilon: Optional[float] = Field(8.0, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    #: Fixed σ for every epoch instead of a schedule.
    noise_multiplier: Optional[float] = Field(None, ge=0)
    #: Keep the noise on at evaluation (inference-time privacy, as DP-Forward); the last
    #: epoch's σ is used.
    eval_noise: bool = True
    autoencoder: LdpAutoencoderCfg = LdpAutoencoderCfg()
    #: Label privacy ε₂ (DP-Forward): K-ary randomized response on every training label, drawn
    #: once before training (privacy/label_rr.py); pure ε₂-DP per example, replace-one.
    #: None = labels are used in the clear (not covered by any guarantee).
    label_epsilon: Optional[float] = Field(None, gt=0)
    #: With ``label_epsilon``: train on the forward-corrected loss −log (softmax·T)[ỹ] with the
    #: known RR transition matrix T (Patrini et al. 2017) instead of cross-entropy on ỹ.
    label_loss_correction: bool = True
    #: Give post(·) the attention mask of the padded input (after the noise). The mask is not
    #: noised: it releases each example's token count in the clear, so the ε then covers the
    #: text of inputs of equal token count (the report's scope says so). False = post(·)
    #: attends to every position and the token count is protected too (the split deployment
    #: never sends a mask).
    mask_after_noise: bool = True
    #: REPRODUCTION ONLY, NOT CERTIFIED: ``dp_forward_code`` does what DP-Forward's official
    #: code does (REPRO_FLAWS (i)–(vii)); the run reports NOT CERTIFIED with each flaw.
    reproduce: Optional[Literal["dp_forward_code"]] = None
    #: ABLATION ONLY, NOT CERTIFIED: a subset of REPRO_FLAWS' ids (e.g. ``["i"]``) applied to
    #: the certified mechanism, to find which of DP-Forward's choices carries its accuracy;
    #: ``reproduce: dp_forward_code`` is all of them.
    reproduce_flaws: Optional[list[Literal["i", "ii", "iii", "iv", "v", "vi", "vii"]]] = None
    #: Certified adaptation of pre(·) by DP-SGD (the certified counterpart of flaw (i)).
    train_pre: LdpTrainPreCfg = LdpTrainPreCfg()



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
    "made in each epoch (PLD, replace-one). It covers the text; labels: see the label guarantee.")
LINKED_STATEMENT = (
    "Example level when the server links rows to users (split deployment: the server knows which "
    "client sent which row): subsampling amplification does not apply, so the example-level "
    "guarantee is the composition of the releases the example actually made — at most the largest "
    "number of releases any example made in each epoch, at that epoch's σ_e (PLD replace-one through "
    "dp_accounting; the same number as 'local ε per example, all releases'). 'with label' adds the "
    "example's one randomized-response label to the same composition.")
LABEL_STATEMENT = (
    "Labels (DP-Forward's ε₂): every training label was replaced once, before training, by K-ary "
    "randomized response (kept with probability e^ε₂/(e^ε₂+K−1), else a uniformly random other "
    "label); every epoch reuses the same noisy label, so all training is post-processing of one "
    "release. Pure ε₂-DP per example (δ = 0) under replace-one (that example's label changed to any "
    "other), ε from dp_accounting's RandomizedResponseDpEvent; not in the add/remove ledger above. "
    "It covers the labels only.")
LABEL_CLEAR_STATEMENT = "Labels are used in the clear (ldp.label_epsilon unset): no guarantee covers them."
COMBINED_STATEMENT = (
    "Text and label together, CONSERVATIVE UPPER BOUND: basic composition ε_stream + ε₂ at δ_stream "
    "of the training-stream guarantee (text, under its assumptions) and the label guarantee, for a "
    "neighbour that changes one example's text and label. Not tight, and not a ledger entry (the two "
    "guarantees use different neighbouring relations: add/remove and replace-one).")


#: What ``ldp.reproduce: dp_forward_code`` does as DP-Forward's official code does
#: (github xiangyue9607/DP-Forward), each a reason the run is NOT CERTIFIED or not comparable.
REPRO_FLAWS = {
    "i": "the layers before the noise (pre(·), and the projection) are trained through the noise, non-privately "
         "(add_noise does not detach; freeze_pre_noise_layers never runs): gradients of clean inputs reach "
         "the user-side weights",
    "ii": "noise std σ·C instead of σ·2C (sensitivity hard-coded to 1, but the replace-one sensitivity of a "
          "matrix clipped to C is 2C)",
    "iii": "σ calibrated with sampling rate q = 1/N over N·E compositions although training uses batches of "
           "B > 1 (q = B/N): the claimed ε does not describe the releases made",
    "iv": "at `output` the pooled [CLS] vector (after the pooler) is noised",
    "v": "the attention mask is passed to the layers after the noise (token count released in the clear)",
    "vi": "the projection (autoencoder) is trained from random initialisation end to end, with no public "
          "pre-training",
    "vii": "no noise at inference (dev inputs unprotected)",
}
REPRO_REASON = ("ldp.reproduce: dp_forward_code reproduces DP-Forward's official code: "
                + "; ".join(f"({k}) {v}" for k, v in REPRO_FLAWS.items()))


def dp_forward_code_sigma(target_epsilon: float, delta: float, n: int, epochs: int) -> float:
    """σ as DP-Forward's code calibrates it (flaw iii): ``PoissonSampled(1/N, Gaussian(σ))``
    composed N·E times to ``target_epsilon`` at ``delta`` (PLD, dp_accounting), σ relative to a
    sensitivity of 1 (noise std σ·C, flaw ii). SST-2 (N = 67,349, E = 3, δ = 1e-5):
    σ = 0.4216 / 0.3745 / 0.3195 at ε = 2 / 4 / 8. NOT a certified calibration."""
    from dpft.accounting.calibrate import calibrate_sigma

    return calibrate_sigma(target_epsilon, delta, 1.0 / n, n * epochs)


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
            from dpft.methods.ldp_train_pre import check_trainable, pre_parameters

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
        elif "i" not in f:
            self.split.pre_cache = {}  # frozen pre(·): computed once per example (speed only)
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
        from dpft.methods.ldp_train_pre import calibrate, effective_sigma

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
            from dpft.accounting.ledger import PrivacyReport

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
        from dpft.methods.ldp_train_pre import combined_event

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


#: What ``ldp.train_pre`` protects (issue 29).
TRAIN_PRE_STATEMENT = (
    "ldp.train_pre: pre(·) is trained by DP-SGD. Each step releases, on one Poisson-sampled batch, the noisy codes "
    "(σ_rep, sensitivity 2C) and the noisy sum of pre(·)'s per-example gradients clipped to C_g (σ_grad); the "
    "ledger records them as ONE event PoissonSampled(q, Gaussian(σ_eff)), σ_eff⁻² = σ_rep⁻² + σ_grad⁻² (two "
    "Gaussians on the same data; sampled once, so amplification is applied once). Inference: the LDP layer "
    "protects each input (local guarantee of one release at σ_rep). Training: the example-level ε covers both "
    "releases; the party that trains pre(·) runs it on clean inputs and adds the gradient noise (trusted, as "
    "in DP-SGD), so the split deployment (a server that never sees a clean input) cannot run this mode. "
    "'linked_rows_epsilon_with_gradients' composes, without amplification, an example's code and gradient "
    "releases (PLD, replace-one).")
#: Headline qualifier of a forward-LDP run without label privacy (issue 13).
LABELS_NOT_PROTECTED = "ε covers the inputs only; labels are not protected (set ldp.label_epsilon)"
#: Qualifier of ``ldp.mask_after_noise`` (issue 18): the mask is an un-noised function of the length.
LENGTH_NOT_PROTECTED = ("token counts are not protected: the attention mask given to post(·) is not noised, "
                        "so ε covers the text of inputs of equal token count (set ldp.mask_after_noise: false "
                        "to protect the count too)")
#: Which dev accuracy the inference-time guarantee covers.
INFERENCE_STATEMENT = (
    "dev_accuracy_noisy_inference: every dev input is clipped and noised at the last epoch's σ before post(·) "
    "sees it, so each dev prediction is a post-processing of one (ε_loc, δ)-LDP release of that input (local "
    "guarantee, 'epsilon_per_release_by_epoch'[-1]; with ldp.mask_after_noise its token count is in the clear). "
    "dev_accuracy_clean_inference: the same model on un-noised inputs — no inference-time protection of the "
    "dev input (the model itself still carries the training guarantee). dev_accuracy is the one ldp.eval_noise "
    "selects.")


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
        the combined event (methods/ldp_train_pre.py). Frozen pre(·): the step unchanged."""
        tp = self.cfg.train_pre
        if not tp.enabled:
            return spec
        from dpft.methods.ldp_train_pre import PHASE_TRAIN_PRE, TrainPreEngine, TrainPreMechanism
        from dpft.step.clip import make_clip_policy

        clip = make_clip_policy("flat", tp.max_grad_norm)
        eng = TrainPreEngine(self.ldp.split, run.loss_fn, clip, self.ldp.first_block, tp.embeddings, tp.engine)
        mech = TrainPreMechanism(self.ldp.schedule.sigmas[0], self.ldp.sigma_grad, clip.sensitivity, run.rng,
                                 eng.pre_names)
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
        layer = self.ldp.layer
        keep, gen = layer.eval_noise, layer.generator
        self._n_eval = getattr(self, "_n_eval", 0) + 1
        out: dict = {}
        try:
            for noisy in (not keep, keep):  # the headline last (its predictions are the ones kept)
                layer.eval_noise = noisy
                layer.generator = run.rng.stream("ldp_eval", self._n_eval, *rank_parts(run), device=run.device)
                res = evaluate()
                tag = "noisy" if noisy else "clean"
                out.update({f"{k}_{tag}_inference": v for k, v in res.items()})
                if noisy == keep:
                    out.update(res)
        finally:
            layer.eval_noise, layer.generator = keep, gen
        return out

    def privacy_section(self, run):
        return self.ldp.privacy_section(run.total_steps)

    def report(self, run) -> dict:
        return self.ldp.summary()

    @classmethod
    def markdown(cls, rep) -> list[str]:
        from dpft.report.report import ldp_markdown

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
def ldp_stream(run, step: int):
    """The secret stream of step ``step``'s forward-LDP releases on this process: ``ldp``, step
    (and the rank under DDP, :func:`rank_parts`), drawn on the model's device."""
    return run.rng.stream("ldp", int(step), *rank_parts(run), device=run.device)


def rank_parts(run) -> tuple:
    """Extra parts of a per-example noise stream's name under DDP: ``("rank", r)`` with K > 1
    processes (each rank noises other examples: the same draw on two ranks would let anyone who
    sees both releases subtract the noise), none in one process (its streams stay as they were)."""
    k = int(getattr(run, "world_size", 1) or 1)
    return ("rank", int(getattr(run, "rank", 0))) if k > 1 else ()


def privatize_labels(ds, eps: float, num_labels: int, generator):
    """Replace the ``label`` column of a tokenised split by K-ary randomized response, drawn once.

    Returns ``(dataset with the noisy labels, (N,) int64 noisy labels)``. The same noisy label is
    then used at every step and epoch: post-processing, so the label guarantee is ε₂ however
    long training runs. ``generator`` is the run's secret stream ``rng.stream("label_rr")``
    (a :class:`~dpft.privacy.randomness.SecretStream`): with its secret and the data one could
    tell which labels were kept.
    """
    if "label" not in ds.column_names:
        raise LDPError("ldp.label_epsilon needs a labelled classification task (no 'label' column)")
    y = torch.tensor([int(v) for v in ds["label"]], dtype=torch.long)
    noisy = randomized_response(y, eps, num_labels, generator)
    return ds.remove_columns("label").add_column("label", noisy.tolist()), noisy


def max_releases_per_epoch(sampler, n: int, epochs: int, steps_per_epoch: int, upto: int) -> list[int]:
    """Largest number of releases of one example in each epoch, over steps ``< upto`` (from the
    seeded sampler: data-independent, so this statistic is public)."""
    out = []
    for e in range(epochs):
        counts = torch.zeros(n, dtype=torch.long)
        for step in range(e * steps_per_epoch, min((e + 1) * steps_per_epoch, upto)):
            counts[sampler.indices(step)] += 1
        out.append(int(counts.max()) if n else 0)
    return out


def linked_section(release_sigmas: list[float], delta: float, eps_label: float | None,
                   num_labels: int) -> dict[str, Any]:
    """Example-level guarantee without amplification (server links rows to users): PLD
    replace-one composition (dp_accounting) of the σ's of one example's releases, without and
    with its RR label."""
    return {
        "statement": LINKED_STATEMENT,
        "delta": delta,
        "releases": len(release_sigmas),
        "epsilon": local_epsilon_composed(release_sigmas, delta),
        "epsilon_with_label": (example_epsilon_with_label(release_sigmas, delta, eps_label, num_labels)
                               if eps_label is not None else None),
    }


def label_section(eps_label: float | None, num_labels: int, correction: bool, stream_epsilon: float,
                  stream_delta: float) -> dict[str, Any]:
    """The label guarantee (ε₂, δ = 0, via dp_accounting) and the conservative combined bound."""
    if eps_label is None:
        return {"privacy": "none", "statement": LABEL_CLEAR_STATEMENT}
    e2 = label_epsilon(eps_label, num_labels)
    return {
        "privacy": "randomized response", "statement": LABEL_STATEMENT,
        "epsilon": e2, "delta": 0.0, "label_epsilon_configured": eps_label, "num_labels": num_labels,
        "keep_probability": rr_keep_probability(eps_label, num_labels),
        "loss": "forward-corrected (Patrini et al. 2017)" if correction else "cross-entropy on the noisy labels",
        "combined_upper_bound": {"epsilon": stream_epsilon + e2, "delta": stream_delta,
                                 "method": "basic composition (sum of ε's): an upper bound",
                                 "statement": COMBINED_STATEMENT},
    }
