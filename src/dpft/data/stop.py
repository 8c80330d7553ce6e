"""Instruction tuning that learns to stop (issue 36 item 9).

A causal LM stops generating at the ids of ``generation_config.eos_token_id`` (or the
tokenizer's EOS). It learns to emit one only if one is a *target* of the completion (its label is
not ``-100``). Two ways this silently fails: a template whose end-of-turn marker is not the EOS
generation stops at (a base model's ``<|endoftext|>`` while ChatML turns end in ``<|im_end|>``),
and prompt/completion rows rendered without EOS (a tokenizer with no ``eos_token``; TRL's
``completion_only_loss`` on text that does not end in it). Then generations run to
``max_new_tokens`` and, after a few private steps, often repeat the same text for every prompt.

- :func:`learned_stop_ids`: the special tokens among the completions' targets (the stop tokens
  the data teaches; every complete row must have one), or a :class:`~dpft.data.tasks.DataError` naming the fix when there
  are none; every instruct path of dpft checks its rows with it (``data/instruct.py``; TRL's
  prepared rows via :func:`check_prepared_rows`).
- :func:`set_generation_stop`: make generation stop at them (``generation_config``, saved with
  the model so ``pipeline``/``dpft predict`` stop there too).
- :func:`identical_generations`: the warning when every generation is the same text.

No message quotes a row: only counts and token names from the vocabulary.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from dpft.data.tasks import DataError

#: Label of a position that is not a target.
IGNORE = -100


def _targets(row: Mapping[str, Any]) -> list[int]:
    """The target token ids of one row: ``labels`` other than -100, else ``input_ids`` where
    ``completion_mask`` / ``assistant_masks`` is 1 (TRL's prepared columns)."""
    if "labels" in row and row["labels"] is not None:
        return [int(t) for t in row["labels"] if int(t) != IGNORE]
    ids = row["input_ids"]
    for key in ("completion_mask", "assistant_masks"):
        if row.get(key) is not None:
            return [int(t) for t, m in zip(ids, row[key]) if m]
    return [int(t) for t in ids]  # no mask: every token is a target (plain language modelling)


def _candidates(tokenizer) -> set[int]:
    """Special tokens that may end a turn: every special id but padding, BOS and unknown (EOS
    itself, ``<|im_end|>``, ``<|eot_id|>`` ...)."""
    ids = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    for name in ("pad_token_id", "bos_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None and v != getattr(tokenizer, "eos_token_id", None):
            ids.discard(int(v))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def learned_stop_ids(rows: Iterable[Mapping[str, Any]], tokenizer, where: str,
                     cut_right: Optional[Sequence[int]] = None, max_length: Optional[int] = None) -> list[int]:
    """The special tokens that end the completions: what the model learns to stop at.

    Args:
        rows: dicts with ``input_ids`` and ``labels`` (-100 = not a target), or TRL's
            ``completion_mask`` / ``assistant_masks``.
        where: names the data in the error (a file, ``"DPSFTTrainer train_dataset"``).
        cut_right: per row, tokens cut from the right by truncation (such a row lost its end
            legitimately and is not checked); or ``max_length``: a row that long may have been.

    Returns:
        Sorted token ids (the tokenizer's EOS first when it is one of them).

    Raises:
        DataError: a complete row has no stop token (EOS, or another special token such as
            ``<|im_end|>``) among its targets (the model would never learn to end a completion);
            the message names the fix.
    """
    cand = _candidates(tokenizer)
    learned: set[int] = set()
    missing = checked = 0
    for k, row in enumerate(rows):
        if cut_right is not None and cut_right[k]:
            continue
        if max_length is not None and len(row["input_ids"]) >= max_length:
            continue
        checked += 1
        found = cand.intersection(_targets(row))
        if not found:
            missing += 1
        learned |= found
    eos = getattr(tokenizer, "eos_token", None)
    fix = ("prompt/completion rows: end every completion with the tokenizer's EOS (dpft's simple template does; "
           "TRL: SFTConfig(completion_only_loss=True) with a tokenizer that has an eos_token); chat rows: a chat "
           "template whose assistant turn ends in a special token inside the turn")
    if eos is None:
        fix = "the tokenizer has no eos_token: set one (tokenizer.eos_token = '</s>' or the model's end token); " + fix
    if checked == 0:
        return [int(tokenizer.eos_token_id)] if getattr(tokenizer, "eos_token_id", None) is not None else []
    if missing:
        raise DataError(
            f"{where}: {missing} of {checked} complete rows have no end-of-sequence token ({eos!r} or another "
            "special token such as a chat template's end of turn) among their target tokens, so the model never learns to stop and its generations "
            f"run to max_new_tokens. Fix: {fix}")
    first = int(tokenizer.eos_token_id) if getattr(tokenizer, "eos_token_id", None) in learned else None
    return ([first] if first is not None else []) + sorted(i for i in learned if i != first)


def check_prepared_rows(dataset: Any, tokenizer, where: str = "DPSFTTrainer train_dataset",
                        max_length: Optional[int] = None) -> list[int]:
    """:func:`learned_stop_ids` of a tokenised ``datasets.Dataset`` (TRL's prepared
    ``train_dataset``: ``input_ids`` with ``completion_mask``/``assistant_masks``, or ``labels``).
    ``max_length``: rows that long are taken as truncated and not checked."""
    cols = [c for c in ("input_ids", "labels", "completion_mask", "assistant_masks")
            if c in (getattr(dataset, "column_names", None) or [])]
    if "input_ids" not in cols:
        raise DataError(f"{where}: no input_ids column; check the prepared (tokenised) dataset")
    view = dataset.select_columns(cols) if hasattr(dataset, "select_columns") else dataset
    return learned_stop_ids(view, tokenizer, where, max_length=max_length)


def set_generation_stop(model, stop_ids: Optional[Sequence[int]]) -> None:
    """Add ``stop_ids`` to ``model.generation_config.eos_token_id`` (kept first: the model's own
    EOS ids), so that ``generate``, ``pipeline`` and a saved ``generation_config.json`` stop at
    what the data taught. No-op without ids or a generation config."""
    if not stop_ids:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for m in {id(model): model, id(base): base}.values():
        gc = getattr(m, "generation_config", None)
        if gc is None:
            continue
        have = gc.eos_token_id
        have = [] if have is None else [have] if isinstance(have, int) else list(have)
        new = have + [int(i) for i in stop_ids if int(i) not in have]
        gc.eos_token_id = new[0] if len(new) == 1 else new


def generation_stop_ids(model, tokenizer) -> list[int]:
    """The ids a generation ends at: ``generation_config.eos_token_id`` and the tokenizer's EOS."""
    gc = getattr(model, "generation_config", None)
    have = getattr(gc, "eos_token_id", None) if gc is not None else None
    ids = [] if have is None else [have] if isinstance(have, int) else list(have)
    if getattr(tokenizer, "eos_token_id", None) is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return [int(i) for i in ids]


def identical_generations(generations: Sequence[str]) -> Optional[str]:
    """A warning when at least two generations were made and all are the same text (after
    stripping whitespace), else None. The text itself is not quoted."""
    gens = [str(g).strip() for g in generations]
    if len(gens) < 2 or len(set(gens)) > 1:
        return None
    return (f"all {len(gens)} generations are the same text: the model ignores its prompts (too few private "
            "steps, a learning rate too low or too high, or completions that never end: check that EOS is a "
            "target). Do not deploy it as is")
