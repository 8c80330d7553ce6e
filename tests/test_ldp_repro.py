"""Issue 18, EW-FT / DP-Forward: the certified fixes (mask after the noise, [CLS] release at
`output`, noisy and clean inference) and the NOT CERTIFIED ``ldp.reproduce: dp_forward_code``."""

import json

import pytest
import torch

from conftest import ldp_recipe, tiny_classifier
from dpft.privacy.randomness import Randomness
from dpft.accounting.calibrate import epsilon_for_sigma
from dpft.methods.ewft.method import REPRO_FLAWS, dp_forward_code_sigma
from dpft.privacy.ldp import GaussianLDP, LDPError, SplitClassifier
from dpft.run.loop import Trainer


def test_dp_forward_code_sigma_matches_the_codes_calibration():
    # the code's claim: q = 1/N over N·E compositions, sensitivity 1
    s = dp_forward_code_sigma(4.0, 1e-3, 500, 2)
    assert epsilon_for_sigma(s, 1 / 500, 1000, 1e-3) <= 4.0 + 1e-6
    assert epsilon_for_sigma(s * 0.99, 1 / 500, 1000, 1e-3) > 4.0


def test_code_noise_std_is_sigma_c_and_not_detached():
    h = torch.zeros(4000, 1, 5, requires_grad=True)
    code = GaussianLDP(max_norm=3.0, sigma=0.5, std_factor=1.0, detach=False,
                       generator=Randomness(0).stream("ldp")).train()
    z = code.release(h)
    assert z.std().item() == pytest.approx(0.5 * 3.0, rel=0.03)  # σ·C, not σ·2C
    assert z.requires_grad  # flaw (i): gradients reach the user side
    cert = GaussianLDP(max_norm=3.0, sigma=0.5, generator=Randomness(0).stream("ldp")).train()
    zc = cert.release(h)
    assert zc.std().item() == pytest.approx(0.5 * 6.0, rel=0.03) and not zc.requires_grad
    with pytest.raises(LDPError, match="std_factor"):
        GaussianLDP(std_factor=3.0)


def test_mask_after_noise_gives_the_masked_model():
    m = tiny_classifier("bert")
    ids = torch.randint(3, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[2, 6:] = 0
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask).logits
    kw = dict(max_length=8)
    with_mask = SplitClassifier(m, "encoder:1", GaussianLDP(1e9, 0.0), pass_mask=True, **kw).eval()
    without = SplitClassifier(m, "encoder:1", GaussianLDP(1e9, 0.0), pass_mask=False, **kw).eval()
    with torch.no_grad():
        a = with_mask(input_ids=ids, attention_mask=mask).logits
        b = without(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a, ref, atol=1e-6, rtol=1e-4)
    # padding attended to (the old behaviour): a visibly different function
    assert (b - ref).abs().max() > 20 * (a - ref).abs().max() + 1e-6


def test_output_releases_the_cls_row_only():
    m = tiny_classifier("bert")
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    split = SplitClassifier(m, "output", GaussianLDP(1e9, 0.0), max_length=8, release_cls=True).eval()
    z = split.release(ids, torch.ones_like(ids))
    assert z.shape == (2, 1, m.config.hidden_size)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert torch.allclose(split(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, ref, atol=1e-5)
    with pytest.raises(LDPError, match="output"):
        SplitClassifier(tiny_classifier("bert"), "encoder:1", GaussianLDP(1.0, 0.0), 8, release_cls=True)


def test_certified_run_reports_noisy_and_clean_inference(tiny_model_dir, sst_like_files, tmp_path):
    t = Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **{"schedule.epochs": 1}), tmp_path / "c",
                progress=False)
    rep = t.run()
    met = rep["metrics"]
    for k in ("dev_accuracy_noisy_inference", "dev_accuracy_clean_inference"):
        assert 0.0 <= met[k] <= 1.0
    assert met["dev_accuracy"] == met["dev_accuracy_noisy_inference"]  # ldp.eval_noise: true
    assert rep["privacy"]["guarantee"] == "certified"
    assert "token counts are not protected" in rep["privacy"]["scope"]
    assert rep["ldp"]["mask_after_noise"] is True and rep["ldp"]["reproduce"] is None
    assert "noisy_inference" in rep["ldp"]["inference"]


def test_dp_forward_code_reproduction_is_not_certified(tiny_model_dir, sst_like_files, tmp_path):
    rec = ldp_recipe(tiny_model_dir, sst_like_files, **{"schedule.epochs": 1, "ldp.reproduce": "dp_forward_code",
                                                         "ldp.position": "output", "ldp.autoencoder.sizes": []})
    t = Trainer(rec, tmp_path / "r", progress=False)
    ldp = t.method("ewft").ldp
    split = ldp.split
    emb = split.model.bert.embeddings.word_embeddings.weight
    assert emb.requires_grad and split.pooled_release and split.pass_mask  # (i), (iv), (v)
    assert ldp.layer.sensitivity == pytest.approx(rec.ldp.max_norm)  # (ii)
    assert ldp.layer.eval_noise is False  # (vii)
    before = emb.detach().clone()
    rep = t.run()
    assert not torch.equal(before, emb.detach())  # pre(·) was trained through the noise
    p = rep["privacy"]
    assert p["guarantee"] == "NOT CERTIFIED" and p["epsilon"] is None and set(p["flaws"]) == set(REPRO_FLAWS)
    assert not t.ledger.certified and "dp_forward_code" in t.ledger.not_certified_reason
    # the ledger still holds what was released: std σ·C against sensitivity 2C = multiplier σ/2
    assert len(t.ledger.entries) == 1 and f"{ldp.schedule.sigmas[0] / 2:.6g}"[:6] in repr(t.ledger.entries[0].event)
    assert rep["metrics"]["dev_accuracy"] == rep["metrics"]["dev_accuracy_clean_inference"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "NOT CERTIFIED" in md
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert saved["privacy"]["guarantee"] == "NOT CERTIFIED"


def test_single_flaw_ablation_changes_only_that_choice_and_is_not_certified(tiny_model_dir, sst_like_files, tmp_path):
    base = {"schedule.epochs": 1, "ldp.position": "output", "ldp.autoencoder.sizes": []}
    t = Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **base, **{"ldp.reproduce_flaws": ["i"]}),
                tmp_path / "i", progress=False)
    ldp = t.method("ewft").ldp
    emb = ldp.split.model.bert.embeddings.word_embeddings.weight
    # (i) only: pre(·) trains through the noise; the rest is the certified mechanism
    assert emb.requires_grad and not ldp.layer.detach and ldp.split.pre_cache is None
    assert ldp.layer.sensitivity == pytest.approx(2 * t.recipe.ldp.max_norm) and ldp.layer.eval_noise
    assert ldp.split.release_cls and not ldp.split.pooled_release
    certified = Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **base), tmp_path / "c", progress=False)
    assert ldp.schedule.sigmas == certified.method("ewft").ldp.schedule.sigmas  # (iii) not taken: same σ
    before = emb.detach().clone()
    rep = t.run()
    assert not torch.equal(before, emb.detach())
    p = rep["privacy"]
    assert p["guarantee"] == "NOT CERTIFIED" and p["epsilon"] is None and set(p["flaws"]) == {"i"}
    assert "(i)" in t.ledger.not_certified_reason and "(ii)" not in t.ledger.not_certified_reason
    assert rep["ldp"]["reproduce_flaws"] == ["i"]
    # (ii) + (iii): frozen pre(·) with the code's smaller noise
    t2 = Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **base, **{"ldp.reproduce_flaws": ["ii", "iii"]}),
                 tmp_path / "ii", progress=False)
    l2 = t2.method("ewft").ldp
    assert l2.layer.sensitivity == pytest.approx(t2.recipe.ldp.max_norm) and l2.layer.detach
    assert not l2.split.model.bert.embeddings.word_embeddings.weight.requires_grad
    assert l2.schedule.sigmas[0] == pytest.approx(dp_forward_code_sigma(t2.recipe.ldp.target_epsilon,
                                                                       t2.recipe.ldp.delta, t2.n, 1))
    assert not t2.ledger.certified
    with pytest.raises(LDPError, match="not both"):
        Trainer(ldp_recipe(tiny_model_dir, sst_like_files, **base, **{"ldp.reproduce_flaws": ["i"],
                                                                       "ldp.reproduce": "dp_forward_code"}),
                tmp_path / "both", progress=False)


def test_split_deployment_refuses_the_reproduction(tiny_model_dir, sst_like_files, tmp_path):
    from test_ldp_split import _client

    with pytest.raises(LDPError, match="reproduce"):
        _client(tiny_model_dir, sst_like_files, tmp_path, recipe={"ldp.reproduce": "dp_forward_code"})
