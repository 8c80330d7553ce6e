"""User-level DP for ``DPDPOTrainer``: a user's preference pairs are one privacy unit.

The sampling is DPTrainer's user level unchanged (step/sample.py ``UserPoissonSampler`` over the
rows of the prepared preference dataset, one row = one pair): users are Poisson-sampled with
``q = expected_batch_size / U``, a sampled user brings a fresh random subset of at most
``k = max_rows_per_user`` of its pairs, DDP shards whole users (``DPTrainer._share``) and the
ledger counts users. What this module adds is the preference layout: a pair is two rows
(chosen, rejected; :func:`~dpft.integrations.trl.pair_rows`), so

* ``user_clipping='group'``: every row of one user's pairs carries the user's clipping group
  (``GROUP_KEY``), and the engine clips the norm of the user's *summed* gradient over all of its
  chosen and rejected rows to C (grads/groups.py). Add/remove one user changes the clipped sum
  by at most C.
* ``user_clipping='per_example_over_k'``: each pair stays its own group, clipped to C/k
  (``DPTrainer._make_clip``); a user's at most k pairs sum to at most C.

Sources: Chua et al. 2024, "Mind the Privacy Unit! User-Level Differential Privacy for Language
Model Fine-Tuning" (user-level DP-SGD, Poisson over users); Charles et al. 2024, "Fine-Tuning
Large Language Models with User-Level Differential Privacy" (ELS, k examples per user).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dpft.api import PackedBatchError
from dpft.grads.groups import GROUP_KEY
from dpft.integrations import hf_data


def user_pair_batches(trainer: Any, mine: torch.Tensor, pair_rows) -> Iterator[dict[str, torch.Tensor]]:
    """Collated physical batches of this rank's sampled pairs ``mine`` (grouped by user, as the
    user sampler returns them) at user level: whole users per batch (at most
    ``max(max_physical_batch_size, k)`` pairs), ``2P`` rows each, chosen and rejected interleaved.

    Args:
        trainer: a ``DPDPOTrainer`` at user level (``sampler`` a ``UserPoissonSampler``).
        mine: ``(P_rank,)`` int64 row (pair) indices of this rank's sampled users.
        pair_rows: :func:`~dpft.integrations.trl.pair_rows` (passed in: no import cycle).

    Yields:
        the prepared batch: ``input_ids`` etc. ``(2P, L)``, ``ref_logps (2P,)``, ``GROUP_KEY (2P,)``
        (the user's local id for ``group``; the pair's for ``per_example_over_k``).

    Raises:
        PackedBatchError: the collated batch is not two rows per sampled pair, in order.
    """
    col = trainer.dp_args.user_column
    by_user = trainer.dp_args.user_clipping == "group"
    for micro in trainer.sampler.micro_batches(mine, trainer.physical_batch_size):
        chunk = [{k: v for k, v in r.items() if k != col} if isinstance(r, Mapping) else r
                 for r in trainer._rows(micro)]
        batch = pair_rows(trainer._dp_collator(chunk))
        hf_data.check_unpacked_batch(batch, 2 * len(chunk), "DPDPOTrainer")
        # The pair layout: every pair exactly two consecutive rows of one group.
        if not torch.equal(batch[GROUP_KEY], torch.arange(len(chunk)).repeat_interleave(2)):
            raise PackedBatchError("DPDPOTrainer: the collated batch is not two rows per sampled pair")
        if by_user:
            # Groups of whole pairs of one user: both rows of each pair take the pair's user's group.
            batch[GROUP_KEY] = trainer.sampler.groups(micro).repeat_interleave(2)
        yield trainer._prepare_inputs(batch)
