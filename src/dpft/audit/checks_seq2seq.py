"""Audit checks of the ``seq2seq`` task's step (issue 27 item 4): encoder-decoder batches
(data/tokenize.py ``collate_seq2seq``) through the book-keeping engine with the target-only loss
(models/losses.py ``seq2seq_lm_loss``).

For a tiny T5 with LoRA and a tiny BART in full fine-tuning (random, in-process) and four
source/target rows of different lengths (padding in both encoder and decoder; the micro-batch's
size equal to one target length, so a shared position tensor looks per example), the clipped sum
``S(D)`` of one step (σ = 0, q = 1) is compared with ``S(D∖i)`` for every row i (add/remove-one,
Abadi et al. 2016, Alg. 1): ``max_i ‖S(D) − S(D∖i)‖ ≤ C(1 + tol)``. A collation or loss that lets
one row's targets reach another row's gradient, or a per-example rule that mixes rows, breaks it.

``planted`` re-opens one hole for the auditor's self-test: ``"seq2seq_targets_across_rows"``
(``collate_seq2seq`` pairs each source with the next row's target).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Optional

import torch

from dpft.audit.whitebox import Check

PLANTED = ("seq2seq_targets_across_rows",)
TOL = 1e-3
C = 0.05
V = 40
#: The checks' rows once they passed without a planted bug in this process: the tiny models and
#: rows are fixed, so a later audit in the same process reuses them (``stats["cached"]``); a
#: failing run, or one with a planted bug, is never reused.
_PASSED: Optional[list[Check]] = None


@contextlib.contextmanager
def planted_bug(name: Optional[str]) -> Iterator[None]:
    """Plant ``name`` for the duration (``None``: nothing).

    Raises:
        ValueError: an unknown name."""
    from dpft.audit.planted import planting
    from dpft.data import tokenize

    with planting(name, PLANTED) as p:
        if name == "seq2seq_targets_across_rows":
            orig = tokenize.collate_seq2seq

            def rolled(rows, pad_id, device=None):
                out = orig(rows, pad_id, device)
                out["labels"] = out["labels"].roll(1, dims=0)  # row i learns row i-1's target
                return out

            p.set(tokenize, "collate_seq2seq", rolled)
        yield


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    lengths = [(7, 3), (4, 2), (9, 1), (3, 3)]  # (source, target) + EOS: 4 rows, decoder length 4
    return [{"input_ids": torch.randint(3, V, (s,), generator=g).tolist() + [1],
             "target_ids": torch.randint(3, V, (t,), generator=g).tolist() + [1]} for s, t in lengths]


def _models():
    import transformers as tf

    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    import peft

    t5 = peft.get_peft_model(t5, peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=2, lora_alpha=4, init_lora_weights=False,
                                                 target_modules=["q", "v", "wi", "wo"]))
    torch.manual_seed(0)
    bart = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=1))
    return [("T5 + LoRA", t5.eval()), ("BART full", bart.eval())]


def _clipped_sum(model, rows) -> torch.Tensor:
    import warnings

    from dpft.data import tokenize
    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.models.losses import seq2seq_lm_loss
    from dpft.step.clip import make_clip_policy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BART's embeddings take the exact torch.func fallback
        out = BookKeepingEngine(model, seq2seq_lm_loss, make_clip_policy("flat", C)).clipped_sum(
            tokenize.collate(rows, 0))
    return torch.cat([g.reshape(-1) for _, g in sorted(out.grad_sum.items())])


def seq2seq_checks(planted: Optional[str] = None) -> list[Check]:
    """Leave-one-out of the seq2seq step on T5 + LoRA and BART (full); ``planted`` one of
    :data:`PLANTED`.

    Returns:
        Two :class:`Check` rows; with ``planted`` at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    global _PASSED
    if planted is None and _PASSED is not None:
        return [dataclasses.replace(c, stats={**c.stats, "cached": True}) for c in _PASSED]
    out = []
    with planted_bug(planted):
        rows = _rows()
        for name, model in _models():
            t0 = time.perf_counter()
            full = _clipped_sum(model, rows)
            worst = max(float((full - _clipped_sum(model, rows[:i] + rows[i + 1:])).norm()) for i in range(len(rows)))
            ok = worst <= C * (1 + TOL)
            out.append(Check(f"seq2seq: {name} leave-one-out", ok,
                             f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {len(rows)}, q = 1, σ = 0, "
                             "target-only loss)" + ("" if ok else " — one row moved the sum by more than C"),
                             {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)}))
    if planted is None and all(c.passed for c in out):
        _PASSED = out
    return out
