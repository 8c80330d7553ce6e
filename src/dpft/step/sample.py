"""Poisson sampling of logical batches, split into physical micro-batches.

Each example joins step t's logical batch independently with probability q = expected batch
size / N, where N is the size of the training set (never ``1 / len(loader)``). This is the
sampling the accountant's ``PoissonSampledDpEvent(q, ·)`` assumes. Batches may be empty.

The draw of step t comes from the run's secret randomness (privacy/randomness.py), stream
``sample`` and step t: secret by default (a resumed run draws fresh batches; the live ledger
accounts the replayed steps), the same batches for the same seed in reproducible mode.
Membership is decided on 53-bit integers (``SecretStream.bernoulli``): an example joins with
probability exactly ⌊q·2⁵³⌋/2⁵³ ≤ q, never the ⌈q·2²⁴⌉/2²⁴ ≥ q of a float32 ``rand < q``
(+19 % at q = 1e-7). :class:`ScheduledPoissonSampler` follows a schedule of expected batch sizes (one
q_t per step, each step's own event in the ledger).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from dpft.privacy.randomness import Randomness


def check_batch(n: int, expected_batch_size: int) -> None:
    """What :class:`PoissonSampler` refuses, nothing drawn.

    Raises:
        ValueError: N < 1, or B outside [1, N] (naming ``batch.expected_batch_size``)."""
    if n < 1:
        raise ValueError("cannot sample from an empty training set")
    if not 1 <= expected_batch_size <= n:
        raise ValueError(
            f"expected batch size {expected_batch_size} must be between 1 and N = {n}; "
            "lower batch.expected_batch_size"
        )


class PoissonSampler:
    """Args:
        n: dataset size N (≥ 1).
        expected_batch_size: q·N (≥ 1, ≤ N).
        rng: the run's :class:`~dpft.privacy.randomness.Randomness` (secret by default).

    Raises:
        ValueError: empty dataset or expected batch larger than N.
    """

    def __init__(self, n: int, expected_batch_size: int, rng: "Randomness"):
        check_batch(n, expected_batch_size)
        self.n = n
        self.expected_batch_size = expected_batch_size
        self.q = expected_batch_size / n
        self.rng = rng

    def indices(self, step: int) -> torch.Tensor:
        """Indices of step ``step``'s logical batch (int64, sorted, possibly empty)."""
        return self.draw(step, self.q)

    def draw(self, step: int, q: float) -> torch.Tensor:
        """Each of the N examples independently with probability ⌊q·2⁵³⌋/2⁵³ ≤ q (stream
        ``sample``, step; 53-bit integer comparison, see the module docstring)."""
        return torch.nonzero(self.rng.stream("sample", step).bernoulli((self.n,), q)).flatten()

    @staticmethod
    def micro_batches(indices: torch.Tensor, max_physical: int) -> list[torch.Tensor]:
        """Split a logical batch into chunks of at most ``max_physical`` examples."""
        return list(torch.split(indices, max_physical)) if len(indices) else []


# --------------------------------------------------------------------------- variable rate
# A schedule of expected batch sizes, one Poisson rate q_t per step. The DP-Adam-AC paper accounts a
# changing batch size with its own "variable-q" RDP accountant (Yang, App. C). dpft records each
# step's own ``PoissonSampledDpEvent(q_t, GaussianDpEvent(σ))`` in the ledger instead, and the PLD
# accountant of ``dp_accounting`` composes the heterogeneous events (runs of equal q are grouped by
# the ledger).


class ScheduledPoissonSampler(PoissonSampler):
    """Poisson sampling with expected batch size ``b_t`` from a step schedule.

    Args:
        n: dataset size N.
        schedule: ``[(from_step, expected_batch_size), ...]``, the first at step 0, steps
            strictly increasing, every size in [1, N].
        rng: the run's secret randomness (privacy/randomness.py).

    Raises:
        ValueError: a malformed schedule (the message says which entry).
    """

    def __init__(self, n: int, schedule: Sequence[tuple[int, int]], rng):
        sched = [(int(s), int(b)) for s, b in schedule]
        if not sched or sched[0][0] != 0:
            raise ValueError("batch.schedule must start with an entry for step 0, e.g. [[0, 64], [100, 128]]")
        for (s0, _), (s1, _) in zip(sched, sched[1:]):
            if s1 <= s0:
                raise ValueError(f"batch.schedule steps must increase strictly; {s1} follows {s0}")
        for s, b in sched:
            if not 1 <= b <= n:
                raise ValueError(f"batch.schedule: expected batch {b} at step {s} must be between 1 and N = {n}")
        super().__init__(n, sched[0][1], rng)
        self.schedule = sched
        self._starts = [s for s, _ in sched]

    def expected_batch_at(self, step: int) -> int:
        return self.schedule[bisect.bisect_right(self._starts, step) - 1][1]

    def q_at(self, step: int) -> float:
        """q_t = b_t / N."""
        return self.expected_batch_at(step) / self.n

    def indices(self, step: int) -> torch.Tensor:
        return self.draw(step, self.q_at(step))


class UserPoissonSampler:
    """Poisson sampling over *users* (user-level DP), at most ``k`` rows per sampled user.

    Each of the U users joins step t's logical batch independently with probability
    q = expected_users / U (the ``PoissonSampledDpEvent(q, ·)`` of the ledger, over users);
    a sampled user contributes a fresh uniformly random subset of min(k, its rows) of its rows
    (Chua et al. 2024, "Mind the Privacy Unit!", user-level DP-SGD with Poisson sampling over
    users; Charles et al. 2024, "Fine-tuning LLMs with user-level DP", ELS with k rows per
    user). Both draws come from the run's secret randomness: stream ``sample`` (users, step
    t) and stream ``user_rows`` (the row subsets, step t).

    Args:
        users: ``(N_rows,)`` int64 user index of every training row, values in ``[0, U)``, every
            user with at least one row.
        expected_users: expected users per step q·U (≥ 1, ≤ U).
        k: most rows per sampled user per step (≥ 1).
        rng: the run's :class:`~dpft.privacy.randomness.Randomness`.

    Attributes:
        n: number of users U (the privacy units: what the ledger's q and the report's N count).
        q: sampling rate over users.
        n_rows: number of training rows.

    Raises:
        ValueError: no rows, a user without rows, k < 1, expected users outside [1, U].
    """

    def __init__(self, users: torch.Tensor, expected_users: int, k: int, rng: "Randomness"):
        users = torch.as_tensor(users, dtype=torch.long).flatten()
        if users.numel() == 0:
            raise ValueError("cannot sample users from an empty training set")
        if int(k) < 1:
            raise ValueError(f"task.max_rows_per_user (k) must be ≥ 1, got {k}")
        if int(users.min()) < 0:
            raise ValueError("user indices must be ≥ 0")
        n_users = int(users.max()) + 1
        counts = torch.bincount(users, minlength=n_users)
        if bool((counts == 0).any()):
            raise ValueError(f"{int((counts == 0).sum())} user indices have no rows; number the users 0..U-1 "
                             "(dpft.step.sample.user_index does)")
        if not 1 <= expected_users <= n_users:
            raise ValueError(
                f"expected users per step {expected_users} must be between 1 and the number of users "
                f"U = {n_users}; lower batch.expected_batch_size (at user level it counts users)")
        self.users = users
        self.n = n_users
        self.n_rows = int(users.numel())
        self.k = int(k)
        self.expected_batch_size = int(expected_users)
        self.q = expected_users / n_users
        self.rng = rng
        self.counts = counts

    def sampled_users(self, step: int) -> torch.Tensor:
        """Users of step ``step`` (int64, sorted, possibly empty): each with probability
        ⌊q·2⁵³⌋/2⁵³ ≤ q (53-bit integer comparison)."""
        return torch.nonzero(self.rng.stream("sample", step).bernoulli((self.n,), self.q)).flatten()

    def indices(self, step: int) -> torch.Tensor:
        """Row indices of step ``step``'s logical batch, grouped by user (int64; possibly empty):
        for each sampled user, a random subset of at most k of its rows."""
        chosen = torch.zeros(self.n, dtype=torch.bool)
        chosen[self.sampled_users(step)] = True
        rows = torch.nonzero(chosen[self.users]).flatten()
        if rows.numel() == 0:
            return rows
        key = self.rng.stream("user_rows", step).uniform((self.n_rows,))[rows]  # float64, 53-bit
        rows = rows[torch.argsort(key)]  # random order, then a stable sort by user
        rows = rows[torch.argsort(self.users[rows], stable=True)]
        u = self.users[rows]
        start = torch.ones_like(u, dtype=torch.bool)
        start[1:] = u[1:] != u[:-1]
        first = torch.cummax(torch.where(start, torch.arange(len(u)), torch.zeros_like(u)), 0).values
        rank = torch.arange(len(u)) - first  # position of the row within its user's random order
        return rows[rank < self.k]

    def micro_batches(self, indices: torch.Tensor, max_physical: int) -> list[torch.Tensor]:
        """Split a logical batch (grouped by user) into micro-batches of whole users: at most
        ``max(max_physical, k)`` rows each (a user's rows are never split, so its contribution
        can be clipped as one unit)."""
        if not len(indices):
            return []
        u = self.users[indices]
        out, start, size = [], 0, 0
        bounds = (torch.nonzero(u[1:] != u[:-1]).flatten() + 1).tolist() + [len(u)]
        prev = 0
        for b in bounds:
            m = b - prev
            if size and size + m > max_physical:
                out.append(indices[start:prev])
                start, size = prev, 0
            size += m
            prev = b
        out.append(indices[start:])
        return out

    def groups(self, micro: torch.Tensor) -> torch.Tensor:
        """``(B,)`` int64 local group ids 0..G-1 of a micro-batch's rows (one group per user)."""
        return torch.unique_consecutive(self.users[micro], return_inverse=True)[1]


def user_index(values) -> tuple[torch.Tensor, list]:
    """Map a column of user ids (any hashable values) to ``(N_rows,)`` int64 indices 0..U-1
    in order of first appearance, and the list of distinct ids.

    Raises:
        ValueError: an empty column or a missing (None/NaN/empty) user id.
    """
    index: dict = {}
    out = []
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and not v.strip()):
            raise ValueError(f"row {i + 1} has no user id; every row needs one in the user column "
                             "(drop the row or fill it)")
        out.append(index.setdefault(v, len(index)))
    if not out:
        raise ValueError("the user column is empty: no users to sample")
    return torch.tensor(out, dtype=torch.long), list(index)
