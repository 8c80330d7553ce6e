"""`dpft.audit.audit_make_private` / `audit_dp_trainer` on the user's own model, rows and loop
(issue 23): leave-one-out ≤ C and noise std σC through the real API, and a planted bug caught."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def _net_and_rows():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    x = torch.randn(5, 6)
    x[0] *= 40.0  # a large input: a gradient far above C
    return net, TensorDataset(x, torch.tensor([0, 1, 2, 0, 1]))


def test_make_private_audit_of_your_model_passes():
    from dpft.audit import audit_make_private

    net, ds = _net_and_rows()
    rows = audit_make_private(net, ds, nn.CrossEntropyLoss(), rows=5, max_grad_norm=0.5)
    assert [c.name for c in rows] == ["yours: make_private leave-one-out", "yours: make_private noise std σC"]
    assert all(c.passed for c in rows), [c.message for c in rows]
    assert rows[0].stats["loo_over_C"] <= 1.001 and rows[0].stats["loo_over_C"] > 0.5  # the big row hits C
    assert abs(rows[1].stats["std_over_sigma_c"] - 1.0) < 0.2


def test_make_private_audit_of_your_model_catches_a_clip_that_does_not_clip(monkeypatch):
    from dpft.audit import audit_make_private
    from dpft.step.clip import FlatClip

    monkeypatch.setattr(FlatClip, "scales", lambda self, sq: torch.ones_like(sq))  # planted: no clipping
    net, ds = _net_and_rows()
    rows = audit_make_private(net, ds, nn.CrossEntropyLoss(), rows=5, max_grad_norm=0.5)
    assert not rows[0].passed and "more than C" in rows[0].message


def test_make_private_audit_with_your_train_step_and_head_body():
    from dpft.audit import audit_make_private

    net, ds = _net_and_rows()

    def step(module, optimizer, criterion, batch):  # the user's own loop body
        x, y = batch
        optimizer.zero_grad()
        (criterion(module(x), y) * 3.0).backward()  # a scaled loss is still clipped to C
        optimizer.step()

    rows = audit_make_private(net, ds, nn.CrossEntropyLoss(), train_step=step, rows=4, max_grad_norm=1.0,
                              clipping="head_body", head_parameters=["3.weight", "3.bias"])
    assert all(c.passed for c in rows), [c.message for c in rows]


def test_dp_trainer_audit_of_your_model_passes():
    import datasets
    from transformers import default_data_collator

    from dpft.audit import audit_dp_trainer
    from dpft.audit.whitebox import tiny_classifier

    model = tiny_classifier("bert", vocab=64, max_len=16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (4, 8), generator=g)
    rows = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(4, 8).long().tolist(),
                                       "labels": [0, 1, 1, 0]})
    out = audit_dp_trainer(model, rows, rows=4, max_grad_norm=0.1, data_collator=default_data_collator)
    assert [c.name for c in out] == ["yours: DPTrainer leave-one-out", "yours: DPTrainer noise std σC"]
    assert all(c.passed for c in out), [c.message for c in out]


def test_dp_trainer_audit_keeps_labels_for_a_model_whose_forward_takes_none():
    """dpft's mean-pooling classifier takes no `labels` argument: the audit keeps the column."""
    import datasets
    from transformers import BertConfig, BertModel, default_data_collator

    from dpft.audit import audit_dp_trainer
    from dpft.models.load import MeanPoolClassifier

    torch.manual_seed(0)
    enc = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=16))
    model = MeanPoolClassifier(enc, 2)
    g = torch.Generator().manual_seed(1)
    rows = datasets.Dataset.from_dict({"input_ids": torch.randint(3, 64, (4, 8), generator=g).tolist(),
                                       "attention_mask": torch.ones(4, 8).long().tolist(), "labels": [0, 1, 1, 0]})
    out = audit_dp_trainer(model, rows, rows=4, max_grad_norm=0.1, data_collator=default_data_collator)
    assert all(c.passed for c in out), [c.message for c in out]
