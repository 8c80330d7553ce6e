"""One refusal registry for every way in (issue 46 item 3; src/dpft/config/refusals.py): each shared rule is
refused by make_private, by DPTrainer's arguments and by a recipe with the same sentence, naming the recipe
key and the keyword; every registered refusal is raised somewhere in src (no dead entries)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import datasets
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import TrainingArguments, default_data_collator

from conftest import tiny_classifier

import dpft.methods  # noqa: F401  (hands the recipe schema the method registry)
from dpft.api import PrivacyEngine
from dpft.api.arguments import PerformanceArguments, PrivacyArguments, check_arguments
from dpft.config import RecipeError, load_recipe
from dpft.config.refusals import REFUSALS, SETTINGS, WAYS, refuse
from dpft.errors import PlanError, TrainingError
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine
from dpft.integrations.hf import DPArguments, DPTrainer
from dpft.integrations.hf.checks import check_trainer, check_training_arguments
from dpft.run.loop import Trainer

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


# --- user-level group clipping on an engine without groups: every way in reaches the session's one check.
# No engine of dpft lacks groups today (a method's build hook could swap one in), so the engines say they lack them.
def _no_groups(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(BookKeepingEngine, "supports_groups", False)
    mp.setattr(ReferenceEngine, "supports_groups", False)


def _group_make_private():
    with pytest.MonkeyPatch.context() as mp:
        _no_groups(mp)
        torch.manual_seed(0)
        module = nn.Linear(4, 2)
        ds = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
        PrivacyEngine(reproducible_seed=0).make_private(
            module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            dataset=ds, expected_batch_size=2, steps=2, noise_multiplier=1.0, max_grad_norm=1.0,
            user_ids=[i % 4 for i in range(12)], max_rows_per_user=3, user_clipping="group")


def _group_dptrainer(request):
    g = torch.Generator().manual_seed(0)
    rows = datasets.Dataset.from_dict({"input_ids": torch.randint(3, 64, (12, 8), generator=g).tolist(),
                                       "attention_mask": [[1] * 8] * 12, "labels": [i % 2 for i in range(12)],
                                       "who": [f"u{i % 4}" for i in range(12)]})
    args = TrainingArguments(output_dir=str(request.getfixturevalue("tmp_path") / "hf"), max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, per_device_train_batch_size=4)
    with pytest.MonkeyPatch.context() as mp:
        _no_groups(mp)
        DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=rows,
                  data_collator=default_data_collator,
                  dp_args=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=2,
                                      user_column="who", max_rows_per_user=3, user_clipping="group"))


def _group_dpft_train(request):
    tmp = request.getfixturevalue("tmp_path")
    words = ["good", "bad", "great", "awful"]
    pd.DataFrame([{"text": f"a {words[i % 4]} film {i}", "label": i % 2, "person": f"u{i % 6}"}
                  for i in range(24)]).to_csv(tmp / "u.csv", index=False)
    pd.DataFrame([{"text": f"a {words[i % 4]} film", "label": i % 2} for i in range(4)]).to_csv(tmp / "dev.csv",
                                                                                                index=False)
    rec = load_recipe(None, {
        "model.name": str(request.getfixturevalue("tiny_model_dir")), "model.max_length": 16, "task.name": "files",
        "task.train_file": str(tmp / "u.csv"), "task.dev_file": str(tmp / "dev.csv"), "task.user_column": "person",
        "task.max_rows_per_user": 2, "task.user_clipping": "group", "batch.expected_batch_size": 3,
        "schedule.steps": 2, "privacy.noise_multiplier": 1.0, "privacy.target_epsilon": None,
        "privacy.delta": 1e-3, "perf.device": "cpu"})
    with pytest.MonkeyPatch.context() as mp:
        _no_groups(mp)
        Trainer(rec, tmp / "r", progress=False)


def _dpo_pair_groups(request):
    pytest.importorskip("trl")
    from test_trl import dp, dpo_args, preference_rows, tiny_llama, tiny_tokenizer

    from dpft.integrations.trl.trainer import DPDPOTrainer

    with pytest.MonkeyPatch.context() as mp:
        _no_groups(mp)
        DPDPOTrainer(model=tiny_llama(40), args=dpo_args(request.getfixturevalue("tmp_path") / "dpo"),
                     train_dataset=preference_rows(), processing_class=tiny_tokenizer(), dp_args=dp())


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
    "task.user_clipping:group_engine": {
        "make_private": _group_make_private, "DPTrainer": _group_dptrainer, "recipe": _group_dpft_train},
    "privacy.engine:pair_groups": {"DPTrainer": _dpo_pair_groups},
}


def _call(case, request):
    """A case takes the test's ``request`` (fixtures: tmp_path, tiny_model_dir) when it has a parameter."""
    return case(request) if inspect.signature(case).parameters else case()


def test_every_refusal_has_a_case_for_each_way_in():
    assert set(CASES) == set(REFUSALS)
    for key, r in REFUSALS.items():
        assert set(CASES[key]) == set(r.ways), key
        assert set(r.ways) <= set(WAYS)


@pytest.mark.parametrize("key,way", [(k, w) for k, ways in CASES.items() for w in ways])
def test_each_way_in_refuses_with_the_same_sentence(key, way, request):
    r = REFUSALS[key]
    expected = r.errors.get(way, RecipeError if way == "recipe" else ValueError)
    with pytest.raises(expected) as e:
        _call(CASES[key][way], request)
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
    """Each (refusal, way in) is raised by name in src, or by the private session for its way in
    (``self.way``, session/core.py: the one check every way in reaches)."""
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "refusals.py")
    session = (SRC / "session" / "core.py").read_text()
    for key, r in REFUSALS.items():
        in_session = re.search(rf'\brefuse\(\s*"{re.escape(key)}",\s*self\.way\b', session)
        for way in r.ways:
            assert in_session or re.search(rf'\w*refuse\w*\(\s*"{re.escape(key)}",\s*"{way}"', text), (key, way)


@pytest.mark.parametrize("way", ["make_private", "DPTrainer", "recipe"])
def test_group_clipping_on_a_non_group_engine_is_the_sessions_one_refusal(way, request):
    """Issue 46 item 3: user-level group clipping on an engine that cannot clip groups is refused once, by
    the private session on the plan's engine, with the registry's words for each way in (make_private,
    DPTrainer, dpft train): the message is exactly ``refuse(...)``'s, a PlanError (ValueError and
    TrainingError alike), raised from ``PrivateSession.check_groups`` and nowhere else."""
    with pytest.raises(PlanError) as e:
        _call(CASES["task.user_clipping:group_engine"][way], request)
    want = refuse("task.user_clipping:group_engine", way, got="BookKeepingEngine")
    assert str(e.value) == str(want) and isinstance(e.value, (ValueError, TrainingError))
    assert e.traceback[-1].name == "check_groups" and e.traceback[-1].path.name == "core.py"
    assert "recipe key task.user_clipping" in str(e.value) or way == "recipe"
    assert "recipe key privacy.engine" in str(e.value) or way == "recipe"
