"""The subspace basis ``P`` the subspace engine computes in (grads/subspace.py): an orthonormal
``(d, k)`` basis stored block-wise, one ``(k, *shape_n)`` block per parameter, its projections
``Pᵀg`` and ``Ps`` and its safetensors file.

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models"
(AAAI 2026), Eq. 4 (``P``) and Algorithm 2 lines 7 and 12 (project with ``Pᵀ``, unproject with
``P``). How a basis is built from a fine-tuning trajectory is DP-SFT's (transforms/subspace.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["SubspaceBasis", "SubspaceError"]


class SubspaceError(ValueError):
    """A basis that cannot be built or used; the message names the fix."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SubspaceBasis:
    """An orthonormal basis ``P`` (d × k) stored block-wise.

    Attributes:
        blocks: parameter name -> ``(k, *param.shape)`` block of ``P`` (float32 or bfloat16).
        singular_values: ``(k,)`` singular values of the trajectory ``A`` (float64, descending).
        start: optional parameter name -> tensor: the parameters ``Θ*`` stage 2 starts from
            (Algorithm 3 line 4: PST(Θ*, P, ...)).
        meta: JSON-able provenance (source, snapshots, steps, public task...).
    """

    blocks: dict[str, torch.Tensor]
    singular_values: torch.Tensor
    start: Optional[dict[str, torch.Tensor]] = None
    meta: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(next(iter(self.blocks.values())).shape[0])

    @property
    def names(self) -> list[str]:
        return list(self.blocks)

    @property
    def dim(self) -> int:
        """d: number of parameters spanned."""
        return sum(b[0].numel() for b in self.blocks.values())

    @property
    def nbytes(self) -> int:
        """Memory of P in bytes (as stored: dtype × d × k)."""
        return sum(b.numel() * b.element_size() for b in self.blocks.values())

    def to(self, dtype: str | torch.dtype, device: str | torch.device | None = None) -> "SubspaceBasis":
        """A copy of the basis with P stored in ``dtype`` (``float32`` or ``bfloat16``), on
        ``device`` (None: where it is; ``Θ*`` stays where it is, it is copied into the model)."""
        dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        return SubspaceBasis({n: b.to(device=device, dtype=dt) for n, b in self.blocks.items()},
                             self.singular_values, self.start, dict(self.meta))

    @property
    def device(self) -> torch.device:
        """Where P is stored."""
        return next(iter(self.blocks.values())).device

    # ------------------------------------------------------------------ projections
    def project(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``Pᵀ g``: ``(k,)`` coordinates of a gradient given per parameter (float32).

        Raises:
            SubspaceError: a parameter of the basis is missing from ``grads``.
        """
        missing = [n for n in self.blocks if n not in grads]
        if missing:
            raise SubspaceError(f"project: gradient lacks basis parameters {missing[:3]}")
        out = torch.zeros(self.k, dtype=torch.float32, device=self.device)
        for n, b in self.blocks.items():
            out += b.reshape(self.k, -1).float() @ grads[n].reshape(-1).float().to(b.device)
        return out

    def unproject(self, coords: torch.Tensor) -> dict[str, torch.Tensor]:
        """``P s``: parameter name -> tensor shaped like the parameter (float32), for
        ``coords`` of shape ``(k,)`` (Algorithm 2 line 12)."""
        if coords.shape != (self.k,):
            raise SubspaceError(f"unproject: coordinates must have shape ({self.k},), got {tuple(coords.shape)}")
        c = coords.float()
        return {n: torch.tensordot(c, b.float(), dims=1) for n, b in self.blocks.items()}

    def gram(self) -> torch.Tensor:
        """``PᵀP`` (k × k, float64): the identity for an orthonormal basis."""
        g = torch.zeros(self.k, self.k, dtype=torch.float64, device=self.device)
        for b in self.blocks.values():
            f = b.reshape(self.k, -1).double()
            g += f @ f.T
        return g

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write the basis (and ``Θ*`` if present) as one safetensors file.

        Keys: ``basis.<name>`` ``(k, *shape)``, ``start.<name>``, ``singular_values``; the
        metadata header holds ``meta`` as JSON.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # The file is device-free: tensors on an accelerator are copied to the host first.
        tensors = {f"basis.{n}": b.detach().cpu().contiguous() for n, b in self.blocks.items()}
        tensors["singular_values"] = self.singular_values.double().cpu().contiguous()
        for n, t in (self.start or {}).items():
            tensors[f"start.{n}"] = t.detach().cpu().contiguous()
        meta = {"format": "dpft-subspace-1", "names": json.dumps(self.names), "meta": json.dumps(self.meta)}
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SubspaceBasis":
        """Read a file written by :meth:`save`.

        Raises:
            SubspaceError: missing file or not a dpft subspace file.
        """
        path = Path(path)
        if not path.is_file():
            raise SubspaceError(f"subspace file not found: {path} (write one with a public or private "
                                "stage-1 run; it is saved as <run>/subspace/basis.safetensors)")
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if md.get("format") != "dpft-subspace-1":
                raise SubspaceError(f"{path} is not a dpft subspace file (no 'dpft-subspace-1' header)")
            names = json.loads(md["names"])
            blocks = {n: f.get_tensor(f"basis.{n}") for n in names}
            keys = set(f.keys())
            start = {n: f.get_tensor(f"start.{n}") for n in names if f"start.{n}" in keys} or None
            sv = f.get_tensor("singular_values")
        return cls(blocks, sv, start, json.loads(md.get("meta", "{}")))
