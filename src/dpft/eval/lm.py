"""Causal-LM evaluation: held-out next-token loss (nats per token), perplexity, samples."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from dpft.data.tokenize import collate
from dpft.models.losses import model_inputs, seq2seq_lm_loss


@torch.no_grad()
def lm_eval(model, rows: Sequence[dict], pad_id: int, batch_size: int = 64) -> dict[str, float]:
    """Mean next-token cross-entropy over every predicted token of ``rows`` and its exp.

    Args:
        rows: dicts with ``input_ids`` (list of int) and optionally ``labels`` (same length,
            -100 = not scored: the instruct task scores completion tokens only); padding is
            masked out.

    Returns:
        ``{"dev_loss": nats/token, "dev_perplexity": exp(dev_loss), "dev_tokens": count}``.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device  # perf.device: batches go where the model is
    for k in range(0, len(rows), batch_size):
        batch = collate(list(rows[k:k + batch_size]), pad_id, with_token_types=False, device=device)
        logits = model(**model_inputs(batch)).logits.float()
        if "labels" in batch:  # instruct task: completion tokens only (-100 elsewhere)
            targets = batch["labels"][:, 1:]
            mask = ((targets != -100) & batch["attention_mask"][:, 1:].bool()).float()
            targets = targets.clamp(min=0)
        else:
            targets = batch["input_ids"][:, 1:]
            mask = batch["attention_mask"][:, 1:].float()
        tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
        total += float((tok * mask).sum())
        count += int(mask.sum())
    model.train(was_training)
    loss = total / max(count, 1)
    return {"dev_loss": loss, "dev_perplexity": math.exp(min(loss, 50.0)), "dev_tokens": count}


@torch.no_grad()
def seq2seq_eval(model, rows: Sequence[dict], pad_id: int, batch_size: int = 64) -> dict[str, float]:
    """Mean target-token cross-entropy of an encoder-decoder LM over ``rows`` (``input_ids``,
    ``target_ids``; data/seq2seq.py) and its exp.

    Returns:
        ``{"dev_loss": nats/target token, "dev_perplexity", "dev_tokens"}``.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for k in range(0, len(rows), batch_size):
        batch = collate(list(rows[k:k + batch_size]), pad_id, device=device)
        total += float(seq2seq_lm_loss(model, batch).sum())
        count += int((batch["labels"] != -100).sum())
    model.train(was_training)
    loss = total / max(count, 1)
    return {"dev_loss": loss, "dev_perplexity": math.exp(min(loss, 50.0)), "dev_tokens": count}


@torch.no_grad()
def sample_generations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 40, seed: int = 0,
                       temperature: float = 0.8, top_k: int = 40) -> list[dict[str, str]]:
    """Sampled continuations (temperature/top-k, seeded) of each prompt, as the paper's App. E.

    Returns ``[{"prompt": p, "completion": text}, ...]``.
    """
    was_training = model.training
    model.eval()
    out = []
    for i, p in enumerate(prompts):
        torch.manual_seed(seed + i)
        enc = tokenizer(p, return_tensors="pt").to(next(model.parameters()).device)
        gen = model.generate(**enc, do_sample=True, temperature=temperature, top_k=top_k,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        # an encoder-decoder's output is the decoder's tokens alone (no prompt to cut)
        new = gen[0] if getattr(model.config, "is_encoder_decoder", False) else gen[0, enc["input_ids"].shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        out.append({"prompt": p, "completion": text})
    model.train(was_training)
    return out
