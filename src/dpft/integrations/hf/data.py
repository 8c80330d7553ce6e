"""Poisson sampling inside ``Trainer`` (the data front end of :class:`~dpft.integrations.hf.trainer.DPTrainer`):
the train dataloader yields one placeholder per logical step; the step draws its rows from the
plan's sampler, orders them, takes this rank's share and collates physical batches."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import TrainingArguments

from dpft.placement import world as ddp
from dpft.api import check_unpacked_batch
from dpft.grads.groups import GROUP_KEY
from dpft.step.sample import PoissonSampler, user_index

__all__ = ["PoissonData", "LogicalSteps", "TOKEN", "user_ids"]

#: Key of the placeholder batches the replaced train dataloader yields (one per logical step).
TOKEN = "dpft_logical_step"


class LogicalSteps(Dataset):
    """``n`` placeholders: one per logical step of an epoch."""

    def __init__(self, n: int):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> int:
        return k


def _collate_token(items: list) -> dict[str, int]:
    return {TOKEN: int(items[0])}


class PoissonData:
    """Mixin of :class:`~dpft.integrations.hf.trainer.DPTrainer`: the sampled rows of each logical step."""

    def get_train_dataloader(self) -> DataLoader:
        """One placeholder batch per logical step (``ceil(N / expected_batch_size)`` per epoch).

        The rows of step ``t`` are drawn in :meth:`training_step` by Poisson sampling. Each call
        starts a new training loop with its own child of the secret randomness, so no two
        releases of this trainer ever share noise."""
        self._loops += 1
        self._run_rng = self.rng.child(f"hf-train-loop-{self._loops}")
        self.sampler.rng = self._run_rng
        self.mechanism.rng = self._run_rng
        ds = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            is_hf_ds = isinstance(ds, datasets.Dataset)
        except ImportError:  # pragma: no cover - datasets is a dependency
            is_hf_ds = False
        if is_hf_ds:
            ds = self._remove_unused_columns(ds, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        self._dp_rows, self._dp_collator = ds, collator
        return DataLoader(LogicalSteps(self.steps_per_epoch), batch_size=1, shuffle=False,
                          collate_fn=_collate_token)

    def num_examples(self, dataloader: DataLoader) -> int:
        if isinstance(getattr(dataloader, "dataset", None), LogicalSteps):
            return self.n
        return super().num_examples(dataloader)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The expected logical batch size qN (the realised sizes are private)."""
        return int(self.dp_args.expected_batch_size)

    def _rows(self, idx: torch.Tensor) -> list:
        ds, keys = self._dp_rows, idx.tolist()
        if hasattr(ds, "__getitems__"):
            rows = ds.__getitems__(keys)
            if isinstance(rows, list) and len(rows) == len(keys):
                return rows
        return [ds[i] for i in keys]

    def _logical_order(self, idx: torch.Tensor) -> torch.Tensor:
        """The order step ``t`` runs its logical batch ``idx`` in, which DDP shards it by (the same
        on every rank): by length (stable) so that physical batches carry little padding, when the
        rows have ``input_ids``; at user level grouped by user as the sampler returns it. The set
        of examples (all that privacy depends on) is unchanged."""
        if self.user_level or len(idx) < 2:
            return idx
        rows = self._rows(idx)
        if not (rows and isinstance(rows[0], Mapping) and "input_ids" in rows[0]):
            return idx
        lengths = torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.long)
        return idx[torch.argsort(lengths, stable=True)]

    def _share(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's share of the logical batch ``idx`` (in :meth:`_logical_order`): every K-th
        example, or at user level every K-th *user* with all its sampled rows (a user's rows are
        clipped as one, so they never straddle two ranks). One process: all of ``idx``."""
        if self.user_level:
            return ddp.shard_units(idx, self.sampler.users[idx], self.world)
        return ddp.shard(idx, self.world)

    def _micro_batches(self, idx: torch.Tensor):
        """Collated physical batches of this rank's share of the logical batch ``idx`` (in
        :meth:`_logical_order`; built one at a time): at most ``max_physical_batch_size`` rows
        each; at user level whole users (the user column dropped), with their local user ids
        under ``GROUP_KEY`` when ``user_clipping='group'``."""
        mine = self._share(idx)
        if not len(mine):
            return
        if self.user_level:
            micros = self.sampler.micro_batches(mine, self.physical_batch_size)
        else:
            micros = PoissonSampler.micro_batches(mine, self.physical_batch_size)
        col = self.dp_args.user_column
        for micro in micros:
            chunk = self._rows(micro)
            if col is not None:
                chunk = [{k: v for k, v in r.items() if k != col} if isinstance(r, Mapping) else r for r in chunk]
            batch = self._dp_collator(chunk)
            # One sampled row must stay one example: a packing / padding-free collator would clip
            # several rows as one (and removing a row would reshuffle later packs).
            check_unpacked_batch(batch, len(chunk), "DPTrainer")
            if self.user_level and self.dp_args.user_clipping == "group":
                batch[GROUP_KEY] = self.sampler.groups(micro)
            yield self._prepare_inputs(batch)


def user_ids(ds, column: str) -> torch.Tensor:
    """``(N_rows,)`` int64 user index 0..U-1 of every row of ``ds[column]``
    (:func:`~dpft.step.sample.user_index`).

    Raises:
        ValueError: the column is missing or a row has no user id."""
    cols = getattr(ds, "column_names", None)
    try:
        if cols is not None:
            if column not in cols:
                raise ValueError(f"DPTrainer: DPArguments.user_column {column!r} is not a column of train_dataset "
                                 f"(columns: {', '.join(cols)}); add a user id per row, or set user_column=None for "
                                 "example level")
            values = list(ds[column])
        else:
            values = []
            for i in range(len(ds)):
                row = ds[i]
                if not isinstance(row, Mapping) or column not in row:
                    raise ValueError(f"DPTrainer: DPArguments.user_column {column!r}: row {i} of train_dataset has "
                                     "no such key; every row needs a user id")
                values.append(row[column])
        users, _ = user_index(values)
    except ValueError as exc:
        if str(exc).startswith("DPTrainer:"):
            raise
        raise ValueError(f"DPTrainer: user_column {column!r}: {exc}") from None
    return users
