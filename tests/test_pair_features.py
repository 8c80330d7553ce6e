"""Siamese sentence-pair features (issue 45; models/hf_mean_pool.py): the joint pair encoding split back
into its two sentences equals encoding each alone, the head reads ``[u, v, |u − v|, √H · u ⊙ v]``, the saved
model loads with the same outputs, and a trainable encoder is refused (tiny random BERT, built in-process)."""

from __future__ import annotations

import pytest
import torch
import transformers

from dpft.config.recipe import TrainableCfg, load_recipe
from dpft.models.features import frozen_prefix
from dpft.models.hf_mean_pool import masked_mean, split_pair, siamese_features
from dpft.models.load import select_trainable
from dpft.models.standard import DpftMeanPoolForSequenceClassification, MeanPoolClassifier
from dpft.run.scope import resolve_scope

CLS, SEP, PAD = 2, 3, 0


def _encoder():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, pad_token_id=PAD)
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def _rows(pairs, sep_twice=False):
    """Joint encodings ``[CLS] a [SEP] b [SEP]`` (``[SEP][SEP]`` between with ``sep_twice``), right-padded."""
    rows = [[CLS, *a, SEP, *([SEP] if sep_twice else []), *b, SEP] for a, b in pairs]
    t = max(map(len, rows)) + 2
    ids = torch.tensor([r + [PAD] * (t - len(r)) for r in rows])
    return ids, (ids != PAD).long()


def _alone(enc, toks):
    ids = torch.tensor([[CLS, *toks, SEP]])
    return masked_mean(enc(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state, None)[0]


PAIRS = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14]), ([15, 16], [17])]


def test_the_product_block_is_scaled_to_the_others():
    """``[u, v, |u − v|, √H · u ⊙ v]`` of the normalised embeddings: unscaled, the product block's norm is
    about 1/√H (a DP head, one clip and noise scale for all coordinates, barely learns from it); scaled, about 1."""
    torch.manual_seed(0)
    h = 384
    u, v = torch.randn(64, h), torch.randn(64, h) + 2 * torch.randn(1, h)  # correlated, as paired sentences are
    f = siamese_features(u, v)
    un, vn = torch.nn.functional.normalize(u, dim=-1), torch.nn.functional.normalize(v, dim=-1)
    torch.testing.assert_close(f, torch.cat([un, vn, (un - vn).abs(), un * vn * h ** 0.5], -1))
    blocks = f.view(64, 4, h).norm(dim=-1).mean(0)
    assert blocks[0] == pytest.approx(1.0) and 0.3 < blocks[3] < 3.0, blocks
    assert (un * vn).norm(dim=-1).mean() < 0.15  # the unscaled block: an order of magnitude smaller
    torch.testing.assert_close(f[:, 3 * h:].sum(-1) / h ** 0.5, torch.nn.functional.cosine_similarity(u, v))


@pytest.mark.parametrize("sep_twice", [False, True])
def test_split_pair_equals_each_sentence_encoded_alone(sep_twice):
    enc = _encoder()
    ids, mask = _rows(PAIRS, sep_twice)
    ids_a, mask_a, ids_b, mask_b = split_pair(ids, mask, PAD)
    for i, (a, b) in enumerate(PAIRS):
        assert ids_a[i][mask_a[i].bool()].tolist() == [CLS, *a, SEP]
        assert ids_b[i][mask_b[i].bool()].tolist() == [CLS, *b, SEP]
    with torch.no_grad():
        u = masked_mean(enc(input_ids=ids_a, attention_mask=mask_a).last_hidden_state, mask_a)
        v = masked_mean(enc(input_ids=ids_b, attention_mask=mask_b).last_hidden_state, mask_b)
        for i, (a, b) in enumerate(PAIRS):
            torch.testing.assert_close(u[i], _alone(enc, a), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v[i], _alone(enc, b), rtol=1e-5, atol=1e-6)


def test_one_sentence_rows_are_refused_by_name():
    ids = torch.tensor([[CLS, 5, 6, SEP, PAD]])
    with pytest.raises(ValueError, match="text_pair"):
        split_pair(ids, (ids != PAD).long(), PAD)


def test_head_reads_the_four_pair_features_and_the_saved_model_agrees(tmp_path):
    m = MeanPoolClassifier(_encoder(), num_labels=2, dropout=0.0, pair="siamese").eval()
    assert m.classifier.in_features == 4 * 16
    ids, mask = _rows(PAIRS)
    with torch.no_grad():
        feats = m.features(input_ids=ids, attention_mask=mask)
        u = torch.stack([_alone(m.encoder, a) for a, _ in PAIRS])
        v = torch.stack([_alone(m.encoder, b) for _, b in PAIRS])
        torch.testing.assert_close(feats, siamese_features(u, v), rtol=1e-5, atol=1e-6)
        nu = u / u.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(feats[:, 16 * 3:], nu * (v / v.norm(dim=-1, keepdim=True)) * 16 ** 0.5,
                                       rtol=1e-5, atol=1e-6)
        logits = m(input_ids=ids, attention_mask=mask).logits
    m.save_pretrained(tmp_path, labels=["yes", "no"])
    back = DpftMeanPoolForSequenceClassification.from_pretrained(tmp_path).eval()
    assert back.pair == "siamese"
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask).logits, logits, rtol=1e-5, atol=1e-6)


def test_cached_features_are_the_pair_features():
    m = select_trainable(MeanPoolClassifier(_encoder(), 2, 0.0, pair="siamese"), TrainableCfg(mode="head")).eval()
    split, why = frozen_prefix(m)
    assert split is not None and split.kind == "pooled", why
    ids, mask = _rows(PAIRS)
    feats = split.prefix({"input_ids": ids, "attention_mask": mask})
    assert feats.shape == (3, 64)
    torch.testing.assert_close(split.suffix_forward(feats).logits,
                               m(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-6)
    joint = select_trainable(MeanPoolClassifier(_encoder(), 2, 0.0), TrainableCfg(mode="head"))
    assert frozen_prefix(joint)[0].fingerprint() != split.fingerprint()  # never one cache for both


def test_a_trainable_encoder_is_refused():
    m = MeanPoolClassifier(_encoder(), 2, 0.0, pair="siamese").train()  # everything trains
    ids, mask = _rows(PAIRS)
    with pytest.raises(ValueError, match="trainable.mode: head"):
        m(input_ids=ids, attention_mask=mask)


def test_the_recipe_refuses_what_siamese_cannot_do():
    base = {"model.pooling": "mean", "model.pair": "siamese", "task.name": "qnli"}
    load_recipe(None, {**base, "trainable.mode": "head"})
    for bad, says in (({"trainable.mode": "last_k"}, "trainable.mode: head"),
                      ({"trainable.mode": "head", "model.pooling": "model"}, "model.pooling: mean"),
                      ({"trainable.mode": "head", "task.name": "sst2"}, "sentence-pair task"),
                      ({"trainable.mode": "head", "task.name": "files", "task.train_file": "x.csv"},
                       "text_pair_column")):
        with pytest.raises(ValueError, match=says):
            load_recipe(None, {**base, **bad})


def test_auto_scope_reads_pairs_siamese():
    r = load_recipe(None, {"model.pooling": "mean", "task.name": "qnli", "trainable.mode": "auto"})
    resolved, msg = resolve_scope(r, 4000)
    assert resolved.trainable.mode == "head" and resolved.model.pair == "siamese"
    assert resolved.model.max_length == 128  # two texts: the arm measured (scope_evidence.py probe_pair)
    kept, _ = resolve_scope(load_recipe(None, {"model.pooling": "mean", "task.name": "qnli", "trainable.mode": "auto",
                                               "model.max_length": 48}), 4000)
    assert kept.model.max_length == 48
    single, _ = resolve_scope(load_recipe(None, {"model.pooling": "mean", "trainable.mode": "auto"}), 4000)
    assert single.model.pair == "joint"


@pytest.mark.slow  # a Trainer end to end twice (about 30 s on 2 shared cores)
def test_dpft_train_siamese_cache_on_equals_off(tiny_model_dir, tmp_path):
    """Through ``dpft train`` on a two-text CSV: cached siamese features release the same ledger, dev
    metrics and weights as the uncached run (reproducible mode), and the head is 4H wide."""
    import pandas as pd

    from conftest import files_recipe
    from dpft.run.loop import Trainer

    words = ["good", "bad", "great", "awful", "fine", "poor"]
    pd.DataFrame([{"text": f"is film {i} {words[i % 6]}", "other": f"it was {words[(i * 5) % 6]} indeed",
                   "label": int(i % 2 == 0)} for i in range(60)]).to_csv(tmp_path / "p.csv", index=False)
    out = {}
    for cache in ("on", "off"):
        rec = files_recipe(tiny_model_dir, {"csv": tmp_path / "p.csv"}, **{
            "task.text_pair_column": "other", "model.pooling": "mean", "model.pair": "siamese",
            "trainable.mode": "head", "model.max_length": 24, "privacy.reproducible": True, "seed": 3,
            "perf.feature_cache": cache, "schedule.steps": 4, "eval.every_steps": 2,
            "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 5})
        t = Trainer(rec, tmp_path / cache, progress=False)
        assert (t.plan.features is not None) == (cache == "on")
        rep = t.run()
        assert t.model.classifier.in_features == 4 * 16
        out[cache] = (rep, {n: p.detach().clone() for n, p in t.params.items()},
                      (tmp_path / cache / "ledger.json").read_text())
    (rep_on, p_on, led_on), (rep_off, p_off, led_off) = out["on"], out["off"]
    assert led_on == led_off
    assert rep_on["metrics"]["dev_accuracy"] == rep_off["metrics"]["dev_accuracy"]
    for n in p_on:
        torch.testing.assert_close(p_on[n], p_off[n], rtol=1e-4, atol=1e-6, msg=n)
    # The released model reads pairs the same way through transformers' pipeline (a pair in, the trained
    # head's label out; one text is refused by name).
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(tmp_path / "off" / "model"))  # t: the last run, off
    got = clf({"text": "is film 1 bad", "text_pair": "it was great indeed"})
    assert got["label"] in set(clf.model.config.id2label.values())
    tok = clf.tokenizer
    enc = tok("is film 1 bad", "it was great indeed", return_tensors="pt")
    with torch.no_grad():
        want = t.model.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.softmax(-1).max()
    assert abs(got["score"] - float(want)) < 1e-4
    with pytest.raises(ValueError, match="text_pair"):
        clf("one text only")


def test_a_head_candidate_of_a_search_reads_pairs_siamese():
    """``tune.space`` with the scope in it: the head candidate on a pair task gets siamese features (and 128
    tokens), the top-2-block candidate keeps the joint encoding it needs (run/scope.py ``scope_overrides``)."""
    from dpft.run.scope import scope_overrides

    r = load_recipe(None, {"model.pooling": "mean", "task.name": "qnli", "trainable.mode": "last_k"})
    head = scope_overrides(r, "head", 4000, keep_length=False)
    assert head["model.pair"] == "siamese" and head["model.max_length"] == 128
    assert "model.pair" not in scope_overrides(r, "last_k", 4000, keep_length=False)
    single = load_recipe(None, {"model.pooling": "mean", "trainable.mode": "last_k"})
    assert "model.pair" not in scope_overrides(single, "head", 4000, keep_length=False)


def test_search_trials_on_pairs_validate_for_both_scopes(tmp_path):
    """A search over the scope on a pair task: the head trial reads pairs siamese from the two-text fit files,
    the top-2-block trial keeps the joint encoding (run/tune.py ``_trial_recipe``); both recipes validate."""
    from dpft.run import tune as T
    from dpft.run.defaults import CLASSIFICATION

    r = load_recipe(None, dict(CLASSIFICATION, **{
        "task.name": "qnli", "trainable.mode": "last_k", "privacy.target_epsilon": 8.0, "schedule.steps": 40,
        "tune": {"space": {"trainable.mode": {"choice": ["head", "last_k"]}}}}))
    args = (1.0, tmp_path / "f.jsonl", tmp_path / "s.jsonl", True, ["entailment", "not_entailment"], 4000)
    head = T._trial_recipe(r, {"trainable.mode": "head"}, *args)
    assert (head.model.pair, head.model.max_length, head.task.text_pair_column) == ("siamese", 128, "text_pair")
    blocks = T._trial_recipe(r, {"trainable.mode": "last_k"}, *args)
    assert blocks.model.pair == "joint" and blocks.trainable.mode == "last_k"
