"""What ``dpft train`` hands the private session (session/core.py), translated from the recipe:
the typed :class:`~dpft.session.SessionSettings`, the methods' view of the run
(:class:`~dpft.methods.base.Run`) and the recipe's methods as the session prepares them
(:class:`RecipeMethods`: ``prepare``, ``hooks``, ``on_sigma``) — as ``make_private``
(api/arguments.py ``PrivacyArguments.session_settings``, methods/python.py ``PythonMethods``) and ``DPTrainer``
(integrations/hf/args.py) translate theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from dpft.data.prepare import TrainData
from dpft.methods.base import PhaseRunner, Run
from dpft.models.losses import causal_lm_loss, classification_loss, seq2seq_lm_loss
from dpft.optim import build_optimizer
from dpft.session import PrivateSession, SessionSettings
from dpft.step.mechanisms import Mechanism
from dpft.step.unit import PrivacyUnit

__all__ = ["recipe_settings", "run_context", "RecipeMethods", "evaluate_with_methods"]


def recipe_settings(recipe, mechanism: Mechanism, phase: str = "train") -> SessionSettings:
    """The recipe's privacy settings as the session's (a σ given wins over the target ε, whose
    default is 8; ``privacy.enabled: false`` / ``--no-dp``: ``private=False``)."""
    p, s = recipe.privacy, recipe.schedule
    return SessionSettings(
        max_grad_norm=float(p.clipping.max_norm), expected_batch_size=int(recipe.batch.expected_batch_size),
        mechanism=mechanism, steps=s.steps or None, epochs=s.epochs, noise_multiplier=p.noise_multiplier,
        target_epsilon=p.target_epsilon, target_delta=p.delta, clipping=p.clipping.style, hardened=p.hardened_noise,
        max_rows_per_user=int(recipe.task.max_rows_per_user), user_clipping=recipe.task.user_clipping, phase=phase,
        private=bool(p.enabled))


def evaluate_with_methods(methods: list, ctx: Run, base: Callable[[], dict]) -> dict:
    """Dev metrics: the first method that evaluates its own way (e.g. an EMA's weights) wins;
    else ``base()``."""
    for m in methods:
        out = m.evaluate(ctx, base)
        if out is not None:
            return out
    return base()


def run_context(recipe, session: PrivateSession, data: TrainData, tokenizer, model, unit: PrivacyUnit, methods: list,
                *, run_dir: Path, resume: bool, progress: bool, live: Path,
                train_phase: Optional[PhaseRunner], evaluate_model: Callable[[Any], dict]) -> Run:
    """The methods' view of one ``dpft train`` run (methods/base.py :class:`~dpft.methods.base.Run`):
    the session's key and ledger, the rows, model and loss, the unit (N, q, sampler); the planned
    steps: the session's count, set as the session prepares the methods (:class:`RecipeMethods`);
    ``evaluate`` runs the methods' own evaluation or ``evaluate_model(model)``; an optimizer factory
    over the recipe's optimizer; ``train_phase``: the driver's phase runner."""
    r, w = recipe, session.world
    ctx = Run(recipe=r, run_dir=run_dir, resume=resume, progress=progress, private=r.privacy.enabled,
              rng=session.rng, ledger=session.ledger, live_ledger_path=live, task=data.task, tokenizer=tokenizer,
              model=model, loss_fn=(seq2seq_lm_loss if data.seq2seq else causal_lm_loss if data.causal
                                    else classification_loss),
              train_tok=data.train_tok, dev_tok=data.dev_tok, n=unit.n, q=unit.q, sampler=unit.sampler,
              total_steps=0, evaluate=lambda: evaluate_with_methods(methods, ctx, lambda: evaluate_model(
                  ctx.model)), make_optimizer=lambda params: build_optimizer(r.optimizer, params),
              train_phase=train_phase, is_main=w.is_main, rank=w.rank, world_size=w.world_size)
    return ctx


class RecipeMethods:
    """The recipe's methods (methods/base.py plug-ins, composed in order) as the session's
    ``methods``: :meth:`prepare` runs each one's ``prepare`` on the run (earlier private phases
    append to the ledger; it may wrap model, loss, rows or set the length), :attr:`hooks` are their
    ``build`` (each returns a changed copy of the step's spec), :meth:`on_sigma` sets ``Run.sigma``
    before the hooks read it (0 for a non-private run). ``planned``: the session's count of the
    run's steps (session/core.py ``PrivateSession.prepare``), the methods' ``Run.total_steps``."""

    def __init__(self, methods: list, ctx: Run, planned: int):
        self.methods, self.ctx = list(methods), ctx
        ctx.total_steps = planned

    def prepare(self) -> None:
        for m in self.methods:
            m.prepare(self.ctx)

    @property
    def hooks(self) -> list[Callable[[Any], Any]]:
        return [lambda spec, m=m: m.build(spec, self.ctx) for m in self.methods]

    def on_sigma(self, sigma: Optional[float]) -> None:
        self.ctx.sigma = sigma if sigma is not None else 0.0
