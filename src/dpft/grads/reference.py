"""Reference per-example gradients with ``torch.func`` (``functional_call`` + ``vmap(grad)``).

Exact and general (any differentiable model), but it materialises a ``(B, *shape)`` gradient
for every trainable parameter, so memory grows with B times the trainable size. It is the
ground truth the fast book-keeping engine is tested against, and the fallback for layers the
fast engine does not know.
"""

from __future__ import annotations

import warnings
from typing import Mapping

import torch
from torch.func import functional_call, grad, vmap

from dpft.grads.base import ClippedBatch, PerExampleEngine
from dpft.grads.groups import split_groups

_warned_loop = False


class ReferenceEngine(PerExampleEngine):
    """Per-example gradients by ``vmap(grad(loss of one example))``.

    Each example is run as a batch of one (``unsqueeze(0)``), so broadcast buffers such as
    BERT's ``position_ids`` are per example by construction. If the model's forward cannot be
    vmapped (data-dependent control flow), it falls back to a Python loop over examples with
    the same ``grad`` function and says so once.

    :attr:`precision` applies: the forward runs under its autocast; under fp16 each example's
    loss is multiplied by the static loss scale S and its gradient divided by S in fp32, and
    an example that overflows contributes 0 (``PerExampleEngine.screen_overflow``).
    Hugging Face activation checkpointing is not supported (its input-gradient hook calls
    ``requires_grad_`` inside the ``torch.func`` transform); use the book-keeping engine.
    """

    supports_precision = True
    #: ``clipped_sum`` honours ``batch[GROUP_KEY]`` (user-level group clipping, grads/groups.py).
    supports_groups = True

    def _single_loss(self, params, buffers, example):
        batch1 = {k: v.unsqueeze(0) for k, v in example.items()}
        fwd = lambda **kw: functional_call(  # noqa: E731
            self.model, (params, buffers), args=(), kwargs=kw, tie_weights=True, strict=False
        )
        with self.precision.autocast():
            loss = self.loss_fn(fwd, batch1)
        s = float(self.precision.loss_scale)
        return (loss.sum() * s if s != 1.0 else loss.sum()), loss.detach().sum()

    def per_example_grads(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], float]:
        """Per-example gradients ``name -> (B, *param.shape)`` and the summed loss."""
        grads, losses = self._per_example(batch)
        return grads, float(losses.sum())

    def _per_example(self, batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example gradients (loss scale divided out, fp32 when scaled) and ``(B,)`` losses."""
        global _warned_loop
        params = {n: p.detach() for n, p in self.params.items()}
        buffers = {n: b for n, b in self.model.named_buffers()}
        g = grad(self._single_loss, has_aux=True)
        batch = {k: v for k, v in batch.items()}
        try:
            # The transform's backward runs inside the forward's autocast too: under torch.func,
            # SDPA with dropout (attention dropout in train mode) saves an fp32 mask product and
            # its backward then multiplies fp32 by bf16 ("expected m1 and m2 to have the same
            # dtype"); plain autograd does not hit this. Autocast casts those matmul inputs as
            # the forward did; parameter gradients stay fp32 (the casts' backward).
            with self.precision.autocast():
                grads, losses = vmap(g, in_dims=(None, None, 0), randomness="different")(
                    params, buffers, batch
                )
        except Exception as exc:  # noqa: BLE001 - any vmap incompatibility
            if not _warned_loop:
                # Hugging Face's mask helpers inspect mask values (data-dependent control
                # flow), which vmap refuses; the per-example loop is exact, only slower.
                warnings.warn(
                    f"torch.func.vmap cannot trace this model ({type(exc).__name__}: "
                    f"{str(exc)[:80]}...); the reference engine loops over examples instead "
                    "(same result, slower)",
                    stacklevel=2,
                )
                _warned_loop = True
            b = next(iter(batch.values())).shape[0]
            with self.precision.autocast():  # as above
                outs = [g(params, buffers, {k: v[i] for k, v in batch.items()}) for i in range(b)]
            grads = {n: torch.stack([o[0][n] for o in outs]) for n in params}
            losses = torch.stack([o[1] for o in outs])
        s = float(self.precision.loss_scale)
        if s != 1.0:
            grads = {n: g.float() / s for n, g in grads.items()}
        return grads, losses

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        """Per-example clipped sum; with ``batch[GROUP_KEY]`` each group's summed gradient is
        clipped as one unit (user-level DP, grads/groups.py)."""
        batch, groups = split_groups(batch)
        grads, losses = self._per_example(batch)
        return self._finish(grads, float(losses.sum()), losses, groups)
