"""Recipe schema of ``tune:`` (private hyperparameter search; run/tune.py, accounting/selection.py).

Kept apart from config.py (which imports it) so that the recipe schema stays within its size."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import BeforeValidator, Field, model_validator

from dpft.config.base import PluginConfig

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(v: Any) -> Any:
    """Seconds from ``3600``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"`` or ``"1.5h"`` (None stays None).

    Raises:
        ValueError: not a positive duration (the message shows the accepted forms)."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("time budget: give seconds or a duration such as 30m, 2h, 1h30m")
    if isinstance(v, (int, float)):
        sec = float(v)
    else:
        text = str(v).strip().lower().replace(" ", "")
        parts = re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", text)
        if not text or "".join(a + b for a, b in parts) != text or (len(parts) > 1 and not all(b for _, b in parts)):
            raise ValueError(f"time budget {v!r}: give seconds or a duration such as 30m, 2h, 1h30m")
        sec = sum(float(a) * _UNITS[b or "s"] for a, b in parts)
    if not sec > 0:
        raise ValueError(f"time budget must be positive (got {v!r})")
    return sec


#: A wall-clock duration in seconds, read from ``30m`` / ``2h`` / ``1h30m`` / a number of seconds.
Duration = Annotated[float, BeforeValidator(parse_duration)]


def time_budget_steps(cls, data: Any) -> Any:
    """``schedule`` validator: a time budget chooses T, so it means ``steps: auto``; a fixed T or
    epochs beside it, or a second budget (``compute_budget``), is refused naming the fix."""
    if not isinstance(data, dict) or data.get("time_budget") is None:
        return data
    data = dict(data)
    if data.get("steps") is None and data.get("epochs") is None:
        data["steps"] = "auto"
    if data.get("steps") != "auto" or data.get("epochs") is not None:
        raise ValueError("schedule.time_budget chooses the number of steps: set schedule.steps: auto and no "
                         "schedule.epochs (dpft train/tune --time-budget does), or drop the time budget")
    if data.get("compute_budget") is not None:
        raise ValueError("schedule: give time_budget or compute_budget, not both")
    return data


#: Recipe keys a search may vary. The first group changes the privacy cost of a trial (q, steps):
#: those must be ``choice`` (a finite set of configurations, each calibrated and bounded).
PRIVACY_KEYS = ("batch.expected_batch_size", "schedule.steps", "schedule.epochs", "trainable.mode")
#: The scopes a search may choose between (``trainable.mode`` in ``tune.space``; each brings its own batch and
#: schedule for the fit rows, run/scope.py). LP-FT is not among them: it splits a target ε between two phases
#: at two sampling rates, while a search's trial runs at the σ the search calibrates for one (q, T) per
#: candidate (run/tune.py), so ``dpft tune`` refuses it up front (run/tune_space.py ``check_search_methods``).
SCOPE_CHOICES = ("head", "last_k", "full", "lora")
FREE_KEYS = ("optimizer.lr", "optimizer.head_lr", "optimizer.weight_decay", "privacy.clipping.max_norm",
             "trainable.last_k", "trainable.lora.r", "trainable.lora.alpha")


_Strict = PluginConfig


def is_method_key(key: str) -> bool:
    """``methods.<name>.<field>``: a method's setting (which methods may be searched is checked by
    run/tune.py against the method registry: the schema imports no method)."""
    parts = key.split(".")
    return len(parts) >= 3 and parts[0] == "methods" and all(parts)


class TrialsCfg(_Strict):
    """The law of the number of trials K (Papernot & Steinke 2022): the user gives its mean."""

    #: ``truncated_negative_binomial`` (K ≥ 1; η = 1 geometric, η = 0 logarithmic) or ``poisson``
    #: (K = 0 possible: the search then releases no model, and its ε is still spent).
    distribution: Literal["truncated_negative_binomial", "poisson"] = "truncated_negative_binomial"
    #: E[K]; > 1 for the truncated negative binomial.
    mean: float = Field(5.0, gt=0)
    #: η of the truncated negative binomial (> −1).
    eta: float = Field(1.0, gt=-1)
    #: With ``schedule.time_budget``: each trial gets budget / E[K] (None, default: the search takes
    #: the budget on average, longer when K > E[K]) or budget / k_p with k_p the p-quantile of K
    #: (the search fits the budget with probability ≥ p; shorter trials). K's law is never changed.
    time_quantile: Optional[float] = Field(None, gt=0, lt=1)


class TuneCfg(_Strict):
    """A private random search (``dpft tune``). The run's ``privacy.target_epsilon`` is the budget of
    the WHOLE search (all trials, their scores and the selection)."""

    trials: TrialsCfg = TrialsCfg()
    #: Search space: ``{recipe.key: {choice: [...]}}`` or ``{recipe.key: {log_uniform: [lo, hi]}}``.
    space: dict[str, dict[str, list[Any]]] = {}
    #: σ of the Gaussian noise on each trial's count of correct predictions on the held-out
    #: scoring rows (sensitivity 1 under add/remove of one row). Unused with ``task.dev_public``.
    score_noise_multiplier: float = Field(10.0, gt=0)
    #: Fraction of the private training rows held out to score trials (a keyed hash of each row's
    #: content decides, so one row's presence moves no other row). Unused with ``task.dev_public``.
    score_fraction: float = Field(0.1, gt=0, lt=0.5)

    @model_validator(mode="after")
    def _space_ok(self):
        for key, spec in self.space.items():
            if key not in PRIVACY_KEYS + FREE_KEYS and not is_method_key(key):
                raise ValueError(f"tune.space: {key!r} cannot be searched; allowed: {', '.join(PRIVACY_KEYS + FREE_KEYS)}"
                                 ", and methods.<method>.<field> of a method that leaves the privacy events "
                                 "unchanged (docs/tune.md)")
            if len(spec) != 1 or next(iter(spec)) not in ("choice", "log_uniform"):
                raise ValueError(f"tune.space.{key}: give one of {{choice: [..]}} or {{log_uniform: [lo, hi]}}")
            kind, vals = next(iter(spec.items()))
            if key in PRIVACY_KEYS and kind != "choice":
                raise ValueError(f"tune.space.{key} changes a trial's privacy cost: it must be a choice of values "
                                 "(each is calibrated and bounded), not log_uniform")
            if kind == "log_uniform" and not (len(vals) == 2 and 0 < float(vals[0]) < float(vals[1])):
                raise ValueError(f"tune.space.{key}: log_uniform needs [lo, hi] with 0 < lo < hi")
            if kind == "choice" and not vals:
                raise ValueError(f"tune.space.{key}: choice needs at least one value")
            if key == "trainable.mode" and not set(vals) <= set(SCOPE_CHOICES):
                raise ValueError(f"tune.space.trainable.mode: choose among {', '.join(SCOPE_CHOICES)} (each brings "
                                 "its own batch and schedule for the fit rows; run/scope.py)")
        if self.trials.distribution == "truncated_negative_binomial" and self.trials.mean <= 1:
            raise ValueError("tune.trials.mean must be > 1 for a truncated negative binomial K (K ≥ 1)")
        if "schedule.steps" in self.space and "schedule.epochs" in self.space:
            raise ValueError("tune.space: search schedule.steps or schedule.epochs, not both")
        return self
