"""``PrivacyEngine``: ``make_private`` / ``make_private_with_epsilon`` (Opacus-shaped)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpft.placement import world as ddp
from dpft.accounting.ledger import PrivacyLedger
from dpft.api.arguments import (PerformanceArguments, PrivacyArguments, adapt_data, check_arguments, check_optimizer,
                                user_values)
from dpft.api.clipping import api_clip_and_engine
from dpft.api.criterion import PerExampleCriterion
from dpft.api.loader import DPDataLoader, _PoissonMicroBatches
from dpft.api.optimizer import DPOptimizer
from dpft.api.sharded import ShardedDPOptimizer, ShardedMicroBatches, check_fsdp2_model, is_fsdp2_model
from dpft.api.state import LoopState, write_live_record
from dpft.grads.live import LiveBookKeeping
from dpft.placement.fsdp_methods import refusal_message
from dpft.methods.python import PythonMethods, PythonRecipe, python_methods
from dpft.privacy.randomness import Randomness
from dpft.step.guard import ReleaseGuard
from dpft.step.pipeline import DPStep
from dpft.session import PrivateSession



class PrivacyEngine:
    """DP training for a user's own PyTorch loop (Opacus-shaped; see the module docstring).

    Args:
        reproducible_seed: None (default): the randomness (Poisson sampling, noise) comes from
            a fresh secret key from the OS CSPRNG, never written anywhere. An int: reproducible
            draws for research and tests; the ε then holds only while the seed stays secret.
        hardened_noise: draw each noise coordinate as the sum of four normals / 2 (Opacus
            ``secure_mode``; ``dpft.privacy.randomness``).

    Attributes:
        ledger: the :class:`~dpft.accounting.ledger.PrivacyLedger` of every noisy update made
            through this engine (all ``make_private`` calls compose).
        noise_multiplier: σ of the last ``make_private``.
    """

    def __init__(self, *, reproducible_seed: Optional[int] = None, hardened_noise: bool = True):
        self._rng: Optional[Randomness] = None  # the session's key: made by the first make_private's world
        self._seed = reproducible_seed
        #: this process's place under torch.distributed (set by make_private; one process alone).
        self.world: Optional[ddp.World] = None
        self.reproducible = reproducible_seed is not None
        self.hardened_noise = hardened_noise
        self.ledger = PrivacyLedger()
        self.noise_multiplier: Optional[float] = None
        self._calls = 0
        self._sessions: list[LiveBookKeeping] = []
        #: (guard, DP step) of every make_private loop (step/guard.py), for :meth:`check_releases`.
        self._guards: list[tuple[ReleaseGuard, DPStep]] = []
        #: the last make_private's stateful parts (api/state.py); None before the first.
        self._loop: Optional[LoopState] = None
        #: the live release record (``<state path>.releases.json``), once a state was saved.
        self._live_path = None

    def get_epsilon(self, delta: float) -> float:
        """ε(δ) of everything this engine released (PLD accountant of ``dp-accounting``).

        Raises:
            ValueError: δ not in (0, 1).
        """
        return float(self.ledger.epsilon(delta).epsilon)

    def save_ledger(self, path) -> bool:
        """Write :attr:`ledger` as JSON to ``path`` — on rank 0 only under ``torch.distributed``
        (every rank holds the same ledger; the others write nothing and need no file system).

        Returns:
            Whether this process wrote the file.
        """
        world = self.world if self.world is not None else ddp.World()
        self.check_releases()
        if not world.is_main:
            return False
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.ledger.save(path)
        return True

    def check_releases(self) -> None:
        """Every update of the optimizers made private by this engine applied exactly one DP release
        (each loop's optimizer steps = the releases its DP step recorded in :attr:`ledger`), and no
        update ever ran without one (step/guard.py). :meth:`save_ledger` calls it first.

        Raises:
            dpft.step.guard.UpdateWithoutReleaseError: naming the violation (the ledger's ε does not
                cover the weights)."""
        for guard, step in self._guards:
            guard.check_clean("the ledger")
            guard.check_end(step.recorded)

    def save_noise_state(self, path) -> bool:
        """Write the secret state of the last ``make_private`` with a stateful mechanism
        (``mechanism="banded_mf"``) to ``path``: the last b − 1 noises, the next step, the
        examples' secret partition, a keyed fingerprint of the training rows' content, σ and the
        ledger (``torch.save``; mode 0600 from creation, written atomically). **Secret**: whoever
        holds it can subtract most of the noise from the released weights; keep it with your
        private checkpoints, never with a released model (``optimizer.state_dict()`` never holds
        it). From this call on, every release also rewrites the live release record
        ``<path>.releases.json`` (the ledger; not secret), which :meth:`load_noise_state` needs.
        Call it between logical batches, when you checkpoint the model and optimizer. Under
        ``torch.distributed`` call it on **every rank** (a collective: with an FSDP2 model each
        rank's slice of the noise buffers is gathered, api/state.py); rank 0 writes the one file.

        Returns:
            Whether this process wrote the file.

        Raises:
            ValueError: the last make_private has no secret state, or a logical batch is open."""
        return self._require_state("save_noise_state").save(self, path)

    def load_noise_state(self, path) -> None:
        """Continue a loop saved by :meth:`save_noise_state`: call it on a fresh ``PrivacyEngine``
        right after ``make_private`` with the same arguments and the same training rows in the same
        order (and after loading the model's and optimizer's checkpoint), before the first step.
        Under ``torch.distributed`` call it on every rank (a collective; with an FSDP2 model each
        rank keeps its slice, so a state saved on K ranks continues on any number).
        Restores the noise buffers, the secret partition, the step counter of the loader and
        optimizer, and appends the saved releases to the ledger. The next steps draw fresh secret
        randomness.

        Raises:
            FileNotFoundError: ``path`` is missing (a banded_mf loop cannot continue without it).
            ValueError: no secret state in this loop; steps already made; another σ, N, bands or
                number of steps; other training rows or the same rows reordered; releases made
                after the state was saved (the live record holds more), or the record missing
                (api/state.py) — each naming the fix."""
        self._require_state("load_noise_state").load(self, path)

    def _require_state(self, what: str) -> LoopState:
        if self._loop is None or not self._loop.plan.mechanism.stateful:
            raise ValueError(f"{what}: the last make_private of this engine is not mechanism='banded_mf' (only "
                             "banded matrix factorization has secret state beyond the key)")
        return self._loop

    def _on_release(self) -> None:
        """After every ledger append: the live release record, once a state was saved."""
        if self._live_path is not None:
            write_live_record(self._live_path, self.ledger, self.world)

    def detach(self) -> None:
        """Remove the hooks from every module made private by this engine."""
        for s in self._sessions:
            s.close()
            s.engine.model.__dict__.pop("_dpft_private", None)
        self._sessions.clear()

    def make_private_with_epsilon(self, *, target_epsilon: float, target_delta: float,
                                  epochs: Optional[float] = None, steps: Optional[int] = None, **kwargs):
        """Opacus' name for :meth:`make_private` with a target ε."""
        return self.make_private(target_epsilon=target_epsilon, target_delta=target_delta,
                                 epochs=epochs, steps=steps, **kwargs)

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_grad_norm: float,
        criterion: Optional[nn.Module] = None,
        data_loader: Optional[DataLoader] = None,
        dataset: Optional[Dataset] = None,
        expected_batch_size: Optional[int] = None,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        noise_multiplier: Optional[float] = None,
        clipping: str = "flat",
        head_fraction: float = 0.5,
        head_parameters: Any = None,
        max_physical_batch_size: Optional[int] = None,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        batch_first: bool = True,
        noise_generator: Any = None,
        grad_sample_mode: Any = None,
        norm_mode: str = "auto",
        num_workers: int = 0,
        collate_fn: Any = None,
        user_ids: Any = None,
        max_rows_per_user: int = 4,
        user_clipping: str = "group",
        max_batch_size: Optional[int] = None,
        mechanism: str = "gaussian",
        bands: Optional[int] = None,
        methods: Optional[list] = None,
        lr_scheduler: Any = None,
    ):
        """Make ``module``, ``optimizer``, ``criterion`` and the data private (DP-SGD / DP-Adam) on the
        private session every way in shares (dpft/session/). The manual: docs/make_private.md.

        Args:
            module, optimizer: the user's ``nn.Module`` (hooked, not wrapped; example dimension first)
                and a plain ``torch.optim.Optimizer`` over its trainable parameters.
            max_grad_norm: C > 0, the L2 bound of one unit's clipped gradient.
            criterion: a torch.nn loss ('mean'/'sum'), returned per-example; None: Opacus' 3-tuple.
            data_loader | dataset (+ expected_batch_size, collate_fn, num_workers): the rows, map-style;
                expected_batch_size: qN (units), default the loader's ``batch_size``.
            target_epsilon + target_delta (σ calibrated, PLD, after the engine's ledger) | noise_multiplier σ;
                epochs | steps: the planned length (step/plan.py ``planned_steps``).
            clipping, head_fraction, head_parameters, norm_mode: the clip style and book-keeping route.
            max_physical_batch_size: largest micro-batch (performance only); loss_reduction: 'mean' | 'sum'.
            poisson_sampling, batch_first (True only), noise_generator (refused), grad_sample_mode (ignored):
                Opacus' arguments.
            user_ids, max_rows_per_user, user_clipping: user-level DP (ids per row, or a field name).
            max_batch_size: truncated Poisson; mechanism: ``"gaussian"`` | ``"banded_mf"`` with ``bands`` b.
            methods: method plug-ins (``[{"name": ..., "method": ..., ...}]``); lr_scheduler: stepped at
                every noisy update.

        Returns:
            ``(module, optimizer, criterion, data_loader)``, or ``(module, optimizer, data_loader)``
            without a criterion (a :class:`DPOptimizer`, :class:`PerExampleCriterion`, :class:`DPDataLoader`).

        Raises:
            ValueError: anything that cannot be certified or is ambiguous (naming the fix);
                dpft.accounting.calibrate.CalibrationError: the target cannot be met;
                dpft.placement.world.DistributedError: a DDP-wrapped module, ranks that disagree, a key
                asked for in a world of another size; dpft.grads.bookkeeping.UnattributedUseError.
        """
        p = PrivacyArguments(
            max_grad_norm=max_grad_norm, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            steps=steps, noise_multiplier=noise_multiplier, clipping=clipping, head_fraction=head_fraction,
            user_ids=user_ids, max_rows_per_user=max_rows_per_user, user_clipping=user_clipping,
            max_batch_size=max_batch_size, mechanism=mechanism, bands=bands, poisson_sampling=poisson_sampling)
        perf = PerformanceArguments(max_physical_batch_size=max_physical_batch_size, norm_mode=norm_mode)
        meths = python_methods(methods, "make_private")
        mech = check_arguments(module, optimizer, p, perf, batch_first=batch_first, noise_generator=noise_generator,
                               methods=meths, lr_scheduler=lr_scheduler)  # refusals before any work (api/arguments.py)
        sharded = _check_sharded(module, meths)
        sess = PrivateSession.open(self._seed, rng=self._rng, ledger=self.ledger, made_for=self.world,
                                   where="make_private")  # the world and the engine's one key (session/world.py)
        self._rng, self.world = sess.rng, sess.world
        dataset, n, eb, loader_kwargs = adapt_data(data_loader, dataset, expected_batch_size, num_workers, collate_fn)
        s, calls = p.session_settings(mech, eb, self.hardened_noise), self._calls + 1
        names = check_optimizer(module, optimizer)
        plan = sess.plan(
            s, rows=dataset, n_rows=n, rng=sess.rng.child(f"make_private:{calls}"), optimizer=optimizer,
            users=None if user_ids is None else user_values(dataset, user_ids, n), method_list=meths,
            methods=self._methods_for(meths, module, p, eb),
            parts=lambda sampler: api_clip_and_engine(module, optimizer, p.clipping, p.max_grad_norm, p.head_fraction,
                                                      head_parameters, perf.norm_mode, p.over_k))
        self._calls, self.noise_multiplier = calls, plan.sigma
        return self._private_loop(sess, plan, s, perf, sharded, names, dataset, n, loader_kwargs, module=module,
                                  optimizer=optimizer, criterion=criterion, lr_scheduler=lr_scheduler,
                                  loss_reduction=loss_reduction)

    def _methods_for(self, meths: list, module: nn.Module, p: PrivacyArguments, expected_batch_size: int):
        """The session's factory of make_private's method plug-ins (methods/python.py) over ``module``."""
        def methods(units: int, rng: Randomness, user_level: bool) -> PythonMethods:
            recipe = PythonRecipe(max_grad_norm=p.max_grad_norm, clipping=p.clipping,
                                  expected_batch_size=expected_batch_size, hardened_noise=self.hardened_noise,
                                  methods=meths)
            return PythonMethods(meths, model=module, n=units, ledger=self.ledger, rng=rng, where="make_private",
                                 recipe=recipe, user_level=user_level)
        return methods

    def _private_loop(self, sess: PrivateSession, plan, s, perf: PerformanceArguments, sharded: bool, names: dict,
                      dataset, n: int, loader_kwargs: dict, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                      criterion: Optional[nn.Module], lr_scheduler: Any, loss_reduction: str):
        """make_private's front end over the session's plan: the micro-batches, the step for this
        world, the DP optimizer with its release guard, the live book-keeping, the data loader and
        the per-example criterion (see :meth:`make_private`)."""
        world, pm = sess.world, sess.methods
        batches = (ShardedMicroBatches if sharded else _PoissonMicroBatches)(
            plan.sampler, max(1, math.ceil(sess.n / s.expected_batch_size)), perf.max_physical_batch_size,
            sess.planned, world=world, groups=sess.user_level and s.user_clipping == "group")
        if not sharded:  # one FSDP2 model for the world: nothing to broadcast
            ddp.broadcast_module(world, module)  # DDP: the world starts from rank 0's weights
        dp_step = sess.step(plan, sharded=sharded, on_release=self._on_release)
        dp_opt = ShardedDPOptimizer(optimizer, dp_step, sess.planned, world, batches, methods=pm if pm else None) \
            if sharded else DPOptimizer(optimizer, dp_step, sess.planned, world=world, methods=pm if pm else None)
        if plan.spec.mechanism is not None:  # every step of the user's optimizer = one release of dp_step
            dp_opt.release_guard = dp_step.guard = ReleaseGuard("make_private", _GUARD_FIX)
            dp_opt.release_guard.attach(optimizer)
            self._guards.append((dp_opt.release_guard, dp_step))
        # An engine that runs its own forward (a method's, e.g. DP-SFT's subspace engine) offers the
        # view that the user's forward and backward drive.
        live = plan.engine.live_view() if hasattr(plan.engine, "live_view") else plan.engine
        session = LiveBookKeeping(live, dp_opt._on_result, loss_reduction=loss_reduction)
        dp_opt.session, dp_opt.param_names, dp_opt.lr_scheduler = session, names, lr_scheduler
        module.__dict__["_dpft_private"] = True
        self._sessions.append(session)
        loader = DPDataLoader(dataset, batches, dp_opt, **loader_kwargs)
        self._loop = LoopState(plan, dp_opt, batches, n)
        if criterion is None:
            return module, dp_opt, loader
        per_example = PerExampleCriterion(criterion)
        per_example._session = session
        return module, dp_opt, per_example, loader


def _check_sharded(module, meths) -> bool:
    """Whether ``module`` is an FSDP2 (``fully_shard``) root, which runs the sharded step
    (api/sharded.py); a sharded submodule only, or methods it cannot run, are refused.

    Raises:
        ValueError: a method that cannot run on sharded parameters (each named with its reason:
            methods/base.py ``sharded_refusal``), or what ``check_fsdp2_model`` refuses."""
    if not is_fsdp2_model(module):
        return False
    check_fsdp2_model(module, "make_private")  # banded MF runs sharded: its state is gathered (api/state.py)
    why = refusal_message("make_private", meths)  # RMT, DP-Adam-AC's adaptive clipping run sharded
    if why:
        raise ValueError(why)
    return True


#: What a make_private user whose loop trips the release guard should do instead.
_GUARD_FIX = ("Step only the optimizer make_private returned, once after the last micro-batch of each logical batch "
              "of its data loader (it clips, noises and then steps your optimizer); never call step() on the "
              "optimizer you passed in, nor change p.grad between its release and the update")
