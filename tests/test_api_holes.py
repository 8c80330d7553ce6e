"""Issue 23 findings 2–4 (the Python ways in) and issue 24 item 3 (Python routes that learn).

make_private: one capture per micro-batch, optimizer parameters outside the engine refused
with a gradient, packed batches refused; head_body / per_group clipping, param-group learning
rates, fractional epochs, the constant-classifier warning. DPTrainer: the same holes, the head
learning rate and the evaluation warning. The audit checks of both routes catch each planted bug.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpft import PrivacyEngine
from dpft.api import (DoubleCaptureError, GroupClip, PackedBatchError, UnclippedParameterError,
                      check_unpacked_batch, prediction_summary)

C = 0.05


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def one_step(model, x, y, loop, *, optimizer=None, unfreeze=None, **kw):
    """One logical step, σ = 0, q = 1; returns (S = −Δθ·qN per parameter name, engine)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(reproducible_seed=0)
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=1.0)
    args = dict(noise_multiplier=0.0, max_grad_norm=C, steps=1)
    args.update(kw)
    module, opt, crit, dl = engine.make_private(module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(),
                                                data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
                                                **args)
    if unfreeze is not None:
        unfreeze.requires_grad_(True)
    for xb, yb in dl:
        opt.zero_grad()
        loop(module, crit, xb, yb)
        opt.step()
    return {n: -(p.detach() - before[n]) * len(x) for n, p in model.named_parameters()}, engine


def total_norm(s):
    return float(torch.cat([v.flatten() for v in s.values()]).norm())


def one_pass(m, crit, x, y):
    crit(m(x), y).backward()


X1, Y1 = torch.tensor([[3.0, -2.0, 1.0, 0.5]]), torch.tensor([1])


# ----------------------------------------------------------------------------- finding 2


def test_issue_numbers_one_pass_is_C_two_passes_refused():
    """N = 1, q = 1, σ = 0, C = 0.05: one pass moves by 0.050; two passes (two losses, an
    augmentation) were 0.100 with one ledger event — now refused before anything is released."""
    s, engine = one_step(net(), X1, Y1, one_pass)
    assert total_norm(s) == pytest.approx(C, rel=1e-4)
    assert engine.ledger.steps == 1

    def two_passes(m, crit, x, y):
        crit(m(x), y).backward()
        crit(m(x * 1.1), y).backward()  # an augmentation of the same example

    model = net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DoubleCaptureError, match="sum the losses and call backward once"):
        one_step(model, X1, Y1, two_passes)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_two_passes_after_a_step_of_the_same_micro_batch_refused():
    """forward/backward/step (accumulated), then forward/backward/step on the same micro-batch."""
    def loop(m, crit, x, y):
        pass

    engine = PrivacyEngine(reproducible_seed=0)
    model = net()
    x = torch.randn(4, 4)
    y = torch.tensor([0, 1, 0, 1])
    module, opt, crit, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                                criterion=nn.CrossEntropyLoss(),
                                                data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
                                                noise_multiplier=0.0, max_grad_norm=C, steps=1, max_physical_batch_size=2)
    with pytest.raises(DoubleCaptureError):
        for xb, yb in dl:
            crit(module(xb), yb).backward()
            opt.step()
            crit(module(xb), yb).backward()
            opt.step()


def test_retain_graph_twice_is_one_capture_and_a_logging_forward_is_allowed():
    def twice(m, crit, x, y):
        loss = crit(m(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        m(x)  # a forward without backward (e.g. logging) is not a second capture

    s, engine = one_step(net(), X1, Y1, twice)
    assert total_norm(s) <= C * (1 + 1e-4)
    assert engine.ledger.steps == 1


# ----------------------------------------------------------------------------- finding 3


def test_parameter_unfrozen_after_make_private_is_refused():
    model = net()
    model[0].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match="frozen parameter"):
        with pytest.raises(UnclippedParameterError, match="Call make_private after setting requires_grad"):
            one_step(model, X1, Y1, one_pass, unfreeze=model[0].weight)


def test_frozen_parameter_held_by_the_optimizer_is_harmless_while_frozen():
    model = net()
    model[0].weight.requires_grad_(False)
    w0 = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match="frozen parameter"):
        s, engine = one_step(model, X1, Y1, one_pass)
    assert torch.equal(model[0].weight, w0)
    assert total_norm(s) == pytest.approx(C, rel=1e-4)


# ----------------------------------------------------------------------------- finding 4


def test_check_unpacked_batch_cases():
    ids = torch.ones(2, 5, dtype=torch.long)
    check_unpacked_batch({"input_ids": ids, "attention_mask": ids}, 2, "t")
    check_unpacked_batch([torch.zeros(3, 4), torch.zeros(3)], 3, "t")
    left = {"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
            "position_ids": torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])}  # left padding: fine
    check_unpacked_batch(left, 2, "t")
    with pytest.raises(PackedBatchError, match="leading dimension 1 for 3"):
        check_unpacked_batch({"input_ids": torch.ones(1, 9)}, 3, "t")
    with pytest.raises(PackedBatchError, match="restart"):
        check_unpacked_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])}, 2, "t")
    with pytest.raises(PackedBatchError, match="cu_seq_lens_q"):
        check_unpacked_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 5])}, 2, "t")


def test_make_private_refuses_a_flattening_collate():
    x = torch.randn(6, 4)
    y = torch.randint(0, 2, (6,))

    def flatten(rows):  # every row of the micro-batch concatenated into one
        return torch.cat([r[0] for r in rows])[None], torch.stack([r[1] for r in rows])[:1]

    model = net()
    engine = PrivacyEngine(reproducible_seed=0)
    module, opt, crit, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                                criterion=nn.CrossEntropyLoss(), dataset=TensorDataset(x, y),
                                                expected_batch_size=6, collate_fn=flatten, noise_multiplier=0.0,
                                                max_grad_norm=C, steps=1)
    with pytest.raises(PackedBatchError, match="padding collator"):
        next(iter(dl))


# ----------------------------------------------------------------------------- issue 24: learning on real models


class HeadNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.classifier = nn.Linear(8, 2)

    def forward(self, x):
        return self.classifier(torch.tanh(self.body(x)))


def test_head_body_clips_head_and_body_separately():
    big = X1 * 20
    s, _ = one_step(HeadNet(), big, Y1, one_pass, clipping="head_body", head_fraction=0.3)
    head = math.sqrt(sum(float(v.pow(2).sum()) for n, v in s.items() if n.startswith("classifier")))
    body = math.sqrt(sum(float(v.pow(2).sum()) for n, v in s.items() if n.startswith("body")))
    assert head == pytest.approx(C * math.sqrt(0.3), rel=1e-3)
    assert body == pytest.approx(C * math.sqrt(0.7), rel=1e-3)
    assert total_norm(s) <= C * (1 + 1e-4)
    m = HeadNet()  # explicit head parameters give the same split
    s2, _ = one_step(m, big, Y1, one_pass, clipping="head_body", head_fraction=0.3,
                     head_parameters=m.classifier.parameters())
    assert all(torch.allclose(s[k], s2[k]) for k in s)
    with pytest.raises(ValueError, match="needs a head"):
        one_step(net(), X1, Y1, one_pass, clipping="head_body")


def test_per_group_clip_fractions_and_param_group_learning_rates():
    m = HeadNet()
    opt = torch.optim.SGD([{"params": m.body.parameters(), "lr": 0.5, "clip_fraction": 0.2},
                           {"params": m.classifier.parameters(), "lr": 2.0}], lr=1.0)
    s, _ = one_step(m, X1 * 20, Y1, one_pass, optimizer=opt, clipping="per_group")
    body = math.sqrt(sum(float(v.pow(2).sum()) for n, v in s.items() if n.startswith("body")))
    head = math.sqrt(sum(float(v.pow(2).sum()) for n, v in s.items() if n.startswith("classifier")))
    # the released sum is S_g · lr_g: each group's learning rate is honoured by the DP optimizer
    assert body == pytest.approx(0.5 * C * math.sqrt(0.2), rel=1e-3)
    assert head == pytest.approx(2.0 * C * math.sqrt(0.8), rel=1e-3)
    with pytest.raises(ValueError, match="≤ 1"):
        GroupClip(1.0, [0, 1], [0.7, 0.6])


def test_fractional_epochs():
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    model = net()
    engine = PrivacyEngine(reproducible_seed=0)
    module, opt, crit, dl = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                criterion=nn.CrossEntropyLoss(),
                                                data_loader=DataLoader(TensorDataset(x, y), batch_size=10),
                                                target_epsilon=8.0, target_delta=1e-3, epochs=1.5, max_grad_norm=1.0)
    assert dl.planned_steps == 6  # ceil(1.5 × 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            for xb, yb in dl:
                opt.zero_grad()
                crit(module(xb), yb).backward()
                opt.step()
    assert engine.ledger.steps == 6 and engine.get_epsilon(1e-3) <= 8.0 + 1e-6
    with pytest.raises(ValueError, match="epochs must be a positive number"):
        PrivacyEngine().make_private(module=net(), optimizer=torch.optim.SGD(net().parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=10),
                                     target_epsilon=8.0, target_delta=1e-3, epochs=-1.0, max_grad_norm=1.0)


def test_prediction_summary_warns_on_a_constant_classifier():
    with pytest.warns(UserWarning, match="every one of the 4 predictions is class 1"):
        out = prediction_summary(torch.tensor([[0.0, 1.0]] * 4), [1, 0, 1, 1])
    assert out["single_class"] and out["accuracy"] == 0.75 and out["majority_baseline"] == 0.75
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not prediction_summary(torch.tensor([0, 1, 1]))["single_class"]


# ----------------------------------------------------------------------------- DPTrainer


transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _trainer(tmp_path, model, rows, **kw):
    from transformers import TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    dp = kw.pop("dp", {})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=kw.pop("max_steps", 1), learning_rate=1e-2,
                             per_device_train_batch_size=8, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    return DPTrainer(model=model, args=args, train_dataset=rows, data_collator=kw.pop("collator", default_data_collator),
                     dp_args=DPArguments(noise_multiplier=0.0, target_delta=1e-3, max_grad_norm=C,
                                         expected_batch_size=len(rows), reproducible_seed=0, **dp), **kw)


def _rows(n=6):
    g = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict({"input_ids": torch.randint(3, 64, (n, 8), generator=g).tolist(),
                                       "attention_mask": [[1] * 8] * n, "labels": [i % 2 for i in range(n)]})


def test_dp_trainer_unfrozen_parameter_refused(tmp_path):
    from dpft.audit.whitebox import tiny_classifier

    model = tiny_classifier("bert")
    model.classifier.weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="does not clip"):
        tr = _trainer(tmp_path, model, _rows(), optimizers=(opt, None))
    model.classifier.weight.requires_grad_(True)
    with pytest.raises(UnclippedParameterError, match="before creating DPTrainer"):
        tr.train()
    assert tr.ledger.steps == 0


def test_dp_trainer_refuses_flattening_collator(tmp_path):
    from transformers import DataCollatorWithFlattening, GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64))
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9, 10, 11], [3, 4], [12, 13, 14, 15, 16]]})
    tr = _trainer(tmp_path, model, rows, collator=DataCollatorWithFlattening())
    with pytest.raises(PackedBatchError, match="DataCollatorWithFlattening"):
        tr.train()
    assert tr.ledger.steps == 0


def test_dp_trainer_head_learning_rate_and_constant_classifier_warning(tmp_path):
    from dpft.audit.whitebox import tiny_classifier

    model = tiny_classifier("bert")
    rows = _rows()
    tr = _trainer(tmp_path, model, rows, eval_dataset=rows, dp={"head_learning_rate": 0.5, "clipping": "head_body"})
    tr.create_optimizer()
    lrs = {id(p): g["lr"] for g in tr.optimizer.param_groups for p in g["params"]}
    assert lrs[id(model.classifier.weight)] == 0.5
    assert lrs[id(model.bert.embeddings.word_embeddings.weight)] == 1e-2
    with torch.no_grad():  # a constant classifier: every prediction is class 1
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, 5.0]))
    with pytest.warns(UserWarning, match="every one of the 6 predictions is class 1"):
        metrics = tr.evaluate()
    assert metrics["eval_top_class_share"] == 1.0


# ----------------------------------------------------------------------------- the audit checks


def test_api_checks_pass_on_the_real_code():
    from dpft.audit.ways_in import api_checks

    rows = api_checks()
    assert len(rows) == 8 and all(c.passed for c in rows), [c.message for c in rows if not c.passed]


@pytest.mark.parametrize("planted, route", [("double_capture", "make_private"), ("unfrozen_param", "both"),
                                            ("packing_collator", "dp_trainer"), ("session_steps_rule", "both")])
def test_api_checks_catch_each_planted_bug(planted, route):
    from dpft.audit.ways_in import api_checks, audit_dp_trainer, audit_make_private

    run = {"make_private": audit_make_private, "dp_trainer": audit_dp_trainer, "both": api_checks}[route]
    rows = run(planted=planted)
    failed = [c.name for c in rows if not c.passed]
    assert failed, f"planted {planted} not caught"
    from dpft.api import DPOptimizer
    from dpft.grads.live import LiveBookKeeping

    # the plant is undone afterwards
    assert LiveBookKeeping._check_one_capture.__name__ == "_check_one_capture"
    assert DPOptimizer.check_unclipped_grads.__name__ == "check_unclipped_grads"
