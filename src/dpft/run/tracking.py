"""Experiment tracking (``log.report_to: [tensorboard, wandb, mlflow]``), released quantities only.

What a tracker receives is a subset of ``metrics.jsonl`` (the release set, outputs/release.py):
ε, dev (and, at the end, test) metrics and the learning rate — an allow-list (:func:`trackable`),
so a private statistic (training loss, realised batch size, clip fraction, step time) can never
reach a tracker even if a row carried one by mistake. The trackers are optional extras
(``pip install dpft[tracking]``); a missing one is an error naming the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from dpft.outputs.release import PRIVATE_KEYS
from dpft.config.recipe import dump_recipe

#: Keys a tracker may receive besides ``dev_*`` / ``test_*`` metrics.
#: ``noisy_score``: a search's released score of its chosen trial (run/tune_report.py ``track_search``).
ALLOWED = frozenset({"epsilon", "lr", "noisy_score"})

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingError(ValueError):
    """A tracker named in ``log.report_to`` is not installed."""


def trackable(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``row`` a tracker may see: ε, lr, dev_*/test_* metrics (never a private key)."""
    out = {}
    for k, v in row.items():
        if k in PRIVATE_KEYS or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if k in ALLOWED or k.startswith(("dev_", "test_")):
            out[k] = float(v)
    return out


class Trackers:
    """The run's trackers; ``log(row)`` sends :func:`trackable` ``row`` at ``row["step"]``."""

    def __init__(self, names: Sequence[str], run_dir: str | Path, run_name: str, config: dict[str, Any]):
        self.names = list(dict.fromkeys(names))
        self._tb = self._wandb = self._mlflow = None
        for n in self.names:
            try:
                if n == "tensorboard":
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
                elif n == "wandb":
                    import wandb

                    self._wandb = wandb.init(name=run_name, config=config, dir=str(run_dir))
                elif n == "mlflow":
                    import mlflow

                    self._mlflow = mlflow
                    mlflow.start_run(run_name=run_name)
                    mlflow.log_params(_flat(config))
            except ImportError:
                raise TrackingError(f"log.report_to: {n} is not installed; pip install {_PACKAGES[n]} "
                                    "(or pip install 'dpft[tracking]')") from None

    def log(self, row: dict[str, Any], step: Optional[int] = None) -> None:
        vals = trackable(row)
        step = int(row.get("step", step or 0))
        if not vals:
            return
        if self._tb is not None:
            for k, v in vals.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(vals, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics(vals, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = str(v)[:250]
    return out


def public_config(recipe) -> dict[str, Any]:
    """The recipe as sent to a tracker: public settings only (no mechanism seed unless
    reproducible, as in ``recipe.yaml``)."""
    import yaml

    return yaml.safe_load(dump_recipe(recipe))
