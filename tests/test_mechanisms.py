"""Issue 28: truncated Poisson with fixed shapes and banded matrix factorization."""

from __future__ import annotations

import json
import math
import os
import time

import dp_accounting as dpa
import numpy as np
import pytest
import torch

from conftest import files_recipe
from dpft.accounting.ledger import PrivacyLedger, epsilon_of
from dpft.audit.trainer_walk import trainer_plan
from dpft.privacy.randomness import Randomness
from dpft.step.correlated import (NOISE_STATE_FILE, BandedMFMechanism, CyclicPoissonSampler, banded_coefficients,
                                  banded_phase_event, prefix_sum_loss)
from dpft.step.truncated import (EXAMPLE_MASK, MaskedEngine, TruncatedPoissonSampler, fixed_micro_batches,
                                 pad_to_length, truncated_event, truncation_probability)


# ----------------------------------------------------------------------------- truncated Poisson
def test_truncated_sampler_never_exceeds_the_bound_and_keeps_a_subset_of_the_draw():
    s = TruncatedPoissonSampler(300, 60, Randomness(), max_batch_size=40)
    sizes = []
    for t in range(30):
        drawn, kept = s.draw(t, s.q), s.indices(t)
        assert len(kept) == min(len(drawn), 40) and bool(torch.isin(kept, drawn).all())
        assert torch.equal(kept, kept.sort().values)
        sizes.append(len(drawn))
    assert max(sizes) > 40  # the bound was exercised (q·N = 60)
    assert s.truncation_probability == pytest.approx(truncation_probability(300, 0.2, 40))
    from scipy import stats

    assert s.truncation_probability == pytest.approx(float(stats.binom.sf(40, 300, 0.2)))


def test_fixed_shapes_and_padded_rows_contribute_nothing():
    from dpft.audit.whitebox import tiny_classifier
    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.models.losses import classification_loss
    from dpft.step.clip import FlatClip

    chunks = fixed_micro_batches(torch.arange(10), 4)
    assert [len(c) for c, _ in chunks] == [4, 4, 4] and [int(m.sum()) for _, m in chunks] == [4, 4, 2]
    assert fixed_micro_batches(torch.arange(0), 4) == []
    ids = torch.randint(1, 64, (6, 5), generator=torch.Generator().manual_seed(0))
    b = pad_to_length({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "position_ids": torch.arange(5).expand(6, 5), "labels": torch.zeros(6, dtype=torch.long)}, 8, 0)
    assert b["input_ids"].shape == (6, 8) and int(b["attention_mask"][:, 5:].sum()) == 0
    assert b["position_ids"][0].tolist() == list(range(8)) and b["labels"].shape == (6,)
    b["labels"] = torch.tensor([0, 1, 1, 0, 1, 0])
    eng = MaskedEngine(BookKeepingEngine(tiny_classifier("bert"), classification_loss, FlatClip(0.1)))
    ref = eng.clipped_sum({k: v[:4] for k, v in b.items()})
    pad = eng.clipped_sum({**b, EXAMPLE_MASK: torch.tensor([True] * 4 + [False] * 2)})
    for k in ref.grad_sum:
        assert torch.equal(ref.grad_sum[k], pad.grad_sum[k]) or torch.allclose(ref.grad_sum[k], pad.grad_sum[k],
                                                                                 atol=1e-7)
    assert pad.n == 4 and pad.scales.shape[0] == 4 and pad.loss_sum == pytest.approx(ref.loss_sum)


def test_truncated_run_records_the_truncated_event_with_fixed_shapes(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    r = files_recipe(tiny_model_dir, sst_like_files, **{"batch.max_batch_size": 6, "batch.max_physical_batch_size": 4,
                                                        "privacy.noise_multiplier": 1.0})
    tr = Trainer(r, tmp_path / "run", progress=False)
    n, q = tr.n, tr.q
    idx = tr.sampler.indices(0)
    shapes = {tuple(mb["input_ids"].shape) for mb in tr.micro_batches(torch.arange(5))}
    assert shapes == {(4, r.model.max_length)} and len(idx) <= 6
    # the release records the sampler's event; the audit reads B_max off the sampler
    assert tr.mechanism.step_event == tr.sampler.step_event and trainer_plan(tr)["max_batch_size"] == 6
    rep = tr.run()
    want = truncated_event(n, q, 6, 1.0)
    assert [(e.event, e.count) for e in tr.ledger.entries] == [(want, 3)]
    pp = tr.plan.privacy  # what σ is calibrated on
    assert pp.mechanism.phase_event(pp.sampler, n, q, 3)(1.0) == dpa.SelfComposedDpEvent(want, 3)
    m = rep["dp"]["mechanism"]
    assert m["max_batch_size"] == 6 and m["truncation_probability_per_step"] == pytest.approx(
        truncation_probability(n, q, 6))
    assert math.isnan(rep["privacy"]["epsilon_rdp"]) and rep["privacy"]["epsilon"] > 0
    assert "P[truncated]" in (tmp_path / "run" / "report.md").read_text()


def test_mechanism_refusals_name_the_fix(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.errors import TrainingError
    from dpft.run.loop import Trainer

    r = files_recipe(tiny_model_dir, sst_like_files, **{"batch.max_batch_size": 6, "privacy.mechanism": "banded_mf",
                                                        "privacy.noise_multiplier": 1.0})
    with pytest.raises(TrainingError, match="drop batch.max_batch_size"):
        Trainer(r, tmp_path / "a", progress=False)
    r = files_recipe(tiny_model_dir, sst_like_files, **{"privacy.mechanism": "banded_mf", "privacy.bands": 8,
                                                        "privacy.noise_multiplier": 1.0})
    with pytest.raises(TrainingError, match="lower privacy.bands"):  # b·B = 64 > N
        Trainer(r, tmp_path / "b", progress=False)


# ----------------------------------------------------------------------------- banded MF
def test_banded_coefficients_are_normalised_and_beat_the_square_root_start():
    assert banded_coefficients(50, 1).tolist() == [1.0]
    losses = []
    for b in (1, 2, 4, 8):
        c = banded_coefficients(200, b)
        assert len(c) == b and c[0] > 0 and np.linalg.norm(c) == pytest.approx(1.0)
        losses.append(prefix_sum_loss(c, 200))
        bsr = np.array([math.comb(2 * j, j) / 4 ** j for j in range(b)])
        assert losses[-1] <= prefix_sum_loss(bsr / np.linalg.norm(bsr), 200) + 1e-9
    assert losses == sorted(losses, reverse=True) and losses[0] == 200 * 201 / 2  # b = 1: ‖A‖_F²


def test_banded_noise_is_c_inverse_z_across_steps():
    """Reproducible streams: C·Y = σC·Z exactly (Y the released noises), so the covariance across
    steps is σ²C²·C⁻¹C⁻ᵀ; b = 1 is DP-SGD's independent noise."""
    steps, b, dim, sigma, clip = 7, 3, 50, 0.8, 1.5
    c = banded_coefficients(steps, b)
    rng = Randomness(seed=3)
    m = BandedMFMechanism(sigma, clip, rng, c, 0.3)
    y = torch.stack([m.release({"w": torch.zeros(dim)}, clip, 0.1, t)[0]["w"].double() for t in range(steps)])
    z = torch.stack([rng.stream("noise", t, "w").normal((dim,)).double() for t in range(steps)]) * sigma * clip
    cm = sum(torch.diag(torch.full((steps - j,), float(v), dtype=torch.float64), -j) for j, v in enumerate(c))
    assert torch.allclose(cm @ y, z, atol=1e-5)
    assert len(m.buffers) == b - 1 and m.next_step == steps
    with pytest.raises(ValueError, match="in order"):
        m.release({"w": torch.zeros(dim)}, clip, 0.1, 2)
    m1 = BandedMFMechanism(sigma, clip, Randomness(seed=3), [1.0], 0.3)
    y1 = m1.release({"w": torch.zeros(dim)}, clip, 0.1, 0)[0]["w"]
    assert torch.allclose(y1.double(), z[0], atol=1e-6)
    with pytest.raises(ValueError, match="‖c‖ ≤ 1"):
        BandedMFMechanism(sigma, clip, rng, [1.0, 0.5], 0.3)


def test_cyclic_poisson_is_b_min_separated():
    s = CyclicPoissonSampler(200, 10, Randomness(), bands=4)
    assert s.partition_rate == pytest.approx(0.2) and s.q == pytest.approx(0.05)
    seen: dict[int, int] = {}
    for t in range(16):
        for i in s.indices(t).tolist():
            assert int(s.partition[i]) == t % 4
            assert i not in seen or t - seen[i] >= 4
            seen[i] = t
    with pytest.raises(ValueError, match="lower privacy.bands"):
        CyclicPoissonSampler(20, 10, Randomness(), bands=4)


def test_banded_ledger_records_ceil_n_over_b_participations():
    sigma, p, steps, b = 1.1, 0.2, 10, 4
    m = BandedMFMechanism(sigma, 1.0, Randomness(), banded_coefficients(steps, b), p)
    led = PrivacyLedger()
    for t in range(steps):
        led.record("train", m.release({"w": torch.zeros(2)}, 1.0, 0.05, t)[1])
    assert led.steps == steps  # one entry per step (interrupts and replays count steps)
    want = banded_phase_event(sigma, p, steps, b)
    assert want.count == 3
    assert led.epsilon(1e-5).epsilon == pytest.approx(epsilon_of([want], 1e-5).epsilon)
    # b = 1: exactly DP-SGD's events at rate q = p
    m1 = BandedMFMechanism(sigma, 1.0, Randomness(), [1.0], p)
    assert all(m1.release({"w": torch.zeros(2)}, 1.0, p, t)[1] == dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(sigma))
               for t in range(3))


def test_banded_calibration_uses_the_recorded_events():
    from dpft.accounting.calibrate import epsilon_for_sigma
    from dpft.step.build import resolve_sigma

    ev = lambda s: banded_phase_event(s, 0.2, 5, 3)  # noqa: E731  (⌈5/3⌉ = 2 participations)
    sigma = resolve_sigma(noise_multiplier=None, target_epsilon=3.0, delta=1e-3, q=0.2 / 3, steps=5, n=300,
                          phase_event=ev)
    assert epsilon_for_sigma(sigma, 0.0, 1, 1e-3, phase_event=ev) <= 3.0
    assert epsilon_for_sigma(sigma * 0.98, 0.0, 1, 1e-3, phase_event=ev) > 3.0


def test_banded_run_resumes_from_its_secret_noise_state(tiny_model_dir, sst_like_files, tmp_path):
    """Reproducible mode: 3 steps, checkpoint, resume for 3 more == 6 uninterrupted steps; the
    buffers live in an owner-only file outside the release set; without it resume refuses."""
    from dpft.run.errors import TrainingError
    from dpft.run.loop import Trainer
    from dpft.outputs.release import RELEASE_SET

    kw = {"privacy.mechanism": "banded_mf", "privacy.bands": 3, "privacy.noise_multiplier": 1.0,
          "privacy.reproducible": True, "schedule.steps": 6, "checkpoint_every": 3, "eval.every_steps": 6,
          "batch.expected_batch_size": 6}
    r = files_recipe(tiny_model_dir, sst_like_files, **kw)
    full = Trainer(r, tmp_path / "full", progress=False)
    full.run()
    part = Trainer(r, tmp_path / "part", progress=False)
    part._t_run = time.time()
    (tmp_path / "part").mkdir()
    for t in range(3):
        part.step(t)
    part.save(3)
    state = tmp_path / "part" / NOISE_STATE_FILE
    assert state.is_file() and (os.stat(state).st_mode & 0o777) == 0o600
    assert NOISE_STATE_FILE not in RELEASE_SET and not any("noise" in p.name for p in (tmp_path / "part" / "checkpoint").iterdir())
    res = Trainer(r, tmp_path / "part", resume=True, progress=False)
    res.run()
    for k, p in full.params.items():
        assert torch.allclose(p, res.params[k], atol=1e-6), k
    evs = [e for e in res.ledger.entries if not isinstance(e.event, dpa.NoOpDpEvent)]
    assert sum(e.count for e in evs) == 2 and res.ledger.steps == 6
    rep = json.loads((tmp_path / "part" / "report.json").read_text())
    assert rep["dp"]["mechanism"]["bands"] == 3 and rep["dp"]["mechanism"]["participations_accounted"] == 2
    state.unlink()
    with pytest.raises(TrainingError, match="noise buffers"):
        Trainer(r, tmp_path / "part", resume=True, progress=False).run()


def test_make_private_truncates_and_records_the_truncated_event():
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpft import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    eng = PrivacyEngine()
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=20), noise_multiplier=1.0, max_grad_norm=1.0, max_batch_size=12)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert sizes and max(sizes) <= 12
    assert [type(e.event).__name__ for e in eng.ledger.entries] == ["TruncatedSubsampledGaussianDpEvent"]
    assert eng.ledger.entries[0].event == truncated_event(40, 0.5, 12, 1.0)


@pytest.mark.parametrize("planted", [None, "banded_buffers_reset", "truncate_first_rows"])
def test_mechanism_audit_checks_pass_honest_and_catch_planted_bugs(planted):
    from dpft.audit.checks_mechanisms import mechanism_checks

    checks = mechanism_checks(planted)
    failed = [c.name for c in checks if not c.passed]
    assert (failed == []) if planted is None else failed, (planted, failed)
