"""Make another ``transformers.Trainer`` subclass private through the same plan as
:class:`~dpft.integrations.hf.trainer.DPTrainer` (JetBrains' ``privatize_trainer`` idea for Opacus)::

    from transformers import Seq2SeqTrainer
    from dpft.integrations.hf.privatize import privatize_trainer

    DPSeq2SeqTrainer = privatize_trainer(Seq2SeqTrainer)
    trainer = DPSeq2SeqTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                               dp_args=DPArguments(target_epsilon=8, target_delta=1e-5, ...))

The returned class is ``(DPTrainer, cls)``: DPTrainer's Poisson sampling, per-example clipping,
noise, ledger, checkpoints and resume come first in the method order, and everything else of
``cls`` (its evaluation, generation, logging) is kept. A subclass whose training path or loss
breaks the per-example structure is refused by name, with the reason, and so is one with its own
training loop (integrations/hf/checks.py ``LOOP_METHODS``). Whatever the class, every update of the
optimizer must be a DP release (step/guard.py), or training stops.
"""

from __future__ import annotations

from transformers import Trainer

from dpft.integrations.hf.trainer import DPTrainer
from dpft.integrations.hf.checks import check_training_path

__all__ = ["privatize_trainer", "REFUSED"]

#: Trainer subclasses whose loss is not a sum of per-example terms, with the reason.
REFUSED = {
    "KTOTrainer": "KTO's loss subtracts a KL reference point estimated from mismatched pairs of the batch, so one "
                  "example's loss depends on the others and its gradient cannot be clipped alone",
    "BCOTrainer": "BCO's loss shifts every example by a running mean reward of the batches (a statistic of the "
                  "private data outside the DP step)",
    "GRPOTrainer": "GRPO normalises each completion's advantage by its group's mean and std across rows",
    "RLOOTrainer": "RLOO's baseline for each completion is the mean reward of the other completions",
}
#: Methods whose override would be bypassed by the DP step (refused: the class would run DPTrainer's).
_STEP_METHODS = ("get_train_dataloader", "_get_train_sampler", "training_step")


def privatize_trainer(cls: type) -> type:
    """A private version of the ``Trainer`` subclass ``cls`` (named ``DP<cls>``); its ``__init__``
    takes ``dp_args`` and DPTrainer's other keywords (``loss_fn``, ``ledger``, ``transforms``).

    Raises:
        TypeError: ``cls`` is not a ``transformers.Trainer`` subclass.
        ValueError: ``cls`` (or a base) is in :data:`REFUSED`, or it overrides the sampling or the
            training step, which the DP step replaces, or the training loop around it (``train``,
            ``_inner_training_loop``, ``_run_epoch``: its own loop would update the weights without
            the DP step) — each naming the reason and the fix.
    """
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"privatize_trainer: {cls!r} is not a transformers.Trainer subclass")
    if issubclass(cls, DPTrainer):
        return cls
    for klass in cls.__mro__:
        if klass.__name__ in REFUSED:
            raise ValueError(f"privatize_trainer: {klass.__name__} cannot be made private: {REFUSED[klass.__name__]}; "
                             "per-example clipping needs a loss that is a sum of per-example terms")
    own = [m for m in _STEP_METHODS if getattr(cls, m) is not getattr(Trainer, m)]
    if own:
        raise ValueError(f"privatize_trainer: {cls.__name__} overrides {', '.join(own)}, which the DP step replaces "
                         "(Poisson sampling and the per-example step); its own version would be silently skipped")
    check_training_path(cls, "privatize_trainer")  # its own train / _inner_training_loop / _run_epoch
    doc = f"{cls.__name__} with DPTrainer's DP step (dpft.integrations.hf.privatize.privatize_trainer)."
    body = {"__module__": cls.__module__, "__doc__": doc}
    if getattr(cls, "compute_loss") is not Trainer.compute_loss:
        def __init__(self, *args, loss_fn=None, **kwargs):  # its batch loss is not what the DP step clips
            if loss_fn is None:
                raise ValueError(f"DP{cls.__name__}: {cls.__name__}.compute_loss returns one loss for the batch, which "
                                 "the DP step cannot clip per example; pass loss_fn=lambda forward, batch: ... "
                                 "returning the (B,) per-example losses of that objective")
            DPTrainer.__init__(self, *args, loss_fn=loss_fn, **kwargs)

        body["__init__"] = __init__
    return type(f"DP{cls.__name__}", (DPTrainer, cls), body)
