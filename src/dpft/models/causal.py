"""Causal language models (any ``AutoModelForCausalLM``: GPT-2, Llama, Qwen2 shapes)."""

from __future__ import annotations

import torch

from dpft.models.load import ModelError, model_load_message, resolve_model_path


def _named_tokenizer(tok, path: str):
    """The tokenizer class that ``tokenizer_config.json`` names, if AutoTokenizer chose another.

    transformers 5 resolves the class from the model's ``model_type`` first: a Qwen2 model
    saved with a Llama (sentencepiece) tokenizer got a byte-level ``Qwen2Tokenizer`` reading
    the same vocabulary, which segments text differently and decodes without spaces.
    """
    import json
    from pathlib import Path

    import transformers

    cfg = Path(path) / "tokenizer_config.json"
    if not cfg.is_file():
        return tok
    named = json.loads(cfg.read_text()).get("tokenizer_class")
    if named and type(tok).__name__ not in (named, named + "Fast") and hasattr(transformers, named):
        return getattr(transformers, named).from_pretrained(path)
    return tok


def load_causal_lm(name: str, seed: int = 0):
    """Tokenizer and ``AutoModelForCausalLM`` from a folder or hub id; the tokenizer gets a pad
    token (EOS, or id 0) if it has none (padding positions never count in the loss).

    Raises:
        ModelError: not loadable as a causal LM (the message says what to give instead).
    """
    from transformers import AutoModelForCausalLM

    return _load_lm(AutoModelForCausalLM, name, seed, "a causal language model",
                    "the text task needs a decoder (GPT-2, Llama, Qwen2 …) folder with config.json and weights")


def load_seq2seq_lm(name: str, seed: int = 0):
    """Tokenizer and ``AutoModelForSeq2SeqLM`` (T5, BART, …) from a folder or hub id, for the
    ``seq2seq`` task; the tokenizer gets a pad token (EOS, or id 0) if it has none.

    Raises:
        ModelError: not loadable as an encoder-decoder LM (the message says what to give instead).
    """
    from transformers import AutoModelForSeq2SeqLM

    return _load_lm(AutoModelForSeq2SeqLM, name, seed, "a sequence-to-sequence model",
                    "the seq2seq task needs an encoder-decoder (T5, BART …) folder with config.json and weights")


def _load_lm(auto_cls, name: str, seed: int, what: str, need: str):
    """``(tokenizer, auto_cls.from_pretrained(name))``; the tokenizer gets a pad token (EOS, or
    id 0) if it has none, and the model's config that pad id. Raises ModelError naming ``need``."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    torch.manual_seed(seed)
    try:
        tok = _named_tokenizer(AutoTokenizer.from_pretrained(path), path)
        model = auto_cls.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(model_load_message(name, exc, what, need)) from None
    pad_for_loss(tok, model)
    return tok, model


def pad_for_loss(tok, model) -> None:
    """Give ``tok`` and ``model.config`` a pad id where they have none (EOS, else 0): padding
    positions never count in the loss (masked by the attention mask), so any id serves."""
    if tok.pad_token_id is None:
        if tok.eos_token_id is not None:
            tok.pad_token = tok.eos_token
        else:
            tok.pad_token_id = 0
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id

