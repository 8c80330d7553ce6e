"""The model split behind cached features (models/features.py): suffix(prefix(x)) is the model's
own output and the book-keeping engine's clipped sums agree on cached and token inputs (tiny
random BERT, mean pooling, built in-process; seconds)."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import random_batch
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.models.features import frozen_prefix
from dpft.models.load import select_trainable
from dpft.models.losses import classification_loss
from dpft.models.standard import MeanPoolClassifier
from dpft.config.recipe import TrainableCfg
from dpft.step.clip import make_clip_policy


def _model(mode: str, **kw):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    m = MeanPoolClassifier(transformers.BertModel(cfg, add_pooling_layer=False), num_labels=3, dropout=0.0)
    return select_trainable(m, TrainableCfg(mode=mode, **kw)).eval()


@pytest.mark.parametrize("mode,kw,kind,start", [("head", {}, "pooled", 3), ("last_k", {"last_k": 1}, "hidden", 2),
                                               ("last_k", {"last_k": 2}, "hidden", 1),
                                               ("units", {"units": ["block.2"]}, "hidden", 2)])
def test_suffix_of_prefix_is_the_model(mode, kw, kind, start):
    from dpft.run.features import FeatureCache

    m = _model(mode, **kw)
    split, why = frozen_prefix(m)
    assert split is not None, why
    assert (split.kind, split.start) == (kind, start)
    b = random_batch(b=5, t=9, num_labels=3)
    full = m(**{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    feats = split.prefix(b)
    part = split.suffix_forward(feats, b["attention_mask"] if kind == "hidden" else None,
                                b["position_ids"] if kind == "hidden" else None).logits
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)
    # The engine on cached inputs: the same per-example norms and clipped sums, same parameter names.
    clip = make_clip_policy("flat", 0.5)
    tok = BookKeepingEngine(m, classification_loss, clip).clipped_sum(b)
    cache = FeatureCache(split, store=None)  # only the loss is used here
    fb = {"features": feats, "labels": b["labels"]}
    if kind == "hidden":
        fb.update(attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    cached = BookKeepingEngine(m, cache.loss(classification_loss), clip).clipped_sum(fb)
    assert set(tok.grad_sum) == set(cached.grad_sum)
    torch.testing.assert_close(cached.sq_norms, tok.sq_norms, rtol=1e-4, atol=1e-7)
    for n in tok.grad_sum:
        torch.testing.assert_close(cached.grad_sum[n], tok.grad_sum[n], rtol=1e-4, atol=1e-6, msg=n)


def test_no_prefix_when_the_bottom_trains():
    for mode, kw in (("full", {}), ("bias", {}), ("units", {"units": ["block.0"]})):
        split, why = frozen_prefix(_model(mode, **kw))
        assert split is None and why


def test_auto_skips_a_sequence_cache_at_about_one_pass():
    """The demo (1.1 passes over 67k rows) computes no 6.6 GB of block states under ``auto``; the probe
    (pooled rows) and LP-FT's 3 epochs do cache."""
    from pathlib import Path

    from dpft.config import load_recipe
    from dpft.run.features import few_passes

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    assert "1.1 expected passes" in few_passes(load_recipe(recipes / "sst2-minilm.yaml"), 67349)
    assert few_passes(load_recipe(recipes / "lpft-minilm.yaml"), 5000) is None
    assert few_passes(load_recipe(recipes / "probe-minilm.yaml"), 5000) is None
