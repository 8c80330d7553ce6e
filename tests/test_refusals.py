"""One refusal registry for every way in (issue 46 item 3; src/dpft/config/refusals.py): each shared rule is
refused by make_private, by DPTrainer's arguments and by a recipe with the same sentence, naming the recipe
key and the keyword; every registered refusal is raised somewhere in src (no dead entries)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import dpft.methods  # noqa: F401  (hands the recipe schema the method registry)
from dpft.api.arguments import PerformanceArguments, PrivacyArguments, check_arguments
from dpft.config import RecipeError, load_recipe
from dpft.config.refusals import REFUSALS, SETTINGS, WAYS, refuse
from dpft.integrations.hf import DPArguments, DPTrainer
from dpft.integrations.hf.checks import check_trainer, check_training_arguments

SRC = Path(__file__).resolve().parents[1] / "src" / "dpft"


def _make_private(**kw):
    module = kw.pop("module", None) or nn.Linear(2, 2)
    perf = PerformanceArguments(max_physical_batch_size=kw.pop("max_physical_batch_size", None))
    p = PrivacyArguments(**{"max_grad_norm": 1.0, "steps": 3, "noise_multiplier": 1.0, **kw})
    check_arguments(module, torch.optim.SGD(module.parameters(), lr=0.1), p, perf)


def _dp_arguments(**kw):
    DPArguments(**{"target_delta": 1e-3, "expected_batch_size": 8, "noise_multiplier": 1.0, **kw})


def _recipe(**ov):
    load_recipe(None, {k.replace("__", "."): v for k, v in ov.items()})


def _dptrainer_batchnorm():
    fake = type("Fake", (), {m: getattr(DPTrainer, m) for m in ("get_train_dataloader", "_get_train_sampler")})()
    fake.model_init, fake.compute_loss_func, fake.train_dataset = None, None, [0]
    fake.model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    check_trainer(fake, None, DPTrainer)


CAL = dict(target_epsilon=1.0, target_delta=1e-3, noise_multiplier=None)
#: key -> {way: a call that breaks the rule in that way in}
CASES = {
    "poisson_sampling:not_poisson": {
        "make_private": lambda: _make_private(poisson_sampling=False),
        "DPTrainer": lambda: check_training_arguments(SimpleNamespace(group_by_length=True))},
    "schedule.steps:both_lengths": {
        "make_private": lambda: _make_private(steps=3, epochs=1),
        "recipe": lambda: _recipe(schedule__steps=5, schedule__epochs=1.0)},
    "schedule.steps:no_length": {
        "make_private": lambda: _make_private(steps=None, **CAL),
        "recipe": lambda: _recipe(schedule__steps=None)},
    "privacy.noise_multiplier:both_or_neither": {
        "make_private": lambda: _make_private(target_epsilon=1.0, target_delta=1e-3),
        "DPTrainer": lambda: _dp_arguments(target_epsilon=1.0),
        "recipe": lambda: _recipe(privacy__target_epsilon=None)},
    "privacy.noise_multiplier:range": {
        "make_private": lambda: _make_private(noise_multiplier=-1.0),
        "DPTrainer": lambda: _dp_arguments(noise_multiplier=-1.0),
        "recipe": lambda: _recipe(privacy__noise_multiplier=-1.0)},
    "privacy.target_epsilon:range": {
        "make_private": lambda: _make_private(**{**CAL, "target_epsilon": 0.0}),
        "DPTrainer": lambda: _dp_arguments(target_epsilon=0.0, noise_multiplier=None),
        "recipe": lambda: _recipe(privacy__target_epsilon=0.0)},
    "privacy.delta:missing": {
        "make_private": lambda: _make_private(**{**CAL, "target_delta": None})},
    "privacy.delta:range": {
        "make_private": lambda: _make_private(**{**CAL, "target_delta": 1.5}),
        "DPTrainer": lambda: _dp_arguments(target_delta=1.5),
        "recipe": lambda: _recipe(privacy__delta=1.5)},
    "privacy.clipping.style:unknown": {
        "make_private": lambda: _make_private(clipping="bogus"),
        "DPTrainer": lambda: _dp_arguments(clipping="bogus"),
        "recipe": lambda: _recipe(privacy__clipping__style="bogus")},
    "task.user_clipping:unknown": {
        "make_private": lambda: _make_private(user_clipping="bogus"),
        "DPTrainer": lambda: _dp_arguments(user_clipping="bogus"),
        "recipe": lambda: _recipe(task__user_clipping="bogus")},
    "task.max_rows_per_user:range": {
        "make_private": lambda: _make_private(max_rows_per_user=0),
        "DPTrainer": lambda: _dp_arguments(max_rows_per_user=0),
        "recipe": lambda: _recipe(task__max_rows_per_user=0)},
    "batch.max_physical_batch_size:range": {
        "make_private": lambda: _make_private(max_physical_batch_size=0),
        "DPTrainer": lambda: _dp_arguments(max_physical_batch_size=0),
        "recipe": lambda: _recipe(batch__max_physical_batch_size=0)},
    "model.name:batchnorm": {
        "make_private": lambda: _make_private(module=nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))),
        "DPTrainer": _dptrainer_batchnorm},
}


def test_every_refusal_has_a_case_for_each_way_in():
    assert set(CASES) == set(REFUSALS)
    for key, r in REFUSALS.items():
        assert set(CASES[key]) == set(r.ways), key
        assert set(r.ways) <= set(WAYS)


@pytest.mark.parametrize("key,way", [(k, w) for k, ways in CASES.items() for w in ways])
def test_each_way_in_refuses_with_the_same_sentence(key, way):
    r = REFUSALS[key]
    expected = RecipeError if way == "recipe" else r.errors.get(way, ValueError)
    with pytest.raises(expected) as e:
        CASES[key][way]()
    msg = str(e.value)
    for part in r.fragments():  # the one template's fixed text, in every way in
        assert part in msg, (part, msg)
    if way == "make_private":
        assert msg.startswith("make_private: ") or "make_private: " in msg
    if way == "DPTrainer":
        assert "DPTrainer: " in msg
    # the setting named as this way in spells it, and as the other ways do (recipe key / keyword)
    s = SETTINGS[r.setting]
    assert s.own(way) is None or s.own(way) in msg
    if way != "recipe" and s.recipe:
        assert f"recipe key {s.recipe}" in msg
    if way == "recipe":
        assert f"keyword {s.make_private}" in msg


def test_a_way_in_not_registered_for_a_refusal_is_a_stray_call():
    with pytest.raises(KeyError, match="not registered"):
        refuse("privacy.delta:missing", "DPTrainer")
    with pytest.raises(KeyError):
        refuse("no.such:rule", "make_private")


def test_no_dead_entries_every_refusal_is_raised_in_src():
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "refusals.py")
    for key, r in REFUSALS.items():
        for way in r.ways:
            assert re.search(rf'\w*refuse\w*\(\s*"{re.escape(key)}",\s*"{way}"', text), (key, way)
