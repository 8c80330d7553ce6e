"""Tokenisation and collation into model batches.

Examples are tokenised once (no padding); each physical micro-batch is padded to its own
longest example. Batches carry explicit ``position_ids`` and ``token_type_ids`` of shape
``(B, T)``: Hugging Face models otherwise broadcast a ``(1, T)`` buffer, whose batch dimension
of 1 would make hook-based per-example gradients of position embeddings wrong.
"""

from __future__ import annotations

from typing import Sequence

import datasets
import torch


def tokenize_split(ds: datasets.Dataset, tokenizer, max_length: int) -> datasets.Dataset:
    """Add ``input_ids`` (and ``token_type_ids`` when the tokenizer has them), truncated."""

    def fn(batch):
        pair = batch.get("text_pair")
        enc = tokenizer(batch["text"], pair, truncation=True, max_length=max_length)
        out = {"input_ids": enc["input_ids"]}
        if "token_type_ids" in enc:
            out["token_type_ids"] = enc["token_type_ids"]
        return out

    texts = ds["text"]
    if any(t is None for t in texts):
        raise ValueError("some rows have an empty text; drop them or fill the text column")
    return ds.map(fn, batched=True, desc="tokenising", load_from_cache_file=False)


def collate(rows: Sequence[dict], pad_id: int, with_token_types: bool = True) -> dict[str, torch.Tensor]:
    """Pad a list of tokenised rows into a batch dict of ``(B, T)`` tensors plus ``labels (B,)``."""
    b = len(rows)
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
    return out
