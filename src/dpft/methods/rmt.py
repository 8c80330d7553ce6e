"""RMT gradient denoising as a plug-in: singular-value shrinkage of each 2-D weight gradient
after the noise (post-processing, no ε cost; transforms/rmt/ holds the maths).

Recipe: ``denoise: {method: rmt, kappa: 1.05}`` or ``methods: [{name: rmt, method: rmt}]``.

``denoise.diagnostics`` (research runs only, NOT CERTIFIED): keeps each step's *clean* clipped
sum and writes, per step, the per-layer spike strength of the clean gradient against the BBP
threshold and the detection threshold, and the cosine of the noisy and the denoised gradient
to the clean one (``<run>/rmt_diagnostics.jsonl``). The clean gradient is not protected by
the noise, so such a run is marked NOT CERTIFIED and prints no ε.
"""

from __future__ import annotations

import json
from typing import Literal, Optional

from pydantic import Field

from dpft.config.base import PluginConfig
from dpft.methods.base import Method, register_method
from dpft.step.postprocess import rmt_transform
from dpft.transforms.rmt import RMTDenoiser, matrix_param_names, spike_report

#: Why a diagnostics run cannot be certified.
DIAGNOSTICS_REASON = ("denoise.diagnostics: the run reads each step's clean (un-noised) clipped gradient and writes "
                      "statistics of it (spike strength, cosines) to rmt_diagnostics.jsonl; they are not covered by "
                      "the noise, so nothing this run writes is under a proven ε (research on the ledger's "
                      "mechanism only; run the same recipe without diagnostics for a certified release)")
DIAGNOSTICS_FILE = "rmt_diagnostics.jsonl"


class DenoiseCfg(PluginConfig):
    """Post-processing of the noisy gradient (free under DP): ``rmt`` = singular-value
    shrinkage of each 2-D weight gradient (transforms/rmt/)."""

    method: Literal["none", "rmt"] = "none"
    #: Denoise a layer only if its top normalised singular value exceeds κ·(1 + √β).
    kappa: float = Field(1.05, ge=1.0)  # from benchmarks/results/rmt_kappa_sweep.md
    #: Randomized top-r SVD instead of a full SVD (None = full).
    rank: Optional[int] = Field(None, ge=1)
    #: Leave matrices with min(m, n) < min_dim alone: Marchenko–Pastur asymptotics need both
    #: dimensions large (the 2 × 384 classifier head of a binary task is excluded by default).
    min_dim: int = Field(8, ge=1)
    #: NOT CERTIFIED research runs: log per-layer spike strength of the clean gradient and the
    #: cosines to it (module doc).
    diagnostics: bool = False


class _CleanCapture:
    """The step's Gaussian mechanism, keeping a copy of the clean clipped sum it is given
    (diagnostics only; everything else is the wrapped mechanism's)."""

    def __init__(self, mech):
        self.mech = mech
        self.clean = None

    def release(self, grad_sum, sensitivity, q, step):
        self.clean = {k: v.detach().clone() for k, v in grad_sum.items()}
        return self.mech.release(grad_sum, sensitivity, q, step)

    def __getattr__(self, name):
        return getattr(self.mech, name)


@register_method
class RMTDenoise(Method):
    """Appends the RMT denoiser to the step's post-processing transforms (private runs only)."""

    name = "rmt"
    config = DenoiseCfg
    legacy_section = "denoise"
    order = 60
    #: Under DDP: post-processing of the (identical) noisy sum, the same on every rank.
    supports_ddp = True
    #: The SVDs run on the noisy gradient's device (its sketch generator too: public, seeded).
    supports_device = True
    #: Under FSDP2: each rank holds its rows of the noisy gradient; the SVD needs whole matrices, so
    #: the transform declares ``whole_tensors`` and the sharded step all-gathers them (already noised:
    #: post-processing, no privacy cost), denoises them identically on every rank (the sketch
    #: generator is public and seeded) and keeps this rank's rows (dpft/placement/fsdp_methods.py).
    supports_fsdp = True
    #: Post-processing of the noisy sum: the step's events are unchanged (a search may vary it).
    search_events_unchanged = True
    uncertified_fields = ("diagnostics",)

    @classmethod
    def enabled(cls, cfg: DenoiseCfg) -> bool:
        return cfg.method == "rmt"

    @classmethod
    def python_refusal(cls, cfg: DenoiseCfg) -> Optional[str]:
        """RMT is post-processing of the noisy gradient: it runs in every way in, except its NOT
        CERTIFIED diagnostics (they write the clean gradient's statistics into a run folder)."""
        if cfg.diagnostics:
            return "diagnostics: true keeps un-noised gradient statistics (NOT CERTIFIED research runs only)"
        return None

    @classmethod
    def sharded_refusal(cls, cfg: DenoiseCfg) -> Optional[str]:
        """RMT runs sharded (whole matrices gathered after the noise); its NOT CERTIFIED diagnostics do
        not: they read the clean clipped sum, which FSDP holds only as reduce-scattered row shards."""
        if cfg.diagnostics:
            return ("denoise.diagnostics reads the clean (un-noised) clipped sum, which FSDP holds only as "
                    "reduce-scattered row shards; run diagnostics (NOT CERTIFIED research) in one process or "
                    "under DDP")
        return None

    def prepare(self, run) -> None:
        if self.cfg.diagnostics and run.private:
            run.ledger.mark_not_certified(DIAGNOSTICS_REASON)

    def build(self, spec, run):
        if not run.private:
            return spec

        params = spec.params if spec.params is not None else spec.engine.params
        if not self.cfg.diagnostics:
            tf = rmt_transform(run.model, list(params), self.cfg)
            # the SVD acts on whole matrices: under FSDP the step gathers them (dpft/placement/fsdp_methods.py)
            tf.whole_tensors = list(matrix_param_names(run.model, list(params)))  # type: ignore[attr-defined]
            return spec.replace(transforms=[*spec.transforms, tf])
        cap = _CleanCapture(spec.mechanism)
        return spec.replace(mechanism=cap, transforms=[*spec.transforms, self._diagnostic_transform(run, params, cap)])

    def _diagnostic_transform(self, run, params, cap):
        c = self.cfg
        den = RMTDenoiser(kappa=c.kappa, rank=c.rank, min_dim=c.min_dim, diagnostics=True)
        names = matrix_param_names(run.model, list(params))
        path = run.run_dir / DIAGNOSTICS_FILE

        def apply(grads, ctx):
            denom = ctx["q"] * run.n  # as the step divides the noisy sum
            clean = {k: v.float() / denom for k, v in cap.clean.items() if k in grads}
            out = den(grads, ctx["noise_std"], names, clean_grads=clean)
            spikes = spike_report(clean, ctx["noise_std"], c.kappa, names=list(den.last_stats))
            cos = den.last_cosine_report or {"layers": {}, "total": {}}
            layers = {k: {**spikes.get(k, {}), "y1_observed": st.top_sv, "touched": st.touched,
                          **{f"cos_{a}": b for a, b in cos["layers"].get(k, {}).items()}}
                      for k, st in den.last_stats.items()}
            row = {"step": ctx["step"], "noise_std": ctx["noise_std"], "excluded_min_dim": den.last_excluded,
                   "cos_total": cos["total"], "layers": layers}
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            return out

        apply.denoiser = den  # type: ignore[attr-defined]
        return apply

    def report(self, run) -> dict:
        out = {"kappa": self.cfg.kappa, "rank": self.cfg.rank, "min_dim": self.cfg.min_dim,
               "diagnostics": self.cfg.diagnostics}
        if self.cfg.diagnostics:
            out["diagnostics_file"] = DIAGNOSTICS_FILE
            out["not_certified"] = DIAGNOSTICS_REASON
        return out
