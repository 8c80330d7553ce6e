"""The ``text`` task: a text corpus for causal-language-model fine-tuning.

A corpus is a file with one text per row: a CSV/TSV/JSONL/Parquet column (``task.text_column``,
default ``text``) or a ``.txt`` file with one text per line. Train and dev are split by
*document* before tokenisation, so no text lends tokens to both.

The privacy unit (what one "example" of the (ε, δ) guarantee is) is set by ``task.unit``:

- ``block`` (default, the DP-Adam-AC paper's setup): every document is tokenised with BOS/EOS,
  the token streams are concatenated in order and cut into blocks of ``block_size`` tokens
  (the last partial block is dropped). One block is one example. A document that straddles
  two blocks contributes to two examples, so the guarantee is per block, not per document
  (a document of k blocks is protected at group size k).
- ``document``: one document is one example. Its tokens fill one row on their own (never
  packed with another document's), truncated to ``block_size`` tokens; shorter documents are
  padded at collation. The guarantee is then per document.

Memory: in ``document`` mode a text is cut to ``block_size * CHARS_PER_TOKEN`` characters (64
per token, see data/tokenize.py) before it is tokenised; in ``block`` mode every token is kept,
and a text over ``PIECE_CHARS`` characters is tokenised in pieces cut before a whitespace
character (exact for tokenizers that split words at whitespace, as BPE and WordPiece do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import datasets

from dpft.config.recipe import TaskCfg
from dpft.data.tasks import DataError, _load_file
from dpft.data.tokenize import CHARS_PER_TOKEN

#: ``block`` mode: texts longer than this are tokenised in pieces of about this many characters.
PIECE_CHARS = 1 << 20


@dataclass
class TextData:
    """A tokenised corpus. ``train``/``dev`` have ``input_ids`` (and ``doc_id``) per example."""

    name: str
    train: datasets.Dataset
    dev: datasets.Dataset
    source: str
    unit: str
    block_size: int
    notes: list[str] = field(default_factory=list)
    #: Kept so that the report/trainer code written for classification tasks still works.
    label_names: list[str] = field(default_factory=list)
    #: ``document`` mode: ``{"max_length", "train", "dev"}``, documents truncated to
    #: ``block_size`` tokens per split (the training count is private: not in ``notes``).
    truncated: Optional[dict] = None

    @property
    def num_labels(self) -> int:
        return 0


def read_texts(path: str | Path, column: Optional[str]) -> list[str]:
    """Texts of a corpus file: a ``.txt`` file (one per non-empty line) or a table column.

    Raises:
        DataError: missing file or column, or no non-empty text.
    """
    p = Path(path)
    if p.suffix.lower() == ".txt":
        if not p.is_file():
            raise DataError(f"corpus file not found: {p}")
        texts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines()]
    else:
        ds = _load_file(p)
        col = column or "text"
        if col not in ds.column_names:
            raise DataError(f"{p}: no text column {col!r}; columns are {ds.column_names}. "
                            "Pass --text-column with one of them")
        texts = [("" if t is None else str(t)).strip() for t in ds[col]]
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"{p}: no non-empty text rows")
    return texts


def read_texts_users(path: str | Path, column: Optional[str], user_column: str) -> tuple[list[str], list]:
    """Texts and their users (``task.user_column``) of a table corpus, empty texts dropped.

    Raises:
        DataError: a ``.txt`` corpus (no columns), a missing text/user column, a row without user.
    """
    p = Path(path)
    if p.suffix.lower() == ".txt":
        raise DataError(f"{p}: a .txt corpus has no user column; give a CSV/TSV/JSONL/Parquet file with "
                        f"a {user_column!r} column, or drop --user-column")
    ds = _load_file(p)
    col = column or "text"
    for role, c in (("text", col), ("user", user_column)):
        if c not in ds.column_names:
            raise DataError(f"{p}: no {role} column {c!r}; columns are {ds.column_names}. "
                            f"Pass --{role}-column with one of them")
    texts = [("" if t is None else str(t)).strip() for t in ds[col]]
    users = list(ds[user_column])
    missing = [i + 1 for i, u in enumerate(users) if u is None or not str(u).strip()]
    if missing:
        raise DataError(f"{p}: no user id in column {user_column!r} at rows {missing[:5]} (counting from 1); "
                        "every row needs its user at user-level privacy: fill those rows or drop them")
    keep = [(t, str(u)) for t, u in zip(texts, users) if t]
    if not keep:
        raise DataError(f"{p}: no non-empty text rows")
    return [t for t, _ in keep], [u for _, u in keep]


def chunk_blocks_by_user(docs: Sequence[Sequence[int]], users: Sequence, block_size: int,
                         unit: str = "block") -> dict[str, list]:
    """:func:`chunk_blocks` at user level: every example carries its ``user``, and in ``block``
    mode a user's documents are concatenated and cut *on their own* (a block never holds two
    users' tokens; each user's last partial block is dropped), so a block has one owner.

    Returns:
        ``{"input_ids", "doc_id", "user"}``.
    """
    if unit == "document":
        out = chunk_blocks(docs, block_size, unit)
        out["user"] = [users[i] for i in out["doc_id"]]
        return out
    by_user: dict = {}
    for i, u in enumerate(users):
        by_user.setdefault(u, []).append(i)
    out = {"input_ids": [], "doc_id": [], "user": []}
    for u, idx in by_user.items():
        part = chunk_blocks([docs[i] for i in idx], block_size, unit)
        out["input_ids"] += part["input_ids"]
        out["doc_id"] += [idx[j] for j in part["doc_id"]]
        out["user"] += [u] * len(part["input_ids"])
    return out


def _pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut made just before a
    whitespace character that precedes a non-space (the start of a word)."""
    out, start = [], 0
    while len(text) - start > size:
        cut = start + size
        while cut > start and not (text[cut].isspace() and not text[cut + 1:cut + 2].isspace()):
            cut -= 1
        if cut == start:  # no word boundary in the window: cut anywhere
            cut = start + size
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _encode(texts: Sequence[str], tokenizer, max_chars: Optional[int] = None) -> list[list[int]]:
    """Token ids of each text with BOS (if the tokenizer has one) and EOS appended.

    ``max_chars``: cut each text to that many characters first (``document`` mode); without
    it, texts over ``PIECE_CHARS`` characters are tokenised piece by piece (bounded memory).
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if max_chars is not None:
        ids = tokenizer([t[:max_chars] for t in texts], add_special_tokens=False)["input_ids"]
    else:
        ids = []
        for t in texts:
            parts = _pieces(t, PIECE_CHARS) if len(t) > PIECE_CHARS else [t]
            ids.append([x for part in tokenizer(parts, add_special_tokens=False)["input_ids"] for x in part])
    return [([bos] if bos is not None else []) + x + ([eos] if eos is not None else []) for x in ids]


def chunk_blocks(docs: Sequence[Sequence[int]], block_size: int, unit: str = "block") -> dict[str, list]:
    """Cut tokenised documents into examples.

    Args:
        docs: token ids per document.
        block_size: tokens per block (≥ 2: a block must hold at least one next-token target).
        unit: ``block`` (concatenate, cut, drop the remainder) or ``document`` (one document
            per example, truncated to ``block_size``).

    Returns:
        ``{"input_ids": [...], "doc_id": [...]}``; in ``block`` mode ``doc_id`` is the
        document of the block's first token (a block may span documents), in ``document``
        mode it is the only document of the row.

    Raises:
        ValueError: block_size < 2 or unknown unit.
    """
    if block_size < 2:
        raise ValueError(f"block size must be ≥ 2 tokens, got {block_size}")
    if unit == "document":
        keep = [(i, list(d[:block_size])) for i, d in enumerate(docs) if len(d) >= 2]
        return {"input_ids": [x for _, x in keep], "doc_id": [i for i, _ in keep]}
    if unit != "block":
        raise ValueError(f"unknown privacy unit {unit!r}; use block or document")
    stream: list[int] = []
    owner: list[int] = []
    for i, d in enumerate(docs):
        stream.extend(d)
        owner.extend([i] * len(d))
    n = len(stream) // block_size
    return {"input_ids": [stream[k * block_size:(k + 1) * block_size] for k in range(n)],
            "doc_id": [owner[k * block_size] for k in range(n)]}


def load_text_task(cfg: TaskCfg, tokenizer, block_size: int, seed: int = 0) -> TextData:
    """Read, split (by document), tokenise and chunk a corpus.

    ``max_train_examples``/``max_dev_examples`` cap the number of *examples* (blocks or
    documents) after chunking, taking a seeded random subset; N is then that number.

    Raises:
        DataError: no ``train_file``, unreadable file, or too little text for one block.
    """
    if not cfg.train_file:
        raise DataError("task 'text' needs --train-file (a .txt file with one text per line, "
                        "or a CSV/TSV/JSONL/Parquet file with --text-column)")
    notes: list[str] = []
    train_users = None
    if cfg.user_column:  # user level: each document keeps its user (the privacy unit)
        train_texts, train_users = read_texts_users(cfg.train_file, cfg.text_column, cfg.user_column)
    else:
        train_texts = read_texts(cfg.train_file, cfg.text_column)
    if cfg.dev_file:
        dev_texts = read_texts(cfg.dev_file, cfg.text_column)
    else:
        if len(train_texts) < 2:
            raise DataError(f"{cfg.train_file}: too few texts to hold out a dev split; give --dev-file")
        cols = {"t": train_texts, **({"u": train_users} if train_users is not None else {})}
        split = datasets.Dataset.from_dict(cols).train_test_split(test_size=cfg.dev_fraction, seed=seed)
        train_texts, dev_texts = split["train"]["t"], split["test"]["t"]
        if train_users is not None:
            train_users = split["train"]["u"]
        notes.append(f"dev = {cfg.dev_fraction:.0%} of the documents of {cfg.train_file} held out (seed {seed})")
    max_chars = block_size * CHARS_PER_TOKEN if cfg.unit == "document" else None
    tr_docs, dv_docs = _encode(train_texts, tokenizer, max_chars), _encode(dev_texts, tokenizer, max_chars)
    truncated = None
    if cfg.unit == "document":
        n_cut = lambda texts, docs: sum(len(t) > max_chars or len(d) > block_size  # noqa: E731
                                        for t, d in zip(texts, docs))
        truncated = {"max_length": block_size, "train": n_cut(train_texts, tr_docs), "dev": n_cut(dev_texts, dv_docs)}
        if truncated["dev"]:
            notes.append(f"truncated to {block_size} tokens: {truncated['dev']} of {len(dev_texts)} dev documents "
                         "(raise model.max_length to keep more text; the count for the private training set "
                         "is not released)")
    tr = (chunk_blocks(tr_docs, block_size, cfg.unit) if train_users is None
          else chunk_blocks_by_user(tr_docs, train_users, block_size, cfg.unit))
    dv = chunk_blocks(dv_docs, block_size, cfg.unit)
    if not tr["input_ids"]:
        raise DataError(f"{cfg.train_file}: fewer than {block_size} tokens in all; lower model.max_length")
    if not dv["input_ids"]:
        raise DataError("the dev split has fewer tokens than one block; give a larger --dev-file or dev_fraction")
    train = datasets.Dataset.from_dict(tr)
    dev = datasets.Dataset.from_dict(dv)
    if cfg.user_column:
        notes.append(f"privacy unit: one user (column {cfg.user_column!r}); a user's documents are chunked on "
                     f"their own ({cfg.unit} mode), so no example holds two users' tokens")
    elif cfg.unit == "block":
        notes.append(f"privacy unit: one block of {block_size} tokens (documents concatenated with BOS/EOS "
                     f"and cut; a document spanning k blocks is protected at group size k)")
    else:
        notes.append(f"privacy unit: one document (row), truncated to {block_size} tokens, never packed "
                     "with another document")
    if cfg.max_train_examples and cfg.max_train_examples < len(train):
        train = train.shuffle(seed=seed).select(range(cfg.max_train_examples))
        notes.append(f"training set: a seeded random subset of {cfg.max_train_examples} examples "
                     f"(N = {cfg.max_train_examples})")
    if cfg.max_dev_examples and cfg.max_dev_examples < len(dev):
        dev = dev.shuffle(seed=seed).select(range(cfg.max_dev_examples))
        notes.append(f"dev set: a seeded random subset of {cfg.max_dev_examples} examples")
    return TextData("text", train, dev, f"text corpus: {cfg.train_file}", cfg.unit, block_size, notes,
                    truncated=truncated)
