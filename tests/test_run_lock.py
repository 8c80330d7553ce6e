"""One process owns a run folder (issue 36 item 1): outputs/lock.py across real processes, and
``dpft train`` refusing a folder another process is writing, before anything is loaded."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
from typer.testing import CliRunner

from dpft.errors import RunLockError
from dpft.outputs.lock import LOCK_NAME, RunLock, is_locked, read_holder
from lock_worker import _contend, _hold, _hold_then_hang

_CTX = mp.get_context("spawn")  # a clean interpreter per process, as two `dpft train` would be



def test_two_processes_started_together_one_is_refused_naming_the_holder(tmp_path):
    barrier, results = _CTX.Barrier(2), _CTX.Queue()
    procs = [_CTX.Process(target=_contend, args=(str(tmp_path / "run"), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    kinds = sorted(g[0] for g in got)
    assert kinds == ["holds", "refused"], got
    holder = next(g[1] for g in got if g[0] == "holds")
    msg = next(g[2] for g in got if g[0] == "refused")
    assert f"run folder {tmp_path / 'run'} is in use by pid {holder} on host {socket.gethostname()}" in msg
    assert f"stop it (kill {holder})" in msg and "another --output-dir" in msg
    assert not is_locked(tmp_path / "run" / LOCK_NAME)  # released at the end
    assert read_holder(tmp_path / "run" / LOCK_NAME) is None  # emptied: a clean release leaves no stale lock



@pytest.mark.parametrize("fork_child", [False, True])
def test_a_killed_holders_lock_is_stale_and_taken_over_with_a_message(tmp_path, fork_child):
    ready = _CTX.Queue()
    p = _CTX.Process(target=_hold_then_hang, args=(str(tmp_path / "run"), fork_child, ready))
    p.start()
    child = ready.get(timeout=120)
    try:
        with pytest.raises(RunLockError, match=f"in use by pid {p.pid}"):
            RunLock.for_dir(tmp_path / "run").acquire()
        os.kill(p.pid, signal.SIGKILL)  # no release, no atexit: the file still names it
        t0 = time.monotonic()
        while p.exitcode is None and time.monotonic() - t0 < 30:  # reaped (join would wait for the forked child)
            time.sleep(0.05)
        assert read_holder(tmp_path / "run" / LOCK_NAME)["pid"] == p.pid
        said = []
        with RunLock.for_dir(tmp_path / "run", log=said.append) as lock:
            assert lock.took_over["pid"] == p.pid
            assert read_holder(lock.path)["pid"] == os.getpid()
        assert len(said) == 1 and f"taking over a stale lock left by pid {p.pid}" in said[0]
        assert "no longer running" in said[0]
        if child:  # the forked worker still runs, yet it did not keep the folder locked
            os.kill(child, 0)
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        if p.is_alive():
            p.kill()


def test_lock_for_a_state_file_and_reentry_in_one_process(tmp_path):
    state = tmp_path / "dp_state.pt"
    with RunLock.for_file(state) as a:
        assert a.path == tmp_path / "dp_state.pt.lock" and a.held
        assert a.acquire() is a  # idempotent
        with pytest.raises(RunLockError, match="state file .*dp_state.pt is in use by pid"):
            RunLock.for_file(state).acquire()  # a second open of the same file: refused too
    assert not a.held and not is_locked(a.path)
    RunLock.for_file(state).acquire().release()



def test_dpft_train_refuses_a_folder_another_process_writes_before_loading(tmp_path, monkeypatch, sst_like_files):
    import dpft.data.tasks as tasks
    from dpft.cli.commands import app
    import dpft.models.build as build

    def boom(*a, **k):
        raise AssertionError("loaded data or a model before the lock")

    monkeypatch.setattr(tasks, "load_task", boom)
    monkeypatch.setattr(build, "load_classifier", boom)
    out = tmp_path / "run"
    ready, stop = _CTX.Queue(), _CTX.Queue()
    p = _CTX.Process(target=_hold, args=(str(out), ready, stop))
    p.start()
    pid = ready.get(timeout=120)
    try:
        for extra in ([], ["--resume"]):  # with --resume the checkpoint check would fail first: the lock is named
            r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "-o", str(out), *extra])
            assert r.exit_code == 2, r.output
            flat = " ".join(r.output.split())
            assert f"error: run folder {out} is in use by pid {pid} on host {socket.gethostname()}" in flat
            assert "Traceback" not in r.output
            assert sorted(x.name for x in out.iterdir()) == [LOCK_NAME]  # nothing written
    finally:
        stop.put(1)
        p.join(timeout=60)
    # the folder's own run, once the holder is gone: the default run-folder choice skips a locked one
    monkeypatch.chdir(tmp_path)
    from dpft.cli.commands import _default_run_dir

    (tmp_path / "runs" / "x").mkdir(parents=True)
    with RunLock.for_dir(tmp_path / "runs" / "x"):
        assert _default_run_dir("x", False, False)[0].as_posix() == "runs/x-2"
    assert _default_run_dir("x", False, False)[0].as_posix() == "runs/x"
