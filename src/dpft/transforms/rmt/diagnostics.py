"""NON-PRIVATE diagnostics of the RMT denoiser: they read the clean clipped gradient (research
on public or synthetic data only; never released under the run's (ε, δ))."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import torch
from torch import Tensor

from dpft.transforms.rmt.shrinkage import DEFAULT_KAPPA, bulk_edge

# --------------------------------------------------------------------------------------------
# Diagnostics (NON-PRIVATE)
# --------------------------------------------------------------------------------------------


def spike_report(clean: Mapping[str, Tensor], noise_std: float, kappa: float = DEFAULT_KAPPA,
                 names: Collection[str] | None = None) -> dict[str, dict[str, float]]:
    """Per-layer spike strength of the *clean* gradient against the detection thresholds.

    For an oriented ``m × n`` clean gradient ``G`` (m ≤ n, β = m/n) and per-entry noise std
    ``s``: ``x = ‖G‖₂ / (s √n)`` (top singular value in the normalised units of the module
    doc). The noisy matrix shows an outlier above the MP bulk iff ``x > β^{1/4}`` (BBP), at
    ``y(x) = √((1 + x²)(β + x²)) / x``; the denoiser touches the layer iff the observed
    ``y_1 > κ (1 + √β)``. Returns ``{name: {"x", "bbp", "y_pred", "threshold", "above_bbp",
    "detectable"}}`` (floats and bools).

    NON-PRIVATE: reads the clean gradient (see :func:`cosine_report`); diagnostics runs only.
    """
    out: dict[str, dict[str, float]] = {}
    for k in (names if names is not None else clean):
        g = clean[k]
        if g.ndim != 2 or noise_std <= 0:
            continue
        m, n = sorted(g.shape)
        beta = m / n
        x = float(torch.linalg.matrix_norm(g.detach().double(), ord=2)) / (noise_std * math.sqrt(n))
        bbp = beta ** 0.25
        y = math.sqrt((1 + x * x) * (beta + x * x)) / x if x > 0 else math.inf
        thr = kappa * bulk_edge(beta)
        out[k] = {"x": x, "bbp": bbp, "y_pred": y if x > bbp else bulk_edge(beta), "threshold": thr,
                  "above_bbp": x > bbp, "detectable": x > bbp and y > thr}
    return out


def _cos(dot: float, na: float, nb: float) -> float:
    return dot / math.sqrt(na * nb) if na > 0 and nb > 0 else math.nan


def cosine_report(
    noisy: Mapping[str, Tensor],
    denoised: Mapping[str, Tensor],
    clean: Mapping[str, Tensor],
    names: Collection[str] | None = None,
) -> dict:
    """Cosine similarity of the noisy and the denoised gradient with the clean one.

    The paper's evaluation quantity (Section 3, "improvement"; Theorem 1): per layer
    ``cos(G̃_l, G_l)`` vs ``cos(Ĝ_l, G_l)``, and over the whole concatenated gradient.

    NON-PRIVATE. ``clean`` is the clipped, *un-noised* averaged gradient: it is not protected
    by differential privacy, and neither is anything computed from it. Enabling this (the
    denoiser's ``diagnostics=True``) means the logs contain non-private statistics of the
    training data; use it for research on public or synthetic data only, never feed it back
    into training, and do not publish such logs under the run's (ε, δ).

    Args:
        noisy, denoised, clean: ``{name: tensor}`` with matching shapes per name.
        names: names to compare; default: every name of ``clean`` present in both others.

    Returns:
        ``{"layers": {name: {"noisy": c0, "denoised": c1, "gain": c1 - c0}}, "total": {...}}``
        with Python floats (NaN where a norm is zero); dot products in float64.

    Raises:
        ValueError: if shapes differ for a name.
    """
    if names is None:
        names = [k for k in clean if k in noisy and k in denoised]
    layers: dict[str, dict[str, float]] = {}
    tot = {"nc": 0.0, "dc": 0.0, "nn": 0.0, "dd": 0.0, "cc": 0.0}
    for k in names:
        a, b, c = noisy[k], denoised[k], clean[k]
        if not (a.shape == b.shape == c.shape):
            raise ValueError(
                f"{k!r}: shapes differ (noisy {tuple(a.shape)}, denoised {tuple(b.shape)}, "
                f"clean {tuple(c.shape)})"
            )
        a = a.detach().reshape(-1).double()
        b = b.detach().reshape(-1).to(a)
        c = c.detach().reshape(-1).to(a)
        nc, dc = float(a @ c), float(b @ c)
        nn_, dd, cc = float(a @ a), float(b @ b), float(c @ c)
        c0, c1 = _cos(nc, nn_, cc), _cos(dc, dd, cc)
        layers[k] = {"noisy": c0, "denoised": c1, "gain": c1 - c0}
        for key, v in (("nc", nc), ("dc", dc), ("nn", nn_), ("dd", dd), ("cc", cc)):
            tot[key] += v
    c0 = _cos(tot["nc"], tot["nn"], tot["cc"])
    c1 = _cos(tot["dc"], tot["dd"], tot["cc"])
    return {"layers": layers, "total": {"noisy": c0, "denoised": c1, "gain": c1 - c0}}
