"""Book-keeping rule for ``nn.Embedding`` (word, position and token-type tables).

Forward: ``y[i, t] = W[x_i,t]`` with ids ``x: (B, T)`` int64, ``W: (V, d)``, ``y: (B, T, d)``.
With ``G = dL/dy: (B, T, d)`` the per-example gradient is a sum of one-hot outer products::

    dL_i/dW = sum_t e_{x_i,t} G_i,t^T                          (V, d)

kept as ``Outer(left=x, right=G)`` with an *index* left side -- the ``(B, V, d)`` tensor is
never built. Its squared norm counts repeated tokens of one example exactly::

    ||dL_i/dW||^2 = sum_{t,s : x_t = x_s} <G_i,t, G_i,s>

computed in ``O(B T d)`` by summing the rows of equal ``(example, token)`` keys first
(``_hooks._index_sq_norm``). The clipped sum is one ``index_add_`` of the ``c_i``-scaled rows.

Positions equal to ``padding_idx`` receive no gradient (as in ``nn.Embedding``), so their rows
are zeroed. Position ids broadcast over the batch (Hugging Face BERT/GPT-2 pass ``(1, T)``
when ``position_ids`` is not given) would make ``G`` the *sum* over examples; the forward hook
therefore expands such an output to ``(B, T, d)`` (a stride-0 view, no copy) so that each
example receives its own gradient. Subclasses with their own ``forward`` (e.g. scaled
embeddings), ``max_norm`` or ``scale_grad_by_freq`` are not matched and use the exact fallback.
"""

from __future__ import annotations

from torch import nn

from dpft.grads.contrib import BatchLayoutError, Outer

from dpft.grads.kinds import LayerKind, LayoutError, batch_first, first_input
from dpft.grads.registry import register_layer


@register_layer(nn.Embedding, builtin=True)
class EmbeddingKind(LayerKind):
    """``nn.Embedding`` with the stock forward."""

    name = "embedding"

    def matches(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Embedding)
            and type(module).forward is nn.Embedding.forward
            and module.max_norm is None
            and not module.scale_grad_by_freq
        )

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def save(self, module, args, kwargs, output, batch):
        ids = first_input(args, kwargs)
        new_out = None
        if ids.dim() >= 1 and ids.shape[0] == 1 and batch > 1:
            ids = ids.expand(batch, *ids.shape[1:])
            new_out = output.expand(batch, *output.shape[1:])
        try:  # (B, ...) ids, or flattened token-major (B*n,) ids seen as (B, n)
            return batch_first(ids, batch, "Embedding ids"), new_out, [ids]
        except BatchLayoutError as e:
            return LayoutError(str(e)), None, []

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None or "weight" not in roles:
            return {}
        ids = state.reshape(state.shape[0], -1)
        g = g.reshape(g.shape[0], -1, g.shape[-1])
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx)[:, :, None].to(g.dtype)
        return {"weight": Outer(ids, g, module.weight.shape)}
