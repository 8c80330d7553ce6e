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
* **a trial says nothing on the screen** — a tiny search (a random BERT with a word-level tokenizer,
  40 rows, one step per trial, a fixed key) runs with its progress lines on, its stdout and stderr
  captured at the file descriptors: no trial's hyperparameters, σ, count of correct predictions or
  score appears, and no trial progress bar (``dev_acc``); planted ``trial_prints`` (each trial's
  ``{hyperparameters} σ = …`` line and its score printed, the review's black-box leak) fails it.
  Tens of seconds on a CPU: its test is marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
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

RELEASE_PLANTED = ("trial_publishes", "search_skips_lock", "ledger_entry_replaced", "score_redrawn_on_resume",
                   "trial_prints")


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


def _plant_prints(p) -> None:
    rec, score = T._trial_recipe, T.private_score  # noqa: SLF001

    def says_hp(r, hp, sigma, *a, **kw):  # the per-trial line the review saw on stderr
        print(f"trial: {hp} σ = {sigma:.4f}", file=sys.stderr, flush=True)
        return rec(r, hp, sigma, *a, **kw)

    def says_score(correct, score_sigma, ledger, noise, i=0, ledger_path=None):
        s = score(correct, score_sigma, ledger, noise, i, ledger_path)
        print(f"trial {i}: correct {correct}, score {s:.2f}", flush=True)
        return s

    p.set(T, "_trial_recipe", says_hp)
    p.set(T, "private_score", says_score)


_bug = bug_planter(RELEASE_PLANTED, {"trial_publishes": _plant_publish, "search_skips_lock": _plant_no_lock,
                                     "ledger_entry_replaced": _plant_one_phase,
                                     "score_redrawn_on_resume": _plant_redraw, "trial_prints": _plant_prints})


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


@contextlib.contextmanager
def _screen(path: Path):
    """Everything written to stdout and stderr inside the block, at the file descriptors (print, tqdm,
    logging handlers, C extensions), appended to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", encoding="utf-8") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield
        finally:
            f.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _tiny_classifier_dir(d: Path) -> Path:
    """A random 2-layer BERT (hidden 16) and a word-level tokenizer over ``_WORDS``, saved to ``d``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate(special + sorted(set(_WORDS)) + [str(i) for i in range(40)])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(d)
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=32,
                                             max_position_embeddings=64)).save_pretrained(d)
    return d


_WORDS = ("a", "good", "bad", "great", "awful", "film", "number")


def _screen_silent(planted=None) -> Check:
    """A tiny search run with its progress lines on: its captured screen names no trial's numbers."""
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        with _screen(d / "setup.txt"):  # the model's own save bar, kept off the audit's console
            model = _tiny_classifier_dir(d / "model")
        rows = "\n".join(f"a {_WORDS[1 + i % 4]} film number {i},{int(i % 4 < 2)}" for i in range(40))
        (d / "train.csv").write_text("text,label\n" + rows + "\n")
        r = Recipe.model_validate({
            "model": {"name": str(model), "max_length": 8}, "task": {"name": "files", "train_file": str(d / "train.csv")},
            "batch": {"expected_batch_size": 8, "max_physical_batch_size": 8}, "schedule": {"steps": 1},
            "privacy": {"target_epsilon": 8.0, "delta": 1e-3, "engine": "reference"}, "perf": {"device": "cpu"},
            "tune": {"trials": {"distribution": "truncated_negative_binomial", "mean": 2.0, "eta": 1.0},
                     "score_fraction": 0.3, "space": {"optimizer.lr": {"log_uniform": [1e-3, 1e-1]}}}})
        with _bug(planted if planted == "trial_prints" else None), _screen(d / "screen.txt"):
            T.tune(r, d / "run", progress=True, rng=Randomness.from_key(b"audit-tune-screen".ljust(32, b"\0")))
        text = (d / "screen.txt").read_text(errors="replace")
        trials = json.loads((d / "run" / T.PRIVATE / "state.json").read_text())["trials"]
    seen = []
    for t in trials:
        lr = t["hyperparameters"]["optimizer.lr"]
        for what, s in (("learning rate", repr(lr)[:8]), ("σ", f"{t['sigma']:.4f}"), ("score", f"{t['score']:.2f}"),
                        ("count", f"correct {t['correct']}")):
            if s in text:
                seen.append(f"trial {t['index']}'s {what}")
    if "dev_acc" in text:
        seen.append("a trial's progress bar")
    return Check("tune: a trial prints nothing to the screen (stdout, stderr)", bool(trials) and not seen,
                 f"{len(trials)} trial(s); {len(text.splitlines())} screen lines; trial numbers on the screen: "
                 f"{', '.join(seen) or 'none'}")


def release_checks(planted: str | None = None) -> list:
    """The checks above (tens of seconds: the screen check runs a tiny search). ``planted``: None, one of
    :data:`RELEASE_PLANTED`, or another module's."""
    return [_silent_trials(planted), _lock_held(planted), _ledger_composes(planted), _score_once(planted),
            _screen_silent(planted)]
