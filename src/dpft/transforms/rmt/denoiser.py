"""The RMT denoiser: per-layer optimal shrinkage of the released, averaged gradient (paper
Eq. (9)); see :mod:`dpft.transforms.rmt` for the model and the estimator."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dpft.transforms.rmt.diagnostics import cosine_report
from dpft.transforms.rmt.shrinkage import DEFAULT_KAPPA, bulk_edge, optimal_shrinkage

#: Which matrices to denoise: a preset name, a set of parameter names, or a predicate.
Targets = str | Collection[str] | Callable[[str, Tensor], bool]


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
