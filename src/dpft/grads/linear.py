"""Book-keeping rule for ``nn.Linear`` (with or without bias; also LoRA's ``lora_A``/``lora_B``).

Forward: ``y = x W^T + b`` with ``x: (B, ..., d_in)``, ``W: (d_out, d_in)``, ``b: (d_out,)``;
2-D inputs ``(B, d_in)`` are treated as ``T = 1``, higher ones are flattened to
``(B, T, d_in)``. With ``A = x`` and ``G = dL/dy: (B, T, d_out)`` the per-example gradients are
(Goodfellow 2015, "Efficient per-example gradient computations"; Bu et al. 2023)::

    dL_i/dW = G_i^T A_i        (d_out, d_in)      -> Outer(left=G, right=A)
    dL_i/db = sum_t G_i,t      (d_out,)           -> PerExample

The weight's squared norm is the ghost norm ``<A_i A_i^T, G_i G_i^T>`` or the instantiated
``||G_i^T A_i||^2``, whichever costs less (``_hooks.outer_sq_norm``); its clipped sum is
``(c * G)^T A`` as one matrix product over the ``B*T`` rows.
"""

from __future__ import annotations

from torch import nn

from dpft.grads.contrib import Outer, PerExample

from dpft.grads.kinds import LayerKind, as_3d, save_input
from dpft.grads.registry import register_layer


@register_layer(nn.Linear, builtin=True)
class LinearKind(LayerKind):
    """``nn.Linear`` and subclasses that keep its ``forward``."""

    name = "linear"
    #: Weight stored (d_in, d_out) instead of (d_out, d_in) (GPT-2 Conv1D).
    transposed = False

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight", "bias")

    def save(self, module, args, kwargs, output, batch):
        return save_input(args, kwargs, batch, f"{type(module).__name__} input")

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None:
            return {}
        a = as_3d(state)
        g = as_3d(g)
        out = {}
        if "weight" in roles:
            out["weight"] = Outer(a, g, module.weight.shape) if self.transposed else Outer(g, a, module.weight.shape)
        if "bias" in roles:
            out["bias"] = PerExample(g.sum(1))
        return out
