"""``PrivacyEngine``: ``make_private`` / ``make_private_with_epsilon`` (Opacus-shaped)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpft.placement import world as ddp
from dpft.accounting.ledger import PrivacyLedger
from dpft.api.arguments import adapt_data, check_arguments, check_optimizer, user_values
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
from dpft.step.plan import build_privacy_plan, planned_steps
from dpft.step.unit import build_user_unit
from dpft.session import session_world, step_for



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
        self._key_world: Optional[ddp.World] = None  # the world the key was made in
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
        """Make ``module``, ``optimizer``, ``criterion`` and the data private (DP-SGD / DP-Adam).

        Args:
            module: any ``nn.Module``; its trainable parameters are those with ``requires_grad``.
                Hooks are added to it (it is returned, not wrapped). Every hooked layer must see
                the example dimension first (``batch_first``).
            optimizer: any ``torch.optim.Optimizer`` over (a subset of) ``module``'s parameters.
            max_grad_norm: C > 0, the L2 bound of each example's clipped gradient (the
                sensitivity of the clipped sum under add/remove-one).
            criterion: a torch.nn loss with ``reduction`` 'mean', 'sum' (or 'batchmean'); its
                per-example version is returned. None: return Opacus' 3-tuple and take the
                user's loss as a batch ``loss_reduction`` of per-example losses.
            data_loader: a map-style ``DataLoader`` with the default sampler (sequential or
                shuffled); its dataset, collate function and worker settings are kept, its
                sampling replaced by Poisson sampling. Or give ``dataset`` (+
                ``expected_batch_size``, ``collate_fn``, ``num_workers``).
            expected_batch_size: qN, the expected logical batch (default: the loader's
                ``batch_size``).
            target_epsilon, target_delta: the (ε, δ) target; σ is calibrated on the events the
                run records (``dpft.accounting.calibrate.calibrate_sigma``, PLD), composed after
                what this engine's ledger already holds. Needs ``epochs`` or ``steps``.
            epochs: passes of ``N // expected batch`` logical steps each, fractional allowed
                (``1.5``: ``ceil(1.5 · N // batch)`` steps; the last pass stops early); or
                ``steps``: logical steps in all (not both).
            noise_multiplier: σ instead of a target ε (``0`` for tests; its ε is infinite).
            clipping: ``"flat"`` (Abadi et al. 2016), ``"per_layer"`` (C/√G per parameter
                tensor), ``"automatic"`` (AUTO-S, Bu et al. 2022), ``"head_body"`` (the task head
                clipped to C·√f and the rest to C·√(1−f), ``f = head_fraction``; as the CLI) or
                ``"per_group"`` (each optimizer param group clipped to C·√f_g, ``f_g`` = the
                group's ``"clip_fraction"`` key; groups without one share what is left of 1
                equally). Every style keeps one example's clipped gradient within C.
            head_fraction: f of ``head_body`` (share of C² for the head), in (0, 1).
            head_parameters: ``head_body``: the head's parameters (tensors or names); default:
                parameters whose name has a ``classifier``/``score``/``pooler``/``lm_head``
                component (``dpft.models.load.is_head_param``).
            max_physical_batch_size: largest micro-batch the loader yields (None: whole logical
                batches). A performance setting: it never changes the guarantee.
            loss_reduction: 'mean' | 'sum', used only for losses not made by the returned
                criterion (Opacus' argument).
            poisson_sampling, batch_first: Opacus' arguments; only True is accepted.
            noise_generator: refused (the randomness is the engine's secret source; use
                ``PrivacyEngine(reproducible_seed=...)``). ``grad_sample_mode``: ignored (dpft
                always uses the book-keeping engine).
            norm_mode: book-keeping norm route ``"auto"`` | ``"ghost"`` | ``"instantiate"``.
            user_ids: user-level DP (the privacy unit is a user, add/remove-one *user*): a
                sequence of one user id per dataset row (any hashable values; a tensor or array
                of ints), or the name of a field of the dataset's rows (a ``datasets.Dataset``
                column or a key of dict rows). Then, as ``dpft train``'s ``task.user_column``
                (step/unit.py, step/sample.py ``UserPoissonSampler``, grads/groups.py): every one
                of the U users joins a logical batch with q = expected batch / U (the loader's
                ``batch_size`` or ``expected_batch_size`` counts *users*), a sampled user
                contributes a fresh random subset of at most ``max_rows_per_user`` of its rows,
                a micro-batch holds whole users, and the user's summed gradient is clipped to C;
                the ledger, σ calibration, δ < 1/U, ``epochs`` (U // expected users steps) and
                the division by qU count users (Chua et al. 2024, "Mind the Privacy Unit!").
                None (default): example level.
            max_rows_per_user: k, the most rows of one sampled user per step (user level).
            user_clipping: ``"group"`` (exact: each user's summed gradient clipped to C, its
                norm from the book-keeping factors with every cross term) or
                ``"per_example_over_k"`` (each row clipped to C/k; k rows sum to ≤ C).

        Distributed (``torchrun --nproc_per_node=K``, one process per GPU or CPU slot): call
        ``make_private`` on every rank with the same arguments (after
        ``torch.distributed.init_process_group``, or without it: torchrun's environment is
        detected and the group is created, gloo on CPU and NCCL for CUDA tensors). Pass the
        *unwrapped* module — not ``DistributedDataParallel(model)`` (refused: its buckets
        all-reduce unclipped gradients). The world runs one DP-SGD, the mechanism of one process
        (``dpft.placement.world``, as ``dpft train`` under torchrun): rank 0 draws the secret key and
        broadcasts it (reproducible mode: every rank derives it from the seed); every rank draws
        the same Poisson logical batch for the world and its data loader yields only this rank's
        share (``distributed.shard``: every K-th example; at user level whole users,
        ``distributed.shard_units``), in micro-batches; each rank clips its examples (users), and
        at the last micro-batch ``optimizer.step()`` all-reduces the clipped sums once, adds the
        same noise draw on every rank (streams of the shared key) and applies the same update,
        checked at every step (``distributed.check_step_digest``: same logical batch, same
        weights, else :class:`~dpft.placement.world.DistributedError` before the step is used). The
        module's weights are rank 0's from ``make_private`` on (broadcast). Every rank holds the
        same ledger, so ``get_epsilon`` is the same everywhere; :meth:`save_ledger` writes on
        rank 0 only (make_private itself writes no file). ``optimizer.step()`` is a collective
        at the last micro-batch of each logical batch: call it after every micro-batch on every
        rank (a rank whose share of a logical batch is empty joins it when its loader moves on).
        Dropout masks come from each rank's own torch generator (not a DP mechanism): seed the
        ranks differently. A checkpoint resumed from must come from the same number of ranks.
            max_batch_size: truncated Poisson (docs/mechanisms.md): at most this many examples per
                logical batch, a uniformly random subset when more are drawn; the ledger records
                ``TruncatedSubsampledGaussianDpEvent`` and σ is calibrated on it. The batch
                shapes stay your collate function's (no padding here; ``dpft train`` pads).
            mechanism: ``"gaussian"`` (default: DP-SGD, independent noise) or ``"banded_mf"``:
                banded matrix factorization (docs/mechanisms.md; Choquette-Choo et al. 2023,
                step/correlated.py), as ``dpft train``'s ``privacy.mechanism``. Each example gets
                a secret partition in {0..b−1}; step t Poisson-samples partition t mod b at rate
                p = b·B/N; step t's noise is row t of C⁻¹Z (C b-banded Toeplitz, optimised for
                the planned steps); the ledger records PoissonSampled(p, Gaussian(σ)) at steps
                t ≡ 0 (mod b) and NoOp at the others, and σ is calibrated on those events. Needs
                ``epochs`` or ``steps``; steps must run in order (a logical batch left without
                ``optimizer.step()`` stops the run). The secret noise state ((b − 1) × the
                trainable parameters in fp32) is never in ``optimizer.state_dict()``: save it with
                :meth:`save_noise_state` (an owner-only file; never release it) and restore it
                with :meth:`load_noise_state` to continue; without it a loop cannot be resumed.
            bands: b ≥ 1 of ``banded_mf`` (default 4; b = 1 is DP-SGD).
            lr_scheduler: a ``torch.optim.lr_scheduler`` over ``optimizer``, stepped by the DP optimizer
                after every noisy update — including those of empty Poisson batches, which release
                noise without reaching your loop (so ``if optimizer.step(): scheduler.step()`` would
                leave the schedule behind). Do not call its ``step()`` yourself.
            methods: the recipe's method plug-ins, as ``dpft train``'s ``methods:`` list (``[{"name":
                "rmt", "method": "rmt", "kappa": 1.05}]``): their ``build`` changes this loop's step
                through the same plan (methods/python.py) and their ``after_update`` runs after every
                noisy update (``optimizer.method_stats``: what they released). Runs here: ``rmt``;
                ``dp_adam_ac`` with ``adaptive_clip`` (C follows a private quantile estimate: a noisy
                count released with each step, σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) on the gradient, one
                event per step for both, as ``dpft train``); ``dpsft`` with ``source: file`` (a
                saved basis; its recorded releases are appended to this ledger before σ is
                calibrated; the trainable parameters must be those the basis spans) or ``none``
                with ``paper_noise_placement``. A method that needs ``dpft train``'s driver
                (earlier phases such as a subspace estimated privately, the recipe's optimizer,
                the run folder) refuses with its reason.

        Returns:
            ``(module, optimizer, criterion, data_loader)`` (Opacus' shape with a criterion),
            or ``(module, optimizer, data_loader)`` when ``criterion`` is None. ``optimizer`` is
            a :class:`DPOptimizer`, ``criterion`` a :class:`PerExampleCriterion`,
            ``data_loader`` a :class:`DPDataLoader`.

        Raises:
            ValueError: anything that cannot be certified or is ambiguous: both or neither of
                ``data_loader``/``dataset``; an iterable dataset; a loader with a custom
                sampler or batch sampler (its population is not the dataset); both ``steps``
                and ``epochs``; both or neither of ``target_epsilon``/``noise_multiplier``; a
                target ε without δ or without a length; a criterion that cannot be made
                per-example; BatchNorm (it mixes the examples of a batch); optimizer parameters
                that are not trainable parameters of ``module``; an unknown clipping style;
                ``banded_mf`` with ``user_ids`` or ``max_batch_size`` (no certified event), with
                b < 1, with b·B > N (p > 1), without ``epochs``/``steps``, or with noise buffers
                above 16 GiB.
            dpft.accounting.calibrate.CalibrationError: the target cannot be met (δ ≥ 1/N, or
                unreachable with this q and number of steps), with the reason.
            dpft.placement.world.DistributedError: a module wrapped in ``DistributedDataParallel``
                (pass ``model.module``); a second world for an engine whose key is already in use;
                ranks with different secret randomness.
            dpft.grads.bookkeeping.UnattributedUseError: (first training micro-batch) a
                trainable parameter used outside the forward of the module that owns it.
        """
        meths = python_methods(methods, "make_private")
        mech = check_arguments(
            module=module, optimizer=optimizer, poisson_sampling=poisson_sampling, batch_first=batch_first,
            noise_generator=noise_generator, clipping=clipping, steps=steps, epochs=epochs,
            target_epsilon=target_epsilon, target_delta=target_delta, noise_multiplier=noise_multiplier,
            max_physical_batch_size=max_physical_batch_size, max_rows_per_user=max_rows_per_user,
            user_clipping=user_clipping, mechanism=mechanism, bands=bands, max_batch_size=max_batch_size,
            user_ids=user_ids, methods=meths, lr_scheduler=lr_scheduler)
        sharded = _check_sharded(module, meths)
        # an initialised group, or torchrun's environment (the group is made); the engine's key, the world's
        world, self._rng = session_world(self._seed, self._rng, made_for=self._key_world, where="make_private")
        self._key_world = world
        dataset, n, expected_batch_size, loader_kwargs = adapt_data(data_loader, dataset, expected_batch_size,
                                                                    num_workers, collate_fn)
        calls = self._calls + 1
        rng = self._rng.child(f"make_private:{calls}")
        unit = _user_unit(dataset, user_ids, n, expected_batch_size, max_rows_per_user, rng, user_clipping)
        n_units = unit.n if unit is not None else n
        _check_same_on_every_rank(world, (
            n, n_units, expected_batch_size, steps, epochs, noise_multiplier, target_epsilon, target_delta,
            float(max_grad_norm), clipping, user_clipping if unit else None, max_rows_per_user if unit else None,
            mechanism, bands, max_batch_size))
        planned = None if steps is None and epochs is None else planned_steps(n_units, expected_batch_size, steps,
                                                                                epochs)
        names = check_optimizer(module, optimizer)
        group = unit is not None and user_clipping == "group"
        # The methods over what this loop knows (methods/python.py); their earlier releases (a
        # privately built basis from a file) enter the ledger before σ is calibrated after them.
        ddp.check_methods(world, meths)
        pm = PythonMethods(meths, model=module, n=n_units, ledger=self.ledger, rng=rng, where="make_private",
                           recipe=PythonRecipe(max_grad_norm=max_grad_norm, clipping=clipping,
                                               expected_batch_size=expected_batch_size,
                                               hardened_noise=self.hardened_noise, methods=meths),
                           user_level=unit is not None)
        pm.prepare()

        def parts(sampler):  # per_example_over_k (user level): each row clipped to C/k
            return api_clip_and_engine(module, optimizer, clipping, max_grad_norm, head_fraction, head_parameters,
                                       norm_mode, sampler.k if unit is not None and not group else None)

        # DDP: rank 0 calibrates σ (on the events this loop records, after those the ledger holds).
        plan = build_privacy_plan(
            n=n_units, expected_batch_size=expected_batch_size, steps=planned or 0, mechanism=mech, rng=rng,
            parts=parts, optimizer=optimizer, noise_multiplier=None if target_epsilon is not None else noise_multiplier,
            target_epsilon=target_epsilon, delta=target_delta, prior=self.ledger.events(),
            calibrate=lambda f: ddp.on_rank0(world, f), sampler=unit.sampler if unit is not None else None,
            hardened=self.hardened_noise, rows=dataset, hooks=pm.hooks, on_sigma=pm.on_sigma)
        plan.spec.engine.clip = plan.spec.clip  # the spec's clip is in force (a method may swap it; as DPStep.run)
        self._calls = calls
        batches = (ShardedMicroBatches if sharded else _PoissonMicroBatches)(
            plan.sampler, max(1, math.ceil(n_units / expected_batch_size)), max_physical_batch_size, planned,
            world=world, groups=group)
        if not sharded:  # one FSDP2 model for the world: nothing to broadcast
            ddp.broadcast_module(world, module)  # DDP: the world starts from rank 0's weights
        dp_step = step_for(plan, world, self.ledger, n_units, sharded=sharded, on_release=self._on_release)
        dp_opt = ShardedDPOptimizer(optimizer, dp_step, planned, world, batches, methods=pm if pm else None) \
            if sharded else DPOptimizer(optimizer, dp_step, planned, world=world, methods=pm if pm else None)
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
        self.world, self.noise_multiplier = world, plan.sigma
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


def _user_unit(dataset, user_ids, n: int, expected_batch_size: int, max_rows_per_user, rng, user_clipping):
    """The user-level privacy unit (``user_ids`` given) or None (example level).

    Raises:
        ValueError: what ``build_user_unit`` refuses, prefixed with the user column."""
    if user_ids is None:
        return None
    values, column = user_values(dataset, user_ids, n)
    try:
        return build_user_unit(values, expected_batch_size, max_rows_per_user, rng, user_clipping, column)
    except ValueError as exc:
        raise ValueError(f"make_private (user level, user_ids={column!r}): {exc}") from None


def _check_same_on_every_rank(world, mine: tuple) -> None:
    """Under torch.distributed every rank must describe the same mechanism over the same data.

    Raises:
        DistributedError: a rank's (N, users, B, steps/epochs, σ or target, C, clipping, mechanism)
            differs from rank 0's."""
    if world.distributed and ddp.any_rank(world, mine != ddp.broadcast_object(world, mine)):
        raise ddp.DistributedError(
            "make_private: the ranks passed different datasets or privacy arguments (N rows, N users, batch size, "
            "steps/epochs, σ or target, C, clipping); call make_private with the same data and arguments on every "
            "rank")


#: What a make_private user whose loop trips the release guard should do instead.
_GUARD_FIX = ("Step only the optimizer make_private returned, once after the last micro-batch of each logical batch "
              "of its data loader (it clips, noises and then steps your optimizer); never call step() on the "
              "optimizer you passed in, nor change p.grad between its release and the update")
