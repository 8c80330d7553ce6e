"""DP-Adam-AC (Yang, "DP-Adam-AC: Privacy-preserving Fine-Tuning of Localizable Language Models
Using Adam Optimization with Adaptive Clipping", Alg. 1), wired into the Trainer, made private.

This file wires pieces and holds no math of its own:

- clip policy: ``AdaptiveQuantileClip`` (Andrew et al. 2021; privacy/clipping.py) when
  ``adam_ac.adaptive_clip``; the gradient noise uses σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) so the
  ledger's one ``GaussianDpEvent(σ)`` per step covers the gradient and the count;
- optimizer: ``DPAdam`` (optim/dp_adam.py) with AdamBC's noise-variance correction and
  Adam-AC's γ (driven by the privatised clip rate 1 − b̃), EMA of the weights;
- ``adam_ac.reproduce_paper``: the paper's leaky rule (raw-norm percentile C, raw clip rate
  γ) — the ledger is marked NOT CERTIFIED.

The paper's rule needs the *raw* norms; the private rule needs only the number of unclipped
examples, which the loop already counts.
"""

from __future__ import annotations

from typing import Any

import torch

from dpft.optim.dp_adam import DPAdam, GammaNudger, WeightEMA
from dpft.step.clip import AdaptiveQuantileClip, PaperPercentileClip, effective_noise_multiplier

#: Why the paper's rule cannot be certified (printed in the report).
PAPER_REASON = ("reproduce_paper: the clip norm C is the percentile of raw, un-noised per-example gradient "
                "norms and the learning-rate multiplier γ follows the raw clip rate (Yang, Alg. 1 lines "
                "19-27), so data-dependent statistics steer training outside the Gaussian mechanism")


def _active(ac) -> bool:
    return bool(ac.adaptive_clip or ac.gamma_nudge or ac.ema_decay or ac.bias_correction or ac.reproduce_paper)


def setup_clip(tr) -> None:
    """Replace ``tr.clip`` (and σ of the noise) as ``recipe.adam_ac`` says. Called only for
    private runs, before the engine is built.

    Raises:
        ValueError: adaptive clipping with a non-flat style, or σ ≥ 2σ_b.
    """
    r = tr.recipe
    ac = r.adam_ac
    if not (ac.adaptive_clip or ac.reproduce_paper):
        return
    if r.privacy.clipping.style != "flat":
        raise ValueError("adam_ac.adaptive_clip / reproduce_paper need privacy.clipping.style: flat")
    if ac.adaptive_clip and ac.reproduce_paper:
        raise ValueError("choose one of adam_ac.adaptive_clip (private) or adam_ac.reproduce_paper (leaky)")
    c0 = r.privacy.clipping.max_norm
    if ac.reproduce_paper:
        tr.clip = PaperPercentileClip(c0, ac.target_clip_rate, ac.paper_history, ac.min_clip, ac.max_clip)
        tr.ledger.mark_not_certified(PAPER_REASON)
        return
    sigma_b = ac.count_noise if ac.count_noise is not None else r.batch.expected_batch_size / 20.0
    tr.noise_sigma = effective_noise_multiplier(tr.sigma, sigma_b)
    tr.clip = AdaptiveQuantileClip(c0, 1.0 - ac.target_clip_rate, ac.clip_lr, sigma_b, ac.min_clip, ac.max_clip,
                                   rng=tr.rng)


def make_dp_adam(params, o, ac) -> DPAdam:
    """``DPAdam`` for ``optimizer.name`` adam (no decay) or adamw (decoupled decay).

    Raises:
        ValueError: SGD with Adam-only options.
    """
    if o.name not in ("adam", "adamw"):
        raise ValueError("adam_ac.bias_correction / gamma_nudge need optimizer.name adam or adamw")
    if o.name == "adam" and o.weight_decay:
        raise ValueError("optimizer.name adam with weight_decay: use adamw (decoupled decay) with DP-Adam-AC")
    return DPAdam(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                  bias_correction=ac.bias_correction, bc_floor=ac.bc_floor)


def setup_optim(tr) -> None:
    """γ nudger, EMA and AdamBC's noise-variance transform; sets ``tr.adam_ac_active``."""
    ac = tr.recipe.adam_ac
    tr.adam_ac_active = _active(ac)
    tr.ema = WeightEMA(tr.params, ac.ema_decay) if ac.ema_decay else None
    tr.gamma = GammaNudger(ac.rho_low, ac.rho_high, ac.gamma_up, ac.gamma_down, ac.gamma_min,
                           ac.gamma_max) if (ac.gamma_nudge or ac.reproduce_paper) else None
    if ac.gamma_nudge and not (ac.adaptive_clip or ac.reproduce_paper) and tr.private:
        raise ValueError("adam_ac.gamma_nudge needs a privatised clip rate: set adam_ac.adaptive_clip: true")
    if tr.adam_ac_active and tr.resume:
        raise ValueError("--resume is not supported with adam_ac options yet (C, γ and the EMA are not "
                         "checkpointed); start a new run")
    if ac.bias_correction:
        if not isinstance(tr.optimizer, DPAdam):
            raise ValueError("adam_ac.bias_correction needs optimizer.name adam or adamw")

        def set_noise_variance(grads, ctx):
            # Φ = (σ_Δ C / (qN))²: per-coordinate variance of the noise in the averaged gradient.
            tr.optimizer.set_noise_variance(float(ctx["noise_std"]) ** 2)
            return grads

        tr.transforms.append(set_noise_variance)


def after_step(tr, step: int, bsz: int, clipped: int, raw_norms: list, expected: float) -> dict[str, Any]:
    """Post-update bookkeeping of one step: EMA, C update, γ update. Returns log fields.

    Private path: b̃ is released here (noise σ_b) and drives both C and γ. Paper path: the raw
    norms and raw clip rate drive them (NOT CERTIFIED).
    """
    ac = tr.recipe.adam_ac
    out: dict[str, Any] = {}
    if tr.ema is not None:
        tr.ema.update()
    rate = None
    if tr.private and isinstance(tr.clip, AdaptiveQuantileClip):
        out["clip_norm"] = tr.clip.max_norm  # the C used in this step
        b = tr.clip.noisy_unclipped_fraction(bsz - clipped, bsz, expected, step)
        tr.clip.update(b)
        rate = min(1.0, max(0.0, 1.0 - b))
        out["clip_rate_private"] = rate
    elif tr.private and isinstance(tr.clip, PaperPercentileClip):
        out["clip_norm"] = tr.clip.max_norm
        rate = clipped / max(bsz, 1)  # raw: leaks (reproduction only)
        if raw_norms:
            tr.clip.update_from_norms(torch.cat(raw_norms))
    if tr.gamma is not None:
        if rate is None:
            raise ValueError("adam_ac.gamma_nudge needs a privatised clip rate: set adam_ac.adaptive_clip: true")
        tr.optimizer.lr_scale = tr.gamma.update(rate)
        out["gamma"] = tr.gamma.gamma
    return out


@torch.no_grad()
def evaluate(tr) -> dict[str, float]:
    """Dev metrics of the EMA weights when kept (the paper evaluates the EMA) and of the raw
    weights (``*_raw``); causal LM: loss per token and perplexity."""
    from dpft.eval.lm import lm_eval

    def one() -> dict[str, float]:
        if tr.causal:
            return lm_eval(tr.model, list(tr.dev_tok), tr.pad_id, tr.recipe.eval.batch_size)
        return tr._evaluate_classifier()

    if tr.ema is None:
        return one()
    raw = one()
    with tr.ema.swap():
        ema = one()
    return {**ema, **{f"{k}_raw": v for k, v in raw.items()}}


def generate(tr) -> list[dict[str, str]]:
    """Sampled continuations of ``eval.prompts`` (EMA weights when kept)."""
    from dpft.eval.lm import sample_generations

    e = tr.recipe.eval
    if tr.ema is None:
        return sample_generations(tr.model, tr.tokenizer, e.prompts, e.max_new_tokens, seed=tr.recipe.seed)
    with tr.ema.swap():
        return sample_generations(tr.model, tr.tokenizer, e.prompts, e.max_new_tokens, seed=tr.recipe.seed)
