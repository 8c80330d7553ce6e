"""Time budget (``--time-budget`` / ``schedule.time_budget``): how long one logical step will take,
measured BEFORE σ is calibrated and without touching the private data.

σ depends on T, and T is what the time budget chooses, so the step cannot be timed on the run's
own first (noisy) step. Instead :func:`probe_step_time` builds a throw-away copy of the run's
model (same recipe: model, trainable selection, engine, clip policy, optimizer, device and
precision) and times it on **synthetic inputs**:

- the rows are token ids drawn uniformly from the tokenizer's vocabulary by a public generator
  (seed 0), each ``model.max_length`` tokens long, labels drawn the same way; ``max_length`` is an
  upper bound on a real row (real micro-batches are padded to their longest row only), so the
  estimate errs towards fewer steps. The private rows' lengths are not used (they are private);
- a micro-batch of ``batch.max_physical_batch_size`` such rows goes through the run's per-example
  engine (forward, backward, per-example norms, clipping, the clipped sum) once as warm-up (kernel
  selection, allocator, lazy initialisation: excluded), then ``repeats`` times (the median is used);
- the update is timed once: a Gaussian draw for every trainable tensor through the run's noise code
  (``GaussianMechanism.add_noise``) with a *public* :class:`~dpft.privacy.randomness.Randomness`
  seeded 0 — never the run's secret key, which is created later by the run itself and is
  untouched — and one optimizer step of the throw-away model; then one checkpoint-sized save
  (the trainable tensors and the optimizer state) to a temporary folder, and one forward-only
  pass (evaluation).

Why nothing is released and no ledger entry is needed: no private row, label or length enters the
probe (its inputs are functions of the public tokenizer and a public seed; the model is the
public pretrained one before any training), so its wall times — and the (B, T) chosen from them —
are functions of public information and the machine. What the data decides is only what it
decided before: N (for q = B/N) and the number of labels, as with ``auto`` batch/steps. The
throw-away model is deleted before the run loads its own.

Not in the estimate (printed as such): the methods' own phases and per-step work (a ``methods:``
entry), a test file's final evaluation, the report and the model's save, time other processes
take from the machine. Under DDP (torchrun) a time budget is refused: each rank would time itself
and the ranks could choose different T.
"""

from __future__ import annotations

import gc
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from scipy.stats import binom

from dpft.data.tokenize import collate
from dpft.models.build import build_model
from dpft.models.load import is_head_param
from dpft.models.losses import classification_loss, model_inputs
from dpft.optim import build_optimizer
from dpft.placement.device import build_placement, place_model
from dpft.privacy.randomness import Randomness
from dpft.run.checkpoint import release_checkpoints
from dpft.step.build import build_clip, make_engine
from dpft.step.noise import GaussianMechanism

__all__ = ["StepTiming", "probe_step_time"]


@dataclass(frozen=True)
class StepTiming:
    """Measured wall times (seconds) of the run's parts on synthetic rows (module docstring).

    Attributes:
        micro_batch_seconds: forward + backward + per-example clipping of one micro-batch of
            ``physical`` rows × ``length`` tokens (median of ``repeats`` after one warm-up).
        update_seconds: noise for every trainable tensor + one optimizer step.
        checkpoint_seconds: one save of the trainable tensors and the optimizer state.
        checkpoints_per_step: 1 when the run checkpoints at every release, else 1/checkpoint_every.
        eval_row_seconds: forward-only time per row (evaluation).
        setup_seconds: building the throw-away model, engine and optimizer (the run pays it again:
            reserved from the budget).
        physical, length, repeats: the probe's micro-batch rows, tokens per row, timed repeats.
    """

    micro_batch_seconds: float
    update_seconds: float
    checkpoint_seconds: float
    checkpoints_per_step: float
    eval_row_seconds: float
    setup_seconds: float
    physical: int
    length: int
    repeats: int = 3

    def micro_batches(self, batch: int, n: Optional[int] = None) -> float:
        """Expected micro-batches of a logical step of expected size B = qN: E⌈X/P⌉ = Σ_{k≥0} P[X > kP]
        with X ~ Binomial(N, q) the Poisson-sampled batch (a partial micro-batch counted as full);
        ⌈B/P⌉ when N is not given."""
        p = self.physical
        if n is None or n <= batch:
            return float(max(1, math.ceil(batch / p)))
        top = int(math.ceil((batch + 8 * math.sqrt(batch) + 1) / p)) + 1
        return float(sum(binom.sf(k * p, n, batch / n) for k in range(top + 1)))

    def step_seconds(self, batch: int, n: Optional[int] = None) -> float:
        """Estimated seconds of one logical step of expected size ``batch`` over ``n`` units: its
        expected micro-batches (:meth:`micro_batches`), the update and the checkpoint share."""
        return (self.micro_batch_seconds * self.micro_batches(batch, n) + self.update_seconds
                + self.checkpoint_seconds * self.checkpoints_per_step)

    def eval_seconds(self, rows: int) -> float:
        """Estimated seconds of one evaluation over ``rows`` dev rows."""
        return self.eval_row_seconds * rows

    def describe(self) -> str:
        return (f"timed on synthetic rows (no private data): one micro-batch of {self.physical} rows × {self.length} "
                f"tokens (model.max_length, an upper bound) {self.micro_batch_seconds:.3g} s (forward, backward, "
                f"per-example clipping; median of {self.repeats} after 1 warm-up); noise + optimizer "
                f"{self.update_seconds:.3g} s; checkpoint {self.checkpoint_seconds:.3g} s × "
                f"{self.checkpoints_per_step:.3g} per step; evaluation {self.eval_row_seconds * 1e3:.3g} ms per row; "
                f"setup {self.setup_seconds:.3g} s")


def _sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def synthetic_rows(tokenizer, rows: int, length: int, num_labels: int, seed: int = 0) -> list[dict]:
    """``rows`` public synthetic classification rows of ``length`` token ids (uniform over the
    vocabulary, from a generator seeded ``seed``) and uniform labels — no private data."""
    g = torch.Generator().manual_seed(seed)
    vocab = int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = torch.randint(0, max(1, num_labels), (rows,), generator=g)
    return [{"input_ids": ids[i].tolist(), "token_type_ids": [0] * length, "label": int(labels[i])}
            for i in range(rows)]


def probe_step_time(recipe, num_labels: int, *, repeats: int = 3,
                    clock: Callable[[], float] = time.perf_counter) -> StepTiming:
    """Time the run's step on synthetic rows with a throw-away model (module docstring).

    Args:
        recipe: the run's recipe (a classification task; ``batch``/``steps`` may still be auto).
        num_labels: the task's number of labels (the head size).
        repeats: timed repeats of the micro-batch after one warm-up (the median is kept).
        clock: the wall clock (tests pass a fake one).

    Raises:
        ModelError, TrainingError: as building the run's model would (before the run does)."""
    r = recipe
    p = r.batch.max_physical_batch_size
    if r.batch.expected_batch_size != "auto":
        p = min(p, int(r.batch.expected_batch_size))
    length = r.model.max_length
    t0 = clock()
    placement = build_placement(r, None, False, [])
    tokenizer, model = build_model(r, num_labels, device=placement.device)
    model = place_model(model, r.perf, placement.device)
    clip = build_clip(r.privacy)
    engine = make_engine(r.privacy.engine, model, classification_loss, clip)
    if hasattr(clip, "set_head_mask"):  # head/body clipping splits C as the run's step does (step/build.py)
        clip.set_head_mask([is_head_param(n) for n in engine.params])
    engine.precision = placement.precision
    optimizer = build_optimizer(r.optimizer, engine.params)
    setup = clock() - t0
    with_tt = "token_type_ids" in tokenizer.model_input_names
    batch = collate(synthetic_rows(tokenizer, p, length, num_labels), tokenizer.pad_token_id or 0, with_tt,
                    device=placement.device)
    model.train()
    engine.clipped_sum(batch)  # warm-up: not timed
    _sync(placement.device)
    times = []
    for _ in range(max(1, repeats)):
        t = clock()
        out = engine.clipped_sum(batch)
        _sync(placement.device)
        times.append(clock() - t)
    t = clock()
    noisy = GaussianMechanism(1.0, clip.sensitivity, Randomness(0), hardened=r.privacy.hardened_noise
                              ).add_noise(out.grad_sum, 0)
    for name, prm in engine.params.items():
        prm.grad = noisy[name].to(prm.dtype)
    optimizer.step()
    _sync(placement.device)
    update = clock() - t
    with tempfile.TemporaryDirectory() as tmp:
        t = clock()
        torch.save({"params": {n: v.detach().cpu() for n, v in engine.params.items()},
                    "optim": optimizer.state_dict()}, Path(tmp) / "probe.pt")
        ck = clock() - t
    every_release = release_checkpoints(r, r.privacy.enabled, False, engine.params)
    model.eval()
    with torch.no_grad():
        t = clock()
        model(**model_inputs(batch))
        _sync(placement.device)
        ev = (clock() - t) / p
    del model, engine, optimizer, out, noisy, batch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return StepTiming(micro_batch_seconds=statistics.median(times), update_seconds=update, checkpoint_seconds=ck,
                      checkpoints_per_step=1.0 if every_release else 1.0 / r.checkpoint_every,
                      eval_row_seconds=ev, setup_seconds=setup, physical=p, length=length, repeats=len(times))
