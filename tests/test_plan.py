"""Issue 34: one privacy plan for every way in (step/plan.py), the mechanisms as one family
(step/mechanisms.py), and the one state/resume path: the review's two reproductions — (1) the
same rows back in another order under banded MF, (2) a make_private noise state older than its
last release — refused in every way in."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import files_recipe, tiny_classifier
from dpft import PrivacyEngine
from dpft.errors import PlanError, TrainingError
from dpft.step.fingerprint import RowsMismatch, check_rows, rows_fingerprint
from dpft.step.mechanisms import BandedMF, Mechanism, TruncatedPoisson, mechanism_of
from dpft.step.plan import PrivacyPlan, planned_steps

N, B, BANDS, STEPS, SEED = 48, 4, 3, 6, 11


# ----------------------------------------------------------------------------- the plan's parts
def test_one_steps_rule_and_mechanism_family():
    assert planned_steps(30, 8, epochs=2) == 8 == planned_steps(30, 8, steps=8)  # ⌈60/8⌉ in every way in
    assert planned_steps(100, 10, epochs=1) == 10 and planned_steps(5, 10, epochs=0.1) == 1
    assert type(mechanism_of()) is Mechanism and isinstance(mechanism_of(max_batch_size=5), TruncatedPoisson)
    assert mechanism_of("banded_mf").bands == 4 and mechanism_of("banded_mf", 1).bands == 1
    with pytest.raises(PlanError, match="no dp-accounting event; drop max_batch_size"):
        mechanism_of("banded_mf", 2, 5)
    assert isinstance(PlanError("x"), ValueError) and isinstance(PlanError("x"), TrainingError)
    # each refusal says which part of the maths forbids it
    why = BandedMF(2).refusals(user_level=True, methods=["rmt"])
    assert len(why) == 2 and "b-min-separation is per example" in why[0] and "their own steps" in why[1]
    assert Mechanism().refusals(user_level=True, methods=["rmt"]) == []
    with pytest.raises(PlanError, match=r"p = b·B/N = 2 > 1; lower bands"):
        BandedMF(4).sampler(10, 5, None)
    assert dataclasses.is_dataclass(PrivacyPlan) and PrivacyPlan.__dataclass_params__.frozen


def test_rows_fingerprint_is_keyed_by_content_and_order():
    rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": 1}, {"input_ids": [4, 5], "labels": 0}]
    fp = rows_fingerprint(rows)
    same = [{"input_ids": [1, 2, 3], "labels": 1}, {"input_ids": torch.tensor([4, 5]), "labels": 0}]
    check_rows(fp, same, "x", "fix")  # a tensor and a list of the same numbers are the same row
    with pytest.raises(RowsMismatch, match="same 2 training rows in another order"):
        check_rows(fp, rows[::-1], "x", "fix")
    with pytest.raises(RowsMismatch, match="differ"):
        check_rows(fp, [rows[0], {"input_ids": [4, 6], "labels": 0}], "x", "fix")
    with pytest.raises(RowsMismatch, match="no fingerprint"):
        check_rows(None, rows, "x", "fix")
    other = rows_fingerprint(rows)  # a fresh 128-bit salt: another digest for the same rows
    assert other["salt"] != fp["salt"] and other["ordered"] != fp["ordered"] and len(bytes.fromhex(fp["salt"])) == 16


# ----------------------------------------------------------------------------- make_private
def _data(order=None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
    if order is not None:
        x, y = x[order], y[order]
    return TensorDataset(x, y)


def _mp(data, upto, save=None, load=None, sigma=0.9):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    eng = PrivacyEngine(reproducible_seed=SEED)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        dataset=data, expected_batch_size=B, max_grad_norm=0.5, steps=STEPS, noise_multiplier=sigma,
        mechanism="banded_mf", bands=BANDS)
    if load is not None:
        eng.load_noise_state(load)
    while opt.logical_steps < upto:
        for x, y in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            if save is not None and opt.logical_steps == save[0]:
                eng.save_noise_state(save[1])
            if opt.logical_steps >= upto:
                break
    return eng, opt


def test_make_private_refuses_reordered_or_other_rows(tmp_path):
    path = tmp_path / "noise.secret.pt"
    _mp(_data(), 3, save=(3, path))
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=f"same {N} training rows in another order"):
        _mp(_data(perm), STEPS, load=path)
    other = _data()
    other.tensors[0][0, 0] += 1.0
    with pytest.raises(ValueError, match="training rows differ"):
        _mp(other, STEPS, load=path)
    eng, opt = _mp(_data(), STEPS, load=path)  # the same rows in the same order resume
    assert opt.logical_steps == STEPS and eng.ledger.steps == STEPS


def test_make_private_refuses_a_state_older_than_its_last_release(tmp_path):
    """The review's reproduction: save at step 2, release 2 more, crash; a fresh engine loading the
    step-2 state would replay steps 2-3 under fresh noise with a 2-step ledger. Refused; the live
    record holds all 4 releases."""
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.api.state import live_record_path

    path = tmp_path / "noise.secret.pt"
    eng, _ = _mp(_data(), 4, save=(2, path))
    assert eng.ledger.steps == 4 and PrivacyLedger.load(live_record_path(path)).steps == 4
    with pytest.raises(ValueError, match=r"2 release\(s\) were made after this state was saved"):
        _mp(_data(), STEPS, load=path)
    live_record_path(path).unlink()
    with pytest.raises(ValueError, match="live record of the releases"):
        _mp(_data(), STEPS, load=path)


def test_make_private_appends_the_saved_ledger_never_swaps(tmp_path):
    path = tmp_path / "noise.secret.pt"
    _mp(_data(), 3, save=(3, path))
    eng, opt = _mp(_data(), STEPS, load=path)
    assert [e.phase for e in eng.ledger.entries] and eng.ledger.steps == STEPS  # 3 saved + 3 new
    # the resumed loop kept the live record: the step-3 state is now stale and refused
    with pytest.raises(ValueError, match="were made after this state was saved"):
        _mp(_data(), STEPS, load=path)
    # an engine whose ledger holds other releases than the state starts with is refused
    path = tmp_path / "again.secret.pt"
    _mp(_data(), 3, save=(3, path))
    torch.manual_seed(0)
    eng2 = PrivacyEngine(reproducible_seed=SEED)
    import dp_accounting as dpa

    eng2.ledger.record("earlier", dpa.GaussianDpEvent(1.0))
    model = nn.Linear(4, 3)
    eng2.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      criterion=nn.CrossEntropyLoss(), dataset=_data(), expected_batch_size=B, max_grad_norm=0.5,
                      steps=STEPS, noise_multiplier=0.9, mechanism="banded_mf", bands=BANDS)
    with pytest.raises(ValueError, match="does not start with"):
        eng2.load_noise_state(path)


# ----------------------------------------------------------------------------- DPTrainer
def test_dptrainer_refuses_reordered_rows_on_banded_resume(tmp_path):
    import datasets
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (40, 6), generator=g)
    rows = {"input_ids": ids.tolist(), "attention_mask": torch.ones(40, 6, dtype=torch.long).tolist(),
            "labels": torch.randint(0, 2, (40,), generator=g).tolist()}
    ds = datasets.Dataset.from_dict(rows)

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 2

    def trainer(data, callbacks=None):
        args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1e-2, per_device_train_batch_size=8,
                                 report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=3,
                                 save_strategy="steps", save_steps=2)
        dp = DPArguments(noise_multiplier=0.8, target_delta=1e-3, expected_batch_size=8, mechanism="banded_mf",
                         bands=2, reproducible_seed=SEED)
        return DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=data,
                         data_collator=default_data_collator, dp_args=dp, callbacks=callbacks)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(ds, [StopAt()]).train()
        with pytest.raises(ValueError, match="same 40 training rows in another order"):
            trainer(ds.shuffle(seed=3)).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        t = trainer(ds)
        t.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert t.state.global_step == 3


# ----------------------------------------------------------------------------- dpft train
def test_cli_refuses_reordered_rows_on_banded_resume(tiny_model_dir, sst_like_files, tmp_path):
    import pandas as pd

    from dpft.run.loop import Trainer

    kw = {"privacy.mechanism": "banded_mf", "privacy.bands": 3, "privacy.noise_multiplier": 1.0,
          "schedule.steps": 6, "checkpoint_every": 3, "eval.every_steps": 6, "batch.expected_batch_size": 6,
          "task.dev_file": str(sst_like_files["csv"])}
    r = files_recipe(tiny_model_dir, sst_like_files, **kw)
    part = Trainer(r, tmp_path / "part", progress=False)
    part._t_run = time.time()
    (tmp_path / "part").mkdir()
    for t in range(3):
        part.step(t)
    part.save(3)
    df = pd.read_csv(sst_like_files["csv"])
    df.iloc[::-1].to_csv(sst_like_files["csv"], index=False)  # the same rows, re-exported in another order
    with pytest.raises(TrainingError, match="another order"):
        Trainer(r, tmp_path / "part", resume=True, progress=False).run()
    df.to_csv(sst_like_files["csv"], index=False)
    res = Trainer(r, tmp_path / "part", resume=True, progress=False)
    res.run()
    assert res.ledger.steps == 6


def test_audit_catches_the_planted_resume_bugs():
    from dpft.audit import checks_resume as cr
    from dpft.audit.planted import ALL

    assert all(c.passed for c in cr.resume_checks(None)), [c for c in cr.resume_checks(None) if not c.passed]
    assert set(cr.PLANTED) <= set(ALL)
    for bug in cr.PLANTED:
        with cr.planted_bug(bug):
            checks = cr.resume_checks(bug)
        assert any(not c.passed for c in checks), bug


def test_bug_planter_patches_for_the_duration_and_refuses_unknown_or_unplantable_bugs():
    import types

    from dpft.audit.planted import bug_planter

    target = types.SimpleNamespace(f=1)
    planted_bug = bug_planter(("a",), {"a": lambda p: p.set(target, "f", 2)})
    with planted_bug("a"):
        assert target.f == 2
    assert target.f == 1
    with planted_bug(None):
        assert target.f == 1
    with pytest.raises(ValueError, match="unknown planted bug 'b'"):
        with planted_bug("b"):
            pass
    with pytest.raises(ValueError, match="no plant for"):  # a listed bug nothing plants: a vacuous self-test
        bug_planter(("a", "b"), {"a": lambda p: None})


# ----------------------------------------------------------------------------- methods
def test_rmt_through_make_private_and_dptrainer_and_refusals():
    """RMT (post-processing) through make_private(methods=…) is the CLI's transform on the same
    noisy gradient; a method that needs the driver refuses with the reason."""
    from dpft.step.postprocess import rmt_transform

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
            return super().step(closure)

    def run(methods):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 3, (64,), generator=g))
        eng = PrivacyEngine(reproducible_seed=SEED)
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=Capture(model.parameters(), lr=0.0), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=16, max_grad_norm=1.0, steps=1, noise_multiplier=0.3,
            methods=methods)
        for x, y in loader:
            crit(module(x), y).backward()
            if opt.step():
                break
        return model, opt

    m0, opt0 = run(None)
    m1, opt1 = run([{"name": "rmt", "method": "rmt", "min_dim": 2}])
    assert len(opt1.dp_step.spec.transforms) == len(opt0.dp_step.spec.transforms) + 1
    names = [n for n, _ in m0.named_parameters()]
    noisy = dict(zip(names, opt0.original_optimizer.seen))
    ctx = {"noise_std": 0.3 * 1.0 / 16, "step": 0, "q": 16 / 64}
    want = rmt_transform(m0, list(noisy), type("C", (), {"kappa": 1.05, "rank": None, "min_dim": 2})())(noisy, ctx)
    for n, g in zip(names, opt1.original_optimizer.seen):
        assert torch.allclose(g, want[n], atol=1e-6), n
    assert any(not torch.allclose(want[n], noisy[n]) for n in noisy)  # RMT shrank something
    with pytest.raises(ValueError, match="method 'ewft' cannot run here: it needs dpft train's driver"):
        run([{"name": "ewft", "enabled": True}])
    with pytest.raises(ValueError, match="method 'dp_adam_ac' cannot run here: bias_correction"):
        run([{"name": "dp_adam_ac", "adaptive_clip": True, "bias_correction": True}])
    with pytest.raises(ValueError, match="switched off by its own config"):
        run([{"name": "rmt"}])
    with pytest.raises(ValueError, match="NOT CERTIFIED"):
        run([{"name": "rmt", "method": "rmt", "diagnostics": True}])
    from dpft.integrations.hf.trainer import DPArguments

    with pytest.raises(ValueError, match="build their own steps"):
        DPArguments(target_epsilon=1.0, target_delta=1e-3, expected_batch_size=4, mechanism="banded_mf",
                    methods=[{"name": "rmt", "method": "rmt"}])
    assert DPArguments(target_epsilon=1.0, target_delta=1e-3, expected_batch_size=4,
                       methods=[{"name": "rmt", "method": "rmt"}]).methods


# ----------------------------------------------------------------------------- model cards (issue 36 item 4)
def test_dptrainer_lora_card_states_the_guarantee(tmp_path):
    """DPTrainer + LoRA: the adapter folder's README is dpft's card (ε, δ, unit and N, mechanism),
    not PEFT's template, and create_model_card (what push_to_hub calls) writes the same; no
    absolute local path in it."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (32, 6), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(32, 6).long().tolist(),
                                     "labels": torch.randint(0, 2, (32,), generator=g).tolist()})
    base = tiny_classifier("bert")
    base.config._name_or_path = str(tmp_path / "my-local-base")  # a local folder: named by its last part only
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"]))
    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=2, save_strategy="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                       dp_args=DPArguments(target_epsilon=3.0, target_delta=1e-3, expected_batch_size=8))
        tr.train()
        tr.save_model()
    card = (out / "README.md").read_text()
    assert (out / "adapter_config.json").is_file()
    assert "differential privacy" in card and f"ε = {tr.get_epsilon():.4g} at δ = 0.001" in card
    assert "N = 32" in card and "Poisson-subsampled Gaussian" in card and "What the ε covers" in card
    assert "dp_epsilon:" in card and str(tmp_path) not in card and "my-local-base" in card
    (out / "README.md").unlink()
    tr.create_model_card()
    assert "dp_epsilon:" in (out / "README.md").read_text()


def test_make_private_steps_the_lr_scheduler_at_every_release_empty_batches_included():
    """Issue 36 item 6: with q = 1/30 many logical batches are empty; each still releases noise and
    must advance the schedule (the README's `if optimizer.step(): scheduler.step()` left 110 of 300
    releases at a stale rate)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(60, 4, generator=g), torch.randint(0, 2, (60,), generator=g))
    eng = PrivacyEngine(reproducible_seed=SEED)
    module, dp_opt, crit, loader = eng.make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=2,
        max_grad_norm=1.0, steps=40, noise_multiplier=1.0, lr_scheduler=sched)
    stepped = 0
    while dp_opt.logical_steps < 40:
        for x, y in loader:
            crit(module(x), y).backward()
            stepped += bool(dp_opt.step())
            dp_opt.zero_grad()
    assert eng.ledger.steps == 40 == sched.last_epoch and stepped < 40  # empty batches never reached the loop
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 41)
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=1.0), lambda t: 1.0)
    with pytest.raises(ValueError, match="made over the optimizer you pass"):
        PrivacyEngine().make_private(module=nn.Linear(4, 2), optimizer=torch.optim.SGD(nn.Linear(4, 2).parameters(),
                                     lr=1.0), dataset=data, expected_batch_size=2, max_grad_norm=1.0, steps=4,
                                     noise_multiplier=1.0, lr_scheduler=other)


# ----------------------------------------------------------------------------- DPTrainer: lock and ε cap (issue 36)
def _hf_rows(n=40):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (n, 6), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, 6).long().tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def _hf_trainer(out, max_steps, callbacks=None, save_steps=None, **dp):
    from transformers import TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    args = TrainingArguments(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=max_steps,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    return DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=_hf_rows(),
                     data_collator=default_data_collator, callbacks=callbacks,
                     dp_args=DPArguments(target_epsilon=2.0, target_delta=1e-3, expected_batch_size=8, **dp))


def test_dptrainer_resume_after_a_crash_ends_within_the_target(tmp_path, capsys):
    """A run planned for 6 steps checkpoints at 4 and dies after releasing step 5 (the live ledger
    holds 5); its resume counts that release and stops at step 5, ending at ε ≤ 2 — said before
    the first step. allow_overspend keeps the old behaviour (7 releases, ε > 2)."""
    from transformers import TrainerCallback

    from dpft.accounting.ledger import PrivacyLedger

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 5

    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_trainer(out, 6, [Crash()], save_steps=4).train()
        assert PrivacyLedger.load(out / "ledger.json").steps == 5
        import shutil

        shutil.copytree(out, tmp_path / "copy")
        tr = _hf_trainer(out, 6, save_steps=4)
        tr.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        assert "stops at step 5 of the 6 planned (1 early)" in capsys.readouterr().err
        assert tr.state.global_step == 5 and tr.ledger.steps == 6 and tr.get_epsilon() <= 2.0 + 1e-9
        over = _hf_trainer(tmp_path / "copy", 6, save_steps=4, allow_overspend=True)
        over.train(resume_from_checkpoint=str(tmp_path / "copy" / "checkpoint-4"))
    assert over.ledger.steps == 7 and over.get_epsilon() > 2.0


def test_dptrainer_output_dir_is_owned_by_one_process(tmp_path):
    from dpft.errors import TrainingError
    from dpft.outputs.lock import RunLock

    out = tmp_path / "out"
    held = RunLock.for_dir(out).acquire()  # another run (here: another open file description) holds it
    try:
        with warnings.catch_warnings(), pytest.raises(TrainingError, match="is in use by pid"):
            warnings.simplefilter("ignore")
            _hf_trainer(out, 2).train()
    finally:
        held.release()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _hf_trainer(out, 2).train().global_step == 2


def test_make_private_state_path_is_owned_by_one_process(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "noise.secret.pt"
    _mp(_data(), 3, save=(3, path))  # this process now owns the state path
    code = ("import sys; sys.path.insert(0, 'tests'); import test_plan as t; from pathlib import Path; "
            f"t._mp(t._data(), 6, load=Path({str(path)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "is in use by pid" in out.stderr, out.stderr[-2000:]
    eng, opt = _mp(_data(), STEPS, load=path)  # a second engine of the same process shares it
    assert opt.logical_steps == STEPS


@pytest.mark.parametrize("when", [0, 2])
def test_make_private_names_a_parameter_frozen_after_it(when):
    """Issue 36 item 6: freezing a parameter after make_private crashed in torch's hook code naming
    no fix (before the first step), or kept training it (later); now both name it and the fix."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    eng = PrivacyEngine(reproducible_seed=SEED)
    m, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        dataset=_data(), expected_batch_size=8, max_grad_norm=1.0, steps=6, noise_multiplier=1.0,
        max_physical_batch_size=4)
    with pytest.raises(ValueError, match=r"frozen after make_private \(0.weight\).*Set requires_grad before"):
        while True:
            for x, y in loader:
                if opt.logical_steps == when:
                    model[0].weight.requires_grad_(False)
                crit(m(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert eng.ledger.steps == when  # nothing was released with the frozen parameter


def test_epochs_1_1_over_100_rows_at_b_10_is_11_steps_in_every_way_in(tiny_model_dir, tmp_path):
    """Issue 46 item 3: one ``planned_steps`` (⌈epochs · N / B − 1e-9⌉), counted by the private session for
    dpft train, make_private and DPTrainer (session/core.py ``PrivateSession.prepare``) and behind dpft tune and
    the auto choice: 1.1 · 100 / 10 is 11.000000000000002 in floating point, which the CLI's own ⌈·⌉ made 12
    steps while make_private and DPTrainer planned 11 — the same settings calibrating σ for different T."""
    import pandas as pd
    import transformers

    from dpft.config.recipe import load_recipe
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer
    from dpft.run.loop import Trainer
    from dpft.run.tune import _steps_and_q

    assert 1.1 * 100 / 10 > 11 and planned_steps(100, 10, epochs=1.1) == 11
    r = load_recipe(None, {"schedule.epochs": 1.1, "schedule.steps": None, "batch.expected_batch_size": 10})
    assert _steps_and_q(r, {}, 100)[1] == 11  # dpft tune's trials
    target = dict(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=10)
    # dpft train over 100 rows
    words = ["good", "bad", "great", "awful"]
    pd.DataFrame([{"text": f"a {words[i % 4]} film {i}", "label": i % 2} for i in range(100)]).to_csv(
        tmp_path / "rows.csv", index=False)
    files = {"csv": tmp_path / "rows.csv"}
    r = files_recipe(tiny_model_dir, files, **{"schedule.epochs": 1.1, "schedule.steps": None,
                                               "batch.expected_batch_size": 10, "task.dev_file": str(files["csv"]),
                                               "privacy.target_epsilon": 3.0})
    t = Trainer(r, tmp_path / "run", progress=False)
    assert (t.n, t.total_steps, t.plan.session.planned, t.plan.privacy.steps) == (100, 11, 11, 11)
    # make_private over 100 rows
    model = nn.Sequential(nn.Linear(6, 3))
    eng = PrivacyEngine(reproducible_seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, opt, _, _ = eng.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        criterion=nn.CrossEntropyLoss(), epochs=1.1, **target,
                                        dataset=TensorDataset(torch.randn(100, 6), torch.randint(0, 3, (100,))))
    assert opt.planned_steps == 11
    # DPTrainer over 100 rows
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=2)
    rows = [{"input_ids": [1 + i % 60] * 8, "attention_mask": [1] * 8, "labels": i % 2} for i in range(100)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), num_train_epochs=1.1, report_to=[],
                                          use_cpu=True, per_device_train_batch_size=10)
    with pytest.warns(UserWarning, match="reproducible_seed"):
        tr = DPTrainer(model=transformers.BertForSequenceClassification(cfg), args=args, train_dataset=rows,
                       dp_args=DPArguments(reproducible_seed=SEED, **target))
    assert (tr.n, tr.total_steps) == (100, 11)
    # one plan: the same σ for the same settings (the one count, the one calibration)
    assert t.sigma == tr.sigma == opt.dp_step.spec.mechanism.sigma
