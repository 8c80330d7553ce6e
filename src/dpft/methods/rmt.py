"""RMT gradient denoising as a plug-in: singular-value shrinkage of each 2-D weight gradient
after the noise (post-processing, no ε cost; transforms/rmt.py holds the maths).

Recipe: ``denoise: {method: rmt, kappa: 1.05}`` or ``methods: [{name: rmt, method: rmt}]``.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from dpft.config import _Strict
from dpft.methods.base import Method, register_method


class DenoiseCfg(_Strict):
    """Post-processing of the noisy gradient (free under DP): ``rmt`` = singular-value
    shrinkage of each 2-D weight gradient (transforms/rmt.py)."""

    method: Literal["none", "rmt"] = "none"
    #: Denoise a layer only if its top normalised singular value exceeds κ·(1 + √β).
    kappa: float = Field(1.05, ge=1.0)  # from benchmarks/results/rmt_kappa_sweep.md
    #: Randomized top-r SVD instead of a full SVD (None = full).
    rank: Optional[int] = Field(None, ge=1)


@register_method
class RMTDenoise(Method):
    """Appends the RMT denoiser to the step's post-processing transforms (private runs only)."""

    name = "rmt"
    config = DenoiseCfg
    legacy_section = "denoise"
    order = 60

    @classmethod
    def enabled(cls, cfg: DenoiseCfg) -> bool:
        return cfg.method == "rmt"

    def build(self, spec, run):
        if not run.private:
            return spec
        from dpft.step.postprocess import rmt_transform

        params = spec.params if spec.params is not None else spec.engine.params
        return spec.replace(transforms=[*spec.transforms, rmt_transform(run.model, list(params), self.cfg)])
