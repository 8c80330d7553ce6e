"""A run's training data as a plan part (run/plan.py): rows loaded, tokenised once, with what
the step needs to collate them.

Classification rows are loaded before the model (their label set sizes the head, and δ < 1/N is
checked before tens of seconds of model loading); causal-LM rows after it (their loaders need
the tokenizer).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from dpft.accounting.calibrate import check_delta
from dpft.data.tokenize import tokenize_task

__all__ = ["TrainData", "is_causal", "load_rows", "build_train_data"]


@dataclass(frozen=True)
class TrainData:
    """Tokenised training and dev rows of one run.

    Attributes:
        task: the loader's ``TaskData`` (labels, notes, truncation counts, generation groups).
        train_tok, dev_tok: tokenised ``datasets.Dataset`` s (``input_ids`` without padding).
        causal: ``text``/``instruct`` task (causal-LM loss) rather than classification.
        pad_id: the tokenizer's pad id (0 without one).
        with_token_types: collate ``token_type_ids`` (BERT-style classifiers).
        train_lengths: ``(N_rows,)`` int64 token counts, to order a logical batch by length.
    """

    task: Any
    train_tok: Any
    dev_tok: Any
    causal: bool
    pad_id: int
    with_token_types: bool
    train_lengths: torch.Tensor
    #: ``seq2seq`` task (encoder-decoder, data/seq2seq.py); ``causal`` is then True too (a
    #: generative LM: no label set, dev loss per token, generation metrics).
    seq2seq: bool = False


def is_causal(recipe) -> bool:
    """``text`` (blocks of a corpus) and ``instruct`` (prompt/completion rows) train a causal LM;
    ``seq2seq`` (source/target rows) an encoder-decoder LM, loaded the same way (after the model)."""
    return recipe.task.name in ("text", "instruct", "seq2seq")


def load_rows(recipe, private: bool):
    """Classification: the task's rows (``data/tasks.py`` ``load_task``), with δ < 1/N checked at
    once for a private run (N units ≤ rows, so the check is necessary at user level too).
    Causal tasks: None (their loaders need the tokenizer; see :func:`build_train_data`).

    Raises:
        DataError, CalibrationError: bad rows; δ ≥ 1/N."""
    if is_causal(recipe):
        return None
    from dpft.data.tasks import load_task

    task = load_task(recipe.task, seed=recipe.seed)
    if private:
        check_delta(recipe.privacy.delta, len(task.train))
    return task


def _say_truncated(n: int, what: str, max_length: int, progress: bool) -> None:
    if n and progress:
        print(f"{n} training {what} were truncated to model.max_length = {max_length} tokens (private statistic: "
              "shown here only, not written to the run directory)", file=sys.stderr)


def build_train_data(recipe, task, tokenizer, hide_counts: bool, progress: bool) -> TrainData:
    """Tokenise the run's rows once.

    Args:
        task: :func:`load_rows`' result (classification) or None (causal tasks load here).
        hide_counts: the training truncation count is private (a private run, or any method):
            shown on the terminal only, never written.
    """
    r = recipe
    causal = is_causal(r)
    if causal:
        from dpft.data.instruct import load_instruct_task
        from dpft.data.text import load_text_task

        if r.task.name == "seq2seq":
            from dpft.data.seq2seq import load_seq2seq_task

            task = load_seq2seq_task(r.task, tokenizer, r.model.max_length, seed=r.seed, private=hide_counts)
            if hide_counts:
                _say_truncated(task.truncated["train"], "rows", r.model.max_length, progress)
        elif r.task.name == "instruct":
            task = load_instruct_task(r.task, tokenizer, r.model.max_length, seed=r.seed, private=hide_counts)
            if hide_counts:
                _say_truncated(task.truncated["train"], "rows", r.model.max_length, progress)
        else:
            task = load_text_task(r.task, tokenizer, r.model.max_length, seed=r.seed)
        train_tok, dev_tok = task.train, task.dev
    else:
        # Dev truncation count goes in the report's notes; the training count is private.
        train_tok, dev_tok = tokenize_task(task, tokenizer, r.model.max_length, private=hide_counts)
        if hide_counts:
            _say_truncated(getattr(task, "truncated", {}).get("train", 0), "examples", r.model.max_length, progress)
    return TrainData(task=task, train_tok=train_tok, dev_tok=dev_tok, causal=causal,
                     pad_id=tokenizer.pad_token_id or 0,
                     with_token_types="token_type_ids" in tokenizer.model_input_names and not causal,
                     train_lengths=torch.tensor([len(x) for x in train_tok["input_ids"]]),
                     seq2seq=r.task.name == "seq2seq")


def num_labels(task: Optional[Any]) -> Optional[int]:
    """The head size a classification task needs (None for causal tasks)."""
    return None if task is None else task.num_labels
