"""DP-SFT's subspace engine driven by the user's own loop (``make_private(methods=[{"name":
"dpsft", "source": "file", ...}])``).

:class:`~dpft.grads.subspace.SubspaceEngine` runs its forward and backward itself (``dpft train``,
``DPTrainer``). Under ``make_private`` the user's ``module(x)`` and ``loss.backward()`` run them,
and :class:`~dpft.grads.live.LiveBookKeeping` captures each layer's per-example contributions with
the same hooks as the plain engine; :class:`LiveSubspace` is the engine it is handed: the model's
spanned parameters (switched to ``requires_grad=False`` for the forward, so no weight gradient is
built), the book-keeping units and usage check, and a ``reduce`` that projects the contributions
onto the basis instead of summing them: ``s_i = Σ_l P_lᵀ g_{i,l}`` (``project_contribution``, the
same projection as the engine's), clipped in R^k to C and summed — the ``ClippedBatch`` the step's
aggregator expects under the engine's one key ``COORDS``.

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models"
(AAAI 2026), Algorithm 2 lines 5-10.
"""

from __future__ import annotations

import torch

from dpft.grads.base import ClippedBatch
from dpft.grads.contrib import full_precision, merge
from dpft.grads.subspace import COORDS, SubspaceEngine, project_contribution
from dpft.step.clip import check_finite_norms

__all__ = ["LiveSubspace", "live_engine"]


class LiveSubspace:
    """The :class:`SubspaceEngine` as :class:`~dpft.grads.live.LiveBookKeeping` drives an engine.

    Attributes:
        model, units: the engine's model and book-keeping units; params: the spanned model
            parameters (what the live hooks freeze for the forward and whose ``p.grad`` they drop).
    """

    def __init__(self, engine: SubspaceEngine):
        self.sub = engine
        self.model = engine.model
        self.units = engine.units
        self.params = engine.model_params

    # The book-keeping engine owns the first-call usage check and the checkpointing flag.
    @property
    def _checked(self) -> bool:
        return self.sub._bk._checked

    @_checked.setter
    def _checked(self, value: bool) -> None:
        self.sub._bk._checked = value

    @property
    def recomputes(self) -> bool:
        return getattr(self.sub._bk, "recomputes", False)

    @recomputes.setter
    def recomputes(self, value: bool) -> None:
        self.sub._bk.recomputes = value

    def verify_uses(self, *args, **kwargs):
        return self.sub._bk.verify_uses(*args, **kwargs)

    def reduce(self, contribs: dict, b: int, loss_sum: float, device=None, grad_scale: float = 1.0,
               groups=None, losses=None) -> ClippedBatch:
        """``Σ_i c_i s_i`` of one micro-batch: ``(k,)`` under ``COORDS``; ``sq_norms``/``scales``
        ``(B, 1)`` (``‖s_i‖²`` and the flat clip factor min(1, C/‖s_i‖)).

        Raises:
            ValueError: user ids (group clipping is refused with DP-SFT before this).
            NonFiniteGradientError: a non-finite coordinate norm (nothing is released)."""
        if groups is not None:
            raise ValueError("DP-SFT coordinates are per row; user-level group clipping is not supported")
        for u in self.units:  # outputs kept for a layout check that did not run (no criterion)
            u.check_outputs = []
        basis = self.sub.basis
        with full_precision():
            coords = torch.zeros(b, basis.k, dtype=torch.float32, device=basis.device)
            for n in basis.names:
                for c in merge(contribs.pop(n, [])):
                    coords += project_contribution(c, basis.blocks[n], b).to(coords.device)
            contribs.clear()
            if grad_scale != 1.0:  # a batch-mean loss: each example's own gradient
                coords = coords * float(grad_scale)
            sq = coords.pow(2).sum(1, keepdim=True)
            check_finite_norms(sq)
            scales = self.sub.clip.scales(sq)
            total = (coords * scales).sum(0)
        return ClippedBatch({COORDS: total}, sq, scales, float(loss_sum), b)


def live_engine(engine):
    """The engine :class:`~dpft.grads.live.LiveBookKeeping` drives for ``engine`` (itself, unless a
    method swapped in the subspace engine)."""
    return LiveSubspace(engine) if isinstance(engine, SubspaceEngine) else engine
