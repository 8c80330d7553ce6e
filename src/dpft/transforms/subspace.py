"""Subspace basis of DP-SFT: top-k right singular vectors of a fine-tuning trajectory.

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models"
(AAAI 2026), Algorithm 1 lines 12-18 (snapshots ``Θ_t − Θ_0`` stacked into ``A``, Eq. 3) and
Eq. 4 (``P`` = top-k right singular vectors of ``A``), Algorithm 2 lines 7 and 12 (project with
``Pᵀ``, unproject with ``P``).

Shapes: the trajectory ``A`` is ``(m, d)`` with ``m`` snapshots (m ≈ k, small) and ``d`` the
number of parameters that span the subspace; ``P`` is ``(d, k)`` with orthonormal columns. Both
are kept *block-wise*, one block per parameter: ``A_n: (m, d_n)`` and ``P_n: (k, *shape_n)``
(so ``P = concat_n P_n.reshape(k, -1)ᵀ``). ``P`` is never formed as one tensor, and neither
``AᵀA`` (d × d) nor a full SVD is ever computed: the right singular vectors come from the
``m × m`` Gram matrix ``A Aᵀ = U Λ Uᵀ`` as ``P = Aᵀ U_k Λ_k^{-1/2}`` (exact: ``A = U Λ^{1/2} Wᵀ``
gives ``W = Aᵀ U Λ^{-1/2}``), followed by one ``k × k`` re-orthonormalisation pass that removes
the round-off of the Gram route.

The basis itself (:class:`SubspaceBasis`: blocks, projections, file) is the subspace engine's
and lives in ``grads/basis.py``, re-exported here. Everything here is post-processing of whatever
produced the snapshots: it costs no privacy itself; the privacy of a basis is that of its
trajectory (see ``methods/dpsft/method.py``).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from dpft.grads.basis import _DTYPES, SubspaceBasis, SubspaceError  # noqa: F401 (public here: dpft.transforms.subspace)


def basis_from_snapshots(
    snapshots: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
    k: int,
    dtype: str = "float32",
    rel_tol: float = 1e-10,
) -> SubspaceBasis:
    """Top-k right singular vectors of the trajectory ``A`` (Eq. 3-4) via its m × m Gram matrix.

    Args:
        snapshots: either parameter name -> ``(m, *shape)`` stacked differences ``Θ_t − Θ_0``,
            or a list of ``m`` dicts name -> ``Θ_t − Θ_0``.
        k: subspace dimension (number of columns of P); needs ``k ≤ rank(A) ≤ m``.
        dtype: storage dtype of P: ``float32`` or ``bfloat16`` (half the memory; P is then
            orthonormal to ~1e-2, which the noise scale does not depend on — the clip bound
            holds on the coordinates actually computed).
        rel_tol: singular directions with ``λ_j ≤ rel_tol · λ_1`` count as zero.

    Returns:
        the basis with ``singular_values`` = top-k singular values of A.

    Cost: ``O(m² d)`` time, ``O(k d)`` extra memory; no d × d matrix and no full SVD.

    Raises:
        SubspaceError: no snapshots, k < 1, or rank(A) < k (too few / identical snapshots:
            record more snapshots or lower k).
    """
    if dtype not in _DTYPES:
        raise SubspaceError(f"basis dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if not isinstance(snapshots, Mapping):
        snaps = list(snapshots)
        if not snaps:
            raise SubspaceError("no snapshots: the trajectory matrix A is empty")
        snapshots = {n: torch.stack([s[n] for s in snaps]) for n in snaps[0]}
    if not snapshots:
        raise SubspaceError("no parameters in the snapshots")
    if k < 1:
        raise SubspaceError(f"subspace dimension k must be ≥ 1, got {k}")
    m = next(iter(snapshots.values())).shape[0]
    for n, a in snapshots.items():
        if a.shape[0] != m:
            raise SubspaceError(f"snapshot stack of {n} has {a.shape[0]} rows, expected {m}")
    if k > m:
        raise SubspaceError(f"k = {k} > m = {m} snapshots: rank(A) ≤ m; record at least k snapshots or lower k")
    # Gram matrix A Aᵀ = Σ_n A_n A_nᵀ in float64 (m × m), on the snapshots' device.
    dev = next(iter(snapshots.values())).device
    gram = torch.zeros(m, m, dtype=torch.float64, device=dev)
    for a in snapshots.values():
        f = a.reshape(m, -1).double()
        gram += f @ f.T
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    evals, evecs = evals.flip(0), evecs.flip(1)
    # eigh's sign per eigenvector is arbitrary: fix it (largest-|·| entry positive) so that two runs whose
    # trajectories agree to round-off (1 process and a world of K) build the same P, not P with flipped columns.
    lead = evecs.abs().argmax(0)
    evecs = evecs * torch.sign(evecs[lead, torch.arange(m, device=dev)]).clamp_min(0).mul(2).sub(1)
    top = float(evals[0])
    if not top > 0:
        raise SubspaceError("the trajectory is all zeros (the parameters never moved); check the learning "
                            "rate and that the subspace parameters are trainable in stage 1")
    rank = int((evals > rel_tol * top).sum())
    if rank < k:
        raise SubspaceError(f"rank(A) = {rank} < k = {k}: the snapshots span fewer than k directions; "
                            "record more (distinct) snapshots or lower k")
    lam = evals[:k].clamp_min(0)
    coef = evecs[:, :k] / lam.sqrt()  # (m, k): P = Aᵀ U_k Λ_k^{-1/2}
    blocks = {}
    for n, a in snapshots.items():
        p = coef.T @ a.reshape(m, -1).double()  # (k, d_n)
        blocks[n] = p
    # Re-orthonormalise: P ← P (PᵀP)^{-1/2} (k × k), removing the Gram route's round-off.
    g = torch.zeros(k, k, dtype=torch.float64, device=dev)
    for p in blocks.values():
        g += p @ p.T
    w, v = torch.linalg.eigh(g)
    inv_sqrt = (v / w.clamp_min(1e-300).sqrt()) @ v.T
    out = {}
    for n, p in blocks.items():
        shape = snapshots[n].shape[1:]
        out[n] = (inv_sqrt @ p).to(_DTYPES[dtype]).reshape(k, *shape)
    return SubspaceBasis(out, lam.sqrt().cpu(), None, {"snapshots": m, "rank": rank, "dtype": dtype})


def format_bytes(n: int) -> str:
    """``n`` bytes as a short human string (MiB / GiB)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def snapshot_schedule(total_steps: int, m: int) -> tuple[int, list[int]]:
    """Algorithm 3 line 1 / Algorithm 1 line 2: round T1 up to a multiple of ``m`` and record a
    snapshot after every ``y = T1 / m`` steps. Returns ``(T1, steps after which to record)``."""
    if m < 1:
        raise SubspaceError(f"number of snapshots must be ≥ 1, got {m}")
    t1 = max(1, math.ceil(total_steps / m)) * m
    y = t1 // m
    return t1, [y * (j + 1) for j in range(m)]


__all__ = ["SubspaceBasis", "SubspaceError", "basis_from_snapshots", "format_bytes", "snapshot_schedule"]
