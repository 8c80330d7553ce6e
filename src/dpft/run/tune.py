"""``dpft tune RECIPE``: private random hyperparameter search charged to the ledger (issue 35).

The search (Papernot & Steinke 2022, accounting/selection.py):

1. the private training rows are split, each row by a hash of its own content, into *fit* rows
   and *scoring* rows (``tune.score_fraction``), so that adding or removing one row moves no other
   row; with ``task.dev_public: true`` the whole training set is fit and the (public) dev file
   scores;
2. per-trial σ of every (q, steps) configuration is calibrated so that the WHOLE search spends
   ``privacy.target_epsilon`` (selection bound on the trials' dp-accounting events); with
   ``batch.expected_batch_size``/``schedule.steps: auto`` one (B, T) is first chosen for the fit rows,
   against that bound (run/tune_space.py ``resolve_search_auto``), and is then the one configuration;
3. K ~ the declared law and every trial's hyperparameters are drawn from the run's secret
   randomness and written to ``tune_private/state.json`` *before* the first trial (a resume
   never redraws K);
4. each trial is a full DP run (``run/loop.py`` Trainer over ``run/plan.py`` build_plan) in
   ``tune_private/trial_i``; its score is the count of correct predictions on the scoring rows +
   N(0, σ_s²) (sensitivity 1 under add/remove of one scoring row; the ``GaussianDpEvent(σ_s)`` is
   recorded in the trial's ledger before the draw), or the exact count on a public dev file;
5. the best trial's ``model/`` is copied to ``RUN/model``; ``RUN/ledger.json`` holds one
   ``RandomKSelectionDpEvent`` (candidates = every configuration's per-trial events, the law of
   K); ``RUN/report.json``/``report.md`` state the chosen hyperparameters, its noisy score and the
   search's ε. The trial folders (the losing models) are deleted.

What is NOT released, and why: K and the other trials' hyperparameters and scores. The
selection theorem covers the output of the best trial only; publishing every trial's score
would be K more releases (and K itself), so they stay in ``tune_private/`` (mode 0700) for the
data holder, outside the release set.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import dp_accounting as dpa

from dpft.run.scope import has_auto_scope, resolve_scope, scope_overrides
from dpft.step.plan import planned_steps
from dpft.accounting.io import atomic_write_text
from dpft.accounting.ledger import PrivacyLedger, event_from_dict, event_to_dict
from dpft.accounting.selection import (KDistribution, RandomKSelectionDpEvent, calibrate_search, candidate_event,
                                       check_trials_covered, selection_epsilon)
from dpft.config.recipe import Recipe, apply_overrides, dump_recipe
from dpft.config.tune import PRIVACY_KEYS
from dpft.privacy.randomness import Randomness
from dpft.outputs.report import NOT_FOR_RELEASE, REPRODUCIBLE_WARNING
from dpft.run.errors import TrainingError
from dpft.run.tune_space import (BudgetError, apply_hyperparameters, auto_refusal, check_search_methods,
                                 resolve_search_auto, search_auto, steps_for, time_budget_refusal, time_plan)
from dpft.accounting.ledger import PrivacyLedger as _Ledger
from dpft.outputs.lock import RunLock
from dpft.run.tune_report import k_law_message, markdown, score_on_test_file, summary, track_search, write_card

__all__ = ["tune", "TuneError", "configurations", "split_rows", "draw_trials", "private_score", "finish_search", "summary"]

PRIVATE = "tune_private"


class TuneError(TrainingError):
    """A search that cannot run as asked; the message names the fix."""


def check_tune_recipe(r: Recipe) -> None:
    """Refusals that need no data (before any loading).

    Raises:
        TuneError: no ``tune:`` section, a non-private or σ-fixed recipe, a method, a task or
            mechanism the search does not support yet."""
    if r.tune is None:
        raise TuneError("dpft tune needs a tune: section (search space and trials); see recipes/tune-sst2-minilm.yaml")
    p = r.privacy
    if not p.enabled or p.target_epsilon is None or p.noise_multiplier is not None:
        raise TuneError("dpft tune spends privacy.target_epsilon on the whole search: set it, and no "
                        "privacy.noise_multiplier (each trial's σ is calibrated from it)")
    try:  # methods (in methods: or tune.space) only where every trial keeps the candidates' events
        check_search_methods(r)
    except TrainingError as exc:
        raise TuneError(str(exc)) from None
    if r.task.name in ("text", "instruct", "seq2seq") or r.task.user_column:
        raise TuneError("dpft tune scores classifiers by a noisy count of correct predictions; this task is not "
                        "supported yet")
    if p.mechanism != "gaussian" or r.batch.schedule or r.batch.max_batch_size:
        raise TuneError("dpft tune supports the Gaussian mechanism with plain Poisson sampling (no banded_mf, "
                        "batch.schedule or batch.max_batch_size)")
    timed = r.schedule.time_budget is not None
    if timed and time_budget_refusal(r):
        raise TuneError(time_budget_refusal(r))
    if timed and {"schedule.steps", "schedule.epochs"} & set(r.tune.space or {}):
        raise TuneError("tune: schedule.time_budget chooses each trial's steps; remove schedule.steps/epochs from "
                        "tune.space (or drop the time budget)")
    if auto_refusal(r):  # batch/steps auto: one (B, T) chosen against the search's bound (run/tune_space.py)
        raise TuneError(auto_refusal(r))
    for bad in publishing_settings(r):
        raise TuneError(bad)
    if r.task.test_file and not Path(r.task.test_file).is_file():
        raise TuneError(f"test file not found: {r.task.test_file}")
    if r.task.dev_public and not r.task.dev_file and r.task.name in ("files",):
        raise TuneError("task.dev_public: true needs a task.dev_file (a dev set held out of the training file is "
                        "private data)")


#: The one thing a trial's eval.every_steps becomes: never (a trial is evaluated once, by the private score).
NEVER = 10 ** 9


def publishing_settings(r: Recipe) -> list[str]:
    """Recipe settings that would publish per-trial numbers, each as its refusal (issue 44 item 1).

    A trial has no outputs of its own (DESIGN.md "Tuning is a private algorithm"): its hyperparameters,
    σ, dev accuracy on the private scoring rows and K are covered by the selection theorem only
    while they stay inside the search. ``log.report_to`` is kept — the tracker gets ONE record at the end
    (run/tune_report.py :func:`track_search`) — and periodic evaluation is switched off in every trial (said on the screen)."""
    out = []
    if r.eval.save_predictions:
        out.append("dpft tune: eval.save_predictions writes each trial's predictions on the private scoring rows "
                   "(per-trial numbers the search's ε does not cover); remove it and run dpft predict on the "
                   "released model")
    if r.log.private_diagnostics:
        out.append("dpft tune: log.private_diagnostics writes each trial's per-step private statistics (per-trial "
                   "numbers the search's ε does not cover); remove it (a search keeps no per-trial diagnostics)")
    return out


def configurations(r: Recipe) -> list[dict[str, Any]]:
    """Every combination of the privacy-relevant choices (batch size, steps/epochs): each is one
    candidate mechanism of the selection bound."""
    combos: list[dict[str, Any]] = [{}]
    for key in PRIVACY_KEYS:
        spec = (r.tune.space or {}).get(key)
        if spec is None:
            continue
        combos = [{**c, key: v} for c in combos for v in spec["choice"]]
    return combos


def _with_scope(r: Recipe, combo: dict, n: int) -> dict:
    """``combo`` with the batch and schedule its ``trainable.mode`` brings for ``n`` fit rows (run/scope.py), where
    the combination itself sets none: what a trial of that scope runs, and so what the accounting charges."""
    scope = combo.get("trainable.mode")
    if scope is None:
        return combo
    return {**{k: v for k, v in scope_overrides(r, scope, n, keep_length=False).items()
               if k in ("batch.expected_batch_size", "schedule.steps", "schedule.epochs")}, **combo}


def _steps_and_q(r: Recipe, combo: dict, n: int, steps_by_batch: Optional[dict] = None) -> tuple[float, int]:
    combo = _with_scope(r, combo, n)
    b = int(combo.get("batch.expected_batch_size", r.batch.expected_batch_size))
    steps = combo.get("schedule.steps")
    epochs = combo.get("schedule.epochs")
    if steps_by_batch:  # a time budget (run/tune_space.py time_plan) chose T for this B
        steps, epochs = steps_by_batch[str(b)], None
    elif steps is None and epochs is None:
        steps, epochs = r.schedule.steps, r.schedule.epochs
    t = planned_steps(n, b, int(steps) if steps else None, None if steps else float(epochs))
    if b > n:
        raise TuneError(f"tune: expected batch size {b} exceeds the {n} fit rows; choose smaller batches")
    return b / n, t


def split_rows(texts: list[str], fraction: float, salt: str) -> list[bool]:
    """True for a scoring row: BLAKE2b(salt, row text) below ``fraction`` — each row's side depends on its
    own content only (adding or removing one row moves no other row, so a row is in one mechanism's
    data: the fit rows' training or the scoring rows' count)."""
    out = []
    for t in texts:
        h = hashlib.blake2b(t.encode("utf-8"), key=salt.encode()[:64] or b"dpft", digest_size=8).digest()
        out.append(int.from_bytes(h, "big") / 2 ** 64 < fraction)
    return out


def draw_trials(r: Recipe, dist: KDistribution, rng: Randomness) -> tuple[int, list[dict[str, Any]]]:
    """K from the declared law (one secret uniform, inverse CDF) and K hyperparameter draws
    (secret uniforms: log-uniform or a uniform choice)."""
    k = dist.sample(float(rng.stream("tune_k").uniform((1,))[0]))
    trials = []
    for i in range(k):
        hp = {}
        for j, (key, spec) in enumerate(sorted((r.tune.space or {}).items())):
            u = float(rng.stream("tune_hp", i, j).uniform((1,))[0])
            kind, vals = next(iter(spec.items()))
            if kind == "log_uniform":
                lo, hi = math.log(float(vals[0])), math.log(float(vals[1]))
                hp[key] = math.exp(lo + u * (hi - lo))
            else:
                hp[key] = vals[min(len(vals) - 1, int(u * len(vals)))]
        trials.append({"index": i, "hyperparameters": hp})
    return k, trials


def _write_split(rows, path: Path, label_names: list[str]) -> None:
    with open(path, "w") as f:
        for row in rows:
            out = {"text": row["text"], "label": label_names[int(row["label"])]}
            if "text_pair" in row:
                out["text_pair"] = row["text_pair"]
            f.write(json.dumps(out) + "\n")


def _trial_recipe(r: Recipe, hp: dict, sigma: float, fit: Path, score: Path, pair: bool,
                  label_names: list[str], n: Optional[int] = None) -> Recipe:
    d = r.model_dump(mode="json")
    if "trainable.mode" in hp:  # the scope's own bundle first (run/scope.py), the sampled values on top
        d = apply_overrides(d, scope_overrides(r, hp["trainable.mode"], n, keep_length=False))
    d["tune"] = None
    d["output_dir"] = None
    # A trial has no outputs of its own (issue 44 item 1): no tracker, no periodic or test evaluation
    # (the search scores it once), no predictions or diagnostics files.
    d["log"].update({"report_to": [], "private_diagnostics": False})
    d["eval"].update({"every_steps": NEVER, "save_predictions": False})
    d["task"].update({"name": "files", "train_file": str(fit), "dev_file": str(score), "test_file": None,
                      "text_column": "text",
                      "label_column": "label", "text_pair_column": "text_pair" if pair else None,
                      "max_train_examples": None, "max_dev_examples": None, "dev_public": False,
                      "label_names": list(label_names)})  # the task's class order, not the names' sorted order
    d["privacy"].update({"noise_multiplier": sigma, "target_epsilon": None})
    d["schedule"]["time_budget"] = None  # the search's budget: its share is in hp's schedule.steps
    if "schedule.steps" in hp:
        d["schedule"]["epochs"] = None
    if "schedule.epochs" in hp:
        d["schedule"]["steps"] = None
    return Recipe.model_validate(apply_hyperparameters(d, dict(hp)))


def private_score(correct: int, score_sigma: Optional[float], ledger: PrivacyLedger, noise, i: int = 0,
                  ledger_path: Optional[Path] = None) -> float:
    """Trial ``i``'s released score: ``correct`` + σ_s·z, the ``GaussianDpEvent(σ_s)`` recorded in the
    trial's ledger (and saved) BEFORE the score is formed (sensitivity 1: one scoring row changes the count
    by at most 1 under add/remove); or the exact count when ``score_sigma`` is None (a public dev file).

    ``noise``: z itself (a float drawn from the secret stream ("tune_score", i) when the search started and
    kept in ``tune_private/state.json``, so that a resume forms the SAME score again: issue 44 item 3), or a
    :class:`Randomness` to draw z from now. A ledger that already holds this trial's score event (a crash
    between forming the score and saving the state) gets none again: the same count + the same z is the
    same release, not a new one."""
    if score_sigma is None:
        return float(correct)
    if not any(e.phase == "score" for e in ledger.entries):
        ledger.record("score", dpa.GaussianDpEvent(score_sigma))
        if ledger_path is not None:
            ledger.save(ledger_path)
    z = float(noise.stream("tune_score", i).normal((1,))[0]) if isinstance(noise, Randomness) else float(noise)
    return correct + score_sigma * z


def _comparable(r: Recipe) -> dict:
    """The recipe as a resume compares it (``perf`` and ``output_dir`` never change the guarantee)."""
    d = json.loads(json.dumps(r.model_dump(mode="json")))
    d.pop("perf", None)
    d.pop("output_dir", None)
    return d


def _save_state(path: Path, state: dict) -> None:
    atomic_write_text(path, json.dumps(state, indent=1))


class _SharedFeatures:
    """The frozen features of a search (run/features.py), computed once by the first trial that builds them and
    handed to every later trial (a trial reuses them only when their key — frozen weights, tokenised rows,
    settings — matches its own); private data at rest, removed when the search ends however it ends."""

    def __init__(self):
        self.cache = None

    def take(self, trainer) -> None:
        fc = getattr(getattr(trainer, "plan", None), "features", None)
        if fc is not None and fc.owned and self.cache is None:
            fc.owned = False  # the search owns it now: the trial does not remove it at its end
            self.cache = fc

    def close(self) -> None:
        if self.cache is not None:
            self.cache.owned = True
            self.cache.close()
            self.cache = None


def tune(recipe: Recipe, run_dir: str | Path, resume: bool = False, progress: bool = True,
         rng: Optional[Randomness] = None, keep_trials: bool = False) -> dict[str, Any]:
    """Run the private search of ``recipe`` in ``run_dir`` (module docstring). Returns the report.

    The run folder is locked (outputs/lock.py) for the search's whole life, as ``dpft train`` locks its own:
    a second search or resume into it while this one runs is refused naming this one (issue 44 item 3).
    ``progress``: the search's own lines on stderr (the law of K, the auto choice, one line at the end);
    a trial prints nothing and has no progress bar whatever ``progress`` is (issue 44 item 1).

    Raises:
        TuneError, SelectionError, DataError: each naming the fix (recipe refusals before loading);
        RunLockError: another process holds ``run_dir``."""

    check_tune_recipe(recipe)
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TuneError(f"output folder {run_dir} is a file; give --output-dir a folder")
    lock = RunLock.for_dir(run_dir, what=f"search folder {run_dir}",
                           fix="wait for that search to finish, stop it (kill PID), or give this search another "
                               "--output-dir").acquire()
    try:
        return _tune_locked(recipe, run_dir, resume, progress, rng, keep_trials)
    finally:
        lock.release()


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _tune_locked(recipe: Recipe, run_dir: Path, resume: bool, progress: bool, rng: Optional[Randomness],
                 keep_trials: bool) -> dict[str, Any]:
    from dpft.data.tasks import load_task
    from dpft.run.loop import Trainer

    r = orig = recipe  # orig: the recipe as given (a resume compares it); r: with auto (B, T) resolved
    priv = run_dir / PRIVATE
    state_path = priv / "state.json"
    if state_path.exists() and not resume:
        raise TuneError(f"{run_dir} already holds a search; pass --resume to continue it or choose another "
                        "--output-dir (nothing was overwritten)")
    if resume and not state_path.exists():
        raise TuneError(f"--resume: {run_dir} holds no search state ({state_path})")
    if resume:  # before any data is copied: a finished search reruns nothing; another recipe is refused
        state = json.loads(state_path.read_text())
        if state.get("recipe") != _comparable(orig):
            raise TuneError(f"--resume: the recipe differs from the one that started the search in {run_dir}; "
                            "resume with the same recipe, or use a new --output-dir")
        if state.get("finished"):
            return json.loads((run_dir / "report.json").read_text())
    priv.mkdir(parents=True, exist_ok=True)
    os.chmod(priv, 0o700)
    rng = rng or Randomness(r.seed if r.privacy.reproducible else None)
    if r.privacy.reproducible:
        _say(progress, f"WARNING: {NOT_FOR_RELEASE} — this search's ε is NOT CERTIFIED for release")
    tc = r.tune
    public = bool(r.task.dev_public)
    # A dev file equal to the training file keeps load_task from splitting by a permutation of all rows.
    own_file = (r.task.name == "files" or r.task.train_file) and not r.task.dev_file
    task_cfg = r.task.model_copy(update={"dev_file": r.task.train_file, "test_file": None}) if own_file else \
        r.task.model_copy(update={"test_file": None})
    task = load_task(task_cfg, seed=r.seed)
    fit_path, score_path = priv / "fit.jsonl", priv / "score.jsonl"
    if public:
        fit_rows, score_rows = task.train, task.dev
    else:
        side = split_rows([t + "\x00" + str(p) for t, p in zip(task.train["text"], task.train["text_pair"]
                                                                if task.has_pair else [""] * len(task.train))],
                          tc.score_fraction, f"dpft-tune-{r.seed}")
        fit_rows = task.train.select([i for i, s in enumerate(side) if not s])
        score_rows = task.train.select([i for i, s in enumerate(side) if s])
    if len(score_rows) == 0 or len(fit_rows) < 2:
        raise TuneError(f"tune: {len(fit_rows)} fit and {len(score_rows)} scoring rows; raise tune.score_fraction "
                        "or give more data (or a public task.dev_file with task.dev_public: true)")
    _write_split(fit_rows, fit_path, task.label_names)
    _write_split(score_rows, score_path, task.label_names)
    n = len(fit_rows)
    if r.privacy.delta >= 1.0 / n:
        raise TuneError(f"δ = {r.privacy.delta:g} is not below 1/N = {1 / n:.3g} for the {n} fit rows; lower δ")
    t = tc.trials
    dist = KDistribution.with_mean(t.distribution, t.mean, t.eta)
    score_sigma = None if public else tc.score_noise_multiplier
    auto = None
    if has_auto_scope(r):  # the scope from the fit rows' count, as dpft train chooses it (run/scope.py; no privacy)
        r, said = resolve_scope(r, n)
        _say(progress, said)
    if search_auto(r):  # before K is drawn: (B, T) for the whole search's bound; a resume reuses the first choice
        try:
            r, auto, said = resolve_search_auto(r, n, dist, score_sigma, state.get("auto") if resume else None)
        except BudgetError as exc:
            raise TuneError(f"tune: {exc}") from None
        _say(progress, said)
    combos = configurations(r)
    steps_by_batch = state.get("steps_by_batch") if resume else None
    timing = None
    if r.schedule.time_budget is not None and not resume:  # T per batch size from a timed probe (no private data)
        steps_by_batch, said, timing = time_plan(r, n, len(score_rows), task.num_labels, dist, combos,
                                                 with_timing=True)
        _say(progress, said)
    plans = [_steps_and_q(r, c, n, steps_by_batch) for c in combos]
    if resume:
        sigmas = state["sigmas"]
    elif auto is not None:  # the choice's σ IS calibrate_search on this one configuration (tune_space.search_sigma)
        if plans != [(auto["batch"] / n, auto["steps"])]:  # auto_refusal keeps (B, T) out of tune.space
            raise TuneError(f"tune: internal: auto chose one (B, T) but the search has configurations {combos}")
        sigmas = [auto["sigma"]]
        k, trials = draw_trials(r, dist, rng)
    else:
        sigmas, _ = calibrate_search(r.privacy.target_epsilon, r.privacy.delta, dist, plans, score_sigma)
        k, trials = draw_trials(r, dist, rng)
    if not resume:
        if score_sigma is not None:  # each trial's score noise z, drawn now and kept private: a resume
            for tr in trials:        # forms the same score again instead of a second release (item 3)
                tr["noise"] = float(rng.stream("tune_score", tr["index"]).normal((1,))[0])
        state = {"search_id": secrets.token_hex(8), "recipe": _comparable(orig), "auto": auto, "k": k,
                 "distribution": dist.as_dict(), "sigmas": sigmas, "configurations": combos,
                 "n_fit": n, "n_score": len(score_rows), "score_sigma": score_sigma, "trials": trials,
                 "steps_by_batch": steps_by_batch}
        _save_state(state_path, state)  # K persisted before the first trial: a resume never redraws it
    state.setdefault("search_id", "0" * 16)  # a search started before ids: one id for its one entry
    if progress:
        _say(progress, k_law_message(r, dist, plans, n, len(score_rows), task.num_labels, combos, timing))
    candidates = [candidate_event(s, q, steps, score_sigma) for s, (q, steps) in zip(sigmas, plans)]
    shared = _SharedFeatures()  # the frozen features, computed by the first trial, reused by the rest
    try:
        for tr in state["trials"]:
            if tr.get("score") is not None:
                continue
            i, hp = tr["index"], tr["hyperparameters"]
            combo = {k2: hp[k2] for k2 in PRIVACY_KEYS if k2 in hp}
            sigma = sigmas[combos.index(combo)]
            tdir = priv / f"trial_{i}"
            if tr.get("correct") is None:  # train (or finish training) the trial, silently, and count once
                rec = _trial_recipe(r, steps_for(r, hp, steps_by_batch), sigma, fit_path, score_path, task.has_pair,
                                    task.label_names, n)
                trainer = Trainer(rec, tdir, resume=(tdir / "checkpoint").exists(), progress=False,
                                  rng=rng.child(f"trial{i}"), features=shared.cache)
                shared.take(trainer)
                trainer.run()
                tr["correct"] = round(float(trainer.evaluate()["dev_accuracy"]) * len(score_rows))
                _save_state(state_path, state)  # the count (private) before any score is formed from it
            ledger = _Ledger.load(tdir / "ledger.json")
            noise = tr.get("noise")
            score = private_score(tr["correct"], score_sigma, ledger, rng if noise is None else noise, i,
                                  tdir / "ledger.json")
            tr.update({"score": score, "events": [json.loads(json.dumps(_ev(e))) for e in ledger.events()],
                       "trial_epsilon": ledger.epsilon(r.privacy.delta).epsilon, "sigma": sigma})
            _save_state(state_path, state)
    finally:
        shared.close()
    rep = finish_search(r, run_dir, state, dist, candidates, keep_trials)
    track_search(r, run_dir, rep)
    return rep


def _ev(e):
    return event_to_dict(e)


def finish_search(r: Recipe, run_dir: Path, state: dict, dist: KDistribution, candidates: list, keep: bool) -> dict:
    priv = run_dir / PRIVATE
    delta = r.privacy.delta
    trials = state["trials"]
    actual = [dpa.ComposedDpEvent([event_from_dict(e) for e in t["events"]]) for t in trials]
    full = RandomKSelectionDpEvent(candidates=candidates, kind=dist.kind, eta=dist.eta, gamma=dist.gamma,
                                   mu=dist.mu, trials=actual)
    private_ledger = PrivacyLedger()
    private_ledger.record("tune", full)
    private_ledger.save(priv / "ledger_with_trials.json")
    # Released ledger: the selection without its trials (their number is K, which is not released);
    # a trial not covered by the candidates (released again after a crash) is composed on top, in full.
    # Appended, never replaced (issue 44 item 3): each search in this folder has its own entry, phase
    # "tune:<search id>"; an earlier search's entries stay and compose with this one. A finish that is
    # run again (a crash after the ledger was written) finds its own entry and adds nothing.
    ledger = PrivacyLedger.load(run_dir / "ledger.json") if (run_dir / "ledger.json").exists() else PrivacyLedger()
    sid = state.get("search_id") or "0" * 16
    phase, phase_unc = search_phases(sid)
    earlier = sorted({e.phase.split(":", 1)[1] for e in ledger.entries if e.phase.startswith("tune:")} - {sid})
    if not any(e.phase == phase for e in ledger.entries):
        ledger.record(phase, RandomKSelectionDpEvent(candidates=candidates, kind=dist.kind, eta=dist.eta,
                                                     gamma=dist.gamma, mu=dist.mu))
        for i in check_trials_covered(full):
            ledger.record(phase_unc, actual[i])
        ledger.save(run_dir / "ledger.json")
    bound = selection_epsilon(candidates, dist, delta)
    total = ledger.epsilon(delta)
    rep: dict[str, Any] = {
        "kind": "private hyperparameter search (dpft tune)",
        "epsilon": total.epsilon, "delta": delta, "target_epsilon": r.privacy.target_epsilon,
        "accountant": total.accountant, "selection": bound.as_dict(), "k_distribution": dist.as_dict(),
        "certified_by": _certified_by(bound, total.epsilon),
        "score": "noisy count of correct predictions on held-out private rows" if state["score_sigma"] is not None
        else "exact count of correct predictions on the public dev file",
        "score_noise_multiplier": state["score_sigma"],
        "configurations": [{"config": c, "sigma": s} for c, s in zip(state["configurations"], state["sigmas"])],
        "steps_by_batch": state.get("steps_by_batch"),  # chosen by schedule.time_budget (None: not timed)
        "auto": _auto_public(state.get("auto")),  # (B, T) chosen by batch/steps auto (None: typed in)
        "not_released": "K, the search's run time, and the other trials' hyperparameters and scores "
                        "(tune_private/, mode 0700): the selection theorem covers the chosen trial's output only",
        "search_id": sid,
    }
    if earlier:  # an earlier search in this folder: its release is composed with this one's
        rep["earlier_searches"] = earlier
    if r.privacy.reproducible:  # the seed is in the released recipe.yaml (as dpft train says)
        rep["reproducible"] = f"{NOT_FOR_RELEASE}. {REPRODUCIBLE_WARNING}."
        rep["certified_by"] = f"NOT CERTIFIED (reproducible mode); the bound computed: {rep['certified_by']}"
    done = [t for t in trials if t.get("score") is not None]
    if done:
        best = max(done, key=lambda t: t["score"])
        src = priv / f"trial_{best['index']}" / "model"
        if (run_dir / "model").exists():
            shutil.rmtree(run_dir / "model")
        shutil.copytree(src, run_dir / "model")
        # the recipe of the released model (the user's recipe with the chosen values): `dpft predict RUN` reads it
        d = r.model_dump(mode="json")
        hp = steps_for(r, best["hyperparameters"], state.get("steps_by_batch"))
        d["schedule"]["time_budget"] = None
        for a, b in (("schedule.steps", "epochs"), ("schedule.epochs", "steps")):
            if a in hp:
                d["schedule"][b] = None
        chosen = Recipe.model_validate(apply_hyperparameters(d, dict(hp)))
        atomic_write_text(run_dir / "recipe.yaml", dump_recipe(chosen))
        rep["chosen"] = {"hyperparameters": best["hyperparameters"], "noisy_score": best["score"],
                         "sigma": best["sigma"], "trial_epsilon": best["trial_epsilon"]}
        write_card(r, run_dir, priv / f"trial_{best['index']}" / "report.json", total,
                   state["score_sigma"] is not None,
                   state.get("n_fit", 0) + (state.get("n_score", 0) if state["score_sigma"] is not None else 0),
                   rep["certified_by"])
        card = run_dir / "model" / "README.md"
        note = (f"\n\n## Hyperparameter search (covered)\n\nThese hyperparameters were chosen by a private random "
                f"search (dpft tune): K ~ {dist.kind} with E[K] = {dist.mean():.3g}, each trial a DP run scored "
                f"{'exactly on a public dev file' if state['score_sigma'] is None else 'by a noisy count'}; only "
                f"this model was released. The whole search, this model included, is (ε = {total.epsilon:.4g}, "
                f"δ = {delta:g})-DP, certified by {rep['certified_by']} (the smaller of two valid bounds: "
                f"Papernot & Steinke 2022 RDP ε = {bound.epsilon_rdp:.4g}; privacy-profile bound ε = "
                f"{bound.epsilon_profile:.4g}): the ε stated above.\n")
        if r.privacy.reproducible:
            note += f"\n**{rep['reproducible']}**\n"
        if card.exists():
            card.write_text(card.read_text() + note)
        if r.task.test_file:  # the released model on the test file, once (issue 44 item 9)
            rep["test"] = score_on_test_file(run_dir, r.task.test_file, r.perf.device, priv)
    else:
        rep["chosen"] = None  # Poisson K = 0: nothing released, the ε above is still spent
    atomic_write_text(run_dir / "report.json", json.dumps(rep, indent=1, default=str))
    atomic_write_text(run_dir / "report.md", markdown(rep))
    state["finished"] = True
    for t in trials:  # the score noise is secret state: not kept once the scores are formed
        t.pop("noise", None)
    _save_state(priv / "state.json", state)
    if not keep:  # the losing models and the copies of the private rows
        for t in trials:
            shutil.rmtree(priv / f"trial_{t['index']}", ignore_errors=True)
        for f in ("fit.jsonl", "score.jsonl"):
            (priv / f).unlink(missing_ok=True)
    return rep


def search_phases(search_id: str) -> tuple[str, str]:
    """The ledger phases of one search: its selection event, and trials it composes on top in full."""
    return f"tune:{search_id}", f"tune_uncovered:{search_id}"


def _auto_public(auto: Optional[dict]) -> Optional[dict]:
    """The auto choice as released: (B, T), the compute budget, the lr factor and each candidate's σ_trial —
    functions of the recipe, the law of K and N (public by dpft's convention), nothing else."""
    if not auto:
        return None
    return {k: auto[k] for k in ("batch", "steps", "sigma", "budget", "n_fit", "lr_scale", "rows") if k in auto}


def _certified_by(bound, epsilon: float) -> str:
    """Which bound the search's ε is (the ledger reports the smaller of its RDP sum and the selection's
    own best bound; with the search alone in the ledger these coincide with ``bound``)."""
    if abs(epsilon - bound.epsilon) <= 1e-9 * max(1.0, epsilon):
        return bound.certified_by_name
    return "the RDP composition of the ledger (Papernot & Steinke 2022 with the run's other events)"
