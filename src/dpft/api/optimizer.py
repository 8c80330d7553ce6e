"""``DPOptimizer``: wraps the user's optimizer; accumulates clipped sums over micro-batches and
runs the DP step once per logical batch."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Optional

import torch

from dpft.placement import world as ddp
from dpft.api.guards import UnclippedParameterError
from dpft.grads.live import FrozenAfterPrivateError, LiveBookKeeping
from dpft.step.aggregate import Aggregator
from dpft.step.clip import NonFiniteGradientError
from dpft.step.pipeline import DPStep, StepOutput


class DPOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; ``step()`` applies one noisy update per logical batch.

    ``param_groups``, ``state``, ``defaults``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` are the wrapped optimizer's (an LR scheduler built on either works).

    Attributes:
        original_optimizer: the user's optimizer.
        is_last_micro_batch: the current micro-batch ends its logical batch (``step()`` will
            apply the noisy update).
        logical_steps: noisy updates applied so far (= ledger events of this ``make_private``).
        last_step: the :class:`~dpft.step.StepOutput` of the last noisy update (its ``private``
            dict holds un-noised statistics that are not covered by the guarantee).
        noise_multiplier: σ; ``max_grad_norm``: C in force for the next step (a method such as
            DP-Adam-AC's adaptive clipping moves it after every update).
        methods: the loop's method plug-ins (methods/python.py ``PythonMethods``) or None; their
            ``after_update`` runs after every noisy update is applied, and ``method_stats`` holds
            what they released at the last one (privatised statistics only, e.g. the C used and
            the privatised clip rate).
        world: the ``torch.distributed`` world (:class:`dpft.placement.world.World`; one process
            alone): under it, each rank's clipped sum is all-reduced once per logical batch
            before the noise (the same draw on every rank) and the ranks' logical batch and
            weights are compared after every noisy update (``distributed.check_step_digest``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dp_step: DPStep, planned_steps: Optional[int],
                 world: Optional["ddp.World"] = None, methods=None):
        # Not Optimizer.__init__: the parameters and their state stay the wrapped optimizer's.
        self.original_optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.dp_step = dp_step
        self.planned_steps = planned_steps
        self.session: Optional[LiveBookKeeping] = None
        self.noise_multiplier = dp_step.spec.mechanism.sigma if dp_step.spec.mechanism else 0.0
        self.methods = methods
        self.method_stats: dict = {}
        self.current_step: Optional[int] = None
        self.is_last_micro_batch = False
        self.logical_steps = 0
        self.last_step: Optional[StepOutput] = None
        self._agg: Optional[Aggregator] = None
        self._agg_step: Optional[int] = None
        self._released_upto = -1
        #: an LR scheduler stepped once per release, empty Poisson batches included (make_private's
        #: ``lr_scheduler``): a release is a step for the schedule, and an empty batch never
        #: reaches the user's loop.
        self.lr_scheduler = None
        self._warned: set[str] = set()
        #: the :class:`~dpft.step.guard.ReleaseGuard` on ``optimizer`` (set by make_private; None for a
        #: non-private step): each of its steps must apply one release of ``dp_step``.
        self.release_guard = None
        self._engine_ids = {id(p) for p in dp_step.params.values()}
        #: id → name of the module's parameters (for error messages); set by make_private.
        self.param_names: dict[int, str] = {}
        self.world = world if world is not None else ddp.World()
        #: the world's logical batch of each step not yet released (the per-step digest).
        self._batches: dict[int, torch.Tensor] = {}
        #: a non-finite loss/norm on this rank in the open logical batch (DDP: told to every rank
        #: in the all-reduce, so that no rank releases the step).
        self._failed: Optional[NonFiniteGradientError] = None

    # -- the wrapped optimizer's state ---------------------------------------------------
    @property
    def param_groups(self):  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise RuntimeError(
            "make_private: parameter groups cannot be added after make_private (their gradients "
            "would not be clipped); build the optimizer with every group before")

    @property
    def max_grad_norm(self) -> float:
        """C of the next noisy update (the clip policy in force)."""
        return self.dp_step.spec.clip.max_norm

    def __repr__(self) -> str:
        return (f"DPOptimizer(σ={self.noise_multiplier:.4g}, C={self.max_grad_norm:g}, "
                f"{self.original_optimizer!r})")

    # -- the DP protocol -----------------------------------------------------------------
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def _on_result(self, res) -> None:
        """A micro-batch's clipped sum (from the module's hooks)."""
        if self._agg is None or self._agg_step is None or self._agg_step <= self._released_upto:
            self._warn_once(
                "stale",
                "make_private: a clipped gradient arrived after its logical batch was applied (or "
                "outside a micro-batch of the data loader) and was dropped")
            return
        self._agg.add(res)

    def _discard_unreleased(self) -> None:
        if self._agg is not None and self._agg_step is not None and self._agg_step > self._released_upto:
            if self._agg.batch_size > 0:
                self._warn_once(
                    "discard",
                    f"make_private: logical batch {self._agg_step} ended without optimizer.step() "
                    "after its last micro-batch; its gradients were discarded (nothing released)")
        self._agg, self._agg_step = None, None

    def _flush(self) -> None:
        """Reduce the open micro-batch. Under DDP a non-finite loss or norm is kept until the
        step's all-reduce (every rank must hear of it there, or the others would wait)."""
        if self.session is None:
            return
        if not self.world.distributed:
            self.session.flush()
            return
        try:
            self.session.flush()
        except NonFiniteGradientError as exc:
            self._failed = exc

    def _begin_micro_batch(self, step: int, size: int, last: bool, groups: Optional[torch.Tensor] = None,
                           batch: Optional[torch.Tensor] = None) -> None:
        self._flush()
        if step != self._agg_step:
            self._discard_unreleased()
            self._agg = self._new_aggregator()
            self._agg_step = step
        if batch is not None:
            self._batches[step] = batch
        self.current_step = step
        self.is_last_micro_batch = last
        if self.session is not None:
            self.session.begin_micro_batch(size, groups)

    def _end_of_epoch(self) -> None:
        self._flush()
        if self.session is not None:
            self.session.begin_micro_batch(None)
        self._discard_unreleased()
        self.current_step = None
        self.is_last_micro_batch = False

    def _release_empty(self, step: int, batch: Optional[torch.Tensor] = None) -> None:
        """An empty Poisson batch (or, under DDP, an empty share of this rank): its noisy update
        is still released (pure noise; under DDP this rank joins the world's all-reduce)."""
        self._flush()
        if self.session is not None:
            self.session.begin_micro_batch(None)
        self._discard_unreleased()
        self.current_step = None
        if batch is not None:
            self._batches[step] = batch
        self._release(step, self._new_aggregator())

    def check_unclipped_grads(self) -> None:
        """Refuse optimizer parameters outside the DP engine that hold a gradient.

        The engine clips and noises the parameters that were trainable at ``make_private``; a
        parameter the optimizer holds but the engine does not (frozen then, unfrozen since) gets
        its raw batch gradient from the user's backward, which the optimizer would apply with no
        clipping and no noise.

        Raises:
            UnclippedParameterError: naming the parameters and the fix.
        """
        bad = [self.param_names.get(id(p), f"<tensor {tuple(p.shape)}>")
               for g in self.original_optimizer.param_groups for p in g["params"]
               if id(p) not in self._engine_ids and p.grad is not None]
        if bad:
            raise UnclippedParameterError(
                f"make_private: the optimizer parameter(s) {bad[:5]} have a gradient but are not clipped or "
                "noised by the DP engine (they were frozen when make_private ran); the optimizer would apply "
                "their raw gradient. Call make_private after setting requires_grad, or pass only the "
                "trainable parameters to the optimizer. Nothing was released")

    # -- what a sharded step (api/sharded.py, FSDP2) changes ---------------------------------
    def _new_aggregator(self) -> Aggregator:
        """The accumulator of one logical batch's clipped sums: one buffer per parameter the
        engine sums (DP-SFT's subspace engine: its k coordinates)."""
        return Aggregator(self.dp_step.spec.engine.params)

    def _reduce_world(self, agg: Aggregator) -> None:
        """One all-reduce of the clipped sums per logical batch, then the noise once for the
        world: every rank draws the same N(0, σ²C²I) from the shared key (distributed.py)."""
        failed, self._failed = self._failed, None
        if agg.all_reduce(self.world.group, failed=failed is not None):
            raise failed or NonFiniteGradientError(
                "non-finite training loss on another rank; lower the learning rate or check the data "
                "(nothing was released for this logical batch)")

    def _digest_params(self) -> dict:
        """The weights the per-step digest compares across ranks."""
        return self.dp_step.params

    def _release(self, step: int, agg: Aggregator) -> StepOutput:
        if step <= self._released_upto:  # never two releases with one noise stream
            raise RuntimeError(f"logical step {step} was already released")
        self.check_unclipped_grads()
        self._released_upto = step
        batch = self._batches.pop(step, None)
        for old in [t for t in self._batches if t < step]:
            del self._batches[old]
        if self.world.distributed:
            self._reduce_world(agg)
        out = self.dp_step.release_and_update(step, agg)
        # Same logical batch (in the order it was sharded) and same weights on every rank, or stop.
        ddp.check_step_digest(self.world, step, batch if batch is not None else torch.zeros(0, dtype=torch.long),
                              self._digest_params())
        self.logical_steps += 1
        self.last_step = out
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self.methods is not None:  # after the update is applied (dpft train: after its scheduler too)
            self.method_stats = self.methods.after_update(out)
        if self.planned_steps is not None and self.logical_steps > self.planned_steps:
            self._warn_once("budget", f"make_private: more than the {self.planned_steps} planned "
                                      "logical steps were applied; ε now exceeds the target")
        return out

    def step(self, closure=None) -> bool:  # type: ignore[override]
        """Add this micro-batch's clipped gradients; after the last micro-batch of a logical
        batch, apply the noisy update (noise once per logical batch).

        Returns:
            True when the noisy update was applied (the parameters changed), False when the
            micro-batch was only accumulated.

        Raises:
            ValueError: a closure (closure-based optimizers re-evaluate the loss several times,
                which per-example clipping cannot account for).
            RuntimeError: no micro-batch of the private data loader is open.
            UnclippedParameterError: an optimizer parameter outside the engine has a gradient
                (frozen at ``make_private``, unfrozen since).
            dpft.step.clip.NonFiniteGradientError: a non-finite loss or gradient norm (nothing
                is released for this logical batch).
        """
        if closure is not None:
            raise ValueError("make_private: optimizer.step(closure) is not supported")
        self._flush()
        self.check_unclipped_grads()
        frozen = [self.param_names.get(id(p), n) for n, p in self.dp_step.params.items() if not p.requires_grad]
        if frozen:  # frozen by the user since make_private (the engine's own freezes are undone by the flush)
            raise FrozenAfterPrivateError(frozen)
        if self.current_step is None:
            raise RuntimeError(
                "make_private: optimizer.step() outside a micro-batch of the data loader that "
                "make_private returned")
        if self.current_step <= self._released_upto:
            self._warn_once("twice", "make_private: optimizer.step() called again after the noisy "
                                     "update of this logical batch; ignored")
            return False
        if not self.is_last_micro_batch:
            return False
        assert self._agg is not None
        self._release(self.current_step, self._agg)
        self._agg = None
        return True
