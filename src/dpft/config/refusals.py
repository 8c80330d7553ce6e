"""The refusals every way in shares, worded once (issue 46 item 3): one registry keyed by setting.

A :class:`Refusal` names its setting in every way in — the recipe key of ``dpft train``, the
keyword of ``make_private`` and the argument of ``DPTrainer`` (``DPArguments`` / ``TrainingArguments``)
— a condition id, ONE message template naming the fix, and the exception type each way in raises.
:func:`refuse` words it for one way in, naming the setting as that way spells it and as the recipe
(or the keyword) spells it, so a user of any way in reads the same rule::

    raise refuse("privacy.noise_multiplier:both_or_neither", way="make_private")
    # ValueError: make_private: set exactly one of target_epsilon (recipe privacy.target_epsilon; ...

A rule that needs the built step is checked once where every way in meets it: user-level group
clipping on an engine without groups by the private session (session/core.py
``PrivateSession.check_groups``, raising for the session's way in, :func:`way_of`).

Rules that only one way in has stay with it (e.g. ``TrainingArguments.fp16`` in
integrations/hf/checks.py); the mechanism's refusals (``banded_mf`` with user level or truncated
Poisson, bands < 1, b·B > N) are worded once in step/mechanisms.py with each way in's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from string import Formatter
from typing import Optional

from dpft.errors import PlanError

__all__ = ["Setting", "Refusal", "SETTINGS", "REFUSALS", "WAYS", "refuse", "setting_name", "way_of"]

#: The ways in, as their messages begin (the recipe's messages are placed by the recipe loader).
WAYS = ("make_private", "DPTrainer", "recipe")


def way_of(where: str) -> str:
    """The registry's way in for a private session's ``where`` (session/core.py ``PrivateSession.open``):
    ``make_private``; ``dpft train`` (and the session's default ``dpft``) is the recipe's; any other
    is ``DPTrainer`` or one of its subclasses (the TRL trainers), which take ``DPArguments``."""
    if where == "make_private":
        return "make_private"
    if where in ("dpft train", "dpft"):
        return "recipe"
    return "DPTrainer"


@dataclass(frozen=True)
class Setting:
    """One setting as each way in spells it (None: that way in has no such setting)."""

    recipe: Optional[str]
    make_private: Optional[str]
    dptrainer: Optional[str]

    def own(self, way: str) -> Optional[str]:
        return {"recipe": self.recipe, "make_private": self.make_private, "DPTrainer": self.dptrainer}[way]

    def render(self, way: str) -> str:
        """The name ``way`` uses, with the recipe key (or, for the recipe, the keyword) beside it."""
        own = self.own(way)
        if way == "recipe":
            kw = self.make_private or self.dptrainer
            return f"{own} (keyword {kw})" if kw and kw != own else str(own or kw)
        if own is None:  # a setting this way in does not have: the others' names, and that it has none
            named = [n for n in (self.make_private, self.dptrainer) if n] + (
                [f"recipe key {self.recipe}"] if self.recipe else [])
            return f"{' or '.join(named)}, not a {way} setting"
        return f"{own} (recipe key {self.recipe})" if self.recipe else str(own)


#: Settings by handle (the ``make_private`` keyword); a template names them as ``{handle}``.
SETTINGS: dict[str, Setting] = {
    "poisson_sampling": Setting(None, "poisson_sampling",
                                "TrainingArguments.train_sampling_strategy / group_by_length"),
    "steps": Setting("schedule.steps", "steps", "TrainingArguments.max_steps"),
    "epochs": Setting("schedule.epochs", "epochs", "TrainingArguments.num_train_epochs"),
    "target_epsilon": Setting("privacy.target_epsilon", "target_epsilon", "DPArguments.target_epsilon"),
    "target_delta": Setting("privacy.delta", "target_delta", "DPArguments.target_delta"),
    "noise_multiplier": Setting("privacy.noise_multiplier", "noise_multiplier", "DPArguments.noise_multiplier"),
    "clipping": Setting("privacy.clipping.style", "clipping", "DPArguments.clipping"),
    "user_clipping": Setting("task.user_clipping", "user_clipping", "DPArguments.user_clipping"),
    "max_rows_per_user": Setting("task.max_rows_per_user", "max_rows_per_user", "DPArguments.max_rows_per_user"),
    "max_physical_batch_size": Setting("batch.max_physical_batch_size", "max_physical_batch_size",
                                       "DPArguments.max_physical_batch_size"),
    "module": Setting("model.name", "module", "model"),
    "engine": Setting("privacy.engine", None, "DPArguments.engine"),
}


@dataclass(frozen=True)
class Refusal:
    """One rule: its setting (a :data:`SETTINGS` handle), the condition refused, one template
    naming the fix (``{handle}`` renders a setting for the way in; other fields are values), the
    ways in that check it and the exception type each raises."""

    setting: str
    condition: str
    template: str
    ways: tuple[str, ...]
    errors: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{SETTINGS[self.setting].recipe or self.setting}:{self.condition}"

    def fragments(self) -> list[str]:
        """The template's fixed text (the sentence core every way in's message holds)."""
        return [lit.strip() for lit, _, _, _ in Formatter().parse(self.template) if lit.strip()]


_R = [
    Refusal("poisson_sampling", "not_poisson",
            "{poisson_sampling} = {got!r} is refused: the accountant assumes Poisson sampling (each example "
            "independently with q = expected batch / N; PoissonSampledDpEvent), and shuffled or fixed-size "
            "batches would not be what is certified; leave {poisson_sampling} at its default",
            ("make_private", "DPTrainer")),
    Refusal("steps", "both_lengths",
            "give {epochs} or {steps}, not both: the number of noisy steps has one rule",
            ("make_private", "recipe")),
    Refusal("steps", "no_length",
            "{why} needs epochs or steps, the number of noisy steps σ and the mechanism are planned for: "
            "set {epochs} or {steps}", ("make_private", "recipe")),
    Refusal("noise_multiplier", "both_or_neither",
            "set exactly one of {target_epsilon}, for which σ is calibrated, and {noise_multiplier}, a fixed σ",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("noise_multiplier", "range", "{noise_multiplier} must be finite and ≥ 0, got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("target_epsilon", "range", "{target_epsilon} must be > 0, got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("target_delta", "missing", "{target_epsilon} needs {target_delta}, the δ of the guarantee",
            ("make_private",)),
    Refusal("target_delta", "range", "{target_delta} must be in (0, 1) (and below 1/N), got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("clipping", "unknown", "{clipping} must be one of {allowed}, got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("user_clipping", "unknown", "{user_clipping} must be 'group' or 'per_example_over_k', got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("max_rows_per_user", "range", "{max_rows_per_user} must be a positive integer, got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("max_physical_batch_size", "range", "{max_physical_batch_size} must be a positive integer, got {got!r}",
            ("make_private", "DPTrainer", "recipe")),
    Refusal("module", "batchnorm",
            "BatchNorm mixes the examples of a batch, so per-example gradients are not per example "
            "({modules}); use LayerNorm or GroupNorm in {module}", ("make_private", "DPTrainer")),
    # Checked once, by the private session on the plan's engine (after the methods' build, which may
    # swap it): session/core.py PrivateSession.plan.
    Refusal("user_clipping", "group_engine",
            "{user_clipping} = 'group' clips all of a user's rows as one, which the per-example engine {got} "
            "cannot (it would clip each row to C alone, so one user could move the sum by k·C); keep an engine "
            "that clips groups ({engine}: 'bookkeeping' or 'reference') with no method that replaces it, or set "
            "{user_clipping} to 'per_example_over_k'", WAYS, errors={w: PlanError for w in WAYS}),
    # DPDPOTrainer (integrations/trl/trainer.py): a preference pair is the unit at example level too.
    Refusal("engine", "pair_groups",
            "a preference pair's chosen and rejected rows are clipped as one group, which the per-example "
            "engine {got} cannot (each row clipped alone, a pair could move the sum by 2C); keep an engine that "
            "clips groups ({engine}: 'bookkeeping' or 'reference')", ("DPTrainer",), errors={"DPTrainer": PlanError}),
]
#: The registry, keyed by ``<recipe key or keyword>:<condition>`` (e.g. ``privacy.noise_multiplier:range``).
REFUSALS: dict[str, Refusal] = {r.key: r for r in _R}
_DEFAULT_ERRORS = {"make_private": ValueError, "DPTrainer": ValueError, "recipe": ValueError}
_PREFIX = {"make_private": "make_private: ", "DPTrainer": "DPTrainer: ", "recipe": ""}


def setting_name(handle: str, way: str) -> str:
    """How ``way`` names setting ``handle``, with the recipe key (or keyword) beside it."""
    return SETTINGS[handle].render(way)


class _Names(dict):
    def __init__(self, way: str, values: dict):
        super().__init__(values)
        self.way = way

    def __missing__(self, name: str) -> str:
        if name in SETTINGS:
            return setting_name(name, self.way)
        raise KeyError(f"refusal template field {name!r} is neither a setting nor a given value")


def refuse(key: str, way: str, **values) -> Exception:
    """The exception ``way`` raises for refusal ``key`` (:data:`REFUSALS`), worded by its one template.

    Args:
        key: ``<recipe key or keyword>:<condition>``, e.g. ``schedule.steps:both_lengths``.
        way: ``make_private`` | ``DPTrainer`` | ``recipe``.
        values: the template's value fields (``got``, ``allowed``, ...).

    Returns:
        The exception (the caller raises it): ``ValueError`` unless the refusal names another type.

    Raises:
        KeyError: an unknown key, or a way in that the refusal does not list (a dead or stray call).
    """
    r = REFUSALS[key]
    if way not in r.ways:
        raise KeyError(f"refusal {key!r} is not registered for {way!r} (ways: {r.ways})")
    msg = r.template.format_map(_Names(way, values))
    return r.errors.get(way, _DEFAULT_ERRORS[way])(_PREFIX[way] + msg)

