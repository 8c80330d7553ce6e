"""``dpft train``'s loading: the task's rows, the tokenizer and model on the run's device, and the
tokenised training and dev rows (with rows a caller adds before N is counted).

The slow part of building a run (run/plan.py ``build_plan``): it comes after every refusal that
needs no data (run/refuse.py), and before the privacy unit counts N.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from dpft.data.prepare import TrainData, build_train_data, load_rows, num_labels
from dpft.models.build import build_model
from dpft.placement.device import Placement, place_model

__all__ = ["load_run_data"]


def load_run_data(recipe, placement: Placement, methods: list, progress: bool,
                  extra_rows: Optional[Callable[[Any, TrainData, Any], TrainData]] = None
                  ) -> tuple[TrainData, Any, Any]:
    """The run's data and model: rows (δ < 1/N checked at once for a private run), tokenizer and
    model (trainable parameters selected, placed: device, activation checkpointing), tokenised rows.

    Args:
        placement: the run's device and precision (run/refuse.py ``refuse_and_place``).
        methods: the recipe's active methods (with any, the counts the tokeniser prints are hidden).
        progress: this process prints progress.
        extra_rows: ``(recipe, data, tokenizer) -> data``: rows added to the tokenised training rows
            before N is counted (the final-model audit's canaries, audit/final_model.py).

    Returns:
        ``(data, tokenizer, model)``.

    Raises:
        DataError, ModelError, CalibrationError: each naming the fix."""
    r, private = recipe, recipe.privacy.enabled
    task = load_rows(r, private)
    tokenizer, model = build_model(r, num_labels(task), device=placement.device)
    model = place_model(model, r.perf, placement.device)
    data = build_train_data(r, task, tokenizer, hide_counts=private or bool(methods), progress=progress)
    if extra_rows is not None:  # before the unit: N and q count the added rows
        data = extra_rows(r, data, tokenizer)
    return data, tokenizer, model
