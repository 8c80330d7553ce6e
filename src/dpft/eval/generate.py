"""Decoding the dev prompts of an ``instruct`` run (or the dev sources of a ``seq2seq`` run: an
encoder-decoder's decoder output) and scoring them (eval/metrics.py).

Greedy decoding by default, beam search with ``eval.num_beams`` > 1 (Hugging Face
``generate``; deterministic, so no randomness is drawn). Prompts are batched with left
padding; a generation ends at the tokenizer's EOS or after ``eval.max_new_tokens`` tokens.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from dpft.data.stop import identical_generations
from dpft.eval.metrics import score_generations


@torch.no_grad()
def generate_ids(model, prompts: Sequence[Sequence[int]], pad_id: int, eos_id: Optional[int | Sequence[int]],
                 max_new_tokens: int = 64, num_beams: int = 1, batch_size: int = 32) -> list[list[int]]:
    """New tokens of each prompt (EOS and what follows removed).

    Args:
        prompts: token ids per prompt (at least one token each).
        eos_id: the id (or ids: EOS and a chat template's end of turn) a generation ends at.

    Returns:
        One list of generated token ids per prompt, in order.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[int]] = []
    if getattr(model.config, "is_encoder_decoder", False):  # seq2seq task: data/seq2seq.py
        out = _generate_encoder_decoder(model, prompts, pad_id, eos_id, max_new_tokens, num_beams, batch_size, device)
        model.train(was_training)
        return out
    for k in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[k:k + batch_size]]
        t = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), t), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), t), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[i, t - len(p):] = torch.tensor(p)
            mask[i, t - len(p):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             num_beams=num_beams, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=eos_id, top_k=None, top_p=None, temperature=None)
        stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
        for row in gen[:, t:].tolist():
            ends = [j for j, x in enumerate(row) if x in stops]
            out.append(row[:ends[0]] if ends else row)
    model.train(was_training)
    return out


def _generate_encoder_decoder(model, prompts, pad_id, eos_id, max_new_tokens, num_beams, batch_size, device):
    """Decoder tokens of an encoder-decoder LM per source (right-padded sources: positions start
    at 0 for every example, as in training); the decoder start token, EOS and what follows
    removed."""
    out: list[list[int]] = []
    for k in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[k:k + batch_size]]
        t = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), t), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), t), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             num_beams=num_beams, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=eos_id, top_k=None, top_p=None, temperature=None)
        for row in gen[:, 1:].tolist():  # gen[:, 0] is decoder_start_token_id
            stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
            ends = [j for j, x in enumerate(row) if x in stops]
            out.append(row[:ends[0]] if ends else row)
    return out


def generation_eval(model, tokenizer, groups: Sequence[dict], max_new_tokens: int = 64, num_beams: int = 1,
                    batch_size: int = 32, max_prompts: Optional[int] = None, num_samples: int = 3,
                    stop_ids: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """Decode each group's prompt and score it against all its references.

    Args:
        groups: ``[{"prompt_ids", "prompt", "references"}]`` (data/instruct.py
            ``group_references``); the first ``max_prompts`` are used.
        stop_ids: besides the tokenizer's EOS, ids a generation ends at (the end-of-turn token the
            completions were trained to end with; ``InstructData.stop_ids``).

    Returns:
        ``{"metrics": {"dev_bleu", "dev_rouge_l", "dev_exact_match", "dev_generated",
        "dev_distinct_generations"}, "samples": [{"prompt", "generation", "references"}] (the first
        ``num_samples``), "settings": {...}, "warning"?}``; ``warning`` when every generation is
        the same text (data/stop.py ``identical_generations``).
    """
    groups = list(groups)[:max_prompts] if max_prompts else list(groups)
    if not groups:
        raise ValueError("no dev prompts to generate from")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stops = ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    stops += [int(i) for i in (stop_ids or []) if i not in stops]
    new = generate_ids(model, [g["prompt_ids"] for g in groups], pad, stops or None,
                       max_new_tokens, num_beams, batch_size)
    hyps = [tokenizer.decode(x, skip_special_tokens=True).strip() for x in new]
    refs = [g["references"] for g in groups]
    metrics = {**score_generations(hyps, refs), "dev_generated": len(hyps),
               "dev_distinct_generations": len(set(h.strip() for h in hyps))}
    samples = [{"prompt": g["prompt"], "generation": h, "references": g["references"][:3]}
               for g, h in zip(groups[:num_samples], hyps)]
    out = {"metrics": metrics, "samples": samples,
           "settings": {"decoding": "greedy" if num_beams == 1 else f"beam search ({num_beams} beams)",
                        "max_new_tokens": max_new_tokens, "prompts": len(groups),
                        "references": sum(len(r) for r in refs)}}
    warning = identical_generations(hyps)
    if warning:
        out["warning"] = warning
    return out
