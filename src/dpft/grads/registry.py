"""The open registry of book-keeping layer rules: ``@register_layer(nn.Module subclass)``.

A *rule* is a :class:`~dpft.grads._hooks.LayerKind`: ``save`` keeps what a module's backward
needs (its input), ``contributions`` turns the module's output gradient into per-example
gradient contributions of its parameters (``PerExample`` or factored ``Outer``). The
book-keeping engine looks a rule up for every module that owns a trainable parameter; a module
with no rule falls back to exact per-example gradients by ``torch.func`` (slower, one warning
naming its class). Users give their own module classes a fast rule without forking dpft::

    from dpft.grads.contrib import Outer

    from dpft.grads.kinds import LayerKind, save_input
    from dpft.grads.registry import register_layer      # also dpft.register_layer

    @register_layer(ScaledLinear)                        # y = s * (x @ W.T), W: (d_out, d_in)
    class ScaledLinearKind(LayerKind):
        def roles(self, module):                         # parameters the rule accounts for
            return ("weight",)
        def save(self, module, args, kwargs, output, batch):
            return save_input(args, kwargs, batch, "ScaledLinear input")   # x: (B, ..., d_in)
        def contributions(self, module, x, grads, roles):
            g = grads[0]                                 # dL/dy: (B, ..., d_out)
            g, x = g.reshape(g.shape[0], -1, g.shape[-1]), x.reshape(x.shape[0], -1, x.shape[-1])
            return {"weight": Outer(module.s * g, x, module.weight.shape)}  # g_i = s G_iᵀ X_i

The built-in rules (``linear.py``, ``embedding.py``, ``layernorm.py``, ``rmsnorm.py``,
``conv1d.py``, ``lora.py``) register themselves the same way; ``dpft/grads/__init__.py``
imports them, so they are registered whenever this module is (the registry imports none of
them back: no import circle).

Lookup for a module ``m`` (:func:`rules_for`): candidate rules are those registered for a class
in ``type(m).__mro__`` whose ``matches(m)`` is true, ordered

1. most specific class first (position in the MRO; a rule for ``nn.Module`` is a catch-all
   tried last, which is where the built-in rules that match by class *name* -- RMSNorm of any
   model family, GPT-2's Conv1D, peft's LoRA embedding -- live, so that dpft imports neither
   transformers nor peft);
2. for the same class, user registrations before built-in ones;
3. then the most recent registration first (registering again for a class overrides).

The first candidate whose ``roles(m)`` cover all the module's trainable parameters is used.
A rule's default ``matches`` accepts instances of the classes it was registered for; override it
to refuse variants (e.g. a subclass with its own ``forward``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dpft.grads.kinds import LayerKind


@dataclass(frozen=True)
class _Entry:
    module_cls: type
    kind: LayerKind
    builtin: bool
    order: int


_REGISTRY: list[_Entry] = []
_counter = 0


def _check_module_classes(module_classes: tuple) -> None:
    if not module_classes:
        raise TypeError("register_layer needs at least one nn.Module subclass, e.g. @register_layer(MyModule)")
    for c in module_classes:
        if not (inspect.isclass(c) and issubclass(c, nn.Module)):
            raise TypeError(f"register_layer: {c!r} is not an nn.Module subclass")


def _as_kind(obj: Any) -> LayerKind:
    if inspect.isclass(obj) and issubclass(obj, LayerKind):
        return obj()
    if isinstance(obj, LayerKind):
        return obj
    raise TypeError(
        f"register_layer must decorate a LayerKind subclass or instance (dpft.grads._hooks.LayerKind), got {obj!r}"
    )


def _register(module_classes: tuple, obj: Any, builtin: bool) -> Any:
    global _counter
    _check_module_classes(module_classes)
    kind = _as_kind(obj)
    kind.registered_for = tuple(getattr(kind, "registered_for", ())) + tuple(module_classes)
    for c in module_classes:
        _counter += 1
        _REGISTRY.append(_Entry(c, kind, builtin, _counter))
    return obj


def register_layer(*module_classes: type, builtin: bool = False):
    """Decorator: make a :class:`~dpft.grads._hooks.LayerKind` the book-keeping rule for
    instances of ``module_classes`` (and their subclasses, unless a more specific rule exists
    or ``matches`` refuses them).

    Use on a ``LayerKind`` subclass (instantiated once, with no arguments) or on an instance;
    the decorated object is returned unchanged. ``builtin=True`` is for dpft's own rules (user
    rules win over them for the same class). Registrations are process-wide; see
    :func:`unregister_layer`.

    Raises:
        TypeError: a class that is not an ``nn.Module`` subclass, or a decorated object that is
            not a ``LayerKind``.
    """
    _check_module_classes(module_classes)

    def deco(obj):
        return _register(module_classes, obj, builtin)

    return deco


def unregister_layer(module_cls: type, kind: Any = None) -> int:
    """Remove the user registrations for ``module_cls`` (only those of ``kind``, a LayerKind
    subclass or instance, if given). Built-in rules are never removed. Returns how many."""
    global _REGISTRY

    def hit(e: _Entry) -> bool:
        if e.builtin or e.module_cls is not module_cls:
            return False
        if kind is None:
            return True
        return e.kind is kind or (inspect.isclass(kind) and isinstance(e.kind, kind))

    n = sum(hit(e) for e in _REGISTRY)
    _REGISTRY = [e for e in _REGISTRY if not hit(e)]
    return n


def rules_for(module: nn.Module) -> list[LayerKind]:
    """Rules that match ``module``, best first (see the module docstring for the order)."""
    mro = type(module).__mro__
    rank = {c: i for i, c in enumerate(mro)}
    cands = [e for e in _REGISTRY if e.module_cls in rank]
    cands.sort(key=lambda e: (rank[e.module_cls], e.builtin, -e.order))
    out: list[LayerKind] = []
    for e in cands:
        if e.kind in out:
            continue
        if e.kind.matches(module):
            out.append(e.kind)
    return out


def rule_for(module: nn.Module, roles) -> LayerKind | None:
    """The best rule for ``module`` whose roles cover ``roles`` (parameter attribute paths)."""
    need = set(roles)
    for k in rules_for(module):
        if need <= set(k.roles(module)):
            return k
    return None


def registered_kinds() -> tuple[LayerKind, ...]:
    """Every registered rule once, user rules first, then built-ins, newest first: a snapshot
    (the backward-compatible ``dpft.grads.bookkeeping.KINDS``)."""
    out: list[LayerKind] = []
    for e in sorted(_REGISTRY, key=lambda e: (e.builtin, -e.order)):
        if e.kind not in out:
            out.append(e.kind)
    return tuple(out)


class _KindsView(Sequence):
    """A live, read-only sequence of the registered rules (:func:`registered_kinds` order)."""

    def __getitem__(self, i):
        return registered_kinds()[i]

    def __len__(self) -> int:
        return len(registered_kinds())

    def __repr__(self) -> str:
        return f"KINDS({[k.name for k in registered_kinds()]})"


#: Backward-compatible ``KINDS``: a live view of the registry (it was a closed tuple).
KINDS: Sequence[LayerKind] = _KindsView()

__all__ = ["KINDS", "register_layer", "unregister_layer", "rules_for", "rule_for", "registered_kinds"]
