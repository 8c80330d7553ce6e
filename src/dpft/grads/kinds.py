"""Layer rules' protocol (:class:`LayerKind`) and the batch-layout helpers rules use to find each
example's rows in a module's inputs and outputs (batch-first, flattened ``(B·n, …)``, refused
layouts), with the first micro-batch's check that each recorded output's rows belong to its
example (:func:`check_example_support`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from dpft.grads.contrib import BatchLayoutError, Contribution

# --------------------------------------------------------------------------- layer kinds


class LayerKind:
    """A module kind the engine knows. Subclasses live in one file per kind and register
    themselves with ``@register_layer(nn.Module subclass)`` (``grads/registry.py``), as user
    rules for custom modules do.

    ``save`` runs in the forward hook and keeps what the backward needs (detached);
    ``contributions`` runs when the output gradients arrive and returns one
    :class:`Contribution` per parameter role (attribute path inside the module).
    """

    name = "layer"
    #: Module classes this rule was registered for (set by ``grads.registry.register_layer``).
    registered_for: tuple = ()

    def matches(self, module: nn.Module) -> bool:
        """Whether this rule applies to ``module``. Default: it is an instance of a class the
        rule was registered for (``@register_layer(cls)``); override to refuse variants."""
        if self.registered_for:
            return isinstance(module, self.registered_for)
        raise NotImplementedError(f"{type(self).__name__}.matches is not defined and the rule is not registered")

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        """Parameter attribute paths this kind can account for."""
        raise NotImplementedError

    def save(self, module: nn.Module, args: tuple, kwargs: dict, output: Any,
             batch: int) -> tuple[Any, Any, list[torch.Tensor]]:
        """Return ``(state, replacement_output_or_None, tensors_whose_version_to_check)``."""
        raise NotImplementedError

    def contributions(self, module: nn.Module, state: Any, grads: list[Optional[torch.Tensor]],
                      roles: tuple[str, ...]) -> dict[str, Contribution]:
        raise NotImplementedError

    #: The rule hands the module per-example inputs before its forward (:meth:`pre_forward`).
    has_pre_forward = False

    def claims(self, module: nn.Module) -> tuple[str, ...]:
        """Parameter paths of *child* modules that this rule accounts for on ``module`` (the
        owner of those parameters then gets no unit of its own; ``discover_units``). Default:
        none. Used where a parameter is applied to a batch-independent tensor inside the parent's
        forward (T5's relative-attention bias table), so that only the parent can hand it a
        per-example copy."""
        return ()

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict, batch: int
                    ) -> Optional[tuple[tuple, dict, Any, list[torch.Tensor]]]:
        """Only for rules with ``has_pre_forward``: run as a forward pre-hook while capturing.

        Returns None (the call is left alone and records nothing), or ``(args, kwargs, state,
        tensors)``: the forward runs on the new ``args``/``kwargs``; ``tensors`` are per-example
        tensors ``(B, ...)`` handed to it (made to require grad if they do not), whose total
        gradients (every use, inside the forward and after it) are passed, in order, as
        ``grads`` to :meth:`contributions` with ``state`` (``save`` is not called).
        """
        return None

    def post_forward(self, module: nn.Module) -> None:
        """Only for rules with ``has_pre_forward``: run after every forward of ``module`` whose
        pre-hook ran (and when the capture closes): undo what :meth:`pre_forward` changed on the
        module for the duration of its forward (an instance override of a method). Idempotent."""

    #: A rule that only changes how a module computes while capturing (per-example copies of a
    #: shared tensor, :meth:`pre_forward`) and accounts for no parameter of its own: the engine
    #: gives it a unit when :meth:`needed` says so (``discover_units``).
    layout_only = False

    def needed(self, module: nn.Module, trainable: set[int], claimed: bool) -> bool:
        """``layout_only`` rules: whether ``module`` must be hooked, given the ids of the trainable
        parameters and whether some rule claimed a parameter of a shared table."""
        return False


def first_input(args: tuple, kwargs: dict, name: str = "input") -> torch.Tensor:
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def check_batch(t: torch.Tensor, batch: int, label: str) -> None:
    if t.dim() == 0 or t.shape[0] != batch:
        raise BatchLayoutError(_layout_msg(t, batch, label))


def _layout_msg(t: torch.Tensor, batch: int, label: str) -> str:
    return (f"{label}: the book-keeping engine needs the example dimension first (or a token-major "
            f"flattening (B*n, ...) of it), but this module received a tensor of shape "
            f"{tuple(t.shape)} for a micro-batch of {batch} examples (a parameter used on a "
            "batch-independent tensor); freeze this module's parameters or train it with LoRA, or "
            "use ReferenceEngine (exact, one backward per example)")


@dataclass
class LayoutError:
    """State of a module call whose input is not batch-first. Harmless while no gradient reaches
    the call's outputs (peft DoRA's ``lora_B(lora_A(eye))``, detached); :class:`Capture` raises
    :class:`BatchLayoutError` with ``msg`` if one does."""

    msg: str


def batch_first(t: torch.Tensor, batch: int, label: str) -> torch.Tensor:
    """``t`` with the example dimension first: ``(B, ...)`` as is, or a flattened token-major
    ``(B*n, ...)`` (row ``r`` belongs to example ``r // n``: ``x.reshape(-1, d)`` of a
    ``(B, n, d)`` tensor, as OPT's decoder layers and mixture-of-experts blocks do) reshaped
    to ``(B, n, ...)``. The row-to-example map is checked on the first micro-batch
    (:func:`check_example_support`).

    Raises:
        BatchLayoutError: the leading dimension is neither ``B`` nor a multiple of it.
    """
    if t.dim() > 0 and t.shape[0] == batch:
        return t
    if t.dim() > 0 and batch > 0 and t.shape[0] > batch and t.shape[0] % batch == 0:
        return t.reshape(batch, t.shape[0] // batch, *t.shape[1:])
    raise BatchLayoutError(_layout_msg(t, batch, label))


def save_input(args: tuple, kwargs: dict, batch: int, label: str):
    """``LayerKind.save`` for kinds whose state is their detached first input ``x``:
    returns ``(x, None, [x])`` with ``x`` batch-first (:func:`batch_first`; a flattened
    ``(B*n, d)`` input becomes ``(B, n, d)``, and the output gradients the rule receives are
    reshaped the same way). An input that is not batch-first gives a :class:`LayoutError` state:
    an error if a gradient reaches that call."""
    x = first_input(args, kwargs).detach()
    try:
        return batch_first(x, batch, label), None, [x]
    except BatchLayoutError as e:
        return LayoutError(str(e)), None, []


#: While set (thread-local), Capture's gradient hooks ignore what they see (the engine's own
#: extra backward passes of :func:`check_example_support`).
_SUSPEND = threading.local()


def check_example_support(losses: torch.Tensor, outputs: list[tuple[torch.Tensor, str]],
                          groups: torch.Tensor | None = None) -> None:
    """Check that each recorded module output's rows belong to the example the engine assigns
    them to: row block ``i`` of ``out.reshape(B, -1)`` may influence ``losses[i]`` only.

    Two extra backward passes (first micro-batch only): ``G1 = d(sum_i l_i)/d out`` and
    ``Gw = d(sum_i w_i l_i)/d out`` with ``w_i = 2^(i mod 16)``. If block ``i`` of ``out``
    influences only ``l_i`` then ``Gw_i = w_i G1_i`` exactly; any influence on another example
    ``j`` adds ``(w_j - w_i) dl_j/d out_i``.

    Raises:
        BatchLayoutError: naming the module whose output mixes examples.
    """
    b = losses.shape[0]
    outs = [(t, lab) for t, lab in outputs if t.requires_grad and t.numel() % b == 0]
    if b < 2 or not outs or not losses.requires_grad:
        return
    # Powers of two: scaling a gradient by 2^k is exact in floating point, so Gw_i = w_i G1_i
    # holds bit for bit (fp32 or bf16/fp16 autocast alike) unless examples mix. (Examples i and
    # i + 16 get the same weight; a layout error mixes every example, neighbours included.)
    # With clipping groups (grads/groups.py) rows of one group may influence each other's losses
    # (a DPO pair: its loss is on one row and depends on both); they share a weight, so only
    # influence across groups is caught.
    ids = range(b) if groups is None else [int(g) for g in groups]
    w = torch.tensor([2.0 ** (i % 16) for i in ids], device=losses.device, dtype=losses.dtype)
    tens = [t for t, _ in outs]
    _SUSPEND.on = True
    try:
        g1 = torch.autograd.grad(losses.sum(), tens, retain_graph=True, allow_unused=True)
        gw = torch.autograd.grad((losses * w).sum(), tens, retain_graph=True, allow_unused=True)
    except RuntimeError as e:
        if "reentrant" not in str(e):
            raise
        # Reentrant activation checkpointing refuses autograd.grad: batch-first outputs are
        # taken as before; a flattened one cannot be verified, so it is refused.
        flat = [lab for t, lab in outs if t.shape[0] != b]
        if flat:
            raise BatchLayoutError(
                f"{flat[0]}: a flattened (B*n, ...) output cannot be checked under reentrant "
                "activation checkpointing; use gradient_checkpointing_kwargs="
                "{'use_reentrant': False}") from None
        return
    finally:
        _SUSPEND.on = False
    for (t, lab), a, c in zip(outs, g1, gw):
        if a is None or c is None:
            continue
        a = a.float().reshape(b, -1) * w.float()[:, None]
        c = c.float().reshape(b, -1)
        scale = float(torch.maximum(a.abs().max(), c.abs().max()))
        if scale > 0 and float((c - a).abs().max()) > 1e-5 * scale:
            raise BatchLayoutError(
                f"{lab}: its output of shape {tuple(t.shape)} is not laid out example by example "
                f"(rows the engine assigns to one of the {b} examples influence the loss of "
                "another): a parameter used on a batch-independent or example-mixing tensor. Freeze "
                "this module's parameters or train it with LoRA, or use ReferenceEngine (exact, one "
                "backward per example)")


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """``(B, ..., d) -> (B, T, d)`` with ``T`` the product of the middle dims (1 for 2-D)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])
