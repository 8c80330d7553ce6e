"""The privacy unit and its Poisson sampler, as a plan part (run/unit.py builds a recipe's;
:func:`build_user_unit` a user-level unit from given user ids, for ``make_private``).

``example`` (a row, the default): every row joins step t independently with probability
q = expected batch / N rows (:class:`~dpft.step.sample.PoissonSampler`; a ``batch.schedule``
varies q by step). ``user`` (``task.user_column``, issue 17): every *user* joins with
q = expected users / N users, at most k rows of a sampled user per step, and the user's summed
gradient is clipped to C (:class:`~dpft.step.sample.UserPoissonSampler`, grads/groups.py). The
ledger, σ calibration, the δ check and epochs all count units, never rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpft.step.sample import UserPoissonSampler, user_index

__all__ = ["PrivacyUnit", "build_user_unit"]


@dataclass(frozen=True)
class PrivacyUnit:
    """What one neighbouring dataset differs by, and how units are sampled.

    Attributes:
        sampler: draws step t's logical batch (row indices) from the run's secret randomness.
        n: N, the number of units (rows, or users).
        q: the Poisson sampling rate of a unit.
        user_level: units are users.
        info: the report's description (``unit``, ``n_units``, and at user level ``column``,
            ``max_rows_per_user``, ``user_clipping``).
    """

    sampler: Any
    n: int
    q: float
    user_level: bool
    info: dict


def build_user_unit(user_values, expected_users: int, max_rows_per_user: int, rng, user_clipping: str = "group",
                    column: str = "user_ids") -> PrivacyUnit:
    """A user-level privacy unit over rows whose user ids are ``user_values`` (one per row, any
    hashable values; ``make_private(user_ids=...)``), with the CLI's sampler: Poisson over users
    with q = expected users / U, at most ``max_rows_per_user`` rows of a sampled user per step.

    Raises:
        ValueError: a row without a user id, ``user_clipping`` unknown, expected users outside
            [1, U], or k < 1 (:class:`~dpft.step.sample.UserPoissonSampler`).
    """
    if user_clipping not in ("group", "per_example_over_k"):
        raise ValueError(f"user_clipping must be 'group' or 'per_example_over_k', got {user_clipping!r}")
    users, _ = user_index(user_values)
    sampler = UserPoissonSampler(users, int(expected_users), int(max_rows_per_user), rng)
    info = {"unit": "user", "column": column, "n_units": sampler.n, "max_rows_per_user": sampler.k,
            "user_clipping": user_clipping}
    return PrivacyUnit(sampler, sampler.n, sampler.q, True, info)
