"""Tokenisation and collation into model batches.

Examples are tokenised once (no padding); each physical micro-batch is padded to its own
longest example. Batches carry explicit ``position_ids`` and ``token_type_ids`` of shape
``(B, T)``: Hugging Face models otherwise broadcast a ``(1, T)`` buffer, whose batch dimension
of 1 would make hook-based per-example gradients of position embeddings wrong.
"""

from __future__ import annotations

from typing import Optional, Sequence

import datasets
import torch

from dpft.data.tasks import DataError, _col

#: Each text (and text pair) is cut to ``max_length * CHARS_PER_TOKEN`` characters before it is
#: tokenised. Only the first ``max_length`` tokens are kept anyway, and natural text averages
#: a few characters per token, so the cut changes nothing but memory (a 50 MB field otherwise
#: took 7 GB of RAM in the tokenizer). Only a text whose first ``max_length`` tokens average
#: more than 64 characters each would lose tokens to it.
CHARS_PER_TOKEN = 64

_TRUNC = "__dpft_truncated__"


def _cap(texts: Sequence[Optional[str]], max_chars: int) -> list[Optional[str]]:
    return [t if t is None or len(t) <= max_chars else t[:max_chars] for t in texts]


def tokenize_split(ds: datasets.Dataset, tokenizer, max_length: int,
                   stats: Optional[dict] = None) -> datasets.Dataset:
    """Add ``input_ids`` (and ``token_type_ids`` when the tokenizer has them), truncated to
    ``max_length`` tokens (texts are first cut to ``max_length * CHARS_PER_TOKEN`` characters).

    Args:
        stats: if given, filled with ``n`` (examples) and ``truncated`` (how many were longer
            than ``max_length`` tokens and were truncated).

    Raises:
        DataError: a row with no text.
    """
    max_chars = max_length * CHARS_PER_TOKEN

    def fn(batch):
        cut = [t is not None and len(t) > max_chars for t in batch["text"]]
        text = _cap(batch["text"], max_chars)
        pair = None
        if "text_pair" in batch:
            cut = [c or (t is not None and len(t) > max_chars) for c, t in zip(cut, batch["text_pair"])]
            pair = _cap(batch["text_pair"], max_chars)
        enc = tokenizer(text, pair, truncation=True, max_length=max_length)
        out = {"input_ids": enc["input_ids"]}
        if "token_type_ids" in enc:
            out["token_type_ids"] = enc["token_type_ids"]
        if getattr(enc, "encodings", None):  # fast tokenizer: truncated rows keep what they cut
            over = [bool(e.overflowing) for e in enc.encodings]
        else:  # slow tokenizer: a row that reaches max_length + 1 tokens was truncated
            longer = tokenizer(text, pair, truncation=True, max_length=max_length + 1)
            over = [len(x) > max_length for x in longer["input_ids"]]
        out[_TRUNC] = [a or b for a, b in zip(over, cut)]
        return out

    texts = _col(ds, "text")
    empty = [i + 1 for i, t in enumerate(texts) if t is None]
    if empty:
        raise DataError(f"{len(empty)} rows have no text (rows {empty[:5]} of this split, counting from 1); "
                        "drop them or fill the text column")
    out = ds.map(fn, batched=True, desc="tokenising", load_from_cache_file=False)
    if stats is not None:
        stats["n"] = len(out)
        stats["truncated"] = int(sum(_col(out, _TRUNC)))
    return out.remove_columns(_TRUNC)


def truncation_note(train: dict, dev: dict, max_length: int, private: bool = True) -> Optional[str]:
    """The report note for the ``stats`` of :func:`tokenize_split` on train and dev, or None
    when there is nothing to say.

    With ``private`` the training-set count is left out: it is a statistic of the private data,
    and the report holds only public or privatised quantities (DESIGN.md, "The release set").
    The dev count is reported like the dev metrics are.
    """
    if private:
        if not dev.get("truncated"):
            return None
        return (f"truncated to model.max_length = {max_length} tokens: {dev['truncated']} of {dev['n']} dev "
                "examples (raise model.max_length to keep more text; the count for the private training "
                "set is not released)")
    if not train.get("truncated") and not dev.get("truncated"):
        return None
    return (f"truncated to model.max_length = {max_length} tokens: {train['truncated']} of {train['n']} "
            f"training and {dev['truncated']} of {dev['n']} dev examples (raise model.max_length to keep more text)")


def tokenize_task(task, tokenizer, max_length: int, private: bool = True) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenise ``task.train`` and ``task.dev`` (:func:`tokenize_split`), set ``task.truncated``
    to ``{"max_length", "train", "dev"}`` (examples truncated to ``max_length`` tokens per split)
    and append :func:`truncation_note` to ``task.notes`` (with ``private``, the dev count only).

    Returns:
        ``(train_tok, dev_tok)``.
    """
    st_train: dict = {}
    st_dev: dict = {}
    train_tok = tokenize_split(task.train, tokenizer, max_length, st_train)
    dev_tok = tokenize_split(task.dev, tokenizer, max_length, st_dev)
    task.truncated = {"max_length": max_length, "train": st_train["truncated"], "dev": st_dev["truncated"]}
    note = truncation_note(st_train, st_dev, max_length, private)
    if note:
        task.notes.append(note)
    return train_tok, dev_tok


def collate(rows: Sequence[dict], pad_id: int, with_token_types: bool = True,
            device: Optional[torch.device | str] = None) -> dict[str, torch.Tensor]:
    """Pad a list of tokenised rows into a batch dict of ``(B, T)`` tensors plus ``labels (B,)``,
    built on the CPU and moved to ``device`` when given (the run's ``perf.device``)."""
    b = len(rows)
    if rows and "target_ids" in rows[0]:
        return collate_seq2seq(rows, pad_id, device)
    t = max(len(r["input_ids"]) for r in rows) if b else 1
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    tt = torch.zeros((b, t), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        if "token_type_ids" in r:
            tt[i, :n] = torch.tensor(r["token_type_ids"])
    out = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": torch.arange(t).unsqueeze(0).expand(b, t).contiguous(),
    }
    if with_token_types:
        out["token_type_ids"] = tt
    if rows and "label" in rows[0]:
        out["labels"] = torch.tensor([int(r["label"]) for r in rows], dtype=torch.long)
    elif rows and "labels" in rows[0]:  # instruct task: per-token targets, -100 = no loss (padding too)
        lab = torch.full((b, t), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            lab[i, :len(r["labels"])] = torch.tensor(r["labels"], dtype=torch.long)
        out["labels"] = lab
    if device is not None and torch.device(device).type != "cpu":
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out


def collate_seq2seq(rows: Sequence[dict], pad_id: int, device: Optional[torch.device | str] = None
                    ) -> dict[str, torch.Tensor]:
    """Pad source/target rows (data/seq2seq.py) into ``input_ids``/``attention_mask`` ``(B, S)``
    (right padding with ``pad_id``) and ``labels`` ``(B, T)`` (-100 after each target). No
    ``position_ids``/``token_type_ids``: encoder-decoder models (T5, BART) take none, and the
    engine's rules cover their batch-independent position tables (issue 27)."""
    b = len(rows)
    s = max(len(r["input_ids"]) for r in rows) if b else 1
    t = max(len(r["target_ids"]) for r in rows) if b else 1
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.long)
    lab = torch.full((b, t), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n, m = len(r["input_ids"]), len(r["target_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        lab[i, :m] = torch.tensor(r["target_ids"])
    out = {"input_ids": ids, "attention_mask": mask, "labels": lab}
    if device is not None and torch.device(device).type != "cpu":
        out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return out
