"""One process owns a run folder: an OS-level lock taken before anything is written into it.

Two runs started into one folder used to both run (issue 36 item 1): the ledger then listed the
releases of one run for the steps of both, ``metrics.jsonl`` interleaved them and the model and
report were those of whichever finished last. :class:`RunLock` holds ``fcntl.flock`` (an
exclusive, non-blocking advisory lock) on a lock file for as long as the process writes:

- the lock file is ``<folder>/.dpft.lock`` for a run folder (:meth:`RunLock.for_dir`: ``dpft
  train``, ``DPTrainer``'s ``output_dir``) and ``<file>.lock`` beside a single state file
  (:meth:`RunLock.for_file`: ``make_private``'s state path);
- it holds the holder's pid, host, start time and command line (JSON), written after the lock is
  taken, so that a refused process can name who holds the folder and how to free it;
- the kernel releases a ``flock`` when its holder exits, however it exits (``kill -9``
  included), so a lock is never left held by a dead process on this host. The file's contents
  do stay behind: a lock file that names a holder but is free was left by a process that ended
  without releasing it (a crash); it is *stale* and taken over, with a message naming the
  process that left it. A clean release empties the file;
- forked children (DataLoader workers, ``multiprocessing``) close their copy of the lock's file
  descriptor at fork, so a surviving child never keeps the folder locked after its parent died;
- released on :meth:`RunLock.release`, at the end of a ``with`` block and at interpreter exit
  (``atexit``), whichever comes first.

Under ``torchrun`` only rank 0 takes the lock (it alone writes the folder; see
``dpft.placement.world.World.is_main``): take it where ``world.is_main`` (or ``RANK`` is 0).

Imports nothing of dpft but :mod:`dpft.errors`, so every way in (``run/``, ``api/``,
``integrations/``) can use it.

Usage::

    with RunLock.for_dir(run_dir):          # raises RunLockError when another process holds it
        ...write the run folder...

    lock = RunLock.for_file(state_path).acquire()   # held until lock.release() or exit
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from dpft.errors import RunLockError

try:  # POSIX; on other systems the lock is a no-op with a warning (see RunLock.acquire)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLock", "RunLockError", "is_locked", "read_holder"]

#: Name of the lock file inside a run folder.
LOCK_NAME = ".dpft.lock"

_HELD: "weakref.WeakSet[RunLock]" = weakref.WeakSet()


def _close_in_child() -> None:
    # A forked child must not keep a parent's lock alive: flock belongs to the open file
    # description, shared by every descriptor of it, and is released when the last one closes.
    for lock in list(_HELD):
        lock._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def read_holder(lock_file: str | Path) -> Optional[dict]:
    """The holder recorded in ``lock_file`` (``{"pid", "host", "started", "command"}``), or None
    when the file is absent, empty (released cleanly) or unreadable."""
    try:
        text = Path(lock_file).read_text()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        d = json.loads(text)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def is_locked(lock_file: str | Path) -> bool:
    """Whether a live process holds ``lock_file`` now (creates nothing; False if it is absent).
    For a run folder pass ``folder / LOCK_NAME``."""
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def describe_holder(h: Optional[dict]) -> str:
    """``pid 123 on host h (since 2026-11-27 17:20:01 UTC: dpft train …)`` from a holder record."""
    if not h:
        return "another process (its lock file names no holder)"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h["started"])) if isinstance(
        h.get("started"), (int, float)) else "?"
    cmd = h.get("command") or ""
    if len(cmd) > 120:
        cmd = cmd[:117] + "…"
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')} (since {when}{': ' + cmd if cmd else ''})"


class RunLock:
    """An exclusive lock on a run folder or state file, held by one process.

    Args:
        lock_file: the lock file (created with its parent folders).
        what: what is locked, for messages (``"run folder runs/x"``).
        fix: the sentence that ends a refusal (how to proceed).
        log: called with the stale-lock message when a stale lock is taken over (default:
            a line on stderr).

    Raises (from :meth:`acquire`):
        RunLockError: another live process holds the lock; the message names it (pid, host,
            start, command), the lock file and the fix.
        OSError: the lock file cannot be created (e.g. a read-only folder).
    """

    def __init__(self, lock_file: str | Path, *, what: Optional[str] = None, fix: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = None):
        self.path = Path(lock_file)
        self.what = what or f"{self.path.parent}"
        self.fix = fix or ("wait for it to finish, stop it (kill PID), or choose another output folder")
        self.log = log or (lambda m: print(m, file=sys.stderr))
        self._fd: Optional[int] = None
        #: The holder this lock took over from (a stale lock), else None.
        self.took_over: Optional[dict] = None

    @classmethod
    def for_dir(cls, folder: str | Path, **kw) -> "RunLock":
        """The lock of run folder ``folder`` (``folder/.dpft.lock``)."""
        folder = Path(folder)
        kw.setdefault("what", f"run folder {folder}")
        kw.setdefault("fix", "wait for that run to finish, stop it (kill PID), or give this run another "
                             "--output-dir")
        return cls(folder / LOCK_NAME, **kw)

    @classmethod
    def for_file(cls, state_file: str | Path, **kw) -> "RunLock":
        """The lock of a single state file (``state_file.lock`` beside it)."""
        state_file = Path(state_file)
        kw.setdefault("what", f"state file {state_file}")
        kw.setdefault("fix", "wait for that process to finish, stop it (kill PID), or give this one another "
                             "state path")
        return cls(state_file.with_name(state_file.name + ".lock"), **kw)

    @property
    def held(self) -> bool:
        """This process holds the lock now."""
        return self._fd is not None

    def acquire(self) -> "RunLock":
        """Take the lock (non-blocking) or raise :class:`RunLockError`; returns ``self``.

        Idempotent: acquiring a lock this object already holds does nothing."""
        if self._fd is not None:
            return self
        for _ in range(10):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if fcntl is None:  # pragma: no cover - no flock on this system
                self.log(f"warning: no OS file locks here: {self.what} is not protected against a second run")
                self._fd = fd
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                holder = read_holder(self.path)
                for _ in range(20):  # the holder writes its record just after taking the lock
                    if holder is not None:
                        break
                    time.sleep(0.05)
                    holder = read_holder(self.path)
                raise RunLockError(self._refusal(holder)) from None
            try:  # still the file at this path? (a holder may have removed it: see release(remove=True))
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:  # pragma: no cover - the file vanished ten times in a row
            raise RunLockError(f"{self.what}: its lock file {self.path} keeps being removed; retry")
        previous = read_holder(self.path)
        if previous is not None:
            # Free but not emptied: its holder ended without releasing it (crash, kill -9).
            self.took_over = previous
            here = previous.get("host") == socket.gethostname()
            gone = here and isinstance(previous.get("pid"), int) and not _pid_alive(previous["pid"])
            state = ("which is no longer running" if gone else
                     "which no longer holds it" if here else "on another host, which no longer holds it")
            self.log(f"{self.what}: taking over a stale lock left by {describe_holder(previous)}, {state} "
                     f"(it ended without releasing {self.path.name}, e.g. killed)")
        prog = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
        prog_name = prog.parent.name if prog.name == "__main__.py" else prog.name  # python -m dpft: dpft
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "command": " ".join([prog_name, *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD.add(self)
        atexit.register(self.release)
        return self

    def _refusal(self, holder: Optional[dict]) -> str:
        here = holder is not None and holder.get("host") == socket.gethostname()
        extra = ""
        if here and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"]):
            # Its recorded pid is gone but the lock is held: a child that outlived it holds it.
            extra = (f"; pid {holder['pid']} has exited but a process it started still holds the lock "
                     f"(find it with: fuser {self.path})")
        pid = holder.get("pid") if holder else None
        fix = self.fix.replace("PID", str(pid)) if pid is not None else self.fix.replace(" (kill PID)", "")
        return (f"{self.what} is in use by {describe_holder(holder)}{extra}: one process writes a run folder at "
                f"a time (lock file {self.path}); {fix}")

    def release(self, remove: bool = False) -> None:
        """Empty the lock file and release the lock (idempotent; a clean release leaves no stale lock).

        ``remove``: delete the lock file too (while still holding it, so that a process that
        opened it meanwhile sees it gone and retries on a new one), and its folder when that is
        then empty: for a run refused before it wrote anything."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        try:
            os.ftruncate(fd, 0)
            if remove:
                self.path.unlink()
                try:
                    self.path.parent.rmdir()  # only when empty
                except OSError:
                    pass
        except OSError:
            pass
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        try:
            atexit.unregister(self.release)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # the parent's descriptor keeps the lock
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({str(self.path)!r}, held={self.held})"
