"""Poisson sampler statistics, recipe validation, data loading and its errors."""

import math

import pytest
import torch

from dpft.privacy.randomness import Randomness

from dpft.config.recipe import RecipeError, load_recipe
from dpft.step.sample import PoissonSampler
from dpft.data.tasks import DataError, load_task
from dpft.data.tokenize import collate


def test_poisson_batch_sizes_have_binomial_mean_and_variance():
    n, b = 2000, 50
    s = PoissonSampler(n, b, Randomness(3))
    assert s.q == b / n
    sizes = torch.tensor([len(s.indices(t)) for t in range(3000)], dtype=torch.float64)
    mean, var = n * s.q, n * s.q * (1 - s.q)
    assert abs(sizes.mean() - mean) < 4 * math.sqrt(var / 3000)
    assert abs(sizes.var() / var - 1) < 0.1
    # same seed and step -> same batch (what resume relies on); other step -> other batch
    assert torch.equal(s.indices(17), PoissonSampler(n, b, Randomness(3)).indices(17))
    assert not torch.equal(s.indices(17), s.indices(18))


def test_empty_batches_are_legal_and_micro_batches_bound_memory():
    s = PoissonSampler(1000, 1, Randomness(0))
    sizes = [len(s.indices(t)) for t in range(200)]
    assert 0 in sizes
    assert PoissonSampler.micro_batches(torch.tensor([], dtype=torch.long), 4) == []
    chunks = PoissonSampler.micro_batches(torch.arange(10), 4)
    assert [len(c) for c in chunks] == [4, 4, 2]


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="empty"):
        PoissonSampler(0, 1, Randomness(0))
    with pytest.raises(ValueError, match="between 1 and N"):
        PoissonSampler(10, 11, Randomness(0))


def test_recipe_unknown_key_and_bad_value(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("privacy:\n  target_epsilonn: 3\noptimizer:\n  lr: -1\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert "privacy.target_epsilonn: unknown key" in msg
    assert "optimizer.lr" in msg and "greater than 0" in msg


def test_recipe_overrides_and_demo_recipe():
    r = load_recipe("recipes/sst2-minilm.yaml", {"privacy.target_epsilon": 3.0, "optimizer.lr": 0.01})
    assert r.privacy.target_epsilon == 3.0 and r.optimizer.lr == 0.01
    assert r.model.name == "minilm" and r.task.name == "sst2"
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("no/such.yaml")


@pytest.mark.parametrize("ext", ["csv", "tsv", "jsonl", "parquet"])
def test_local_files_load_with_columns(sst_like_files, ext):
    from dpft.config.recipe import TaskCfg

    d = load_task(TaskCfg(name="files", train_file=str(sst_like_files[ext])), seed=0)
    assert len(d.train) + len(d.dev) == 60 and d.num_labels == 2
    assert set(d.train.column_names) == {"text", "label"}


def test_data_errors_name_the_fix(sst_like_files, tmp_path):
    from dpft.config.recipe import TaskCfg

    f = str(sst_like_files["csv"])
    with pytest.raises(DataError, match="no text column 'sentence'.*--text-column"):
        load_task(TaskCfg(name="files", train_file=f, text_column="sentence"))
    with pytest.raises(DataError, match="not found"):
        load_task(TaskCfg(name="files", train_file=str(tmp_path / "missing.csv")))
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    with pytest.raises(DataError, match="empty|too few|cannot read"):
        load_task(TaskCfg(name="files", train_file=str(empty), dev_file=f))
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nok,0\nfine,1\n")
    dev = tmp_path / "dev.csv"
    dev.write_text("text,label\nhm,5\n")
    with pytest.raises(DataError, match="outside the label set"):
        load_task(TaskCfg(name="files", train_file=str(bad), dev_file=str(dev)))
    with pytest.raises(DataError, match="unknown task"):
        load_task(TaskCfg(name="nope"))


def test_sst2_offline_from_shared_data(shared_data, monkeypatch):
    from dpft.config.recipe import TaskCfg

    monkeypatch.setenv("DPFT_DATA_DIR", str(shared_data))
    d = load_task(TaskCfg(name="sst2"))
    assert len(d.train) == 67349 and len(d.dev) == 872 and d.label_names == ["negative", "positive"]


def test_collate_gives_explicit_positions_per_example():
    rows = [{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].shape == (2, 3) and b["position_ids"].shape == (2, 3)
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [1, 0]


def test_every_shipped_recipe_validates():
    """Each recipe in recipes/ (the README's and the papers' tables) passes the schema as shipped."""
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert len(recipes) >= 10
    for f in recipes:
        r = load_recipe(str(f))
        assert r.name, f
    # the DP-SFT paper's Adapter-DP baseline (r = 48 on RoBERTa-base's 768): Tables 1 and 2
    paper = [load_recipe(str(f)) for f in recipes if "adapter-dp" in f.name]
    assert {(r.task.name, r.privacy.target_epsilon) for r in paper} >= {("sst2", 4.0), ("sst2", 1.0), ("qnli", 4.0)}
    assert all(768 // r.model.adapter.reduction_factor == 48 and r.privacy.clipping.max_norm == 10.0 for r in paper)
