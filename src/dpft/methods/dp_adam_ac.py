"""DP-Adam-AC (Yang, "DP-Adam-AC: Privacy-preserving Fine-Tuning of Localizable Language Models
Using Adam Optimization with Adaptive Clipping", Alg. 1), a plug-in of the DP step, made private.

This file wires pieces and holds no math of its own:

- clip policy: ``AdaptiveQuantileClip`` (Andrew et al. 2021; step/clip.py) when
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

from contextlib import nullcontext
from typing import Any, Optional

import torch
from pydantic import Field

from dpft.config.base import PluginConfig
from dpft.methods.base import Method, register_method
from dpft.optim.dp_adam import DPAdam, GammaNudger, WeightEMA, swap_values
from dpft.placement.shards import full_on_rank0, is_sharded
from dpft.step.clip import AdaptiveQuantileClip, PaperPercentileClip, effective_noise_multiplier
from dpft.step.noise import GaussianMechanism

#: Why the paper's rule cannot be certified (printed in the report).
PAPER_REASON = ("reproduce_paper: the clip norm C is the percentile of raw, un-noised per-example gradient "
                "norms and the learning-rate multiplier γ follows the raw clip rate (Yang, Alg. 1 lines "
                "19-27), so data-dependent statistics steer training outside the Gaussian mechanism")


class AdamACCfg(PluginConfig):
    """DP-Adam-AC pieces (Yang, "DP-Adam-AC", Alg. 1), made private where the paper leaks.

    Adaptive clipping is Andrew et al. 2021's private quantile estimate (step/clip.py);
    γ nudging reads the *privatised* clip rate; DP-AdamBC is Tang et al. 2023 (optim/)."""

    #: Private adaptive clipping (noisy count of unclipped examples, geometric C update).
    adaptive_clip: bool = False
    #: Target clip rate ρ* (the paper's 0.2): C tracks the (1 − ρ*) quantile of ‖g_i‖.
    target_clip_rate: float = Field(0.2, gt=0, lt=1)
    #: Geometric step η_C of the C update, C ← C·exp(−η_C (b̃ − (1 − ρ*))).
    clip_lr: float = Field(0.2, gt=0)
    #: σ_b, the noise std of the unclipped count (default: expected batch / 20, Andrew et al.).
    count_noise: Optional[float] = Field(None, gt=0)
    min_clip: float = Field(1e-3, gt=0)
    max_clip: float = Field(1e3, gt=0)
    #: Adam-AC learning-rate multiplier γ from the privatised clip rate.
    gamma_nudge: bool = False
    rho_low: float = Field(0.1, ge=0, le=1)
    rho_high: float = Field(0.3, ge=0, le=1)
    gamma_up: float = Field(1.01, ge=1)
    gamma_down: float = Field(0.995, gt=0, le=1)
    gamma_min: float = Field(0.1, gt=0)
    gamma_max: float = Field(2.0, gt=0)
    #: EMA decay d of the weights (None = off); the EMA is evaluated and saved in model_ema/.
    ema_decay: Optional[float] = Field(None, gt=0, lt=1)
    #: DP-AdamBC (Tang et al. 2023): subtract the noise variance from v̂, floor at bc_floor.
    bias_correction: bool = False
    bc_floor: float = Field(1e-8, gt=0)
    #: REPRODUCTION ONLY: the paper's rule (C and γ from raw, un-noised norms). The run is
    #: marked NOT CERTIFIED and its report prints no ε.
    reproduce_paper: bool = False
    #: History length H of the paper's percentile rule.
    paper_history: int = Field(100, ge=1)


def _active(ac) -> bool:
    return bool(ac.adaptive_clip or ac.gamma_nudge or ac.ema_decay or ac.bias_correction or ac.reproduce_paper)


class _ShardedDPAdam(DPAdam):
    """DPAdam in an FSDP2 run: ``torch.distributed.checkpoint`` (``get_optimizer_state_dict``, what the
    run's per-rank checkpoints save: dpft/placement/fsdp_checkpoint.py) keys optimizer state by parameter only, so
    DPAdam's running Φ̂ (its non-parameter ``"_phi"`` entry) is kept beside the state during ``step``.
    It is not checkpointed: a run with adam_ac options does not resume (``DPAdamAC.prepare``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phi_state = self.state.pop("_phi")

    @torch.no_grad()
    def step(self, closure=None):
        self.state["_phi"] = self._phi_state
        try:
            return super().step(closure)
        finally:
            self._phi_state = self.state.pop("_phi")


def make_dp_adam(params, o, ac, sharded: bool = False) -> DPAdam:
    """``DPAdam`` for ``optimizer.name`` adam (no decay) or adamw (decoupled decay); ``sharded``
    (``perf.sharding: fsdp``): its FSDP2-checkpointable form (:class:`_ShardedDPAdam`).

    Raises:
        ValueError: SGD with Adam-only options.
    """
    if o.name not in ("adam", "adamw"):
        raise ValueError("adam_ac.bias_correction / gamma_nudge need optimizer.name adam or adamw")
    if o.name == "adam" and o.weight_decay:
        raise ValueError("optimizer.name adam with weight_decay: use adamw (decoupled decay) with DP-Adam-AC")
    cls = _ShardedDPAdam if sharded else DPAdam
    return cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
               bias_correction=ac.bias_correction, bc_floor=ac.bc_floor)


@register_method
class DPAdamAC(Method):
    """DP-Adam-AC's pieces as a plug-in.

    ``build``: the clip policy (private adaptive quantile, or the paper's leaky rule), the
    gradient-noise σ_Δ with the accounted σ unchanged, ``DPAdam`` (AdamBC's noise-variance
    transform, γ), the EMA. ``after_update``: EMA, the private C update from the noisy count, γ
    from the privatised clip rate. ``evaluate``: the EMA weights (and the raw ones as ``*_raw``).

    Raises:
        ValueError: adaptive clipping with a non-flat style, both adaptive and paper modes,
            γ without a privatised clip rate, --resume (C, γ and the EMA are not checkpointed).
    """

    name = "dp_adam_ac"
    config = AdamACCfg
    legacy_section = "adam_ac"
    report_key = "adam_ac"
    order = 40
    #: Under DDP: the private path reads the all-reduced counts and draws its count noise from
    #: the shared key (the paper's raw-norm path is refused by the driver's ``keep_norms`` check).
    supports_ddp = True
    #: Optimizer moments and the EMA are created like the parameters (zeros_like, clone); the
    #: count noise is a host scalar from the secret stream; the gradient noise is the step's.
    supports_device = True

    #: Under FSDP2: the noisy count reads the world's all-reduced counts (``FSDPStep._stats``) and
    #: draws from the shared key; the σ_Δ Gaussian mechanism of ``build`` is sharded by the step
    #: (``fsdp.shard_mechanism``); DPAdam, AdamBC's Φ and the EMA are elementwise on the shards; the
    #: EMA saved at the end is gathered at the last step (a collective every rank runs).
    supports_fsdp = True

    #: The noisy count counts rows: refused with user-level units (methods/python.py).
    example_level_only = True
    #: The count shares the step's one GaussianDpEvent(σ) (σ_Δ above); DPAdam, γ and the EMA are
    #: post-processing: the step's events are unchanged (a search may vary it).
    search_events_unchanged = True
    uncertified_fields = ("reproduce_paper",)

    @classmethod
    def enabled(cls, cfg: AdamACCfg) -> bool:
        return _active(cfg)

    @classmethod
    def python_refusal(cls, cfg: AdamACCfg) -> Optional[str]:
        """Private adaptive clipping runs in every way in (its C update reads only the noisy count,
        released in ``after_update``); the options that need the driver are refused by name."""
        why = []
        if cfg.reproduce_paper:
            why.append("reproduce_paper steers C and γ by raw, un-noised norms (NOT CERTIFIED); the driver keeps "
                       "those norms and marks the report")
        if cfg.bias_correction or cfg.gamma_nudge:
            why.append("bias_correction / gamma_nudge replace the optimizer with dpft's DPAdam built from the "
                       "recipe's optimizer section; keep your optimizer and set adaptive_clip alone")
        if cfg.ema_decay:
            why.append("ema_decay: the EMA weights are evaluated and saved (model_ema/) by the driver")
        if why:
            return "; ".join(why) + "; or run it with `dpft train`"
        return None

    @classmethod
    def sharded_refusal(cls, cfg: AdamACCfg) -> Optional[str]:
        """Every private option runs sharded; the paper's leaky rule does not (NOT CERTIFIED)."""
        if cfg.reproduce_paper:
            return ("reproduce_paper sets C from the percentile of raw per-example norms, which each rank holds "
                    "for its own examples only (a NOT CERTIFIED reproduction: run it in one process)")
        return None

    def __init__(self, cfg, recipe):
        super().__init__(cfg, recipe)
        #: FSDP2: the full EMA weights, gathered on every rank at the last step (``finish`` and
        #: ``weights`` then run on rank 0 alone, on a plain copy of the model).
        self._ema_full: Optional[dict[str, torch.Tensor]] = None
        self._run = None
        self.clip = None
        self.ema: Optional[WeightEMA] = None
        self.gamma: Optional[GammaNudger] = None
        self.optimizer = None
        self.noise_sigma: Optional[float] = None

    def prepare(self, run) -> None:
        ac = self.cfg
        if run.resume:
            raise ValueError("--resume is not supported with adam_ac options yet (C, γ and the EMA are not "
                             "checkpointed); start a new run")
        if ac.gamma_nudge and not (ac.adaptive_clip or ac.reproduce_paper) and run.private:
            raise ValueError("adam_ac.gamma_nudge needs a privatised clip rate: set adam_ac.adaptive_clip: true")
        if run.private and (ac.adaptive_clip or ac.reproduce_paper):
            if run.recipe.privacy.clipping.style != "flat":
                raise ValueError("adam_ac.adaptive_clip / reproduce_paper need flat clipping (privacy.clipping.style: "
                                 "flat; make_private / DPArguments: clipping='flat')")
            if ac.adaptive_clip and ac.reproduce_paper:
                raise ValueError("choose one of adam_ac.adaptive_clip (private) or adam_ac.reproduce_paper (leaky)")
            if ac.reproduce_paper:
                run.ledger.mark_not_certified(PAPER_REASON)

    def build(self, spec, run):
        from dpft.models.load import head_param_groups

        ac, r = self.cfg, run.recipe
        changes: dict[str, Any] = {}
        c0 = r.privacy.clipping.max_norm
        if run.private and ac.reproduce_paper:
            self.clip = PaperPercentileClip(c0, ac.target_clip_rate, ac.paper_history, ac.min_clip, ac.max_clip)
            changes.update(clip=self.clip, keep_norms=True)
        elif run.private and ac.adaptive_clip:
            sigma_b = ac.count_noise if ac.count_noise is not None else r.batch.expected_batch_size / 20.0
            self.noise_sigma = effective_noise_multiplier(run.sigma, sigma_b)
            self.clip = AdaptiveQuantileClip(c0, 1.0 - ac.target_clip_rate, ac.clip_lr, sigma_b, ac.min_clip,
                                             ac.max_clip, rng=run.rng)
            # One GaussianDpEvent(σ) covers the gradient (noise σ_Δ·C) and the count release.
            mech = GaussianMechanism(self.noise_sigma, self.clip.sensitivity, run.rng,
                                     hardened=r.privacy.hardened_noise, accounted_sigma=run.sigma)
            changes.update(clip=self.clip, mechanism=mech)
        params = spec.params if spec.params is not None else spec.engine.params
        if ac.bias_correction or ac.gamma_nudge or ac.reproduce_paper:
            # (only dpft train gets here: the Python ways in refuse these options, methods/python.py)
            self.optimizer = make_dp_adam(head_param_groups(params, r.optimizer.head_lr), r.optimizer, ac,
                                          sharded=r.perf.sharding == "fsdp")
            changes["optimizer"] = self.optimizer
        self.ema = WeightEMA(params, ac.ema_decay) if ac.ema_decay else None
        self._run = run  # weights(): the run's model now (after FSDP2, rank 0's plain copy)
        if ac.gamma_nudge or ac.reproduce_paper:
            self.gamma = GammaNudger(ac.rho_low, ac.rho_high, ac.gamma_up, ac.gamma_down, ac.gamma_min, ac.gamma_max)
        if ac.bias_correction:
            opt = self.optimizer

            def set_noise_variance(grads, ctx):
                # Φ = (σ_Δ C / (qN))²: per-coordinate variance of the noise in the averaged gradient.
                opt.set_noise_variance(float(ctx["noise_std"]) ** 2)
                return grads

            changes["transforms"] = [*spec.transforms, set_noise_variance]
        return spec.replace(**changes)

    def after_update(self, out, run) -> dict[str, Any]:
        """EMA, C update, γ update after one step. Released fields: the C used, the privatised
        clip rate and γ. Private path: b̃ is released here (noise σ_b) and drives both C and γ.
        Paper path: the raw norms and raw clip rate drive them (NOT CERTIFIED)."""
        res: dict[str, Any] = {}
        if self.ema is not None:
            self.ema.update()
            if out.step + 1 >= run.total_steps and any(is_sharded(t) for t in self.ema.shadow.values()):
                # FSDP2: rank 0 alone saves and generates, on a plain copy; gather the EMA now (every rank
                # joins each gather, in the same order); rank 0 alone keeps it (dpft/placement/shards.py)
                self._ema_full = full_on_rank0(self.ema.shadow)
        bsz, clipped = out.private["batch_size"], out.private["clipped"]
        rate = None
        if run.private and isinstance(self.clip, AdaptiveQuantileClip):
            res["clip_norm"] = self.clip.max_norm  # the C used in this step
            b = self.clip.noisy_unclipped_fraction(bsz - clipped, bsz, out.q * run.n, out.step)
            self.clip.update(b)
            rate = min(1.0, max(0.0, 1.0 - b))
            res["clip_rate_private"] = rate
        elif run.private and isinstance(self.clip, PaperPercentileClip):
            res["clip_norm"] = self.clip.max_norm
            rate = clipped / max(bsz, 1)  # raw: leaks (reproduction only)
            res["clip_rate_raw"] = rate
            if out.raw_norms is not None:
                self.clip.update_from_norms(out.raw_norms)
        if self.gamma is not None:
            if rate is None:
                raise ValueError("adam_ac.gamma_nudge needs a privatised clip rate: set adam_ac.adaptive_clip: true")
            self.optimizer.lr_scale = self.gamma.update(rate)
            res["gamma"] = self.gamma.gamma
        return res

    def weights(self):
        """Context manager swapping in the EMA weights (no-op without an EMA). After an FSDP2 run the
        model is a plain copy (``fsdp.materialise``): the gathered EMA goes into its parameters."""
        if self.ema is None:
            return nullcontext()
        model = getattr(self._run, "model", None)
        if self._ema_full is not None and model is not None and not any(is_sharded(p) for p in model.parameters()):
            return swap_values(dict(model.named_parameters()), self._ema_full)
        return self.ema.swap()

    @torch.no_grad()
    def evaluate(self, run, evaluate):
        """Dev metrics of the EMA weights when kept (the paper evaluates the EMA) and of the raw
        weights (``*_raw``)."""
        if self.ema is None:
            return None
        raw = evaluate()
        with self.ema.swap():
            ema = evaluate()
        return {**ema, **{f"{k}_raw": v for k, v in raw.items()}}

    def finish(self, run) -> None:
        if self.ema is not None:  # the EMA weights beside the raw ones
            with self.weights():  # FSDP2: rank 0's plain copy, the gathered EMA swapped in
                run.model.save_pretrained(run.run_dir / "model_ema")
            run.tokenizer.save_pretrained(run.run_dir / "model_ema")

    def report(self, run) -> dict[str, Any]:
        info: dict[str, Any] = {"options": self.cfg.model_dump(mode="json")}
        if run.private:
            info["noise_multiplier_accounted"] = run.sigma
            info["noise_multiplier_gradient"] = self.noise_sigma if self.noise_sigma is not None else run.sigma
            if self.clip is not None:
                info["final_clip_norm"] = float(self.clip.max_norm)
        if self.gamma is not None:
            info["final_gamma"] = self.gamma.gamma
        return info

    @classmethod
    def markdown(cls, rep) -> list[str]:
        """Markdown lines of the DP-Adam-AC section of report.md (the options, σ split, final C and γ)."""
        lines: list[str] = []
        ac = rep.get("adam_ac")
        if ac:
            o = ac["options"]
            opts = [k for k in ("adaptive_clip", "gamma_nudge", "bias_correction", "reproduce_paper") if o.get(k)]
            if o.get("ema_decay"):
                opts.append(f"EMA d = {o['ema_decay']}")
            lines += ["## DP-Adam family options", "", f"- enabled: {', '.join(opts) or 'none'}"]
            if "noise_multiplier_gradient" in ac:
                lines.append(f"- σ accounted {ac['noise_multiplier_accounted']:.4g}; gradient noise σ_Δ "
                             f"{ac['noise_multiplier_gradient']:.4g} (the rest pays for the noisy unclipped count)")
                if "final_clip_norm" in ac:
                    lines.append(f"- final clipping norm C = {ac['final_clip_norm']:.4g}")
            if "final_gamma" in ac:
                lines.append(f"- final learning-rate multiplier γ = {ac['final_gamma']:.4g}")
            if o.get("ema_decay"):
                lines.append("- dev metrics are of the EMA weights (raw weights: the *_raw fields of report.json); "
                             "both are saved (model/ and model_ema/)")
            lines.append("")
        return lines
