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
