"""Audit check: no data error quotes a label value (issue 44 item 5, ``docs/bad_inputs.md``).

A label column may hold private text (text and label columns swapped, a free-text "reason"
column), and an error message goes to screens, logs and bug reports that no ledger covers. Every
refusal of the reading path that can see labels is driven here with a distinctive planted label
(:data:`SECRET`, and :data:`SECRET_NUMBER` for the paths that need numbers) through
:func:`dpft.data.tasks.load_task`, and the full text of the error (message and traceback) must
not contain it:

* a dev label not among the training labels; a training label outside a task's label set;
* a string label among numbers (mixed types); a number that is not whole; an integer label
  outside 0..K-1; integer labels with gaps;
* one class; more classes than N/10 (columns swapped); a class of fewer than 5 rows.

Planted ``label_quoted``: the message helper that describes an offending label
(``tasks._kind``) quotes its value instead, as the messages before issue 44 did for
non-integer and out-of-range labels; the check must FAIL.
"""

from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Optional

from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.config.recipe import TaskCfg
from dpft.data import tasks
from dpft.data.tasks import DataError

__all__ = ["PLANTED", "SECRET", "SECRET_NUMBER", "error_cases", "data_checks", "planted_bug"]

PLANTED = ("label_quoted",)
#: the planted label (a string) and its numeric counterpart (its digits must not appear either)
SECRET = "ZZSECRETLABEL42"
SECRET_NUMBER = 424242


def _plant_quoted(p) -> None:

    p.set(tasks, "_kind", lambda v: repr(v))


planted_bug = bug_planter(PLANTED, {"label_quoted": _plant_quoted})


def _write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    return str(path)


def _rows(labels) -> list[dict]:
    return [{"text": f"row {i}", "label": v} for i, v in enumerate(labels)]


def error_cases(d: Path) -> dict[str, Callable[[], object]]:
    """``{case: call}``: each call must raise a DataError whose text never holds the planted
    label. Files are written under ``d``. Sizes are the smallest that reach each check."""

    s, n = SECRET, SECRET_NUMBER

    def files(name, train, dev, ext=".csv"):
        cfg = TaskCfg(name="files", train_file=_write(d / f"{name}-t{ext}", _rows(train)),
                      dev_file=_write(d / f"{name}-d{ext}", _rows(dev)))
        return lambda: tasks.load_task(cfg)

    def label_set():
        import datasets

        def ds(labels):
            return datasets.Dataset.from_dict({"label": labels, tasks._ROW: list(range(1, len(labels) + 1))})
        return tasks._encode_labels(ds(["neg", s, "pos"]), ds(["pos"]), "task t (train)", "task t (dev)",
                                    label_names=["neg", "pos"])

    return {
        "unknown label in the dev file": files("dev", ["pos", "neg"] * 3, ["pos", s]),
        "label not in the task's label set": label_set,
        "string among numbers (mixed types)": files("mixed", [0, 1, s, 1], [0, 1], ext=".jsonl"),
        "number that is not whole": files("frac", [0, 1, n + 0.5, 1], [0, 1], ext=".jsonl"),
        "integer outside 0..K-1 (dev file)": files("range", [0, 1, 0, 1], [0, n]),
        "integer outside 0..K-1 (negative)": files("neg", [0, 1, -n, 1], [0, 1]),
        "integer labels with gaps": files("gaps", [0, n] * 3, [0, n]),
        "one class": files("one", [s] * 6, [s]),
        "more classes than N/10": files("many", [f"{s}{i}" for i in range(200)], ["x"]),
        "a class of fewer than 5 rows": files("rare", ["pos", "neg"] * 60 + [s] * 2, ["pos"]),
    }


def leaked(text: str) -> bool:
    """Whether ``text`` holds the planted label (or its number's digits)."""
    return SECRET in text or str(SECRET_NUMBER) in text


def run_case(call: Callable[[], object]) -> tuple[bool, str]:
    """(refused with a DataError, its full text: type, message and traceback)."""

    try:
        call()
    except DataError as exc:
        return True, "".join(traceback.format_exception(exc))
    return False, "accepted"


def data_checks(planted: Optional[str] = None) -> list[Check]:
    """One check: every case of :func:`error_cases` refused, none quoting the planted label;
    ``planted`` one of :data:`PLANTED` (or None)."""
    with planted_bug(planted), tempfile.TemporaryDirectory() as d:
        results = {name: run_case(call) for name, call in error_cases(Path(d)).items()}
    quoted = [k for k, (_, text) in results.items() if leaked(text)]
    accepted = [k for k, (refused, _) in results.items() if not refused]
    ok = not quoted and not accepted
    msg = (f"{len(results)} data error paths driven with a planted label: none quotes it" if ok else
           f"quoted the planted label: {quoted or 'none'}; accepted: {accepted or 'none'}")
    return [Check("data: no error message quotes a label value", ok, msg,
                  {"paths": len(results), "quoted": len(quoted), "accepted": len(accepted)})]
