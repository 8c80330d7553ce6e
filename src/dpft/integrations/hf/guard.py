"""The release guard of :class:`~dpft.integrations.hf.trainer.DPTrainer` and the TRL trainers (a mixin;
step/guard.py): every step of the optimizer ``Trainer`` updates the parameters with must apply
exactly one DP release of ``DPTrainer.training_step``, and at the end of ``train()`` the updates
must equal the training releases the ledger gained (with none, the weights must not have moved).
A violation stops training with :class:`~dpft.step.guard.UpdateWithoutReleaseError`, and
``save_model`` / the model card are refused from then on.

The optimizer is hooked wherever it comes from: ``optimizers=(opt, ...)`` at construction,
``create_optimizer`` (``Trainer``'s or DPTrainer's head groups), ``on_train_begin`` (after
accelerate's wrapper) and every ``training_step`` (an optimizer swapped in since).
"""

from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

from dpft.step.guard import ReleaseGuard, train_releases, weights_digest

__all__ = ["GuardedTraining", "GUARD_FIX"]

#: What a user whose loop trips the guard should do instead.
GUARD_FIX = ("Let transformers' Trainer loop call DPTrainer.training_step and then step the optimizer once, with no "
             "other backward, gradient change or optimizer.step() in between (post-process the noisy gradient with "
             "DPTrainer(transforms=...)); for a loop of your own use dpft.PrivacyEngine().make_private(...)")


class _GuardOptimizer(TrainerCallback):
    """Hooks the guard on the optimizer ``Trainer`` prepared (after ``create_optimizer`` and
    accelerate's wrapper), whatever created it."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._guard_optimizer()


class GuardedTraining:
    """Mixin of :class:`~dpft.integrations.hf.trainer.DPTrainer` (before ``transformers.Trainer`` in the
    method order): the release guard around ``Trainer.train``.

    Attributes:
        release_guard: the :class:`~dpft.step.guard.ReleaseGuard` (None before the DP step exists)."""

    release_guard: Optional[ReleaseGuard] = None

    def _init_release_guard(self) -> None:
        """Bind the DP step's releases to the optimizer's updates (call once ``dp_step`` exists)."""
        self.release_guard = ReleaseGuard(type(self).__name__, GUARD_FIX)
        self.dp_step.guard = self.release_guard
        self.add_callback(_GuardOptimizer(self))
        self._guard_optimizer()

    def _guard_optimizer(self, optimizer=None) -> None:
        """Hook ``optimizer`` (default: the trainer's) on the guard (idempotent)."""
        opt = optimizer if optimizer is not None else getattr(self, "optimizer", None)
        if opt is not None and self.release_guard is not None:
            self.release_guard.attach(opt)

    def _get_grad_norm(self, model, grad_norm=None):
        """None: ``Trainer``'s norm of the gradient (dropped from the logs anyway) would rescale the
        released gradient in place (``clip_grad_norm_`` at ∞ multiplies it by 1), which the guard
        cannot tell from a change of the released gradient."""
        return None

    def check_releases(self, what: str = "the model card") -> None:
        """Refuse to write ``what`` after a violation of the guard.

        Raises:
            dpft.step.guard.UpdateWithoutReleaseError: the violation."""
        if self.release_guard is not None:
            self.release_guard.check_clean(what)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` with the end-of-training check: optimizer updates = training releases
        the ledger gained; with none, the weights unchanged (a fresh run: a resume loads weights).

        Raises:
            dpft.step.guard.UpdateWithoutReleaseError: an update without a release (from the hook),
                or the counts differ."""
        guard = self.release_guard
        if guard is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self.check_releases("training")
        self._guard_optimizer()
        base, updates = train_releases(self.ledger, self.dp_step.spec.phase), guard.updates
        before = None if resume_from_checkpoint else weights_digest(self.model.parameters())
        out = super().train(resume_from_checkpoint, *args, **kwargs)
        after = None if before is None else weights_digest(self.model.parameters())
        guard.check_end(train_releases(self.ledger, self.dp_step.spec.phase) - base, guard.updates - updates,
                        before, after)
        return out
