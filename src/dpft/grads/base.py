"""The per-example engine interface.

An engine takes one physical micro-batch and returns what the DP step needs from it: the
clipped sum ``sum_i c_i g_i`` over trainable parameters and the per-example norms that set
the clip factors. How it gets there is the engine's business: the ``torch.func`` reference
(``grads/reference.py``) materialises per-example gradients; the book-keeping fast path
(issue 3) never does.

Shapes: ``B`` examples in the micro-batch, ``G`` clipping groups = trainable parameters in
``engine.param_names`` order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from dpft.grads.contrib import full_precision
from dpft.grads.precision import FP32, Precision
from dpft.grads.clip import ClipPolicy, check_finite_norms
from dpft.grads.groups import group_sum, n_groups

#: ``loss_fn(forward, batch) -> (B,)`` per-example losses (nats). ``forward(**inputs)`` runs the
#: model (possibly functionally); ``batch`` holds tensors with leading dimension B.
PerExampleLoss = Callable[[Callable[..., object], Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass
class ClippedBatch:
    """Result of one micro-batch.

    Attributes:
        grad_sum: name -> tensor shaped like the parameter: ``sum_i c_i g_i`` (not averaged).
        sq_norms: ``(B, G)`` squared per-example gradient norm of each group, before clipping.
        scales: ``(B, G)`` clip factors applied.
        loss_sum: sum of the per-example losses (detached, nats; under fp16, of the examples
            that did not overflow).
        n: number of examples B.
        overflowed: examples whose loss or gradient overflowed under fp16 and that contribute
            0 (their clip factors are 0); a private statistic like the clip count.
    """

    grad_sum: dict[str, torch.Tensor]
    sq_norms: torch.Tensor
    scales: torch.Tensor
    loss_sum: float
    n: int
    overflowed: int = 0

    @property
    def norms(self) -> torch.Tensor:
        """``(B,)`` per-example L2 norm of the whole trainable gradient before clipping."""
        return self.sq_norms.sum(dim=1).sqrt()


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name (tied parameters appear once, as in ``named_parameters``)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class PerExampleEngine(ABC):
    """Computes clipped per-example gradient sums for the trainable parameters of ``model``.

    Args:
        model: the network; its trainable parameters are those with ``requires_grad``.
        loss_fn: per-example loss, see :data:`PerExampleLoss`.
        clip: the clip policy (``grads/clip.py``).

    Attributes:
        precision: autocast dtype and static loss scale of the forward/backward
            (:class:`dpft.grads.precision.Precision`; fp32 by default). Engines that apply it declare
            ``supports_precision = True``; the trainer refuses bf16/fp16 with any other.
    """

    #: Whether :attr:`precision` is applied by this engine's ``clipped_sum``.
    supports_precision = False
    #: Whether ``clipped_sum`` clips groups of rows as one (``batch[GROUP_KEY]``, grads/groups.py).
    supports_groups = False

    def __init__(self, model: nn.Module, loss_fn: PerExampleLoss, clip: ClipPolicy):
        self.model = model
        self.loss_fn = loss_fn
        self.clip = clip
        self.precision: Precision = FP32
        self.params = trainable_parameters(model)
        if not self.params:
            raise ValueError(
                "the model has no trainable parameters; choose a trainable selection "
                "(e.g. trainable.mode: full, head, last_k, bias, lora)"
            )
        self.param_names = list(self.params)

    @abstractmethod
    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        """Clip each example's gradient with the policy and sum over the micro-batch."""

    def screen_overflow(self, sq: torch.Tensor, losses: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp16 only: the examples whose loss or squared norm is not finite, and ``sq`` with
        their rows set to 0; ``(sq, None)`` when there are none or the precision is not fp16.

        Such an example then gets clip factor 0 and its factors are zeroed, so it contributes
        nothing (sensitivity stays C; see :mod:`dpft.placement.device`). Under fp32/bf16 a non-finite
        norm still stops the step (``check_finite_norms``)."""
        if not self.precision.zero_nonfinite:
            return sq, None
        bad = ~torch.isfinite(sq).all(dim=1)
        if losses is not None:
            bad = bad | ~torch.isfinite(losses.detach().reshape(-1))
        if not bool(bad.any()):
            return sq, None
        return sq.masked_fill(bad[:, None], 0.0), bad

    def _finish(self, per_ex: dict[str, torch.Tensor], loss_sum: float,
                losses: torch.Tensor | None = None, groups: torch.Tensor | None = None) -> ClippedBatch:
        """Shared tail for engines that hold per-example grads ``name -> (B, *shape)``
        (true gradients, loss scale already divided out). Norms, factors and sums in fp32.

        ``groups``: ``(B,)`` int64 group ids 0..G-1 (user-level DP, grads/groups.py): the norm
        clipped is each group's summed gradient; each row gets its group's factor."""
        names = self.param_names
        b = next(iter(per_ex.values())).shape[0]
        if groups is not None:
            if self.precision.zero_nonfinite:
                raise ValueError("user-level (group) clipping does not support fp16; use perf.dtype: bf16 or fp32")
            ng = n_groups(groups)
            with full_precision():
                sq_g = torch.stack([group_sum(per_ex[n].reshape(b, -1), groups, ng).pow(2).sum(1)
                                    for n in names], dim=1)
                check_finite_norms(sq_g)
                sq = sq_g[groups.to(sq_g.device)]
                scales = self.clip.scales(sq)
                grad_sum = {n: torch.einsum("b,b...->...", scales[:, j].float(), per_ex[n].float())
                            for j, n in enumerate(names)}
            return ClippedBatch(grad_sum, sq.detach(), scales.detach(), loss_sum, b, 0)
        with full_precision():
            sq = torch.stack([per_ex[n].reshape(b, -1).float().pow(2).sum(1) for n in names], dim=1)
            sq, bad = self.screen_overflow(sq, losses)
            check_finite_norms(sq)
            scales = self.clip.scales(sq)
            overflowed = 0
            if bad is not None:
                scales = scales.masked_fill(bad[:, None], 0.0)
                overflowed = int(bad.sum())
                keep = ~bad
                loss_sum = float(losses.detach().reshape(-1)[keep].sum()) if losses is not None else loss_sum
            grad_sum = {}
            for j, n in enumerate(names):
                g = per_ex[n].float()
                if bad is not None:
                    g = torch.where(bad.reshape(-1, *([1] * (g.dim() - 1))), torch.zeros((), device=g.device), g)
                grad_sum[n] = torch.einsum("b,b...->...", scales[:, j].float(), g)
        return ClippedBatch(grad_sum, sq.detach(), scales.detach(), loss_sum, b, overflowed)


class NonPrivateEngine(PerExampleEngine):
    """Plain backward of the summed loss: ``grad_sum = sum_i g_i``, no clipping, no norms.

    Used by ``--no-dp`` reference runs and as the denominator of speed benchmarks. Applies
    :attr:`precision` (autocast forward; fp16: static loss scale, divided out of the sum).
    """

    supports_precision = True

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        for p in self.params.values():
            p.grad = None
        with self.precision.autocast():
            losses = self.loss_fn(lambda **kw: self.model(**kw), batch)
        s = float(self.precision.loss_scale)
        (losses.sum() * s if s != 1.0 else losses.sum()).backward()
        grad_sum = {
            n: (p.grad.detach().float() / s if p.grad is not None else torch.zeros(p.shape, device=p.device))
            for n, p in self.params.items()
        }
        for p in self.params.values():
            p.grad = None
        b = losses.shape[0]
        nan = torch.full((b, len(self.param_names)), float("nan"), device=losses.device)
        return ClippedBatch(grad_sum, nan, torch.ones_like(nan), float(losses.detach().sum()), b)
