"""The capture: forward hooks on the trainable modules for one forward pass, tensor hooks on their
outputs in the backward, each layer's output gradient reduced at once to its contributions;
activation-checkpointing re-runs told apart from the original calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from dpft.grads.contrib import BatchLayoutError, Contribution, full_precision, in_backward
from dpft.grads.kinds import _SUSPEND, LayerKind, LayoutError

# --------------------------------------------------------------------------- capture


@dataclass(eq=False)
class Unit:
    """One module with trainable parameters and the kind that accounts for them."""

    module: nn.Module
    kind: LayerKind
    roles: dict[str, str]  # role (attribute path in module) -> engine parameter name
    label: str  # qualified module name
    clone_input: bool = False
    #: Outputs recorded on a checking pass, for :func:`check_example_support` (then cleared).
    check_outputs: list = field(default_factory=list)


@dataclass(eq=False)
class _Record:
    unit: Unit
    state: Any
    grads: list = field(default_factory=list)
    pending: int = 0
    done: bool = False
    #: Per output slot: ``n`` when that output is a flattened ``(B*n, ...)`` (its gradient is
    #: reshaped to ``(B, n, ...)`` before the rule sees it), else 0.
    flat: list = field(default_factory=list)
    #: Slots are a rule's per-example inputs (``pre_forward``): their gradients are summed over
    #: every delivery (reentrant checkpointing runs one backward per checkpointed block, each
    #: delivering its share to a tensor they all read) and reduced when the backward is over.
    accumulate: bool = False


class Capture:
    """Hooks the units' forward calls for one pass.

    ``mode="main"``: records activations, makes outputs differentiable leaves where needed,
    and collects contributions (``self.contribs``: parameter name -> list) as gradients
    arrive. ``mode="probe"``: only counts calls and watches in-place modifications.

    Activation checkpointing (``torch.utils.checkpoint``, Hugging Face
    ``gradient_checkpointing_enable``) re-runs forwards inside the backward, and the unit hooks
    fire again there. :meth:`backward` keeps them registered for that, and every call is
    counted exactly once:

    * **non-reentrant** checkpointing (``use_reentrant=False``, PyTorch's default) runs the
      original forward with grad enabled and builds the real graph; the call is recorded then.
      The recomputation only refills saved tensors; there the hook only *replays* what it did
      to the graph (marking an output a leaf) so the recomputed graph has the same saved
      tensors, and records nothing.
    * **reentrant** checkpointing runs the original forward under ``no_grad`` (no graph, so
      nothing can be recorded) and the recomputation inside the backward builds the graph the
      gradients flow through; the call is recorded there, once. A unit call under ``no_grad``
      is counted as pending, and only a pending call is recorded when it is re-run.

    A record whose outputs never receive a gradient contributes nothing, so even a
    misclassified re-run cannot add an activation twice.
    """

    def __init__(self, units: list[Unit], batch: int, mode: str = "main",
                 clone_all: bool = False, keep_fallback_inputs: bool = False,
                 check_outputs: Optional[bool] = None):
        self.units = units
        #: Keep every recorded output on its unit for :func:`check_example_support` (the
        #: checking pass: the probe, or the first micro-batch of a user-driven loop).
        self.check_outputs = (mode == "probe" or clone_all) if check_outputs is None else check_outputs
        self.batch = batch
        self.mode = mode
        #: Copy every saved input while still watching the originals for in-place changes (the
        #: first micro-batch of a user-driven loop, before the in-place check has run).
        self.clone_all = clone_all
        #: Main mode: also keep fallback modules' saved inputs in ``probe_inputs`` (usage check).
        self.keep_fallback_inputs = keep_fallback_inputs
        self.active = False
        #: ``forward`` inside ``with capture``; ``backward`` while re-run forwards are expected.
        self.phase = "forward"
        self.handles: list = []
        self.leaves: list[tuple[torch.Tensor, _Record, int]] = []
        self.records: list[_Record] = []
        self.contribs: dict[str, list[Contribution]] = {}
        self.versions: list[tuple[torch.Tensor, int, Unit]] = []
        self.calls: dict[int, int] = {}  # id(unit) -> number of calls
        self.probe_inputs: dict[int, list] = {}  # id(unit) -> saved states (probe mode)
        #: id(unit) -> calls made under no_grad in the forward, not yet re-run (reentrant
        #: checkpointing re-runs them in the backward, where they are recorded).
        self.pending: dict[int, int] = {}
        #: A forward was re-run inside the backward (activation checkpointing in use).
        self.recomputed = False
        #: id(unit) -> results of the rule's ``pre_forward`` for calls not yet finished (a stack:
        #: the post-hook of the same call takes the last one).
        self._pre: dict[int, list] = {}

    def _register(self) -> None:
        if not self.handles:
            for u in self.units:
                if u.kind.has_pre_forward:
                    self.handles.append(
                        u.module.register_forward_pre_hook(self._make_pre_hook(u), with_kwargs=True)
                    )
                self.handles.append(
                    u.module.register_forward_hook(self._make_hook(u), with_kwargs=True)
                )

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for u in self.units:  # a forward that raised left a pre_forward change on its module
            if u.kind.has_pre_forward:
                u.kind.post_forward(u.module)

    def __enter__(self) -> "Capture":
        self.phase = "forward"
        self._register()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._remove()

    def open_backward(self) -> None:
        """Keep the hooks on while the backward runs (forwards re-run by checkpointing)."""
        self.phase = "backward"
        self.active = True
        self._register()

    def close(self) -> None:
        """Remove the hooks."""
        self.active = False
        self._remove()

    def _make_pre_hook(self, unit: Unit) -> Callable:
        """Forward pre-hook of a rule with ``pre_forward``: hands the module its per-example
        inputs (on every run of the forward, checkpoint re-runs included, so that a re-run builds
        the same graph); the post-hook of the same call records them."""

        def pre(module, args, kwargs):
            if not self.active or (self.phase == "backward" and not in_backward()):
                return None
            res = unit.kind.pre_forward(module, args, kwargs, self.batch)
            self._pre.setdefault(id(unit), []).append(res)
            if res is None:
                return None
            new_args, new_kwargs, _, tensors = res
            for t in tensors:
                if not t.requires_grad:  # weights switched off: a leaf whose gradient is the "B"
                    t.requires_grad_(True)
            return new_args, new_kwargs

        return pre

    def _take_pre(self, unit: Unit):
        """The ``pre_forward`` result of the call whose post-hook runs now (None: declined)."""
        stack = self._pre.get(id(unit))
        return stack.pop() if stack else None

    def _make_hook(self, unit: Unit) -> Callable:
        def hook(module, args, kwargs, output):
            if not self.active:
                return None
            if self.phase == "backward":
                if not in_backward():  # a forward of a submodule after the pass: not ours
                    return None
                try:
                    return self._on_recompute(unit, args, kwargs, output)
                finally:
                    if unit.kind.has_pre_forward:
                        unit.kind.post_forward(module)
            try:
                return self._on_forward(unit, args, kwargs, output)
            finally:
                if unit.kind.has_pre_forward:
                    unit.kind.post_forward(module)

        return hook

    def _save(self, unit: Unit, args, kwargs, output):
        state, new_out, watched = unit.kind.save(unit.module, args, kwargs, output, self.batch)
        if unit.clone_input or self.clone_all:  # the model modifies this input in place later
            state = torch.utils._pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state
            )
            if unit.clone_input:
                watched = []
        return state, new_out, watched

    def _on_forward(self, unit: Unit, args, kwargs, output):
        pre = self._take_pre(unit) if unit.kind.has_pre_forward else None
        if unit.kind.has_pre_forward and pre is None:
            return None  # the rule declined this call: its parameters were not used by it
        self.calls[id(unit)] = self.calls.get(id(unit), 0) + 1
        if self.mode != "probe" and not torch.is_grad_enabled():
            # No graph is built (a reentrant checkpoint's first pass, or a no_grad region):
            # this call's output cannot receive a gradient here. Reentrant checkpointing
            # re-runs it inside the backward, where it is recorded.
            self.pending[id(unit)] = self.pending.get(id(unit), 0) + 1
            return None
        if pre is not None:
            return self._record_inputs(unit, pre)
        state, new_out, watched = self._save(unit, args, kwargs, output)
        for t in watched:
            self.versions.append((t, t._version, unit))
        if self.mode == "probe":
            self.probe_inputs.setdefault(id(unit), []).append(state)
            if self.check_outputs:
                self._keep_outputs(unit, new_out if new_out is not None else output)
            return new_out
        if self.keep_fallback_inputs and getattr(unit.kind, "is_fallback", False):
            self.probe_inputs.setdefault(id(unit), []).append(state)
        return self._record(unit, state, new_out, output, leaves=True)

    def _record_inputs(self, unit: Unit, pre) -> None:
        """Record a call whose gradient slots are the per-example tensors its rule's
        ``pre_forward`` handed the forward (hooks on them receive the gradient of every use)."""
        _, _, state, tensors = pre
        if self.mode == "probe":
            self.probe_inputs.setdefault(id(unit), []).append(state)
            if self.check_outputs:
                self._keep_outputs(unit, tensors)
            return None
        if self.keep_fallback_inputs and getattr(unit.kind, "is_fallback", False):
            self.probe_inputs.setdefault(id(unit), []).append(state)
        rec = _Record(unit, state, accumulate=True)
        rec.grads = [None] * len(tensors)
        rec.pending = len(tensors)
        rec.flat = [0] * len(tensors)
        self.records.append(rec)
        for slot, t in enumerate(tensors):
            t.register_hook(self._grad_hook(rec, slot))
        if self.check_outputs:
            self._keep_outputs(unit, tensors)
        return None

    def _keep_outputs(self, unit: Unit, out) -> None:
        b = self.batch
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
                    and t.shape[0] % b == 0):
                unit.check_outputs.append((t, unit.label))

    def _record(self, unit: Unit, state, new_out, output, leaves: bool):
        out = new_out if new_out is not None else output
        flat, spec = torch.utils._pytree.tree_flatten(out)
        rec = _Record(unit, state)
        slots = [k for k, t in enumerate(flat)
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
        rec.grads = [None] * len(slots)
        rec.pending = len(slots)
        b = self.batch
        rec.flat = [flat[k].shape[0] // b if (flat[k].dim() > 0 and flat[k].shape[0] != b
                                              and flat[k].shape[0] % b == 0) else 0 for k in slots]
        self.records.append(rec)
        if len(slots) > 1 and any(flat[k].requires_grad for k in slots):
            # Several outputs, one maybe computed from another inside the module (a router's
            # scores from its logits): a hook on the upstream one would also receive the
            # gradient flowing back from the other through the module. Each output is handed
            # on as a fresh alias whose gradient comes from the uses after the module only.
            for k in slots:
                if flat[k].requires_grad:
                    flat[k] = flat[k].view_as(flat[k])
            new_out = torch.utils._pytree.tree_unflatten(flat, spec)
        for slot, k in enumerate(slots):
            t = flat[k]
            if t.requires_grad:
                t.register_hook(self._grad_hook(rec, slot))
            else:
                # No trainable input upstream and the weights are switched off: make the output
                # a graph leaf so its gradient (the layer's "B") is computed.
                t.requires_grad_(True)
                if leaves:
                    self.leaves.append((t, rec, slot))
                else:
                    t.register_hook(self._grad_hook(rec, slot))
        if self.check_outputs and leaves:
            self._keep_outputs(unit, out)
        return new_out

    def _on_recompute(self, unit: Unit, args, kwargs, output):
        """A unit's forward re-run inside the backward by activation checkpointing."""
        self.recomputed = True
        pre = self._take_pre(unit) if unit.kind.has_pre_forward else None
        if self.mode == "probe" or (unit.kind.has_pre_forward and pre is None):
            return None
        if self.pending.get(id(unit), 0) > 0:
            # Reentrant: the original call ran without a graph; this one's graph is the one
            # the gradients flow through.
            self.pending[id(unit)] -= 1
            if pre is not None:
                return self._record_inputs(unit, pre)
            state, new_out, _ = self._save(unit, args, kwargs, output)
            return self._record(unit, state, new_out, output, leaves=False)
        # Non-reentrant: already recorded in the forward. Replay the graph change only (the
        # recomputed graph must save the same tensors as the original one).
        if pre is not None:  # the pre-hook already handed the re-run its per-example inputs
            return None
        _, new_out, _ = unit.kind.save(unit.module, args, kwargs, output, self.batch)
        out = new_out if new_out is not None else output
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
                t.requires_grad_(True)
        return new_out

    def _grad_hook(self, rec: _Record, slot: int) -> Callable:
        def h(g):
            if getattr(_SUSPEND, "on", False):
                return None
            self._deliver(rec, slot, g)
            return None

        return h

    def _deliver(self, rec: _Record, slot: int, g: Optional[torch.Tensor]) -> None:
        if rec.done:
            return
        if rec.accumulate:  # finished when the backward is over (backward(), or the live flush)
            if g is not None:
                rec.grads[slot] = g if rec.grads[slot] is None else rec.grads[slot] + g
            return
        rec.grads[slot] = g
        rec.pending -= 1
        if rec.pending == 0:
            self._finish(rec)

    def _finish(self, rec: _Record) -> None:
        rec.done = True
        if all(g is None for g in rec.grads):
            rec.state = None
            return
        u = rec.unit
        if isinstance(rec.state, LayoutError):
            raise BatchLayoutError(f"{u.label}: {rec.state.msg}")
        b = self.batch
        grads = [g.reshape(b, n, *g.shape[1:]) if (g is not None and n) else g
                 for g, n in zip(rec.grads, rec.flat or [0] * len(rec.grads))]
        # A fallback rule re-runs its module here (inside the backward): that is no
        # checkpoint recomputation, so the unit hooks stay quiet meanwhile.
        active, self.active = self.active, False
        try:
            with full_precision():
                out = u.kind.contributions(u.module, rec.state, grads, tuple(u.roles))
        finally:
            self.active = active
        rec.state = None
        rec.grads = []
        for role, c in out.items():
            if c is not None:
                self.contribs.setdefault(u.roles[role], []).append(c)

    def changed_inputs(self) -> list[Unit]:
        """Units whose saved tensors were modified in place after the module ran."""
        return [u for t, v, u in self.versions if t._version != v]

    def backward(self, loss: torch.Tensor) -> None:
        """Propagate activation gradients only; deliver the leaves' gradients; flush.

        ``loss.backward()`` with tensor hooks on the leaves (not ``torch.autograd.grad`` on
        them: reentrant checkpointing refuses ``autograd.grad``, and an output made to
        require grad by someone else, e.g. Hugging Face's ``enable_input_require_grads``, is a
        leaf this capture did not create). The leaves are this pass's own temporaries; no
        parameter requires grad during the pass, so no ``p.grad`` is written.
        """
        if loss.requires_grad:
            for t, rec, slot in self.leaves:
                t.register_hook(self._grad_hook(rec, slot))
            self.open_backward()
            try:
                loss.backward()
            finally:
                self.close()
        for rec in self.records:  # outputs that never received a gradient count as zero
            if not rec.done:
                self._finish(rec)
        self.leaves.clear()
        self.records.clear()
        self.versions.clear()


def uses_activation_checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face checkpointing is switched on in any module of ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
