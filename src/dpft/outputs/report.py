"""Run reports: ``report.json`` (machine), ``report.md`` (people), ``training.png`` (plot).

Every ε printed here comes from the run's ledger (``ledger.json``) through the PLD accountant
of dp-accounting; a non-private run says plainly that it has no guarantee.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from dpft.accounting.io import atomic_write_text
from dpft.accounting.ledger import NotCertifiedError, PrivacyLedger
from dpft.outputs.report_lm import extra_sections, render_extra
from dpft.outputs.report_partial import is_train_run, reprint_interrupted
from dpft.methods.base import get_method
from dpft.outputs.release import DIAGNOSTICS_FILE, RELEASE_SET, dev_statement

#: Headline qualifier of a run in reproducible mode (privacy.reproducible).
REPRODUCIBLE_WARNING = ("REPRODUCIBLE MODE: the sampling and noise were derived from the recorded seed; "
                        "this ε holds only while that seed stays secret")
#: Headline of a reproducible run: its seed is in the released ``recipe.yaml``, so anyone with
#: the release can regenerate the sampling and the noise (issue 23).
NOT_FOR_RELEASE = ("NOT CERTIFIED for release (reproducible mode: the seed is in the released recipe.yaml, from "
                   "which anyone can regenerate the sampling and the noise)")
NO_GUARANTEE = "NONE: this is a non-private reference run (--no-dp); it has no privacy guarantee"


def privacy_section(ledger: PrivacyLedger | None, delta: float) -> dict[str, Any]:
    if ledger is None:
        return {"guarantee": NO_GUARANTEE}
    if not ledger.certified:
        return {"guarantee": "NOT CERTIFIED", "reason": ledger.not_certified_reason, "epsilon": None}
    rep = ledger.epsilon(delta)
    return {"guarantee": "certified", **rep.as_dict(),
            "ledger": [{"phase": e.phase, "count": e.count, "event": repr(e.event)} for e in ledger.entries]}


def write_report(trainer, final_eval: dict[str, float], elapsed: float) -> dict[str, Any]:
    """Build and write the three report files of a finished run; returns the JSON dict."""
    from dpft.models.load import count_parameters

    r = trainer.recipe
    n_train, n_total = count_parameters(trainer.model)
    priv = privacy_section(trainer.ledger if trainer.private else None, r.privacy.delta)
    rep = {
        "name": r.name,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "task": {"name": trainer.task.name, "source": trainer.task.source, "n_train": trainer.n,
                 "n_dev": len(trainer.task.dev), "dev_source": dev_source(r.task, trainer.task.source),
                 "labels": trainer.task.label_names, "notes": trainer.task.notes},
        "model": {"name": r.model.name, "trainable": r.trainable.mode, "trainable_parameters": n_train,
                  "total_parameters": n_total, "max_length": r.model.max_length,
                  "quantization": r.model.quantization},
        "privacy": priv,
        "dp": {"private": trainer.private, "noise_multiplier": trainer.sigma, "sampling_rate": trainer.q,
               "expected_batch_size": r.batch.expected_batch_size, "steps": trainer.total_steps,
               # every release of the training phase in the ledger (more than the plan's steps
               # when a resume released steps again) and those repeats (run/loop.py ``replays``)
               "released_steps": released_steps(trainer), "replays": list(getattr(trainer, "replays", [])),
               "resume_cap": getattr(trainer, "resume_cap", None),  # issue 36: ε capped across a crash
               "target_epsilon": (r.privacy.target_epsilon if trainer.private and r.privacy.noise_multiplier is None
                                  else None),
               "clipping": r.privacy.clipping.model_dump() if trainer.private else None,
               "engine": type(trainer.dp_step.spec.engine).__name__, "sampling": "Poisson",
               # issue 17: what one "unit" of the guarantee is, and N of them (users at user level)
               "privacy_unit": getattr(trainer, "privacy_unit", {"unit": "example", "n_units": trainer.n}),
               "randomness": "reproducible (from the recorded seed)" if r.privacy.reproducible
               else "secret (OS CSPRNG key, never written)",
               # truncated Poisson / banded_mf (step/mechanisms.py): public parameters only
               **mechanism_section(trainer),
               **plan_section(getattr(getattr(trainer, "plan", None), "privacy", None))},
        "optimizer": r.optimizer.model_dump(mode="json"),
        "metrics": final_eval,
        "time_seconds": round(elapsed, 1),
        "history": trainer.history.rows,
        "coverage": coverage_section(trainer),
    }
    test = getattr(trainer, "test_metrics", None)
    if test:  # task.test_file: evaluated once after training, reported apart from dev
        rep["test"] = {**test, "statement": test_statement(test["file"])}
    rep["task"]["notes"] = list(rep["task"]["notes"]) + list(getattr(trainer, "ledger_notes", []))

    rep.update(extra_sections(trainer))
    # Each method's own section (methods/base.py); a method may replace the privacy section
    # (forward LDP has its own guarantees).
    rep["methods"] = [m.name for m in trainer.methods]
    for m in trainer.methods:
        rep[m.report_key or m.name] = m.report(trainer.ctx)
        sec = m.privacy_section(trainer.ctx)
        if sec is not None:
            rep["privacy"] = sec
    if r.privacy.reproducible and rep["privacy"].get("guarantee") == "certified":
        rep["privacy"]["reproducible"] = True
        rep["privacy"]["release"] = NOT_FOR_RELEASE
        rep["privacy"]["certified_for_release"] = False
    withhold_private_dev_texts(rep)
    d = trainer.run_dir
    try:  # first, so that the file list below knows whether it exists
        plot_history(rep["history"], d / "training.png",
                     private=trainer.private or any(m.epsilon(trainer.ctx) is not None for m in trainer.methods))
    except Exception as exc:  # noqa: BLE001 - a plot never fails a finished run
        rep["plot_error"] = str(exc)
    rep["coverage"]["release_set"] = present_files(d, rep["coverage"]["release_set"])
    atomic_write_text(d / "report.json", json.dumps(rep, indent=1))
    atomic_write_text(d / "report.md", render_markdown(rep))
    return rep


def test_statement(file: str) -> str:
    """What the report may say about the test metrics (task.test_file)."""
    return (f"Test metrics are computed once, after the last step, on your test file {file}, which is not part of "
            "training and never steered it (no selection, no early stopping): they are exact statistics of those "
            "test examples and are NOT covered by ε. Share them only if the test examples may be disclosed.")


def test_line(rep: dict[str, Any]) -> list[str]:
    """The report's test-file headline (empty without a test file)."""
    t = rep.get("test")
    if not t or "test_accuracy" not in t:
        return []
    return [f"**Test accuracy:** {t['test_accuracy']:.4f} ({t['n']} examples of {t['file']}), test loss "
            f"{t['test_loss']:.4f} nats — evaluated once after training, never used for selection", ""]


#: Files this module writes with the report itself (present once it is written).
_REPORT_FILES = ("report.json", "report.md")


def present_files(run_dir: Path, release_set: dict[str, str]) -> dict[str, str]:
    """The entries of ``release_set`` that exist in ``run_dir`` (``report.json``/``report.md``
    count as present: they are being written); a report lists only files it has."""
    d = Path(run_dir)
    return {k: v for k, v in release_set.items() if k in _REPORT_FILES or (d / k.rstrip("/")).exists()}


def released_steps(trainer) -> Optional[int]:
    """Noisy releases of the training loop's phase in the run's ledger (None: not private)."""
    if not trainer.private:
        return None
    phase = getattr(trainer, "phase", "train")
    return sum(e.count for e in trainer.ledger.entries if e.phase == phase)


def overspend_line(rep: dict[str, Any]) -> Optional[str]:
    """``ε = X exceeds the target Y: …`` when the certified ε is above the recipe's target, with
    the reason the ledger shows (steps released twice after an interrupt); else None."""
    p, dp = rep["privacy"], rep.get("dp") or {}
    target = dp.get("target_epsilon")
    if p.get("guarantee") != "certified" or target is None or p.get("epsilon") is None:
        return None
    if p["epsilon"] <= target * (1 + 1e-9):
        return None
    line = f"ε = {p['epsilon']:.4g} exceeds the target {target:g}"
    reps = dp.get("replays") or []
    if reps:
        spans = ", ".join(f"{x['from_step']}–{x['to_step']}" if x["to_step"] > x["from_step"] else str(x["from_step"])
                          for x in reps)
        n = sum(x["releases"] for x in reps)
        line += (f": steps {spans} were released twice ({n} extra release{'s' if n != 1 else ''}: the run was "
                 f"stopped after releasing them and resumed from an earlier checkpoint); the ledger counts "
                 f"{dp.get('released_steps')} releases for {dp['steps']} planned steps")
    elif dp.get("released_steps") is not None and dp["released_steps"] > dp["steps"]:
        line += f": the ledger counts {dp['released_steps']} releases for {dp['steps']} planned steps"
    else:
        line += " (releases recorded before training, e.g. an earlier attempt in this directory; see the ledger)"
    return line


def unit_line(dp: dict[str, Any]) -> str:
    """The report's privacy-unit row: what one unit of the (ε, δ) guarantee is, and N."""
    u = dp.get("privacy_unit") or {}
    if u.get("unit") == "user":
        clip = ("the user's summed gradient clipped to C (exact group clipping)" if u["user_clipping"] == "group"
                else "each row clipped to C/k, so a user's sum is ≤ C (conservative)")
        return (f"user (column {u['column']!r}): N = {u['n_units']} users; Poisson sampling over users, at most "
                f"k = {u['max_rows_per_user']} rows per sampled user per step; {clip}; the guarantee protects "
                "each user, whatever the number of rows")
    return f"example (one training row): N = {u.get('n_units', dp.get('n_units', '?'))}"


def epsilon_line(rep: dict[str, Any]) -> str:
    p = rep["privacy"]
    if p["guarantee"] == "certified":
        line = (f"ε = {p['epsilon']:.4g} at δ = {p['delta']:g} ({p['accountant']}; "
                f"RDP cross-check ε = {p['epsilon_rdp']:.4g})")
        over = overspend_line(rep)
        if over:
            line = f"{over} — {line}"
        if p.get("scope"):
            line += f" — {p['scope']}"
        u = (rep.get("dp") or {}).get("privacy_unit") or {}
        if u.get("unit") == "user":
            line += f" — privacy unit: user (N = {u['n_units']} users)"
        if p.get("reproducible"):
            line = f"{NOT_FOR_RELEASE} — {line} — {REPRODUCIBLE_WARNING}"
        return line
    if p["guarantee"] == "NOT CERTIFIED":
        return f"ε: NOT CERTIFIED — {p['reason']}"
    return f"ε: {p['guarantee']}"


#: What a final-model audit's lower bound does and does not mean (report and model card).
AUDIT_MEANING = ("A lower bound: it shows that the training code leaks at least this much about canaries built to "
                 "be easy to detect (ε̂ above the certified ε would reveal a bug); it does not show that the certified "
                 "ε is tight, nor what leaks about ordinary rows.")


def audited_lines(rep: dict[str, Any]) -> list[str]:
    """"audited: ε̂ ≥ x at 95 % confidence …" and its meaning, when a final-model audit
    (audit/final_model.py) is attached to the report; else no lines."""
    a = rep.get("final_model_audit")
    if not a:
        return []
    where = ("this run, trained with the canaries" if a.get("same_run")
             else "a run of the same recipe with the canaries added")
    # the headline is the estimator valid for any mechanism (Steinke et al.); the f-DP one only beside it, with
    # its assumption (an attached audit from before issue 44 headlined f-DP: its method says so)
    line = (f"**Audited:** ε̂ ≥ {a['epsilon_hat']:.3g} at {a['confidence']:.0%} confidence by a final-model audit "
            f"with m = {a['m']} canaries ({a['method']}; {a['design']} canaries, black-box, on {where})"
            + (" — it detected no leakage at this power" if a["epsilon_hat"] == 0 else ""))
    if a.get("epsilon_hat_gaussian") is not None:
        line += f"; assuming a Gaussian trade-off curve (f-DP, Mahloujifar et al. 2025): ε̂ ≥ {a['epsilon_hat_gaussian']:.3g}"
    if a.get("whitebox"):
        w = a["whitebox"]
        line += (f"; white-box upper reference on the same run, {w['m']} Dirac gradient canaries on every "
                 f"release: ε̂ ≥ {w['steinke']:.3g} (any mechanism), ≥ {w['fdp']:.3g} assuming a Gaussian trade-off "
                 "curve")
    if a.get("verdict") == "FAIL":
        line += " — **the audit FAILED: ε̂ exceeds the certified ε**"
    if a.get("planted"):
        line = f"**PLANTED BUG `{a['planted']}` (auditor self-test, not an audit):** " + line[len("**Audited:** "):]
    return [line + ".", "", AUDIT_MEANING, ""]


def steps_cell(dp: dict[str, Any]) -> str:
    """The table's steps: the ledger's count of releases, and the plan when they differ."""
    rel = dp.get("released_steps")
    if rel is None or rel == dp["steps"]:
        return f"{dp['steps'] if rel is None else rel}"
    why = " (steps released twice after an interrupt: see the headline)" if dp.get("replays") else ""
    cap = dp.get("resume_cap") or {}
    if cap and cap.get("stop", dp["steps"]) < cap.get("planned_steps", dp["steps"]):  # run/checkpoint.py
        why = (f" (stopped at step {cap['stop']} of the {cap['planned_steps']} planned: steps released before a "
               "crash ran again after the resume, and the run stopped early so that ε stays within the target)")
    return f"{rel} released (ledger), {dp['steps']} planned{why}"


def render_markdown(rep: dict[str, Any]) -> str:
    dp, m, mod, t = rep["dp"], rep["metrics"], rep["model"], rep["task"]
    lines = [
        f"# dpft run report: {rep['name']}",
        "",
        f"**Privacy:** {epsilon_line(rep)}",
        "",
        *audited_lines(rep),
        (f"**Dev accuracy:** {m['dev_accuracy']:.4f} ({t['n_dev']} examples), dev loss {m['dev_loss']:.4f} nats"
         if "dev_accuracy" in m else
         f"**Dev loss:** {m['dev_loss']:.4f} nats/token, perplexity {m['dev_perplexity']:.3f} ({t['n_dev']} examples)"),
        "",
        *test_line(rep),
        "| item | value |",
        "|---|---|",
        f"| task | {t['name']} ({t['source']}), N = {t['n_train']} "
        f"{'users' if dp.get('privacy_unit', {}).get('unit') == 'user' else 'training examples'} |",
        f"| model | {mod['name']} — trainable: {mod['trainable']}, {mod['trainable_parameters']:,} of {mod['total_parameters']:,} parameters"
        + (f"; base quantized ({mod['quantization']}, bitsandbytes)" if mod.get("quantization") else "") + " |",
    ]
    if dp["private"]:
        c = dp["clipping"]
        lines += [
            f"| noise multiplier σ | {dp['noise_multiplier']:.4f} |",
            f"| sampling | Poisson, q = {dp['sampling_rate']:.5f} (expected batch {dp['expected_batch_size']}) |",
            f"| steps | {steps_cell(dp)} |",
            f"| clipping | {c['style']}, C = {c['max_norm']:g} |",
            f"| privacy unit | {unit_line(dp)} |",
            f"| per-example engine | {dp['engine']} |",
            *mechanism_lines(dp),
        ]
    elif rep.get("ldp"):
        lines += [f"| steps | {dp['steps']} (expected batch {dp['expected_batch_size']}) |",
                  "| privacy | forward-pass LDP (below); gradients are not clipped or noised |"]
    else:
        lines += [f"| steps | {dp['steps']} (expected batch {dp['expected_batch_size']}) |",
                  "| privacy | none: no clipping, no noise |"]
    o = rep["optimizer"]
    lines += [f"| optimizer | {o['name']}, lr {o['lr']:g}, weight decay {o['weight_decay']:g} |",
              f"| time | {rep['time_seconds']:.0f} s |", ""]
    if t["notes"]:
        lines += ["Notes:", *[f"- {n}" for n in t["notes"]], ""]

    for name in rep.get("methods", []):
        lines += get_method(name).markdown(rep)
    if dp["private"] and rep["privacy"].get("ledger"):
        lines += ["## Ledger (every private release of this run)", "", "| phase | count | event |", "|---|---|---|"]
        lines += [f"| {e['phase']} | {e['count']} | `{e['event']}` |" for e in rep["privacy"]["ledger"]]
        lines += [""]
    plot = ["![dev metric and ε](training.png)", ""] if "training.png" in (rep.get("coverage") or {}).get(
        "release_set", {"training.png": ""}) else []
    lines += [*render_extra(rep), *coverage_markdown(rep), *plot]
    return "\n".join(lines)


def withhold_private_dev_texts(rep: dict[str, Any]) -> dict[str, Any]:
    """Drop the verbatim dev prompts, generations and references from ``rep`` (in place) unless
    its dev set is public (``rep["coverage"]["dev_public"]``): the user's own dev texts are not
    covered by ε and the report is released. Their number is kept (``samples_withheld``)."""
    g = rep.get("generation")
    if g and g.get("samples") and not (rep.get("coverage") or {}).get("dev_public", False):
        rep["generation"] = {**g, "samples": [], "samples_withheld": len(g["samples"])}
    return rep


def dev_source(task_cfg, source: str) -> str:
    """Where the dev rows came from, for the report and the model card: the dev file's name, the
    split held out from the training file, or the benchmark's own dev split."""
    if task_cfg.dev_file:
        return f"dev file {Path(task_cfg.dev_file).name}"
    if task_cfg.train_file:
        return f"held out from the training file {Path(task_cfg.train_file).name}"
    return f"{source} dev split"


def dev_is_public(task) -> bool:
    """Whether the run's dev set is public benchmark data, whose texts the report may print.

    Public: a named benchmark task read from the hub or from ``DPFT_DATA_DIR`` (the benchmark
    data folder, e.g. SST-2's dev split), or a ``task.dev_file`` inside ``DPFT_DATA_DIR`` (e.g.
    E2E's ``devset.csv``). Not public: a ``task.dev_file`` anywhere else (the user's own data)
    and the split held out from ``task.train_file``."""
    from dpft.data.tasks import data_dir

    if task.dev_file:
        root = data_dir()
        if root is None:
            return False
        try:
            Path(task.dev_file).resolve().relative_to(root.resolve())
        except ValueError:
            return False
        return True
    return task.name not in ("files",) and not task.train_file


def coverage_section(trainer) -> dict[str, Any]:
    """What the run's ε covers and what it does not (every sentence must be true)."""
    r = trainer.recipe
    t = r.task
    dev_public = dev_is_public(t)
    if t.dev_file:
        src = f"your dev file {t.dev_file}"
    elif t.train_file:
        src = f"a split held out from your training file {t.train_file}"
    else:
        src = f"the {t.name} dev split"
    covered = trainer.private or any(m.epsilon(trainer.ctx) is not None for m in trainer.methods)
    out = {
        "release_set": RELEASE_SET,
        "dev_public": dev_public,
        "dev": dev_statement(dev_public, src),
        "not_released": ("Per-step training loss, realised batch sizes and clip fractions are not in the release "
                         "set" + (f"; they are in {DIAGNOSTICS_FILE} (not covered, for you only)"
                                   if r.log.private_diagnostics else " (log.private_diagnostics is off)") + "."),
        "timing": "Wall-clock times grow with the realised batch sizes: they are a side channel not covered by ε.",
        "public": ("The pre-trained model, the recipe's settings and the training-set size N are treated as "
                   "public."),
    }
    if not covered:
        out["statement"] = "This run has no privacy guarantee: nothing it writes is covered."
    elif not trainer.ledger.certified:
        out["statement"] = "This run is NOT CERTIFIED: nothing it writes is covered by a proven ε."
    elif getattr(trainer, "user_level", False):
        u = trainer.privacy_unit
        out["statement"] = (
            f"For any one user (column {u['column']!r}), the probability of any outcome of this run — the model, "
            "every checkpoint, the ledger and the released metrics — changes by at most a factor e^ε between the "
            "training data with and without all of that user's rows, however many they are, except with "
            f"probability δ (add/remove-one-user neighbouring datasets, user-level privacy over N = {u['n_units']} "
            f"users; each sampled user contributes at most k = {u['max_rows_per_user']} rows per step).")
        out["public"] = ("The pre-trained model, the recipe's settings and the number of users N are treated as "
                         "public.")
    else:
        out["statement"] = (
            "For any one training example, the probability of any outcome of this run — the model, every "
            "checkpoint, the ledger and the released metrics — changes by at most a factor e^ε between the "
            "training data with and without that example, except with probability δ (add/remove-one "
            "neighbouring datasets, example-level privacy). If one person contributes several rows, each "
            "person's protection is weaker (group privacy).")
    if r.privacy.reproducible and covered:
        out["reproducible"] = f"{NOT_FOR_RELEASE}. {REPRODUCIBLE_WARNING}."
    return out


def coverage_markdown(rep: dict[str, Any]) -> list[str]:
    c = rep.get("coverage")
    if not c:
        return []
    lines = ["## What the ε covers", "", c["statement"], ""]
    if c.get("reproducible"):
        lines += [f"**{c['reproducible']}**", ""]
    lines += [f"- {c['dev']}", *([f"- {rep['test']['statement']}"] if rep.get("test") else []), f"- {c['not_released']}", f"- {c['timing']}", f"- {c['public']}", "",
              "Files released by this run:", "", "| file | holds |", "|---|---|",
              *[f"| `{k}` | {v} |" for k, v in c["release_set"].items()], ""]
    return lines


def plot_history(rows: list[dict[str, Any]], path: Path, private: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Released quantities only (outputs/release.py): no training loss or batch size.
    panels = 2 if private else 1
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), squeeze=False)
    axes = axes[0]
    ev = [x for x in rows if "dev_accuracy" in x or "dev_perplexity" in x]
    key = "dev_accuracy" if ev and "dev_accuracy" in ev[0] else "dev_loss"
    axes[0].plot([x["step"] for x in ev], [x[key] for x in ev], marker="o")
    axes[0].set(title="dev accuracy" if key == "dev_accuracy" else "dev loss (nats/token)", xlabel="step")
    if private:
        eps = [(x["step"], x["epsilon"]) for x in ev if x.get("epsilon") is not None]
        axes[1].plot([a for a, _ in eps], [b for _, b in eps], marker="o", color="C3")
        axes[1].set(title="ε spent (PLD)", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reprint(run_dir: str | Path) -> str:
    """Recompute the privacy line from ``ledger.json`` and return the Markdown report.

    Reads a ``dpft train`` run directory (``report.json``) or a :class:`~dpft.integrations.hf.trainer.DPTrainer`
    output folder (``ledger.json`` with ``dp_state.json``, at the top or in its latest
    ``checkpoint-K/``).

    Raises:
        FileNotFoundError: neither kind of folder (the message says what is missing)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d} is not a folder: give a dpft run directory or a DPTrainer output_dir")
    if not (d / "report.json").is_file():
        if is_train_run(d):  # a dpft train run stopped before its report (not a DPTrainer folder)
            return reprint_interrupted(d, epsilon_line, privacy_section, steps_cell)
        if (d / "ledger.json").is_file() or _hf_state_file(d) is not None:
            return reprint_hf(d)
        raise FileNotFoundError(f"no report.json in {d} (a dpft train run directory) and no ledger.json or "
                                "dp_state.json (a DPTrainer output_dir): is this a finished run's folder?")
    rep = json.loads((d / "report.json").read_text())
    if rep.get("coverage", {}).get("release_set"):  # files moved or deleted since: list what is there
        rep["coverage"]["release_set"] = present_files(d, rep["coverage"]["release_set"])
    if (d / "ledger.json").is_file() and rep["dp"]["private"]:
        ledger = PrivacyLedger.load(d / "ledger.json")
        try:
            rep["privacy"] = privacy_section(ledger, rep["privacy"].get("delta") or 1e-5)
        except NotCertifiedError:
            pass
    return render_markdown(rep)


def _hf_state_file(d: Path) -> Optional[Path]:
    """``dp_state.json`` of a DPTrainer folder: the top one, else the latest ``checkpoint-K/``'s."""
    if (d / "dp_state.json").is_file():
        return d / "dp_state.json"
    cks = sorted((p for p in d.glob("checkpoint-*") if (p / "dp_state.json").is_file()),
                 key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1)
    return cks[-1] / "dp_state.json" if cks else None


def reprint_hf(d: Path) -> str:
    """Markdown report of a DPTrainer output folder (integrations/hf/trainer.py writes ``ledger.json``
    live and ``dp_state.json`` with the model): ε recomputed from the ledger at the recorded δ,
    the settings of ``dp_state.json``, the last logged evaluation (``trainer_state.json``)."""
    state_file = _hf_state_file(d)
    st = json.loads(state_file.read_text()) if state_file else {}
    args = st.get("dp_args") or {}
    delta = args.get("target_delta")
    ledger_file = d / "ledger.json" if (d / "ledger.json").is_file() else (
        state_file.parent / "ledger.json" if state_file and (state_file.parent / "ledger.json").is_file() else None)
    ledger = PrivacyLedger.load(ledger_file) if ledger_file else None
    if ledger is None:
        priv: dict[str, Any] = {"guarantee": "NOT CERTIFIED", "reason": f"no ledger.json in {d}", "epsilon": None}
    elif delta is None:
        priv = {"guarantee": "NOT CERTIFIED", "reason": f"no dp_state.json in {d} to give δ; the ledger holds "
                f"{ledger.steps} releases (dpft account gives ε for a δ)", "epsilon": None}
    else:
        try:
            priv = privacy_section(ledger, float(delta))
        except NotCertifiedError as exc:
            priv = {"guarantee": "NOT CERTIFIED", "reason": str(exc), "epsilon": None}
    released = sum(e.count for e in ledger.entries if e.phase == "train") if ledger else None
    dp = {"private": True, "steps": st.get("total_steps", "?"), "released_steps": released,
          "target_epsilon": args.get("target_epsilon") if args.get("noise_multiplier") is None else None,
          "replays": []}
    rep = {"privacy": priv, "dp": dp}
    lines = [f"# DPTrainer run: {d.name}", "", f"**Privacy:** {epsilon_line(rep)}"
             + ("" if state_file is None or state_file.parent == d else f" (settings from {state_file.parent.name}/)"),
             "", "| item | value |", "|---|---|"]
    if st:
        q, n = st.get("q"), st.get("n")
        lines += [f"| noise multiplier σ | {st['sigma']:.4f} |" if isinstance(st.get("sigma"), (int, float))
                  else f"| noise multiplier σ | {st.get('sigma')} |",
                  f"| sampling | Poisson, q = {q:.5f} (expected batch {args.get('expected_batch_size', '?')}) |"
                  if isinstance(q, (int, float)) else f"| sampling | q = {q} |",
                  f"| steps | {steps_cell(dp) if isinstance(dp['steps'], int) else dp['steps']}"
                  f" (optimizer steps done: {st.get('global_step', '?')}) |",
                  f"| clipping | {args.get('clipping', '?')}, C = {args.get('max_grad_norm', '?')} |",
                  f"| privacy unit | example (one training row): N = {n} |",
                  f"| per-example engine | {args.get('engine', '?')} |",
                  "| randomness | " + ("reproducible (from a seed given to DPArguments)" if args.get("reproducible")
                                       else "secret (OS CSPRNG key, never written)") + " |"]
    else:
        lines.append(f"| settings | no dp_state.json in {d} (written by DPTrainer.save_model) |")
    ev = _last_eval(d, state_file)
    if ev:
        lines.append("| last evaluation | " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in ev.items()) + " |")
    lines.append("")
    if ledger is not None and priv.get("ledger"):
        lines += ["## Ledger (every private release of this run)", "", "| phase | count | event |", "|---|---|---|"]
        lines += [f"| {e['phase']} | {e['count']} | `{e['event']}` |" for e in priv["ledger"]]
        lines.append("")
    lines += [f"Files in {d}: " + ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in d.iterdir())), ""]
    return "\n".join(lines)


def _last_eval(d: Path, state_file: Optional[Path]) -> dict[str, Any]:
    """The last ``eval_*`` entry of ``trainer_state.json`` (top folder, else the latest checkpoint's)."""
    cks = sorted((p for p in d.glob("checkpoint-*/trainer_state.json")),
                 key=lambda p: int(p.parent.name.split("-")[-1]) if p.parent.name.split("-")[-1].isdigit() else -1)
    for f in (d / "trainer_state.json", cks[-1] if cks else None):
        if f is not None and f.is_file():
            hist = json.loads(f.read_text()).get("log_history", [])
            evs = [h for h in hist if any(k.startswith("eval_") for k in h)]
            if evs:
                return {k: v for k, v in evs[-1].items() if k.startswith("eval_") or k in ("step", "epsilon")}
    return {}


def mechanism_section(trainer) -> dict:
    """``{"mechanism": …}`` for truncated Poisson or banded_mf runs (public parameters; the
    truncation probability from N, q and the bound), else {}."""
    privacy = getattr(getattr(trainer, "plan", None), "privacy", None)
    info = privacy.mechanism.info(privacy.sampler, trainer.total_steps) if privacy is not None and trainer.private \
        else {}
    return {"mechanism": info} if info else {}


def plan_section(privacy) -> dict:
    """``{"plan": …}``: the privacy plan ``privacy`` (step/plan.py ``PrivacyPlan``, or None) as a value,
    its settings and σ in simple types (``CalibratedPlan.to_dict``; public: N, B, T, the mechanism, the
    target, σ), else {}. The one serializer of every way in: ``dpft train``'s report.json, DPTrainer's
    ``dp_state.json`` and card report, ``make_private``'s saved state."""
    return {"plan": privacy.calibrated.to_dict()} if privacy is not None and privacy.calibrated is not None else {}


def mechanism_lines(dp: dict) -> list[str]:
    m = dp.get("mechanism") or {}
    if m.get("mechanism") == "banded_mf":
        return [f"| noise | banded matrix factorization, b = {m['bands']} bands; {m['participation']}, "
                f"p = {m['partition_rate']:.5f}; accounted as {m['participations_accounted']} Poisson-subsampled "
                f"Gaussian releases ({m['source']}) |"]
    if "max_batch_size" in m:
        return [f"| truncation | at most {m['max_batch_size']} examples per step (a random subset when more are "
                f"drawn); P[truncated] = {m['truncation_probability_per_step']:.3g} per step, from N, q and the bound "
                f"alone; accounted by {m['event']} |"]
    return []
