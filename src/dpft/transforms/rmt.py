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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

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

#: Default threshold multiplier κ (denoise a layer only if ``y_1 > κ (1 + √β)``). The paper
#: tunes κ > 1 on SST-2/RoBERTa-base and keeps it fixed across tasks; its numeric value is
#: not legible in the text we have. 1.05 comes from our sweep on real MiniLM/SST-2 gradients
#: at ε = 3 (benchmarks/rmt_kappa_sweep.py → benchmarks/results/rmt_kappa_sweep.md): κ ≥ 1.1
#: almost never fires there (gain ≤ +0.0006 in cosine), κ ∈ {1.0, 1.02, 1.05} give the largest
#: gains (+0.007…+0.010, within one standard deviation of each other); 1.05 is the largest of
#: those, keeping a margin above the edge against finite-size (Tracy–Widom) fluctuations of
#: pure noise, whose top singular value overshoots 1 + √β by ~1 % at n = 384.
DEFAULT_KAPPA = 1.05

Targets = str | Collection[str] | Callable[[str, Tensor], bool]


# --------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------


def averaged_noise_std(
    noise_multiplier: float, sensitivity: float, sample_rate: float, dataset_size: int
) -> float:
    """Per-entry std ``s = σ Δ / (q N)`` of the noise in the averaged privatised gradient.

    Args:
        noise_multiplier: ``σ`` (dimensionless).
        sensitivity: ``Δ``, L2 sensitivity of the clipped sum: ``C`` under add/remove-one
            neighbouring datasets, ``2C`` under replace-one (per-example L2 norm units).
        sample_rate: Poisson sampling rate ``q`` in (0, 1].
        dataset_size: ``N``; ``q N`` is the expected batch size the noisy sum is divided by.

    Returns:
        ``s`` in gradient units (same units as the averaged gradient's entries).

    Raises:
        ValueError: on a negative/non-finite σ or Δ, or ``q N <= 0``.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not (math.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity}")
    if not (0 < sample_rate <= 1):
        raise ValueError(f"sample rate q must be in (0, 1], got {sample_rate}")
    if dataset_size <= 0:
        raise ValueError(f"dataset size N must be > 0, got {dataset_size}")
    return float(noise_multiplier) * float(sensitivity) / (float(sample_rate) * dataset_size)


def bulk_edge(beta: float) -> float:
    """Upper edge ``1 + √β`` of the Marchenko–Pastur singular-value bulk of an ``m × n``
    (``β = m/n <= 1``) matrix with i.i.d. ``N(0, 1/n)`` entries (dimensionless)."""
    if not (0 < beta <= 1):
        raise ValueError(f"aspect ratio beta = m/n must be in (0, 1], got {beta}")
    return 1.0 + math.sqrt(beta)


def optimal_shrinkage(y: Tensor, beta: float) -> Tensor:
    """Frobenius-optimal singular-value shrinker with known noise level.

    ``η(y) = √((y² - β - 1)² - 4β) / y`` for ``y > 1 + √β`` and 0 otherwise (Gavish & Donoho
    2017, Eq. (7); equals ``x(y) c(y) c̃(y)`` of Shabalin & Nobel 2013 / the paper's Eq. (8)).

    Args:
        y: singular values of the *normalised* matrix ``Y = G̃ / (s √n)``, any shape.
        beta: aspect ratio ``m / n`` in (0, 1].

    Returns:
        ``η(y)``, same shape and dtype as ``y``, in the normalised units.
    """
    edge = bulk_edge(beta)
    above = y > edge
    y_safe = torch.where(above, y, torch.full_like(y, 2.0 * edge))
    disc = ((y_safe * y_safe - beta - 1.0) ** 2 - 4.0 * beta).clamp_min(0.0)
    return torch.where(above, disc.sqrt() / y_safe, torch.zeros_like(y))


# --------------------------------------------------------------------------------------------
# Which parameters are matrices
# --------------------------------------------------------------------------------------------


class MatrixParam(NamedTuple):
    """What :func:`matrix_param_names` knows about one 2-D weight.

    ``kind`` is ``"linear"``, ``"conv1d"``, ``"lora_A"``, ``"lora_B"`` or ``"embedding"``;
    ``transposed`` is True when stored ``(in, out)`` (transformers ``Conv1D``) rather than
    ``(out, in)``. The denoiser does not need ``transposed`` (it is transpose-equivariant);
    it is there for other consumers (e.g. per-example engines).
    """

    kind: str
    transposed: bool


def _is_conv1d(mod: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers missing or broken: fall back to duck typing
        Conv1D = None
    if Conv1D is not None and isinstance(mod, Conv1D):
        return True
    w = getattr(mod, "weight", None)
    return (
        type(mod).__name__ == "Conv1D"
        and isinstance(w, Tensor)
        and w.ndim == 2
        and w.shape[1] == getattr(mod, "nf", -1)
    )


def matrix_param_names(
    model: nn.Module,
    trainable_names: Collection[str] | None = None,
    *,
    include_embeddings: bool = False,
) -> dict[str, MatrixParam]:
    """Find the 2-D weight matrices of ``model`` by module type.

    Selected: ``nn.Linear`` weights (``(out, in)``; this covers peft LoRA ``lora_A`` /
    ``lora_B`` adapters, which are ``nn.Linear`` of shapes ``(r, in)`` / ``(out, r)``, and peft
    ``modules_to_save`` copies of heads) and transformers ``Conv1D`` weights (``(in, out)``).
    ``nn.Embedding`` weights (also a weight tied to one, e.g. GPT-2's ``lm_head``) only with
    ``include_embeddings=True``. Not selected: biases, norms, raw ``nn.Parameter`` matrices
    (e.g. ``nn.MultiheadAttention.in_proj_weight``), peft ``lora_embedding_A/B``.

    Args:
        model: any module (plain, transformers, or peft-wrapped).
        trainable_names: names (as in ``model.named_parameters()``) to consider; default:
            those with ``requires_grad``. Names of frozen base weights are thus skipped.
        include_embeddings: also return embedding matrices (explicit opt-in).

    Returns:
        ``{parameter name: MatrixParam}`` in module order; names are the canonical (first,
        de-duplicated) names of ``model.named_parameters()``.
    """
    canonical: dict[int, str] = {}
    requires_grad: set[str] = set()
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
        if p.requires_grad:
            requires_grad.add(name)
    allowed = set(trainable_names) if trainable_names is not None else requires_grad
    embedding_ids = {
        id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)
    }

    out: dict[str, MatrixParam] = {}
    for mod_name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, Tensor) or w.ndim != 2:
            continue
        if isinstance(mod, nn.Linear):
            path = f".{mod_name}."
            kind = "lora_A" if ".lora_A." in path else "lora_B" if ".lora_B." in path else "linear"
            info = MatrixParam(kind, False)
        elif _is_conv1d(mod):
            info = MatrixParam("conv1d", True)
        elif isinstance(mod, nn.Embedding):
            info = MatrixParam("embedding", False)
        else:
            continue
        if id(w) in embedding_ids and not include_embeddings:
            continue
        if id(w) in embedding_ids:
            info = MatrixParam("embedding", False)
        name = canonical.get(id(w))
        if name is None or name not in allowed or name in out:
            continue
        out[name] = info
    return out


# --------------------------------------------------------------------------------------------
# The denoiser
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerStats:
    """Per-layer record of the last :class:`RMTDenoiser` call (safe to log: a function of the
    released gradient only).

    Attributes:
        shape: stored shape of the gradient.
        m, n: oriented dimensions (``m <= n``); ``beta = m / n``.
        top_sv: ``y_1``, top singular value of ``Y = G̃ / (s √n)`` (dimensionless).
        edge: bulk edge ``1 + √β``; ``threshold = κ · edge``.
        n_spikes: number of singular values of ``Y`` above ``edge`` (among the top ``rank``
            with the randomized path).
        touched: True if the layer was replaced by its denoised version.
        rank_saturated: randomized path only: ``n_spikes == rank``, i.e. there may be more
            spikes than were computed and the result is then an approximation.
    """

    shape: tuple[int, int]
    m: int
    n: int
    beta: float
    top_sv: float
    edge: float
    threshold: float
    n_spikes: int
    touched: bool
    rank_saturated: bool = False

    @property
    def top_over_edge(self) -> float:
        """``y_1 / (1 + √β)``; the layer is touched iff this exceeds κ."""
        return self.top_sv / self.edge


class RMTDenoiser:
    """Per-layer RMT denoiser of the averaged privatised gradient (paper Eq. (9)).

    Construct once, call every step::

        den = RMTDenoiser(kappa=1.05)                      # rank=8 for randomized top-8 SVD
        names = matrix_param_names(model)                  # once, after building the model
        s = averaged_noise_std(sigma, C, q, N)             # σ C / (q N)  (add/remove-one)
        grads = den(grads, s, names)                       # dict name -> (averaged) tensor
        log(den.last_stats)                                # per-layer spikes / y_1 / touched

    Args:
        kappa: threshold multiplier κ >= 1: a matrix is denoised only if its top normalised
            singular value exceeds ``κ (1 + √β)``.
        rank: ``None`` for a full batched SVD; an int ``r`` for a randomized top-``r`` SVD
            (Halko et al. 2011, with ``niter`` power iterations and ``oversample`` extra
            columns). Exact up to the randomized approximation whenever a layer has at most
            ``r`` spikes (everything below the bulk edge is set to 0 anyway); see
            ``LayerStats.rank_saturated``. Singular values from the randomized path are lower
            bounds of the true ones, so a borderline layer may stay untouched. If
            ``r + oversample >= m`` the full SVD of that group is used.
        targets: which gradients to denoise: ``"2d-weights"`` (default) — the names passed as
            ``matrix_names`` at call time (typically :func:`matrix_param_names`), which is
            required; ``"all-2d"`` — every 2-D tensor in the dict, embeddings included; a
            collection of names; or a predicate ``f(name, tensor) -> bool``.
        diagnostics: allow ``clean_grads=`` at call time to compute :func:`cosine_report`
            into ``last_cosine_report`` (NON-PRIVATE; research only). Off by default.
        norm_correction: rescale each denoised matrix to the Frobenius norm of its input
            (paper Eq. (9)); False gives the plain Gavish–Donoho estimator (ablation).
        oversample, niter, seed: randomized-SVD settings; the Gaussian sketch uses a private
            ``torch.Generator`` seeded with ``seed`` (the global RNG is not touched).
        compute_dtype: dtype of the SVD; default float32 (float64 if the input is float64).
        min_dim: leave matrices with ``min(m, n) < min_dim`` unchanged (the MP law is an
            asymptotic statement for m, n → ∞ at fixed β; for m = 2 the "bulk edge" means
            nothing). They are listed in ``last_excluded``.

    Raises:
        ValueError: on ``kappa < 1`` (the estimator could return a zero matrix that cannot be
            norm-corrected), non-positive ``rank``, unknown ``targets`` string.
    """

    def __init__(
        self,
        kappa: float = DEFAULT_KAPPA,
        rank: int | None = None,
        targets: Targets = "2d-weights",
        diagnostics: bool = False,
        *,
        norm_correction: bool = True,
        oversample: int = 8,
        niter: int = 6,
        seed: int = 0,
        compute_dtype: torch.dtype | None = None,
        min_dim: int = 1,
    ):
        if int(min_dim) < 1:
            raise ValueError(f"min_dim must be >= 1, got {min_dim}")
        if not (math.isfinite(kappa) and kappa >= 1.0):
            raise ValueError(
                f"kappa must be a finite number >= 1 (threshold at or above the bulk edge), "
                f"got {kappa}"
            )
        if rank is not None and int(rank) < 1:
            raise ValueError(f"rank must be None (full SVD) or >= 1, got {rank}")
        if isinstance(targets, str) and targets not in ("2d-weights", "all-2d"):
            raise ValueError(
                f"targets must be '2d-weights', 'all-2d', a collection of names or a "
                f"predicate, got {targets!r}"
            )
        if oversample < 0 or niter < 0:
            raise ValueError("oversample and niter must be >= 0")
        self.kappa = float(kappa)
        self.rank = None if rank is None else int(rank)
        self.targets = targets
        self.diagnostics = bool(diagnostics)
        self.norm_correction = bool(norm_correction)
        self.oversample = int(oversample)
        self.niter = int(niter)
        self.seed = int(seed)
        self.compute_dtype = compute_dtype
        #: Matrices with min(m, n) < min_dim are left alone (Marchenko–Pastur asymptotics need
        #: both dimensions large: a 2 × 384 head has a 2-point "spectrum").
        self.min_dim = int(min_dim)
        #: Names skipped by ``min_dim`` at the last call.
        self.last_excluded: list[str] = []
        self._generators: dict[torch.device, torch.Generator] = {}
        #: Per-layer stats of the last call, ``{name: LayerStats}`` (selected layers only).
        self.last_stats: dict[str, LayerStats] = {}
        #: :func:`cosine_report` of the last call when ``diagnostics`` and ``clean_grads``.
        self.last_cosine_report: dict | None = None

    # ---- public -------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        grads: Mapping[str, Tensor],
        noise_std: float,
        matrix_names: Collection[str] | None = None,
        *,
        clean_grads: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Denoise the selected matrices of an averaged privatised gradient.

        Args:
            grads: ``{name: tensor}``, the averaged noisy gradient (noisy clipped sum divided
                by the expected batch size ``q N``); any shapes.
            noise_std: per-entry noise std ``s = σ Δ / (q N)`` of ``grads`` (same units as the
                gradient; see :func:`averaged_noise_std`). ``0`` (no noise) returns every
                tensor unchanged, which is the limit of the estimator as ``s → 0``.
            matrix_names: names of the 2-D "matrix" parameters (a ``matrix_param_names``
                dict works); required with ``targets="2d-weights"``, ignored otherwise.
                Names not present in ``grads`` are ignored.
            clean_grads: the clean clipped averaged gradient, only with ``diagnostics=True``
                (NON-PRIVATE; see :func:`cosine_report`).

        Returns:
            A new dict with the same keys, in the same order. Unselected and untouched tensors
            are the *same objects* as in ``grads``; denoised ones are new tensors of the
            input's shape, dtype and device.

        Raises:
            ValueError: negative/non-finite ``noise_std``; a selected tensor that is not 2-D;
                ``targets="2d-weights"`` without ``matrix_names``; ``clean_grads`` given
                while ``diagnostics`` is off.
        """
        noise_std = float(noise_std)
        if not (math.isfinite(noise_std) and noise_std >= 0):
            raise ValueError(f"noise_std must be finite and >= 0, got {noise_std}")
        if clean_grads is not None and not self.diagnostics:
            raise ValueError(
                "clean_grads given but diagnostics=False: the clean gradient is non-private; "
                "enable diagnostics=True explicitly to log non-private statistics"
            )
        selected = self._select(grads, matrix_names)
        out = dict(grads)
        stats: dict[str, LayerStats] = {}

        # Group by oriented shape (m <= n), dtype and device for batched SVDs.
        groups: dict[tuple, list[tuple[str, bool]]] = {}
        for name in selected:
            t = grads[name]
            transpose = t.shape[0] > t.shape[1]
            m, n = (t.shape[1], t.shape[0]) if transpose else (t.shape[0], t.shape[1])
            groups.setdefault((m, n, t.dtype, t.device), []).append((name, transpose))

        for (m, n, dtype, device), items in groups.items():
            beta = m / n
            edge = bulk_edge(beta)
            if noise_std == 0.0 or m == 0:
                for name, _ in items:
                    stats[name] = LayerStats(
                        tuple(grads[name].shape), m, n, beta, math.inf if m else 0.0,
                        edge, self.kappa * edge, 0, False,
                    )
                continue
            cdtype = self.compute_dtype or (
                torch.float64 if dtype == torch.float64 else torch.float32
            )
            X = torch.stack(
                [grads[nm].mT if tr else grads[nm] for nm, tr in items]
            ).to(cdtype)
            denoised, top, spikes, touched, saturated = self._denoise_batch(X, noise_std)
            j = 0
            for i, (name, transpose) in enumerate(items):
                if touched[i]:
                    g = denoised[j]
                    j += 1
                    g = g.mT if transpose else g
                    out[name] = g.to(dtype).contiguous()
                stats[name] = LayerStats(
                    tuple(grads[name].shape), m, n, beta, float(top[i]), edge,
                    self.kappa * edge, int(spikes[i]), bool(touched[i]), bool(saturated[i]),
                )
        self.last_stats = {name: stats[name] for name in selected}
        self.last_cosine_report = (
            cosine_report(grads, out, clean_grads) if clean_grads is not None else None
        )
        return out

    def summary(self) -> dict[str, float]:
        """Aggregate of ``last_stats`` for scalar logging: layers, touched, total spikes."""
        st = self.last_stats.values()
        return {
            "rmt/layers": float(len(self.last_stats)),
            "rmt/touched": float(sum(s.touched for s in st)),
            "rmt/spikes": float(sum(s.n_spikes for s in st)),
        }

    # ---- internals ----------------------------------------------------------------------

    def _select(
        self, grads: Mapping[str, Tensor], matrix_names: Collection[str] | None
    ) -> list[str]:
        t = self.targets
        if isinstance(t, str):
            if t == "all-2d":
                names = [k for k, v in grads.items() if v.ndim == 2]
            else:
                if matrix_names is None:
                    raise ValueError(
                        "targets='2d-weights' needs matrix_names (e.g. "
                        "matrix_param_names(model)) to tell weight matrices from embeddings; "
                        "use targets='all-2d' to denoise every 2-D tensor"
                    )
                wanted = set(matrix_names)
                names = [k for k in grads if k in wanted]
        elif callable(t):
            names = [k for k, v in grads.items() if t(k, v)]
        else:
            wanted = set(t)
            names = [k for k in grads if k in wanted]
        for k in names:
            if grads[k].ndim != 2:
                raise ValueError(
                    f"{k!r} selected for RMT denoising has shape {tuple(grads[k].shape)}, "
                    f"expected a 2-D matrix"
                )
        self.last_excluded = [k for k in names if min(grads[k].shape) < self.min_dim]
        return [k for k in names if min(grads[k].shape) >= self.min_dim]

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def _svd(self, X: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
        """Top singular triplets of ``X (L, m, n)``: ``U (L, m, k)``, ``S (L, k)``,
        ``Vh (L, k, n)`` (descending), and whether they are a truncation."""
        L, m, n = X.shape
        r = self.rank
        if r is None or r + self.oversample >= m:
            if m < n:
                # LAPACK (MKL gesdd) is ~2x faster on the tall, column-major view X^T than on
                # the wide row-major X; X^T = U' S V'^T  =>  X = V' S U'^T.
                Ut, S, Vht = torch.linalg.svd(X.mT, full_matrices=False)
                return Vht.mT, S, Ut.mT, False
            U, S, Vh = torch.linalg.svd(X, full_matrices=False)
            return U, S, Vh, False
        # Randomized range finder with power iterations (Halko, Martinsson & Tropp 2011,
        # Algorithms 4.4 + 5.1); sketch from the short side (m <= n).
        q = r + self.oversample
        omega = torch.randn(
            L, n, q, generator=self._generator(X.device), device=X.device, dtype=X.dtype
        )
        Q = torch.linalg.qr(X @ omega).Q
        for _ in range(self.niter):
            Q = torch.linalg.qr(X.mT @ Q).Q
            Q = torch.linalg.qr(X @ Q).Q
        Ub, S, Vh = torch.linalg.svd(Q.mT @ X, full_matrices=False)
        return (Q @ Ub)[..., :r], S[..., :r], Vh[..., :r, :], True

    def _denoise_batch(self, X: Tensor, s: float):
        """Denoise a stack ``X (L, m, n)`` (``m <= n``) in gradient units.

        Returns ``(denoised (L_touched, m, n), top (L,), spikes (L,), touched (L,),
        saturated (L,))`` as CPU tensors except ``denoised``."""
        L, m, n = X.shape
        beta = m / n
        edge = bulk_edge(beta)
        scale = s * math.sqrt(n)
        U, S, Vh, truncated = self._svd(X)
        y = S / scale  # singular values of Y = X / (s √n)
        top = y[:, 0]
        spikes = (y > edge).sum(dim=1)
        touched = top > self.kappa * edge
        saturated = (spikes >= y.shape[1]) if truncated else torch.zeros_like(touched)
        top_c, spikes_c, touched_c, sat_c = (
            top.cpu(), spikes.cpu(), touched.cpu(), saturated.cpu()
        )
        if not bool(touched_c.any()):
            return None, top_c, spikes_c, touched_c, sat_c
        k = max(int(spikes_c[touched_c].max()), 1)
        U, y, Vh = U[..., :k], y[:, :k], Vh[..., :k, :]  # slice before gathering
        if not bool(touched_c.all()):
            idx = touched.nonzero().squeeze(1)
            U, y, Vh, X = U[idx], y[idx], Vh[idx], X[idx]
        eta = optimal_shrinkage(y, beta)  # (Lt, k), normalised units
        if self.norm_correction:
            # U, V have orthonormal columns, so ||U diag(w) V^T||_F = ||w||_2: fold the norm
            # correction into the weights instead of a second pass over the (Lt, m, n) output.
            target = torch.linalg.vector_norm(X, dim=(-2, -1))
            w = eta * (target / torch.linalg.vector_norm(eta, dim=-1))[:, None]
        else:
            w = eta * scale
        return (U * w[:, None, :]) @ Vh, top_c, spikes_c, touched_c, sat_c


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
