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

import torch
from pydantic import Field

from dpft.config import _Strict
from dpft.methods.base import Method, register_method

from dpft.accounting.calibrate import check_delta
from dpft.accounting.ewpba import SIGMA_FLOOR, NoiseSchedule, make_schedule, schedule_epsilon
from dpft.privacy.label_rr import (example_epsilon_with_label, label_epsilon, make_corrected_classification_loss,
                                   randomized_response, rr_keep_probability, rr_transition_matrix)
from dpft.privacy.ldp import (GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, local_epsilon,
                              local_epsilon_composed, pretrain_autoencoder)

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
        #: Label privacy (ldp.label_epsilon): RR labels drawn once here, before training.
        self.num_labels = int(trainer.task.num_labels)
        self.noisy_labels: torch.Tensor | None = None
        if c.label_epsilon is not None:
            # RR draws from the run's secret randomness (stream label_rr); nothing is recorded.
            trainer.train_tok, self.noisy_labels = privatize_labels(trainer.train_tok, c.label_epsilon,
                                                                    self.num_labels, trainer.rng.generator("label_rr"))
            if c.label_loss_correction:
                # the Trainer builds its engine from trainer.loss_fn after this constructor
                trainer.loss_fn = make_corrected_classification_loss(
                    rr_transition_matrix(c.label_epsilon, self.num_labels))

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
        # The noise of this step's releases: the run's secret randomness, stream ldp, step.
        self.layer.generator = self.trainer.rng.generator("ldp", step)

    def after_step(self, step: int) -> None:
        # One event per step, empty batch or not: the step's release is the Poisson-sampled set.
        self.trainer.record(PHASE, self.schedule.step_event(step))

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
        return max_releases_per_epoch(t.sampler, t.n, self.epochs, self.steps_per_epoch, upto)

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
            # Without label RR the labels are used in the clear: the ε covers the inputs only.
            "scope": None if self.cfg.label_epsilon is not None else LABELS_NOT_PROTECTED,
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
        }

    def summary(self) -> dict[str, Any]:
        c = self.cfg
        return {"position": c.position, "max_norm": c.max_norm, "sensitivity": self.layer.sensitivity,
                "noise_std_by_epoch": [s * self.layer.sensitivity for s in self.schedule.sigmas],
                "autoencoder": c.autoencoder.sizes or None, "pretrain_loss": self.pretrain_loss,
                "pretrain_mse_of_zero": self.pretrain_baseline,
                "eval_noise": c.eval_noise, **self.schedule.as_dict(),
                "label_epsilon": c.label_epsilon,
                "label_loss_correction": bool(c.label_epsilon is not None and c.label_loss_correction),
                "release_shape": [self.trainer.recipe.model.max_length,
                                  (c.autoencoder.sizes[-1] if c.autoencoder.sizes
                                   else int(self.split.model.config.hidden_size))]}


#: Headline qualifier of a forward-LDP run without label privacy (issue 13).
LABELS_NOT_PROTECTED = "ε covers the inputs only; labels are not protected (set ldp.label_epsilon)"


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

    @classmethod
    def enabled(cls, cfg: LdpCfg) -> bool:
        return cfg.enabled

    def prepare(self, run) -> None:
        self.ldp = LDPRun(run)

    def before_step(self, step, run) -> None:
        self.ldp.before_step(step)

    def after_update(self, out, run) -> dict:
        self.ldp.after_step(out.step)
        return {}

    def epsilon(self, run):
        return self.ldp.epsilon()

    def privacy_section(self, run):
        return self.ldp.privacy_section(run.total_steps)

    def report(self, run) -> dict:
        return self.ldp.summary()

    @classmethod
    def markdown(cls, rep) -> list[str]:
        from dpft.report.report import ldp_markdown

        return ldp_markdown(rep)


# ---------------------------------------------------------------------------- shared helpers
def privatize_labels(ds, eps: float, num_labels: int, generator: torch.Generator):
    """Replace the ``label`` column of a tokenised split by K-ary randomized response, drawn once.

    Returns ``(dataset with the noisy labels, (N,) int64 noisy labels)``. The same noisy label is
    then used at every step and epoch: post-processing, so the label guarantee is ε₂ however
    long training runs. ``generator`` must come from the run's secret randomness (stream
    ``label_rr``): with its seed and the data one could tell which labels were kept.
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
