"""Frozen features computed once (issue 45 item 1; run/features.py, models/features.py).

The cache is exact: in reproducible mode, the same recipe with ``perf.feature_cache: on`` and
``off`` releases the same ledger, the same dev metrics and the same final weights (tiny random
BERT built in-process, mean pooling, dropout on, so the suffix's dropout masks must agree too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import files_recipe

pytestmark = pytest.mark.slow  # each test runs Trainers end to end (20-40 s on 2 shared cores)

MODES = {
    "head": {"trainable.mode": "head"},
    "last_k": {"trainable.mode": "last_k", "trainable.last_k": 1},
    "units": {"trainable.mode": "units", "trainable.units": ["block.1"]},
}


def _recipe(tiny_model_dir, files, mode, cache, **extra):
    ov = {"model.pooling": "mean", "model.dropout": 0.1, "model.head_dropout": 0.1, "privacy.reproducible": True,
          "privacy.engine": "bookkeeping", "seed": 3, "schedule.steps": 4, "eval.every_steps": 2,
          "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 5, "perf.feature_cache": cache,
          **MODES[mode], **extra}
    return files_recipe(tiny_model_dir, files, **ov)


def _run(rec, out):
    from dpft.run.loop import Trainer

    t = Trainer(rec, out, progress=False)
    cached = t.plan.features is not None
    rep = t.run()
    params = {n: p.detach().clone() for n, p in t.params.items()}
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return t, rep, params, rows, cached


@pytest.mark.parametrize("mode", sorted(MODES))
def test_cache_on_equals_cache_off(tiny_model_dir, sst_like_files, tmp_path, mode):
    t_on, rep_on, p_on, rows_on, cached = _run(_recipe(tiny_model_dir, sst_like_files, mode, "on"), tmp_path / "on")
    t_off, rep_off, p_off, rows_off, cached_off = _run(_recipe(tiny_model_dir, sst_like_files, mode, "off"),
                                                      tmp_path / "off")
    assert cached and not cached_off
    # The same trainable parameters under the same names, and the same final values.
    assert list(p_on) == list(p_off)
    for n in p_on:
        torch.testing.assert_close(p_on[n], p_off[n], rtol=1e-5, atol=1e-6, msg=n)
    # The same ledger (the same events), the same ε and the same released dev metrics.
    assert t_on.ledger.to_json() == t_off.ledger.to_json()
    assert (tmp_path / "on" / "ledger.json").read_text() == (tmp_path / "off" / "ledger.json").read_text()
    assert len(rows_on) == len(rows_off) == 4
    for a, b in zip(rows_on, rows_off):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
            else:
                assert a[k] == b[k], k


def test_training_moved_the_weights_and_prefix_is_eval(tiny_model_dir, sst_like_files, tmp_path):
    """The equality above is not vacuous: the weights moved; and the frozen prefix runs in eval
    mode in a training step (no dropout there), with or without the cache."""
    from dpft.run.loop import Trainer

    for cache in ("on", "off"):
        t = Trainer(_recipe(tiny_model_dir, sst_like_files, "last_k", cache), tmp_path / cache, progress=False)
        before = {n: p.detach().clone() for n, p in t.params.items()}
        t.step(0)
        assert any(not torch.equal(before[n], p) for n, p in t.params.items())
        prefix = t.plan.prefix
        assert prefix is not None and prefix.start == 1
        assert all(not m.training for mod in prefix.prefix_modules() for m in mod.modules())
        assert t.model.classifier.training and t.model.encoder.encoder.layer[1].training
        if t.plan.features is not None:
            t.plan.features.close()


def test_plan_states_size_and_cache_is_private_and_removed(tiny_model_dir, sst_like_files, tmp_path):
    """Disk-backed beyond the memory limit, in a private folder outside the run folder, removed
    when the run ends; nothing of it in the run folder."""
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, "last_k", "on", **{"perf.feature_cache_memory_mb": 0})
    t = Trainer(rec, tmp_path / "run", progress=False)
    store = t.plan.features.store
    assert store.on_disk and store.folder is not None and store.folder.is_dir()
    assert oct(store.folder.stat().st_mode & 0o777) == "0o700"
    assert tmp_path / "run" not in store.folder.parents
    assert "MiB" in t.plan.features.describe() and "removed when the run ends" in t.plan.features.describe()
    t.run()
    assert not store.folder.exists()
    names = {p.name for p in (tmp_path / "run").rglob("*")}
    assert not any(n.endswith(".npy") or "features" in n for n in names)


def test_kept_cache_is_reused_and_key_follows_the_model(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    keep = {"perf.keep_feature_cache": True, "perf.feature_cache_dir": str(tmp_path / "fc")}
    t1 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **keep), tmp_path / "a", progress=False)
    t1.run()
    folder = t1.plan.features.store.folder
    assert folder.is_dir() and not t1.plan.features.store.loaded
    t2 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **keep), tmp_path / "b", progress=False)
    assert t2.plan.features.store.loaded and t2.plan.features.key == t1.plan.features.key
    # Another max length (other tokenised rows) or another frozen part: another key.
    t3 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **keep, **{"model.max_length": 8}),
                 tmp_path / "c", progress=False)
    t4 = Trainer(_recipe(tiny_model_dir, sst_like_files, "last_k", "on", **keep), tmp_path / "d", progress=False)
    assert len({t1.plan.features.key, t3.plan.features.key, t4.plan.features.key}) == 3
    # Changed feature code (the pooling / pair features): another key, so an old cache is never reused.
    import dpft.models.hf_mean_pool as code

    changed = tmp_path / "hf_mean_pool.py"
    changed.write_text(Path(code.__file__).read_text() + "\n# changed\n")
    orig = code.__file__
    try:
        code.__file__ = str(changed)
        t5 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **keep), tmp_path / "f", progress=False)
    finally:
        code.__file__ = orig
    assert t5.plan.features.key != t1.plan.features.key and not t5.plan.features.store.loaded
    # A kept cache inside the run folder is refused (private data at rest, outside the release set).
    from dpft.errors import TrainingError

    bad = {"perf.keep_feature_cache": True, "perf.feature_cache_dir": str(tmp_path / "e" / "fc")}
    with pytest.raises(TrainingError, match="outside the release set"):
        Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **bad), tmp_path / "e", progress=False)


def test_reuse_across_trials_and_on_refused_without_prefix(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.errors import TrainingError
    from dpft.run.loop import Trainer

    t1 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on"), tmp_path / "a", progress=False)
    t2 = Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **{"optimizer.lr": 0.5}), tmp_path / "b",
                 progress=False, features=t1.plan.features)
    assert t2.plan.features.store is t1.plan.features.store and not t2.plan.features.owned
    with pytest.raises(TrainingError, match="perf.feature_cache: on"):
        Trainer(_recipe(tiny_model_dir, sst_like_files, "head", "on", **{"trainable.mode": "full"}),
                tmp_path / "c", progress=False)
    t1.plan.features.close()


def test_resume_with_cache(tiny_model_dir, sst_like_files, tmp_path):
    """A run checkpointed at step 2 and resumed (cache rebuilt) ends where an uninterrupted run does."""
    from dpft.run.loop import Trainer

    full = _run(_recipe(tiny_model_dir, sst_like_files, "last_k", "on", checkpoint_every=2), tmp_path / "full")
    rec = _recipe(tiny_model_dir, sst_like_files, "last_k", "on", checkpoint_every=2, **{"schedule.steps": 4})
    t = Trainer(rec, tmp_path / "part", progress=False)
    t.total_steps = 2  # stop after the checkpoint at step 2 (the recipe still says 4)
    t.run()
    t2 = Trainer(rec, tmp_path / "part", resume=True, progress=False)
    assert t2.plan.features is not None
    t2.run()
    assert t2.start_step == 2
    for n, p in full[2].items():
        torch.testing.assert_close(t2.params[n].detach(), p, rtol=1e-5, atol=1e-6)


