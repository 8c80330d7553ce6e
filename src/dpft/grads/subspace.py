"""Per-example subspace coordinates ``s_i = Pᵀ g_i`` without a whole-model per-example gradient.

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models"
(AAAI 2026), Algorithm 2 lines 5-10 (project, clip in R^k, aggregate). dpft's version of
line 10-11: the clipped coordinates are *summed* here and the Gaussian mechanism adds
``N(0, σ²C² I_k)`` to the sum (the paper adds σC after averaging: an effective noise
multiplier σB, B times more noise than its stated σ needs); the loop then divides by the
expected batch size.

How: the book-keeping capture (``_hooks.Capture``; one forward, one backward of activation
gradients only) hands each trainable layer's per-example gradient in factored form. Layer by
layer, the engine turns it into its share of the coordinates and drops it:

* ``Outer(U, V)`` (Linear / Conv1D weights, ``g_i = U_iᵀ V_i``, ``(R, C)``): instantiated a tile
  of rows at a time (``(B, rows, C)``, at most ``_PROJ_TILE_ELEMS`` floats, so it stays in cache)
  and multiplied by the matching rows of the layer's block ``P_l: (k, R, C)`` — cost
  ``B R C (T + k)``, the same order as the weight gradient of a non-private backward;
* an index side (embeddings): ``Σ_t P_l[:, idx_t, :] · v_t`` by a gather, ``O(B T k C)``;
* ``PerExample(g)`` (biases, LayerNorm): ``g.reshape(B, -1) @ P_lᵀ``.

Contributions to one parameter (tied weights, repeated calls) are projected separately and
added (projection is linear), so no cross terms are needed. The coordinates of the whole
model are the sum over layers: ``s_i = Σ_l P_lᵀ g_{i,l}``. At no time does a ``(B, d)`` tensor
exist; the largest per-example object is one tile of one layer.

The engine's single clipping group is the k-vector: ``sq_norms`` is ``(B, 1)`` = ``‖s_i‖²`` and
the flat clip factor ``min(1, C/‖s_i‖)`` bounds each example's contribution in R^k by ``C``.

Under FSDP2 (dpft/placement/fsdp.py, issue 38) FSDP all-gathers each block before its forward and backward,
so every captured contribution of a rank's own examples is full-shape, and with ``P`` replicated
on every rank (``k × d_trainable`` floats per rank) ``s_i`` is complete on the example's rank: no
communication per example. The clipped sum ``Σ_i c_i s_i`` is not a sharded parameter but a
``(k,)`` vector: the engine hands it to ``on_param_sum`` (the step's
:class:`~dpft.placement.fsdp_methods.ReplicatedSum`, which zeroes a placeholder's) and the step all-reduces
it once per logical batch (``replicated_sum``), then noises it once for the world.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from dpft.grads.capture import Capture

from dpft.grads.contrib import Contribution, Outer, PerExample, full_precision, merge
from dpft.grads.base import ClippedBatch, PerExampleEngine, PerExampleLoss, trainable_parameters
from dpft.grads.bookkeeping import BookKeepingEngine, _batch_size
from dpft.grads.clip import ClipPolicy, check_finite_norms
from dpft.grads.basis import SubspaceBasis, SubspaceError

#: Per-example gradients of one layer are instantiated a tile of rows at a time, at most this
#: many floats (4 MiB: about a core's L2/L3 share), and projected at once.
_PROJ_TILE_ELEMS = 1 << 20

#: Name under which the engine returns the clipped sum of coordinates ``Σ_i c_i s_i`` (k,).
COORDS = "subspace.coords"


def project_contribution(c: Contribution, block: torch.Tensor, batch: int) -> torch.Tensor:
    """``(B, k)`` float32: ``P_lᵀ g_{i}`` for one contribution ``c`` to a parameter whose block
    of P is ``block: (k, *param.shape)``."""
    k = block.shape[0]
    if isinstance(c, PerExample):
        return c.g.reshape(batch, -1).float() @ block.reshape(k, -1).float().T
    assert isinstance(c, Outer)
    r, cc = c.shape
    if c.left_index or c.right_index:
        # g_i = Σ_t e_{idx_t} v_tᵀ (rows) or Σ_t u_t e_{idx_t}ᵀ (columns): <P_j, g_i> = Σ_t P_j[idx_t] · v_t
        if c.left_index:
            idx, dense, pb = c.left, c.right, block.reshape(k, r, cc)
        else:
            idx, dense, pb = c.right, c.left, block.reshape(k, r, cc).transpose(1, 2)
        b, t = idx.shape
        rows = pb[:, idx.reshape(-1), :].float()  # (k, B*T, C)
        per = torch.einsum("knc,nc->nk", rows, dense.reshape(b * t, -1).float())
        return per.reshape(b, t, k).sum(1)
    # Tiles of rows: the per-example gradients of `rows` rows of the layer, (B, rows, C), stay in
    # cache between the bmm that builds them and the GEMM that projects them, and each row block
    # of P is read once. Materialising the whole (B, R, C) first was memory-bound (2x slower).
    pf = block.reshape(k, r, cc)
    ut = c.left.float().transpose(1, 2)  # (B, R, T)
    v = c.right.float()  # (B, T, C)
    rows = max(1, _PROJ_TILE_ELEMS // max(1, batch * cc))
    out = torch.zeros(batch, k, dtype=torch.float32, device=v.device)
    for r0 in range(0, r, rows):
        g = torch.bmm(ut[:, r0: r0 + rows], v)  # (B, rows, C): this layer, these rows
        out.addmm_(g.reshape(batch, -1), pf[:, r0: r0 + rows].reshape(k, -1).float().T)
    return out


class SubspaceEngine(PerExampleEngine):
    """Clipped sum of per-example subspace coordinates (DP-SFT stage 2).

    Args:
        model: the network; its trainable parameters must be exactly the parameters the basis
            spans (the loop freezes everything else).
        loss_fn: per-example loss ``(B,)`` (nats).
        clip: clip policy applied to ``‖s_i‖`` in R^k (flat or automatic; per-layer has one
            group here and equals flat).
        basis: the basis ``P`` (``grads/basis.py``).

    ``clipped_sum(batch)`` returns a :class:`ClippedBatch` whose ``grad_sum`` has one entry,
    ``COORDS`` -> ``Σ_i c_i s_i`` of shape ``(k,)``; ``sq_norms``/``scales`` are ``(B, 1)``.
    ``self.params`` is ``{COORDS: zeros(k)}`` (the shape of what the engine sums), and
    ``self.model_params`` the model parameters spanned.

    Raises:
        SubspaceError: the trainable parameters and the basis parameters differ, or shapes do
            not match.
    """

    def __init__(self, model: nn.Module, loss_fn: PerExampleLoss, clip: ClipPolicy, basis: SubspaceBasis):
        super().__init__(model, loss_fn, clip)
        train = trainable_parameters(model)
        missing = [n for n in basis.names if n not in train]
        extra = [n for n in train if n not in basis.blocks]
        if missing or extra:
            raise SubspaceError(
                "the basis must span exactly the trainable parameters; "
                f"basis parameters not trainable here: {missing[:3]}, trainable parameters not in "
                f"the basis: {extra[:3]}. Use the same trainable selection as the stage that built it")
        for n in basis.names:
            if tuple(basis.blocks[n].shape[1:]) != tuple(train[n].shape):
                raise SubspaceError(f"basis block of {n} has shape {tuple(basis.blocks[n].shape[1:])}, "
                                    f"the parameter {tuple(train[n].shape)}")
        dev = next(iter(train.values())).device
        if basis.device != dev:  # P beside the model: coordinates, their sum and its noise live there
            basis = basis.to(next(iter(basis.blocks.values())).dtype, device=dev)
        self.basis = basis
        self.model_params = train
        # The book-keeping engine owns the layer rules and the first-call attribution check.
        self._bk = BookKeepingEngine(model, loss_fn, clip)
        self.units = self._bk.units
        # What the engine sums lives beside P (the model's device: the noise is drawn there).
        self.params = {COORDS: torch.zeros(basis.k, device=basis.device)}  # type: ignore[dict-item]
        self.param_names = [COORDS]
        self._checked = False

    #: The clipped sum is a ``(k,)`` vector held whole by every rank (all-reduced under FSDP2,
    #: dpft/placement/fsdp.py), not a sharded parameter to reduce-scatter.
    replicated_sum = True
    #: The sharded step's hook ``(name, sum) -> sum`` for each micro-batch's clipped coordinate sum
    #: (dpft/placement/fsdp_methods.py ``ReplicatedSum``: zeros for a placeholder). None: kept as is.
    on_param_sum = None

    def check_usage(self, batch: Mapping[str, torch.Tensor], groups: torch.Tensor | None = None) -> None:
        """The book-keeping engine's one-time usage probe (every use of a spanned weight is a hooked
        module call); the sharded step runs it on the same placeholder batch on every rank."""
        self._bk.check_usage(batch, groups)
        self._checked = True

    def finish_sum(self, total: torch.Tensor) -> torch.Tensor:
        """``Σ_i c_i s_i`` of one micro-batch through the sharded step's hook (as is without one)."""
        return total if self.on_param_sum is None else self.on_param_sum(COORDS, total)

    def coordinates(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped per-example coordinates ``(B, k)`` float32 and the per-example losses ``(B,)``."""
        b = _batch_size(batch)
        params = list(self.model_params.values())
        flags = [p.requires_grad for p in params]
        cap = Capture(self.units, b, mode="main")
        coords = torch.zeros(b, self.basis.k, dtype=torch.float32, device=self.basis.device)
        try:
            for p in params:
                p.requires_grad_(False)  # activation gradients only; no weight gradient is built
            with torch.enable_grad():
                with cap:
                    losses = self.loss_fn(lambda **kw: self.model(**kw), batch)
                if losses.shape != (b,):
                    raise ValueError(f"loss_fn must return per-example losses of shape ({b},), "
                                     f"got {tuple(losses.shape)}")
                cap.backward(losses.sum())
        finally:
            for p, f in zip(params, flags):
                p.requires_grad_(f)
        for n in self.basis.names:
            for c in merge(cap.contribs.pop(n, [])):
                coords += project_contribution(c, self.basis.blocks[n], b).to(coords.device)
        return coords, losses.detach()

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        if not self._checked:
            # Every use of a spanned weight must be a hooked module call. The probe runs a forward
            # (dropout draws): fork the RNG so a resumed run's masks equal an uninterrupted one's.
            with torch.random.fork_rng(devices=[]):
                self._bk.check_usage(batch)
            self._checked = True
        coords, losses = self.coordinates(batch)
        sq = coords.pow(2).sum(1, keepdim=True)
        check_finite_norms(sq)
        scales = self.clip.scales(sq)
        total = self.finish_sum((coords * scales).sum(0))
        return ClippedBatch({COORDS: total}, sq, scales, float(losses.sum()), coords.shape[0])


class LiveSubspace:
    """DP-SFT's subspace engine driven by the user's own loop (``make_private``): the engine
    :class:`~dpft.grads.live.LiveBookKeeping` is handed. Under ``make_private`` the user's
    ``module(x)`` and ``loss.backward()`` run the forward and backward and the live hooks capture
    each layer's per-example contributions, as for the plain engine; this view holds the spanned
    model parameters (frozen for the forward, so no weight gradient is built), the book-keeping
    units and usage check, and a ``reduce`` that projects the contributions onto the basis instead
    of summing them: ``s_i = Σ_l P_lᵀ g_{i,l}`` (``project_contribution``, the engine's own
    projection), clipped in R^k to C and summed under the engine's one key ``COORDS`` (Zheng et al.,
    AAAI 2026, Algorithm 2 lines 5-10).

    Attributes:
        model, units: the engine's model and book-keeping units; params: the spanned parameters.
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
            total = self.sub.finish_sum((coords * scales).sum(0))  # FSDP2: a placeholder's is zeros
        return ClippedBatch({COORDS: total}, sq, scales, float(loss_sum), b)


__all__ = ["COORDS", "LiveSubspace", "SubspaceEngine", "project_contribution"]
