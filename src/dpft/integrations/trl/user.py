"""User-level DP for ``DPDPOTrainer``: a user's preference pairs are one privacy unit.

The sampling is DPTrainer's user level unchanged (step/sample.py ``UserPoissonSampler`` over the
rows of the prepared preference dataset, one row = one pair): users are Poisson-sampled with
``q = expected_batch_size / U``, a sampled user brings a fresh random subset of at most
``k = max_rows_per_user`` of its pairs, DDP shards whole users (``DPTrainer._share``) and the
ledger counts users. What this module adds is the chunking by whole users and the pairs' user groups;
``DPDPOTrainer._micro_batches`` collates the chunks as at example level (a pair is two rows, chosen and
rejected: :func:`~dpft.integrations.trl.trainer.pair_rows`), so

* ``user_clipping='group'``: every row of one user's pairs carries the user's clipping group
  (``GROUP_KEY``), and the engine clips the norm of the user's *summed* gradient over all of its
  chosen and rejected rows to C (grads/groups.py). Add/remove one user changes the clipped sum
  by at most C.
* ``user_clipping='per_example_over_k'``: each pair stays its own group, clipped to C/k
  (``DPArguments.clip_settings``, step/clip.py ``build_clip_policy``); a user's at most k pairs sum to at most C.

Sources: Chua et al. 2024, "Mind the Privacy Unit! User-Level Differential Privacy for Language
Model Fine-Tuning" (user-level DP-SGD, Poisson over users); Charles et al. 2024, "Fine-Tuning
Large Language Models with User-Level Differential Privacy" (ELS, k examples per user).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch


def user_pair_chunks(trainer: Any, mine: torch.Tensor) -> Iterator[tuple[list, Optional[torch.Tensor]]]:
    """This rank's sampled pairs ``mine`` (grouped by user, as the user sampler returns them) in
    physical chunks of whole users (at most ``max(max_physical_batch_size, k)`` pairs each), for
    ``DPDPOTrainer._micro_batches`` to collate as it collates example-level chunks.

    Args:
        trainer: a ``DPDPOTrainer`` at user level (``sampler`` a ``UserPoissonSampler``).
        mine: ``(P_rank,)`` int64 row (pair) indices of this rank's sampled users.

    Yields:
        ``(rows, users)``: the chunk's pair rows without the user column, and ``(P,)`` the user's local
        group id of each pair for ``user_clipping='group'`` (both rows of a pair take it), None for
        ``per_example_over_k`` (each pair stays its own group, clipped to C/k).
    """
    col = trainer.dp_args.user_column
    by_user = trainer.dp_args.user_clipping == "group"
    for micro in trainer.sampler.micro_batches(mine, trainer.physical_batch_size):
        rows = [{k: v for k, v in r.items() if k != col} if isinstance(r, Mapping) else r
                for r in trainer._rows(micro)]
        yield rows, (trainer.sampler.groups(micro) if by_user else None)
