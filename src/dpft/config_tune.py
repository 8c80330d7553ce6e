"""Recipe schema of ``tune:`` (private hyperparameter search; run/tune.py, accounting/selection.py).

Kept apart from config.py (which imports it) so that the recipe schema stays within its size."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dpft.config_base import PluginConfig

#: Recipe keys a search may vary. The first group changes the privacy cost of a trial (q, steps):
#: those must be ``choice`` (a finite set of configurations, each calibrated and bounded).
PRIVACY_KEYS = ("batch.expected_batch_size", "schedule.steps", "schedule.epochs")
FREE_KEYS = ("optimizer.lr", "optimizer.head_lr", "optimizer.weight_decay", "privacy.clipping.max_norm",
             "trainable.last_k", "trainable.lora.r", "trainable.lora.alpha")


_Strict = PluginConfig


class TrialsCfg(_Strict):
    """The law of the number of trials K (Papernot & Steinke 2022): the user gives its mean."""

    #: ``truncated_negative_binomial`` (K ≥ 1; η = 1 geometric, η = 0 logarithmic) or ``poisson``
    #: (K = 0 possible: the search then releases no model, and its ε is still spent).
    distribution: Literal["truncated_negative_binomial", "poisson"] = "truncated_negative_binomial"
    #: E[K]; > 1 for the truncated negative binomial.
    mean: float = Field(5.0, gt=0)
    #: η of the truncated negative binomial (> −1).
    eta: float = Field(1.0, gt=-1)


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
            if key not in PRIVACY_KEYS + FREE_KEYS:
                raise ValueError(f"tune.space: {key!r} cannot be searched; allowed: {', '.join(PRIVACY_KEYS + FREE_KEYS)}")
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
        if self.trials.distribution == "truncated_negative_binomial" and self.trials.mean <= 1:
            raise ValueError("tune.trials.mean must be > 1 for a truncated negative binomial K (K ≥ 1)")
        if "schedule.steps" in self.space and "schedule.epochs" in self.space:
            raise ValueError("tune.space: search schedule.steps or schedule.epochs, not both")
        return self
