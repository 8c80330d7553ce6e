"""dpft: differentially private fine-tuning of language models.

One engine (Poisson sampling → per-example gradients → clipping → Gaussian noise →
post-processing → optimizer), one ledger of ``dp_accounting`` events per run, three ways in:

- ``dpft train RECIPE`` (CLI) or :func:`dpft.train` (Python) for a complete run and a report;
- :class:`dpft.PrivacyEngine` ``.make_private(...)`` for your own PyTorch loop (Opacus-shaped);
- ``dpft.integrations.hf.trainer.DPTrainer`` for Hugging Face ``Trainer`` users.

Public names: :class:`PrivacyEngine`, :class:`DPStep`, :class:`Recipe`, :func:`train`,
:class:`PrivacyLedger`, :class:`Method`, :func:`register_method`, :func:`register_layer`,
:func:`load_recipe`. They are imported on first use (``import dpft`` stays light).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_NAMES = {
    "PrivacyEngine": "dpft.api",
    "DPStep": "dpft.step.pipeline",
    "StepSpec": "dpft.step.pipeline",
    "Recipe": "dpft.config.recipe",
    "PluginConfig": "dpft.config.base",
    "load_recipe": "dpft.config.recipe",
    "PrivacyLedger": "dpft.accounting.ledger",
    "Method": "dpft.methods.base",
    "register_method": "dpft.methods.base",
    "register_layer": "dpft.grads.registry",
    "unregister_layer": "dpft.grads.registry",
    "Randomness": "dpft.privacy.randomness",
    "DPTrainer": "dpft.integrations.hf.trainer",
    "DPArguments": "dpft.integrations.hf.trainer",
}

__all__ = ["__version__", "train", "tune", *_NAMES]


def tune(recipe: Any, output_dir: Any, *, resume: bool = False, progress: bool = True,
         overrides: dict[str, Any] | None = None, time_budget: Any = None) -> dict[str, Any]:
    """Private hyperparameter search (the CLI's ``dpft tune`` from Python; run/tune.py): returns report.json.

    Args: as :func:`train`; ``recipe`` needs a ``tune:`` section; its ``privacy.target_epsilon`` is the
    budget of the whole search; ``time_budget`` the wall-clock budget of the whole search."""
    from dpft.run.tune import tune as _tune

    rec = _recipe_of(recipe, _with_time_budget(overrides, time_budget))
    return _tune(rec, output_dir, resume=resume, progress=progress)


def _with_time_budget(overrides: dict[str, Any] | None, time_budget: Any) -> dict[str, Any] | None:
    """``time_budget`` (``"30m"``, ``"2h"``, seconds) as overrides: T is chosen by it (``steps: auto``)."""
    if time_budget is None:
        return overrides
    return {**(overrides or {}), "schedule.time_budget": time_budget, "schedule.steps": "auto", "schedule.epochs": None}


def _hand_method_registry() -> None:
    """Hand the recipe schema the method registry (importing ``dpft.methods`` does; the schema
    imports no method): deferred so that ``import dpft`` stays light."""
    import dpft.methods  # noqa: F401


def _recipe_of(recipe: Any, overrides: dict[str, Any] | None):
    """A :class:`Recipe` from a Recipe, a dict of keys or a YAML path, with ``overrides`` applied."""
    from dpft.config.recipe import Recipe, apply_overrides, load_recipe

    _hand_method_registry()

    if isinstance(recipe, Recipe):
        return recipe if not overrides else load_recipe(None, apply_overrides(recipe.model_dump(mode="json"),
                                                                              dict(overrides)))
    if isinstance(recipe, dict):
        return load_recipe(None, apply_overrides(dict(recipe), dict(overrides or {})))
    return load_recipe(recipe, overrides)


#: Names whose use loads a recipe: the recipe schema is handed the method registry first.
_RECIPE_NAMES = {"Recipe", "load_recipe"}


def __getattr__(name: str) -> Any:
    if name in _RECIPE_NAMES:
        _hand_method_registry()
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'dpft' has no attribute {name!r}")


def train(recipe: Any, output_dir: Any = None, *, resume: bool = False, progress: bool = True,
          overrides: dict[str, Any] | None = None, allow_overspend: bool = False,
          time_budget: Any = None) -> dict[str, Any]:
    """Run a recipe end to end (the CLI's ``dpft train`` from Python) and return report.json.

    Args:
        recipe: a :class:`Recipe`, a path to a YAML recipe, or a dict of recipe keys.
        output_dir: the run directory (default: ``recipe.output_dir`` or ``runs/<name>``).
        resume: continue the run in ``output_dir`` from its last checkpoint.
        progress: show the progress bar.
        overrides: dotted keys applied on top (``{"privacy.target_epsilon": 3}``).
        allow_overspend: with ``resume``, run every planned step even when releases made before a
            crash take ε above the target (default: stop within it; run/checkpoint.py).
        time_budget: wall-clock budget (``"30m"``, ``"2h"``, seconds): T (and B when ``auto``) chosen to
            fit it from a step timed on synthetic rows before σ is calibrated (run/timing.py).

    Returns:
        The report dict (also written to ``<output_dir>/report.json``): ``privacy`` holds the
        certified ε from the run's ledger, ``metrics`` the final dev metrics.

    Raises:
        RecipeError, DataError, ModelError, CalibrationError, TrainingError — each names the fix;
        RunLockError (a TrainingError): another process writes ``output_dir`` (outputs/lock.py).
    """
    import os
    from pathlib import Path

    from dpft.run.loop import Trainer
    from dpft.outputs.rundir import lock_output_dir, release_output_dir

    rec = _recipe_of(recipe, _with_time_budget(overrides, time_budget))
    from dpft.run.auto import resolve_auto

    out = Path(output_dir or rec.output_dir or Path("runs") / rec.name)
    rec, chosen = resolve_auto(rec, resume_dir=out if resume else None)  # batch/steps auto (accounting/budget.py)
    if chosen and progress:
        import sys

        print(chosen, file=sys.stderr)
    # One process writes a run folder (outputs/lock.py): rank 0 of a torchrun world holds its lock.
    lock = lock_output_dir(out, resume) if int(os.environ.get("RANK", "0") or 0) == 0 else None
    try:
        return Trainer(rec, out, resume=resume, progress=progress, allow_overspend=allow_overspend).run()
    finally:
        if lock is not None:
            release_output_dir(lock)
