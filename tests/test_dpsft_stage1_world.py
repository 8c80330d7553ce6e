"""DP-SFT stage 1 (``subspace.source: public | private``) in a world of processes (issue 38;
methods/dpsft/stage1.py): stage 1 is a world run of the driver like any other, the snapshots are the full
trainable parameters (gathered under FSDP2, kept on rank 0), the basis P is built once on rank 0 and
broadcast, then stage 2 runs as before.

Fast: ``share_basis`` on a 1-process gloo group and alone; the snapshots of a world keep full tensors on
rank 0 only. Slow: ``dpft train`` on 2 gloo processes (``perf.sharding`` fsdp and ddp) equals 1 process
(reproducible mode): the ledger (stage 1's events once for the world under phase ``subspace``, then stage
2's), the saved basis within float tolerance, the final weights within float tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpft.config.recipe import load_recipe
from dpft.placement.world import World
from dpft.methods.dpsft.stage1 import Snapshots, share_basis
from dpft.run.loop import Trainer
from dpft.transforms.subspace import SubspaceBasis, SubspaceError

from test_ddp import free_port, launch_worker  # noqa: E402 (tests/ helpers)
from test_fsdp_methods import _weights_close  # noqa: E402

K = 3


def _basis() -> SubspaceBasis:
    g = torch.Generator().manual_seed(0)
    return SubspaceBasis(blocks={"w": torch.randn(K, 4, 2, generator=g), "b": torch.randn(K, 4, generator=g)},
                         singular_values=torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64),
                         start={"w": torch.randn(4, 2, generator=g), "b": torch.randn(4, generator=g)},
                         meta={"source": "private", "ledger": {"entries": []}})


def test_share_basis_alone_and_on_a_gloo_group():
    """Alone: ``build()`` itself. On a (1-rank) gloo group: the broadcast path gives the same blocks, Θ*,
    singular values and meta; an error of rank 0's build is raised (not a hang)."""
    b = _basis()
    assert share_basis(None, lambda: b, torch.device("cpu")) is b
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        w = World(0, 1)
        assert share_basis(w, lambda: b, torch.device("cpu")) is b  # a 1-process world: no collective

        class Two(World):  # rank 0 of a "world" whose collectives run on the 1-rank group
            @property
            def distributed(self):
                return True

        got = share_basis(Two(0, 1), lambda: b, torch.device("cpu"))
        assert got is not b and got.meta == b.meta and got.blocks.keys() == b.blocks.keys()
        for n in b.blocks:
            assert torch.equal(got.blocks[n], b.blocks[n]) and torch.equal(got.start[n], b.start[n])
        assert torch.equal(got.singular_values, b.singular_values)

        def bad():
            raise SubspaceError("rank(A) = 1 < k = 3")

        with pytest.raises(SubspaceError, match="rank"):
            share_basis(Two(0, 1), bad, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_snapshots_keep_full_tensors_on_rank0_only(monkeypatch):
    """In a world, rank 0 keeps the full snapshots (in the parameters' order), another rank none; both
    count the records (they take part in every gather)."""
    from dpft.methods.dpsft import stage1 as dpsft_stage1

    params = {"w": torch.zeros(4, 2), "b": torch.zeros(4)}
    monkeypatch.setattr(dpsft_stage1, "full_on_rank0", lambda t: {n: t[n].detach() for n in sorted(t)})

    class W(World):
        @property
        def distributed(self):
            return True

    s0 = Snapshots([1, 2])
    s0.start(params, W(0, 2))
    assert list(s0.snapshots) == ["w", "b"] and s0.snapshots["w"].shape == (2, 4, 2)
    params["w"] += 1.0
    s0(1, params)
    assert torch.equal(s0.snapshots["w"][0], torch.ones(4, 2)) and s0.recorded == 1
    monkeypatch.setattr(dpsft_stage1, "full_on_rank0", lambda t: None)
    s1 = Snapshots([1, 2])
    s1.start(params, W(1, 2))
    s1(1, params)
    s1(2, params)
    assert s1.snapshots == {} and s1.recorded == 2


# -- 2 processes = 1 process (slow) ------------------------------------------------------------------------
def _recipe(model_dir: Path, csv: Path, sharding: str, source: str, public_csv: Path | None) -> dict:
    ov = {"model.name": str(model_dir), "model.max_length": 16, "model.dropout": 0.0, "task.name": "files",
          "task.train_file": str(csv), "privacy.noise_multiplier": 1.0, "privacy.target_epsilon": None,
          "privacy.delta": 1e-3, "privacy.reproducible": True, "schedule.steps": 3, "schedule.decay": "constant",
          "batch.expected_batch_size": 9, "batch.max_physical_batch_size": 2, "eval.every_steps": 3,
          "checkpoint_every": 3, "perf.sharding": sharding, "optimizer.name": "sgd", "optimizer.lr": 0.5,
          "subspace.source": source, "subspace.k": K, "subspace.snapshots": K, "subspace.steps": K,
          "subspace.lr": 0.5}
    if source == "public":
        ov["subspace.public_task"] = {"name": "files", "train_file": str(public_csv)}
    return ov


@pytest.fixture
def public_csv(tmp_path) -> Path:
    import pandas as pd

    words = ["nice", "ugly", "superb", "boring", "ok", "weak"]
    rows = [{"text": f"the {words[i % 6]} show {i}", "label": int(i % 6 % 2 == 0)} for i in range(40)]
    p = tmp_path / "public.csv"
    pd.DataFrame(rows).to_csv(p, index=False)
    return p


@pytest.mark.slow
@pytest.mark.parametrize("sharding,source", [("fsdp", "private"), ("ddp", "private"), ("fsdp", "public")])
def test_dpft_train_dpsft_stage1_two_processes_equal_one(tiny_model_dir, sst_like_files, public_csv, tmp_path,
                                                         sharding, source):
    """``dpft train`` with DP-SFT's stage 1 in this run: 2 processes = 1 process — the ledger (a private
    stage 1's K events once, phase ``subspace``, then stage 2's 3), ε, the basis P rank 0 saved and its Θ*
    (within float tolerance), and the final weights (every rank unprojects with its own P: a rank with
    another P would move its rows elsewhere)."""
    ov = _recipe(tiny_model_dir, sst_like_files["csv"], sharding, source, public_csv)
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    assert logs[0]["world_size"] == 2
    two = tmp_path / "two" / "rank0" / "run"
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, two))
    assert la == lb
    want = ([("subspace", K)] if source == "private" else []) + [("train", 3)]
    assert [(e["phase"], e["count"]) for e in la["entries"]] == want
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (one, two))
    assert ra["privacy"]["epsilon"] == rb["privacy"]["epsilon"]
    ba, bb = (SubspaceBasis.load(d / "subspace" / "basis.safetensors") for d in (one, two))
    assert not (tmp_path / "two" / "rank1" / "run" / "subspace" / "basis.safetensors").exists()  # rank 0 writes
    assert ba.blocks.keys() == bb.blocks.keys() and ba.k == K
    dp = max(float((ba.blocks[n] - bb.blocks[n]).abs().max()) for n in ba.blocks)
    ds = max(float((ba.start[n] - bb.start[n]).abs().max()) for n in ba.start)
    for n in ba.blocks:
        torch.testing.assert_close(bb.blocks[n], ba.blocks[n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(bb.start[n], ba.start[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bb.singular_values, ba.singular_values, rtol=1e-4, atol=1e-7)
    assert ba.meta["source"] == bb.meta["source"] == source
    _weights_close(one, two, 1e-5)
    print(f"dpsft stage 1 {source} {sharding}: 2 vs 1 process: max |ΔP| = {dp:.3g}, max |ΔΘ*| = {ds:.3g}; "
          f"ledger equal")


@pytest.mark.slow
def test_an_interrupted_world_stage1_is_refused_on_every_rank(tiny_model_dir, sst_like_files, public_csv, tmp_path):
    """DDP: a SIGINT reaches rank 1 during stage 1's step index 1; the world checkpoints stage 1 (rank 0's
    folder alone) and stops. Stage 1 cannot be continued (its snapshots were in memory only; the run itself has
    no checkpoint, so ``--resume`` is refused): a new start in the same folder stops on every rank, also rank 1
    whose folder holds no stage-1 checkpoint, with the fix (no rank waits at a collective)."""
    ov = _recipe(tiny_model_dir, sst_like_files["csv"], "ddp", "private", public_csv)
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 1})
    assert failure is None, failure
    assert r0["interrupted"].startswith("interrupted (SIGINT)") and r1["interrupted"].startswith("interrupted (SIGINT)")
    assert (two / "rank0" / "run" / "subspace" / "stage1" / "checkpoint").exists()
    assert not (two / "rank1" / "run" / "subspace" / "stage1" / "checkpoint").exists()
    failure, (r0, r1) = launch_worker(two, ov)
    assert failure is not None
    for log in (r0, r1):
        assert "was interrupted before its basis was written" in log["error"], log
