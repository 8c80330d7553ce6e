"""The book-keeping engine driven by the user's own ``module(x)`` and ``loss.backward()``.

``BookKeepingEngine.clipped_sum(batch)`` runs the forward and the backward itself. A user with
their own PyTorch loop (``dpft.PrivacyEngine.make_private``, Opacus-shaped) runs them; this
module attaches the same hooks to that loop:

* a forward pre-hook on the root module opens a :class:`~dpft.grads._hooks.Capture` for the
  current physical micro-batch (its size ``B`` comes from the private data loader) and, except
  on the first micro-batch, switches the trainable parameters to ``requires_grad=False`` for
  the forward (autograd then computes no weight gradient and writes no ``p.grad``: the user's
  ``loss.backward()`` only propagates activation gradients); a forward hook on the root closes
  the capture and restores the flags;
* the unit hooks keep each layer's input ``A`` and, during the user's ``loss.backward()``,
  reduce its output gradient ``G`` to per-example contributions (Bu et al. 2023, book-keeping);
* :meth:`LiveBookKeeping.flush` (called by the optimizer's ``step()``, by the loader when the
  next micro-batch starts, and by the next training forward) turns the captured contributions
  into norms, clip factors and the clipped sum ``Σᵢ cᵢgᵢ`` (``BookKeepingEngine.reduce``) and
  hands the :class:`~dpft.grads.base.ClippedBatch` on. One forward, one backward: no second
  pass over the model.

The first micro-batch runs with the parameters requiring grad so that the engine's usage check
(every use of a trainable parameter comes from a hooked module call) can read the autograd
graph of the per-example losses, and with every saved input copied while the originals are
watched for in-place changes; the non-private ``p.grad`` its backward accumulates is dropped as
soon as it lands (a post-accumulate-grad hook), so ``p.grad`` never holds it.

Activation checkpointing (Hugging Face ``gradient_checkpointing_enable`` or
``torch.utils.checkpoint``, reentrant or not) re-runs forwards inside the user's backward: the
unit hooks stay registered until :meth:`LiveBookKeeping.flush` so that those re-runs are seen,
and each module call is recorded once (``Capture``). Once checkpointing is seen (or switched on
in a Hugging Face module), the trainable parameters keep ``requires_grad=False`` from the
training forward until the flush (the next ``optimizer.step()`` or training forward), so the
re-run forwards build the same graph as the original ones.

Mixed precision: run the forward under ``torch.autocast`` as usual (bf16; the backward may be
inside or outside it). Whatever dtype the layers' inputs and output gradients have, norms, clip
factors and the clipped sum are computed in fp32 with autocast off. fp16 with
``torch.amp.GradScaler`` is not supported: its dynamic scale multiplies the per-example
gradients the clip sees, and its scale follows the private examples' overflows (dpft/placement/device.py).

Per-example losses: the criterion returned by ``make_private`` calls :meth:`on_loss` with the
``(B,)`` per-example losses; their gradient reaches the hooks unscaled (a ``mean`` criterion's
gradient is scaled back by ``B``). A loss not made by that criterion cannot be inspected: its
gradient is taken as a batch mean or sum as the caller declared (``loss_reduction``, Opacus'
convention), and the usage check is skipped with a warning.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn

from dpft.grads.capture import Capture, uses_activation_checkpointing
from dpft.grads.base import ClippedBatch
from dpft.grads.bookkeeping import BookKeepingEngine


class DoubleCaptureError(RuntimeError):
    """A second forward+backward on one micro-batch before ``optimizer.step()``: each pass would
    be clipped on its own and the example would count twice (sensitivity 2C, not C)."""


class _LiveCapture(Capture):
    """A :class:`Capture` whose output gradients come from the user's ``loss.backward()``:
    outputs made graph leaves get tensor hooks too, deliveries are counted, and a closed
    capture ignores late gradients."""

    def __init__(self, *args, on_late: Optional[Callable[[], None]] = None,
                 session: Optional["LiveBookKeeping"] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_late = on_late
        self.session = session
        self.delivered = 0
        self.closed = False
        self.first = False
        self.criterion_seen = False
        self.verified = False
        self.loss_sum = 0.0
        self.late = False

    def _on_forward(self, unit, args, kwargs, output):
        n = len(self.leaves)
        out = super()._on_forward(unit, args, kwargs, output)
        for t, rec, slot in self.leaves[n:]:
            t.register_hook(self._grad_hook(rec, slot))
        del self.leaves[n:]
        return out

    def _finish(self, rec):
        # A fallback rule re-runs its module (maybe the root) inside the backward: the root's
        # pre-hook must not open a capture for that.
        if self.session is not None:
            self.session._busy = True
        try:
            super()._finish(rec)
        finally:
            if self.session is not None:
                self.session._busy = False

    def _deliver(self, rec, slot, g):
        if self.closed:
            if not self.late and self.on_late is not None:
                self.on_late()
            self.late = True
            return
        self.delivered += 1
        super()._deliver(rec, slot, g)


class FrozenAfterPrivateError(ValueError):
    """A parameter the DP engine clips was frozen (``requires_grad=False``) after ``make_private``."""

    def __init__(self, names: list[str]):
        super().__init__(
            f"make_private: {len(names)} parameter(s) the DP engine clips were frozen after make_private "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); the engine clips and noises the parameters "
            "that were trainable when make_private ran. Set requires_grad before make_private (call "
            "PrivacyEngine.detach(), freeze, then make_private again on a new optimizer), or unfreeze them")


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _RootHook:
    """The root module's forward pre-hook. A deep copy or a pickle of the module (a snapshot,
    an EMA copy, ``torch.save(model)``) gets a disabled hook: the copy is not hooked into this
    run's DP step."""

    def __init__(self, fn: Optional[Callable] = None):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return None if self.fn is None else self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _RootHook(None)

    def __reduce__(self):
        return (_RootHook, (None,))


class LiveBookKeeping:
    """Hooks a :class:`BookKeepingEngine` into the user's forward/backward of ``engine.model``.

    Args:
        engine: the book-keeping engine (its model, clip policy and units).
        on_result: receives each micro-batch's :class:`ClippedBatch` at :meth:`flush`.
        loss_reduction: ``"mean"`` or ``"sum"``: how a loss *not* made by the wrapped criterion
            reduced the micro-batch (``"mean"`` scales the captured gradients back by ``B``).

    Set :attr:`batch_size` to the current micro-batch size before each training forward (the
    private data loader does it); ``None`` means no micro-batch is open and training forwards
    are not captured (their backward then writes a non-private ``p.grad``, which the next
    :meth:`flush` discards).

    Raises (from the user's forward): :class:`~dpft.grads._hooks.BatchLayoutError` when a
    hooked module does not see the example dimension first with ``B`` rows.
    """

    def __init__(self, engine: BookKeepingEngine, on_result: Callable[[ClippedBatch], None],
                 loss_reduction: str = "mean"):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.engine = engine
        self.on_result = on_result
        self.loss_reduction = loss_reduction
        self.batch_size: Optional[int] = None
        #: local user ids of the open micro-batch's rows (user level), else None.
        self.groups: Optional[torch.Tensor] = None
        #: clipped sums handed on for the current micro-batch (at most one: one capture per
        #: micro-batch, :meth:`_check_one_capture`).
        self.results_in_micro_batch = 0
        self._cap: Optional[_LiveCapture] = None
        self._flags: Optional[list[bool]] = None
        self._post_handle = None
        self._busy = False
        self._grad_drops: list = []
        self._warned: set[str] = set()
        #: requires_grad flags to restore at :meth:`flush` (activation checkpointing: the
        #: re-run forwards in the user's backward must see the flags the forward saw).
        self._restore_at_flush: Optional[list[bool]] = None
        root = engine.model
        self._pre_handle = root.register_forward_pre_hook(_RootHook(self._pre), with_kwargs=True)

    # ------------------------------------------------------------------ hooks
    def _pre(self, module: nn.Module, args, kwargs):
        if self._busy or self._flags is not None or not torch.is_grad_enabled():
            return None
        if self.batch_size is None:
            return None
        self.flush()  # a previous micro-batch's backward (or a forward never backpropagated)
        first = not self.engine._checked
        cap = _LiveCapture(self.engine.units, self.batch_size, mode="main",
                           clone_all=first, keep_fallback_inputs=first, on_late=self._late,
                           session=self)
        cap.first = first
        params = list(self.engine.params.values())
        self._flags = [p.requires_grad for p in params]
        if not first:
            for p in params:
                p.requires_grad_(False)
        elif not self._grad_drops:
            frozen = [n for n, p in self.engine.params.items() if not p.requires_grad]
            if frozen:
                raise FrozenAfterPrivateError(frozen)
            # First micro-batch: the weights take part in the graph (for the usage check); the
            # non-private gradient the backward accumulates is dropped as soon as it lands.
            self._grad_drops = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
        cap.__enter__()
        self._cap = cap
        # Registered after the capture's own hooks so that it runs after them (a root module
        # that owns parameters is itself a unit).
        self._post_handle = module.register_forward_hook(self._post, with_kwargs=True, always_call=True)
        return None

    def _post(self, module, args, kwargs, output):
        if self._post_handle is not None:
            self._post_handle.remove()
            self._post_handle = None
        cap = self._cap
        if cap is not None:
            cap.__exit__(None, None, None)
            # The unit hooks stay on through the user's backward: activation checkpointing
            # re-runs forwards there (Capture tells re-runs from new calls).
            cap.open_backward()
        if self._flags is not None:
            flags, self._flags = self._flags, None
            if cap is not None and not cap.first and self._checkpointing():
                # Re-run forwards in the backward must see requires_grad as the forward did
                # (else their saved tensors differ and the weights' gradients get computed).
                self._restore_at_flush = flags
            else:
                self._restore_flags(flags)
        if cap is not None and not cap.first and cap.changed_inputs():
            names = ", ".join(sorted({u.label for u in cap.changed_inputs()}))
            self._cap = None
            cap.closed = True
            cap.close()
            if self._restore_at_flush is not None:
                self._restore_flags(self._restore_at_flush)
                self._restore_at_flush = None
            raise RuntimeError(
                f"inputs of {names} were modified in place after the module ran (not seen on the "
                "first micro-batch); the stored activations are stale"
            )
        return None

    def begin_micro_batch(self, size: Optional[int], groups: Optional[torch.Tensor] = None) -> None:
        """A new micro-batch of ``size`` examples (None: none open); resets the capture count.

        ``groups``: ``(size,)`` int64 local user ids 0..G-1 of its rows (user-level group
        clipping, grads/groups.py: each user's summed gradient is clipped as one), or None."""
        self.batch_size = size
        self.groups = groups
        self.results_in_micro_batch = 0

    def _check_one_capture(self) -> None:
        """One forward+backward per micro-batch: each captured pass is clipped on its own, so a
        second one (two losses, an augmentation, a second forward) would add the same examples'
        gradients twice. ``loss.backward(retain_graph=True)`` twice on one forward is one capture
        (its gradients are summed before clipping)."""
        if self.results_in_micro_batch:
            raise DoubleCaptureError(
                "make_private: a second forward+backward on the same micro-batch before optimizer.step(): "
                "each pass would be clipped separately and every example would count twice (sensitivity "
                "2C, while the ledger records C). Run one forward and one backward per micro-batch: sum "
                "the losses and call backward once (loss = loss_a + loss_b; loss.backward()), and put "
                "augmented copies in the same forward only if they belong to the same examples")

    def _restore_flags(self, flags: list[bool]) -> None:
        for p, f in zip(self.engine.params.values(), flags):
            p.requires_grad_(f)

    def _checkpointing(self) -> bool:
        """Activation checkpointing is in use: seen re-running a forward, or switched on in a
        Hugging Face module."""
        if getattr(self.engine, "recomputes", False):
            return True

        return uses_activation_checkpointing(self.engine.model)

    # ------------------------------------------------------------------ losses
    def on_loss(self, per_example: torch.Tensor) -> None:
        """Called by the wrapped criterion with the micro-batch's ``(B,)`` per-example losses.

        Raises:
            ValueError: the losses do not have one entry per example of the micro-batch.
            dpft.grads.bookkeeping.UnattributedUseError: (first micro-batch) a trainable
                parameter is used outside the forward of the modules that own it.
        """
        cap = self._cap
        if cap is None or cap.closed:
            return
        if per_example.shape != (cap.batch,):
            raise ValueError(
                f"the criterion gave per-example losses of shape {tuple(per_example.shape)} for a "
                f"micro-batch of {cap.batch} examples; the model output must keep the example "
                "dimension first"
            )
        cap.criterion_seen = True
        cap.loss_sum += float(per_example.detach().sum())
        if cap.first and not cap.verified and per_example.requires_grad:
            self._busy = True
            try:
                self.engine.verify_uses(per_example, cap.calls, cap.probe_inputs)
            finally:
                self._busy = False
            cap.verified = True

    # ------------------------------------------------------------------ results
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def _late(self) -> None:
        self._warn_once(
            "late",
            "make_private: a backward reached a forward pass that was already closed (another "
            "training forward, optimizer.step() or the next micro-batch came in between); that "
            "gradient was dropped. Run forward, loss.backward(), optimizer.step() per micro-batch")

    def discard_param_grads(self) -> None:
        """Drop any ``p.grad`` of the trainable parameters (a non-private sum of gradients)."""
        for p in self.engine.params.values():
            p.grad = None

    def flush(self) -> None:
        """Reduce the open capture (if its backward ran) and hand the clipped sum on."""
        cap = self._cap
        self._cap = None
        if cap is not None:
            cap.close()
            if cap.recomputed:
                self.engine.recomputes = True
        if self._restore_at_flush is not None:
            self._restore_flags(self._restore_at_flush)
            self._restore_at_flush = None
        self.discard_param_grads()
        if cap is None:
            return
        cap.closed = True
        if cap.delivered and self._grad_drops:
            for h in self._grad_drops:
                h.remove()
            self._grad_drops = []
        if cap.delivered == 0:  # forward without backward: nothing to add
            return
        self._check_one_capture()  # a forward without backward (logging) is not a capture
        for rec in cap.records:  # outputs that never received a gradient count as zero
            if not rec.done:
                cap._finish(rec)
        cap.records.clear()
        if cap.first:
            for u in cap.changed_inputs():
                u.clone_input = True
            if not cap.verified:
                self._warn_once(
                    "unverified",
                    "make_private: the first loss was not computed by the criterion make_private "
                    "returned, so the check that every trainable parameter is used only inside "
                    "its module's forward was skipped")
            self.engine._checked = True
        scale = 1.0
        if not cap.criterion_seen:
            self._warn_once(
                "criterion",
                "make_private: a loss not made by the criterion make_private returned was "
                f"backpropagated; its gradient is taken as a batch {self.loss_reduction} "
                f"(loss_reduction={self.loss_reduction!r}) of per-example losses")
            if self.loss_reduction == "mean":
                scale = float(cap.batch)
        device = next(iter(self.engine.params.values())).device
        groups = self.groups
        if groups is not None and len(groups) != cap.batch:  # never clip a user's rows apart silently
            raise ValueError(f"user ids for {len(groups)} rows but a micro-batch of {cap.batch}")
        res = self.engine.reduce(cap.contribs, cap.batch, cap.loss_sum, device, grad_scale=scale, groups=groups)
        self.results_in_micro_batch += 1
        self.on_result(res)

    def close(self) -> None:
        """Remove the hooks (the module behaves as before ``make_private``)."""
        self.flush()
        self._pre_handle.remove()
        for h in self._grad_drops:
            h.remove()
        self._grad_drops = []
        if self._post_handle is not None:
            self._post_handle.remove()


__all__ = ["LiveBookKeeping", "DoubleCaptureError"]
