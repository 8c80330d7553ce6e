"""The registered tasks' public schema: names, columns, files, hub names and label names (no loading).

Kept on the config floor, apart from data/tasks.py's loaders, so that a recipe's validator and the scope rule
read which tasks are sentence pairs from this one table instead of a list of names that mirrors it
(issue 45); data/tasks.py loads the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["TaskSpec", "REGISTRY", "is_pair_task"]


@dataclass
class TaskSpec:
    """A registered task: local files (relative to DPFT_DATA_DIR) and its hub equivalent."""

    name: str
    text: str
    pair: Optional[str]
    label: str
    train_file: Optional[str]
    dev_file: Optional[str]
    hub: tuple[str, ...]
    hub_dev_split: str
    label_names: Optional[list[str]] = None
    note: Optional[str] = None


REGISTRY: dict[str, TaskSpec] = {
    "sst2": TaskSpec("sst2", "sentence", None, "label", "sst2/train.tsv", "sst2/dev.tsv",
                     ("glue", "sst2"), "validation", ["negative", "positive"]),
    "sst5": TaskSpec("sst5", "sentence", None, "label", "sst5/train.tsv", "sst5/dev.tsv",
                     ("SetFit/sst5",), "validation",
                     ["very negative", "negative", "neutral", "positive", "very positive"]),
    "imdb": TaskSpec("imdb", "text", None, "label", "imdb/train.jsonl.gz", "imdb/test.jsonl.gz",
                     ("imdb",), "test", ["negative", "positive"],
                     note="IMDB has no dev split; its test split is used as dev"),
    "qnli": TaskSpec("qnli", "question", "sentence", "label", None, "qnli/dev.tsv",
                     ("glue", "qnli"), "validation", ["entailment", "not_entailment"],
                     note="offline QNLI has no train split: GLUE dev is split 4,000 train / 1,463 eval"),
}


def is_pair_task(name: str, text_pair_column: Optional[str] = None) -> bool:
    """Rows of two texts: a file task with a text-pair column, or a registered task with a pair column."""
    spec = REGISTRY.get(name)
    return bool(text_pair_column) or (spec is not None and spec.pair is not None)
