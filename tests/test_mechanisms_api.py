"""Issue 28 in the Python ways in: banded matrix factorization and truncated Poisson through
``PrivacyEngine.make_private`` and ``DPTrainer`` (events and ε, the noise C⁻¹Z, the secret noise
state, resume, refusals) and their audit checks (audit/ways_in_mechanisms.py)."""

from __future__ import annotations

import os
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.accounting.ledger import epsilon_of
from dpft.privacy.randomness import Randomness
from dpft.step.correlated import NOISE_STATE_FILE, banded_coefficients, banded_phase_event, strategy_matrix
from dpft.step.truncated import truncated_event

N, B, BANDS, STEPS, SEED = 48, 4, 3, 6, 11


def _banded_events(p, sigma, steps, bands):
    return [dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(sigma)) if t % bands == 0 else dpa.NoOpDpEvent()
            for t in range(steps)]


def _flat(ledger):
    return [e.event for e in ledger.entries for _ in range(e.count)]


# ----------------------------------------------------------------------------- make_private
def _mp_loop(seed=SEED, steps=STEPS, upto=None, load=None, save=None, **kw):
    """A make_private banded loop on a linear model with a zero loss (the clipped sums are 0, so
    SGD at lr 1 moves the weights by −(released noise)/B). Returns (engine, optimizer, deltas)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 3, (N,)))
    eng = PrivacyEngine(reproducible_seed=seed)
    args = dict(target_epsilon=3.0, target_delta=1e-3) if "noise_multiplier" not in kw else {}
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        dataset=data, expected_batch_size=B, max_grad_norm=0.5, steps=steps, mechanism="banded_mf", bands=BANDS,
        **args, **kw)
    if load is not None:
        eng.load_noise_state(load)
    deltas = []
    while opt.logical_steps < (upto or steps):
        for x, y in loader:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            (crit(module(x), y) * 0.0).backward()
            if opt.step():
                deltas.append({n: (before[n] - p.detach()).double() for n, p in model.named_parameters()})
            opt.zero_grad()
            if opt.logical_steps >= (upto or steps):
                break
    if save is not None:
        eng.save_noise_state(save)
    return eng, opt, model, deltas


def test_make_private_banded_events_epsilon_and_noise_is_c_inv_z(tmp_path):
    eng, opt, model, deltas = _mp_loop()
    sigma, mech = eng.noise_multiplier, opt.dp_step.spec.mechanism
    p = BANDS * B / N
    # The ledger: PoissonSampled(p, σ) at t ≡ 0 (mod b), NoOp otherwise — the CLI's events; σ calibrated on them.
    assert _flat(eng.ledger) == _banded_events(p, sigma, STEPS, BANDS)
    eps = eng.get_epsilon(1e-3)
    assert eps <= 3.0 + 1e-6 and eps == pytest.approx(3.0, abs=0.02)
    assert eps == pytest.approx(epsilon_of([banded_phase_event(sigma, p, STEPS, BANDS)], 1e-3).epsilon)
    # The released noises Y (= B × the SGD steps) solve C·Y = σC_clip·Z, Z from the streams of the seed.
    rng = Randomness(SEED).child("make_private:1")
    cinv = np.linalg.inv(strategy_matrix(banded_coefficients(STEPS, BANDS), STEPS))
    for name in ("weight", "bias"):
        y = np.stack([d[name].flatten().numpy() * B for d in deltas])
        z = np.stack([rng.stream("noise", t, name).normal(deltas[0][name].shape).double().flatten().numpy()
                      for t in range(STEPS)]) * sigma * 0.5
        np.testing.assert_allclose(y, cinv @ z, atol=2e-6)
        np.testing.assert_allclose(y.sum(0), (cinv @ z).sum(0), atol=1e-5)  # the noise of the weights
    # The secret buffers are never in what users save with their checkpoints.
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"} and not sd["state"]  # SGD without momentum: no state
    assert len(mech.buffers) == BANDS - 1 and mech.next_step == STEPS
    eng.detach()


def test_make_private_banded_resume_from_the_secret_file_equals_one_run(tmp_path):
    """3 steps, save_noise_state (0600), a fresh engine + load_noise_state, 3 more == 6 straight."""
    sigma = 0.9
    full, _, m_full, _ = _mp_loop(noise_multiplier=sigma)
    path = tmp_path / "noise.secret.pt"
    a, _, m_a, _ = _mp_loop(noise_multiplier=sigma, upto=3, save=path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    b, opt_b, m_b, _ = _mp_loop(noise_multiplier=sigma, load=path)
    assert b.ledger.steps == STEPS and _flat(b.ledger) == _flat(full.ledger)  # the ledger continues
    assert opt_b.dp_step.spec.mechanism.next_step == STEPS
    # b started from the initial weights (a user would load a's): compare the moves (pure noise here)
    torch.manual_seed(0)
    init = nn.Linear(4, 3)
    for (n, p_full), p_a, p_b, p_i in zip(m_full.named_parameters(), m_a.parameters(), m_b.parameters(),
                                          init.parameters()):
        # first 3 steps (a) + last 3 steps (b, from the restored buffers) = the 6 uninterrupted steps
        torch.testing.assert_close((p_a - p_i) + (p_b - p_i), p_full - p_i, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="already made steps"):
        b.load_noise_state(path)
    for e in (full, a, b):
        e.detach()


def test_make_private_truncated_records_the_truncated_event():
    """Every logical batch ≤ B_max and the ledger is steps × TruncatedSubsampledGaussian; σ
    calibration on that event is the same helper as DPTrainer's (calibrated in the DPTrainer test)."""
    from dpft.step.mechanisms import sampler_phase_event

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    eng = PrivacyEngine()
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        dataset=data, expected_batch_size=16, max_grad_norm=1.0, noise_multiplier=1.7, steps=4, max_batch_size=12)
    while opt.logical_steps < 4:
        for x, y in loader:
            assert len(x) <= 12
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert _flat(eng.ledger) == [truncated_event(40, 0.4, 12, 1.7)] * 4
    # the phase event σ is calibrated on (resolve_sigma) is the composition of the recorded events
    assert sampler_phase_event(opt.dp_step.spec.sampler, 40, 0.4, 4)(1.7) == dpa.SelfComposedDpEvent(
        truncated_event(40, 0.4, 12, 1.7), 4)
    eng.detach()


def test_make_private_banded_refusals(tmp_path, monkeypatch):
    def mp(**kw):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        base = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    criterion=nn.CrossEntropyLoss(), dataset=TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,))),
                    expected_batch_size=B, max_grad_norm=1.0, noise_multiplier=1.0, steps=4, mechanism="banded_mf")
        base.update(kw)
        eng = PrivacyEngine()
        return eng, eng.make_private(**base)

    with pytest.raises(ValueError, match="user-level"):
        mp(user_ids=[i % 5 for i in range(N)])
    with pytest.raises(ValueError, match="no dp-accounting event; drop max_batch_size"):
        mp(max_batch_size=8)
    with pytest.raises(ValueError, match="bands must be an integer ≥ 1"):
        mp(bands=0)
    with pytest.raises(ValueError, match="bands is the b of mechanism='banded_mf'"):
        mp(mechanism="gaussian", bands=4)
    with pytest.raises(ValueError, match="mechanism must be"):
        mp(mechanism="banded")
    with pytest.raises(ValueError, match=r"p = b·B/N = 1.33 > 1; lower bands or expected_batch_size"):
        mp(bands=16)
    with pytest.raises(ValueError, match="needs epochs or steps"):
        mp(steps=None)
    import dpft.step.correlated as corr

    monkeypatch.setattr(corr, "MAX_BUFFER_BYTES", 16)
    with pytest.raises(ValueError, match="noise buffers of the trainable parameters"):
        mp(bands=2)
    monkeypatch.undo()
    eng, _ = mp(mechanism="gaussian")
    with pytest.raises(ValueError, match="not mechanism='banded_mf'"):
        eng.save_noise_state(tmp_path / "x.pt")
    eng, _ = mp(bands=2)
    with pytest.raises(FileNotFoundError, match="cannot continue without it"):
        eng.load_noise_state(tmp_path / "missing.pt")


def test_secret_partition_travels_with_the_noise_state():
    """Secure mode: a resumed run has a fresh key, so a fresh sampler draws other partitions; the
    noise state carries the old ones (else an example could participate at steps s − 1 and s)."""
    from dpft.step.correlated import CyclicPoissonSampler
    from dpft.step.mechanisms import make_banded_mechanism

    params = {"w": torch.zeros(3)}
    s1 = CyclicPoissonSampler(200, 10, Randomness(), 4)
    m1 = make_banded_mechanism(params, 1.0, 1.0, Randomness(), s1, 8)
    m1.add_noise({"w": torch.zeros(3)}, 0)
    s2 = CyclicPoissonSampler(200, 10, Randomness(), 4)
    assert not torch.equal(s1.partition, s2.partition)
    m2 = make_banded_mechanism(params, 1.0, 1.0, Randomness(), s2, 8)
    m2.load_state(m1.state())
    assert torch.equal(s2.partition, s1.partition) and m2.next_step == 1
    with pytest.raises(ValueError, match="no partition of these 100 examples"):
        make_banded_mechanism(params, 1.0, 1.0, Randomness(), CyclicPoissonSampler(100, 10, Randomness(), 4),
                              8).load_state(m1.state())


# ----------------------------------------------------------------------------- DPTrainer
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

from conftest import tiny_classifier  # noqa: E402
from dpft.integrations.hf.trainer import DPArguments, DPTrainer  # noqa: E402


def _rows(n=40, t=6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (n, t), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def _trainer(out, dp, max_steps, save_steps=None, callbacks=None):
    args = TrainingArguments(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=max_steps,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    return DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=_rows(),
                     data_collator=default_data_collator, dp_args=dp, callbacks=callbacks)


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def _record_noise(mech, out):
    orig = mech.add_noise

    def add_noise(grad_sum, step):
        noisy = orig(grad_sum, step)
        out.append({k: (noisy[k].double() - grad_sum[k].double()) for k in grad_sum})
        return noisy

    mech.add_noise = add_noise


def test_dptrainer_banded_checkpoint_resume_noise_and_refusals(tmp_path):
    """3 steps of b = 2 with a checkpoint at step 2 and a stop; a new DPTrainer resumes from it: the
    3 released noises are C⁻¹Z (the buffers crossed the resume), the ledger continues (2 events,
    its ε that of the banded phase event), the secret file is 0600 outside checkpoint-*/; without it resume refuses."""
    out = tmp_path / "out"
    sigma = 0.8  # fixed: σ calibration on the banded events is the make_private test's (the same helper)
    dp = DPArguments(noise_multiplier=sigma, target_delta=1e-3, expected_batch_size=8, mechanism="banded_mf", bands=2,
                     reproducible_seed=SEED)
    noises: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t1 = _trainer(out, dp, 3, save_steps=2, callbacks=[_StopAt(2)])
        _record_noise(t1.mechanism, noises)
        t1.train()
        secret = out / NOISE_STATE_FILE
        assert t1.state.global_step == 2 and secret.is_file() and os.stat(secret).st_mode & 0o777 == 0o600
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "ledger.json", NOISE_STATE_FILE]
        bufs = [v for b in t1.mechanism.buffers for v in b.values()]
        optim = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)
        flat = [v for st in optim["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]
        assert bufs and not any(v.shape == b.shape and torch.equal(v, b) for v in flat for b in bufs)
        with pytest.raises(ValueError, match="already released 2 correlated steps"):
            t1.train()  # a second fresh train() would restart at step 0 against the buffers
        t2 = _trainer(out, dp, 3)
        _record_noise(t2.mechanism, noises)
        t2.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert t2.state.global_step == 3 and len(noises) == 3
    p = 2 * 8 / 40
    assert _flat(t2.ledger) == _banded_events(p, t1.sigma, 3, 2)
    assert t2.get_epsilon() == pytest.approx(epsilon_of([banded_phase_event(sigma, p, 3, 2)], 1e-3).epsilon)
    rng = Randomness(SEED).child("hf-train-loop-1")
    cm = torch.from_numpy(strategy_matrix(banded_coefficients(3, 2), 3))
    for name, t in noises[0].items():
        y = torch.stack([s[name].flatten() for s in noises])
        z = torch.stack([rng.stream("noise", k, name).normal(t.shape).double().flatten() for k in range(3)])
        assert float((cm @ y - t1.sigma * z).abs().max()) < 1e-5
    # Resume without the secret file, or from a checkpoint older than the state: refused.
    secret.unlink()
    with pytest.raises(ValueError, match="is missing; the correlated noise cannot continue"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(out, dp, 3).train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_dptrainer_truncated_calibrates_on_the_truncated_event(tmp_path):
    """σ is calibrated on 3 × TruncatedSubsampledGaussian(N, q, B_max, σ) and the mechanism records
    that event (a training run's batches and ledger: audit/ways_in_mechanisms.plan_parts_checks and, per way in,
    reaches_session_check, run by tests/test_audit.py and by the planted-bug test below)."""
    from dpft.step.truncated import TruncatedPoissonSampler

    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=16, max_batch_size=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(tmp_path / "out", dp, 3)
    assert isinstance(tr.sampler, TruncatedPoissonSampler) and tr.sampler.max_batch_size == 11
    assert tr.sampler.truncation == (40, 11) and tr.mechanism.step_event == tr.sampler.step_event
    assert tr.mechanism.event(0.4) == truncated_event(40, 0.4, 11, tr.sigma)
    eps = epsilon_of([dpa.SelfComposedDpEvent(truncated_event(40, 0.4, 11, tr.sigma), 3)], 1e-3).epsilon
    assert eps <= 4.0 + 1e-6 and eps == pytest.approx(4.0, abs=0.03)
    assert max(len(tr.sampler.indices(t)) for t in range(20)) <= 11


def test_dpt_arguments_refusals(tmp_path):
    base = dict(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8)
    with pytest.raises(ValueError, match="no dp-accounting event"):
        DPArguments(**base, mechanism="banded_mf", max_batch_size=10)
    with pytest.raises(ValueError, match="bands must be an integer ≥ 1"):
        DPArguments(**base, mechanism="banded_mf", bands=0)
    with pytest.raises(ValueError, match="bands is the b of"):
        DPArguments(**base, bands=3)
    with pytest.raises(ValueError, match="user-level privacy"):
        DPArguments(**base, mechanism="banded_mf", user_column="u")
    with pytest.raises(ValueError, match="user-level privacy"):
        DPArguments(**base, max_batch_size=4, user_column="u")
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        DPArguments(**base, max_batch_size=0)
    assert DPArguments(**base, mechanism="banded_mf").bands == 4
    with pytest.raises(ValueError, match=r"p = b·B/N = 1.6 > 1; lower bands"):
        _trainer(tmp_path / "o", DPArguments(**base, mechanism="banded_mf", bands=8), 2)


# ----------------------------------------------------------------------------- audit
@pytest.mark.parametrize("planted", ["api_banded_every_partition", "no_min_separation",
                                     "trainer_truncation_not_recorded"])
def test_mechanisms_api_audit_catches_planted_bugs(planted):
    """Each planted bug fails the part of the checks it breaks: the session plan's parts on make_private's loops,
    and DPTrainer's thin check (the honest checks run, and must pass, in
    tests/test_audit.py::test_honest_step_passes with the other optional modules; the secret state's planted
    ``api_noise_state_in_optimizer`` is tests/test_plan.py's, audit/checks_resume.py)."""
    from dpft.audit import ways_in_mechanisms as cm
    from dpft.audit.planted import ALL
    from dpft.audit.suite import OPTIONAL_CHECKS

    assert set(cm.PLANTED) <= set(ALL)
    assert ("dpft.audit.ways_in_mechanisms", "mechanisms_api_checks", cm.MECHANISMS_PLANTED) in OPTIONAL_CHECKS
    loops = dict(cm.LOOPS)
    part = {"api_banded_every_partition": lambda: cm.plan_parts_checks(cm.run_loops(loops["make_private"])),
            "no_min_separation": lambda: cm.plan_parts_checks(cm.run_loops(loops["make_private"])),
            "trainer_truncation_not_recorded": lambda: [cm.reaches_session_check(
                "DPTrainer", cm.run_loops(loops["DPTrainer"]))]}[planted]
    with cm.planted_bug(planted):
        checks = part()
    assert any(not c.passed for c in checks), planted
