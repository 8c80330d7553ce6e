"""Audit checks of frozen features computed once (issue 45 item 1; run/features.py).

* **exact** — on a tiny random mean-pooling BERT (``last_k: 1`` and ``head``), the book-keeping
  engine's per-example norms and clipped sums from the cache (built by
  :func:`dpft.run.features.feature_cache`) equal those of the token path with the frozen prefix
  in eval mode; planted ``features_prefix_train_mode`` (the cache computed with dropout on in the
  frozen part) fails it.
* **private at rest** — a disk-backed cache lives in a folder of mode 0700 outside the run folder
  and is gone once the run closes it; planted ``features_cache_in_run_dir`` (the memmap written in
  the run folder and kept) fails it.
* **keyed** — a changed frozen weight gives another key (a changed model never reuses a cache);
  planted ``features_key_ignores_weights`` fails it.
* **pairs per example** — with siamese pair features (``model.pair: siamese``: two encoder rows per
  example) the engine's per-example norms are one per pair, each that pair's own gradient norm, and a
  trainable encoder is refused (``MeanPoolClassifier.check_frozen_encoder``); planted
  ``features_siamese_trainable_encoder`` (the refusal removed) fails it.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import types
from pathlib import Path
from typing import Optional
from unittest import mock

import torch
import transformers

from dpft.audit.whitebox import Check
from dpft.config.recipe import TrainableCfg
from dpft.config.recipe import load_recipe
from dpft.data import feature_store as fs
from dpft.data.tokenize import collate
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.models import features as mf
from dpft.models.load import select_trainable
from dpft.models.losses import classification_loss
from dpft.models.standard import MeanPoolClassifier
from dpft.placement.device import Precision
from dpft.run.features import feature_cache
from dpft.step.clip import make_clip_policy

__all__ = ["PLANTED", "features_checks"]

PLANTED = ("features_prefix_train_mode", "features_cache_in_run_dir", "features_key_ignores_weights",
           "features_siamese_trainable_encoder")


def _model(mode: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.3,
                                  attention_probs_dropout_prob=0.3)
    m = MeanPoolClassifier(transformers.BertModel(cfg, add_pooling_layer=False), num_labels=2, dropout=0.0)
    kw = {"last_k": 1} if mode == "last_k" else {}
    return select_trainable(m, TrainableCfg(mode=mode, **kw))


def _data(n: int = 12):
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist(),
             "label": i % 2} for i in range(n)]
    ds = datasets.Dataset.from_list(rows)
    return types.SimpleNamespace(train_tok=ds, dev_tok=ds.select(range(4)), pad_id=0, with_token_types=False,
                                 causal=False)


def _placement():

    return types.SimpleNamespace(device=torch.device("cpu"), precision=Precision("fp32"))


def _recipe(**perf):

    return load_recipe(None, {"model.pooling": "mean", **{f"perf.{k}": v for k, v in perf.items()}})


class _Tok:
    name_or_path = "audit-tiny"

    def __len__(self):
        return 64


@contextlib.contextmanager
def _plant(planted: Optional[str], run_dir: Path):

    with contextlib.ExitStack() as stack:
        if planted == "features_prefix_train_mode":
            real = mf.FrozenPrefix.prefix

            def train_mode_prefix(self, batch):
                for m in self.prefix_modules():
                    m.train()
                return real(self, batch)

            stack.enter_context(mock.patch.object(mf.FrozenPrefix, "prefix", train_mode_prefix))
        elif planted == "features_cache_in_run_dir":
            def in_run_dir(parent=None, name=None):
                f = run_dir / "features"
                f.mkdir(parents=True, exist_ok=True)
                return f

            stack.enter_context(mock.patch.object(fs, "private_folder", in_run_dir))
            stack.enter_context(mock.patch("dpft.run.features.private_folder", in_run_dir))
            stack.enter_context(mock.patch.object(fs.FeatureStore, "arm_removal", lambda self: None))
        elif planted == "features_key_ignores_weights":
            stack.enter_context(mock.patch.object(mf.FrozenPrefix, "fingerprint", lambda self: "constant"))
        elif planted == "features_siamese_trainable_encoder":
            stack.enter_context(mock.patch.object(MeanPoolClassifier, "check_frozen_encoder", lambda self: None))
        yield


def _exact() -> tuple[bool, str, float]:

    worst = 0.0
    for mode in ("last_k", "head"):
        m = _model(mode)
        data = _data()
        cache, why = feature_cache(_recipe(), data, m, _Tok(), _placement())
        if cache is None:
            return False, f"{mode}: no cache ({why})", float("inf")
        idx = torch.arange(len(data.train_tok))
        clip = make_clip_policy("flat", 0.1)
        m.train()
        cache.split.eval_prefix()
        torch.manual_seed(0)  # the same dropout masks in the trainable block, both paths
        tok = BookKeepingEngine(m, classification_loss, clip).clipped_sum(
            collate(list(data.train_tok.select(idx.tolist())), 0, False))
        torch.manual_seed(0)
        got = BookKeepingEngine(m, cache.loss(classification_loss), clip).clipped_sum(cache.store.train.batch(idx))
        cache.close()
        worst = max(worst, float((tok.sq_norms - got.sq_norms).abs().max()),
                    *[float((tok.grad_sum[n] - got.grad_sum[n]).abs().max()) for n in tok.grad_sum])
    return worst <= 1e-5, f"max |Δ| of norms and clipped sums over head and last_k: {worst:.2g}", worst


def _at_rest(run_dir: Path) -> tuple[bool, str]:

    cache, why = feature_cache(_recipe(feature_cache_memory_mb=0), _data(), _model("last_k"), _Tok(), _placement(),
                               run_dir=run_dir)
    if cache is None:
        return False, f"no cache ({why})"
    folder = cache.store.folder
    mode = folder.stat().st_mode & 0o777 if folder is not None else None
    inside = folder is not None and (run_dir == folder or run_dir in folder.parents)
    cache.close()
    gone = folder is not None and not folder.exists()
    ok = folder is not None and mode == 0o700 and not inside and gone
    return ok, f"folder mode {oct(mode) if mode is not None else '-'}, inside the run folder: {inside}, removed: {gone}"


def _keyed() -> tuple[bool, str]:

    a, _ = feature_cache(_recipe(), _data(), _model("head"), _Tok(), _placement())
    m = _model("head")
    with torch.no_grad():
        m.encoder.encoder.layer[0].output.dense.weight[0, 0] += 1e-3
    b, _ = feature_cache(_recipe(), _data(), m, _Tok(), _placement())
    ok = a is not None and b is not None and a.key != b.key
    return ok, "a changed frozen weight " + ("changes the key" if ok else "kept the key (a stale cache would be reused)")


def _pairs() -> tuple[bool, str]:
    """Siamese pair features (models/hf_mean_pool.py): the engine's per-example norms are one per example (each
    equal to that example's own gradient norm, autograd alone), and a trainable encoder is refused."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    enc = transformers.BertModel(cfg, add_pooling_layer=False)
    full = MeanPoolClassifier(copy.deepcopy(enc), 2, 0.0, pair="siamese")  # every parameter trains
    # eval mode: the frozen encoder's dropout off, as in training (FrozenPrefix.eval_prefix)
    m = select_trainable(MeanPoolClassifier(enc, 2, 0.0, pair="siamese"), TrainableCfg(mode="head")).eval()
    rows = [[2, 5, 6, 3, 8, 9, 3, 0], [2, 10, 3, 11, 12, 13, 14, 3], [2, 15, 16, 3, 17, 3, 0, 0]]
    ids = torch.tensor(rows)
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 1, 1])}
    got = BookKeepingEngine(m, classification_loss, make_clip_policy("flat", 1e6)).clipped_sum(batch).sq_norms.sum(1)
    head = [p for p in m.parameters() if p.requires_grad]
    alone = []
    for i in range(len(rows)):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        g = torch.autograd.grad(classification_loss(m, one).sum(), head)
        alone.append(sum(float((x ** 2).sum()) for x in g))
    per_example = got.shape[0] == len(rows) and torch.allclose(got, torch.tensor(alone), rtol=1e-4, atol=1e-8)
    try:
        full(**{k: batch[k] for k in ("input_ids", "attention_mask")})
        refused = False
    except ValueError:
        refused = True
    return per_example and refused, (f"{got.shape[0]} norms for {len(rows)} pairs, equal to each pair alone: "
                                     f"{per_example}; a trainable encoder refused: {refused}")


def features_checks(planted: Optional[str] = None) -> list[Check]:
    """The four checks above; ``planted`` one of :data:`PLANTED` (or None)."""
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        run_dir.mkdir()
        with _plant(planted, run_dir):
            ok_x, msg_x, worst = _exact()
            ok_r, msg_r = _at_rest(run_dir)
            ok_k, msg_k = _keyed()
            ok_p, msg_p = _pairs()
    return [Check("features: cached path = token path (norms, clipped sums)", ok_x, msg_x, {"max_abs_diff": worst}),
            Check("features: cache private at rest, outside the run folder, removed", ok_r, msg_r),
            Check("features: key follows the frozen weights", ok_k, msg_k),
            Check("features: siamese pairs clipped per example (frozen encoder only)", ok_p, msg_p)]
