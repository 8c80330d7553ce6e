"""``ldp.train_pre``: pre(·) of a forward-LDP model (EW-FT / DP-Forward) adapted by DP-SGD.

Certified version of what DP-Forward's code does non-privately (REPRO_FLAWS (i), which the
issue-18 ablation showed carries its accuracy). Each step, on one Poisson-sampled batch S:

1. representation release (the forward-LDP layer, privacy/ldp.py): per example
   ``z_i = clip_C(enc(pre(x_i))) + N(0, (σ_rep·2C)² I)``; post(·) and the head are trained on
   the ``z_i`` with plain gradients, as with a frozen pre(·);
2. gradient release (DP-SGD, Abadi et al. 2016): per example the gradient of ``ℓ(post(z_i), y_i)``
   with respect to the trained part of pre(·) *through the noise layer* (the noise is additive,
   so ``∂z_i/∂θ = ∂clip_C(enc(pre(x_i)))/∂θ``), clipped to ``C_g`` (flat L2, the policy's
   sensitivity), summed over S, plus ``N(0, (σ_grad·C_g)² I)``.

Accounting (one ledger event per step). Both releases are Gaussian mechanisms on the *same*
sampled batch S, so the step is one subsampled mechanism ``PoissonSampled(q,
Composed([Gaussian(σ_rep), Gaussian(σ_grad)]))``, each σ relative to its own sensitivity:
σ_rep to 2C (what the frozen EW-FT accounting uses, ewft.py STREAM_STATEMENT), σ_grad to C_g
(add/remove, the DP-SGD sum). Two Gaussians with independent noise on the same data are one
Gaussian of multiplier ``σ_eff = (σ_rep⁻² + σ_grad⁻²)^(-1/2)`` (whiten the concatenated
output; Mironov, Talwar & Zhang 2019, Sec. 3 — dp_accounting's RDP accountant reduces a
Composed inner event the same way), and sampling happens once, so the ledger records
``PoissonSampled(q, Gaussian(σ_eff))``: amplification is applied once, not once per release
(two separately sampled events would under-count ε). The PLD accountant of the ledger does not
take a Composed inner event, hence the σ_eff form; ``combined_event`` gives both.

Calibration: the recipe fixes the ratio ρ = σ_grad / σ_rep; σ_eff is calibrated to the target ε
by dp_accounting (accounting/calibrate.py, PLD, after the ledger's earlier events), then
``σ_rep = σ_eff·√(1 + ρ⁻²)``, ``σ_grad = ρ·σ_rep``.

Threat model (what each part protects): at inference the LDP layer protects each input (one
local release). In training the example-level (central) guarantee covers both releases; the
party that computes pre(·)'s per-example gradients runs pre(·) on clean inputs and adds the
gradient noise (trusted, as in DP-SGD) — so a server that must never see a clean input cannot
run this mode (the split deployment, ``dpft ldp-server``, does not support it).
"""

from __future__ import annotations

import math
from typing import Mapping

import dp_accounting as dpa
import torch
from torch import nn

from dpft.grads.base import ClippedBatch, PerExampleEngine
from dpft.privacy.ldp import LDPError, clip_frobenius
from dpft.accounting.calibrate import calibrate_sigma
from dpft.step.build import make_engine
from dpft.step.noise import GaussianMechanism

#: Ledger phase of the combined per-step event.
PHASE_TRAIN_PRE = "ldp-forward+dp-sgd"
#: Batch key of ∂ℓ_i/∂z_i given to the surrogate loss of the pre(·) engine.
_GZ = "_ldp_grad_z"
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def effective_sigma(sigma_rep: float, sigma_grad: float) -> float:
    """σ of the one Gaussian equal to two on the same data: ``(σ_rep⁻² + σ_grad⁻²)^(-1/2)``
    (each σ relative to its own sensitivity; Mironov et al. 2019, Sec. 3). 0 if either is 0."""
    if sigma_rep <= 0 or sigma_grad <= 0:
        return 0.0
    return float((sigma_rep ** -2 + sigma_grad ** -2) ** -0.5)


def split_sigmas(sigma_eff: float, ratio: float) -> tuple[float, float]:
    """``(σ_rep, σ_grad)`` with ``σ_grad = ratio·σ_rep`` and effective σ ``sigma_eff``."""
    if not ratio > 0:
        raise LDPError(f"ldp.train_pre.noise_ratio must be > 0, got {ratio}")
    s_rep = sigma_eff * math.sqrt(1.0 + ratio ** -2)
    return float(s_rep), float(ratio * s_rep)


def step_event(q: float, sigma_rep: float, sigma_grad: float) -> dpa.DpEvent:
    """The ledger event of one step: ``PoissonSampled(q, Gaussian(σ_eff))``."""
    return dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(effective_sigma(sigma_rep, sigma_grad)))


def combined_event(q: float, sigma_rep: float, sigma_grad: float) -> dpa.DpEvent:
    """The same step written as the two releases: ``PoissonSampled(q, Composed([Gaussian(σ_rep),
    Gaussian(σ_grad)]))`` (RDP accounts it; PLD does not take a Composed inner event)."""
    return dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma_rep),
                                                              dpa.GaussianDpEvent(sigma_grad)]))


def calibrate(target_epsilon: float, delta: float, q: float, steps: int, ratio: float,
              prior=()) -> tuple[float, float, float]:
    """``(σ_rep, σ_grad, σ_eff)`` meeting ``target_epsilon`` at ``delta`` over ``steps`` steps
    (PLD via dp_accounting, after ``prior`` events; never below the target's σ).

    Raises:
        CalibrationError: unreachable target."""
    s_eff = calibrate_sigma(target_epsilon, delta, q, steps, prior=list(prior))
    s_rep, s_grad = split_sigmas(s_eff, ratio)
    # rounding must not lower the effective σ below the calibrated one
    while effective_sigma(s_rep, s_grad) < s_eff:
        s_rep, s_grad = s_rep * (1 + 1e-12), s_grad * (1 + 1e-12)
    return s_rep, s_grad, s_eff


class PreTail(nn.Module):
    """The trained part of pre(·) and the user-side encoder: hidden state after the frozen
    blocks → clipped code ``clip_C(enc(blocks[k0:cut](h)))`` ``(B, T, k)`` (``(B, 1, k)`` with
    ``release_cls``). Runs in eval mode (no dropout) so the engine's forward equals the one whose
    output was released. Holds the split's modules (no copies): gradients land on them."""

    def __init__(self, split, first_block: int, embeddings: bool):
        super().__init__()
        base = split.model.bert
        self._split = [split]  # not a submodule: only the trained tail's parameters are here
        self.first = int(first_block)
        self.embeddings = base.embeddings if embeddings else None
        self.blocks = nn.ModuleList(list(base.encoder.layer)[self.first: split.cut])
        ae = split.noise.autoencoder
        self.encoder = ae.encoder if ae is not None else None

    @property
    def split(self):
        return self._split[0]

    def forward(self, hidden=None, attention_mask=None, input_ids=None, token_type_ids=None):
        from transformers.masking_utils import create_bidirectional_mask

        s, base = self.split, self.split.model.bert
        was = base.training
        base.eval()
        try:
            h = base.embeddings(input_ids=input_ids, token_type_ids=token_type_ids) if self.embeddings is not None \
                else hidden
            if len(self.blocks):
                m = create_bidirectional_mask(config=base.config, inputs_embeds=h, attention_mask=attention_mask)
                for blk in self.blocks:
                    h = blk(h, attention_mask=m)
                    h = h[0] if isinstance(h, tuple) else h
            if s.release_cls:
                h = h[:, :1]
            z = self.encoder(h) if self.encoder is not None else h
            return clip_frobenius(z, s.noise.max_norm, s.noise.normalize)
        finally:
            base.train(was)


def frozen_prefix(split, first_block: int, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
    """Hidden state after the frozen part of pre(·) (embeddings and blocks ``< first_block``),
    no gradient, eval mode; inputs padded to ``max_length`` as the release is."""
    from transformers.masking_utils import create_bidirectional_mask

    base = split.model.bert
    was = base.training
    base.eval()
    try:
        with torch.no_grad():
            h = base.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
            if first_block:
                m = create_bidirectional_mask(config=base.config, inputs_embeds=h, attention_mask=attention_mask)
                for blk in base.encoder.layer[:first_block]:
                    h = blk(h, attention_mask=m)
                    h = h[0] if isinstance(h, tuple) else h
        return h
    finally:
        base.train(was)


def _surrogate_loss(forward, batch):
    """``<clip_C(enc(pre(x_i))), ∂ℓ_i/∂z_i>`` per example: its gradient in θ_pre is the exact
    per-example gradient of ℓ_i through the noise layer (``∂ℓ_i/∂z_i`` held fixed)."""
    out = forward(**{k: batch[k] for k in ("hidden", *_INPUTS) if k in batch})
    return (out.float() * batch[_GZ].float()).flatten(1).sum(1)


class TrainPreEngine(PerExampleEngine):
    """One micro-batch of an ``ldp.train_pre`` step: per-example clipped gradients of the
    trained part of pre(·) (through the noise layer), plain summed gradients of post(·).

    ``clipped_sum(batch)`` (``batch``: input_ids, attention_mask, token_type_ids, labels ``(B, …)``):
    draws the representation noise from ``split.noise.generator`` (the step's secret stream),
    runs post(·) on the noisy codes, backpropagates the summed loss (post(·) gradients, and
    ``∂ℓ_i/∂z_i`` per example), then the per-example engine ``engine`` (book-keeping or
    reference) on :class:`PreTail` with the surrogate loss gives ``Σ_i c_i g_i`` for pre(·).
    ``sq_norms``/``scales`` are pre(·)'s (the clipped part).

    Args:
        split: the :class:`~dpft.privacy.ldp.SplitClassifier`.
        loss_fn: per-example loss of the task (``(forward, batch) -> (B,)``).
        clip: flat clip policy of pre(·)'s gradient (sensitivity C_g).
        first_block: first trained block of pre(·) (blocks before it stay frozen).
        embeddings: also train the embeddings (then ``first_block`` must be 0).
        engine: ``bookkeeping`` or ``reference`` (grads/).
    """

    #: Under FSDP2 the driver runs the step this factory builds (``(spec, ledger, n, world, on_release)``;
    #: dpft/session/step.py ``step_for``): methods/ewft/method.py sets methods/ewft/fsdp.py ``make_step``.
    fsdp_step = None

    def __init__(self, split, loss_fn, clip, first_block: int, embeddings: bool = False,
                 engine: str = "bookkeeping"):
        super().__init__(split, loss_fn, clip)

        if embeddings and first_block:
            raise LDPError("ldp.train_pre.embeddings needs every block of pre(·) trained (train_pre.blocks unset)")
        self.first_block = int(first_block)
        self.engine_name = engine
        self.tail = PreTail(split, first_block, embeddings)
        self.pre_engine = make_engine(engine, self.tail, _surrogate_loss, clip)
        ids = {id(p): n for n, p in self.params.items()}
        #: PreTail name → split name, and the split names that are post(·) (plain gradient).
        self.pre_map = {n: ids[id(p)] for n, p in self.pre_engine.params.items()}
        self.pre_names = set(self.pre_map.values())
        self.post_names = [n for n in self.param_names if n not in self.pre_names]
        #: Per-example cache of the frozen prefix's output (embeddings and blocks before the
        #: trained ones: frozen and deterministic, each example padded on its own). Speed only.
        self.prefix_cache: dict | None = {} if embeddings is False else None

    def prefix(self, ids, am, tt) -> torch.Tensor:
        """:func:`frozen_prefix` of the rows, through the cache."""
        if self.prefix_cache is None:
            return frozen_prefix(self.model, self.first_block, ids, am, tt)
        keys = [repr((r.tolist(), m.tolist(), t.tolist())) for r, m, t in zip(ids, am, tt)]
        miss = [i for i, k in enumerate(keys) if k not in self.prefix_cache]
        if miss:
            h = frozen_prefix(self.model, self.first_block, ids[miss], am[miss], tt[miss])
            for j, i in enumerate(miss):
                self.prefix_cache[keys[i]] = h[j].clone()
        return torch.stack([self.prefix_cache[k] for k in keys])

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        from transformers.modeling_outputs import SequenceClassifierOutput

        split = self.model
        self.pre_engine.clip = self.clip
        ids, am, tt = split._pad(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))
        with torch.no_grad():
            hidden = None if self.tail.embeddings is not None else self.prefix(ids, am, tt)
            zc = self.tail(hidden=hidden, attention_mask=am, input_ids=ids, token_type_ids=tt)
            z = zc + split.noise.noise_like(zc)  # the representation release (training: always noised)
        z = z.detach().requires_grad_(True)
        mask = split.padded_mask(batch["input_ids"], batch.get("attention_mask")) if split.pass_mask else None
        for p in self.params.values():
            p.grad = None
        losses = self.loss_fn(lambda **_: SequenceClassifierOutput(logits=split.post(z, mask)), batch)
        losses.sum().backward()
        gz = z.grad.detach()
        post = {n: (self.params[n].grad.detach().float() if self.params[n].grad is not None
                    else torch.zeros(self.params[n].shape, device=self.params[n].device)) for n in self.post_names}
        for p in self.params.values():
            p.grad = None
        sub = {_GZ: gz, "attention_mask": am}
        if self.tail.embeddings is not None:
            sub.update(input_ids=ids, token_type_ids=tt)
        else:
            sub["hidden"] = hidden
        res = self.pre_engine.clipped_sum(sub)
        grad_sum = {**post, **{self.pre_map[n]: g for n, g in res.grad_sum.items()}}
        return ClippedBatch(grad_sum, res.sq_norms, res.scales, float(losses.detach().sum()), res.n, res.overflowed)


class TrainPreMechanism:
    """The gradient half of an ``ldp.train_pre`` step's release, and its one ledger event.

    ``release(grad_sum, sensitivity, q, step)`` adds ``N(0, (σ_grad·C_g)²)`` to pre(·)'s
    entries only (through a :class:`~dpft.step.noise.GaussianMechanism`: the run's secret stream
    ``noise``, (step, name)); post(·)'s sums pass unchanged (post-processing of the released
    codes); returns ``PoissonSampled(q, Gaussian(σ_eff))`` for both releases of the step.
    """

    stateful = False  # no secret state beyond the key (step/noise.py)

    def __init__(self, sigma_rep: float, sigma_grad: float, sensitivity: float, rng, pre_names):
        self.sigma_rep = float(sigma_rep)
        self.sigma_grad = float(sigma_grad)
        self.gauss = GaussianMechanism(sigma_grad, sensitivity, rng)
        self.pre_names = set(pre_names)

    @property
    def sigma(self) -> float:
        return self.sigma_grad

    @property
    def std(self) -> float:
        return self.gauss.std

    def event(self, q: float) -> dpa.DpEvent:
        return step_event(q, self.sigma_rep, self.sigma_grad)

    def event_at(self, step: int, q: float) -> dpa.DpEvent:
        """Step ``step``'s event at rate ``q``: :meth:`event` (independent noise at every step; the
        mechanism family's one interface, step/noise.py)."""
        return self.event(q)

    def release(self, grad_sum: dict[str, torch.Tensor], sensitivity: float, q: float,
                step: int) -> tuple[dict[str, torch.Tensor], dpa.DpEvent]:
        self.gauss.sensitivity = float(sensitivity)
        noisy = self.gauss.add_noise({n: t for n, t in grad_sum.items() if n in self.pre_names}, step)
        return {n: noisy.get(n, t) for n, t in grad_sum.items()}, self.event(q)


def pre_parameters(split, first_block: int, embeddings: bool) -> list[nn.Parameter]:
    """The parameters ``ldp.train_pre`` trains: blocks ``first_block … cut-1`` of pre(·), the
    autoencoder's encoder, and (``embeddings``) the embedding layer."""
    base = split.model.bert
    mods: list[nn.Module] = list(base.encoder.layer)[first_block: split.cut]
    if embeddings:
        mods.append(base.embeddings)
    if split.noise.autoencoder is not None:
        mods.append(split.noise.autoencoder.encoder)
    return [p for m in mods for p in m.parameters()]


def check_trainable(params: list, what: str) -> None:
    if not params:
        raise LDPError(f"ldp.train_pre: {what} has no parameter to train (position embeddings without an "
                       "autoencoder and train_pre.embeddings false); set train_pre.embeddings: true or move "
                       "ldp.position after a block")


__all__ = ["PHASE_TRAIN_PRE", "effective_sigma", "split_sigmas", "step_event", "combined_event", "calibrate",
           "PreTail", "TrainPreEngine", "TrainPreMechanism", "pre_parameters", "frozen_prefix"]
