"""Helpers shared by the ``dpft`` commands (cli.py, cli_methods.py): errors, recipe overrides,
run names."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, get_args

import typer
from dpft.config.recipe import _parse_scalar

__all__ = ["fail", "choices", "overrides", "name_run"]


def fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg="red", err=True)
    raise typer.Exit(code)


def choices(model: type, field: str) -> str:
    """The allowed values of a ``Literal`` recipe field, read from the pydantic model so that
    a flag's help cannot fall behind the schema."""
    return ", ".join(str(v) for v in get_args(model.model_fields[field].annotation))


def overrides(flags: tuple = (), set: Optional[List[str]] = None) -> tuple[dict, dict]:
    """Recipe overrides from named flags and ``--set`` items, and where each came from.

    ``flags``: ``(flag, recipe key, value)`` of every named option (value None = not given).
    Returns ``(overrides, origins)``; ``origins[key]`` is the flag as typed (``--set
    privacy.epsilon=3``, ``--epsilon 3``) so that a bad value blames that flag."""
    out: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for flag, key, value in flags:
        if value is None:
            continue
        out[key] = value
        origins[key] = f"{flag} {value}"
    for item in set or []:
        if "=" not in item:
            fail(f"--set expects key=value (e.g. --set optimizer.lr=1e-3), got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_scalar(v)
        origins[k.strip()] = f"--set {item}"
    return out, origins


def model_short_name(model: str) -> str:
    """``minilm`` → ``minilm``; ``/models/tinybert/`` → ``tinybert``; ``org/name`` → ``name``."""
    return Path(model.rstrip("/\\")).name or model


def name_run(rec, ov: dict) -> None:
    """Name the run after its data unless a name was given (``--name``, ``--set name=…``).

    A training file given on the command line names the run (``--train-file notes.csv`` →
    ``notes``), even over the name of the recipe it overrides (which describes the recipe's own
    data); without a name anywhere the run is ``<task>-<model>`` (``sst2-minilm``), or the
    training file's stem for a task read from files."""
    if "name" in ov:
        return
    if "task.train_file" in ov or "name" not in rec.model_fields_set:
        tf = rec.task.train_file
        rec.name = (Path(tf).stem if tf else "") or f"{rec.task.name}-{model_short_name(rec.model.name)}"
