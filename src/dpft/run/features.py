"""Frozen features computed once, as a plan part (issue 45 item 1; DESIGN.md "Features first at
small N").

:func:`feature_cache` is the seam: given the recipe, the run's tokenised rows, its model and
placement it returns the :class:`FeatureCache` (the split + the stored features) or ``(None,
why)``. ``dpft train`` builds one per run (run/plan.py); a caller running many trials of one
recipe family (``dpft tune``) may build it once and hand it to every trial's plan
(``build_plan(..., features=cache)``): a trial reuses it only when its key matches (same frozen
weights, split, tokenised rows and settings), and closes only a cache it built.

The DP step is untouched: the engine gets the whole model and :meth:`FeatureCache.loss`, a
per-example loss that runs the model from cached features (dpft/models/features.py), so its
trainable parameters, names, clipping, noise and ledger are those of the run without the cache.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dpft.data.feature_store import FeatureStore, compute_split, load_split, private_folder
from dpft.eval.dev import DevEvaluator
from dpft.models import features as prefix_code, hf_mean_pool
from dpft.models.features import FrozenPrefix, frozen_prefix
from dpft.run.errors import TrainingError
from dpft.data.tokenize import collate
from dpft.models.losses import model_inputs

__all__ = ["FeatureCache", "feature_cache", "cache_refusal", "FeatureDevEvaluator", "prefix_of"]

#: Checked on a few rows before a cache is used: |logits(cache) − logits(model)| ≤ this.
_AGREE = 1e-4


@dataclass
class FeatureCache:
    """A run's frozen prefix and its rows' features.

    Attributes:
        split: the model split (models/features.py).
        store: the features (data/feature_store.py), keyed by ``store.key``.
        owned: this plan built it (and so removes it when the run ends).
    """

    split: FrozenPrefix
    store: FeatureStore
    owned: bool = True

    @property
    def key(self) -> str:
        return self.store.key

    def loss(self, base: Callable) -> Callable:
        """The per-example loss on cached batches: ``loss(forward, batch) -> (B,)`` nats, with
        ``forward`` ignored in favour of the split's suffix on ``batch["features"]`` (the
        engine's hooks are on the same modules either way)."""
        split = self.split

        def features_loss(forward, batch):
            out = split.suffix_forward(batch["features"], batch.get("attention_mask"), batch.get("position_ids"))
            logits = out.logits if hasattr(out, "logits") else out
            return F.cross_entropy(logits.float(), batch["labels"], reduction="none")

        features_loss.__name__ = f"features_{getattr(base, '__name__', 'loss')}"
        return features_loss

    def describe(self) -> str:
        """One line for the plan that ``dpft train`` prints."""
        s = self.store
        mb = s.nbytes / 2 ** 20
        where = (f"on disk in a private temp folder ({mb:.0f} MiB)" if s.on_disk and not s.keep else
                 f"kept in {s.folder} ({mb:.0f} MiB)" if s.keep else f"in RAM ({mb:.1f} MiB)")
        how = "loaded from the kept cache" if s.loaded else f"computed once in {s.seconds:.0f} s"
        end = "kept after the run (perf.keep_feature_cache)" if s.keep else "removed when the run ends"
        return (f"features: the frozen {self.split.describe()} (eval mode) {how} for {len(s.train)} training + "
                f"{len(s.dev)} dev rows, {where}; private data at rest, outside the run folder, {end}")

    def close(self) -> None:
        """Remove the store's private folder (unless kept) when this plan owns it."""
        if self.owned:
            self.store.close()


def cache_refusal(recipe, world, methods: list, causal: bool, sampler=None) -> Optional[str]:
    """Why the recipe cannot use cached features (before any model is loaded), or None."""
    r = recipe
    if r.perf.feature_cache == "off":
        return "perf.feature_cache: off"
    if causal or r.task.name == "seq2seq":
        return "not a classification task"
    methods = [m for m in methods if not getattr(m, "keeps_frozen_part", False)]
    if methods:
        return f"method(s) {[m.name for m in methods]} change the model or data"
    if world.distributed:
        return "more than one process"
    if r.perf.sharding == "fsdp":
        return "perf.sharding: fsdp"
    if r.batch.max_batch_size is not None:
        return "truncated Poisson (fixed shapes)"
    if r.perf.activation_checkpointing:
        return "activation checkpointing"
    return None


def prefix_of(recipe, model, methods: list, causal: bool) -> Optional[FrozenPrefix]:
    """The model's frozen prefix, which every training step runs in eval mode (with or without
    the cache); None when there is none or the recipe's methods own the model."""
    methods = [m for m in methods if not getattr(m, "keeps_frozen_part", False)]
    if causal or methods or recipe.perf.sharding == "fsdp":
        return None
    split, _ = frozen_prefix(model)
    return split


def _key(split: FrozenPrefix, recipe, data, tokenizer, placement) -> str:
    """SHA-256 of everything the features depend on: the frozen weights and split, the code that
    computes them (the prefix split and the pooling / pair features), the tokenised rows
    (tokenizer, max length and data content), dtype, device type and library versions."""
    import transformers

    h = hashlib.sha256()
    h.update(split.fingerprint().encode())
    for code in (prefix_code, hf_mean_pool):  # a changed feature function never reuses a cache
        h.update(hashlib.sha256(Path(code.__file__).read_bytes()).digest())
    h.update(f"|{getattr(tokenizer, 'name_or_path', '')}|{type(tokenizer).__name__}|{len(tokenizer)}"
             f"|{recipe.model.max_length}|{placement.precision.dtype}|{placement.device.type}"
             f"|{torch.__version__}|{transformers.__version__}".encode())
    for name, rows in (("train", data.train_tok), ("dev", data.dev_tok)):
        h.update(f"|{name}|{len(rows)}".encode())
        for col in ("input_ids", "token_type_ids", "label"):
            if col in rows.column_names:
                for x in rows[col]:
                    h.update(repr(x).encode())
                    h.update(b";")
    return h.hexdigest()


def _cache_root(recipe) -> Path:
    d = recipe.perf.feature_cache_dir
    if d:
        return Path(d).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpft" / "features"


def _agree(split: FrozenPrefix, rows, collate, device) -> float:
    """max |logits(suffix(prefix(x))) − logits(model(x))| on up to 8 rows, eval mode."""

    m = split.model
    was = m.training
    m.eval()
    try:
        with torch.no_grad():
            batch = collate(list(rows.select(range(min(8, len(rows))))))
            full = m(**model_inputs(batch)).logits.float()
            feats = split.prefix(batch)
            part = split.suffix_forward(feats, batch.get("attention_mask"), batch.get("position_ids")).logits.float()
    finally:
        m.train(was)
    return float((full - part).abs().max()) if full.numel() else 0.0


def feature_cache(recipe, data, model, tokenizer, placement, *, run_dir: Optional[Path] = None,
                  reuse: Optional[FeatureCache] = None, progress: bool = False
                  ) -> tuple[Optional[FeatureCache], str]:
    """The run's cached features, or ``(None, why not)``.

    Args:
        recipe: the run's recipe (``perf.feature_cache*`` keys).
        data: its :class:`~dpft.data.prepare.TrainData` (tokenised train and dev rows).
        model, tokenizer: the run's model (trainable parameters selected) and tokenizer.
        placement: its device and precision.
        run_dir: the run's folder (a kept cache is refused inside it).
        reuse: a cache built earlier (another trial): used when its key matches.

    Raises:
        TrainingError: ``perf.feature_cache: on`` and the model has no frozen prefix or its split
            does not reproduce the model's outputs; a kept cache folder inside the run folder.
    """

    r = recipe
    split, why = frozen_prefix(model)
    if split is None:
        return None, why
    pad, tt, dev = data.pad_id, data.with_token_types, placement.device

    def coll(rows):
        return collate(rows, pad, tt, device=dev)

    gap = _agree(split, data.train_tok, coll, dev)
    if not gap <= _AGREE:
        return None, f"the split does not reproduce this model's outputs (|Δlogit| = {gap:.2g})"
    key = _key(split, r, data, tokenizer, placement)
    if reuse is not None and reuse.key == key:
        return FeatureCache(split, reuse.store, owned=False), ""
    keep = r.perf.keep_feature_cache
    folder = None
    if keep:
        root = _cache_root(r)
        if run_dir is not None:
            rd = Path(run_dir).expanduser().resolve()
            if root == rd or rd in root.parents:
                raise TrainingError(f"perf.feature_cache_dir {root} is inside the run folder {rd}: cached features "
                                    "are private data and must stay outside the release set; choose another folder")
        folder = private_folder(root, key[:32])
        tr, dv = load_split(folder, "train"), load_split(folder, "dev")
        if tr is not None and dv is not None and len(tr) == len(data.train_tok) and len(dv) == len(data.dev_tok):
            return FeatureCache(split, FeatureStore(key, tr, dv, folder, keep=True, loaded=True)), ""
    dim = split.width
    rows_tokens = sum(len(x) for x in data.train_tok["input_ids"]) + sum(len(x) for x in data.dev_tok["input_ids"])
    n_rows = len(data.train_tok) + len(data.dev_tok)
    est = 4 * dim * (n_rows if split.kind == "pooled" else rows_tokens)
    if folder is None and est > r.perf.feature_cache_memory_mb * 2 ** 20:
        folder = private_folder()
    t0 = time.time()
    m = split.model
    was = m.training
    m.eval()
    try:
        auto = placement.precision.autocast if placement.precision.mixed else None
        kw = dict(pooled=split.kind == "pooled", dim=dim, batch_size=max(r.eval.batch_size, 64), device=dev,
                  autocast=auto, disk=folder, progress=progress)
        tr = compute_split(split.prefix, data.train_tok, coll, name="train", **kw)
        dv = compute_split(split.prefix, data.dev_tok, coll, name="dev", **kw)
    except BaseException:
        if folder is not None and not keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        m.train(was)
    store = FeatureStore(key, tr, dv, folder, keep=keep, seconds=time.time() - t0)
    store.arm_removal()
    return FeatureCache(split, store), ""


#: ``auto`` caches a frozen part whose output is a sequence (``last_k``, ``units``) only when the run passes over
#: its rows at least this often: at about one pass the one feature pass costs what the steps' own forwards
#: would, and the states take T·d floats a row (the demo: 67k rows × 64 × 384 ≈ 6.6 GB on disk for 1.1 passes).
MIN_PASSES = 2.0


def few_passes(recipe, n: int) -> Optional[str]:
    """Why ``auto`` skips the cache of a sequence-valued frozen part for this run (None: it caches)."""
    r = recipe
    if r.trainable.mode == "head" and r.model.pooling == "mean":  # (N, d) pooled rows: always cheap to keep
        return None
    b = r.batch.expected_batch_size
    if not isinstance(b, int) or n <= 0:
        return None
    passes = float(r.schedule.epochs) if r.schedule.epochs else (
        float(r.schedule.steps) * b / n if isinstance(r.schedule.steps, int) else MIN_PASSES)
    if passes < MIN_PASSES:
        return (f"{passes:.2g} expected passes over the rows (< {MIN_PASSES:g}): computing the frozen blocks once "
                "would cost what the steps' own forwards do (perf.feature_cache: on to cache anyway)")
    return None


def build_for_plan(recipe, data, model, tokenizer, placement, world, methods: list, *, run_dir: Path,
                   reuse: Optional[FeatureCache] = None, progress: bool = False) -> Optional[FeatureCache]:
    """:func:`feature_cache` for ``dpft train``'s plan: None (silently) where ``auto`` does not
    apply; ``on`` where it cannot apply is an error naming why."""
    why = cache_refusal(recipe, world, methods, data.causal)
    if why is None and reuse is None and recipe.perf.feature_cache == "auto":
        why = few_passes(recipe, len(data.train_tok))
    cache = None
    if why is None:
        cache, why = feature_cache(recipe, data, model, tokenizer, placement, run_dir=run_dir, reuse=reuse,
                                   progress=progress)
    if cache is None and recipe.perf.feature_cache == "on":
        raise TrainingError(f"perf.feature_cache: on, but this run cannot cache features ({why}); "
                            "set perf.feature_cache: auto or off")
    if cache is not None and progress:
        print(cache.describe(), file=sys.stderr)
    return cache


class FeatureDevEvaluator(DevEvaluator):
    """Dev accuracy and loss from cached dev features when the model evaluated is the run's own
    (any other model: the token path). Same metrics as :class:`DevEvaluator`."""

    def __init__(self, data, placement, world, eval_cfg, all_sum, cache: FeatureCache):
        super().__init__(data, placement, world, eval_cfg, all_sum)
        self.cache = cache

    def _classifier(self, model) -> dict[str, float]:
        if model is not self.cache.split.model:
            return super()._classifier(model)
        dev = self.cache.store.dev
        n = len(dev)
        was = model.training
        model.eval()
        logits = []
        try:
            with torch.no_grad():
                for k in range(0, n, self.cfg.batch_size):
                    b = dev.batch(torch.arange(k, min(n, k + self.cfg.batch_size)), self.placement.device)
                    ctx = self.placement.precision.autocast()
                    with ctx:
                        out = self.cache.split.suffix_forward(b["features"], b.get("attention_mask"),
                                                              b.get("position_ids"))
                    logits.append(out.logits.float().cpu())
        finally:
            model.train(was)
        y = dev.labels
        lg = torch.cat(logits) if logits else torch.empty(0, 0)
        pred = lg.argmax(-1) if n else y
        hit = pred == y
        if self.cfg.save_predictions:
            self.dev_predictions = [{"index": i, "prediction": int(p), "correct": bool(h)}
                                    for i, (p, h) in enumerate(zip(pred.tolist(), hit.tolist()))]
        loss = float(F.cross_entropy(lg, y, reduction="sum")) if n else 0.0
        return {"dev_accuracy": int(hit.sum()) / max(n, 1), "dev_loss": loss / max(n, 1)}
