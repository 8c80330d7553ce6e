"""Banded MF and truncated Poisson under FSDP2 (``perf.sharding: fsdp``, dpft/fsdp.py; issue 38 item 3):
2 CPU processes (gloo) against 1 process of the same reproducible recipe — the same ledger (the
mechanism's own events: banded PoissonSampled/NoOp, ``TruncatedSubsampledGaussianDpEvent``), the same
trainable weights within float tolerance — and, in one process, the sharded noise of each mechanism is
the same whatever the number of ranks (each shard's slice of the block layout; banded MF's buffers
hold the shard's slice of the one-process buffers)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dpft.config import load_recipe
from dpft.run.loop import Trainer

from test_ddp import launch_worker  # noqa: E402 (tests/ helpers)
from test_fsdp import fsdp_recipe, lm_dirs  # noqa: F401 (module fixture)

CASES = {
    "truncated": {"batch.max_batch_size": 6},
}


def _weights_close(a, b):
    pa = load_file(str(a / "checkpoint" / "trainable.safetensors"))
    pb = load_file(str(b / "checkpoint" / "trainable.safetensors"))
    assert pa.keys() == pb.keys() and pa
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_mechanism_two_processes_equal_one(lm_dirs, tmp_path, case):  # noqa: F811
    ov = fsdp_recipe(lm_dirs, "gpt2", **CASES[case])
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, two))
    assert la == lb
    assert "TruncatedSubsampledGaussianDpEvent" in json.dumps(la)
    # fixed shapes: every micro-batch of every rank has max_physical_batch_size rows
    assert all(m[0] == 2 for log in logs for ms in log["micro"].values() for m in ms)
    _weights_close(one, two)


@pytest.mark.slow
def test_fsdp_banded_two_processes_equal_one_and_resume(lm_dirs, tmp_path):  # noqa: F811
    """Banded MF (b = 2) and AdamW under FSDP: a SIGINT reaches rank 1 during step index 2, the world
    stops with the checkpoint at step 3 (gathered weights, name-keyed AdamW state, the gathered secret
    buffers, mode 0600 outside checkpoint/); ``--resume`` on 2 processes (each rank its slice) runs
    step 4 — and the whole equals the uninterrupted 1-process run (ledger, weights within 1e-5)."""
    import os

    from dpft.step.correlated import NOISE_STATE_FILE

    ov = fsdp_recipe(lm_dirs, "gpt2", **{"privacy.mechanism": "banded_mf", "privacy.bands": 2, "schedule.steps": 4,
                                         "optimizer.name": "adamw", "optimizer.lr": 0.01, "eval.every_steps": 4,
                                         "checkpoint_every": 4})
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 2})
    assert failure is None, failure
    assert r0["interrupted"] == r1["interrupted"] == "interrupted (SIGINT) at step 3 of 4; checkpoint at step 3"
    run = two / "rank0" / "run"
    st = torch.load(run / NOISE_STATE_FILE, weights_only=True)
    assert (os.stat(run / NOISE_STATE_FILE).st_mode & 0o777) == 0o600 and st["next_step"] == 3
    full = load_file(str(run / "checkpoint" / "trainable.safetensors"))
    assert all(st["buffers"][0][n].shape == full[n].shape for n in full)  # gathered, not one rank's slice
    failure, (r0, r1) = launch_worker(two, ov, resume=True)
    assert failure is None, failure
    assert set(r0["batches"]) == {"3"}
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, run))
    assert la == lb and "NoOpDpEvent" in json.dumps(la) and "PoissonSampledDpEvent" in json.dumps(la)
    _weights_close(one, run)


def _sharded_noise(mech_factory, shapes, k, steps):
    """The noise the K simulated shards of each tensor add over ``steps`` steps, reassembled."""
    from dpft import fsdp

    out = []
    mechs = []
    for r in range(k):
        layout = {n: (torch.Size(s).numel(), *fsdp.chunk_range(s, r, k)) for n, s in shapes.items()}
        mechs.append(fsdp.shard_mechanism(mech_factory(), layout))
    for t in range(steps):
        parts = {n: [] for n in shapes}
        for r, m in enumerate(mechs):
            zeros = {n: torch.zeros(m.layout[n][2]) for n in shapes}
            noisy, _ = m.release(zeros, 1.0, 0.1, t)
            for n in shapes:
                parts[n].append(noisy[n])
        out.append({n: torch.cat(parts[n]) for n in shapes})
    return out, mechs


@pytest.mark.parametrize("kind", ["gaussian", "truncated", "banded_mf"])
def test_sharded_mechanism_noise_is_world_size_invariant(kind):
    from dpft.privacy.randomness import Randomness
    from dpft.step.correlated import BandedMFMechanism, banded_coefficients
    from dpft.step.noise import GaussianMechanism

    def make():
        rng = Randomness(7)
        if kind == "banded_mf":
            return BandedMFMechanism(2.0, 1.0, rng, banded_coefficients(6, 3), 0.3)
        m = GaussianMechanism(2.0, 1.0, rng)
        if kind == "truncated":
            m.truncation = (100, 8)
        return m

    shapes = {"w": (7, 3), "b": (5,)}
    one, m1 = _sharded_noise(make, shapes, 1, 4)
    for k in (2, 3):
        many, mk = _sharded_noise(make, shapes, k, 4)
        for t in range(4):
            for n in shapes:
                assert torch.equal(many[t][n], one[t][n]), (k, t, n)
        # the same ledger event as the unsharded mechanism, step by step
        base = make()
        for t in range(4):
            ev = base.event_at(t) if kind == "banded_mf" else base.event(0.1)
            assert mk[0].event_at(t) == ev if kind == "banded_mf" else mk[0].event(0.1) == ev
    if kind == "banded_mf":  # correlated: step 1's noise is not a fresh draw (y_1 depends on y_0)
        assert len(m1[0].buffers) == 2 and m1[0].buffers[0]["w"].shape == (21,)
        assert not torch.equal(one[1]["w"], one[0]["w"])
    # noise std σC on the fresh draw
    assert 1.0 < float(one[0]["w"].std()) < 3.5


@pytest.mark.slow
def test_fsdp_user_level_two_processes_equal_one(tiny_model_dir, tmp_path):
    """User level under FSDP (``task.user_column``, group clipping): each rank clips whole users
    (``distributed.shard_units``), placeholders keep the collectives in step; 2 processes release what
    1 does — the same ledger over users, the same weights within float tolerance."""
    import pandas as pd

    from test_ddp import overrides

    words = ["good", "bad", "great", "awful", "fine", "poor"]
    rows = [{"text": f"a {words[i % 6]} film {i}" + " long" * (i % 3), "label": int(i % 6 % 2 == 0),
             "who": f"u{i % 15}"} for i in range(60)]
    csv_u = tmp_path / "users.csv"
    pd.DataFrame(rows).to_csv(csv_u, index=False)
    ov = overrides(tiny_model_dir, csv_u, **{"privacy.reproducible": True, "privacy.noise_multiplier": 0.8,
                                             "privacy.target_epsilon": None, "privacy.engine": "auto",
                                             "task.user_column": "who", "task.max_rows_per_user": 2,
                                             "batch.expected_batch_size": 6, "schedule.steps": 3,
                                             "eval.every_steps": 3, "perf.sharding": "fsdp"})
    one = tmp_path / "one" / "run"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, (r0, r1) = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    assert json.loads((two / "report.json").read_text())["dp"]["privacy_unit"]["unit"] == "user"
    for t in ("0", "1", "2"):  # whole users per rank
        assert not set(r0["shares"][t]) & set(r1["shares"][t])
        assert sorted(r0["shares"][t] + r1["shares"][t]) == r0["batches"][t]
    _weights_close(one, two)
