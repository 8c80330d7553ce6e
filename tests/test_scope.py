"""``trainable.mode: auto`` (run/scope.py, issue 45 item 4): the scope from N, with the user's keys kept."""

from __future__ import annotations

import pytest

from dpft.config import load_recipe
from dpft.models.load import ModelError, select_trainable
from dpft.run.auto import resolve_auto
from dpft.run.defaults import CLASSIFICATION
from dpft.run.scope import HEAD_MAX_ROWS, choose_scope


@pytest.mark.parametrize("n, scope", [(1_000, "head"), (5_000, "head"), (HEAD_MAX_ROWS, "head"),
                                      (67_349, "last_k")])
def test_the_rule_by_n(n, scope):
    assert choose_scope(n, 8.0)[0] == scope


def test_pairs_follow_n_and_say_what_was_measured():
    """QNLI at 4,000 rows, ε = 8 (scope_evidence.md): the probe on siamese pair features 0.736, the jointly
    encoded probe 0.542, the top 2 blocks 0.514: the siamese probe, with what the data allows said beside it."""
    assert choose_scope(4000, 8.0, pair=True)[0] == "head"
    assert choose_scope(67_349, 8.0, pair=True)[0] == "last_k"
    r, msg = resolve_auto(load_recipe(None, dict(CLASSIFICATION, **{"task.name": "qnli"})), 4000, num_labels=2,
                          n_dev=100)
    assert r.trainable.mode == "head" and r.model.pair == "siamese" and "rows of two texts" in msg
    assert "without DP the top 2 blocks reach 0.734" in msg  # what the data allows, said beside the choice


def test_auto_resolves_to_the_probe_bundle_and_keeps_what_the_user_set():
    r = load_recipe(None, dict(CLASSIFICATION, **{"privacy.target_epsilon": 3.0, "schedule.epochs": 40,
                                                  "schedule.steps": None}))
    r2, msg = resolve_auto(r, 4000, num_labels=2, n_dev=100)
    assert r2.trainable.mode == "head" and r2.batch.expected_batch_size == 1000 and r2.optimizer.lr == 0.02
    assert r2.schedule.epochs == 40 and "kept as the recipe sets them: schedule.epochs" in msg
    r3, msg = resolve_auto(load_recipe(None, dict(CLASSIFICATION)), 50_000, num_labels=2, n_dev=100)
    assert r3.trainable.mode == "last_k" and r3.optimizer.lr == 3e-4 and "last_k" in msg


def test_an_unresolved_auto_scope_is_refused_before_the_model_trains():
    from torch import nn

    with pytest.raises(ModelError, match="resolve_auto"):
        select_trainable(nn.Linear(2, 2), load_recipe(None, {"trainable.mode": "auto"}).trainable)


def test_the_scope_in_a_search_space_brings_its_batch_and_schedule(tmp_path):
    """``tune.space: {trainable.mode: {choice: [head, last_k]}}`` (issue 45 item 4): each scope is a candidate
    mechanism with the batch and schedule it runs (the probe: q = 1/4, 25 epochs), accounted as it runs."""
    from dpft.run import tune as T

    r = load_recipe(None, dict(CLASSIFICATION, **{
        "trainable.mode": "last_k", "privacy.target_epsilon": 8.0, "schedule.steps": 40,
        "tune": {"space": {"trainable.mode": {"choice": ["head", "last_k"]}}}}))
    combos = T.configurations(r)
    assert {c["trainable.mode"] for c in combos} == {"head", "last_k"}
    plans = {c["trainable.mode"]: T._steps_and_q(r, c, 4000) for c in combos}
    assert plans["head"] == (1000 / 4000, 100)  # B = N/4, 25 epochs
    assert plans["last_k"] == (256 / 4000, 40)  # the recipe's own
    rec = T._trial_recipe(r, {"trainable.mode": "head", "optimizer.lr": 0.05}, 1.0, tmp_path / "f.jsonl",
                          tmp_path / "s.jsonl", False, ["neg", "pos"], 4000)
    assert rec.trainable.mode == "head" and rec.batch.expected_batch_size == 1000 and rec.schedule.epochs == 25
    assert rec.optimizer.lr == 0.05 and rec.privacy.clipping.style == "flat"  # the sampled lr over the bundle's
    with pytest.raises(ValueError, match="choose among head, last_k, full, lora"):
        load_recipe(None, {"tune": {"space": {"trainable.mode": {"choice": ["bias"]}}}})


def test_every_block_and_lora_are_scopes_a_search_may_choose(tmp_path):
    """``full`` and ``lora`` in ``tune.space.trainable.mode`` (issue 45 item 4): q = 1/8 for 5 epochs each (the
    measured full_dp / lora_dp arms), accounted as they run; LoRA at its own lr 1e-3, full at the recipe's."""
    from dpft.run import tune as T

    r = load_recipe(None, dict(CLASSIFICATION, **{
        "trainable.mode": "last_k", "privacy.target_epsilon": 8.0, "schedule.steps": 40,
        "tune": {"space": {"trainable.mode": {"choice": ["head", "last_k", "full", "lora"]}}}}))
    plans = {c["trainable.mode"]: T._steps_and_q(r, c, 4000) for c in T.configurations(r)}
    assert plans["full"] == plans["lora"] == (500 / 4000, 40)  # B = N/8, 5 epochs
    assert plans["head"] == (1000 / 4000, 100) and plans["last_k"] == (256 / 4000, 40)
    for scope, lr in (("full", 3e-4), ("lora", 1e-3)):
        rec = T._trial_recipe(r, {"trainable.mode": scope}, 1.0, tmp_path / "f.jsonl", tmp_path / "s.jsonl", False,
                              ["neg", "pos"], 4000)
        assert rec.trainable.mode == scope and rec.batch.expected_batch_size == 500 and rec.schedule.epochs == 5
        assert rec.optimizer.lr == lr and rec.privacy.clipping.style == "head_body"  # the recipe's clipping


def test_scope_choices_of_the_schema_are_the_rules_scopes():
    from dpft.config.tune import SCOPE_CHOICES
    from dpft.run.scope import SCOPES

    assert set(SCOPE_CHOICES) == set(SCOPES)


def test_the_head_bundle_is_the_probe_recipe():
    """``run/scope.py``'s head bundle restates recipes/probe-minilm.yaml (sized for 5,000 rows): the recipe
    file is the measured source (benchmarks/results/scope_evidence.md); this keeps the two the same."""
    from pathlib import Path

    from dpft.run.scope import SCOPES, _get

    rec = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "probe-minilm.yaml")
    bundle = SCOPES["head"][0](5000)
    for key, value in bundle.items():
        if key in ("batch.max_physical_batch_size", "eval.every_steps", "checkpoint_every"):
            continue  # performance and logging only, not the measured mechanism
        got = _get(rec, key)
        assert got == value or (got is None and value is None), (key, got, value)
