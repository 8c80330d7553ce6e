"""The front end of ``make_private``: its keywords as typed privacy and performance settings
(:class:`PrivacyArguments` → the session's ``SessionSettings``; :class:`PerformanceArguments`, which never
change the guarantee), checked (each refusal names the fix), and the user's data loader adapted to
Poisson sampling. The privacy plan itself is the session's, as in every way in."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

from dpft.placement import world as ddp
from dpft.api.clipping import CLIPPING_STYLES
from dpft.api.loader import DPDataLoader
from dpft.api.optimizer import DPOptimizer
from dpft.config.refusals import refuse
from dpft.errors import PlanError
from dpft.step.mechanisms import Mechanism, mechanism_of
from dpft.session import SessionSettings

__all__ = ["PrivacyArguments", "PerformanceArguments", "check_arguments", "batchnorm_modules", "adapt_data",
           "check_optimizer", "user_values", "LOADER_KEYS"]

LOADER_KEYS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
               "multiprocessing_context", "persistent_workers", "pin_memory_device")


@dataclass(frozen=True)
class PrivacyArguments:
    """``make_private``'s keywords that define the guarantee, as given (checked by :func:`check_arguments`;
    docs/make_private.md). The expected batch size comes with the data (:func:`adapt_data`).

    Attributes:
        max_grad_norm: C; clipping, head_fraction: the clip style and head_body's share of C².
        target_epsilon, target_delta | noise_multiplier: what σ is calibrated to, or σ.
        steps | epochs: the planned length.
        user_ids, max_rows_per_user, user_clipping: user level (ids per row, or a field name).
        mechanism, bands, max_batch_size: the mechanism (banded MF with b bands; truncated Poisson).
        poisson_sampling: Opacus' flag (only True: fixed-size batches are refused).
    """

    max_grad_norm: float
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    epochs: Optional[float] = None
    steps: Optional[int] = None
    noise_multiplier: Optional[float] = None
    clipping: str = "flat"
    head_fraction: float = 0.5
    user_ids: Any = None
    max_rows_per_user: int = 4
    user_clipping: str = "group"
    max_batch_size: Optional[int] = None
    mechanism: str = "gaussian"
    bands: Optional[int] = None
    poisson_sampling: bool = True

    @property
    def over_k(self) -> Optional[int]:
        """k when each row is clipped to C/k (user level, ``user_clipping='per_example_over_k'``), else None."""
        return int(self.max_rows_per_user) if self.user_ids is not None and self.user_clipping != "group" else None

    def session_settings(self, mech: Mechanism, expected_batch_size: int, hardened: bool) -> SessionSettings:
        """These settings as the session's typed privacy settings (session/core.py); ``mech``: from
        :func:`check_arguments`, ``expected_batch_size``: from :func:`adapt_data`."""
        return SessionSettings(
            max_grad_norm=float(self.max_grad_norm), expected_batch_size=int(expected_batch_size), mechanism=mech,
            steps=self.steps, epochs=self.epochs, noise_multiplier=self.noise_multiplier,
            target_epsilon=self.target_epsilon, target_delta=self.target_delta, clipping=self.clipping,
            hardened=hardened, max_rows_per_user=self.max_rows_per_user, user_clipping=self.user_clipping)


@dataclass(frozen=True)
class PerformanceArguments:
    """``make_private``'s keywords that change speed and memory only, never the guarantee (DESIGN.md
    "Performance settings are not privacy settings").

    Attributes:
        max_physical_batch_size: the largest micro-batch (None: the whole logical batch).
        norm_mode: the book-keeping engine's route to per-example norms (grads/bookkeeping.py; exact either way).
    """

    max_physical_batch_size: Optional[int] = None
    norm_mode: str = "auto"


def check_arguments(module, optimizer, p: PrivacyArguments, perf: PerformanceArguments, *, batch_first: bool = True,
                    noise_generator: Any = None, methods=(), lr_scheduler=None) -> Mechanism:
    """Refuse what ``make_private`` cannot certify or cannot tell apart, before any work (its other
    arguments are checked where they are used).

    Returns:
        The mechanism asked for (step/mechanisms.py).

    Raises:
        ValueError: naming the argument and the fix (see ``make_private``).
        dpft.placement.world.DistributedError: a module wrapped in DistributedDataParallel.
    """
    clipping, steps, epochs, user_clipping = p.clipping, p.steps, p.epochs, p.user_clipping
    target_epsilon, target_delta, noise_multiplier = p.target_epsilon, p.target_delta, p.noise_multiplier
    max_physical_batch_size, max_rows_per_user = perf.max_physical_batch_size, p.max_rows_per_user
    if not isinstance(module, nn.Module):
        raise ValueError(f"make_private: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(optimizer, DPOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("make_private: optimizer must be a plain torch.optim.Optimizer (not yet private)")
    if module.__dict__.get("_dpft_private"):
        raise ValueError("make_private: this module is already private (PrivacyEngine.detach() first)")
    if not p.poisson_sampling:
        raise refuse("poisson_sampling:not_poisson", "make_private", got=p.poisson_sampling)
    if not batch_first:
        raise ValueError("make_private: batch_first=False is not supported; put the example "
                         "dimension first")
    if noise_generator is not None:
        raise ValueError("make_private: noise_generator is refused; the noise comes from the "
                         "engine's secret randomness (PrivacyEngine(reproducible_seed=...) for tests)")
    if clipping not in CLIPPING_STYLES:
        raise refuse("privacy.clipping.style:unknown", "make_private", allowed=CLIPPING_STYLES, got=clipping)
    if steps is not None and epochs is not None:
        raise refuse("schedule.steps:both_lengths", "make_private")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"make_private: steps must be a positive integer, got {steps!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                               or not (epochs > 0 and math.isfinite(epochs))):
        raise ValueError(f"make_private: epochs must be a positive number (1.5 allowed), got {epochs!r}")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise refuse("privacy.noise_multiplier:both_or_neither", "make_private")
    if target_epsilon is not None:
        if not target_epsilon > 0:
            raise refuse("privacy.target_epsilon:range", "make_private", got=target_epsilon)
        if target_delta is None:
            raise refuse("privacy.delta:missing", "make_private")
        if steps is None and epochs is None:
            raise refuse("schedule.steps:no_length", "make_private", why="target_epsilon")
    if target_delta is not None and not 0 < target_delta < 1:
        raise refuse("privacy.delta:range", "make_private", got=target_delta)
    if noise_multiplier is not None and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise refuse("privacy.noise_multiplier:range", "make_private", got=noise_multiplier)
    if max_physical_batch_size is not None and (isinstance(max_physical_batch_size, bool)
                                                or int(max_physical_batch_size) != max_physical_batch_size
                                                or max_physical_batch_size < 1):
        raise refuse("batch.max_physical_batch_size:range", "make_private", got=max_physical_batch_size)
    ddp.refuse_ddp_wrapper(module, "make_private")
    if max_rows_per_user is not None and (isinstance(max_rows_per_user, bool) or int(max_rows_per_user) < 1):
        raise refuse("task.max_rows_per_user:range", "make_private", got=max_rows_per_user)
    if user_clipping not in ("group", "per_example_over_k"):
        raise refuse("task.user_clipping:unknown", "make_private", got=user_clipping)

    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
        raise ValueError("make_private: lr_scheduler must be a torch.optim.lr_scheduler made over the optimizer you "
                         "pass (the DP optimizer steps it once per noisy update)")
    try:
        mech = mechanism_of(p.mechanism, p.bands, p.max_batch_size)
    except PlanError as exc:
        raise PlanError(f"make_private: {exc}") from None
    why = mech.refusals(user_level=p.user_ids is not None, methods=[m.name for m in methods])
    if why:
        raise PlanError("make_private: " + "; ".join(why))
    if mech.stateful and steps is None and epochs is None:
        raise refuse("schedule.steps:no_length", "make_private", why=f"mechanism={p.mechanism!r}")
    bn = batchnorm_modules(module)
    if bn:
        raise refuse("model.name:batchnorm", "make_private", modules=bn[:3])
    return mech


def batchnorm_modules(module: nn.Module) -> list[str]:
    """Names of ``module``'s BatchNorm layers (refused by every Python way in: they mix a batch's examples)."""
    return [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def adapt_data(data_loader, dataset, expected_batch_size: Optional[int], num_workers: int, collate_fn):
    """The examples to sample from and the loader settings to keep.

    Returns:
        ``(dataset, N rows, expected batch, loader kwargs)``.

    Raises:
        ValueError: both or neither of ``data_loader``/``dataset``; a private loader; a custom
            sampler; an iterable dataset or one without ``len``; a batch size outside [1, N].
    """
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
        for k in LOADER_KEYS:
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
    return dataset, n, expected_batch_size, loader_kwargs


def check_optimizer(module, optimizer) -> dict:
    """The optimizer must hold only parameters of ``module``; frozen ones held are warned about.

    Returns:
        ``{id(parameter): name}`` of ``module``'s parameters.

    Raises:
        ValueError: a parameter that is not ``module``'s, or no trainable parameter.
    """
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

    return names


def user_values(dataset, user_ids: Any, n: int) -> tuple[list, str]:
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
