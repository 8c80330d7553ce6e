"""The model card (``model/README.md``) of a run, in Hugging Face's format, stating the guarantee.

Built with ``huggingface_hub.ModelCard`` / ``ModelCardData`` from ``report.json`` only (a
released file), so the card says nothing the report does not: ε and δ from the run's ledger
(PLD accountant of dp-accounting, RDP cross-check), the privacy unit and N, the mechanism
(Poisson-subsampled Gaussian: σ, q, steps, C), and what the ε covers and does not cover
(README "What the printed ε means"; report ``coverage``), and the ε̂ of a final-model audit where
one is attached (report ``final_model_audit``, audit/final_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpft.config.tasks import REGISTRY
from dpft.outputs.report import audited_lines, epsilon_line, mechanism_lines, unit_line
from dpft.methods.base import get_method, registered


def _headline(rep: dict[str, Any]) -> str:
    p = rep["privacy"]
    if p.get("guarantee") == "certified":
        u = (rep.get("dp") or {}).get("privacy_unit") or {}
        unit = ("each user (all rows of one person)" if u.get("unit") == "user"
                else "each training example (one row of the training file)")
        n = u.get("n_units", rep["task"].get("n_train"))
        return (f"This model was fine-tuned with **({p['epsilon']:.4g}, {p['delta']:g})-differential privacy** for "
                f"{unit}, N = {n:,} {'users' if u.get('unit') == 'user' else 'examples'} "
                f"(add/remove-one neighbouring datasets): for any set of outcomes, the probability with one "
                f"{'user' if u.get('unit') == 'user' else 'example'} in the training set is at most e^ε times the "
                "probability without it, plus δ.")
    if p.get("guarantee") == "NOT CERTIFIED":
        return f"**No certified privacy guarantee.** This run is NOT CERTIFIED: {p.get('reason')}"
    return "**No privacy guarantee.** This is a non-private reference run (trained without clipping or noise)."


def _mechanism_rows(rep: dict[str, Any]) -> list[str]:
    dp, p = rep["dp"], rep["privacy"]
    if not dp.get("private"):
        row = _from_methods(rep, "card_mechanism")  # a method's own guarantee (e.g. a forward-pass layer)
        return [row] if row else ["| mechanism | none (no clipping, no noise) |"]
    c = dp.get("clipping") or {}
    rows = [
        "| mechanism | Poisson-subsampled Gaussian mechanism on per-example clipped gradients (DP-SGD family, "
        f"{rep['optimizer']['name']}) |",
        f"| noise multiplier σ | {dp['noise_multiplier']:.4f} (noise N(0, σ²C²) added once per step to the summed "
        "clipped gradients) |",
        f"| sampling rate q | {dp['sampling_rate']:.6f} (Poisson; expected batch {dp['expected_batch_size']}) |",
        f"| steps | {dp['steps']} |",
        f"| clipping norm C | {c.get('max_norm', float('nan')):g} ({c.get('style')}) |",
        f"| privacy unit | {unit_line(dp)} |",
    ]
    rows += mechanism_lines(dp)  # truncated Poisson / banded_mf: what differs from the rows above (issue 28)
    if p.get("guarantee") == "certified":
        acc = p.get("accountant", "PLD")
        acc = acc if "dp-accounting" in acc else f"{acc} (dp-accounting)"
        rows.append(f"| accountant | {acc} over the run's ledger; "
                    f"RDP cross-check ε = {p['epsilon_rdp']:.4g} |")
    rows.append(f"| randomness | {dp.get('randomness')} |")
    return rows


def _data_name(t: dict[str, Any]) -> str:
    """The training data as the card names it: a benchmark by name, your own file by its name
    (not its local path)."""
    src = str(t.get("source", ""))
    if src.startswith("files: "):
        return f"your own data (`{Path(src[len('files: '):]).name}`)"
    return f"{t['name']} ({src})"


def _metric_lines(rep: dict[str, Any]) -> list[str]:
    m, t = rep.get("metrics") or {}, rep["task"]
    out = []
    if "dev_accuracy" in m:
        out.append(f"- dev accuracy {m['dev_accuracy']:.4f} on {t['n_dev']:,} examples "
                   f"({t.get('dev_source', t['source'])})")
    elif "dev_loss" in m:
        out.append(f"- dev loss {m['dev_loss']:.4f} nats/token (perplexity {m.get('dev_perplexity', float('nan')):.3f})")
    test = rep.get("test")
    if test and "test_accuracy" in test:
        out.append(f"- test accuracy {test['test_accuracy']:.4f} on {test['n']:,} examples of `{Path(test['file']).name}` "
                   "(evaluated once after training; never used for selection)")
    return out


def _usage(model_dir: Path) -> list[str]:
    cfg_f, ad_f = model_dir / "config.json", model_dir / "adapter_config.json"
    if ad_f.is_file():
        meta_f = model_dir / "dpft_adapter.json"
        meta = json.loads(meta_f.read_text()) if meta_f.is_file() else {}
        lines = ["This folder holds a LoRA adapter in PEFT's format (the trained head with it). Load it with dpft:", "",
                 "```python", "from dpft.models.export import load_for_inference",
                 "tok, model, kind = load_for_inference(\"PATH_TO_THIS_FOLDER\")", "```", ""]
        if meta.get("pooling") != "mean":
            lines += ["or with PEFT: `peft.AutoPeftModelFor"
                      f"{ {'causal_lm': 'CausalLM', 'seq2seq_lm': 'Seq2SeqLM'}.get(meta.get('task'), 'SequenceClassification')}"
                      ".from_pretrained(PATH)`.", ""]
        lines += ["A merged model (no peft needed) is written with `output.merge_lora: true`.", ""]
        return lines
    if not cfg_f.is_file():
        return []
    cfg = json.loads(cfg_f.read_text())
    archs = cfg.get("architectures") or []
    if cfg.get("is_encoder_decoder") and any(a.endswith("ForConditionalGeneration") for a in archs):
        return ["```python", "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
                "tok = AutoTokenizer.from_pretrained(\"PATH_TO_THIS_FOLDER\")",
                "model = AutoModelForSeq2SeqLM.from_pretrained(\"PATH_TO_THIS_FOLDER\")",
                "out = model.generate(**tok([\"name[The Eagle], food[French]\"], return_tensors=\"pt\"), max_new_tokens=40)",
                "print(tok.batch_decode(out, skip_special_tokens=True))", "```", ""]
    if any(a.endswith("ForCausalLM") for a in archs):
        return ["```python", "from transformers import pipeline",
                "gen = pipeline(\"text-generation\", model=\"PATH_TO_THIS_FOLDER\")",
                "print(gen(\"Once upon a time\", max_new_tokens=40))", "```", ""]
    if cfg.get("model_type") == "dpft_mean_pool":
        # The head's code is in the folder (hf_mean_pool.py, named by auto_map): transformers alone
        # loads it with trust_remote_code=True (issue 36 item 5).
        return ["```python", "from transformers import pipeline",
                "clf = pipeline(\"text-classification\", model=\"PATH_TO_THIS_FOLDER\", trust_remote_code=True)",
                "print(clf([\"a gripping, funny film\", \"dull and far too long\"]))", "```", "",
                "The head is a linear layer on the masked mean of the encoder's last hidden states (how the "
                "model was trained), not BERT's [CLS] pooler: `model_type: dpft_mean_pool` in `config.json`, its "
                "code in `hf_mean_pool.py` beside it (torch and transformers only; `auto_map` names it), hence "
                "`trust_remote_code=True`; with dpft imported it is not needed.", ""]
    return ["```python", "from transformers import pipeline",
            "clf = pipeline(\"text-classification\", model=\"PATH_TO_THIS_FOLDER\")",
            "print(clf([\"a gripping, funny film\", \"dull and far too long\"]))", "```", ""]


def _from_methods(rep: dict[str, Any], hook: str):
    """The first registered method's answer to a card hook (methods/base.py ``card_mechanism``,
    ``card_usage``) for this report, else None: the card names no method."""
    for cls in registered().values():
        out = getattr(cls, hook)(rep)
        if out is not None:
            return out
    return None


def _method_sections(rep: dict[str, Any]) -> list[str]:
    """The methods' own report.md sections (methods/base.py ``markdown``), one heading level down."""
    lines: list[str] = []
    for name in rep.get("methods") or []:
        lines += [("#" + ln) if ln.startswith("## ") else ln for ln in get_method(name).markdown(rep)]
    return lines


def build_card(rep: dict[str, Any], model_dir: Path):
    """The ``huggingface_hub.ModelCard`` of a run from its report dict."""
    from huggingface_hub import ModelCard, ModelCardData

    t, mod, cov = rep["task"], rep["model"], rep.get("coverage") or {}
    kind = mod.get("kind")  # a way in that knows its model says so (DPTrainer: integrations/hf/card.py)
    if kind is None:  # a dpft train report: told by its dev metric and task
        m = rep.get("metrics") or {}
        lm = "dev_accuracy" not in m and "dev_perplexity" in m
        kind = ("seq2seq" if t.get("name") == "seq2seq" else "causal") if lm else "classifier"
    causal, s2s = kind in ("causal", "seq2seq"), kind == "seq2seq"
    base = mod["name"]
    hub_base = base if (base.count("/") == 1 and not Path(base).exists()) else None
    if base == "minilm":
        hub_base = "sentence-transformers/all-MiniLM-L6-v2"
    p = rep["privacy"]
    tags = ["dpft", "differential-privacy", "dp-sgd"] if rep["dp"].get("private") else ["dpft"]
    data = ModelCardData(
        library_name="transformers" if not (model_dir / "adapter_config.json").is_file() else "peft",
        pipeline_tag="text2text-generation" if s2s else "text-generation" if causal else "text-classification",
        tags=tags,
        base_model=hub_base,
        datasets=[REGISTRY[t["name"]].hub[0]] if t["name"] in REGISTRY else None,
        # machine-readable guarantee (free-form keys are kept in the YAML header)
        dp_epsilon=round(p["epsilon"], 6) if p.get("guarantee") == "certified" else None,
        dp_delta=p.get("delta") if p.get("guarantee") == "certified" else None,
        dp_guarantee=p.get("guarantee"),
        dp_privacy_unit=((rep["dp"].get("privacy_unit") or {}).get("unit") if rep["dp"].get("private") else None),
        # a final-model audit's lower bound (audit/final_model.py), when one is attached
        # (Steinke et al.: valid for any mechanism), and the f-DP one, which assumes a Gaussian trade-off curve
        dp_audited_epsilon_lower_bound=(rep.get("final_model_audit") or {}).get("epsilon_hat"),
        dp_audited_epsilon_lower_bound_gaussian_tradeoff=(rep.get("final_model_audit") or {}).get(
            "epsilon_hat_gaussian"),
        dp_audit_confidence=(rep.get("final_model_audit") or {}).get("confidence"),
    )
    lines = [
        f"# {rep['name']}", "",
        f"A {'sequence-to-sequence model' if s2s else 'causal language model' if causal else 'text classifier'} "
        f"fine-tuned from `{base}` on "
        f"{_data_name(t)} with dpft (differentially private fine-tuning).", "",
        _headline(rep), "",
        f"**Privacy:** {epsilon_line(rep)}", "",
        *audited_lines(rep),
        "## Privacy guarantee", "",
        "| item | value |", "|---|---|", *_mechanism_rows(rep), "",
    ]
    if p.get("guarantee") == "certified":
        lines += ["ε is computed by the PLD accountant of Google's `dp-accounting` from the run's ledger "
                  "(`ledger.json`), which records every private release of the run (each Poisson-subsampled Gaussian "
                  "step and any earlier private phase) and is only ever appended to, including across crashes and "
                  "resumes.", ""]
    if cov:
        lines += ["### What the ε covers", "", cov.get("statement", ""), ""]
        if cov.get("reproducible"):
            lines += [f"**{cov['reproducible']}**", ""]
        lines += ["It covers the files the run releases: the model (and its checkpoints), the ledger, the "
                  "released metrics and the report.", "", "### What it does not cover (and what is public)", "",
                  f"- {cov.get('dev', '')}"]
        if rep.get("test"):
            lines.append(f"- {rep['test'].get('statement', '')}")
        lines += [f"- {cov.get('not_released', '')}", f"- {cov.get('timing', '')}", f"- {cov.get('public', '')}",
                  "- The pre-training data of the base model: its privacy is whatever the base model's is.", ""]
    lines += ["## Results", "", *(_metric_lines(rep) or ["- (none recorded)"]), "",
              "## Use", "", *(_from_methods(rep, "card_usage") or _usage(model_dir)),
              "## Training", "",
              f"- base model: `{base}`; trainable: {mod['trainable']} ({mod['trainable_parameters']:,} of "
              f"{mod['total_parameters']:,} parameters)"
              + (f"; inputs truncated to {mod['max_length']} tokens" if mod.get("max_length") else "")
              + (f"; base weights quantized to {mod['quantization']} (bitsandbytes; the LoRA adapters are what was "
                 "trained)" if mod.get("quantization") else ""),
              f"- optimizer: {rep['optimizer']['name']}, lr {rep['optimizer']['lr']:g}",
              f"- task labels: {t.get('labels')}" if not causal else
              "- task: sequence to sequence (source → target, loss on target tokens)" if s2s else
              "- task: causal language modelling",
              *([f"- methods: {', '.join(rep['methods'])}"] if rep.get("methods") else []),
              "", *_method_sections(rep),
              "The run's `report.md` and `ledger.json` give the full record.", ""]
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
    return ModelCard(content)


def write_model_cards(run_dir: str | Path, rep: dict[str, Any]) -> list[Path]:
    """Write ``README.md`` into ``model/`` (and ``model_merged/``) of ``run_dir``; returns the paths."""
    run_dir = Path(run_dir)
    out = []
    for sub in ("model", "model_merged"):
        d = run_dir / sub
        if d.is_dir():
            build_card(rep, d).save(d / "README.md")
            out.append(d / "README.md")
    return out
