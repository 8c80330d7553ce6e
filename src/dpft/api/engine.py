"""``PrivacyEngine``: ``make_private`` / ``make_private_with_epsilon`` (Opacus-shaped)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from dpft import distributed as ddp
from dpft.accounting.ledger import PrivacyLedger
from dpft.api.clipping import CLIPPING_STYLES, GroupClip, _group_clip, _head_mask
from dpft.api.criterion import PerExampleCriterion
from dpft.api.loader import DPDataLoader, _PoissonMicroBatches
from dpft.api.optimizer import DPOptimizer
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.groups import PerExampleOverK
from dpft.grads.live import LiveBookKeeping
from dpft.privacy.randomness import Randomness
from dpft.step.build import build_step_spec, resolve_sigma
from dpft.step.clip import make_clip_policy
from dpft.step.pipeline import DPStep
from dpft.step.sample import PoissonSampler
from dpft.step.unit import build_user_unit
from dpft.step.correlated import CyclicPoissonSampler
from dpft.step.mechanisms import make_banded_mechanism, sampler_phase_event
from dpft.step.truncated import TruncatedPoissonSampler


def _not_called(forward, batch):  # pragma: no cover - the user's loop computes the loss
    raise RuntimeError("make_private drives the book-keeping engine from the user's loop")


_LOADER_KEYS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                "multiprocessing_context", "persistent_workers", "pin_memory_device")


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
        self._rng = Randomness(reproducible_seed)
        self._seed = reproducible_seed
        self._shared = False  # the key is the world's (torch.distributed: rank 0's, broadcast)
        #: this process's place under torch.distributed (set by make_private; one process alone).
        self.world: Optional[ddp.World] = None
        self.reproducible = reproducible_seed is not None
        self.hardened_noise = hardened_noise
        self.ledger = PrivacyLedger()
        self.noise_multiplier: Optional[float] = None
        self._calls = 0
        self._sessions: list[LiveBookKeeping] = []
        #: the last make_private's banded-MF loop (mechanism, optimizer, batches, σ, N); None otherwise.
        self._banded: Optional[dict] = None

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
        if not world.is_main:
            return False
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.ledger.save(path)
        return True

    def save_noise_state(self, path) -> bool:
        """Write the secret state of the last ``make_private(mechanism="banded_mf")`` to ``path``:
        the last b − 1 noises, the next step, the examples' secret partition, σ and the ledger
        (``torch.save``; mode 0600 from creation, written atomically). **Secret**: whoever holds it
        can subtract most of the noise from the released weights; keep it with your private
        checkpoints, never with a released model (``optimizer.state_dict()`` never holds it).
        Call it between logical batches, when you checkpoint the model and optimizer. Under
        ``torch.distributed`` rank 0 writes (the state is the same on every rank).

        Returns:
            Whether this process wrote the file.

        Raises:
            ValueError: the last make_private was not banded_mf, or a logical batch is open."""
        loop = self._require_banded("save_noise_state")
        opt, mech = loop["optimizer"], loop["mechanism"]
        if opt._agg is not None and opt._agg_step is not None and opt._agg_step > opt._released_upto:
            raise ValueError("save_noise_state: a logical batch is open (call it after optimizer.step() of its last "
                             "micro-batch)")
        world = self.world if self.world is not None else ddp.World()
        if not world.is_main:
            return False
        from pathlib import Path

        from dpft.step.correlated import write_secret

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_secret(path, {"format": "dpft-make_private-banded-noise-state", **mech.state(), "sigma": loop["sigma"],
                            "n": loop["n"], "ledger": self.ledger.to_json()})
        return True

    def load_noise_state(self, path) -> None:
        """Continue a banded_mf loop saved by :meth:`save_noise_state`: call it on a fresh
        ``PrivacyEngine`` right after ``make_private`` with the same arguments (and after loading
        the model's and optimizer's checkpoint), before the first step. Restores the noise
        buffers, the secret partition, the step counter of the loader and optimizer, and the
        ledger (it continues: the saved releases stay in it). The next steps draw fresh secret
        randomness. Resuming from a state older than the last release (a crash between two
        saves) would replay batches under new noise, which the accounting does not cover: save
        the state whenever you checkpoint, and resume from the matching pair.

        Raises:
            FileNotFoundError: ``path`` is missing (a banded_mf loop cannot continue without it).
            ValueError: not a banded_mf make_private, steps already made, or another σ, N,
                bands or number of steps."""
        loop = self._require_banded("load_noise_state")
        mech, opt, batches = loop["mechanism"], loop["optimizer"], loop["batches"]
        if mech.next_step != 0 or opt.logical_steps != 0 or batches.next_step != 0:
            raise ValueError("load_noise_state: this loop already made steps; call it right after make_private")
        from pathlib import Path

        def read():
            if not Path(path).is_file():
                raise FileNotFoundError(f"load_noise_state: {path} (the secret noise state of a banded_mf loop) is "
                                        "missing; the correlated noise cannot continue without it — start a new "
                                        "loop instead (its ledger composes with the old one)")
            return torch.load(path, weights_only=True, map_location="cpu")

        world = self.world if self.world is not None else ddp.World()
        st = ddp.on_rank0(world, read)
        if st.get("format") != "dpft-make_private-banded-noise-state":
            raise ValueError(f"load_noise_state: {path} is not a make_private banded_mf noise state")
        if int(st["n"]) != loop["n"] or not math.isclose(float(st["sigma"]), loop["sigma"], rel_tol=1e-9,
                                                           abs_tol=1e-12):
            raise ValueError(f"load_noise_state: the state was saved with N = {st['n']}, σ = {st['sigma']:.6g}; this "
                             f"loop has N = {loop['n']}, σ = {loop['sigma']:.6g}. Call make_private with the same "
                             "arguments on a fresh PrivacyEngine")
        try:
            mech.load_state(st, dict(opt.dp_step.params))
        except ValueError as exc:
            raise ValueError(f"load_noise_state: {exc}") from None
        k = mech.next_step
        saved = PrivacyLedger.from_json(st["ledger"])
        self.ledger.entries = list(saved.entries)
        if not saved.certified:
            self.ledger.mark_not_certified(saved.not_certified_reason or "marked not certified")
        self.ledger._cache.clear()
        batches.next_step = k
        opt._released_upto = k - 1
        opt.logical_steps = k

    def _require_banded(self, what: str) -> dict:
        if self._banded is None:
            raise ValueError(f"{what}: the last make_private of this engine is not mechanism='banded_mf' (only "
                             "banded matrix factorization has secret state beyond the key)")
        return self._banded

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
        (``dpft.distributed``, as ``dpft train`` under torchrun): rank 0 draws the secret key and
        broadcasts it (reproducible mode: every rank derives it from the seed); every rank draws
        the same Poisson logical batch for the world and its data loader yields only this rank's
        share (``distributed.shard``: every K-th example; at user level whole users,
        ``distributed.shard_units``), in micro-batches; each rank clips its examples (users), and
        at the last micro-batch ``optimizer.step()`` all-reduces the clipped sums once, adds the
        same noise draw on every rank (streams of the shared key) and applies the same update,
        checked at every step (``distributed.check_step_digest``: same logical batch, same
        weights, else :class:`~dpft.distributed.DistributedError` before the step is used). The
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
            dpft.distributed.DistributedError: a module wrapped in ``DistributedDataParallel``
                (pass ``model.module``); a second world for an engine whose key is already in use;
                ranks with different secret randomness.
            dpft.grads.bookkeeping.UnattributedUseError: (first training micro-batch) a
                trainable parameter used outside the forward of the module that owns it.
        """
        # ---------------------------------------------------------------- what is refused
        if not isinstance(module, nn.Module):
            raise ValueError(f"make_private: module must be an nn.Module, got {type(module).__name__}")
        if isinstance(optimizer, DPOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("make_private: optimizer must be a plain torch.optim.Optimizer (not yet private)")
        if module.__dict__.get("_dpft_private"):
            raise ValueError("make_private: this module is already private (PrivacyEngine.detach() first)")
        if not poisson_sampling:
            raise ValueError("make_private: poisson_sampling=False is refused: the accountant assumes "
                             "Poisson sampling (PoissonSampledDpEvent), and shuffled fixed-size batches "
                             "would not be what is certified")
        if not batch_first:
            raise ValueError("make_private: batch_first=False is not supported; put the example "
                             "dimension first")
        if noise_generator is not None:
            raise ValueError("make_private: noise_generator is refused; the noise comes from the "
                             "engine's secret randomness (PrivacyEngine(reproducible_seed=...) for tests)")
        if clipping not in CLIPPING_STYLES:
            raise ValueError(f"make_private: clipping must be one of {CLIPPING_STYLES}, got {clipping!r}")
        if steps is not None and epochs is not None:
            raise ValueError("make_private: give epochs or steps, not both")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"make_private: steps must be a positive integer, got {steps!r}")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                                   or not (epochs > 0 and math.isfinite(epochs))):
            raise ValueError(f"make_private: epochs must be a positive number (1.5 allowed), got {epochs!r}")
        if (target_epsilon is None) == (noise_multiplier is None):
            raise ValueError("make_private: give exactly one of target_epsilon (with target_delta and "
                             "epochs or steps) and noise_multiplier")
        if target_epsilon is not None:
            if target_delta is None:
                raise ValueError("make_private: target_epsilon needs target_delta")
            if steps is None and epochs is None:
                raise ValueError("make_private: target_epsilon needs epochs or steps (σ is calibrated "
                                 "for that number of noisy steps)")
        if noise_multiplier is not None and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"make_private: noise_multiplier must be finite and ≥ 0, got {noise_multiplier}")
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise ValueError("make_private: max_physical_batch_size must be ≥ 1")
        ddp.refuse_ddp_wrapper(module, "make_private")
        if max_rows_per_user is not None and (isinstance(max_rows_per_user, bool) or int(max_rows_per_user) < 1):
            raise ValueError(f"make_private: max_rows_per_user must be ≥ 1, got {max_rows_per_user!r}")
        if user_clipping not in ("group", "per_example_over_k"):
            raise ValueError(f"make_private: user_clipping must be 'group' or 'per_example_over_k', got "
                             f"{user_clipping!r}")
        if mechanism not in ("gaussian", "banded_mf"):
            raise ValueError(f"make_private: mechanism must be 'gaussian' or 'banded_mf', got {mechanism!r}")
        banded = mechanism == "banded_mf"
        if banded:
            bands = 4 if bands is None else bands
            if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
                raise ValueError(f"make_private: bands must be an integer ≥ 1, got {bands!r}")
            if user_ids is not None:
                raise ValueError("make_private: mechanism='banded_mf' is for example-level DP; user-level privacy "
                                 "(user_ids=) with banded noise has no certified accounting here; drop user_ids or "
                                 "use mechanism='gaussian'")
            if max_batch_size is not None:
                raise ValueError("make_private: banded_mf with truncated Poisson (max_batch_size) has no "
                                 "dp-accounting event; drop max_batch_size or use mechanism='gaussian'")
            if steps is None and epochs is None:
                raise ValueError("make_private: mechanism='banded_mf' needs epochs or steps (its coefficients are "
                                 "optimised for that number of steps)")
        elif bands is not None:
            raise ValueError("make_private: bands is the b of mechanism='banded_mf'; set mechanism='banded_mf' "
                             "or drop bands")
        # torch.distributed: an initialised group, or torchrun's environment (the group is made).
        world = ddp.init_from_env()
        bn = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if bn:
            raise ValueError(f"make_private: BatchNorm mixes the examples of a batch, so per-example "
                             f"gradients are not per example: {bn[:3]}; use LayerNorm or GroupNorm")

        per_example_criterion = None if criterion is None else PerExampleCriterion(criterion)

        # ---------------------------------------------------------------- data
        if (data_loader is None) == (dataset is None):
            raise ValueError("make_private: give exactly one of data_loader and dataset")
        loader_kwargs: dict[str, Any] = {}
        if data_loader is not None:
            if isinstance(data_loader, DPDataLoader):
                raise ValueError("make_private: this data loader is already private")
            dataset = data_loader.dataset
            if not (type(data_loader.batch_sampler) is BatchSampler
                    and type(data_loader.sampler) in (SequentialSampler, RandomSampler)):
                raise ValueError(
                    f"make_private: the data loader's sampler ({type(data_loader.sampler).__name__}, "
                    f"batch sampler {type(data_loader.batch_sampler).__name__}) cannot be replaced "
                    "by Poisson sampling over the whole dataset without changing who is sampled; "
                    "pass dataset=<the examples to train on> and expected_batch_size=...")
            if expected_batch_size is None:
                expected_batch_size = data_loader.batch_size
            for k in _LOADER_KEYS:
                if hasattr(data_loader, k):
                    loader_kwargs[k] = getattr(data_loader, k)
            if loader_kwargs.get("num_workers", 0) > 0:
                loader_kwargs["prefetch_factor"] = data_loader.prefetch_factor
            else:
                loader_kwargs.pop("persistent_workers", None)
        else:
            loader_kwargs["num_workers"] = num_workers
            if collate_fn is not None:
                loader_kwargs["collate_fn"] = collate_fn
        if isinstance(dataset, IterableDataset):
            raise ValueError("make_private: an IterableDataset cannot be Poisson-sampled (N and "
                             "random access are needed); use a map-style dataset")
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError("make_private: the dataset has no len(); N is needed for q = batch / N") from None
        if expected_batch_size is None:
            raise ValueError("make_private: expected_batch_size is needed (the loader has no batch_size)")
        expected_batch_size = int(expected_batch_size)
        if not 1 <= expected_batch_size <= n:
            raise ValueError(f"make_private: expected batch size {expected_batch_size} must be between 1 "
                             f"and N = {n}")
        # ---------------------------------------------------------------- the privacy unit
        calls = self._calls + 1
        if world.distributed and not self._shared:
            if self._calls:
                raise ddp.DistributedError("make_private: this PrivacyEngine already made a private loop in "
                                           "one process; make a new PrivacyEngine under torch.distributed")
            # One key for the world: rank 0's, broadcast (reproducible: derived from the seed).
            self._rng = ddp.shared_randomness(world, self._seed)
            self._shared = True
        ddp.check_same_randomness(world, self._rng)
        rng = self._rng.child(f"make_private:{calls}")
        unit = None
        if user_ids is not None:
            if max_batch_size is not None:
                raise ValueError("make_private: max_batch_size (truncated Poisson) is for example-level DP; at user "
                                 "level (user_ids=) the batch is bounded by max_rows_per_user per sampled user")
            values, column = _user_values(dataset, user_ids, n)
            try:
                unit = build_user_unit(values, expected_batch_size, max_rows_per_user, rng, user_clipping, column)
            except ValueError as exc:
                raise ValueError(f"make_private (user level, user_ids={column!r}): {exc}") from None
            sampler: Any = unit.sampler
            n_units = unit.n
        else:
            if banded:  # b-min-separated cyclic Poisson (step/correlated.py)
                try:
                    sampler = CyclicPoissonSampler(n, expected_batch_size, rng, bands)
                except ValueError:
                    raise ValueError(f"make_private: banded_mf with bands = {bands} samples each of {bands} "
                                     f"partitions of N = {n} examples at rate p = b·B/N = "
                                     f"{bands * expected_batch_size / n:.3g} > 1; lower bands or expected_batch_size"
                                     ) from None
            else:
                sampler = (PoissonSampler(n, expected_batch_size, rng) if max_batch_size is None
                           else TruncatedPoissonSampler(n, expected_batch_size, rng, max_batch_size))
            n_units = n
        q = sampler.q
        steps_per_epoch = max(1, n_units // expected_batch_size)
        if world.distributed:  # every rank must describe the same mechanism over the same data
            mine = (n, n_units, expected_batch_size, steps, epochs, noise_multiplier, target_epsilon, target_delta,
                    float(max_grad_norm), clipping, user_clipping if unit else None, max_rows_per_user if unit else None,
                    mechanism, bands, max_batch_size)
            if ddp.any_rank(world, mine != ddp.broadcast_object(world, mine)):
                raise ddp.DistributedError(
                    "make_private: the ranks passed different datasets or privacy arguments (N rows, N users, "
                    "batch size, steps/epochs, σ or target, C, clipping); call make_private with the same data and "
                    "arguments on every rank")
        planned = steps if steps is not None else (
            max(1, math.ceil(epochs * steps_per_epoch - 1e-9)) if epochs is not None else None)

        # ---------------------------------------------------------------- optimizer params
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        all_params = {id(p) for p in module.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in all_params:
                    raise ValueError("make_private: the optimizer holds parameters that are not "
                                     "parameters of module; their gradients would not be private")
        if not trainable:
            raise ValueError("make_private: module has no trainable parameter (requires_grad)")
        names = {id(p): n for n, p in module.named_parameters()}
        held_frozen = [names[id(p)] for g in optimizer.param_groups for p in g["params"]
                       if id(p) not in trainable]
        if held_frozen:
            # Harmless while frozen (no gradient, the optimizer skips them); unfrozen later, their
            # raw gradient would be applied, which DPOptimizer.step() refuses.
            warnings.warn(
                f"make_private: the optimizer holds {len(held_frozen)} frozen parameter(s) "
                f"({', '.join(held_frozen[:3])}{', ...' if len(held_frozen) > 3 else ''}) that the DP "
                "engine does not clip; they must stay frozen (optimizer.step() refuses them with a "
                "gradient). To train them, set requires_grad before make_private", stacklevel=3)

        # ---------------------------------------------------------------- noise
        # The same builders as `dpft train`'s plan (step/build.py): σ explicit, or calibrated on the
        # events this loop will record after those the ledger already holds; δ < 1/N checked.
        # DDP: rank 0 calibrates, every rank gets its σ (one value for the world).
        # max_batch_size: truncated Poisson (step/truncated.py), accounted and calibrated on
        # TruncatedSubsampledGaussianDpEvent (issue 28; shapes stay the user's collate's).
        # mechanism='banded_mf': ⌈n/b⌉ × PoissonSampled(p, Gaussian(σ)) (the CLI's helper).
        sigma = resolve_sigma(noise_multiplier=None if target_epsilon is not None else noise_multiplier,
                              target_epsilon=target_epsilon, delta=target_delta, q=q, steps=planned, n=n_units,
                              prior=self.ledger.events(), calibrate=lambda f: ddp.on_rank0(world, f),
                              phase_event=sampler_phase_event(sampler, n, q, planned))

        # ---------------------------------------------------------------- the DP step
        self._calls = calls
        ddp.broadcast_module(world, module)  # DDP: the world starts from rank 0's weights
        # per_example_over_k (user level): each row clipped to C/k, a user's ≤ k rows sum to ≤ C.
        over_k = unit is not None and user_clipping == "per_example_over_k"
        c_row = max_grad_norm / sampler.k if over_k else max_grad_norm
        clip = (make_clip_policy(clipping, c_row, head_fraction=head_fraction)
                if clipping != "per_group" else GroupClip(c_row, [0], [1.0]))
        engine = BookKeepingEngine(module, _not_called, clip, norm_mode=norm_mode)
        if clipping == "head_body":
            clip.set_head_mask(_head_mask(engine.params, head_parameters))
        elif clipping == "per_group":
            clip = _group_clip(c_row, engine.params, optimizer)
        if over_k:
            clip = PerExampleOverK(clip, sampler.k)
        engine.clip = clip
        spec = build_step_spec(engine=engine, clip=clip, sigma=sigma, rng=rng, sampler=sampler, optimizer=optimizer,
                               hardened=self.hardened_noise)
        if max_batch_size is not None:
            spec.mechanism.truncation = (n, int(max_batch_size))
        if banded:  # noise C⁻¹Z from the shared key: identical buffers on every rank under DDP
            spec = spec.replace(mechanism=make_banded_mechanism(engine.params, sigma, clip.sensitivity, rng, sampler,
                                                                planned, hardened=self.hardened_noise))
        dp_step = DPStep(spec, self.ledger, n_units, world_group=world.group)
        dp_opt = DPOptimizer(optimizer, dp_step, planned, world=world)
        session = LiveBookKeeping(engine, dp_opt._on_result, loss_reduction=loss_reduction)
        dp_opt.session = session
        dp_opt.param_names = names
        module.__dict__["_dpft_private"] = True
        self._sessions.append(session)
        self.world = world
        batches = _PoissonMicroBatches(sampler, steps_per_epoch, max_physical_batch_size, planned, world=world,
                                       groups=unit is not None and user_clipping == "group")
        loader = DPDataLoader(dataset, batches, dp_opt, **loader_kwargs)
        self.noise_multiplier = sigma
        self._banded = (dict(mechanism=spec.mechanism, optimizer=dp_opt, batches=batches, sigma=sigma, n=n)
                        if banded else None)
        if per_example_criterion is None:
            return module, dp_opt, loader
        per_example_criterion._session = session
        return module, dp_opt, per_example_criterion, loader


def _user_values(dataset, user_ids: Any, n: int) -> tuple[list, str]:
    """One user id per dataset row, as plain hashable values, and how they were named.

    ``user_ids``: a field name (``datasets.Dataset`` column, or key of dict rows) or a sequence
    aligned with the dataset (tensor/array elements become Python numbers: a 0-d tensor hashes
    by identity and would make every row its own user).

    Raises:
        ValueError: a field the rows lack, a sequence of the wrong length, a multi-element id.
    """
    column = "user_ids"
    if isinstance(user_ids, str):
        column = user_ids
        cols = getattr(dataset, "column_names", None)
        if cols is not None:
            if user_ids not in cols:
                raise ValueError(f"make_private: user_ids={user_ids!r} is not a column of the dataset ({cols})")
            values = dataset[user_ids]
        else:
            values = []
            for i in range(n):
                row = dataset[i]
                if not hasattr(row, "keys") or user_ids not in row.keys():
                    raise ValueError(f"make_private: row {i} of the dataset has no field {user_ids!r}; pass "
                                     "user_ids as a sequence aligned with the dataset instead")
                values.append(row[user_ids])
    else:
        values = user_ids
    if hasattr(values, "tolist") and not isinstance(values, list):
        values = values.tolist()
    values = list(values)
    if len(values) != n:
        raise ValueError(f"make_private: user_ids has {len(values)} entries for a dataset of {n} rows (one user "
                         "id per row, in dataset order)")
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) or hasattr(v, "item") and not isinstance(v, (str, bytes)):
            size = v.numel() if isinstance(v, torch.Tensor) else getattr(v, "size", 1)
            if size != 1:
                raise ValueError("make_private: a user id must be one value per row, got a multi-element tensor")
            v = v.item()
        out.append(v)
    return out, column
