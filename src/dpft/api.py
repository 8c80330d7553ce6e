"""``PrivacyEngine().make_private(...)``: DP training inside the user's own PyTorch loop.

Opacus-shaped (Opacus ``PrivacyEngine.make_private`` / ``make_private_with_epsilon``; Yousefpour
et al. 2021), so that an Opacus user switches by changing one import::

    from dpft import PrivacyEngine          # was: from opacus import PrivacyEngine

    engine = PrivacyEngine()                # secret randomness; PrivacyEngine(reproducible_seed=0) in tests
    module, optimizer, criterion, data_loader = engine.make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(ds, batch_size=64),
        target_epsilon=3.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0,
        max_physical_batch_size=32)
    for epoch in range(3):
        for x, y in data_loader:            # Poisson logical batches, in micro-batches of <= 32
            optimizer.zero_grad()
            loss = criterion(module(x), y)
            loss.backward()
            optimizer.step()                # True when the noisy update was applied
    print(engine.get_epsilon(1e-5), engine.ledger)

What each object does (DESIGN.md "The DP step, as data flows"; Abadi et al. 2016, DP-SGD,
Algorithm 1, with Poisson sampling and the book-keeping per-example engine of Bu et al. 2023):

* the **data loader** draws each logical batch by Poisson sampling: every one of the N
  examples joins step t independently with probability q = expected batch / N (expected batch
  = the user's loader ``batch_size`` unless ``expected_batch_size`` is given; N =
  ``len(dataset)``). It yields the logical batch as physical micro-batches of at most
  ``max_physical_batch_size`` examples (Opacus' ``BatchMemoryManager``). ``len(data_loader)``
  is the number of logical steps per epoch, ``N // expected batch``. An empty logical batch
  yields nothing, but its noisy update (pure noise) is still applied and recorded, when the
  next micro-batch is requested;
* the **module** is the user's own module with hooks (not a wrapper): a training forward (grad
  enabled) records each trainable layer's input and the user's ``loss.backward()`` its output
  gradient; from these the per-example gradient norms and the clipped sum ``Σᵢ cᵢgᵢ`` are
  computed (one forward, one backward; ``dpft.grads.live``). ``p.grad`` is never the
  non-private gradient when the optimizer steps. Any ``nn.Module`` made of layers with a
  book-keeping rule works (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, RMSNorm, GPT-2
  ``Conv1D``, peft LoRA, and whatever is registered with ``dpft.grads.registry.register_layer``);
  a trainable module without a rule gets exact per-example gradients via ``torch.func`` with a
  warning naming its class;
* the **criterion** gives per-example losses: it is the user's loss with ``reduction='none'``,
  each example's elements averaged (``'mean'``) or summed (``'sum'``, ``'batchmean'``); it
  returns their mean (or sum) over the micro-batch, whose gradient reaches each example's loss
  unscaled (a mean's ``1/B`` is scaled back), so each example's gradient is its own;
* the **optimizer** wraps the user's: ``step()`` adds the micro-batch's clipped sum to the
  logical batch's and returns ``False``, except after the *last* micro-batch of a logical batch,
  where it runs the project's DP step once (``dpft.step.DPStep.release_and_update``: Gaussian
  noise N(0, σ²C²) on the sum, one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` in the
  ledger, division by the expected batch size qN, then the user's optimizer) and returns
  ``True``. Before calling it, ``optimizer.is_last_micro_batch`` says which it will be;
  ``optimizer.logical_steps`` counts the noisy updates, ``optimizer.last_step`` holds the last
  :class:`~dpft.step.StepOutput`. Step an LR scheduler with ``if optimizer.step():
  scheduler.step()``.

Device and precision: move the module to its device before ``make_private`` (or after; nothing is
moved to the CPU): the clipped sums are accumulated in fp32 on each parameter's device and the
noise is drawn there from a generator of that device seeded by the secret randomness. Batches
come from the user's collate function, so move them as usual (``x.to(device)``). bf16 autocast
around the forward works (norms and sums stay fp32); fp16 with ``torch.amp.GradScaler`` does not
(``dpft.grads.live``). Activation checkpointing works with the module's hooks.

One capture per micro-batch: a second forward+backward on the same micro-batch before
``optimizer.step()`` raises :class:`DoubleCaptureError` (each pass would be clipped on its own and
the example counted twice; sum the losses and call backward once). An optimizer parameter that
the engine does not clip (frozen at ``make_private``) only warns while frozen; with a gradient,
``step()`` raises :class:`UnclippedParameterError` before anything is released. A collated batch
must hold one row per sampled example (:func:`check_unpacked_batch`; packing collators raise
:class:`PackedBatchError`).

Real models: a pretrained encoder with a fresh head learns with ``clipping="head_body"`` and the
head in its own optimizer param group at a far larger learning rate (param groups' ``lr`` are
honoured; ``clipping="per_group"`` clips each group to C·√``clip_fraction``); flat clipping with
one learning rate ends at the majority class. README "From Python" and
docs/snippets/sst2_make_private.py; :func:`prediction_summary` warns on a constant classifier.

``engine.ledger`` is the :class:`~dpft.accounting.ledger.PrivacyLedger` the CLI uses (PLD of
``dp-accounting``); ``engine.get_epsilon(delta)`` is its ε. With a target ε the loader yields no
more than the planned number of logical steps (``epochs × len(data_loader)`` or ``steps``), so
the target is never exceeded; with an explicit ``noise_multiplier`` and no plan it never stops,
and ε is whatever the ledger says.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler,
                              SequentialSampler)

from dpft.accounting.ledger import PrivacyLedger
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.live import DoubleCaptureError, LiveBookKeeping
from dpft.privacy.randomness import Randomness
from dpft.step.aggregate import Aggregator
from dpft.step.clip import EPS, ClipPolicy, make_clip_policy
from dpft.step.build import build_step_spec, resolve_sigma
from dpft.step.pipeline import DPStep, StepOutput
from dpft.step.sample import PoissonSampler

__all__ = ["PrivacyEngine", "DPOptimizer", "DPDataLoader", "PerExampleCriterion", "GroupClip",
           "PackedBatchError", "DoubleCaptureError", "UnclippedParameterError", "prediction_summary"]


class PackedBatchError(ValueError):
    """A collated batch does not hold one row per sampled example (packing / padding-free
    collators): several privacy units would be clipped as one."""


class UnclippedParameterError(RuntimeError):
    """An optimizer parameter outside the DP engine holds a gradient: the optimizer would apply
    it without clipping or noise."""


#: Batch keys of padding-free / packed layouts (transformers' ``DataCollatorWithFlattening``,
#: flash-attention varlen): their presence means several rows share one batch row.
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k", "seq_idx")

_PACKING_FIX = ("one sampled row must be one row of the batch (the privacy unit). Use a padding "
                "collator (e.g. transformers.DataCollatorWithPadding / DataCollatorForLanguageModeling) "
                "instead of a packing or padding-free one (DataCollatorWithFlattening, packing=True in "
                "SFT), and pack nothing across examples")


def check_unpacked_batch(batch: Any, rows: int, where: str) -> None:
    """Refuse a collated batch that is not one row per sampled example.

    Checked on the top level of ``batch`` (a tensor, a tuple/list of tensors, or a mapping):
    every tensor with a leading dimension must have ``rows`` rows; no packing key
    (:data:`PACKING_KEYS`); ``position_ids`` (mapping key) must not restart inside a row (over
    the positions whose ``attention_mask`` is 1, when there is one).

    Raises:
        PackedBatchError: with the fix (a padding collator).
    """
    if isinstance(batch, torch.Tensor):
        items = [("batch", batch)]
    elif isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        keys = list(batch.keys())
        found = [k for k in keys if k in PACKING_KEYS]
        if found:
            raise PackedBatchError(f"{where}: the batch holds the packing keys {found}; {_PACKING_FIX}")
        items = [(str(k), batch[k]) for k in keys]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        return
    for name, v in items:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != rows:
            raise PackedBatchError(
                f"{where}: {name} has leading dimension {v.shape[0]} for {rows} sampled rows; {_PACKING_FIX}")
    if isinstance(batch, torch.Tensor) or isinstance(batch, (tuple, list)):
        return
    pos = batch["position_ids"] if "position_ids" in batch.keys() else None
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[1] > 1:
        mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
        pos = pos.detach().cpu()
        keep = (torch.ones_like(pos, dtype=torch.bool) if not isinstance(mask, torch.Tensor)
                or mask.shape != pos.shape else mask.detach().cpu().bool())
        for r in range(pos.shape[0]):
            p = pos[r][keep[r]]
            if p.numel() > 1 and bool((p[1:] <= p[:-1]).any()):
                raise PackedBatchError(
                    f"{where}: position_ids restart inside row {r} (several sequences packed into one "
                    f"row); {_PACKING_FIX}")


class GroupClip(ClipPolicy):
    """Flat clipping per group of parameters: group ``g`` is clipped to ``C·√f_g`` with
    ``Σ_g f_g ≤ 1``, so one example's whole clipped gradient stays within ``C`` (sensitivity
    ``C``, add/remove-one; per-layer clipping of McMahan et al. 2018 with chosen groups).
    ``head_body`` is the two-group case.

    Args:
        max_norm: C.
        group_of: ``(G,)`` group index of each engine parameter (engine order).
        fractions: ``f_g`` per group index, each > 0, summing to ≤ 1.

    Raises:
        ValueError: C not positive, a fraction ≤ 0, or fractions summing above 1.
    """

    def __init__(self, max_norm: float, group_of, fractions):
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clipping norm C must be a positive finite number, got {max_norm}")
        fr = [float(f) for f in fractions]
        if any(not f > 0 for f in fr) or sum(fr) > 1 + 1e-9:
            raise ValueError(f"per-group clip fractions must be > 0 and sum to ≤ 1, got {fr}")
        self.max_norm = float(max_norm)
        self.group_of = torch.as_tensor(group_of, dtype=torch.long)
        self.fractions = fr

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        if self.group_of.numel() != sq_norms.shape[1]:
            raise ValueError("GroupClip: one group index per trainable parameter is needed")
        gid = self.group_of.to(sq_norms.device)
        out = torch.ones_like(sq_norms)
        for g, f in enumerate(self.fractions):
            sel = gid == g
            if sel.any():
                norms = sq_norms[:, sel].sum(dim=1).clamp_min(0).sqrt()
                c = (self.max_norm * math.sqrt(f) / (norms + EPS)).clamp(max=1.0)
                out[:, sel] = c[:, None]
        return out


def prediction_summary(predictions: Any, labels: Any = None, *, warn: bool = True) -> dict:
    """Accuracy and class spread of classifier predictions, warning when they are all one class.

    A DP run whose noise swamps the signal often ends predicting the majority class for every
    input; its accuracy (the majority share) then looks like learning. Call this on the dev
    predictions of a ``make_private`` model.

    Args:
        predictions: ``(n,)`` class ids, or ``(n, C)`` logits/scores (argmax taken).
        labels: ``(n,)`` true class ids (optional).
        warn: emit a ``UserWarning`` when every prediction is one class (n ≥ 2).

    Returns:
        ``{"n", "top_class", "top_class_share", "single_class"}`` and, with labels,
        ``"accuracy"`` and ``"majority_baseline"`` (share of the most frequent true class).
    """
    pred = torch.as_tensor(predictions)
    if pred.dim() == 2:
        pred = pred.argmax(dim=1)
    pred = pred.reshape(-1).long().cpu()
    n = int(pred.numel())
    out: dict[str, Any] = {"n": n}
    if n == 0:
        return out
    counts = torch.bincount(pred)
    top = int(counts.argmax())
    out.update(top_class=top, top_class_share=float(counts[top]) / n,
               single_class=bool(int((counts > 0).sum()) == 1))
    if labels is not None:
        lab = torch.as_tensor(labels).reshape(-1).long().cpu()
        out["accuracy"] = float((pred == lab).float().mean())
        out["majority_baseline"] = float(torch.bincount(lab).max()) / n
    if warn and out["single_class"] and n >= 2:
        warnings.warn(
            f"every one of the {n} predictions is class {top}: the model has learnt nothing beyond a "
            "constant (its accuracy is that class's share). Under DP this usually means the noise "
            "swamps the signal: use head_body clipping with a larger head learning rate, a larger "
            "expected batch, or more steps (README, \"From Python\")", stacklevel=2)
    return out

CLIPPING_STYLES = ("flat", "per_layer", "automatic", "head_body", "per_group")


# --------------------------------------------------------------------------- data loader


@dataclass
class _Plan:
    """What the loader drew for one yielded micro-batch (or one empty logical batch)."""

    step: int
    size: int
    last: bool
    empty: bool = False


class _PoissonMicroBatches:
    """Batch sampler: per logical step t, the Poisson draw of ``sampler`` (stream ``sample``,
    t), split into micro-batches of at most ``max_physical`` indices. Every yielded micro-batch
    (and every empty logical batch) is announced in a FIFO the loader reads in order."""

    def __init__(self, sampler: PoissonSampler, steps_per_epoch: int, max_physical: Optional[int],
                 planned_steps: Optional[int]):
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.max_physical = max_physical
        self.planned_steps = planned_steps
        self.next_step = 0  # global logical step counter: every index is drawn at most once
        self.plan: deque[_Plan] = deque()

    def remaining(self) -> int:
        if self.planned_steps is None:
            return self.steps_per_epoch
        return max(0, min(self.steps_per_epoch, self.planned_steps - self.next_step))

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self):
        self.plan = plan = deque()
        return self._gen(plan, self.remaining())

    def _gen(self, plan: deque, n_steps: int):
        for _ in range(n_steps):
            t = self.next_step
            self.next_step += 1
            idx = self.sampler.indices(t)
            chunks = PoissonSampler.micro_batches(idx, self.max_physical or max(1, len(idx)))
            if not chunks:
                plan.append(_Plan(t, 0, True, empty=True))
                continue
            for k, c in enumerate(chunks):
                plan.append(_Plan(t, len(c), k == len(chunks) - 1))
                yield c.tolist()


class DPDataLoader(DataLoader):
    """A ``DataLoader`` over the same dataset (and collate function, workers, pinning) that
    yields Poisson-sampled logical batches as physical micro-batches. Built by
    :meth:`PrivacyEngine.make_private`; not meant to be constructed directly.

    Attributes:
        sample_rate: q = expected batch / N.
        expected_batch_size: qN.
        max_physical_batch_size: largest micro-batch (None: a logical batch is one micro-batch).
        planned_steps: the logical steps the noise was calibrated for (None: unlimited).
    """

    def __init__(self, dataset: Dataset, batch_sampler: _PoissonMicroBatches, optimizer: "DPOptimizer",
                 **loader_kwargs: Any):
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        self._dp_optimizer = optimizer
        self.sample_rate = batch_sampler.sampler.q
        self.expected_batch_size = batch_sampler.sampler.expected_batch_size
        self.max_physical_batch_size = batch_sampler.max_physical
        self.planned_steps = batch_sampler.planned_steps
        self._warned_done = False

    def __iter__(self):
        sampler: _PoissonMicroBatches = self.batch_sampler  # type: ignore[assignment]
        if sampler.remaining() == 0 and sampler.planned_steps is not None and not self._warned_done:
            self._warned_done = True
            warnings.warn(
                f"make_private: the {sampler.planned_steps} planned logical steps are done; the "
                "data loader yields nothing more (more steps would spend more than the target ε)",
                stacklevel=2)
        base = super().__iter__()
        return self._wrap(base, sampler.plan)

    def _wrap(self, base, plan: deque):
        opt = self._dp_optimizer
        for batch in base:
            entry = plan.popleft()
            while entry.empty:
                opt._release_empty(entry.step)
                entry = plan.popleft()
            check_unpacked_batch(batch, entry.size, "make_private")
            opt._begin_micro_batch(entry.step, entry.size, entry.last)
            yield batch
        while plan:
            entry = plan.popleft()
            if entry.empty:
                opt._release_empty(entry.step)
        opt._end_of_epoch()


# --------------------------------------------------------------------------- criterion


class _MeanWithOwnGradients(torch.autograd.Function):
    """Value: the mean of the ``(B,)`` per-example losses. Gradient: each example's loss gets
    the upstream gradient unscaled (not ``1/B``), so its per-example gradient is its own."""

    @staticmethod
    def forward(ctx, per_example: torch.Tensor, denom: float):  # type: ignore[override]
        ctx.n = per_example.shape[0]
        return per_example.sum() / denom

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.expand(ctx.n), None


class PerExampleCriterion(nn.Module):
    """The user's loss, made per-example (returned by :meth:`PrivacyEngine.make_private`).

    ``criterion(input, target, ...)`` calls the user's loss with ``reduction='none'``
    (output ``(B, ...)``, example dimension first) and reduces each example's own elements:
    ``'mean'`` averages them (for ``CrossEntropyLoss``/``NLLLoss``, over the targets that are not
    ``ignore_index``), ``'sum'`` and ``'batchmean'`` sum them, giving ``(B,)`` per-example losses
    (nats for cross-entropy). It returns their mean (``'mean'``, ``'batchmean'``) or sum
    (``'sum'``) over the micro-batch, a scalar; in every case the backward gives each example's
    loss gradient 1, so the clip sees each example's own gradient. For a ``'mean'`` loss over
    several elements per example (sequence cross-entropy with padding, for instance) the value
    is the mean of the examples' means, which can differ from torch's mean over all elements.

    Attributes:
        last_per_example: the last ``(B,)`` per-example losses (detached).

    Raises:
        ValueError: (construction) a criterion without a ``reduction`` attribute, or with
            ``reduction='none'``; (call) an output without the example dimension first.
    """

    def __init__(self, criterion: nn.Module, session: Optional[LiveBookKeeping] = None):
        super().__init__()
        reduction = getattr(criterion, "reduction", None)
        if not isinstance(criterion, nn.Module) or reduction is None:
            raise ValueError(
                f"make_private: cannot make the criterion {criterion!r} per-example: it needs a "
                "torch.nn loss module with a `reduction` attribute (e.g. nn.CrossEntropyLoss(), "
                "nn.MSELoss()). For another loss pass criterion=None and compute a batch mean "
                "(loss_reduction='mean') or sum (loss_reduction='sum') of per-example losses yourself")
        if reduction not in ("mean", "sum", "batchmean"):
            raise ValueError(
                f"make_private: criterion has reduction={reduction!r}; pass it with reduction='mean' "
                "or 'sum' (make_private computes the per-example losses itself)")
        inner = type(criterion).__new__(type(criterion))
        inner.__dict__.update(criterion.__dict__)  # a shallow copy sharing weights/buffers
        inner.reduction = "none"
        self.inner = inner
        self.reduction = reduction
        self._session = session
        self.last_per_example: Optional[torch.Tensor] = None

    def per_example(self, input: torch.Tensor, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The ``(B,)`` per-example losses (with their graph)."""
        per = self.inner(input, target, *args, **kwargs)
        if not isinstance(per, torch.Tensor) or per.dim() == 0:
            raise ValueError(
                f"make_private: {type(self.inner).__name__}(reduction='none') returned a scalar; "
                "it cannot give per-example losses")
        b = per.shape[0]
        if per.dim() == 1:
            return per
        flat = per.reshape(b, -1)
        if self.reduction != "mean":
            return flat.sum(1)
        ignore = getattr(self.inner, "ignore_index", None)
        if (ignore is not None and isinstance(target, torch.Tensor) and not target.is_floating_point()
                and target.shape == per.shape):
            count = (target.reshape(b, -1) != ignore).sum(1).clamp_min(1)
            return flat.sum(1) / count.to(flat.dtype)
        return flat.mean(1)

    def forward(self, input: torch.Tensor, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        per = self.per_example(input, target, *args, **kwargs)
        if self._session is not None:
            self._session.on_loss(per)
        self.last_per_example = per.detach()
        if self.reduction == "sum":
            return per.sum()
        return _MeanWithOwnGradients.apply(per, float(max(per.shape[0], 1)))


# --------------------------------------------------------------------------- optimizer


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
        noise_multiplier: σ; ``max_grad_norm``: C.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dp_step: DPStep, planned_steps: Optional[int]):
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
        self.max_grad_norm = dp_step.spec.clip.max_norm
        self.current_step: Optional[int] = None
        self.is_last_micro_batch = False
        self.logical_steps = 0
        self.last_step: Optional[StepOutput] = None
        self._agg: Optional[Aggregator] = None
        self._agg_step: Optional[int] = None
        self._released_upto = -1
        self._warned: set[str] = set()
        self._engine_ids = {id(p) for p in dp_step.params.values()}
        #: id → name of the module's parameters (for error messages); set by make_private.
        self.param_names: dict[int, str] = {}

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

    def _begin_micro_batch(self, step: int, size: int, last: bool) -> None:
        if self.session is not None:
            self.session.flush()
        if step != self._agg_step:
            self._discard_unreleased()
            self._agg = Aggregator(self.dp_step.params)
            self._agg_step = step
        self.current_step = step
        self.is_last_micro_batch = last
        if self.session is not None:
            self.session.begin_micro_batch(size)

    def _end_of_epoch(self) -> None:
        if self.session is not None:
            self.session.flush()
            self.session.begin_micro_batch(None)
        self._discard_unreleased()
        self.current_step = None
        self.is_last_micro_batch = False

    def _release_empty(self, step: int) -> None:
        """An empty Poisson batch: its noisy update (pure noise) is still released."""
        if self.session is not None:
            self.session.flush()
            self.session.begin_micro_batch(None)
        self._discard_unreleased()
        self.current_step = None
        self._release(step, Aggregator(self.dp_step.params))

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

    def _release(self, step: int, agg: Aggregator) -> StepOutput:
        if step <= self._released_upto:  # never two releases with one noise stream
            raise RuntimeError(f"logical step {step} was already released")
        self.check_unclipped_grads()
        self._released_upto = step
        out = self.dp_step.release_and_update(step, agg)
        self.logical_steps += 1
        self.last_step = out
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
        if self.session is not None:
            self.session.flush()
        self.check_unclipped_grads()
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


# --------------------------------------------------------------------------- clip groups


def _head_mask(params: "OrderedDict[str, torch.Tensor] | dict", head_parameters: Any) -> list[bool]:
    """``head_body``: True for the engine parameters of the head (given, or by name)."""
    if head_parameters is None:
        from dpft.models.load import is_head_param

        mask = [is_head_param(n) for n in params]
        how = ("no parameter name has a classifier/score/pooler/lm_head component; pass "
               "head_parameters=model.<head>.parameters()")
    else:
        given = list(head_parameters)
        ids = {id(h) for h in given if isinstance(h, torch.Tensor)}
        strs = {h for h in given if isinstance(h, str)}
        unknown = sorted(strs - set(params))
        if unknown:
            raise ValueError(f"make_private: head_parameters names {unknown[:3]} are not trainable "
                             "parameters of module")
        mask = [n in strs or id(p) in ids for n, p in params.items()]
        how = "head_parameters holds none of the module's trainable parameters"
    if not any(mask):
        raise ValueError(f"make_private: clipping='head_body' needs a head: {how}")
    if all(mask):
        raise ValueError("make_private: clipping='head_body' found only head parameters (no body to "
                         "clip separately); use clipping='flat'")
    return mask


def _group_clip(c: float, params: dict, optimizer: torch.optim.Optimizer) -> GroupClip:
    """``per_group``: one clip group per optimizer param group, C·√f_g each."""
    where = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            where[id(p)] = gi
    missing = [n for n, p in params.items() if id(p) not in where]
    if missing:
        raise ValueError(f"make_private: clipping='per_group' needs every trainable parameter in an "
                         f"optimizer param group; {missing[:3]} are in none")
    given = {gi: g.get("clip_fraction") for gi, g in enumerate(optimizer.param_groups)}
    used = sorted({where[id(p)] for p in params.values()})
    fixed = sum(float(given[g]) for g in used if given[g] is not None)
    free = [g for g in used if given[g] is None]
    if fixed > 1 + 1e-9 or (free and fixed >= 1):
        raise ValueError(f"make_private: the param groups' clip_fraction values sum to {fixed:g}; they "
                         "must sum to ≤ 1 (< 1 when some groups have none)")
    share = (1.0 - fixed) / len(free) if free else 0.0
    index = {g: k for k, g in enumerate(used)}
    fractions = [float(given[g]) if given[g] is not None else share for g in used]
    return GroupClip(c, [index[where[id(p)]] for p in params.values()], fractions)


# --------------------------------------------------------------------------- the engine


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
        self.reproducible = reproducible_seed is not None
        self.hardened_noise = hardened_noise
        self.ledger = PrivacyLedger()
        self.noise_multiplier: Optional[float] = None
        self._calls = 0
        self._sessions: list[LiveBookKeeping] = []

    def get_epsilon(self, delta: float) -> float:
        """ε(δ) of everything this engine released (PLD accountant of ``dp-accounting``).

        Raises:
            ValueError: δ not in (0, 1).
        """
        return float(self.ledger.epsilon(delta).epsilon)

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
                that are not trainable parameters of ``module``; an unknown clipping style.
            dpft.accounting.calibrate.CalibrationError: the target cannot be met (δ ≥ 1/N, or
                unreachable with this q and number of steps), with the reason.
            NotImplementedError: ``torch.distributed`` with more than one process.
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
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise NotImplementedError("make_private under torch.distributed is not supported yet; "
                                      "use `dpft train` (DDP via torchrun)")
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
        q = expected_batch_size / n
        steps_per_epoch = max(1, n // expected_batch_size)
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
        sigma = resolve_sigma(noise_multiplier=None if target_epsilon is not None else noise_multiplier,
                              target_epsilon=target_epsilon, delta=target_delta, q=q, steps=planned, n=n,
                              prior=self.ledger.events())

        # ---------------------------------------------------------------- the DP step
        self._calls += 1
        rng = self._rng.child(f"make_private:{self._calls}")
        clip = (make_clip_policy(clipping, max_grad_norm, head_fraction=head_fraction)
                if clipping != "per_group" else GroupClip(max_grad_norm, [0], [1.0]))
        engine = BookKeepingEngine(module, _not_called, clip, norm_mode=norm_mode)
        if clipping == "head_body":
            clip.set_head_mask(_head_mask(engine.params, head_parameters))
        elif clipping == "per_group":
            clip = _group_clip(max_grad_norm, engine.params, optimizer)
            engine.clip = clip
        sampler = PoissonSampler(n, expected_batch_size, rng)
        spec = build_step_spec(engine=engine, clip=clip, sigma=sigma, rng=rng, sampler=sampler, optimizer=optimizer,
                               hardened=self.hardened_noise)
        dp_step = DPStep(spec, self.ledger, n)
        dp_opt = DPOptimizer(optimizer, dp_step, planned)
        session = LiveBookKeeping(engine, dp_opt._on_result, loss_reduction=loss_reduction)
        dp_opt.session = session
        dp_opt.param_names = names
        module.__dict__["_dpft_private"] = True
        self._sessions.append(session)
        batches = _PoissonMicroBatches(sampler, steps_per_epoch, max_physical_batch_size, planned)
        loader = DPDataLoader(dataset, batches, dp_opt, **loader_kwargs)
        self.noise_multiplier = sigma
        if per_example_criterion is None:
            return module, dp_opt, loader
        per_example_criterion._session = session
        return module, dp_opt, per_example_criterion, loader
