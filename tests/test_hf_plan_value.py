"""Issue 46 item 2: every way in writes the same privacy plan value (outputs/report.py ``plan_section``):
``dpft train``'s report.json ``dp.plan``, DPTrainer's ``dp_state.json`` and card report ``dp.plan``."""

from __future__ import annotations

import json

import pytest

from conftest import files_recipe

from dpft.step.mechanisms import RECIPE_NAMES
from dpft.step.plan import CalibratedPlan

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding, \
    TrainingArguments  # noqa: E402

from dpft.integrations.hf.card import trainer_report  # noqa: E402
from dpft.integrations.hf.trainer import DPArguments, DPTrainer  # noqa: E402
from dpft.outputs.report import plan_section  # noqa: E402
from dpft.run.loop import Trainer  # noqa: E402

B, STEPS, EPS, DELTA = 8, 3, 4.0, 1e-3
#: (recipe keys, DPArguments keywords) of each mechanism, the same settings
MECHS = {"gaussian": ({}, {}),
         "truncated": ({"batch.max_batch_size": 11}, {"max_batch_size": 11}),
         "banded_mf": ({"privacy.mechanism": "banded_mf", "privacy.bands": 2}, {"mechanism": "banded_mf", "bands": 2})}


@pytest.mark.parametrize("mech", list(MECHS))
def test_dp_trainer_writes_the_plan_value_dpft_train_writes(mech, tiny_model_dir, sst_like_files, tmp_path):
    recipe_keys, kwargs = MECHS[mech]
    rec = files_recipe(tiny_model_dir, sst_like_files, **{
        "batch.expected_batch_size": B, "schedule.steps": STEPS, "privacy.target_epsilon": EPS,
        "privacy.delta": DELTA, **recipe_keys})
    run = Trainer(rec, tmp_path / "run", progress=False)
    cli = plan_section(run.plan.privacy)["plan"]  # what write_report puts under report.json's dp.plan
    if mech == "gaussian":  # one cell writes it (the others' runs would add only time)
        rep = run.run()
        assert json.loads((tmp_path / "run" / "report.json").read_text())["dp"]["plan"] == rep["dp"]["plan"] == cli
    assert cli["n"] == run.n and cli["steps"] == STEPS

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = datasets.Dataset.from_csv(str(sst_like_files["csv"]))
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=16), batched=True).select(range(cli["n"]))
    model = BertForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no")
    dp = DPArguments(target_epsilon=EPS, target_delta=DELTA, max_grad_norm=1.0, expected_batch_size=B, **kwargs)
    tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorWithPadding(tok), dp_args=dp)
    tr.save_model(str(tmp_path / "hf"))
    state = json.loads((tmp_path / "hf" / "dp_state.json").read_text())
    hf = state["plan"]
    assert hf == trainer_report(tr)["dp"]["plan"] == tr.plan.calibrated.to_dict()
    # the same value, every field: dpft train hands the session its unit's sampler (run/unit.py: the mechanism's,
    # at example level), DPTrainer's session builds the mechanism's; one rule (step/mechanisms.py Mechanism.owns)
    # records neither's rates (q, p None: B/N, b·B/N); each way in's spelling of refusals is wording, not value
    assert hf == cli and hf["q"] is None and hf["partition_rate"] is None and "names" not in hf
    assert run.plan.privacy.calibrated == tr.plan.calibrated
    assert run.plan.privacy.calibrated.settings.names == tuple(RECIPE_NAMES.items())
    assert tr.plan.calibrated.settings.names == ()  # keywords (KWARG_NAMES)
    assert hf["sigma"] == state["sigma"] == tr.sigma and hf["mechanism"] == mech.replace("truncated", "gaussian")
    # the value round-trips and rebuilds the σ every way in calibrated
    back = CalibratedPlan.from_dict(json.loads(json.dumps(hf)))
    assert back.to_dict() == hf and back.settings.calibrate() == back
