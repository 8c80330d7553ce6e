"""Mean-pooling classifier head (model.pooling = mean): padding never enters an example's
representation, the fast per-example engine stays exact through it, and LoRA / last_k / head
selections and saving work on it."""

from __future__ import annotations

import json

import warnings

import pytest
import torch

from dpft.config.recipe import TrainableCfg
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine
from dpft.models.load import MeanPoolClassifier, load_classifier, select_trainable
from dpft.models.losses import classification_loss
from dpft.step.clip import make_clip_policy

transformers = pytest.importorskip("transformers")


def tiny_meanpool(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=32, pad_token_id=0)
    return MeanPoolClassifier(transformers.BertModel(cfg, add_pooling_layer=False), num_labels=3).eval()


def batch(seed=0, b=4, t=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(t).expand(b, t).contiguous(),
            "token_type_ids": torch.zeros(b, t, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 1])}


def test_padding_does_not_change_logits():
    m = tiny_meanpool()
    ids = torch.tensor([[5, 6, 7]])
    short = m(input_ids=ids, attention_mask=torch.ones(1, 3, dtype=torch.long)).logits
    padded = m(input_ids=torch.tensor([[5, 6, 7, 0, 0]]),
               attention_mask=torch.tensor([[1, 1, 1, 0, 0]])).logits
    torch.testing.assert_close(short, padded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "last_k", "head", "lora"])
def test_bookkeeping_matches_reference_through_mean_pooling(mode):
    m = select_trainable(tiny_meanpool(), TrainableCfg(mode=mode, last_k=1, lora={"target_modules": ["query", "value"]}))
    m.eval()
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert any("classifier" in n for n in trainable), trainable
    if mode == "head":
        assert all("classifier" in n for n in trainable)
    clip = make_clip_policy("flat", 0.3)
    bk = BookKeepingEngine(m, classification_loss, clip).clipped_sum(batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(m, classification_loss, clip).clipped_sum(batch())
    torch.testing.assert_close(bk.sq_norms, ref.sq_norms, rtol=2e-4, atol=1e-8)
    assert set(bk.grad_sum) == set(ref.grad_sum)
    for n, g in ref.grad_sum.items():
        torch.testing.assert_close(bk.grad_sum[n], g, rtol=2e-4, atol=1e-6, msg=n)


def test_load_classifier_mean_pooling_and_save(tiny_model_dir, tmp_path):
    tok, m = load_classifier(str(tiny_model_dir), num_labels=2, pooling="mean")
    assert isinstance(m, MeanPoolClassifier)
    assert not any("pooler" in n for n, _ in m.named_parameters())  # the unused [CLS] pooler is not loaded
    m.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "dpft_mean_pool"  # issue 24
    tok.save_pretrained(tmp_path / "out")
    with torch.no_grad():
        m.classifier.weight.add_(1.0)  # differs from any fresh initialisation
    m.save_pretrained(tmp_path / "out")
    _, again = load_classifier(str(tmp_path / "out"), num_labels=2, pooling="mean", seed=7)
    torch.testing.assert_close(again.classifier.weight, m.classifier.weight)  # the saved head continues
    torch.testing.assert_close(again.classifier.bias, m.classifier.bias)
    _, other = load_classifier(str(tmp_path / "out"), num_labels=3, pooling="mean")
    assert other.classifier.weight.shape == (3, m.classifier.in_features)  # another task: fresh head


def test_set_dropout_zero_makes_training_mode_deterministic():
    from dpft.models.load import set_dropout

    m = tiny_meanpool().train()
    b = batch()
    inputs = {k: v for k, v in b.items() if k != "labels"}
    assert set_dropout(m, 0.0) > 0
    torch.testing.assert_close(m(**inputs).logits, m(**inputs).logits)
    set_dropout(m, 0.5)
    assert not torch.allclose(m(**inputs).logits, m(**inputs).logits)


def test_head_body_clipping_budgets_and_sensitivity():
    from dpft.step.clip import HeadBodyClip, make_clip_policy

    clip = make_clip_policy("head_body", 2.0, head_fraction=0.25)
    g = torch.Generator().manual_seed(0)
    sq = torch.rand(16, 5, generator=g) * torch.tensor([100.0, 0.01, 5.0, 3.0, 0.5])
    with pytest.raises(ValueError, match="set_head_mask"):
        clip.scales(sq)
    mask = torch.tensor([False, False, False, True, True])
    clip.set_head_mask(mask)
    c = clip.scales(sq)
    contrib = sq * c.pow(2)
    head, body = contrib[:, mask].sum(1).sqrt(), contrib[:, ~mask].sum(1).sqrt()
    assert (head <= 2.0 * 0.5 + 1e-5).all() and (body <= 2.0 * 0.75 ** 0.5 + 1e-5).all()
    assert ((head.pow(2) + body.pow(2)).sqrt() <= 2.0 + 1e-5).all()
    assert clip.sensitivity == 2.0
    # within a group the factor is shared (flat clipping of that group)
    assert torch.equal(c[:, 3], c[:, 4]) and torch.equal(c[:, 0], c[:, 2])
    with pytest.raises(ValueError):
        HeadBodyClip(1.0, head_fraction=1.0)


def test_head_body_clipping_in_the_trainer_marks_the_head(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.config.recipe import Recipe
    from dpft.run.loop import Trainer

    r = Recipe.model_validate({
        "model": {"name": str(tiny_model_dir), "pooling": "mean", "max_length": 16},
        "task": {"name": "files", "train_file": str(sst_like_files["csv"]), "text_column": "text",
                 "label_column": "label"},
        "trainable": {"mode": "last_k", "last_k": 1},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-3, "clipping": {"style": "head_body"}},
        "schedule": {"steps": 2}, "batch": {"expected_batch_size": 8}, "eval": {"every_steps": 2},
    })
    tr = Trainer(r, tmp_path / "run", progress=False)
    flags = dict(zip(tr.engine.params, tr.clip.head_mask.tolist()))
    assert flags == {n: n.startswith("classifier.") for n in tr.engine.params}
    rep = tr.run()
    assert 0 <= rep["metrics"]["dev_accuracy"] <= 1
