"""Predictions of a finished run, and the test file of ``dpft train`` (issue 24 item 2).

``dpft predict RUN_DIR --file F [--output OUT]`` reads ``F`` (CSV/TSV/JSONL/Parquet, the
columns of the run's training file), runs the saved ``model/`` in batches (a progress bar)
and writes one JSON line per row: ``{"row", "label", "label_id", "scores"}`` for a classifier
(scores = softmax probabilities in label order), ``{"row", "prompt", "generation"}`` for a
causal LM. When ``F`` has the label column, the accuracy is printed and returned.

``task.test_file`` / ``dpft train --test-file F`` evaluates the final weights on ``F`` once,
after the last step; its metrics are reported apart from dev and never steer training.
Like your own dev file, a test file is your data: its metrics are not covered by ε.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import datasets
import torch

from dpft.data.tasks import (REGISTRY, DataError, _check_missing_labels, _col, _int_labels, _load_file, _rows,
                             _ROW)
from dpft.data.stop import generation_stop_ids, identical_generations
from dpft.eval.dev import classify
from dpft.config.recipe import load_recipe
import dpft.methods  # noqa: F401 (hands the recipe schema the method registry: a saved recipe may name methods)
from dpft.data.tokenize import tokenize_split
from dpft.eval.generate import generate_ids

#: Default output name beside the input when ``--output`` is not given.
SUFFIX = ".predictions.jsonl"


def columns_of(task_cfg) -> tuple[str, Optional[str], str]:
    """``(text, text_pair, label)`` column names of the run's training data."""
    if task_cfg.name in REGISTRY and not task_cfg.train_file:
        s = REGISTRY[task_cfg.name]
        return s.text, s.pair, s.label
    return task_cfg.text_column or "text", task_cfg.text_pair_column, task_cfg.label_column or "label"


def read_rows(path: str | Path, text: str, pair: Optional[str], label: Optional[str], label_names: Sequence[str],
              require_labels: bool = False) -> datasets.Dataset:
    """Rows of ``path`` as a dataset with ``text`` [, ``text_pair``] [, ``label`` (int)] columns.

    Labels (when the column is present) are mapped as in training: strings through
    ``label_names``, integers checked to lie in ``0..K-1``.

    Raises:
        DataError: a missing column (the label column only with ``require_labels``), an empty
            text, a missing or unknown label (naming the file and rows).
    """
    where = str(path)
    ds = _load_file(path)
    cols = ds.column_names
    for role, c in (("text", text), ("text pair", pair)):
        if c is not None and c not in cols:
            raise DataError(f"{where}: no {role} column {c!r}; columns are {cols}. The run was trained on "
                            f"column {c!r}: rename the column in the file")
    has_label = label is not None and label in cols
    if require_labels and not has_label:
        raise DataError(f"{where}: no label column {label!r}; columns are {cols}. A test file needs the labels "
                        "in the training file's label column")
    keep = {text: "text", **({pair: "text_pair"} if pair else {}), **({label: "label"} if has_label else {})}
    ds = ds.select_columns(list(keep)).rename_columns({k: v for k, v in keep.items() if k != v})
    ds = ds.add_column(_ROW, list(range(1, len(ds) + 1)))
    for std, c in (("text", text), ("text_pair", pair)):
        if c is None:
            continue
        empty = [i + 1 for i, t in enumerate(_col(ds, std)) if t is None or not str(t).strip()]
        if empty:
            raise DataError(f"{where}: empty text in column {c!r} at {_rows(empty)}; fill those rows or drop them")
        if ds.features[std].dtype not in ("string", "large_string"):
            ds = ds.cast_column(std, datasets.Value("string"))
    if has_label:
        _check_missing_labels(ds, where, label)
        vals = _col(ds, "label")
        if all(isinstance(v, str) for v in vals):
            index = {n: i for i, n in enumerate(label_names)}
            bad = [r for v, r in zip(vals, _col(ds, _ROW)) if v not in index]
            if bad:
                # neither the file's values nor the run's label set are quoted: both are label values
                raise DataError(f"{where}: {len(bad)} label(s) in column {label!r} at {_rows(bad)} are not among the "
                                f"run's {len(label_names)} labels (its model's config.json id2label lists them; "
                                "labels match exactly, case included)")
            ints = [index[v] for v in vals]
        else:
            ints = _int_labels(ds, where, label)
            bad = [r for v, r in zip(ints, _col(ds, _ROW)) if not 0 <= v < len(label_names)]
            if bad:
                raise DataError(f"{where}: {len(bad)} label(s) in column {label!r} at {_rows(bad)} are outside the "
                                f"run's label set 0..{len(label_names) - 1} (negative or ≥ {len(label_names)})")
        ds = ds.remove_columns("label").add_column("label", ints)
    return ds.remove_columns(_ROW)


# ---------------------------------------------------------------------------------------------
# task.test_file at the end of `dpft train`


def evaluate_test_file(trainer) -> Optional[dict[str, Any]]:
    """The final weights on ``task.test_file`` (classification), once; None without one.

    Goes through the methods' evaluation hooks as dev does (e.g. DP-Adam-AC's EMA weights, EW-FT's
    inference noise), so test and dev describe the same model. Returns ``{"file", "n",
    "test_accuracy", "test_loss", …}``.
    """
    r = trainer.recipe
    if not r.task.test_file or trainer.causal:
        return None

    text, pair, label = columns_of(r.task)
    rows = read_rows(r.task.test_file, text, pair, label, trainer.task.label_names, require_labels=True)
    tok = tokenize_split(rows, trainer.tokenizer, r.model.max_length)

    def run_once() -> dict[str, float]:
        res = classify(trainer.model, tok, trainer.pad_id, trainer.with_token_types, r.eval.batch_size,
                       trainer.device, trainer.precision.autocast)
        return {"dev_accuracy": res["accuracy"], "dev_loss": res["loss"]}  # the keys methods expect

    out = None
    for m in trainer.methods:
        out = m.evaluate(trainer.ctx, run_once)
        if out is not None:
            break
    out = out if out is not None else run_once()
    return {"file": str(r.task.test_file), "n": len(tok),
            **{("test_" + k[4:] if k.startswith("dev_") else f"test_{k}"): v for k, v in out.items()}}


# ---------------------------------------------------------------------------------------------
# dpft predict


def predict(run_dir: str | Path, file: str | Path, output: Optional[str | Path] = None,
            batch_size: int = 64, max_new_tokens: int = 40, device: str = "cpu",
            progress: bool = True) -> dict[str, Any]:
    """Predict every row of ``file`` with the run's saved model and write JSON lines to ``output``
    (default ``<file>.predictions.jsonl``).

    Classification: the run's label names (from ``model/config.json``), softmax scores;
    causal LM: a greedy continuation of each row's text (``max_new_tokens``).

    Returns:
        ``{"output", "n", "kind", "accuracy"?}``.

    Raises:
        FileNotFoundError: no finished run in ``run_dir``. DataError: see :func:`read_rows`.
    """
    from dpft.models.export import load_for_inference

    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    if not (run_dir / "recipe.yaml").is_file() or not model_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} holds no finished run (recipe.yaml and model/): give a dpft run directory")
    if (run_dir / "model_merged").is_dir():  # the same model without peft
        model_dir = run_dir / "model_merged"
    rec = load_recipe(run_dir / "recipe.yaml")
    tok, model, kind = load_for_inference(model_dir, device)
    out_path = Path(output) if output else Path(str(file) + SUFFIX)
    text, pair, label = columns_of(rec.task)
    if kind == "seq2seq_lm":  # encoder-decoder: greedy target of each row's source (eval/generate.py)

        rows = read_rows(file, rec.task.prompt_column, None, None, [])
        srcs = _col(rows, "text")
        ids = [x[:rec.model.max_length] for x in tok(list(srcs))["input_ids"]]
        new = generate_ids(model, ids, tok.pad_token_id or 0, tok.eos_token_id, max_new_tokens, 1, batch_size)
        lines = [{"row": i + 1, "prompt": p, "generation": tok.decode(g, skip_special_tokens=True).strip()}
                 for i, (p, g) in enumerate(zip(srcs, new))]
        summary = {"kind": kind}
    elif kind == "causal_lm":
        col = rec.task.prompt_column if rec.task.name == "instruct" else (rec.task.text_column or "text")
        rows = read_rows(file, col, None, None, [])
        res = _generate(model, tok, _col(rows, "text"), batch_size, max_new_tokens, progress,
                        _stop_ids(model_dir, model, tok))
        lines = [{"row": i + 1, "prompt": p, "generation": g} for i, (p, g) in enumerate(zip(_col(rows, "text"), res))]
        summary: dict[str, Any] = {"kind": kind}
    else:
        id2label = {int(k): v for k, v in (getattr(_cfg_of(model), "id2label", None) or {}).items()}
        names = [id2label[i] for i in sorted(id2label)]
        rows = read_rows(file, text, pair, label, names)
        ds = tokenize_split(rows, tok, rec.model.max_length)
        with_tt = "token_type_ids" in tok.model_input_names
        res = classify(model, ds, tok.pad_token_id or 0, with_tt, batch_size, device, progress=progress)
        probs = res["logits"].softmax(-1)
        lines = [{"row": i + 1, "label": names[int(p.argmax())], "label_id": int(p.argmax()),
                  "scores": [round(float(x), 6) for x in p]} for i, p in enumerate(probs)]
        summary = {"kind": kind, "labels": names}
        if "accuracy" in res:
            summary["accuracy"] = res["accuracy"]
    if kind in ("causal_lm", "seq2seq_lm"):
        warning = identical_generations([x["generation"] for x in lines])
        if warning:  # a model that ignores its prompts (issue 36 item 9)
            summary["warning"] = warning
            print(f"WARNING: {warning}", file=sys.stderr)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    return {"output": str(out_path), "n": len(lines), **summary}


def _stop_ids(model_dir: Path, model, tok) -> list[int]:
    """Where a generation ends: the run's saved ``generation_config.json`` (an instruct run adds the
    token its completions end with, data/stop.py), the model's own and the tokenizer's EOS."""
    ids = generation_stop_ids(model, tok)
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        saved = GenerationConfig.from_pretrained(model_dir).eos_token_id
        saved = [] if saved is None else [saved] if isinstance(saved, int) else list(saved)
        ids += [int(i) for i in saved if int(i) not in ids]
    return ids


def _cfg_of(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


@torch.no_grad()
def _generate(model, tok, prompts: Sequence[str], batch_size: int, max_new_tokens: int, progress: bool,
              stop_ids: Optional[Sequence[int]] = None) -> list[str]:
    """Greedy continuations, left-padded batches, ending at ``stop_ids`` (None: the model's
    generation config)."""
    from tqdm.auto import tqdm

    side = tok.padding_side
    tok.padding_side = "left"
    outs: list[str] = []
    device = next(model.parameters()).device
    try:
        for k in tqdm(range(0, len(prompts), batch_size), desc="generate", disable=not progress, file=sys.stderr):
            enc = tok(list(prompts[k:k + batch_size]), return_tensors="pt", padding=True).to(device)
            stop = {} if not stop_ids else {"eos_token_id": list(stop_ids)}
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, **stop)
            outs += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tok.padding_side = side
    return outs
