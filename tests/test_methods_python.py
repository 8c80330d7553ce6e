"""Methods through the Python ways in (issue 34 item 4): DP-Adam-AC's private adaptive clipping and
DP-SFT with a given subspace through ``make_private(methods=…)`` and ``DPArguments(methods=…)``;
what needs ``dpft train``'s driver refuses with the reason and the fix.

The make_private reference below re-does the method's maths by hand (per-example gradients by a
loop, flat clipping, the centred noisy count, σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2), the geometric C
update — Andrew et al. 2021, Alg. 1) with the same secret streams as the way in's loop (the child
``make_private:1`` of the seed: ``sample``, ``noise``, ``count``), so it checks the wiring — the
plan's hooks, σ handed to the method, ``after_update`` after each update — not only that it runs.
"""

from __future__ import annotations

import math
import warnings

import dp_accounting as dpa
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.accounting.ledger import PrivacyLedger
from dpft.errors import PlanError
from dpft.privacy.randomness import Randomness
from dpft.step.clip import EPS
from dpft.transforms.subspace import SubspaceBasis

SEED = 11
N, B, T, LR, SIGMA, C0 = 40, 8, 5, 0.3, 1.0, 0.5
AC = {"name": "dp_adam_ac", "adaptive_clip": True, "count_noise": 2.0, "clip_lr": 0.4, "target_clip_rate": 0.3}


def _data():
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _make_private_loop(methods, steps=T, eng=None, **kw):
    model, data = _model(), _data()
    eng = eng or PrivacyEngine(reproducible_seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=B, max_grad_norm=C0, steps=steps, methods=methods,
            **({"noise_multiplier": SIGMA} if "target_epsilon" not in kw else {}), **kw)
        stats = []
        while opt.logical_steps < steps:
            for x, y in loader:
                crit(module(x), y).backward()
                if opt.step():
                    stats.append(dict(opt.method_stats))
                opt.zero_grad()
                if opt.logical_steps >= steps:
                    break
    return model, eng, opt, stats


def _reference(cfg=AC):
    """DP-SGD with private adaptive clipping, by hand (Andrew et al. 2021, Alg. 1; per example)."""
    model, (x, y) = _model(), _data().tensors
    rng = Randomness(SEED).child("make_private:1")
    sigma_b = cfg["count_noise"]
    sigma_d = (SIGMA ** -2 - (2 * sigma_b) ** -2) ** -0.5
    q = B / N
    c, cs = C0, []
    for t in range(T):
        idx = torch.nonzero(rng.stream("sample", t).bernoulli((N,), q)).flatten()
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        unclipped = 0
        for i in idx.tolist():
            model.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
            g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            norm = math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))
            factor = min(1.0, c / (norm + EPS))
            unclipped += factor >= 1.0
            for n in g:
                total[n] += factor * g[n]
        with torch.no_grad():
            for n, p in model.named_parameters():
                z = rng.stream("noise", t, n).normal(p.shape, dtype=torch.float32)
                p -= LR * (total[n] + sigma_d * c * z) / (q * N)
        cs.append(c)
        zc = float(rng.stream("count", t).normal((), dtype=torch.float64)) * sigma_b
        b = (unclipped - 0.5 * len(idx) + zc) / (q * N) + 0.5
        c = min(1e3, max(1e-3, c * math.exp(-cfg["clip_lr"] * (b - (1 - cfg["target_clip_rate"])))))
    return model, cs, c


def test_make_private_adaptive_clip_matches_a_hand_written_reference():
    model, eng, opt, stats = _make_private_loop([AC])
    ref, cs, c_end = _reference()
    assert [s["clip_norm"] for s in stats] == pytest.approx(cs, rel=1e-9)  # C used at each step
    assert opt.max_grad_norm == pytest.approx(c_end, rel=1e-9)
    assert len(set(cs)) == T  # C moved at every step
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, r, atol=1e-5), n
    # σ_Δ > σ on the gradient; the ledger's one event per step is at σ (it covers the count too)
    mech = opt.dp_step.spec.mechanism
    assert mech.sigma == pytest.approx((SIGMA ** -2 - 4.0 ** -2) ** -0.5) and mech.accounted_sigma == SIGMA
    assert [(e.phase, e.event, e.count) for e in eng.ledger.entries] == [
        ("train", dpa.PoissonSampledDpEvent(B / N, dpa.GaussianDpEvent(SIGMA)), T)]


def test_adaptive_clip_ledger_equals_plain_dp_sgd_and_calibrates_on_it():
    _, plain, _, _ = _make_private_loop(None, target_epsilon=2.0, target_delta=1e-3)
    _, ac, opt, _ = _make_private_loop([AC], target_epsilon=2.0, target_delta=1e-3)
    # the same σ (calibrated on the same events) and the same ledger: the count is inside σ's event
    assert ac.noise_multiplier == plain.noise_multiplier
    assert [(e.phase, e.event, e.count) for e in ac.ledger.entries] == [
        (e.phase, e.event, e.count) for e in plain.ledger.entries]
    assert ac.get_epsilon(1e-3) == pytest.approx(2.0, abs=0.05)
    assert opt.dp_step.spec.mechanism.accounted_sigma == ac.noise_multiplier  # σ handed over before build


@pytest.mark.parametrize("cfg, words", [
    ({**AC, "bias_correction": True}, "DPAdam"),
    ({**AC, "gamma_nudge": True}, "DPAdam"),
    ({**AC, "ema_decay": 0.9}, "model_ema"),
    ({"name": "dp_adam_ac", "reproduce_paper": True}, "NOT CERTIFIED"),
    ({"name": "dpsft", "source": "private", "k": 2}, "dpft train"),
    ({"name": "dpsft", "source": "public", "k": 2, "public_task": {"name": "imdb"}}, "'source': 'file'"),
    ({"name": "dpsft", "source": "file", "file": "x.safetensors", "optimizer_space": "coords"}, "'full'"),
])
def test_what_needs_the_driver_refuses_with_the_reason_and_the_fix(cfg, words):
    from dpft.integrations.hf.trainer import DPArguments

    with pytest.raises(PlanError, match="cannot run here") as e1:
        _make_private_loop([cfg])
    with pytest.raises(PlanError, match="cannot run here") as e2:
        DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=4, methods=[cfg])
    assert words in str(e1.value) and words in str(e2.value)


def test_adaptive_clip_refuses_user_level_and_non_flat_clipping():
    with pytest.raises(PlanError, match="example-level"):
        _make_private_loop([AC], user_ids=[i // 2 for i in range(N)])
    with pytest.raises(PlanError, match="flat clipping"):
        _make_private_loop([AC], clipping="per_layer")
    with pytest.raises(PlanError, match="2σ_b"):  # σ ≥ 2σ_b: no σ_Δ exists
        _make_private_loop([{**AC, "count_noise": 0.4}])


# --------------------------------------------------------------------------- DP-SFT, a given subspace


def _basis(model, k=3, private=True, seed=5):
    """A random orthonormal basis over ``model``'s parameters, provenance recorded like a private
    stage 1's (its ledger: 7 PoissonSampled(0.1, G(2)) releases, phase subspace)."""
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), k, generator=g,
                                          dtype=torch.float64))
    blocks, o = {}, 0
    for n, p in params.items():
        blocks[n] = flat[o:o + p.numel()].T.reshape(k, *p.shape).float().contiguous()
        o += p.numel()
    led = PrivacyLedger()
    led.record("subspace", dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(2.0)), 7)
    meta = {"source": "private" if private else "public"}
    if private:
        meta["ledger"] = led.to_json()
    return SubspaceBasis(blocks=blocks, singular_values=torch.ones(k, dtype=torch.float64), meta=meta), flat


def _in_span(delta: dict, flat: torch.Tensor) -> float:
    """Relative norm of the part of ``delta`` outside span(P)."""
    v = torch.cat([d.reshape(-1).double() for d in delta.values()])
    resid = v - flat @ (flat.T @ v)
    return float(resid.norm() / v.norm())


def test_make_private_dpsft_file_basis_runs_in_the_subspace_and_composes_its_ledger(tmp_path):
    basis, flat = _basis(_model())
    path = basis.save(tmp_path / "basis.safetensors")
    cfg = {"name": "dpsft", "source": "file", "file": str(path), "k": 3, "start": "initial"}
    init = {n: p.detach().clone() for n, p in _model().named_parameters()}
    model, eng, opt, _ = _make_private_loop([cfg], target_epsilon=3.0, target_delta=1e-3)
    entries = [(e.phase, e.event, e.count) for e in eng.ledger.entries]
    assert entries[0] == ("subspace", dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(2.0)), 7)
    assert entries[1][0] == "train" and entries[1][2] == T
    # σ was calibrated after the basis's releases: the whole ledger meets the target
    assert eng.get_epsilon(1e-3) == pytest.approx(3.0, abs=0.05)
    delta = {n: p.detach() - init[n] for n, p in model.named_parameters()}
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-3
    assert _in_span(delta, flat) < 1e-4  # the update stays in span(P)
    assert set(opt.dp_step.spec.engine.params) == {"subspace.coords"}


def test_make_private_dpsft_equals_the_engine_that_runs_its_own_forward(tmp_path):
    """The live projection (the user's forward/backward) gives the coordinates the subspace engine
    computes with its own forward: one micro-batch, same rows."""
    from dpft.methods.dpsft.method import LiveSubspace
    from dpft.grads.live import LiveBookKeeping
    from dpft.grads.subspace import COORDS, SubspaceEngine
    from dpft.step.clip import FlatClip

    model, (x, y) = _model(), _data().tensors
    basis, _ = _basis(model)

    def loss_fn(forward, batch):
        return nn.functional.cross_entropy(forward(batch["x"]), batch["y"], reduction="none")

    eng = SubspaceEngine(model, lambda fwd, b: loss_fn(lambda z: model(z), b), FlatClip(0.05), basis)
    want = eng.clipped_sum({"x": x[:6], "y": y[:6]})
    got = []
    live = LiveBookKeeping(LiveSubspace(SubspaceEngine(model, loss_fn, FlatClip(0.05), basis)), got.append,
                           loss_reduction="sum")
    live.begin_micro_batch(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.functional.cross_entropy(model(x[:6]), y[:6], reduction="sum").backward()
        live.flush()
    live.close()
    assert len(got) == 1 and torch.allclose(got[0].grad_sum[COORDS], want.grad_sum[COORDS], atol=1e-6)
    assert torch.allclose(got[0].sq_norms, want.sq_norms, rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())  # no weight gradient was built or kept


def test_dptrainer_dpsft_file_basis_and_paper_noise(tmp_path):
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    basis, flat = _basis(model, k=4)
    path = basis.save(tmp_path / "b.safetensors")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(3, 40, (32, 5), generator=g).tolist(),
                                     "attention_mask": [[1] * 5] * 32,
                                     "labels": torch.randint(0, 2, (32,), generator=g).tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=0.5, optim="sgd", max_steps=3,
                             per_device_train_batch_size=8, report_to=[], use_cpu=True, disable_tqdm=True,
                             save_strategy="no", logging_steps=100)
    dp = DPArguments(target_epsilon=3.0, target_delta=1e-3, expected_batch_size=8, reproducible_seed=1,
                     methods=[{"name": "dpsft", "source": "file", "file": str(path), "k": 4, "start": "initial"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator, dp_args=dp)
        tr.train()
    assert [e.phase for e in tr.ledger.entries] == ["subspace", "train"]
    assert tr.get_epsilon() == pytest.approx(3.0, abs=0.05)
    delta = {n: p.detach() - init[n] for n, p in model.named_parameters()}
    assert _in_span(delta, flat) < 1e-4 and max(float(d.abs().max()) for d in delta.values()) > 1e-4
    # the paper's noise placement alone (source none): σ·B on the sum, accounted at σ
    dp2 = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8,
                      methods=[{"name": "dpsft", "source": "none", "paper_noise_placement": True}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr2 = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator, dp_args=dp2)
    assert tr2.mechanism.sigma == 8.0 and tr2.mechanism.accounted_sigma == 1.0


def test_dptrainer_refuses_resume_with_adaptive_clip(tmp_path):
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16,
                                                     max_position_embeddings=16))
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 16, "attention_mask": [[1, 1, 1]] * 16,
                                     "labels": [0, 1] * 8})
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, report_to=[], use_cpu=True)
    tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                   dp_args=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=4,
                                       methods=[AC]))
    with pytest.raises(ValueError, match=r"\(the adaptive clip norm C\) is not in the checkpoint"):
        tr.train(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-1"))


def test_dptrainer_card_names_the_methods_and_their_released_settings(tmp_path):
    """The model card of a DPTrainer run with methods says which ran and what they released (DP-Adam-AC:
    σ split and the final private C), as report.md does for dpft train."""
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer
    from dpft.integrations.hf.card import trainer_report, write_trainer_card

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16,
                                                     max_position_embeddings=16))
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]] * 16, "attention_mask": [[1, 1, 1]] * 16,
                                     "labels": [0, 1] * 8})
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                   dp_args=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=4,
                                       methods=[AC, {"name": "rmt", "method": "rmt"}]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr.train()
    rep = trainer_report(tr)
    assert rep["methods"] == ["dp_adam_ac", "rmt"]
    assert rep["adam_ac"]["final_clip_norm"] == pytest.approx(tr.methods.report()["adam_ac"]["final_clip_norm"])
    text = write_trainer_card(tr, tmp_path / "card").read_text()
    assert "- methods: dp_adam_ac, rmt" in text
    assert "### DP-Adam family options" in text and f"final clipping norm C = {rep['adam_ac']['final_clip_norm']:.4g}" in text


# --------------------------------------------------------------------------- the audit


def test_audit_checks_of_the_methods_through_the_python_ways_in_pass():
    from dpft.audit import ways_in_mechanisms as cm

    checks = cm.methods_api_checks(None)
    assert len(checks) == 3 and all(c.passed for c in checks), [c.message for c in checks if not c.passed]


@pytest.mark.parametrize("bug, check", [("api_adaptive_noise_unadjusted", "_adaptive_noise"),
                                        ("trainer_count_stream_reused", "_trainer_count_streams"),
                                        ("api_subspace_unclipped", "_subspace_leave_one_out")])
def test_audit_catches_each_planted_methods_bug(bug, check):
    from dpft.audit import ways_in_mechanisms as cm
    from dpft.audit.planted import ALL
    from dpft.audit.suite import OPTIONAL_CHECKS

    assert bug in ALL and any(bug in names for _, _, names in OPTIONAL_CHECKS)
    with cm.planted_bug(bug):
        res = getattr(cm, check)()
    assert not res.passed, res.message


def test_dpsfttrainer_runs_adaptive_clipping(tmp_path):
    """DPSFTTrainer (TRL) inherits DPTrainer's plan and its after_update: C moves after each step."""
    pytest.importorskip("trl")
    from test_trl import prompt_completion, sft_args, tiny_llama, tiny_tokenizer

    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPSFTTrainer

    tok = tiny_tokenizer()
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-2, max_grad_norm=1.0, expected_batch_size=4,
                     methods=[{**AC, "count_noise": 1.0}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPSFTTrainer(model=tiny_llama(len(tok)), args=sft_args(tmp_path / "out"),
                          train_dataset=prompt_completion(), processing_class=tok, dp_args=dp)
        tr.train()
    assert tr.mechanism.sigma == pytest.approx((1.0 - 0.25) ** -0.5) and tr.mechanism.accounted_sigma == 1.0
    assert [(e.phase, e.count) for e in tr.ledger.entries] == [("train", 2)]
    assert tr.method_stats["clip_norm"] != 1.0 and tr.clip.max_norm != tr.method_stats["clip_norm"]
