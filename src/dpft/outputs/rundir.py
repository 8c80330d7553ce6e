"""The run folder ``dpft train`` writes: refused before anything is loaded when this run cannot
use it (a file, not writable, a checkpoint to resume missing, an earlier run without
``--resume``, a finished run with ``--resume``), and locked for this process (outputs/lock.py)
before anything is written into it (issue 36 items 1 and 6)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dpft.errors import TrainingError
from dpft.outputs.lock import LOCK_NAME, RunLock, is_locked

__all__ = ["check_output_dir", "finished_run", "holds_run", "lock_output_dir", "release_output_dir"]


def holds_run(d: Path) -> bool:
    """``d`` holds a run: a checkpoint, a report, or a live process writing it (its lock)."""
    return any((d / f).exists() for f in ("checkpoint", ".checkpoint.old", "report.json")) or is_locked(d / LOCK_NAME)


def finished_run(run_dir: Path) -> str | None:
    """``"step T of T"`` when ``run_dir`` holds a finished run (its checkpoint is at its last step
    and its report is written), else None. A run whose last checkpoint is its last step but whose
    report is missing (stopped while writing the model) is not finished: ``--resume`` writes them."""
    st = Path(run_dir) / "checkpoint" / "state.json"
    if not st.is_file() or not (Path(run_dir) / "report.json").is_file():
        return None
    try:
        state = json.loads(st.read_text())
        step, total = int(state["step"]), int(state["total_steps"])
    except (ValueError, KeyError, TypeError):
        return None
    return f"step {step} of {total}" if step >= total else None


def check_output_dir(run_dir: Path, resume: bool) -> None:
    """Refuse, before anything is loaded, a run directory this run cannot use: not a folder, not
    writable, no checkpoint to resume, an earlier run's checkpoint without ``--resume``, or a
    finished run with ``--resume`` (it would evaluate the test set again and rewrite the release
    files).

    Raises:
        TrainingError: naming the fix; nothing was written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"output folder {run_dir} is a file; give --output-dir a folder")
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "output folder" if probe == run_dir else f"folder {probe} (where the output folder {run_dir} would go)"
        raise TrainingError(f"cannot write to the {what}: permission denied; choose a writable --output-dir")
    has_ck = (run_dir / "checkpoint" / "state.json").is_file() or (run_dir / ".checkpoint.old" / "state.json").is_file()
    if resume and not has_ck:
        raise TrainingError(f"--resume: no checkpoint in {run_dir}; run without --resume to start fresh (or give "
                            "the --output-dir of the run to continue)")
    if not resume and has_ck:
        raise TrainingError(f"{run_dir} already holds a run; pass --resume to continue it or choose another "
                            "--output-dir (nothing was overwritten)")
    done = finished_run(run_dir) if resume else None
    if done:
        raise TrainingError(f"--resume: the run in {run_dir} is finished ({done}, report.json written); nothing "
                            f"to resume and nothing was rewritten. Its report: dpft report {run_dir}; to train "
                            "more, start a new run in another --output-dir")


def lock_output_dir(run_dir: Path, resume: bool) -> RunLock:
    """Check ``run_dir`` (:func:`check_output_dir`), lock it for this process and check it again
    (a run that wrote its first checkpoint, or finished, between the two). Rank 0 only under
    torchrun. The caller releases the lock (also released at exit).

    Raises:
        TrainingError: the checks; RunLockError (a TrainingError): another process holds it."""
    try:
        check_output_dir(run_dir, resume)
    except TrainingError:
        if is_locked(run_dir / LOCK_NAME):  # a live run is writing it: name that run instead
            RunLock.for_dir(run_dir).acquire()  # raises RunLockError naming the holder
        raise
    created = not run_dir.exists()
    lock = RunLock.for_dir(run_dir).acquire()
    #: True when this run created the folder: a run refused before writing anything removes it.
    lock.created_dir = created
    try:
        check_output_dir(run_dir, resume)
    except TrainingError:
        release_output_dir(lock)
        raise
    return lock


def release_output_dir(lock: RunLock) -> None:
    """Release the run folder's lock; a folder this run created and left holding nothing but the
    lock file (a run refused before training: a bad device, model or data) is removed."""
    d = lock.path.parent
    empty = getattr(lock, "created_dir", False) and d.is_dir() and [p.name for p in d.iterdir()] == [LOCK_NAME]
    lock.release(remove=empty)
