"""Book-keeping rule for T5's relative-attention bias (T5, mT5, LongT5-style ``T5Attention``).

Forward (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", sec. 2.1; Hugging Face ``T5Attention.compute_bias``): the first
self-attention layer of each stack looks up one scalar per head for every (query, key) pair
from a table ``W: (K, H)`` (``K`` buckets, ``H`` heads)::

    bucket[q, k] = bucket(k - q)                   (Tq, Tk) int64, the same for every example
    P[h, q, k]   = W[bucket[q, k], h]              (1, H, Tq, Tk)
    scores_i    += P                                every layer of the stack, every example

``P`` has no example dimension, so a hook on the table's output sees the gradient summed over
the batch. The rule hands the attention a per-example copy instead: before the forward it
computes ``P`` with the model's own ``compute_bias`` and passes ``P_B = P.expand(B, H, Tq, Tk)``
(a stride-0 view, same values) as ``position_bias``; the stack hands ``P_B`` on to its later
layers, which add it to their scores as before. Example ``i``'s loss then depends on the table
only through ``P_B[i]``, so with ``G = dL/dP_B: (B, H, Tq, Tk)`` (every use, in every layer)::

    dL_i/dW = sum_{q,k} e_{bucket[q,k]} G_i[:, q, k]^T            (K, H)

which is the embedding rule (``embedding.py``) with the bucket ids shared by all examples:
``Outer(left=bucket (B, Tq*Tk), right=G (B, Tq*Tk, H))``, exact, its squared norm summing
repeated buckets of one example first. Matched by class name (dpft does not import
transformers) on attention modules with a ``relative_attention_bias`` ``nn.Embedding`` of the
stock forward and a ``compute_bias`` method; a call handed a bias already, cross-attention or a
decoding step with a cache (not a training pass) is left alone (its table is then not used).
"""

from __future__ import annotations

from torch import nn

from dpft.grads.contrib import Outer
from dpft.grads.kinds import LayerKind
from dpft.grads.registry import register_layer

#: Attention classes with T5's bucketed relative bias (``T5Attention`` and its copies).
T5_ATTENTION_CLASSES = ("T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention",
                        "SwitchTransformersAttention", "Pop2PianoAttention")


def _stock_embedding(m) -> bool:
    return (isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward
            and m.max_norm is None and not m.scale_grad_by_freq and m.padding_idx is None)


@register_layer(nn.Module, builtin=True)
class T5RelativeBiasKind(LayerKind):
    """The relative-attention bias table of a T5-style attention, claimed from its child."""

    name = "T5 relative bias"
    has_pre_forward = True
    _ROLE = "relative_attention_bias.weight"

    def matches(self, module: nn.Module) -> bool:
        return (type(module).__name__ in T5_ATTENTION_CLASSES
                and bool(getattr(module, "has_relative_attention_bias", False))
                and _stock_embedding(getattr(module, "relative_attention_bias", None))
                and callable(getattr(module, "compute_bias", None)))

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return (self._ROLE,)

    def claims(self, module: nn.Module) -> tuple[str, ...]:
        return (self._ROLE,)

    def pre_forward(self, module, args, kwargs, batch):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None or hidden.dim() != 3 or hidden.shape[0] != batch:
            return None
        if kwargs.get("position_bias") is not None or (len(args) > 3 and args[3] is not None):
            return None  # a later layer: it is handed the first layer's (per-example) bias
        if kwargs.get("key_value_states") is not None or (len(args) > 2 and args[2] is not None):
            return None  # cross-attention has no relative bias
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and int(cache.get_seq_length(getattr(module, "layer_idx", 0) or 0)) > 0:
            return None  # a decoding step (the bias depends on the cache): not a training pass
        seen = []
        handle = module.relative_attention_bias.register_forward_hook(
            lambda _m, a, _o: seen.append(a[0].detach()))
        try:
            t = hidden.shape[1]
            bias = module.compute_bias(t, t, device=hidden.device)  # the model's own (1, H, T, T)
        finally:
            handle.remove()
        heads = module.relative_attention_bias.weight.shape[1]
        if len(seen) != 1 or seen[0].shape != (t, t) or tuple(bias.shape) != (1, heads, t, t):
            return None  # not the layout this rule was derived for: the engine's checks refuse it
        per_example = bias.expand(batch, heads, t, t)
        kwargs = dict(kwargs, position_bias=per_example)
        if len(args) > 3:
            args = (*args[:3], per_example, *args[4:])
            kwargs.pop("position_bias")
        return args, kwargs, seen[0], [per_example]

    def save(self, module, args, kwargs, output, batch):  # pragma: no cover - pre_forward records
        raise AssertionError("recorded by pre_forward")

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None or self._ROLE not in roles:
            return {}
        b, heads = g.shape[0], g.shape[1]
        ids = state.reshape(1, -1).expand(b, -1)  # (B, Tq*Tk) bucket of every (q, k)
        right = g.permute(0, 2, 3, 1).reshape(b, -1, heads)  # (B, Tq*Tk, H)
        return {self._ROLE: Outer(ids, right, module.relative_attention_bias.weight.shape)}
