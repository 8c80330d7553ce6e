"""The run as a plan: a recipe resolved into its parts once, before the loop (jax_privacy's
``DPExecutionPlan`` idea).

:func:`build_plan` calls one small builder per concern, each in the room that concern lives in,
and returns a frozen :class:`RunPlan`; :class:`~dpft.run.loop.Trainer` is the loop over it (steps,
evaluation, checkpoints, release, report). In order::

    world, rng      session/world.py     session_world        torchrun world; the one secret key
    ledger          run/checkpoint.py    continue_ledger      appended to, never replaced
    placement       perf.py              build_placement      device, precision (refusals first)
    rows            data/prepare.py      load_rows            classification rows; δ < 1/N
    model           models/build.py      build_model          tokenizer, model, trainable params
                    perf.py              place_model          device, checkpointing
    data            data/prepare.py      build_train_data     tokenised train/dev rows
    unit            run/unit.py          build_unit           privacy unit, Poisson sampler, N, q
    methods         methods/base.py      Method.prepare       earlier phases (Run.train_phase; ledger)
    σ               step/build.py        resolve_sigma        calibrated on the ledger's events
    step spec       step/build.py        build_clip, make_engine, build_step_spec; Method.build
    optimizer       optim/__init__.py    build_optimizer, build_scheduler
    evaluation      eval/dev.py          DevEvaluator

``make_private`` (api/engine.py) and ``DPTrainer`` (integrations/hf/trainer.py) build the overlapping parts —
σ, engine, step spec — with the same step/build.py functions from their own arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from dpft.accounting.ledger import PrivacyLedger
from dpft.data.prepare import TrainData, build_train_data, load_rows, num_labels
from dpft.eval.dev import DevEvaluator
from dpft.methods.base import PhaseRunner, Run, active_methods, registered
from dpft.models.build import build_model
from dpft.models.load import is_head_param
from dpft.models.quant import check_recipe as check_quantization
from dpft.models.losses import causal_lm_loss, classification_loss, seq2seq_lm_loss
from dpft.optim import build_optimizer, build_scheduler
from dpft.placement.device import Placement, build_placement, place_model
from dpft.privacy.randomness import Randomness
from dpft.placement import world as ddp
from dpft.run.auto import has_auto
from dpft.session import session_world
from dpft.run.features import FeatureDevEvaluator, build_for_plan, prefix_of
from dpft.run.checkpoint import continue_ledger
from dpft.errors import PlanError, TrainingError
from dpft.step.build import build_clip, make_engine
from dpft.step.mechanisms import Mechanism, mechanism_of_recipe
from dpft.step.plan import PrivacyPlan, build_privacy_plan, planned_steps
from dpft.run.unit import build_unit, check_user_level
from dpft.step.unit import PrivacyUnit
from dpft.placement.fsdp import check_recipe, shard_model
from dpft.grads.base import NonPrivateEngine
from dpft.step.clip import make_clip_policy

__all__ = ["RunPlan", "build_plan", "evaluate_with_methods"]


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

    @property
    def mechanism(self) -> Mechanism:
        """The mechanism family object (sampler, event, install, report info)."""
        return self.privacy.mechanism


def evaluate_with_methods(methods: list, ctx: Run, base: Callable[[], dict]) -> dict:
    """Dev metrics: the first method that evaluates its own way (e.g. an EMA's weights) wins;
    else ``base()``."""
    for m in methods:
        out = m.evaluate(ctx, base)
        if out is not None:
            return out
    return base()


def build_plan(recipe, run_dir: str | Path, *, resume: bool = False, transforms: Optional[list] = None,
               progress: bool = True, ledger: Optional[PrivacyLedger] = None, rng: Optional[Randomness] = None,
               phase: str = "train", live_ledger_path: Optional[str | Path] = None,
               train_phase: Optional[PhaseRunner] = None,
               extra_rows: Optional[Callable[[Any, TrainData, Any], TrainData]] = None,
               features: Any = None) -> RunPlan:
    """Resolve ``recipe`` into a :class:`RunPlan` (see the module docstring for the order).

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
    r = recipe
    if has_auto(r):  # every way in resolves `auto` first (dpft train, dpft.train, dpft audit do)
        raise TrainingError("batch.expected_batch_size / schedule.steps 'auto': resolve them with "
                            "dpft.run.auto.resolve_auto(recipe) before building the plan")
    run_dir = Path(run_dir)
    private = r.privacy.enabled
    world, rng = session_world(r.seed if r.privacy.reproducible else None, rng, same=r.model_dump(mode="json"))
    if world.distributed and r.perf.sharding == "none":
        raise ddp.DistributedError(f"perf.sharding: none but this run has {world.world_size} processes; run "
                                   "without torchrun, or set perf.sharding: ddp or fsdp")
    progress = progress and world.is_main
    live = Path(live_ledger_path) if live_ledger_path else run_dir / "ledger.json"
    ledger, ledger_notes = continue_ledger(world, run_dir, live, resume,
                                           ledger if ledger is not None else PrivacyLedger())
    methods = active_methods(r)
    sharded = r.perf.sharding == "fsdp"
    check_quantization(r)  # model.quantization (QLoRA): bitsandbytes installed, LoRA only; before any loading
    if sharded:  # refusals that need no data, before any loading (dpft/placement/fsdp.py)

        check_recipe(r, world.world_size, methods, private, resume)
    placement = build_placement(r, world.local_rank if world.distributed else None, progress,
                                [m.name for m in methods if not getattr(m, "supports_device", False)])
    if r.task.user_column and private:  # refusals that need no data, before any loading
        check_user_level(r, [m.name for m in methods])
    mechanism = _recipe_mechanism(r, private, [m.name for m in methods])  # refusals before any loading

    task = load_rows(r, private)
    tokenizer, model = build_model(r, num_labels(task), device=placement.device)
    model = place_model(model, r.perf, placement.device)
    data = build_train_data(r, task, tokenizer, hide_counts=private or bool(methods), progress=progress)
    if extra_rows is not None:  # before the unit: N and q count the added rows
        data = extra_rows(r, data, tokenizer)
    unit = build_unit(r, data.train_tok, data.task.notes, rng, private, mechanism)
    s = r.schedule
    total_steps = planned_steps(unit.n, r.batch.expected_batch_size, s.steps or None, s.epochs)

    ddp.check_methods(world, methods, registry=registered())  # DDP: only methods correct across ranks
    world_sum = functools.partial(ddp.all_sum, world)  # the evaluator's sum over ranks
    evaluator = DevEvaluator(data, placement, world, r.eval, world_sum)
    ctx = Run(recipe=r, run_dir=run_dir, resume=resume, progress=progress, private=private, rng=rng, ledger=ledger,
              live_ledger_path=live, task=data.task, tokenizer=tokenizer, model=model,
              loss_fn=(seq2seq_lm_loss if data.seq2seq else causal_lm_loss if data.causal else classification_loss),
              train_tok=data.train_tok,
              dev_tok=data.dev_tok, n=unit.n, q=unit.q, sampler=unit.sampler, total_steps=total_steps,
              evaluate=lambda: evaluate_with_methods(methods, ctx, lambda: evaluator(ctx.model)),
              make_optimizer=lambda params: build_optimizer(r.optimizer, params), train_phase=train_phase,
              is_main=world.is_main, rank=world.rank, world_size=world.world_size)
    for m in methods:  # earlier private phases; model / loss / data wrapping
        m.prepare(ctx)
    ddp.broadcast_module(world, ctx.model)  # DDP: the world starts from rank 0's weights
    if sharded:  # FSDP2: shard after the broadcast, before the engine and optimizer see the parameters

        ctx.model = shard_model(ctx.model, world, r.perf.dtype)
    total_steps = ctx.total_steps
    # Frozen features computed once (run/features.py): the engine then runs the model from them.
    prefix = prefix_of(r, ctx.model, methods, data.causal)
    cache = None
    if extra_rows is None and (prefix is not None or r.perf.feature_cache == "on"):
        cache = build_for_plan(r, data, ctx.model, tokenizer, placement, world, methods, run_dir=run_dir,
                               reuse=features, progress=progress)
        if cache is not None:
            prefix = cache.split
            evaluator = FeatureDevEvaluator(data, placement, world, r.eval, world_sum, cache)
    step_loss = cache.loss(ctx.loss_fn) if cache is not None else ctx.loss_fn

    p = r.privacy

    def parts(sampler):
        if not private:
            engine = NonPrivateEngine(ctx.model, step_loss, make_clip_policy("flat", 1.0))
            return engine.clip, engine
        clip = build_clip(p, r.task.user_clipping if unit.user_level else None, r.task.max_rows_per_user)
        return clip, make_engine(p.engine, ctx.model, step_loss, clip)

    # DDP: rank 0 calibrates and every rank gets its σ (one value for the world).
    privacy = build_privacy_plan(
        n=unit.n, expected_batch_size=r.batch.expected_batch_size, steps=total_steps, mechanism=mechanism,
        rng=rng, parts=parts, optimizer=None, noise_multiplier=p.noise_multiplier,
        target_epsilon=p.target_epsilon, delta=p.delta, prior=ledger.events(),
        calibrate=lambda f: ddp.on_rank0(world, f), sampler=unit.sampler, private=private,
        hardened=p.hardened_noise, transforms=list(transforms or []),
        head_mask=lambda names: [is_head_param(n) for n in names],
        hooks=[lambda spec, m=m: m.build(spec, ctx) for m in methods],  # each returns a changed copy
        rows=ctx.train_tok, padded=True, phase=phase, optimizer_factory=lambda params: build_optimizer(
            r.optimizer, params), on_sigma=lambda sig: setattr(ctx, "sigma", sig if private else 0.0))
    sigma = privacy.sigma if private else 0.0
    ctx.sigma = sigma
    spec = privacy.spec
    if placement.precision.mixed and not getattr(spec.engine, "supports_precision", False):
        raise TrainingError(f"perf.dtype {placement.precision.dtype}: the {type(spec.engine).__name__} of this "
                            "recipe does not apply autocast; use perf.dtype: fp32")
    spec.engine.precision = placement.precision
    if unit.user_level and r.task.user_clipping == "group" and not getattr(spec.engine, "supports_groups", False):
        raise TrainingError(f"user-level group clipping needs privacy.engine: bookkeeping or reference "
                            f"(got {type(spec.engine).__name__}); or set task.user_clipping: per_example_over_k")
    ddp.check_methods(world, [], keep_norms=spec.keep_norms)  # DDP: no raw norms across ranks
    return RunPlan(recipe=r, run_dir=run_dir, phase=phase, private=private, progress=progress, world=world, rng=rng,
                   ledger=ledger, ledger_notes=ledger_notes, live_ledger_path=live, placement=placement, data=data,
                   model=ctx.model, loss_fn=ctx.loss_fn, train_tok=ctx.train_tok, unit=unit, total_steps=total_steps,
                   sigma=sigma, methods=methods, ctx=ctx, spec=spec,
                   params=spec.params if spec.params is not None else spec.engine.params, optimizer=spec.optimizer,
                   scheduler=build_scheduler(spec.optimizer, s, total_steps), evaluator=evaluator, sharded=sharded,
                   privacy=privacy, prefix=prefix, features=cache)


def _recipe_mechanism(r, private: bool, method_names: list[str]) -> Mechanism:
    """The recipe's mechanism, after its refusals (from the recipe alone, before any loading).

    Raises:
        TrainingError: naming the reason and the fix."""
    try:
        mechanism = mechanism_of_recipe(r)
    except PlanError as exc:
        raise PlanError(f"cannot certify this recipe: {exc}") from None
    why = mechanism.refusals(user_level=bool(r.task.user_column) and private,
                             methods=method_names if private else (), schedule=bool(r.batch.schedule))
    if why:
        raise PlanError("cannot certify this recipe: " + "; ".join(why))
    return mechanism
