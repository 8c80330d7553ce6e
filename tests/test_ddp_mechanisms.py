"""Issue 28's mechanisms under DDP (docs/mechanisms.md): 2 CPU processes (gloo) against 1
process in reproducible mode, launched as tests/test_ddp.py does (forked ranks with torchrun's
environment, tests/ddp_worker.py).

- banded_mf (b = 3, 6 steps): the cyclic partitions, the noise z and so the secret buffers are
  the world's (bit-identical on both ranks after every step); rank 0 alone writes the noise state
  (mode 0600), equal to the 1-process buffers; a run interrupted by a SIGINT that reaches rank 1
  alone stops on both ranks with a checkpoint at its last release, and resumes on 2 processes
  from that file to the 1-process ledger and weights.
- truncated Poisson (B_max = 6 at q·N = 8, so truncation happens): both ranks keep the
  1-process subset; every micro-batch on every rank is exactly P × model.max_length.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer
from dpft.step.correlated import NOISE_STATE_FILE

from test_ddp import csv, files_under, launch_worker, overrides  # noqa: F401  (csv: the shared fixture)


def _weights_close(a_dir, b_dir):
    pa = load_file(str(a_dir / "checkpoint" / "trainable.safetensors"))
    pb = load_file(str(b_dir / "checkpoint" / "trainable.safetensors"))
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_banded_mf_two_processes_equal_one_and_resume(tiny_model_dir, csv, tmp_path):  # noqa: F811
    b = 3
    # σ = 2: a cheap PLD (the test is about the noise being the world's, not about its size).
    ov = overrides(tiny_model_dir, csv, **{"privacy.reproducible": True, "privacy.noise_multiplier": 2.0,
                                           "privacy.mechanism": "banded_mf", "privacy.bands": b})
    # One process, 6 steps (2·b: steps 3-5 subtract the buffers of steps 1-4); keep the buffers
    # after step 4 (where the 2-process run below is interrupted).
    one = tmp_path / "one" / "run"
    trainer = Trainer(load_recipe(None, ov), one, progress=False)
    at4 = {}
    real_step = trainer.step

    def step(t):
        out = real_step(t)
        if t == 3:
            at4["buffers"] = [{k: v.clone() for k, v in buf.items()} for buf in trainer.mechanism.buffers]
        return out

    trainer.step = step
    rep_one = trainer.run()
    assert len(at4["buffers"]) == b - 1

    # Two processes; a SIGINT reaches rank 1 alone during step index 3 (as Ctrl-C or a scheduler's
    # SIGTERM may reach one process first): the world finishes that step and both ranks stop
    # with the checkpoint at step 4, their last release (so the banded resume is allowed).
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 3})
    assert failure is None, failure
    assert r0["interrupted"] == r1["interrupted"] == "interrupted (SIGINT) at step 4 of 6; checkpoint at step 4"
    run = two / "rank0" / "run"
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 4
    assert r0["ledger_steps"] == r1["ledger_steps"] == 4
    # The world's cyclic partitions and noise: same batches and buffers on both ranks.
    for t in ("0", "1", "2", "3"):
        assert r0["batches"][t] == r1["batches"][t]
        assert sorted(r0["shares"][t] + r1["shares"][t]) == r0["batches"][t]
        assert r0["noise"][t] == r1["noise"][t]
    # Rank 0 alone wrote the secret state, owner-only, outside checkpoint/; it is the 1-process one.
    state = run / NOISE_STATE_FILE
    assert (os.stat(state).st_mode & 0o777) == 0o600
    assert files_under(two / "rank1") == []
    assert not any("noise" in p for p in files_under(run / "checkpoint"))
    st = torch.load(state, weights_only=True)
    assert st["next_step"] == 4 and len(st["buffers"]) == b - 1
    for saved, want in zip(st["buffers"], at4["buffers"]):
        assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)

    # Resumed on 2 processes: steps 4-5 from the restored buffers = the uninterrupted 1-process run.
    failure, (r0, r1) = launch_worker(two, ov, resume=True)
    assert failure is None, failure
    assert set(r0["batches"]) == {"4", "5"}
    for t in ("4", "5"):
        assert r0["batches"][t] == r1["batches"][t] and r0["noise"][t] == r1["noise"][t]
    assert r0["digest"] == r1["digest"]
    assert json.loads((one / "ledger.json").read_text()) == json.loads((run / "ledger.json").read_text())
    rep_two = json.loads((run / "report.json").read_text())
    assert rep_two["privacy"]["epsilon"] == rep_one["privacy"]["epsilon"] == r0["epsilon"] == r1["epsilon"]
    assert rep_two["dp"]["mechanism"]["bands"] == b and rep_two["dp"]["mechanism"]["participations_accounted"] == 2
    _weights_close(one, run)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert files_under(two / "rank1") == []


def test_truncated_poisson_two_processes_equal_one_with_fixed_shapes(tiny_model_dir, csv, tmp_path):  # noqa: F811
    p, length, b_max, steps = 2, 16, 6, 4
    # σ = 3: the truncated event's PLD takes ~0.8 s (σ = 0.8: ~5 s per ε, several per run).
    ov = overrides(tiny_model_dir, csv, **{"privacy.reproducible": True, "privacy.noise_multiplier": 3.0,
                                           "batch.max_batch_size": b_max, "batch.max_physical_batch_size": p,
                                           "schedule.steps": steps, "eval.every_steps": steps,
                                           "checkpoint_every": steps})
    one = tmp_path / "one" / "run"
    trainer = Trainer(load_recipe(None, ov), one, progress=False)
    drawn, kept = [], []
    real_truncate = trainer.sampler.truncate

    def truncate(idx, t):
        out = real_truncate(idx, t)
        drawn.append(len(idx))
        kept.append(sorted(int(i) for i in out))
        return out

    trainer.sampler.truncate = truncate
    rep_one = trainer.run()
    assert len(kept) == steps
    assert any(d > b_max for d in drawn), drawn  # truncation happened (P[Bin(N, q) > 6] ≈ 0.7 per step)
    assert all(len(k) == min(d, b_max) for d, k in zip(drawn, kept))

    failure, (r0, r1) = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    for t in range(steps):
        s = str(t)
        # The world's truncated subset (stream ``truncate``, t, from the shared key) on both ranks.
        assert r0["batches"][s] == r1["batches"][s] == kept[t]
        for r in (r0, r1):
            share = len(r["shares"][s])
            # Fixed shapes per rank: ⌈share / P⌉ micro-batches, each exactly P × max_length,
            # padded rows flagged (a rank with fewer rows runs fewer micro-batches: the step
            # all-reduces once per logical step, never per micro-batch).
            assert len(r["micro"][s]) == math.ceil(share / p)
            assert all(m[:2] == [p, length] for m in r["micro"][s]), r["micro"][s]
            assert sum(m[2] for m in r["micro"][s]) == share
    steps_s = [str(t) for t in range(steps)]
    assert any(len(r0["micro"][s]) != len(r1["micro"][s]) for s in steps_s)  # uneven shares were run
    assert any(m[2] < p for r in (r0, r1) for s in steps_s for m in r["micro"][s])  # padded rows were run
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    rep_two = json.loads((two / "report.json").read_text())
    assert rep_two["privacy"]["epsilon"] == rep_one["privacy"]["epsilon"]
    assert rep_two["dp"]["mechanism"] == rep_one["dp"]["mechanism"]
    _weights_close(one, two)
    assert r0["digest"] == r1["digest"]
    assert files_under(tmp_path / "two" / "rank1") == []
