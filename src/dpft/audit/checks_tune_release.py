"""Audit checks of what a private search lets out, and of its folder (issue 44 items 1 and 3).

* **silent trials** — a trial's recipe (run/tune.py ``_trial_recipe``) has no tracker, no periodic or
  test-file evaluation, no predictions or diagnostics file, whatever the search recipe asked; planted
  ``trial_publishes`` (the user's ``log.report_to``, ``eval.every_steps`` and ``task.test_file`` kept in
  every trial: K tracker runs with exact per-trial accuracies) fails it.
* **one process per search folder** — while another holder has the folder's lock, ``dpft.tune(...,
  resume=True)`` is refused with ``RunLockError`` before it reads anything; planted ``search_skips_lock``
  (the lock not taken) fails it.
* **searches compose in the ledger** — two searches finished in one folder leave two selection entries
  (``tune:<id>`` each) and a finish run again adds nothing; planted ``ledger_entry_replaced`` (one
  phase name for every search, so the second finds "its" entry and records nothing) fails it.
* **a score is formed once** — forming a trial's score again after a crash (same count, same kept noise)
  gives the same value and records no second ``GaussianDpEvent``; planted ``score_redrawn_on_resume``
  (a fresh draw and a new event each time, the overspend of a resumed search) fails it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from dpft.accounting.ledger import PrivacyLedger, event_to_dict
from dpft.accounting.selection import KDistribution, candidate_event, selection_epsilon
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.config.recipe import Recipe
from dpft.errors import RunLockError
from dpft.privacy.randomness import Randomness
from dpft.outputs import lock as L
from dpft.run import tune as T

__all__ = ["RELEASE_PLANTED", "release_checks"]

RELEASE_PLANTED = ("trial_publishes", "search_skips_lock", "ledger_entry_replaced", "score_redrawn_on_resume")


def _plant_publish(p) -> None:
    orig = T._trial_recipe  # noqa: SLF001

    def keeps(r, *a, **kw):
        t = orig(r, *a, **kw)
        t.log.report_to = list(r.log.report_to)
        t.eval.every_steps = r.eval.every_steps
        t.task.test_file = r.task.test_file
        return t

    p.set(T, "_trial_recipe", keeps)


class _NoLock:
    def acquire(self):
        return self

    def release(self, remove=False):
        pass


def _plant_no_lock(p) -> None:
    p.set(L.RunLock, "for_dir", classmethod(lambda cls, folder, **kw: _NoLock()))


def _plant_one_phase(p) -> None:
    p.set(T, "search_phases", lambda sid: ("tune", "tune_uncovered"))


def _plant_redraw(p) -> None:
    import dp_accounting as dpa

    def redraw(correct, score_sigma, ledger, noise, i=0, ledger_path=None):
        ledger.record("score", dpa.GaussianDpEvent(score_sigma))
        return correct + score_sigma * float(Randomness(None).stream("tune_score", i).normal((1,))[0])

    p.set(T, "private_score", redraw)


_bug = bug_planter(RELEASE_PLANTED, {"trial_publishes": _plant_publish, "search_skips_lock": _plant_no_lock,
                                     "ledger_entry_replaced": _plant_one_phase,
                                     "score_redrawn_on_resume": _plant_redraw})


def _recipe(**extra) -> Recipe:
    return Recipe.model_validate({"privacy": {"target_epsilon": 8.0, "delta": 1e-5},
                                  "tune": {"trials": {"mean": 3.0}}, **extra})


def _silent_trials(planted=None) -> Check:
    with tempfile.TemporaryDirectory() as d:
        test = Path(d) / "test.csv"
        test.write_text("text,label\na,0\n")
        r = _recipe(log={"report_to": ["tensorboard"]}, eval={"every_steps": 1},
                    task={"name": "files", "train_file": str(test), "test_file": str(test)})
        with _bug(planted if planted == "trial_publishes" else None):
            t = T._trial_recipe(r, {"optimizer.lr": 0.01}, 1.0, Path(d) / "f.jsonl", Path(d) / "s.jsonl", False,
                                ["0", "1"])  # noqa: SLF001
    ok = (t.log.report_to == [] and t.eval.every_steps >= T.NEVER and t.task.test_file is None
          and not t.eval.save_predictions and not t.log.private_diagnostics)
    return Check("tune: a trial has no tracker, periodic or test evaluation of its own", ok,
                 f"trial: report_to {t.log.report_to}, eval every {t.eval.every_steps} steps, test_file "
                 f"{'set' if t.task.test_file else 'none'}")


def _lock_held(planted=None) -> Check:
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        holder = L.RunLock(run / L.LOCK_NAME).acquire()  # another search in this folder
        try:
            with _bug(planted if planted == "search_skips_lock" else None):
                try:
                    T.tune(_recipe(), run, resume=True, progress=False)
                    what = "not refused"
                except RunLockError as exc:
                    what = "RunLockError" + (" naming the holder" if "pid" in str(exc) else "")
                except Exception as exc:  # noqa: BLE001 - any other outcome is a failure of the check
                    what = f"{type(exc).__name__} (the lock was not checked)"
        finally:
            holder.release()
    return Check("tune: one process per search folder (run lock)", what == "RunLockError naming the holder",
                 f"a resume while another process holds the folder: {what}")


def _state(sid: str, cand) -> dict:
    trials = [{"index": 0, "hyperparameters": {}, "score": 1.0, "sigma": 1.0, "trial_epsilon": 1.0,
               "events": [json.loads(json.dumps(event_to_dict(cand)))]}]
    return {"search_id": sid, "k": 1, "trials": trials, "score_sigma": 10.0, "configurations": [{}], "sigmas": [1.0]}


def _ledger_composes(planted=None) -> Check:
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        priv = run / T.PRIVATE
        r = _recipe()
        dist = KDistribution.with_mean("truncated_negative_binomial", 3.0)
        cand = candidate_event(1.0, 0.02, 50, 10.0)
        with _bug(planted if planted == "ledger_entry_replaced" else None):
            for sid in ("a" * 16, "b" * 16, "b" * 16):  # a first search, a second, the second's finish rerun
                (priv / "trial_0" / "model").mkdir(parents=True, exist_ok=True)
                T.finish_search(r, run, _state(sid, cand), dist, [cand], keep=False)
        led = PrivacyLedger.load(run / "ledger.json")
        sel = [e.phase for e in led.entries if e.phase.startswith("tune") and "uncovered" not in e.phase]
        one = selection_epsilon([cand], dist, 1e-5).epsilon
        eps = led.epsilon(1e-5).epsilon
    ok = len(sel) == 2 and len(set(sel)) == 2 and eps > one + 1e-6
    return Check("tune: each search in a folder keeps its own ledger entry", ok,
                 f"selection entries after two searches (and a rerun finish): {sel}; ε {eps:.4f} against one "
                 f"search {one:.4f}")


def _score_once(planted=None) -> Check:
    led = PrivacyLedger()
    with _bug(planted if planted == "score_redrawn_on_resume" else None):
        a = T.private_score(40, 10.0, led, 0.7, 0)
        b = T.private_score(40, 10.0, led, 0.7, 0)  # the same trial's score formed again after a crash
    n = sum(e.count for e in led.entries)
    return Check("tune: a trial's score is one release across crashes", a == b and n == 1,
                 f"score formed twice: {a:.3f}, {b:.3f}; score events in the trial's ledger: {n}")


def release_checks(planted: str | None = None) -> list:
    """The checks above (seconds). ``planted``: None, one of :data:`RELEASE_PLANTED`, or another module's."""
    return [_silent_trials(planted), _lock_held(planted), _ledger_composes(planted), _score_once(planted)]
