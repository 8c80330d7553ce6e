"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM without losing or hiding a release.

The first signal asks the loop to stop after the current logical step: the step finishes
(its noise is released, its update applied), a checkpoint is written at that step, and the
loop raises :class:`TrainingInterrupted`. Since the checkpoint holds every release, a
``--resume`` replays no step. A second signal abandons the current step when nothing of it
has been released and the optimizer has not started its update (the checkpoint is then at
the step before); once its noise is out, the step is finished instead, so that the release
the ledger counts is not wasted. A third signal stops at once without a new checkpoint: the
live ledger keeps every release, and a resume replays (and the report counts) the steps since
the last checkpoint.

Handlers are installed only in the main thread (Python delivers signals there); elsewhere
the run is not interruptible this way.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable, Optional

#: Exit status of a process stopped by a signal (shell convention 128 + signal number).
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after writing its checkpoint.

    A ``KeyboardInterrupt`` so that code catching ``Exception`` does not swallow it.

    Attributes:
        signum: the first signal received (``signal.SIGINT`` or ``signal.SIGTERM``).
        step: logical steps completed (released and applied) when the run stopped.
        checkpoint_step: the step of the checkpoint in ``run_dir`` (== ``step`` unless the
            run was stopped hard by a third signal).
        abandoned: the step after ``step`` was started and abandoned before its release.
        run_dir: the run directory.
    """

    def __init__(self, signum: int, step: int, checkpoint_step: Optional[int], total_steps: int,
                 run_dir, abandoned: bool = False, hard: bool = False, released: Optional[int] = None):
        self.signum, self.step, self.checkpoint_step = signum, step, checkpoint_step
        #: Steps whose noise is in the ledger (``step``, or one more when a hard stop came after
        #: the release of the step in flight).
        self.released = step if released is None else released
        self.total_steps, self.run_dir, self.abandoned, self.hard = total_steps, run_dir, abandoned, hard
        super().__init__(self.describe())

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130)

    def describe(self) -> str:
        """``interrupted at step N; checkpoint at step N`` (and what happened to a step in flight)."""
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = str(self.signum)
        s = f"interrupted ({name}) at step {self.step} of {self.total_steps}"
        if self.abandoned:
            s += f" (step {self.step + 1} abandoned before its noise was released)"
        ck = ("no checkpoint" if self.checkpoint_step is None else f"checkpoint at step {self.checkpoint_step}")
        s += f"; {ck}"
        last = self.checkpoint_step or 0
        if self.hard and last < self.released:
            s += (f" (stopped hard: steps {last + 1}–{self.released} are in the ledger and a resume "
                  "releases them again, which the ledger and the report count)")
        return s


class _Abandon(KeyboardInterrupt):
    """Raised inside a step by the second signal while nothing of the step is released."""


class _HardStop(KeyboardInterrupt):
    """Raised by the third signal: stop now, no new checkpoint."""


class StopOnSignal:
    """Context manager: SIGINT/SIGTERM set :attr:`signum` instead of killing the process.

    Args:
        can_abandon: called in the handler on a second signal; True when the step in
            progress has released nothing and not begun its update (it is then abandoned by
            raising inside it).
        log: where the handler writes what it does (stderr through tqdm).
    """

    def __init__(self, can_abandon: Callable[[], bool], log: Callable[[str], None]):
        self.can_abandon = can_abandon
        self.log = log
        self.signum: Optional[int] = None
        self.count = 0
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.count == 1:
            self.log("stopping: finishing the current step, then writing a checkpoint (signal again to abandon "
                     "the step if its noise is not yet released)")
            return
        if self.count == 2 and self.can_abandon():
            raise _Abandon()
        if self.count == 2:
            self.log("this step's noise is already released (or no step is running): finishing it so that the "
                     "release is not wasted; signal once more to stop at once without a checkpoint")
            return
        raise _HardStop()

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()
