"""``dpft report`` on a ``dpft train`` run that has no report yet (interrupted, killed, or still
running): ε from its live ``ledger.json`` at the recipe's δ, the plan and the checkpoint from
``checkpoint/state.json``, the last dev evaluation from ``metrics.jsonl``, and the command that
resumes it. Such a folder used to be read as "a DPTrainer run … ε: NOT CERTIFIED" although its
ledger certifies ε (issue 36 item 6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from dpft.accounting.ledger import NotCertifiedError, PrivacyLedger

__all__ = ["is_train_run", "reprint_interrupted"]


def _state(d: Path) -> Optional[dict]:
    for ck in ("checkpoint", ".checkpoint.old"):
        f = d / ck / "state.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except ValueError:
                return None
    return None


def is_train_run(d: Path) -> bool:
    """``d`` was written by ``dpft train`` (its recipe or checkpoint), not by DPTrainer."""
    return (d / "recipe.yaml").is_file() or _state(d) is not None


def _recipe(d: Path, state: Optional[dict]) -> dict:
    if state and isinstance(state.get("recipe"), dict):
        return state["recipe"]
    import yaml

    try:
        return yaml.safe_load((d / "recipe.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _last_dev(d: Path) -> dict[str, Any]:
    f = d / "metrics.jsonl"
    if not f.is_file():
        return {}
    last: dict[str, Any] = {}
    for line in f.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if any(k.startswith("dev_") for k in row):
            last = {k: v for k, v in row.items() if k.startswith("dev_") or k in ("step", "epsilon")}
    return last


def reprint_interrupted(d: Path, epsilon_line, privacy_section, steps_cell) -> str:
    """Markdown report of a ``dpft train`` folder without ``report.json`` (see the module docstring);
    outputs/report.py hands in its row builders (so this module does not import it back)."""
    state = _state(d)
    rec = _recipe(d, state)
    p = rec.get("privacy") or {}
    private = p.get("enabled", True)
    delta = float(p.get("delta") or 1e-5)
    ledger = PrivacyLedger.load(d / "ledger.json") if (d / "ledger.json").is_file() else None
    if not private:
        priv: dict[str, Any] = privacy_section(None, delta)
    elif ledger is None:
        priv = {"guarantee": "certified", "epsilon": 0.0, "delta": delta, "epsilon_rdp": 0.0,
                "accountant": "no ledger.json yet: nothing was released"}
    else:
        try:
            priv = privacy_section(ledger, delta)
        except NotCertifiedError as exc:
            priv = {"guarantee": "NOT CERTIFIED", "reason": str(exc), "epsilon": None}
    released = sum(e.count for e in ledger.entries if e.phase == "train") if ledger else 0
    total = (state or {}).get("total_steps")
    target = p.get("target_epsilon") if p.get("noise_multiplier") is None else None
    dp = {"private": private, "steps": total if isinstance(total, int) else "?", "released_steps": released,
          "replays": (state or {}).get("replays", []), "target_epsilon": target}
    rep = {"privacy": priv, "dp": dp}
    where = (f"checkpoint at step {state['step']} of {total}" if state else "no checkpoint yet")
    lines = [f"# dpft train run: {rec.get('name') or d.name} — not finished (no report.json)", "",
             f"**Privacy (spent so far):** {epsilon_line(rep)}", "",
             f"This run stopped (or is still running) before writing its report: {where}; its ledger holds "
             f"{released} training releases. Resume it with `dpft train … --output-dir {d} --resume` (the same "
             "recipe and flags): it writes the model and the report.", "", "| item | value |", "|---|---|"]
    if state and private:
        lines += [f"| noise multiplier σ | {state.get('sigma', 0):.4f} |",
                  f"| sampling | Poisson, q = {state.get('q', 0):.5f} |",
                  f"| steps | {steps_cell(dp) if isinstance(total, int) else '?'} (checkpoint at step {state['step']}) |",
                  f"| privacy unit | N = {state.get('n', '?')} |"]
    ev = _last_dev(d)
    if ev:
        lines.append("| last evaluation | " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in ev.items()) + " |")
    lines.append("")
    if priv.get("ledger"):
        lines += ["## Ledger (every private release so far)", "", "| phase | count | event |", "|---|---|---|"]
        lines += [f"| {e['phase']} | {e['count']} | `{e['event']}` |" for e in priv["ledger"]]
        lines.append("")
    return "\n".join(lines)
