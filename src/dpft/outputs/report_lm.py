"""Report sections of causal-LM runs: privacy unit, generations."""

from __future__ import annotations

from typing import Any


def extra_sections(trainer) -> dict[str, Any]:
    """JSON-able extras of a causal-LM run for ``report.json`` (privacy unit, generations)."""
    out: dict[str, Any] = {}
    if getattr(trainer, "causal", False):
        out["lm"] = {"unit": trainer.task.unit, "block_size": trainer.task.block_size,
                     "samples": getattr(trainer, "samples", [])}
        if getattr(trainer, "generation", None):  # instruct task: eval/generate.py
            out["generation"] = trainer.generation
    return out


def generation_summary(rep: dict[str, Any]) -> list[str]:
    """The CLI's final-summary lines of an instruct run's dev generation (issue 36 item 9): exact
    match and ROUGE-L F (0–100, eval/metrics.py), and a ``WARNING`` line when every generation is
    the same text. None for other runs."""
    g = rep.get("generation")
    if not g:
        return []
    m, st = g["metrics"], g["settings"]
    out = [f"dev generation: exact match {m['dev_exact_match']:.1f} %, ROUGE-L F {m['dev_rouge_l']:.2f}, BLEU "
           f"{m['dev_bleu']:.2f} ({st['prompts']} prompts, {st['decoding']})"]
    if g.get("warning"):
        out.append(f"WARNING: {g['warning']}")
    return out


def render_extra(rep: dict[str, Any]) -> list[str]:
    """Markdown lines of the causal-LM extras (empty when absent)."""
    lines: list[str] = []
    lm = rep.get("lm")
    if lm:
        unit = {"block": f"one block of {lm['block_size']} tokens",
                "example": f"one row: a prompt/completion pair or a conversation (≤ {lm['block_size']} tokens), "
                           "loss on completion tokens only",
                "pair": f"one row: a source/target pair (source ≤ {lm['block_size']} tokens), loss on target tokens "
                        "only"}.get(lm["unit"], f"one document (≤ {lm['block_size']} tokens)")
        u = (rep.get("dp") or {}).get("privacy_unit") or {}
        if u.get("unit") == "user":  # user level: the unit is the user; a row/block is one example of theirs
            unit = f"one user (column {u.get('column')!r}, N = {u.get('n_units')} users); one example is {unit}"
        head = "Sequence-to-sequence model" if lm["unit"] == "pair" else "Causal language model"
        lines += [f"## {head}", "", f"- privacy unit: {unit}", ""]
        if lm["samples"]:
            lines += ["### Sampled generations", ""]
            for s in lm["samples"]:
                lines += [f"- **{s['prompt']}** {s['completion']}"]
            lines.append("")
    g = rep.get("generation")
    if g:
        m, st = g["metrics"], g["settings"]
        lines += ["## Generation on the dev prompts", "",
                  f"{st['decoding']}, at most {st['max_new_tokens']} new tokens; {st['prompts']} prompts scored "
                  f"against {st['references']} references (multi-reference; eval/metrics.py)", "",
                  "| BLEU (sacrebleu) | ROUGE-L F (rouge-score) | exact match |", "|---|---|---|",
                  f"| {m['dev_bleu']:.2f} | {m['dev_rouge_l']:.2f} | {m['dev_exact_match']:.1f} % |", ""]
        if g.get("warning"):  # every dev generation the same text (data/stop.py)
            lines += [f"**Warning:** {g['warning']}.", ""]
        if g.get("samples_withheld"):
            lines += ["### Generations", "", f"{g['samples_withheld']} dev generations and their references are not "
                      "printed: the dev set is your own data (not a public benchmark), and its texts are not "
                      "covered by ε.", ""]
        if g["samples"]:
            lines += ["### Generations", ""]
            for s in g["samples"]:
                lines += [f"- **{s['prompt']}** → {s['generation']}", f"  - reference: {s['references'][0]}"]
            lines.append("")
    return lines
