"""Truncated Poisson sampling with fixed physical shapes (``batch.max_batch_size``).

Each example joins step t's logical batch independently with probability q (the Poisson draw
of :class:`~dpft.step.sample.PoissonSampler`); when more than ``B_max`` joined, a uniformly
random subset of exactly ``B_max`` of them is kept (secret stream ``truncate``, t: a 53-bit
uniform key per sampled example, the ``B_max`` smallest keys kept). The accountant's event is
``dp_accounting.TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` — the "Scalable DP-SGD"
analysis (Chua et al. 2025, arXiv:2508.15089, used for VaultGemma): when truncation happens,
removing an example can let another one in, so that branch is accounted as a replace-one
(sensitivity 2C) mechanism, mixed with the plain subsampled Gaussian with the binomial tail
probability. Only dp-accounting's PLD accountant supports the event (its RDP cross-check is
then reported as not available).

Fixed shapes: the logical batch (≤ B_max rows) runs as micro-batches of exactly P =
``batch.max_physical_batch_size`` rows of exactly T = ``model.max_length`` tokens; the last
micro-batch is padded with copies of its own first row, flagged in ``batch[EXAMPLE_MASK]``.
:class:`MaskedEngine` gives a padded row loss weight 0 *and* clip factor 0, so it contributes
exactly nothing to the clipped sum, the loss sum, the batch size or the clip count.

The truncation probability the report states is the public ``P[Binomial(N, q) > B_max]``,
a consequence of N, q and B_max alone; the realised count is private and never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import dp_accounting as dpa
import torch

from dpft.step.sample import PoissonSampler

if TYPE_CHECKING:
    from dpft.privacy.randomness import Randomness

__all__ = ["EXAMPLE_MASK", "TruncatedPoissonSampler", "check_max_batch", "truncation_probability", "truncated_event",
           "fixed_micro_batches", "fixed_shape_batches", "pad_to_length", "MaskedEngine", "MaskedClip"]

#: Key of the ``(B,)`` bool tensor in a micro-batch that flags real rows (False = padding).
EXAMPLE_MASK = "example_mask"


def truncation_probability(n: int, q: float, max_batch_size: int) -> float:
    """``P[Binomial(N, q) > B_max]``: how often a step's Poisson batch is truncated. Public: a
    function of N, q and B_max only (never of the realised batches)."""
    from scipy import stats

    return float(stats.binom.sf(int(max_batch_size), int(n), float(q)))


def truncated_event(n: int, q: float, max_batch_size: int, sigma: float) -> dpa.DpEvent:
    """One step's ledger event: ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)``."""
    return dpa.TruncatedSubsampledGaussianDpEvent(dataset_size=int(n), sampling_probability=float(q),
                                                  truncated_batch_size=int(max_batch_size),
                                                  noise_multiplier=float(sigma))


def check_max_batch(max_batch_size: int) -> None:
    """What :class:`TruncatedPoissonSampler` refuses of B_max, nothing drawn.

    Raises:
        ValueError: B_max < 1."""
    if int(max_batch_size) < 1:
        raise ValueError(f"batch.max_batch_size must be ≥ 1, got {max_batch_size}")


class TruncatedPoissonSampler(PoissonSampler):
    """Poisson sampling at rate q, truncated to a uniformly random subset of at most ``B_max``.

    Args:
        n, expected_batch_size, rng: as :class:`~dpft.step.sample.PoissonSampler`.
        max_batch_size: B_max ≥ 1.

    Raises:
        ValueError: B_max < 1, or the sampler's own errors.
    """

    def __init__(self, n: int, expected_batch_size: int, rng: "Randomness", max_batch_size: int):
        super().__init__(n, expected_batch_size, rng)
        check_max_batch(max_batch_size)
        self.max_batch_size = int(max_batch_size)

    def indices(self, step: int) -> torch.Tensor:
        """Step ``step``'s logical batch: the Poisson draw, then (if larger than B_max) the rows
        with the B_max smallest secret uniform keys (stream ``truncate``, step). Sorted int64."""
        return self.truncate(self.draw(step, self.q), step)

    def truncate(self, idx: torch.Tensor, step: int) -> torch.Tensor:
        """A uniformly random subset of ``min(len(idx), B_max)`` of ``idx`` (sorted)."""
        if len(idx) <= self.max_batch_size:
            return idx
        key = self.rng.stream("truncate", int(step)).uniform((len(idx),))  # float64, 53 secret bits each
        keep = torch.argsort(key)[: self.max_batch_size]
        return idx[keep].sort().values

    @property
    def truncation(self) -> tuple[int, int]:
        """``(N, B_max)``: what the ledger's ``TruncatedSubsampledGaussianDpEvent`` needs besides q
        and σ (read by :meth:`step_event`)."""
        return int(self.n), self.max_batch_size

    def step_event(self, q: float, sigma: float) -> dpa.DpEvent:
        """One step's ledger event at rate q and noise multiplier σ:
        ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` (:func:`truncated_event` of
        :attr:`truncation`). The release records it: step/mechanisms.py ``TruncatedPoisson.install``
        hands this method to the Gaussian mechanism (step/noise.py ``step_event``)."""
        n, b_max = self.truncation
        return truncated_event(n, q, b_max, sigma)

    @property
    def truncation_probability(self) -> float:
        """``P[Binomial(N, q) > B_max]`` (public)."""
        return truncation_probability(self.n, self.q, self.max_batch_size)


def fixed_micro_batches(indices: torch.Tensor, physical: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a logical batch into micro-batches of exactly ``physical`` rows.

    Returns:
        ``[(rows (P,) int64, mask (P,) bool)]``: ``⌈len/P⌉`` entries (none for an empty batch);
        the last one's missing rows repeat its first row with mask False.
    """
    out = []
    for chunk in torch.split(indices, physical) if len(indices) else []:
        mask = torch.ones(physical, dtype=torch.bool)
        if len(chunk) < physical:
            mask[len(chunk):] = False
            chunk = torch.cat([chunk, chunk[:1].expand(physical - len(chunk))])
        out.append((chunk, mask))
    return out


def pad_to_length(batch: dict[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad a collated batch's ``(B, t)`` token tensors to ``(B, length)`` (t ≤ length): ids with
    ``pad_id``, attention mask 0, token types 0, positions continued, token labels -100."""
    out = {}
    ids = batch["input_ids"]
    b, t = ids.shape
    extra = int(length) - t
    if extra < 0:
        raise ValueError(f"a row has {t} tokens, more than model.max_length = {length}")
    fill = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0, "labels": -100}
    for k, v in batch.items():
        if extra and v.dim() == 2 and v.shape == (b, t):
            if k == "position_ids":
                out[k] = torch.arange(length, device=v.device).unsqueeze(0).expand(b, length).contiguous()
            else:
                pad = torch.full((b, extra), fill.get(k, 0), dtype=v.dtype, device=v.device)
                out[k] = torch.cat([v, pad], dim=1)
        else:
            out[k] = v
    return out


def fixed_shape_batches(chunks, rows, pad_id: int, with_token_types: bool, length: int, device=None, *,
                        collate):
    """Collate :func:`fixed_micro_batches` output into ``(P, length)`` batches with
    ``batch[EXAMPLE_MASK]`` (a generator; ``rows``: the tokenised dataset; ``collate(rows, pad_id,
    with_token_types)``: the way in's collate function, e.g. ``dpft.data.tokenize.collate`` — handed
    in, so that the step imports nothing of the data layer)."""
    for chunk, mask in chunks:
        batch = pad_to_length(collate(list(rows.select(chunk.tolist())), pad_id, with_token_types), length, pad_id)
        batch[EXAMPLE_MASK] = mask
        if device is not None and torch.device(device).type != "cpu":
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        yield batch


class MaskedClip:
    """A clip policy whose factors are the inner policy's times the row mask (0 for padding)."""

    def __init__(self, inner, mask: torch.Tensor):
        self.inner, self.mask = inner, mask

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        s = self.inner.scales(sq_norms)
        return s * self.mask.to(device=s.device, dtype=s.dtype)[:, None]

    def __getattr__(self, name):
        return getattr(self.inner, name)


class MaskedEngine:
    """Wraps a per-example engine so that rows with ``batch[EXAMPLE_MASK] == False`` contribute
    exactly nothing: their loss is multiplied by 0 (zero gradient, zero norm) and their clip
    factor is 0; the result's ``n``, ``scales``, ``sq_norms`` and ``loss_sum`` cover real rows
    only. A batch without the key passes through unchanged. Everything else is the inner
    engine's (``params``, ``precision``, …)."""

    _own = ("inner", "clip")

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "clip", inner.clip)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def clipped_sum(self, batch: Mapping[str, torch.Tensor]):
        if EXAMPLE_MASK not in batch:
            self.inner.clip = self.clip
            return self.inner.clipped_sum(batch)
        mask = batch[EXAMPLE_MASK].bool()
        # The mask travels in the batch (as 0/1 floats), so the loss sees the rows it is given
        # whatever the engine does with them (book-keeping's whole batch, the reference engine's
        # one example at a time under vmap, a probe on a slice); model_inputs() never passes it
        # to the model.
        rest = {**batch, EXAMPLE_MASK: mask.float()}
        inner = self.inner
        loss_fn = inner.loss_fn

        def masked_loss(forward, b):
            losses = loss_fn(forward, {k: v for k, v in b.items() if k != EXAMPLE_MASK})
            return losses * b[EXAMPLE_MASK].to(device=losses.device, dtype=losses.dtype)

        inner.loss_fn, inner.clip = masked_loss, MaskedClip(self.clip, mask)
        try:
            res = inner.clipped_sum(rest)
        finally:
            inner.loss_fn, inner.clip = loss_fn, self.clip
        keep = mask.to(res.scales.device)
        res.scales = res.scales[keep]
        res.sq_norms = res.sq_norms[keep.to(res.sq_norms.device)]
        res.n = int(mask.sum())
        return res
