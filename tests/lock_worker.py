"""Processes that take a run lock for tests/test_run_lock.py (a light module: a spawned
process imports only this and dpft.outputs.lock, not the CLI)."""

from __future__ import annotations

import os
import time

from dpft.errors import RunLockError
from dpft.outputs.lock import RunLock


def _contend(folder: str, barrier, results) -> None:
    barrier.wait()  # both processes try at once
    try:
        lock = RunLock.for_dir(folder).acquire()
    except RunLockError as exc:
        results.put(("refused", os.getpid(), str(exc)))
        return
    results.put(("holds", os.getpid(), ""))
    time.sleep(3.0)  # hold it while the other one tries
    lock.release()


def _hold_then_hang(folder: str, fork_child: bool, ready) -> None:
    RunLock.for_dir(folder).acquire()
    if fork_child:  # a DataLoader-like worker forked while the lock is held outlives its parent
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        ready.put(pid)
    else:
        ready.put(None)
    time.sleep(60)


def _hold(folder: str, ready, stop) -> None:
    lock = RunLock.for_dir(folder).acquire()
    ready.put(os.getpid())
    stop.get(timeout=120)
    lock.release()
