"""Book-keeping rule for GPT-2's ``transformers.pytorch_utils.Conv1D``.

Despite its name it is a linear layer with the weight stored transposed:
``y = x W + b`` with ``x: (B, T, d_in)``, ``W: (d_in, d_out)`` (``nx, nf``), ``b: (d_out,)``.
With ``A = x`` and ``G = dL/dy: (B, T, d_out)``::

    dL_i/dW = A_i^T G_i        (d_in, d_out)      -> Outer(left=A, right=G)
    dL_i/db = sum_t G_i,t      (d_out,)           -> PerExample

Norms and clipped sums are those of ``linear.py`` with the factors swapped.
"""

from __future__ import annotations

from torch import nn

from dpft.grads.linear import LinearKind
from dpft.grads.registry import register_layer


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ != "Conv1D" or not cls.__module__.startswith("transformers"):
        return False
    return hasattr(module, "nf") and hasattr(module, "nx")


# Matched by class name and module (dpft does not import transformers): a catch-all rule.
@register_layer(nn.Module, builtin=True)
class Conv1DKind(LinearKind):
    """``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, ...): a Linear whose weight is
    stored transposed, (d_in, d_out); the input/output-gradient rule is the Linear one."""

    name = "conv1d"
    transposed = True

    def matches(self, module: nn.Module) -> bool:
        return _is_conv1d(module)
