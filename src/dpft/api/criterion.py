"""``PerExampleCriterion``: the user's loss with each example's gradient its own (a mean's 1/B
scaled back)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from dpft.grads.live import LiveBookKeeping


class _MeanWithOwnGradients(torch.autograd.Function):
    """Value: the mean of the ``(B,)`` per-example losses. Gradient: each example's loss gets
    the upstream gradient unscaled (not ``1/B``), so its per-example gradient is its own."""

    @staticmethod
    def forward(ctx, per_example: torch.Tensor, denom: float):  # type: ignore[override]
        ctx.n = per_example.shape[0]
        return per_example.sum() / denom

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.expand(ctx.n), None


class PerExampleCriterion(nn.Module):
    """The user's loss, made per-example (returned by :meth:`PrivacyEngine.make_private`).

    ``criterion(input, target, ...)`` calls the user's loss with ``reduction='none'``
    (output ``(B, ...)``, example dimension first) and reduces each example's own elements:
    ``'mean'`` averages them (for ``CrossEntropyLoss``/``NLLLoss``, over the targets that are not
    ``ignore_index``), ``'sum'`` and ``'batchmean'`` sum them, giving ``(B,)`` per-example losses
    (nats for cross-entropy). It returns their mean (``'mean'``, ``'batchmean'``) or sum
    (``'sum'``) over the micro-batch, a scalar; in every case the backward gives each example's
    loss gradient 1, so the clip sees each example's own gradient. For a ``'mean'`` loss over
    several elements per example (sequence cross-entropy with padding, for instance) the value
    is the mean of the examples' means, which can differ from torch's mean over all elements.

    Attributes:
        last_per_example: the last ``(B,)`` per-example losses (detached).

    Raises:
        ValueError: (construction) a criterion without a ``reduction`` attribute, or with
            ``reduction='none'``; (call) an output without the example dimension first.
    """

    def __init__(self, criterion: nn.Module, session: Optional[LiveBookKeeping] = None):
        super().__init__()
        reduction = getattr(criterion, "reduction", None)
        if not isinstance(criterion, nn.Module) or reduction is None:
            raise ValueError(
                f"make_private: cannot make the criterion {criterion!r} per-example: it needs a "
                "torch.nn loss module with a `reduction` attribute (e.g. nn.CrossEntropyLoss(), "
                "nn.MSELoss()). For another loss pass criterion=None and compute a batch mean "
                "(loss_reduction='mean') or sum (loss_reduction='sum') of per-example losses yourself")
        if reduction not in ("mean", "sum", "batchmean"):
            raise ValueError(
                f"make_private: criterion has reduction={reduction!r}; pass it with reduction='mean' "
                "or 'sum' (make_private computes the per-example losses itself)")
        inner = type(criterion).__new__(type(criterion))
        inner.__dict__.update(criterion.__dict__)  # a shallow copy sharing weights/buffers
        inner.reduction = "none"
        self.inner = inner
        self.reduction = reduction
        self._session = session
        self.last_per_example: Optional[torch.Tensor] = None

    def per_example(self, input: torch.Tensor, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The ``(B,)`` per-example losses (with their graph)."""
        per = self.inner(input, target, *args, **kwargs)
        if not isinstance(per, torch.Tensor) or per.dim() == 0:
            raise ValueError(
                f"make_private: {type(self.inner).__name__}(reduction='none') returned a scalar; "
                "it cannot give per-example losses")
        b = per.shape[0]
        if per.dim() == 1:
            return per
        flat = per.reshape(b, -1)
        if self.reduction != "mean":
            return flat.sum(1)
        ignore = getattr(self.inner, "ignore_index", None)
        if (ignore is not None and isinstance(target, torch.Tensor) and not target.is_floating_point()
                and target.shape == per.shape):
            count = (target.reshape(b, -1) != ignore).sum(1).clamp_min(1)
            return flat.sum(1) / count.to(flat.dtype)
        return flat.mean(1)

    def forward(self, input: torch.Tensor, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        per = self.per_example(input, target, *args, **kwargs)
        if self._session is not None:
            self._session.on_loss(per)
        self.last_per_example = per.detach()
        if self.reduction == "sum":
            return per.sum()
        return _MeanWithOwnGradients.apply(per, float(max(per.shape[0], 1)))
