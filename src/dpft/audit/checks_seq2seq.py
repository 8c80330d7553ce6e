"""Audit checks of the ``seq2seq`` task's step (issue 27 item 4): encoder-decoder batches
(data/tokenize.py ``collate_seq2seq``) through the book-keeping engine with the target-only loss
(models/losses.py ``seq2seq_lm_loss``).

For a tiny T5 with LoRA and a tiny BART in full fine-tuning (random, in-process) and four
source/target rows of different lengths (padding in both encoder and decoder; the micro-batch's
size equal to one target length, so a shared position tensor looks per example), the clipped sum
``S(D)`` of one step (σ = 0, q = 1) is compared with ``S(D∖i)`` for every row i (add/remove-one,
Abadi et al. 2016, Alg. 1): ``max_i ‖S(D) − S(D∖i)‖ ≤ C(1 + tol)``. A collation or loss that lets
one row's targets reach another row's gradient, or a per-example rule that mixes rows, breaks it.

Shared relative-position tables (issue 36 item 10; grads/relbias.py): the same leave-one-out on
T5 in full fine-tuning (its relative-attention bias trained) and on a DeBERTa-v2 classifier with
relative attention with its shared table trained (``rel_embeddings`` and their LayerNorm; C half
the median per-example norm by the torch.func reference).

``planted`` re-opens one hole for the auditor's self-test: ``"seq2seq_targets_across_rows"``
(``collate_seq2seq`` pairs each source with the next row's target), or
``"relative_table_batch_summed"`` (the rules give every example the gradient of the shared table
summed over the batch, what a hook on the table's output sees).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Iterator, Optional

import torch

from dpft.audit.whitebox import Check
from dpft.audit.planted import planting
from dpft.grads import relbias
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine
from dpft.models.losses import seq2seq_lm_loss
from dpft.step.clip import make_clip_policy
from dpft.data import tokenize
from dpft.data.tokenize import collate

PLANTED = ("seq2seq_targets_across_rows", "relative_table_batch_summed")
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

    with planting(name, PLANTED) as p:
        if name == "seq2seq_targets_across_rows":
            orig = tokenize.collate_seq2seq

            def rolled(rows, pad_id, device=None):
                out = orig(rows, pad_id, device)
                out["labels"] = out["labels"].roll(1, dims=0)  # row i learns row i-1's target
                return out

            p.set(tokenize, "collate_seq2seq", rolled)
        if name == "relative_table_batch_summed":
            for cls in (relbias.T5RelativeBiasKind, relbias.DebertaV2TableKind):
                p.set(cls, "contributions", _batch_summed(cls.contributions))
        yield


def _batch_summed(contributions):
    """A planted rule: every example's share of the table's gradient replaced by the batch's sum."""

    def planted(self, module, state, grads, roles):
        g = grads[0]
        if g is not None:
            grads = [g.sum(0, keepdim=True).expand_as(g).contiguous()] + list(grads[1:])
        return contributions(self, module, state, grads, roles)

    return planted


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
    torch.manual_seed(0)
    t5_full = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    return [("T5 + LoRA", t5.eval()), ("BART full", bart.eval()), ("T5 full (relative bias)", t5_full.eval())]


def _deberta_rows() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, V, (n,), generator=g).tolist(), "label": k % 3}
            for k, n in enumerate((6, 3, 8, 5))]


def _deberta():
    """DeBERTa-v2 with relative attention; only the shared table is trained (``rel_embeddings``
    and its LayerNorm: their gradients are ~1e-6 of the projections', so with the whole model
    trained a wrong table rule would hide under C)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=3, relative_attention=True, position_buckets=8,
        pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
        pad_token_id=0)).eval()
    for n, p in model.named_parameters():
        p.requires_grad_("rel_embeddings" in n or "encoder.LayerNorm" in n)
    return model


def _deberta_batch(rows) -> dict:

    batch = collate([{"input_ids": r["input_ids"]} for r in rows], 0)
    batch["labels"] = torch.tensor([r["label"] for r in rows])
    return batch


def _deberta_loss(fwd, b):
    logits = fwd(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits, b["labels"], reduction="none")


def _deberta_clip(model, rows) -> float:
    """Half the median per-example norm by the torch.func reference (independent of the rules)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ReferenceEngine(model, _deberta_loss, make_clip_policy("flat", 1e9)).clipped_sum(_deberta_batch(rows))
    return 0.5 * float(out.norms.median())


def _deberta_clipped_sum(model, rows, c: float) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = BookKeepingEngine(model, _deberta_loss, make_clip_policy("flat", c)).clipped_sum(_deberta_batch(rows))
    return torch.cat([g.reshape(-1) for _, g in sorted(out.grad_sum.items())])


def _clipped_sum(model, rows) -> torch.Tensor:
    import warnings


    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BART's embeddings take the exact torch.func fallback
        out = BookKeepingEngine(model, seq2seq_lm_loss, make_clip_policy("flat", C)).clipped_sum(
            tokenize.collate(rows, 0))
    return torch.cat([g.reshape(-1) for _, g in sorted(out.grad_sum.items())])


def seq2seq_checks(planted: Optional[str] = None) -> list[Check]:
    """Leave-one-out of the seq2seq step on T5 + LoRA, BART (full) and T5 (full: its relative
    bias), and of a DeBERTa-v2 classifier with relative attention (its table trained); ``planted`` one of
    :data:`PLANTED`.

    Returns:
        Four :class:`Check` rows; with ``planted`` at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    global _PASSED
    if planted is None and _PASSED is not None:
        return [dataclasses.replace(c, stats={**c.stats, "cached": True}) for c in _PASSED]
    out = []
    with planted_bug(planted):
        rows = _rows()
        cases = [(f"seq2seq: {name}", model, rows, _clipped_sum, C, "target-only loss") for name, model in _models()]
        deberta, drows = _deberta(), _deberta_rows()
        dc = _deberta_clip(deberta, drows)
        cases.append(("relative attention: DeBERTa-v2 (rel_embeddings and LayerNorm trained)", deberta, drows,
                      lambda m, r: _deberta_clipped_sum(m, r, dc), dc, "classification"))
        for name, model, rs, clipped_sum, c, loss in cases:
            t0 = time.perf_counter()
            full = clipped_sum(model, rs)
            worst = max(float((full - clipped_sum(model, rs[:i] + rs[i + 1:])).norm()) for i in range(len(rs)))
            ok = worst <= c * (1 + TOL)
            out.append(Check(f"{name} leave-one-out", ok,
                             f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {c:.4g} (N = {len(rs)}, q = 1, σ = 0, "
                             f"{loss})" + ("" if ok else " — one row moved the sum by more than C"),
                             {"loo_over_C": worst / c, "seconds": round(time.perf_counter() - t0, 2)}))
    if planted is None and all(c.passed for c in out):
        _PASSED = out
    return out
