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

from dpft.step.clip import ClipPolicy, check_finite_norms

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
        loss_sum: sum of the per-example losses (detached, nats).
        n: number of examples B.
    """

    grad_sum: dict[str, torch.Tensor]
    sq_norms: torch.Tensor
    scales: torch.Tensor
    loss_sum: float
    n: int

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
        clip: the clip policy (``privacy/clipping.py``).
    """

    def __init__(self, model: nn.Module, loss_fn: PerExampleLoss, clip: ClipPolicy):
        self.model = model
        self.loss_fn = loss_fn
        self.clip = clip
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

    def _finish(self, per_ex: dict[str, torch.Tensor], loss_sum: float) -> ClippedBatch:
        """Shared tail for engines that hold per-example grads ``name -> (B, *shape)``."""
        names = self.param_names
        b = next(iter(per_ex.values())).shape[0]
        sq = torch.stack([per_ex[n].reshape(b, -1).pow(2).sum(1) for n in names], dim=1)
        check_finite_norms(sq)
        scales = self.clip.scales(sq)
        grad_sum = {
            n: torch.einsum("b,b...->...", scales[:, j].to(per_ex[n].dtype), per_ex[n])
            for j, n in enumerate(names)
        }
        return ClippedBatch(grad_sum, sq.detach(), scales.detach(), loss_sum, b)


class NonPrivateEngine(PerExampleEngine):
    """Plain backward of the summed loss: ``grad_sum = sum_i g_i``, no clipping, no norms.

    Used by ``--no-dp`` reference runs and as the denominator of speed benchmarks.
    """

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        for p in self.params.values():
            p.grad = None
        losses = self.loss_fn(lambda **kw: self.model(**kw), batch)
        losses.sum().backward()
        grad_sum = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in self.params.items()
        }
        for p in self.params.values():
            p.grad = None
        b = losses.shape[0]
        nan = torch.full((b, len(self.param_names)), float("nan"))
        return ClippedBatch(grad_sum, nan, torch.ones_like(nan), float(losses.detach().sum()), b)
