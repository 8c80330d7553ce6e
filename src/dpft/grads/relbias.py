"""Book-keeping rules for relative-position tables shared by every example of a batch (issue 36
item 10): T5's relative-attention bias (T5, mT5) and DeBERTa-v2's
relative attention (second half of this file). In both, the model computes a table once for the
batch and broadcasts it; while capturing, the rule hands the model a per-example copy (a stride-0
``expand``, same values) so that each example's gradient of the table arrives on its own.

T5.

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

import torch
import torch.nn.functional as F
from torch import nn

from dpft.grads.contrib import Outer, PerExample
from dpft.grads.kinds import LayerKind
from dpft.grads.registry import register_layer

#: Attention classes with T5's bucketed relative bias whose ``compute_bias(q_len, k_len, device=)``
#: this rule follows (T5, and mT5's copy of it). Other copies (UMT5: a bias in every layer; LongT5's
#: local attention: per-block bias) are not matched: the engine's layout check refuses them by name.
T5_ATTENTION_CLASSES = ("T5Attention", "MT5Attention")


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


# ------------------------------------------------------------------------------------- DeBERTa-v2
#
# DeBERTa-v2/v3 with relative attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with
# Disentangled Attention", eq. 4; Hugging Face ``DisentangledSelfAttention``): the encoder computes
# one table ``R = LayerNorm(W)`` (``W = encoder.rel_embeddings.weight: (2k, d)``) and every layer
# projects its first ``2s`` rows with the query/key projections (``share_att_key``) or its own
# ``pos_query_proj``/``pos_key_proj``, then *repeats* the projected table over the batch:
#
#     Pq = proj_q(R[:2s])  (1, 2s, d)  ->  (H, 2s, d_h)  ->  .repeat(B, 1, 1)  (B·H, 2s, d_h)
#
# and uses block ``b`` of the repeat in example ``b``'s scores (c2p, p2c). Every parameter on that
# path (W, the LayerNorm, the projections and their LoRA/DoRA factors) thus sees a tensor without
# the example dimension. While capturing, two rules hand those uses a per-example copy instead:
#
# * ``DebertaV2TableKind`` (on the encoder; claims ``rel_embeddings.weight`` and ``LayerNorm.*``):
#   before the encoder's forward it computes ``R`` with the model's own ``get_rel_embedding`` and
#   makes the encoder pass ``R_B = R.expand(B, 2k, d)`` to its layers; with ``G = dL/dR_B`` (the
#   sum over layers, example by example) the per-example gradients are the LayerNorm's
#   vector-Jacobian product at ``G_i`` (``torch.func.vjp``, vmapped over i), exact;
# * ``DebertaV2RelativeAttentionKind`` (on each ``DisentangledSelfAttention``, a layout rule: it
#   accounts for no parameter) replaces, for the duration of the forward, the attention's
#   ``disentangled_attention_bias`` by :func:`_per_example_bias`: the same computation with the
#   table projected per example, ``proj(R_B[:, :2s])  (B, 2s, d)  ->  (B·H, 2s, d_h)``, which is
#   the repeat's layout, so the projections (and LoRA, DoRA) see batch-first inputs and their own
#   rules (linear.py, lora.py) give exact per-example factors.
#
# The rows of ``R_B`` are the same values as ``R``; in eval mode every output is unchanged. In
# training mode ``pos_dropout`` draws one mask per example instead of one for the batch.

#: DeBERTa-v2 encoders and attentions (DeBERTa-v3 checkpoints use these classes).
DEBERTA_V2_ENCODERS = ("DebertaV2Encoder",)
DEBERTA_V2_ATTENTIONS = ("DisentangledSelfAttention",)


def _deberta_v2_module(module):
    """The transformers module that defines ``module``'s class (its helper functions)."""
    import sys

    mod = sys.modules.get(type(module).__module__)
    if mod is None or not all(hasattr(mod, f) for f in ("build_relative_position", "build_rpos",
                                                       "scaled_size_sqrt")):
        return None
    return mod


def _per_example_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
    """Hugging Face ``DisentangledSelfAttention.disentangled_attention_bias`` (as of transformers 5.24;
    a drift is caught by tests/test_coverage_families.py against the torch.func reference)
    with the relative table projected per example: ``rel_embeddings`` is ``(2k, d)`` (shared: a
    stride-0 copy per example is taken here) or ``(B, 2k, d)`` (``DebertaV2TableKind``'s copy)."""
    mod = _deberta_v2_module(self)
    heads = self.num_attention_heads
    batch = query_layer.size(0) // heads
    if relative_pos is None:
        relative_pos = mod.build_relative_position(query_layer, key_layer, bucket_size=self.position_buckets,
                                                   max_position=self.max_relative_positions)
    if relative_pos.dim() == 2:
        relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos.unsqueeze(1)
    elif relative_pos.dim() != 4:
        raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
    att_span = self.pos_ebd_size
    relative_pos = relative_pos.to(device=query_layer.device, dtype=torch.long)
    rel = rel_embeddings[..., 0:att_span * 2, :]
    if rel.dim() == 2:
        rel = rel.unsqueeze(0).expand(batch, *rel.shape)
    # (B, 2s, d) -> (B·H, 2s, d_h): block b·H + h is example b's head h, as in the repeat
    if self.share_att_key:
        pos_query_layer = self.transpose_for_scores(self.query_proj(rel), heads)
        pos_key_layer = self.transpose_for_scores(self.key_proj(rel), heads)
    else:
        if "c2p" in self.pos_att_type:
            pos_key_layer = self.transpose_for_scores(self.pos_key_proj(rel), heads)
        if "p2c" in self.pos_att_type:
            pos_query_layer = self.transpose_for_scores(self.pos_query_proj(rel), heads)
    score = 0
    if "c2p" in self.pos_att_type:
        scale = mod.scaled_size_sqrt(pos_key_layer, scale_factor)
        c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
        c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
        c2p_att = torch.gather(c2p_att, dim=-1, index=c2p_pos.squeeze(0).expand(
            [query_layer.size(0), query_layer.size(1), relative_pos.size(-1)]))
        score += c2p_att / scale.to(dtype=c2p_att.dtype)
    if "p2c" in self.pos_att_type:
        scale = mod.scaled_size_sqrt(pos_query_layer, scale_factor)
        # the argument order of the model's own call (its max/bucket names are swapped there)
        r_pos = mod.build_rpos(query_layer, key_layer, relative_pos, self.max_relative_positions,
                               self.position_buckets)
        p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
        p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
        p2c_att = torch.gather(p2c_att, dim=-1, index=p2c_pos.squeeze(0).expand(
            [query_layer.size(0), key_layer.size(-2), key_layer.size(-2)])).transpose(-1, -2)
        score += p2c_att / scale.to(dtype=p2c_att.dtype)
    return score


@register_layer(nn.Module, builtin=True)
class DebertaV2RelativeAttentionKind(LayerKind):
    """Layout rule: a DeBERTa-v2 attention computes its relative bias with a per-example table."""

    name = "DeBERTa-v2 relative attention (layout)"
    has_pre_forward = True
    layout_only = True

    def matches(self, module: nn.Module) -> bool:
        return (type(module).__name__ in DEBERTA_V2_ATTENTIONS and bool(getattr(module, "relative_attention", False))
                and callable(getattr(type(module), "disentangled_attention_bias", None))
                and _deberta_v2_module(module) is not None)

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return ()

    def needed(self, module, trainable, claimed):
        # a trainable parameter below it (its projections, LoRA/DoRA factors) or a trained table
        return claimed or any(id(p) in trainable for p in module.parameters())

    def pre_forward(self, module, args, kwargs, batch):
        module.disentangled_attention_bias = _per_example_bias.__get__(module)  # this forward only
        return None

    def post_forward(self, module):
        module.__dict__.pop("disentangled_attention_bias", None)

    def save(self, module, args, kwargs, output, batch):  # pragma: no cover - never recorded
        raise AssertionError("a layout rule records nothing")

    def contributions(self, module, state, grads, roles):  # pragma: no cover - never recorded
        return {}


@register_layer(nn.Module, builtin=True)
class DebertaV2TableKind(LayerKind):
    """The relative-position table of a DeBERTa-v2 encoder (``rel_embeddings.weight``, and the
    ``LayerNorm`` applied to it), claimed from its children."""

    name = "DeBERTa-v2 relative table"
    has_pre_forward = True

    def matches(self, module: nn.Module) -> bool:
        emb = getattr(module, "rel_embeddings", None)
        ln = getattr(module, "LayerNorm", None)
        return (type(module).__name__ in DEBERTA_V2_ENCODERS and bool(getattr(module, "relative_attention", False))
                and isinstance(emb, nn.Embedding)
                and (not self._normed(module) or (type(ln) is nn.LayerNorm and ln.elementwise_affine))
                and callable(getattr(type(module), "get_rel_embedding", None)))

    @staticmethod
    def _normed(module) -> bool:
        return "layer_norm" in (getattr(module, "norm_rel_ebd", None) or [])

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        ln = ("LayerNorm.weight",) + (("LayerNorm.bias",) if module.LayerNorm.bias is not None else ()) \
            if self._normed(module) else ()
        return ("rel_embeddings.weight",) + ln

    def claims(self, module: nn.Module) -> tuple[str, ...]:
        return self.roles(module)

    def pre_forward(self, module, args, kwargs, batch):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] != batch:
            return None
        table = type(module).get_rel_embedding(module)  # the model's own R = LayerNorm(W): (2k, d)
        per_example = table.expand(batch, *table.shape)
        module.get_rel_embedding = lambda: per_example  # the layers get R_B (this forward only)
        return args, kwargs, None, [per_example]

    def post_forward(self, module):
        module.__dict__.pop("get_rel_embedding", None)

    def save(self, module, args, kwargs, output, batch):  # pragma: no cover - pre_forward records
        raise AssertionError("recorded by pre_forward")

    def contributions(self, module, state, grads, roles):
        from torch.func import vjp, vmap

        g = grads[0]
        if g is None:
            return {}
        w = module.rel_embeddings.weight.detach()
        if not self._normed(module):
            return {r: PerExample(g) for r in roles if r == "rel_embeddings.weight"}
        ln = module.LayerNorm
        gamma = ln.weight.detach()
        beta = ln.bias.detach() if ln.bias is not None else torch.zeros_like(gamma)

        def f(w_, g_, b_):
            return F.layer_norm(w_.float(), ln.normalized_shape, g_.float(), b_.float(), ln.eps)

        _, back = vjp(f, w, gamma, beta)
        gw, gg, gb = vmap(back)(g.float())  # per example: (B, 2k, d), (B, d), (B, d)
        out = {"rel_embeddings.weight": PerExample(gw), "LayerNorm.weight": PerExample(gg),
               "LayerNorm.bias": PerExample(gb)}
        return {r: out[r] for r in roles if r in out}
