"""The run as a plan: a recipe resolved into its parts once, before the loop (jax_privacy's
``DPExecutionPlan`` idea), through the private session every way in shares (session/core.py).

:func:`build_plan` translates the recipe for the session and calls one small builder per concern
around it, each in the room that concern lives in, and returns a frozen :class:`RunPlan`;
:class:`~dpft.run.loop.Trainer` is the loop over it (steps, evaluation, checkpoints, release,
report). In order::

    refusals        run/refuse.py        refuse_unresolved    `auto` resolved first
    world, key      session/core.py      PrivateSession.open  torchrun world; the one secret key; same recipe
    refusals        run/refuse.py        refuse_and_place     what needs no data; device and precision
    ledger          run/checkpoint.py    continue_ledger      appended to, never replaced
    data, model     run/load.py          load_run_data        rows (δ < 1/N), tokenizer, model, tokenised rows
    unit            run/unit.py          build_unit           privacy unit, its sampler, N, q
    settings, Run   run/session_args.py  recipe_settings, run_context   the session's settings; the methods' view
    methods         session/core.py      PrivateSession.prepare  same on every rank; T; Method.prepare (ledger)
    step's model    run/step_model.py    StepModel.ready      rank 0's weights, FSDP2 shards, frozen features
    privacy plan    session/core.py      PrivateSession.plan  σ (calibrated on the ledger's events), clip and
                                                              engine (StepModel.parts), Method.build, install
    engine fit      run/step_model.py    StepModel.fit        precision, user-level group clipping
    optimizer       optim/__init__.py    build_optimizer, build_scheduler

``make_private`` (api/engine.py) and ``DPTrainer`` (integrations/hf/trainer.py) ask the same
session for their plans from their own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from dpft.accounting.ledger import PrivacyLedger
from dpft.data.prepare import TrainData
from dpft.eval.dev import DevEvaluator
from dpft.methods.base import PhaseRunner, Run, active_methods, registered
from dpft.models.load import is_head_param
from dpft.optim import build_optimizer, build_scheduler
from dpft.placement.device import Placement
from dpft.privacy.randomness import Randomness
from dpft.run.checkpoint import continue_ledger
from dpft.run.load import load_run_data
from dpft.run.refuse import refuse_and_place, refuse_unresolved
from dpft.run.session_args import RecipeMethods, recipe_settings, run_context
from dpft.run.step_model import StepModel
from dpft.run.unit import build_unit
from dpft.session import PrivateSession
from dpft.step.mechanisms import Mechanism
from dpft.step.plan import PrivacyPlan
from dpft.step.unit import PrivacyUnit

__all__ = ["RunPlan", "build_plan"]


@dataclass(frozen=True)
class RunPlan:
    """Everything a run is, resolved before its first step. Frozen: the loop reads it.

    Attributes:
        recipe, run_dir, phase: the recipe, its run directory, the ledger phase of its steps.
        private: the recipe is private (``privacy.enabled``).
        progress: this process shows progress (rank 0 of a world, and the caller asked).
        world, rng: the DDP world and the run's one secret randomness.
        ledger, ledger_notes, live_ledger_path: the ledger the run appends to (earlier phases and
            attempts included), what the report says about what it carried, and its live file.
        placement: device and precision.
        data: tokenised rows; ``train_tok`` below is the training rows after the methods' prepare.
        model, loss_fn, train_tok: after the methods' ``prepare`` (which may wrap them).
        unit: the privacy unit, its sampler, N and q.
        total_steps: logical steps to run; sigma: σ (0 for a non-private run).
        methods, ctx: the recipe's method plug-ins and what they see of the run.
        spec: the DP step's parts after the methods' ``build``; params: the parameters it updates.
        optimizer, scheduler: the step's optimizer and its learning-rate schedule.
        evaluator: dev evaluation of a model.
    """

    recipe: Any
    run_dir: Path
    phase: str
    private: bool
    progress: bool
    world: Any
    rng: Randomness
    ledger: PrivacyLedger
    ledger_notes: list
    live_ledger_path: Path
    placement: Placement
    data: TrainData
    model: Any
    loss_fn: Callable
    train_tok: Any
    unit: PrivacyUnit
    total_steps: int
    sigma: float
    methods: list
    ctx: Run
    spec: Any
    params: dict
    optimizer: Any
    scheduler: Any
    evaluator: DevEvaluator
    #: ``perf.sharding: fsdp``: parameters are FSDP2 shards and the step is ``dpft.placement.fsdp.FSDPStep``.
    sharded: bool = False
    #: The privacy plan of the training phase (step/plan.py: the builder every way in shares).
    privacy: Optional[PrivacyPlan] = None
    #: The model's frozen prefix (models/features.py), run in eval mode by every step; None: none.
    prefix: Any = None
    #: Frozen features computed once (run/features.py); None: the step runs the whole model.
    features: Any = None
    #: The private session (session/core.py) the plan came from: its world, key and ledger, and
    #: the step for this world (``session.step(plan.privacy, ...)``, run/loop.py).
    session: Any = None

    @property
    def mechanism(self) -> Mechanism:
        """The mechanism family object (sampler, event, install, report info)."""
        return self.privacy.mechanism


def build_plan(recipe, run_dir: str | Path, *, resume: bool = False, transforms: Optional[list] = None,
               progress: bool = True, ledger: Optional[PrivacyLedger] = None, rng: Optional[Randomness] = None,
               phase: str = "train", live_ledger_path: Optional[str | Path] = None,
               train_phase: Optional[PhaseRunner] = None,
               extra_rows: Optional[Callable[[Any, TrainData, Any], TrainData]] = None,
               features: Any = None) -> RunPlan:
    """Resolve ``recipe`` into a :class:`RunPlan` through the private session (see the module
    docstring for the order; the manual: docs/cli_plan.md).

    Args: as :class:`~dpft.run.loop.Trainer`; ``train_phase``: the driver's phase runner, given
    to the methods as ``Run.train_phase`` (a method's earlier training phase runs through it and
    appends to this run's ledger; the plan cannot import the loop that calls it);
    ``extra_rows(recipe, data, tokenizer) -> data``: rows added to the tokenised training rows
    before N is counted (the final-model audit's canaries, audit/final_model.py); ``features``: a
    :class:`~dpft.run.features.FeatureCache` built earlier (a tune trial's), reused when its key
    matches this run's (run/features.py).

    Raises:
        DataError, ModelError, CalibrationError, TrainingError, DistributedError — each naming
        the fix; refusals that need no data come before any loading.
    """
    r, run_dir, methods, private = recipe, Path(run_dir), active_methods(recipe), recipe.privacy.enabled
    refuse_unresolved(r)  # every way in resolves `auto` first (dpft train, dpft.train, dpft audit do)
    session = PrivateSession.open(r.seed if r.privacy.reproducible else None, rng=rng, ledger=ledger,
                                  same=r.model_dump(mode="json"), where="dpft train")
    world, progress = session.world, progress and session.world.is_main
    placement, mechanism = refuse_and_place(r, world, methods, resume, progress)  # before any loading
    live = Path(live_ledger_path) if live_ledger_path else run_dir / "ledger.json"
    session.ledger, ledger_notes = continue_ledger(world, run_dir, live, resume, session.ledger)
    data, tokenizer, model = load_run_data(r, placement, methods, progress, extra_rows)
    unit = build_unit(r, data.train_tok, data.task.notes, session.rng, private, mechanism)
    settings = recipe_settings(r, mechanism, phase)
    step_model = StepModel(r, data, tokenizer, placement, world, methods, run_dir=run_dir, reuse=features,
                           cache=extra_rows is None, progress=progress)
    ctx = run_context(r, session, data, tokenizer, model, unit, methods, run_dir=run_dir, resume=resume,
                      progress=progress, live=live, train_phase=train_phase,
                      evaluate_model=lambda m: step_model.evaluator(m))
    # the same settings on every rank; T counted by the session (the methods see it, may set it); DDP: only
    # methods correct across ranks; earlier phases, wrapping
    session.prepare(settings, n_rows=len(data.train_tok), rng=session.rng, unit=unit, method_list=methods,
                    method_registry=registered(),
                    methods=lambda *_: RecipeMethods(methods, ctx, session.planned))
    step_model.ready(ctx)  # rank 0's weights, FSDP2 shards, frozen features: before the engine sees them
    privacy = session.plan(  # DDP: rank 0 calibrates σ, every rank gets it
        settings, rows=ctx.train_tok, n_rows=len(data.train_tok), rng=session.rng, total_steps=ctx.total_steps,
        parts=step_model.parts(ctx, unit.user_level), padded=True, transforms=list(transforms or []),
        optimizer_factory=lambda params: build_optimizer(r.optimizer, params),
        head_mask=lambda names: [is_head_param(n) for n in names])
    step_model.fit(privacy.spec)
    spec = privacy.spec
    return RunPlan(recipe=r, run_dir=run_dir, phase=phase, private=private, progress=progress, world=world,
                   rng=session.rng, ledger=session.ledger, ledger_notes=ledger_notes, live_ledger_path=live,
                   placement=placement, data=data, model=ctx.model, loss_fn=ctx.loss_fn, train_tok=ctx.train_tok,
                   unit=unit, total_steps=ctx.total_steps, sigma=ctx.sigma, methods=methods, ctx=ctx, spec=spec,
                   params=privacy.params, optimizer=spec.optimizer,
                   scheduler=build_scheduler(spec.optimizer, r.schedule, ctx.total_steps),
                   evaluator=step_model.evaluator, sharded=r.perf.sharding == "fsdp", privacy=privacy,
                   prefix=step_model.prefix, features=step_model.cache, session=session)
