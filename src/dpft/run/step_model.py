"""The model as ``dpft train``'s DP step runs it: readied once the methods prepared it (the world
starts from rank 0's weights; FSDP2 shards; the frozen features computed once, run/features.py),
the clip and per-example engine over it (the session's ``parts``), and the engine's fit to the
placement (autocast).

run/plan.py ``build_plan`` hands :meth:`StepModel.parts` to the private session (session/core.py);
everything here is the driver's, around the session: the session never sees the recipe's model
loading, placement or feature cache.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

from dpft.errors import TrainingError
from dpft.eval.dev import DevEvaluator
from dpft.grads.base import NonPrivateEngine
from dpft.placement import world as ddp
from dpft.placement.device import Placement
from dpft.placement.fsdp import shard_model
from dpft.run.features import FeatureCache, FeatureDevEvaluator, build_for_plan, prefix_of
from dpft.step.build import build_clip, make_engine
from dpft.step.clip import make_clip_policy

__all__ = ["StepModel"]


class StepModel:
    """The model of one ``dpft train`` run as its step runs it.

    Attributes (after :meth:`ready`):
        evaluator: dev evaluation of a model (from cached dev features when there are some).
        prefix: the model's frozen prefix (models/features.py), run in eval mode by every step; None: none.
        cache: the frozen features computed once (:class:`~dpft.run.features.FeatureCache`); None:
            the step runs the whole model.
        loss: the step's loss (over the cached features when there are some).

    Args:
        recipe, data, tokenizer, placement, world: the run's (run/load.py, run/refuse.py, session/world.py).
        methods: the recipe's active methods (a method may rule the feature cache out).
        run_dir: the run folder; reuse: a cache built earlier (a tune trial's), reused when its key matches.
        cache: features may be cached (False: rows were added, e.g. the final-model audit's canaries).
        progress: this process prints progress.
    """

    def __init__(self, recipe, data, tokenizer, placement: Placement, world, methods: list, *, run_dir: Path,
                 reuse: Optional[FeatureCache] = None, cache: bool = True, progress: bool = False):
        self.recipe, self.data, self.tokenizer, self.placement, self.world = recipe, data, tokenizer, placement, world
        self.methods, self.run_dir, self.reuse, self.may_cache, self.progress = methods, run_dir, reuse, cache, progress
        self.world_sum = functools.partial(ddp.all_sum, world)  # the evaluator's sum over ranks
        self.evaluator = DevEvaluator(data, placement, world, recipe.eval, self.world_sum)
        self.prefix: Any = None
        self.cache: Optional[FeatureCache] = None
        self.loss: Optional[Callable] = None

    def ready(self, ctx) -> None:
        """After the methods' ``prepare`` (which may wrap ``ctx.model`` and ``ctx.loss_fn``), before
        the engine and optimizer see the parameters: the world starts from rank 0's weights (DDP),
        the model is sharded (``perf.sharding: fsdp``: ``ctx.model`` becomes the FSDP2 root), and the
        frozen prefix's features are computed once where the recipe allows (run/features.py).

        Raises:
            TrainingError: ``perf.feature_cache: on`` where no cache can apply (naming why)."""
        r, w = self.recipe, self.world
        ddp.broadcast_module(w, ctx.model)
        if r.perf.sharding == "fsdp":  # shard after the broadcast, before the engine and optimizer
            ctx.model = shard_model(ctx.model, w, r.perf.dtype)
        self.prefix = prefix_of(r, ctx.model, self.methods, self.data.causal)
        if self.may_cache and (self.prefix is not None or r.perf.feature_cache == "on"):
            self.cache = build_for_plan(r, self.data, ctx.model, self.tokenizer, self.placement, w, self.methods,
                                        run_dir=self.run_dir, reuse=self.reuse, progress=self.progress)
            if self.cache is not None:
                self.prefix = self.cache.split
                self.evaluator = FeatureDevEvaluator(self.data, self.placement, w, r.eval, self.world_sum, self.cache)
        self.loss = self.cache.loss(ctx.loss_fn) if self.cache is not None else ctx.loss_fn

    def parts(self, ctx, user_level: bool) -> Callable[[Any], tuple[Any, Any]]:
        """The session's ``parts``: ``sampler -> (clip, engine)`` over ``ctx.model`` and :attr:`loss`
        (after :meth:`ready`): the recipe's clip (at user level over ``task.user_clipping``) and
        ``privacy.engine``; a non-private run's engine computes the plain mean gradient."""
        r = self.recipe

        def parts(sampler):
            if not r.privacy.enabled:
                engine = NonPrivateEngine(ctx.model, self.loss, make_clip_policy("flat", 1.0))
                return engine.clip, engine
            clip = build_clip(r.privacy, r.task.user_clipping if user_level else None, r.task.max_rows_per_user)
            return clip, make_engine(r.privacy.engine, ctx.model, self.loss, clip)

        return parts

    def fit(self, spec) -> None:
        """Set the placement's precision on the step's engine (after the methods' ``build``, which may
        swap the engine), refusing an engine that cannot honour it. (User-level group clipping on an
        engine without groups is the session's refusal, session/core.py ``PrivateSession.check_groups``.)

        Raises:
            TrainingError: mixed precision on an engine without autocast, naming the fix."""
        precision = self.placement.precision
        if precision.mixed and not getattr(spec.engine, "supports_precision", False):
            raise TrainingError(f"perf.dtype {precision.dtype}: the {type(spec.engine).__name__} of this "
                                "recipe does not apply autocast; use perf.dtype: fp32")
        spec.engine.precision = precision
