"""Book-keeping rule for ``nn.LayerNorm`` (elementwise affine weight and bias).

Forward: ``y = x_hat * w + b`` with ``x: (B, ..., *S)``, normalised shape ``S`` (usually
``(d,)``), ``x_hat = (x - mean) / sqrt(var + eps)`` over ``S``. With ``G = dL/dy`` the
per-example gradients are small (size of ``S``) and are instantiated directly::

    dL_i/dw = sum_t x_hat_i,t * G_i,t      (*S)   -> PerExample (B, *S)
    dL_i/db = sum_t G_i,t                  (*S)   -> PerExample (B, *S)

``x_hat`` is recomputed from the stored input with ``F.layer_norm`` (no affine), once, when the
gradient arrives; the input and gradient are released right after.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from dpft.grads.contrib import PerExample

from dpft.grads.kinds import LayerKind, save_input
from dpft.grads.registry import register_layer


@register_layer(nn.LayerNorm, builtin=True)
class LayerNormKind(LayerKind):
    """``nn.LayerNorm`` with the stock forward."""

    name = "layernorm"

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def save(self, module, args, kwargs, output, batch):
        return save_input(args, kwargs, batch, "LayerNorm input")

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None:
            return {}
        ns = tuple(module.normalized_shape)
        mid = tuple(range(1, state.dim() - len(ns)))
        out = {}
        if "weight" in roles:
            xhat = F.layer_norm(state, ns, None, None, module.eps)
            gw = xhat * g
            out["weight"] = PerExample(gw.sum(mid) if mid else gw)
        if "bias" in roles:
            out["bias"] = PerExample(g.sum(mid) if mid else g)
        return out
