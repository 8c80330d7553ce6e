"""Book-keeping for peft LoRA (Hu et al. 2022) adapters.

**Linear / Conv1D targets** (``lora.Linear`` wrapping ``nn.Linear`` or GPT-2 ``Conv1D``): peft
computes ``y = base(x) + lora_B(lora_A(dropout(x))) * s`` where ``lora_A: r x d_in`` and
``lora_B: d_out x r`` are ordinary ``nn.Linear`` submodules. They are handled by
``linear.py`` with no extra rule, and both peft details come out right by construction:

* dropout: ``lora_A``'s forward hook stores its *actual* input ``dropout(x)``, the activations
  the weight gradient is built from (``dL_i/dA = G_A,i^T dropout(x)_i``);
* scaling ``s = lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA): it multiplies ``lora_B``'s output
  after the module, so the output gradient ``G_B`` seen by ``lora_B``'s hook already carries
  ``s`` (``dL_i/dB = s * G_i^T h_i`` with ``h = lora_A(dropout(x))``).

The frozen ``base_layer`` has no trainable parameter and is not hooked.

**Embedding targets** (``lora.Embedding``): the adapter weights live in ``ParameterDict``s
(``lora_embedding_A[a]: (r, V)``, ``lora_embedding_B[a]: (d, r)``) and are used functionally::

    h = E_A[x]             with E_A = lora_embedding_A.T  (V, r),   h: (B, T, r)
    y = base(x) + s * h @ lora_embedding_B.T                          y: (B, T, d)

With ``G = dL/dy: (B, T, d)`` captured on the peft module's output::

    dL_i/d lora_embedding_B = s * G_i^T h_i                            (d, r)  Outer(sG, h)
    dL_i/d lora_embedding_A = sum_t (s G_i,t B) e_{x_i,t}^T            (r, V)  Outer(sGB, x)

the second with an index (one-hot) right side, so repeated tokens are counted exactly and no
``(B, r, V)`` tensor is built. Rows at the base layer's ``padding_idx`` get no gradient. Merged,
disabled, DoRA/variant adapters and embedding scales fall back to the exact torch.func path
(or are refused by the engine's usage check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpft.grads.contrib import BatchLayoutError, Outer

from dpft.grads.kinds import LayerKind, LayoutError, batch_first, first_input
from dpft.grads.registry import register_layer


def _active(module: nn.Module) -> list[str]:
    act = getattr(module, "active_adapters", None)
    if act is None:
        act = getattr(module, "active_adapter", [])
    if isinstance(act, str):
        act = [act]
    return [a for a in act if a in module.lora_embedding_A]


# Matched by class name and module (dpft does not import peft): a catch-all rule.
@register_layer(nn.Module, builtin=True)
class LoraEmbeddingKind(LayerKind):
    """peft ``lora.Embedding`` (vanilla LoRA, any number of active adapters)."""

    name = "lora_embedding"

    def matches(self, module: nn.Module) -> bool:
        if not (
            type(module).__name__ == "Embedding"
            and type(module).__module__.startswith("peft.")
            and isinstance(getattr(module, "lora_embedding_A", None), nn.ParameterDict)
            and isinstance(getattr(module, "lora_embedding_B", None), nn.ParameterDict)
        ):
            return False
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Embedding) or type(base).forward is not nn.Embedding.forward:
            return False
        if base.max_norm is not None or base.scale_grad_by_freq:
            return False
        if getattr(module, "lora_variant", {}) or getattr(module, "input_fns", {}) or getattr(
            module, "output_fns", {}
        ):
            return False
        get_scale = getattr(module, "_get_embed_scale", None)
        if get_scale is not None and get_scale() is not None:
            return False
        return True

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        names = list(module.lora_embedding_A.keys())
        return tuple(f"lora_embedding_A.{a}" for a in names) + tuple(
            f"lora_embedding_B.{a}" for a in names
        )

    def save(self, module, args, kwargs, output, batch):
        ids = first_input(args, kwargs)
        if module.merged or module.disable_adapters or "adapter_names" in kwargs:
            return None, None, []
        new_out = None
        if ids.dim() >= 1 and ids.shape[0] == 1 and batch > 1:
            ids = ids.expand(batch, *ids.shape[1:])
            new_out = output.expand(batch, *output.shape[1:])
        try:
            return batch_first(ids, batch, "LoRA Embedding ids"), new_out, [ids]
        except BatchLayoutError as e:
            return LayoutError(str(e)), None, []

    def contributions(self, module, state, grads, roles):
        g = grads[0]
        if g is None or state is None:
            return {}
        ids = state.reshape(state.shape[0], -1)
        g = g.reshape(g.shape[0], -1, g.shape[-1])
        pad = module.base_layer.padding_idx
        out = {}
        for a in _active(module):
            wa = module.lora_embedding_A[a].detach()  # (r, V)
            wb = module.lora_embedding_B[a].detach()  # (d, r)
            s = module.scaling[a]
            sg = g * s
            ra, rb = f"lora_embedding_A.{a}", f"lora_embedding_B.{a}"
            if rb in roles:
                h = F.embedding(ids, wa.t())  # (B, T, r): the forward value, padding included
                out[rb] = Outer(sg, h.to(sg.dtype), wb.shape)
            if ra in roles:
                dh = torch.matmul(sg, wb.to(sg.dtype))  # (B, T, r)
                if pad is not None:
                    dh = dh * (ids != pad)[:, :, None].to(dh.dtype)
                out[ra] = Outer(dh, ids, wa.shape)
        return out


# --------------------------------------------------------------------------- PEFT guard

#: peft tuner layer classes whose computation the rules (and the usage check) were verified
#: against, by module and class name: vanilla LoRA on Linear / GPT-2 Conv1D / Embedding (the
#: adapters are ordinary ``nn.Linear`` submodules or the ``LoraEmbeddingKind`` above), and the
#: LoRA variants listed in :data:`KNOWN_LORA_VARIANTS`. Tested with the peft range named in
#: ``pyproject.toml`` (tests/test_coverage_families.py).
KNOWN_ADAPTER_LAYERS = {("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.layer", "Embedding"),
                        # QLoRA (issue 27 item 5): vanilla LoRA over a frozen bitsandbytes 8-bit / 4-bit
                        # Linear; peft computes ``base(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * s``,
                        # the adapters are ordinary nn.Linear (linear.py) fed the cast input.
                        ("peft.tuners.lora.bnb", "Linear8bitLt"), ("peft.tuners.lora.bnb", "Linear4bit")}
#: Adapter layers over a quantized base, and the base classes each may wrap (``(module, name)``
#: anywhere in the base's MRO). No LoRA variant is verified over a quantized base (DoRA's magnitude
#: needs the dequantized weight's norm): refused.
QUANTIZED_ADAPTER_BASES = {
    ("peft.tuners.lora.bnb", "Linear8bitLt"): {("bitsandbytes.nn.modules", "Linear8bitLt")},
    ("peft.tuners.lora.bnb", "Linear4bit"): {("bitsandbytes.nn.modules", "Linear4bit")},
}
#: ``lora_variant`` classes (peft >= 0.15) checked exact: DoRA on Linear (its magnitude vector
#: takes the exact torch.func fallback; ``lora_A``/``lora_B`` the Linear rule).
KNOWN_LORA_VARIANTS = {"DoraLinearVariant"}


class UnknownAdapterError(NotImplementedError):
    """A peft adapter layer type the book-keeping rules were not verified against."""


def check_adapter_layers(model: nn.Module, trainable: set[int]) -> None:
    """Refuse peft tuner layers whose class (or LoRA variant) is not known to be handled exactly.

    A new peft layer type or LoRA variant may use its adapter weights in a way no rule accounts
    for (Opacus issue 820: a silent change of peft's LoRA layers). Only layers that hold a
    trainable parameter are checked; dpft does not import peft (classes are matched by module
    and name).

    Raises:
        UnknownAdapterError: naming the module, its class and the way out.
    """
    for name, m in model.named_modules():
        cls = type(m)
        threshold = float(getattr(getattr(m, "state", None), "threshold", 0.0) or 0.0)
        if ("bitsandbytes.nn.modules", "Linear8bitLt") in _mro_names(m) and threshold > 0 and trainable:
            # LLM.int8's mixed-precision decomposition picks its outlier columns over every row of
            # the micro-batch (bitsandbytes int8_vectorwise_quant: (|A| >= threshold).any(dim=0)):
            # one example's activations change how another example's output is computed, so the
            # per-example contributions are not functions of their own example alone.
            raise UnknownAdapterError(
                f"book-keeping engine: {name or '<root>'} is a bitsandbytes 8-bit Linear with "
                f"llm_int8_threshold = {threshold:g}: LLM.int8 chooses its outlier columns over every row of the "
                "batch, so one example's activations change another example's output and per-example clipping "
                "no longer bounds each example's influence. Load the base with "
                "BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0), or in 4-bit (load_in_4bit=True)")
        if cls.__module__.startswith("bitsandbytes.") and any(id(p) in trainable for p in m.parameters(recurse=False)):
            raise UnknownAdapterError(
                f"book-keeping engine: {name or '<root>'} is a bitsandbytes quantized layer ({cls.__module__}."
                f"{cls.__name__}) with a trainable parameter; a quantized base is frozen in QLoRA and no per-example "
                "rule covers training it. Train LoRA adapters on it (peft get_peft_model, e.g. after "
                "prepare_model_for_kbit_training) and leave its weight and bias frozen")
        if not cls.__module__.startswith("peft.tuners.") or not hasattr(m, "adapter_layer_names"):
            continue
        if not any(id(p) in trainable for p in m.parameters()):
            continue
        what = None
        key = (cls.__module__, cls.__name__)
        variants = getattr(m, "lora_variant", {}) or {}
        if key not in KNOWN_ADAPTER_LAYERS:
            what = f"adapter layer {cls.__module__}.{cls.__name__}"
        elif key in QUANTIZED_ADAPTER_BASES and variants:
            what = (f"LoRA variant {sorted({type(v).__name__ for v in variants.values()})} over a quantized base in "
                    f"{cls.__module__}.{cls.__name__} (only vanilla LoRA is verified there)")
        else:
            unknown = sorted({type(v).__name__ for v in variants.values()} - KNOWN_LORA_VARIANTS)
            if unknown:
                what = f"LoRA variant {unknown} in {cls.__module__}.{cls.__name__}"
        if what is None:
            what = _unknown_base(m, key)
        if what is not None:
            raise UnknownAdapterError(
                f"book-keeping engine: {name or '<root>'} is a peft {what}, which dpft's per-example "
                "rules were not verified against (known: LoRA and DoRA on Linear/Conv1D, LoRA on "
                "Embedding, LoRA on bitsandbytes 8-bit/4-bit Linear). Use those adapter types (e.g. target_modules= attention/MLP Linear "
                "layers), or register a rule for it with dpft.grads.registry.register_layer and "
                "check it against ReferenceEngine"
            )


def _mro_names(obj) -> set[tuple[str, str]]:
    return {(c.__module__, c.__name__) for c in type(obj).__mro__}


def _unknown_base(m: nn.Module, key: tuple[str, str]):
    """What is unknown about a known peft adapter layer's *base* layer, or None.

    A QLoRA layer (``peft.tuners.lora.bnb``) must wrap the bitsandbytes class it was written for.
    A plain ``lora.Linear`` may wrap any frozen base (``FalconLinear``, ``Conv1D``, …): peft adds
    ``lora_B(lora_A(dropout(x))) * s`` to whatever the base returns, so the base's computation
    never enters the adapters' per-example gradients (a trainable base parameter is its own
    unit, with its own rule, the exact fallback, or the bitsandbytes refusal above). peft's
    adapters over other quantized bases (GPTQ, AWQ, HQQ, torchao, …) are classes of their own,
    refused as unknown adapter layers."""
    if key not in QUANTIZED_ADAPTER_BASES:
        return None
    get = getattr(m, "get_base_layer", None)
    base = get() if callable(get) else getattr(m, "base_layer", None)
    if base is not None and _mro_names(base) & QUANTIZED_ADAPTER_BASES[key]:
        return None
    bcls = type(base)
    return f"base layer {bcls.__module__}.{bcls.__name__} under {key[0]}.{key[1]}"
