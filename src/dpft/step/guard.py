"""Every parameter update is a DP release: a guard on the real optimizer (issue 44 item 2).

The DP step (:meth:`DPStep.release_and_update <dpft.step.pipeline.DPStep.release_and_update>`)
*grants* one update each time it releases a noised gradient (one ledger event) and leaves it in
``p.grad``. A step pre-hook on the torch optimizer that updates the parameters (the user's
optimizer under ``make_private``; ``Trainer``'s, unwrapped from accelerate's
``AcceleratedOptimizer``, under ``DPTrainer`` and the TRL trainers) lets ``optimizer.step()`` run
only while such a grant is pending, and only on the gradient tensors the release wrote (same
tensor objects, unchanged since: a backward or a hand-written gradient after the release bumps
the tensor's version counter). Anything else — a custom training loop, a stock
``Trainer.training_step``, the raw optimizer a ``make_private`` user kept — raises
:class:`UpdateWithoutReleaseError` before the parameters move.

At the end of training the way in calls :meth:`ReleaseGuard.check_end`: the optimizer steps it
saw must equal the training releases the ledger gained (every release applied once, every update
a release), and with no update at all the weights must not have moved (a loop that writes the
parameters without any optimizer). A violation is kept (:attr:`ReleaseGuard.violation`); the way
in then refuses to write its model card (:meth:`ReleaseGuard.check_clean`).

An optimizer subclass whose ``step()`` calls ``super().step()`` runs torch's hooks once per
hooked class in its chain (torch wraps each class's ``step`` once an instance of it exists): the
nested calls inside the one guarded update are that update (counted once, gradients re-checked),
never a second grant.

Empty Poisson batches release pure noise and are granted like any other step; gradient
accumulation over micro-batches happens before the release (one grant, one update per logical
batch); under DDP / FSDP2 every rank releases the same step and guards its own optimizer (the
``DTensor`` gradient of a shard is the tensor the release wrote). A non-private step (no
mechanism) grants nothing, and no way in attaches a guard to it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from typing import Any, Iterable, Optional

import torch

__all__ = ["ReleaseGuard", "UpdateWithoutReleaseError", "real_optimizer", "weights_digest", "train_releases",
           "restoring_optimizer_state"]


class UpdateWithoutReleaseError(RuntimeError):
    """A parameter update without a pending DP release (or with a gradient changed after it), or a
    count of updates that differs from the ledger's releases: the model would not be covered by ε."""


def real_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that updates the parameters, unwrapped from accelerate's
    ``AcceleratedOptimizer`` (``.optimizer``) and dpft's ``DPOptimizer`` (``.original_optimizer``)."""
    seen = set()
    opt = optimizer
    while id(opt) not in seen:
        seen.add(id(opt))
        inner = getattr(opt, "original_optimizer", None)
        if inner is None and type(opt).__name__ == "AcceleratedOptimizer":
            inner = getattr(opt, "optimizer", None)
        if inner is None:
            break
        opt = inner
    return opt


def train_releases(ledger, phase: str = "train") -> int:
    """The number of releases (steps, no-op steps of banded MF included) of ``phase`` in ``ledger``."""
    return sum(e.count for e in ledger.entries if e.phase == phase)


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)  # an FSDP2 DTensor: this rank's shard
    return to_local() if callable(to_local) else p


@torch.no_grad()
def weights_digest(params: Iterable[torch.Tensor]) -> tuple:
    """A cheap fingerprint of the weights (per tensor: shape, float64 sum and sum of squares; FSDP2:
    this rank's shards) — equal before and after a run that updated nothing."""
    out = []
    for p in params:
        t = _local(p).detach()
        d = t.double() if t.is_floating_point() else t.to(torch.float64)
        out.append((tuple(t.shape), float(d.sum()), float(d.square().sum())))
    return tuple(out)


class ReleaseGuard:
    """Binds the updates of the real optimizer to the releases of a :class:`~dpft.step.DPStep`.

    Args:
        where: the way in, for messages (``"DPTrainer"``, ``"make_private"``, ...).
        fix: what the user should do instead (ends every message).

    Attributes:
        granted: releases granted so far; ``updates``: optimizer steps that consumed one.
        violation: the first violation seen (None: none); a way in refuses to write its card then.
    """

    def __init__(self, where: str, fix: str):
        self.where, self.fix = where, fix
        self.granted = 0
        self.updates = 0
        self.violation: Optional[str] = None
        self._pending: Optional[list] = None  # [(grad tensor, its version)] of the open release
        #: (optimizer, torch's step-wrapper frame, consumed release) of the last update: its nested
        #: ``super().step()`` calls re-run the hooks inside that frame (:meth:`_nested`).
        self._outer: Optional[tuple] = None
        self._hooks: dict[int, tuple] = {}
        self._restoring = 0  # > 0 inside :func:`restoring_optimizer_state`

    # -- the DP step's side --------------------------------------------------------------
    def grant(self, params: dict[str, torch.Tensor]) -> None:
        """One release was made and its noised gradient written to ``p.grad`` of ``params``: the
        next optimizer step may apply it (a release left unapplied is replaced, and counted)."""
        self.granted += 1
        self._outer = None
        self._pending = [(n, p, p.grad, getattr(p.grad, "_version", None)) for n, p in params.items()]

    # -- the optimizer's side ------------------------------------------------------------
    def attach(self, optimizer: Any) -> Any:
        """Hook the real optimizer of ``optimizer`` (idempotent); returns it."""
        opt = real_optimizer(optimizer)
        if id(opt) in self._hooks and self._hooks[id(opt)][0]() is opt:
            return opt
        if not hasattr(opt, "register_step_pre_hook"):
            raise TypeError(f"{self.where}: the optimizer {type(opt).__name__} is not a torch.optim.Optimizer; "
                            "its updates cannot be bound to the DP releases. Use a torch.optim.Optimizer")
        prev = opt.__dict__.get("_dpft_release_guard")
        if prev is not None and prev is not self:  # a newer loop over the same optimizer: its guard alone
            prev._drop(opt)
        handle = opt.register_step_pre_hook(self._before_step)
        self._hooks[id(opt)] = (weakref.ref(opt), handle)
        opt.__dict__["_dpft_release_guard"] = self
        return opt

    def _drop(self, opt) -> None:
        ref_handle = self._hooks.pop(id(opt), None)
        if ref_handle is not None:
            ref_handle[1].remove()

    def detach(self) -> None:
        """Remove every hook (the optimizer steps freely again)."""
        for ref, handle in self._hooks.values():
            handle.remove()
            opt = ref()
            if opt is not None and opt.__dict__.get("_dpft_release_guard") is self:
                del opt.__dict__["_dpft_release_guard"]
        self._hooks.clear()
        self._outer = None

    def _fail(self, msg: str) -> None:
        full = f"{self.where}: {msg}. {self.fix}"
        if self.violation is None:
            self.violation = full
        raise UpdateWithoutReleaseError(full)

    @staticmethod
    def _changed(pending: list) -> list:
        return [n for n, p, g, v in pending if p.grad is not g or getattr(g, "_version", None) != v]

    def _nested(self, optimizer, caller) -> bool:
        """This hook call runs inside the update that consumed the last release: an optimizer
        subclass whose ``step()`` calls ``super().step()`` re-enters torch's hooked step wrapper
        (torch wraps ``step`` of each class in the chain once an instance of it exists), so the
        pre-hooks run once per wrapped level of that one ``optimizer.step()``. True only while the
        wrapper frame of that update is still on the call stack (a later, separate step — even
        after an update that raised — is not nested)."""
        outer = self._outer
        if outer is None or outer[0] is not optimizer:
            return False
        f = caller.f_back if caller is not None else None
        while f is not None:
            if f is outer[1]:
                return True
            f = f.f_back
        return False

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self._restoring:  # torch initialising an empty state (lr 0, zero gradients): checked by the caller
            return
        caller = sys._getframe(1)  # torch's step wrapper of this call
        if self._pending is None and self._nested(optimizer, caller):
            bad = self._changed(self._outer[2])[:5]
            if bad:
                self._fail(f"the gradient of {bad} changed between the DP release and optimizer.step() (inside "
                           "the optimizer's step, before its super().step()); the update would not be the "
                           "released one; nothing more was applied")
            return  # the same update (one release, counted once by the outer call)
        pending, self._pending = self._pending, None
        self._outer = None
        if pending is None:
            self._fail(f"optimizer.step() (update {self.updates + 1}) without a pending DP release: the "
                       f"parameters would move on a gradient that was not clipped and noised ({self.granted} "
                       f"release(s), {self.updates} update(s) so far); nothing was applied")
        bad = self._changed(pending)[:5]
        if bad:
            self._fail(f"the gradient of {bad} changed between the DP release and optimizer.step() (a backward or "
                       "a written gradient after the noise); the update would not be the released one; nothing "
                       "was applied")
        self.updates += 1
        self._outer = (optimizer, caller, pending)

    # -- the end of training -------------------------------------------------------------
    def check_end(self, releases: int, updates: Optional[int] = None, before: Optional[tuple] = None,
                  after: Optional[tuple] = None) -> None:
        """At the end of training: the optimizer updates made during it (``updates``; default every
        update this guard saw) must equal ``releases`` (the training releases the ledger gained
        during it); with no update, the weights digest ``after`` (:func:`weights_digest`) must equal
        ``before`` (both optional).

        Raises:
            UpdateWithoutReleaseError: naming the counts (kept in :attr:`violation`)."""
        updates = self.updates if updates is None else int(updates)
        if updates != releases:
            self._fail(f"{updates} optimizer update(s) but {releases} training release(s) in the ledger; "
                       "every update must be exactly one DP release")
        if updates == 0 and before is not None and after is not None and not _same(before, after):
            self._fail("the weights changed during training with no DP release and no guarded optimizer update "
                       "(a training loop that writes the parameters itself); ε covers none of it")

    def check_clean(self, what: str = "the model card") -> None:
        """Refuse to write ``what`` after a violation.

        Raises:
            UpdateWithoutReleaseError: the violation, with ``what`` refused."""
        if self.violation is not None:
            raise UpdateWithoutReleaseError(f"{self.violation} [{what} refused: the weights are not covered by "
                                            "the ledger's ε]")


@contextlib.contextmanager
def restoring_optimizer_state(optimizer: Any):
    """Around ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` on a guarded optimizer.

    torch initialises an optimizer whose state is empty by ONE ``optimizer.step()`` with zero gradients
    and every group's lr set to 0 (``_init_optim_state``), then loads the saved state into it: not an
    update, and no release pays for it. The guard lets the steps inside this block through without
    counting them, and checks the parameters did not move (:func:`weights_digest` before and after).

    Raises:
        UpdateWithoutReleaseError: the parameters changed inside the block (kept in the guard's violation)."""
    opt = real_optimizer(optimizer)
    guard = opt.__dict__.get("_dpft_release_guard")
    if guard is None:
        yield
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    before = weights_digest(params)
    guard._restoring += 1
    try:
        yield
    finally:
        guard._restoring -= 1
    if not _same(before, weights_digest(params)):
        guard._fail("the weights changed while the optimizer state was restored (torch's state initialisation "
                    "must be a step at lr 0 on zero gradients); ε covers no such update")


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for (sa, s1, q1), (sb, s2, q2) in zip(a, b):
        if sa != sb or not (_eq(s1, s2) and _eq(q1, q2)):
            return False
    return True


def _eq(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))
