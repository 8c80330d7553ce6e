"""Issue 44 item 2: every Trainer path releases through the DP step or is refused.

* a ``Trainer`` subclass with its own training loop is refused by ``privatize_trainer`` and by
  ``DPTrainer`` (its subclasses, the TRL trainers) before anything loads;
* the release guard (step/guard.py) on the real optimizer: an update without a pending DP release
  raises before the weights move (make_private: the raw optimizer the user kept; DPTrainer: a stock
  ``training_step`` patched on the instance), as does a gradient changed after the release;
* at the end of training, optimizer updates = the ledger's training releases, and with none the
  weights must not have moved (a loop that writes the parameters itself); the card is refused after.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments, default_data_collator

from dpft import PrivacyEngine
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.integrations.hf.checks import LOOP_METHODS, loop_overrides
from dpft.integrations.hf.privatize import privatize_trainer
from dpft.step.guard import ReleaseGuard, UpdateWithoutReleaseError, weights_digest


# --------------------------------------------------------------------------- refusals (no training)
class CustomLoop(Trainer):
    """The review's reproduction: its own loop, the stock training_step (the DP step never runs)."""

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        raise AssertionError("never reached")


class OwnTrain(Trainer):
    def train(self, *a, **k):
        raise AssertionError("never reached")


class OwnEpoch(Trainer):
    def _run_epoch(self, *a, **k):
        raise AssertionError("never reached")


@pytest.mark.parametrize("cls, meth", [(CustomLoop, "_inner_training_loop"), (OwnTrain, "train"),
                                       (OwnEpoch, "_run_epoch")])
def test_privatize_trainer_refuses_its_own_training_loop(cls, meth):
    with pytest.raises(ValueError, match=rf"privatize_trainer: {cls.__name__}\.{meth} overrides transformers' "
                                         r"training loop.*make_private"):
        privatize_trainer(cls)


def test_stock_and_trl_style_trainers_pass_the_loop_check():
    assert loop_overrides(DPTrainer) == [] and set(LOOP_METHODS) >= {"train", "_inner_training_loop"}
    assert loop_overrides(privatize_trainer(Seq2SeqTrainer)) == []
    trl = pytest.importorskip("trl")  # SFTTrainer's own training_step is shadowed by DPTrainer's
    del trl
    from dpft.integrations.trl.trainer import DPSFTTrainer

    assert loop_overrides(DPSFTTrainer) == []


def test_dptrainer_subclass_with_its_own_loop_is_refused_before_loading():
    class MyDP(DPTrainer):
        def _inner_training_loop(self, *a, **k):
            raise AssertionError("never reached")

    class MyStep(DPTrainer):  # a stock-style training_step in front of DPTrainer's
        def training_step(self, model, inputs, num_items_in_batch=None):
            return Trainer.training_step(self, model, inputs, num_items_in_batch)

    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=4, max_grad_norm=1.0)
    for cls, meth in ((MyDP, "_inner_training_loop"), (MyStep, "training_step")):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{meth} overrides transformers' training loop"):
            cls(model=None, args=None, train_dataset=None, dp_args=dp)  # refused before the model is touched


# --------------------------------------------------------------------------- the guard itself
def test_guard_unit():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    g = ReleaseGuard("unit", "fix it")
    g.attach(opt)
    g.attach(opt)  # idempotent: one hook
    p.grad = torch.ones(3)
    with pytest.raises(UpdateWithoutReleaseError, match=r"unit: optimizer.step\(\) \(update 1\) without a pending "
                                                         r"DP release.*fix it"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))  # nothing applied
    g.violation = None
    g.grant({"p": p})
    opt.step()
    assert g.updates == 1 and torch.equal(p.detach(), -torch.ones(3))
    g.grant({"p": p})
    p.grad.add_(1.0)  # a backward (or a hand-written gradient) after the release
    with pytest.raises(UpdateWithoutReleaseError, match=r"gradient of \['p'\] changed between the DP release"):
        opt.step()
    g.violation = None
    g.check_end(1)
    with pytest.raises(UpdateWithoutReleaseError, match="1 optimizer update\\(s\\) but 2 training release"):
        g.check_end(2)
    with pytest.raises(UpdateWithoutReleaseError, match="the model card refused"):
        g.check_clean()
    g.violation = None
    before = weights_digest([p])
    with torch.no_grad():
        p.add_(1.0)
    with pytest.raises(UpdateWithoutReleaseError, match="weights changed during training with no DP release"):
        g.check_end(0, 0, before, weights_digest([p]))
    g2 = ReleaseGuard("newer", "")
    g2.attach(opt)  # a newer loop over the same optimizer replaces the old guard's hook
    g2.grant({"p": p})
    opt.step()
    assert g2.updates == 1 and g.updates == 1
    g2.detach()
    opt.step()  # unguarded again


# --------------------------------------------------------------------------- make_private
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def _private_loop(steps=4, pre_hook=None):
    torch.manual_seed(0)
    model = Tiny()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    if pre_hook is not None:
        raw.register_step_pre_hook(pre_hook)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    eng = PrivacyEngine(reproducible_seed=0)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=raw, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=6),
        noise_multiplier=1.0, max_grad_norm=1.0, steps=steps, max_physical_batch_size=3)
    return eng, module, raw, opt, crit, loader


def test_make_private_loop_is_guarded_and_consistent(tmp_path):
    eng, module, raw, opt, crit, loader = _private_loop()
    for x, y in loader:  # empty Poisson batches are released (and applied) too
        opt.zero_grad()
        crit(module(x), y).backward()
        opt.step()
    assert eng.ledger.steps == 4 and opt.release_guard.updates == 4
    eng.check_releases()
    assert eng.save_ledger(tmp_path / "ledger.json")


def test_make_private_raw_optimizer_step_fires_the_guard(tmp_path):
    eng, module, raw, opt, crit, loader = _private_loop()
    x, y = next(iter(loader))
    before = [p.detach().clone() for p in module.parameters()]
    raw.zero_grad()
    crit(module(x), y).backward()  # a raw (unclipped, un-noised) gradient
    with pytest.raises(UpdateWithoutReleaseError, match=r"make_private: optimizer.step\(\) \(update 1\) without a "
                                                         r"pending DP release.*optimizer make_private returned"):
        raw.step()  # the optimizer the user passed in, stepped directly
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, module.parameters()))
    with pytest.raises(UpdateWithoutReleaseError, match="ledger refused"):
        eng.save_ledger(tmp_path / "ledger.json")
    assert not (tmp_path / "ledger.json").exists()


def test_make_private_update_of_a_tampered_release_is_refused():
    def tamper(optimizer, args, kwargs):  # runs before the guard's hook: a raw gradient added after the noise
        for grp in optimizer.param_groups:
            for p in grp["params"]:
                p.grad.add_(1.0)

    eng, module, raw, opt, crit, loader = _private_loop(pre_hook=tamper)
    with pytest.raises(UpdateWithoutReleaseError, match="changed between the DP release and optimizer.step"):
        for x, y in loader:
            opt.zero_grad()
            crit(module(x), y).backward()
            opt.step()
    assert eng.ledger.steps == 1 and opt.release_guard.updates == 0


# --------------------------------------------------------------------------- DPTrainer
def _rows(n=8):
    import datasets

    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({"input_ids": torch.randint(3, 64, (n, 8), generator=g).tolist(),
                                       "attention_mask": [[1] * 8] * n, "labels": [i % 2 for i in range(n)]})


def _trainer(out, cls=DPTrainer, steps=3):
    from dpft.audit.whitebox import tiny_classifier

    torch.manual_seed(0)
    model = tiny_classifier("bert", vocab=64, max_len=16)
    args = TrainingArguments(output_dir=out, max_steps=steps, learning_rate=0.1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", label_names=["labels"],
                             disable_tqdm=True, logging_strategy="no")
    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=4, max_grad_norm=1.0)
    return cls(model=model, args=args, train_dataset=_rows(), dp_args=dp, data_collator=default_data_collator)


def test_dptrainer_updates_equal_releases():
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(out)
        tr.train()
        assert tr.ledger.steps == 3 and tr.release_guard.updates == 3 and tr.release_guard.violation is None
        tr.save_model(out)  # the card is written


def test_dptrainer_stock_training_step_fires_the_guard_and_refuses_the_card():
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(out)
        rows = tr.train_dataset
        before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}

        def stock(model, inputs, num_items_in_batch=None):  # Trainer's backward of a raw batch
            loss = model(**default_data_collator([rows[i] for i in range(4)])).loss
            loss.backward()
            return loss.detach()

        tr.training_step = stock  # on the instance: no class check can see it
        with pytest.raises(UpdateWithoutReleaseError, match=r"DPTrainer: optimizer.step\(\) \(update 1\) without a "
                                                             r"pending DP release"):
            tr.train()
        assert all(torch.equal(before[k], p) for k, p in tr.model.named_parameters())
        assert tr.ledger.steps == 0
        with pytest.raises(UpdateWithoutReleaseError, match="save_model and its model card refused"):
            tr.save_model(out)


def test_dptrainer_loop_writing_the_weights_is_caught_at_the_end():
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(out)

        def own_loop(*a, **k):  # patched on the instance: writes the weights, no optimizer, no release
            from transformers.trainer_utils import TrainOutput

            with torch.no_grad():
                for p in tr.model.parameters():
                    p.add_(0.1)
            return TrainOutput(0, 0.0, {})

        tr._inner_training_loop = own_loop
        with pytest.raises(UpdateWithoutReleaseError, match="weights changed during training with no DP release"):
            tr.train()
        with pytest.raises(UpdateWithoutReleaseError, match="refused"):
            tr.create_model_card()


def test_guard_optimizer_subclass_calling_super_step_is_one_update():
    """torch re-runs the step pre-hooks in every hooked ``step`` of the class chain (SGD's is hooked
    once any SGD exists): a subclass's ``super().step()`` is the same update, not an unreleased one."""
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step hooked, whatever ran before

    class Sub(torch.optim.SGD):
        boom = tamper = False

        def step(self, closure=None):
            if self.tamper:
                self.param_groups[0]["params"][0].grad.add_(1.0)
            out = super().step(closure)
            if self.boom:
                raise RuntimeError("boom")
            return out

    p = nn.Parameter(torch.zeros(3))
    opt = Sub([p], lr=1.0)
    g = ReleaseGuard("unit", "fix it")
    g.attach(opt)
    for _ in range(2):
        p.grad = torch.ones(3)
        g.grant({"p": p})
        opt.step()
    assert g.updates == 2 and g.granted == 2 and torch.equal(p.detach(), -2 * torch.ones(3))
    with pytest.raises(UpdateWithoutReleaseError, match=r"\(update 3\) without a pending DP release"):
        opt.step()  # a separate step after the update: not nested
    g.violation = None
    opt.boom = True
    g.grant({"p": p})
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()  # an update that raised after applying: its frame is gone
    opt.boom = False
    with pytest.raises(UpdateWithoutReleaseError, match=r"\(update 4\) without a pending DP release"):
        opt.step()
    g.violation = None
    opt.tamper = True
    p.grad = torch.ones(3)
    g.grant({"p": p})
    before = p.detach().clone()
    with pytest.raises(UpdateWithoutReleaseError, match=r"gradient of \['p'\] changed.*inside the optimizer's step"):
        opt.step()
    assert torch.equal(p.detach(), before)  # nothing applied


def test_restoring_an_optimizer_state_is_not_an_update():
    """torch's ``set_optimizer_state_dict`` initialises an empty state by one step at lr 0 on zero gradients
    (``_init_optim_state``; the FSDP2 resume of DPTrainer does this): inside ``restoring_optimizer_state`` the
    guard lets it through uncounted; the same step outside is refused; a step that moves the weights inside
    the block is a violation."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from dpft.step.guard import restoring_optimizer_state

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    guard = ReleaseGuard("test", "fix")
    guard.attach(opt)
    with restoring_optimizer_state(opt):
        _init_optim_state(opt)
    assert guard.updates == 0 and guard.violation is None and len(opt.state) == 2
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.1)
    ReleaseGuard("test", "fix").attach(opt2)
    with pytest.raises(UpdateWithoutReleaseError, match="without a pending DP release"):
        _init_optim_state(opt2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(UpdateWithoutReleaseError, match="weights changed while the optimizer state"):
        with restoring_optimizer_state(opt):
            opt.step()  # a real update smuggled into a restore
    assert guard.violation is not None
