"""What a finished run writes for people to use (issue 24): the model in standard Hugging Face
form (models/export.py), the test-file evaluation (run/predict.py) and the model card
(outputs/card.py). The driver (run/loop.py) calls :func:`save_run_model` and :func:`after_report`."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from dpft.outputs.card import write_model_cards


def save_run_model(trainer) -> dict[str, str]:
    """``model/`` (and ``model_merged/`` for LoRA with ``output.merge_lora``) of ``trainer``'s run:
    ``AutoModelFor…`` / ``pipeline`` folders with ``id2label`` from the task's labels."""
    from dpft.models.export import save_standard
    from dpft.models.load import resolve_model_path

    r = trainer.recipe
    labels = None if trainer.causal else list(trainer.task.label_names)
    stop = getattr(trainer.task, "stop_ids", None)
    if stop:  # instruct: generation stops where the completions were trained to end (data/stop.py)
        from dpft.data.stop import set_generation_stop

        set_generation_stop(trainer.model, stop)
    out = save_standard(trainer.model, trainer.tokenizer, Path(trainer.run_dir) / "model", labels=labels,
                        merge_lora=r.output.merge_lora, base_name=resolve_model_path(r.model.name))
    gc = getattr(trainer.model, "generation_config", None)
    if stop and gc is not None and not (Path(out["model"]) / "generation_config.json").is_file():
        gc.save_pretrained(out["model"])  # a LoRA adapter folder: dpft predict reads its stop ids
    return out


def after_report(trainer, rep: dict[str, Any]) -> None:
    """Model cards from the written report (``output.model_card``); the test metrics to the
    trackers (``log.report_to``), which are then closed."""
    tr = getattr(trainer, "trackers", None)
    if tr is not None:
        if rep.get("test"):
            tr.log({**rep["test"], "step": trainer.total_steps})
        tr.close()
    if trainer.recipe.output.model_card:
        write_model_cards(trainer.run_dir, rep)
