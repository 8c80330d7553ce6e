"""Issue 29: the Adapter-DP baseline — Houlsby bottleneck adapters (models/adapters.py) as plain
Linear modules, so the exact per-example rules apply; only adapters + head train; saved adapters load."""

import warnings

import pytest
import torch

from conftest import files_recipe, random_batch, tiny_classifier
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine
from dpft.models.adapters import AdapterError, BottleneckAdapter, add_adapters
from dpft.models.losses import classification_loss
from dpft.step.clip import make_clip_policy

CFG = {"type": "houlsby", "reduction_factor": 4, "nonlinearity": "relu"}


def _head_only_with_adapters():
    m = tiny_classifier("bert")
    for n, p in m.named_parameters():
        p.requires_grad_(n.startswith("classifier") or ".pooler." in f".{n}")
    batch = random_batch()
    with torch.no_grad():
        before = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    add_adapters(m, CFG)
    return m, batch, before


def test_adapters_start_as_identity_and_bookkeeping_equals_reference():
    m, batch, before = _head_only_with_adapters()
    ads = [x for x in m.modules() if isinstance(x, BottleneckAdapter)]
    assert len(ads) == 2 * 2 and ads[0].down.out_features == 16 // 4  # 2 per block, d/r wide
    with torch.no_grad():
        after = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(after, before)  # zero-init up-projection: the pre-trained model
    for a in ads:  # a non-zero start, so every rule sees non-trivial inputs and output grads
        torch.nn.init.normal_(a.up.weight, std=0.1)
    clip = make_clip_policy("flat", 0.05)
    bk = BookKeepingEngine(m, classification_loss, clip).clipped_sum(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = ReferenceEngine(m, classification_loss, clip).clipped_sum(batch)
    names = list(ref.grad_sum)
    assert all(".adapter." in n or n.startswith(("classifier", "bert.pooler")) for n in names)
    assert any(".adapter.down." in n for n in names) and any(".adapter.up." in n for n in names)
    torch.testing.assert_close(bk.sq_norms, ref.sq_norms, rtol=2e-4, atol=1e-9)
    assert bool((ref.scales < 1).any())  # some examples clipped
    for n in names:
        torch.testing.assert_close(bk.grad_sum[n], ref.grad_sum[n], rtol=2e-4, atol=1e-7, msg=n)


@pytest.mark.slow  # a whole (2-step) run with its report and saved model
def test_private_run_updates_only_adapters_and_head_and_saves_loadable_adapters(tiny_model_dir, sst_like_files,
                                                                                 tmp_path):
    from dpft.models.export import load_for_inference
    from dpft.run.loop import Trainer

    # mean pooling (the MiniLM recipes' head): saved as dpft's standard class + adapters.safetensors
    rec = files_recipe(tiny_model_dir, sst_like_files, **{"model.adapter": CFG, "trainable.mode": "head",
                                                          "model.pooling": "mean",
                                                          "privacy.noise_multiplier": 0.5,
                                                          "privacy.target_epsilon": None, "schedule.steps": 2})
    t = Trainer(rec, tmp_path / "r", progress=False)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.run()
    moved = {n for n, p in t.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and all(".adapter." in n or "classifier" in n or "pooler" in n for n in moved), moved
    assert any(".adapter." in n for n in moved)
    tok, loaded, _ = load_for_inference(tmp_path / "r" / "model")
    enc = tok(["a good film", "a dull film number 3"], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = t.model.eval()(**enc).logits
        got = loaded(**enc).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_adapters_need_head_mode_and_a_bert_family_model(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    with pytest.raises(AdapterError, match="trainable.mode: head"):
        Trainer(files_recipe(tiny_model_dir, sst_like_files, **{"model.adapter": CFG}), tmp_path / "x", progress=False)
    with pytest.raises(AdapterError, match="BERT-family"):
        add_adapters(tiny_classifier("gpt2"), CFG)
