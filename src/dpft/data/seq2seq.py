"""The ``seq2seq`` task: source → target pairs for encoder-decoder models (T5, BART, …), with the
loss on the target tokens only.

Input: a CSV/TSV/JSONL/Parquet file (read through ``datasets``) with a source column
(``task.prompt_column``, default ``prompt``) and a target column (``task.completion_column``,
default ``completion``), e.g. E2E's ``mr``/``ref``.

Tokenisation: the source is tokenised with the tokenizer's own special tokens (T5: ``… </s>``;
BART: ``<s> … </s>``) and cut on the right to ``model.max_length`` tokens (``input_ids``); the
target likewise to ``task.max_target_length`` (default ``model.max_length``) tokens
(``target_ids``), and always ends with the tokenizer's EOS (appended when the tokenizer does not
add it, kept when a long target is cut), so the model learns to stop. The decoder input is the
model's own right shift of the target (``decoder_start_token_id`` first): transformers builds it
from ``labels`` (models/losses.py ``seq2seq_lm_loss``). Every target token counts in the loss,
summed per example (the causal-LM convention); the encoder input carries no loss.

One row is one example — **the privacy unit is one row** (one source/target pair). Columns other
than the two read are kept per row (e.g. a user id column for user-level privacy); they may not
have a reserved name (:data:`RESERVED_COLUMNS`).

Dev generation: dev rows are grouped by their source tokens; each group is one source with all
its references (multi-reference scoring, as the instruct task; eval/generate.py). Truncation
counts: the dev counts go in the report's notes; the training count is private (returned in
``truncated`` for the terminal only, as data/instruct.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import datasets

from dpft.config.recipe import TaskCfg
from dpft.data.tasks import DataError, _load_file

#: Column names the trainer uses itself; a kept data column with one of these names is refused.
RESERVED_COLUMNS = ("input_ids", "target_ids", "labels", "label", "attention_mask", "position_ids",
                    "token_type_ids", "decoder_input_ids")


@dataclass
class Seq2SeqData:
    """A tokenised source/target dataset. ``train``/``dev`` rows carry ``input_ids`` (source) and
    ``target_ids`` (target, EOS last) and every extra column of the file."""

    name: str
    train: datasets.Dataset
    dev: datasets.Dataset
    source: str
    block_size: int
    #: Dev sources for generation: ``[{"prompt_ids", "prompt", "references"}]`` (multi-reference).
    groups: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    label_names: list[str] = field(default_factory=list)
    #: ``{"max_length", "max_target_length", "train", "dev"}`` rows truncated; ``train`` is private.
    truncated: Optional[dict] = None
    #: One row = one source/target pair.
    unit: str = "pair"
    template: str = "seq2seq"

    @property
    def num_labels(self) -> int:
        return 0


def read_pairs(ds: datasets.Dataset, cfg: TaskCfg, where: str) -> tuple[list[str], list[str]]:
    """Sources and targets of a table.

    Raises:
        DataError: a missing column, a reserved name on a kept column, an empty source or target.
    """
    s, t = cfg.prompt_column, cfg.completion_column
    cols = ds.column_names
    missing = [c for c in (s, t) if c not in cols]
    if missing:
        raise DataError(f"{where}: no source/target column(s) {missing}; columns are {cols}. Set "
                        "--set task.prompt_column=<source> --set task.completion_column=<target>")
    bad = [c for c in cols if c in RESERVED_COLUMNS and (c not in (s, t) or c == cfg.user_column)]
    if bad:
        raise DataError(f"{where}: column(s) {bad} have names dpft uses itself for the columns it keeps; rename "
                        f"them (reserved: {', '.join(RESERVED_COLUMNS)}), or drop them from the file")
    src, tgt = [], []
    for i, (a, b) in enumerate(zip(ds[s], ds[t])):
        if a is None or not str(a).strip() or b is None or not str(b).strip():
            which = "source" if a is None or not str(a).strip() else "target"
            raise DataError(f"{where}: row {i + 1} has an empty {which} ({s if which == 'source' else t!r}); "
                            "drop or fill it")
        src.append(str(a))
        tgt.append(str(b))
    return src, tgt


def encode_pairs(sources: list[str], targets: list[str], tokenizer, max_length: int,
                 max_target_length: int) -> dict[str, list]:
    """Tokenise source/target pairs (module docstring).

    Returns:
        ``{"input_ids", "target_ids", "cut_source", "cut_target"}`` per row (lists of ints; the
        cut flags say whether a row was truncated).

    Raises:
        DataError: the tokenizer has no EOS token (the target could not end).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the seq2seq task needs a tokenizer with an EOS token (the target's end); give a "
                        "T5/BART-style tokenizer or set tokenizer.eos_token")
    src = tokenizer(list(sources))["input_ids"]
    tgt = tokenizer(text_target=list(targets))["input_ids"]
    out: dict[str, list] = {"input_ids": [], "target_ids": [], "cut_source": [], "cut_target": []}
    for s, t in zip(src, tgt):
        s, t = list(s), list(t)
        if not t or t[-1] != eos:
            t = t + [eos]
        cut_s, cut_t = len(s) > max_length, len(t) > max_target_length
        if cut_s:  # keep the tokenizer's end marker of the source
            s = s[:max_length - 1] + [s[-1]] if s[-1] == eos else s[:max_length]
        if cut_t:
            t = t[:max_target_length - 1] + [eos]
        out["input_ids"].append(s)
        out["target_ids"].append(t)
        out["cut_source"].append(cut_s)
        out["cut_target"].append(cut_t)
    return out


def group_sources(enc: dict[str, list], sources: list[str], targets: list[str]) -> list[dict]:
    """Dev generation groups: rows with the same source tokens, each with all its references.

    Returns:
        ``[{"prompt_ids", "prompt", "references"}]`` in order of first appearance.
    """
    groups: dict[tuple, dict] = {}
    for ids, s, t in zip(enc["input_ids"], sources, targets):
        g = groups.setdefault(tuple(ids), {"prompt_ids": list(ids), "prompt": s, "references": []})
        g["references"].append(t.strip())
    return list(groups.values())


def _tokenised(ds: datasets.Dataset, used: list[str], enc: dict[str, list], keep: Optional[str]) -> datasets.Dataset:
    extra = {c: ds[c] for c in ds.column_names if c not in used or c == keep}
    return datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "target_ids": enc["target_ids"], **extra})


def load_seq2seq_task(cfg: TaskCfg, tokenizer, max_length: int, seed: int = 0, private: bool = True) -> Seq2SeqData:
    """Read and tokenise a source/target dataset (module docstring).

    Args:
        cfg: the recipe's task section (``train_file``, optional ``dev_file``, ``prompt_column``
            (source), ``completion_column`` (target), ``max_target_length``, subsets).
        max_length: source tokens per example (``model.max_length``).
        private: leave the training truncation count out of ``notes`` (it is private).

    Raises:
        DataError: no ``train_file``, unreadable or empty file, missing columns, empty rows.
    """
    if not cfg.train_file:
        raise DataError("task 'seq2seq' needs --train-file (CSV/TSV/JSONL/Parquet with source and target "
                        "columns: task.prompt_column, task.completion_column)")
    max_tgt = cfg.max_target_length or max_length
    notes: list[str] = []
    train_ds = _load_file(cfg.train_file)
    if cfg.dev_file:
        dev_ds = _load_file(cfg.dev_file)
    else:
        if len(train_ds) < 2:
            raise DataError(f"{cfg.train_file}: too few rows to hold out a dev split; give --dev-file")
        split = train_ds.train_test_split(test_size=cfg.dev_fraction, seed=seed)
        train_ds, dev_ds = split["train"], split["test"]
        notes.append(f"dev = {cfg.dev_fraction:.0%} of the rows of {cfg.train_file} held out (seed {seed})")
    if len(train_ds) == 0 or len(dev_ds) == 0:
        raise DataError(f"{cfg.train_file if len(train_ds) == 0 else cfg.dev_file}: no rows")
    if cfg.max_train_examples and cfg.max_train_examples < len(train_ds):
        train_ds = train_ds.shuffle(seed=seed).select(range(cfg.max_train_examples))
        notes.append(f"training set: a seeded random subset of {cfg.max_train_examples} rows "
                     f"(N = {cfg.max_train_examples})")
    tr_s, tr_t = read_pairs(train_ds, cfg, str(cfg.train_file))
    dv_s, dv_t = read_pairs(dev_ds, cfg, str(cfg.dev_file or cfg.train_file))
    tr = encode_pairs(tr_s, tr_t, tokenizer, max_length, max_tgt)
    dv = encode_pairs(dv_s, dv_t, tokenizer, max_length, max_tgt)
    groups = group_sources(dv, dv_s, dv_t)
    used = [cfg.prompt_column, cfg.completion_column]
    train = _tokenised(train_ds, used, tr, cfg.user_column)
    dev = _tokenised(dev_ds, used, dv, cfg.user_column)
    if cfg.max_dev_examples and cfg.max_dev_examples < len(dev):
        dev = dev.shuffle(seed=seed).select(range(cfg.max_dev_examples))
        notes.append(f"dev loss: a seeded random subset of {cfg.max_dev_examples} dev rows (generation uses "
                     "every dev row's reference)")
    n_cut = lambda e: sum(1 for a, b in zip(e["cut_source"], e["cut_target"]) if a or b)  # noqa: E731
    truncated = {"max_length": max_length, "max_target_length": max_tgt, "train": n_cut(tr), "dev": n_cut(dv)}
    if truncated["dev"]:
        notes.append(f"truncated to {max_length} source / {max_tgt} target tokens: {truncated['dev']} of "
                     f"{len(dv_s)} dev rows" + ("; the count for the private training set is not released"
                                                if private else ""))
    if truncated["train"] and not private:
        notes.append(f"truncated: {truncated['train']} of {len(tr_s)} training rows (non-private run)")
    kept = [c for c in train.column_names if c not in ("input_ids", "target_ids")]
    row = "one row (source/target pair)"
    unit = (f"privacy unit: one user (column {cfg.user_column!r}: all of that user's rows); one example is {row}"
            if cfg.user_column and private else f"privacy unit: {row}")
    notes.append(f"{unit}; encoder-decoder, loss on target tokens only" + (f"; extra columns kept: {kept}" if kept else ""))
    notes.append(f"dev generation: {len(groups)} distinct sources, {sum(len(g['references']) for g in groups)} "
                 "references (multi-reference scoring)")
    return Seq2SeqData("seq2seq", train, dev, f"source/target data: {cfg.train_file}", max_length, groups, notes,
                       truncated=truncated)
