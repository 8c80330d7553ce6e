"""Report sections of causal-LM runs and DP-Adam-AC options: privacy unit, generations, C and γ."""

from __future__ import annotations

from typing import Any


def extra_sections(trainer) -> dict[str, Any]:
    """JSON-able extras for ``report.json``."""
    out: dict[str, Any] = {}
    r = trainer.recipe
    if getattr(trainer, "causal", False):
        out["lm"] = {"unit": trainer.task.unit, "block_size": trainer.task.block_size,
                     "samples": getattr(trainer, "samples", [])}
    if getattr(trainer, "adam_ac_active", False):
        ac = r.adam_ac.model_dump(mode="json")
        info: dict[str, Any] = {"options": ac}
        if trainer.private:
            info["noise_multiplier_accounted"] = trainer.sigma
            info["noise_multiplier_gradient"] = getattr(trainer, "noise_sigma", trainer.sigma)
            info["final_clip_norm"] = float(trainer.clip.max_norm)
        if getattr(trainer, "gamma", None) is not None:
            info["final_gamma"] = trainer.gamma.gamma
        out["adam_ac"] = info
    return out


def render_extra(rep: dict[str, Any]) -> list[str]:
    """Markdown lines for the extras (empty when absent)."""
    lines: list[str] = []
    ac = rep.get("adam_ac")
    if ac:
        o = ac["options"]
        opts = [k for k in ("adaptive_clip", "gamma_nudge", "bias_correction", "reproduce_paper") if o.get(k)]
        if o.get("ema_decay"):
            opts.append(f"EMA d = {o['ema_decay']}")
        lines += ["## DP-Adam family options", "", f"- enabled: {', '.join(opts) or 'none'}"]
        if "noise_multiplier_gradient" in ac:
            lines.append(f"- σ accounted {ac['noise_multiplier_accounted']:.4g}; gradient noise σ_Δ "
                         f"{ac['noise_multiplier_gradient']:.4g} (the rest pays for the noisy unclipped count)")
            lines.append(f"- final clipping norm C = {ac['final_clip_norm']:.4g}")
        if "final_gamma" in ac:
            lines.append(f"- final learning-rate multiplier γ = {ac['final_gamma']:.4g}")
        if o.get("ema_decay"):
            lines.append("- dev metrics are of the EMA weights (raw weights: the *_raw fields of report.json); "
                         "both are saved (model/ and model_ema/)")
        lines.append("")
    lm = rep.get("lm")
    if lm:
        unit = (f"one block of {lm['block_size']} tokens" if lm["unit"] == "block"
                else f"one document (≤ {lm['block_size']} tokens)")
        lines += ["## Causal language model", "", f"- privacy unit: {unit}", ""]
        if lm["samples"]:
            lines += ["### Sampled generations", ""]
            for s in lm["samples"]:
                lines += [f"- **{s['prompt']}** {s['completion']}"]
            lines.append("")
    return lines
