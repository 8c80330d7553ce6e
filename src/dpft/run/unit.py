"""The privacy unit of a ``dpft train`` recipe over its tokenised rows (run/plan.py): example
level (the mechanism's sampler), user level (``task.user_column``) or a batch schedule. Lives
with the driver because it reads both the data layer and the step layer.

``example`` (a row, the default): every row joins step t independently with probability
q = expected batch / N rows. ``user`` (``task.user_column``, issue 17): every *user* joins with
q = expected users / N users, at most k rows of a sampled user per step, and the user's summed
gradient is clipped to C. The ledger, σ calibration, the δ check and epochs all count units.
"""

from __future__ import annotations

from dpft.data.tasks import USER_COLUMN, DataError, _col
from dpft.errors import TrainingError
from dpft.step.mechanisms import Mechanism
from dpft.step.sample import ScheduledPoissonSampler, UserPoissonSampler, user_index
from dpft.step.unit import PrivacyUnit

__all__ = ["check_user_level", "build_unit"]


def check_user_level(recipe, method_names: list[str]) -> None:
    """Refuse what user-level DP does not support yet, each with the reason and the fix — from the
    recipe alone, before any loading.

    Raises:
        TrainingError: methods, ``batch.schedule``, fp16 or packing with a user column. (Under DDP
            and FSDP2 each rank takes whole users: ``distributed.shard_units``.)"""
    r = recipe
    why = []
    if method_names:
        why.append(f"methods {method_names} assume example-level privacy (their phases, statistics and accounting "
                   "count rows); run them without task.user_column")
    if r.batch.schedule:
        why.append("batch.schedule (a variable q) is not supported over users; use batch.expected_batch_size")
    if r.perf.dtype == "fp16":
        why.append("perf.dtype fp16: an overflowed row would change its user's clipped contribution; use bf16 "
                   "or fp32")
    if getattr(r.task, "packing", False):
        why.append("task.packing mixes privacy units in one row; turn packing off")
    if why:
        raise TrainingError("user-level privacy (task.user_column) cannot run this recipe: " + "; ".join(why))


def _user_sampler(recipe, train_tok, rng):
    r = recipe
    # A loader renames the column to USER_COLUMN (classification, text) or keeps it under its
    # own name (instruction data keeps every extra column per row).
    cols = train_tok.column_names
    col = r.task.user_column if r.task.user_column in cols else USER_COLUMN
    if col not in cols:
        raise DataError(f"task.user_column {r.task.user_column!r}: the training rows carry no user id (this "
                        f"task's loader kept no {USER_COLUMN!r} or {r.task.user_column!r} column); give a file "
                        "with that column")
    try:
        users, _ = user_index(_col(train_tok, col))
        return UserPoissonSampler(users, r.batch.expected_batch_size, r.task.max_rows_per_user, rng)
    except ValueError as exc:
        raise DataError(f"user-level privacy (task.user_column {r.task.user_column!r}): {exc}") from None


def build_unit(recipe, train_tok, task_notes: list, rng, private: bool, mechanism=None) -> PrivacyUnit:
    """The run's privacy unit and sampler over its tokenised training rows.

    A user column in a non-private run is ignored with a note (no privacy unit). ``mechanism``
    (step/mechanisms.py) draws example-level batches (default: plain Poisson).

    Raises:
        DataError: a user column the rows lack, or a row without a user id.
        TrainingError: ``batch.schedule`` without an explicit σ (no calibration for a variable q).
    """
    r = recipe
    mechanism = mechanism if mechanism is not None else Mechanism()
    n_rows = len(train_tok)
    if r.task.user_column and not private:
        task_notes.append(f"task.user_column {r.task.user_column!r} ignored: a non-private run has no privacy unit")
    if r.task.user_column and private:
        sampler = _user_sampler(r, train_tok, rng)
        info = {"unit": "user", "column": r.task.user_column, "n_units": sampler.n,
                "max_rows_per_user": sampler.k, "user_clipping": r.task.user_clipping}
        return PrivacyUnit(sampler, sampler.n, sampler.q, True, info)
    if r.batch.schedule:
        sampler = ScheduledPoissonSampler(n_rows, r.batch.schedule, rng)
        if private and r.privacy.noise_multiplier is None:
            raise TrainingError("batch.schedule: set privacy.noise_multiplier (σ calibration for a "
                                "variable q is not implemented; `dpft report` gives the certified ε)")
    else:  # the mechanism's batch selection: plain, truncated or cyclic Poisson (step/mechanisms.py)
        sampler = mechanism.sampler(n_rows, r.batch.expected_batch_size, rng)  # PlanError names the fix
    return PrivacyUnit(sampler, n_rows, sampler.q, False, {"unit": "example", "n_units": n_rows})
