"""Book-keeping rule for RMSNorm modules (Llama, Qwen2, Mistral, ... and ``torch.nn.RMSNorm``).

Forward (``LlamaRMSNorm``/``Qwen2RMSNorm``)::

    x_hat = (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)
    y     = w * x_hat

with ``x: (B, ..., d)``, ``w: (d,)``. With ``G = dL/dy`` the per-example weight gradient is
``dL_i/dw = sum_t x_hat_i,t * G_i,t``, shape ``(d,)``, instantiated as ``PerExample (B, d)``
from ``x_hat`` recomputed out of the stored input. Variants that scale by ``(1 + w)`` (Gemma)
have the same gradient with respect to ``w``.

Matched: any module whose class name ends in ``RMSNorm`` with a ``weight`` parameter and an
``eps`` or ``variance_epsilon`` attribute, and no other trainable parameter. ``torch.nn.RMSNorm``
is recomputed with ``F.rms_norm`` over its ``normalized_shape`` (``eps=None`` means
``torch.finfo(dtype).eps`` as in torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpft.grads.contrib import PerExample

from dpft.grads.kinds import LayerKind, save_input
from dpft.grads.registry import register_layer


def _eps(module: nn.Module):
    if hasattr(module, "variance_epsilon"):
        return module.variance_epsilon
    return getattr(module, "eps", None)


# Matched by class name (Llama, Qwen2, ... RMSNorm share no base class): registered as a
# catch-all for nn.Module, tried after every class-specific rule.
@register_layer(nn.Module, builtin=True)
class RMSNormKind(LayerKind):
    """Llama/Qwen2-style RMSNorm and ``torch.nn.RMSNorm``."""

    name = "rmsnorm"

    def matches(self, module: nn.Module) -> bool:
        return (
            type(module).__name__.endswith("RMSNorm")
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
        )

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def save(self, module, args, kwargs, output, batch):
        return save_input(args, kwargs, batch, f"{type(module).__name__} input")

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None or "weight" not in roles:
            return {}
        x = state
        if isinstance(module, nn.RMSNorm):
            ns = tuple(module.normalized_shape)
            xhat = F.rms_norm(x, ns, None, module.eps)
        else:
            ns = (x.shape[-1],)
            xf = x.to(torch.float32)
            eps = _eps(module)
            eps = torch.finfo(xf.dtype).eps if eps is None else eps
            xhat = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        mid = tuple(range(1, x.dim() - len(ns)))
        gw = xhat * g
        return {"weight": PerExample(gw.sum(mid) if mid else gw)}
