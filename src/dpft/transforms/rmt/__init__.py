"""RMT gradient denoising: optimal singular-value shrinkage of privatised weight gradients.

Post-processing of the released (privatised, averaged) gradient, so it costs no privacy
budget. Source: Dadsetan & Rudzicz, "Sample-Efficient Differentially Private Fine-Tuning via
Gradient Matrix Denoising" (arXiv 2510.01137), Section 3.2, Eq. (9) (threshold κ and norm
correction) built on Eqs. (7)-(8) (optimal shrinkage), with the shrinker written in the closed
form of Gavish & Donoho (2017), "Optimal Shrinkage of Singular Values", IEEE Trans. Inf. Theory
63(4), Eq. (7) (Frobenius loss, known noise level), which equals Shabalin & Nobel (2013)'s
``x(y) c(y) c̃(y)``.

Model
-----
For one weight gradient, oriented ``m × n`` with ``m <= n`` (a tall matrix is transposed first;
the estimator is transpose-equivariant, so a Conv1D weight stored ``(in, out)`` gives the same
result as the equivalent ``nn.Linear`` weight ``(out, in)``), the DP step releases

    G̃ = G + E,   E_ij ~ N(0, s²) i.i.d.,   s = σ·Δ / (q·N)

where ``Δ`` is the L2 sensitivity of the clipped sum (``C`` under add/remove-one, ``2C`` under
replace-one), ``σ`` the noise multiplier, and ``q·N`` the *expected* batch size the noisy sum
is divided by (Poisson sampling; see DESIGN.md, "RMT denoising"). With ``β = m/n`` and
``Y = G̃ / (s √n)`` the noise part of ``Y`` has i.i.d. ``N(0, 1/n)`` entries: its singular
values fill the Marchenko–Pastur bulk ``[1 - √β, 1 + √β]``; a signal singular value ``x``
(in the same units) produces an outlier ("spike") ``y = √((1+x²)(β+x²)) / x`` above the bulk
edge ``1 + √β`` iff ``x > β^{1/4}`` (BBP transition).

Estimator (per selected matrix)
-------------------------------
1. ``y_1`` = top singular value of ``Y``. If ``y_1 <= κ (1 + √β)`` the gradient is returned
   unchanged (the *same* tensor object, bit-identical).  [paper Eq. (9), first case]
2. Otherwise ``Ĝ_raw = s √n · Σ_i η(y_i) u_i v_iᵀ`` with the Frobenius-optimal shrinker

       η(y) = √((y² - β - 1)² - 4β) / y    for y > 1 + √β,    0 otherwise

   [Gavish & Donoho 2017 Eq. (7); Shabalin & Nobel 2013; paper Eqs. (7)-(8)].
3. Norm correction: ``Ĝ = Ĝ_raw · ‖G̃‖_F / ‖Ĝ_raw‖_F`` [paper Eq. (9)], so the per-layer norms
   are those of the released gradient (to float rounding: ``‖Ĝ_raw‖_F`` is taken as
   ``s √n ‖η‖_2``, exact for orthonormal singular vectors) — hypothesis (ii) of the paper's Theorem 1, which turns
   per-layer cosine gains into a whole-gradient cosine gain. ``norm_correction=False`` gives
   the plain G&D estimator (the paper's ablation, Appendix D.2).

The issue's formulas agree with Gavish & Donoho (2017) and with the paper's threshold
``κ σ (√m + √n)`` (in unnormalised units ``κ s (√m + √n) = κ s √n (1 + √β)``).

Privacy: the transform reads only the released gradient and the public noise scale ``s``; its
output is covered by the same (ε, δ). The optional diagnostics (:func:`cosine_report`, the
``clean_grads`` argument) read the *clean* clipped gradient and are NOT private.
Files: ``shrinkage.py`` (the formulas), ``params.py`` (which parameters are matrices),
``denoiser.py`` (:class:`RMTDenoiser`, the transform), ``diagnostics.py`` (NON-PRIVATE reports).
"""

from dpft.transforms.rmt.denoiser import LayerStats, RMTDenoiser
from dpft.transforms.rmt.diagnostics import cosine_report, spike_report
from dpft.transforms.rmt.params import MatrixParam, matrix_param_names
from dpft.transforms.rmt.shrinkage import (DEFAULT_KAPPA, averaged_noise_std, bulk_edge,
                                           optimal_shrinkage)

__all__ = [
    "DEFAULT_KAPPA",
    "LayerStats",
    "MatrixParam",
    "RMTDenoiser",
    "averaged_noise_std",
    "bulk_edge",
    "cosine_report",
    "matrix_param_names",
    "optimal_shrinkage",
    "spike_report",
]
