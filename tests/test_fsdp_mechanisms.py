"""Banded MF and truncated Poisson under FSDP2 (``perf.sharding: fsdp``, dpft/placement/fsdp.py; issue 38 item 3):
2 CPU processes (gloo) against 1 process of the same reproducible recipe — the same ledger (the
mechanism's own events: banded PoissonSampled/NoOp, ``TruncatedSubsampledGaussianDpEvent``), the same
trainable weights within float tolerance — and, in one process, the sharded noise of each mechanism is
the same whatever the number of ranks (each shard's slice of the block layout; banded MF's buffers
hold the shard's slice of the one-process buffers). ``--resume`` (dpft/placement/fsdp_checkpoint.py): per-rank
``torch.distributed.checkpoint`` shards of weights, optimizer state and the secret banded buffers
(0700 folder, 0600 files, outside ``checkpoint/``), resumed on the same and on another number of
processes (2 save → 1 resumes) equal to the uninterrupted run; old gathered checkpoints still read."""

from __future__ import annotations

import json

import pytest
import torch
from dpft.config.recipe import load_recipe
from dpft.placement.fsdp_checkpoint import SECRET_SHARDS_DIR, SHARDS_DIR, read_trainable
from dpft.run.loop import Trainer
from dpft.step.truncated import TruncatedPoissonSampler, truncated_event

from test_ddp import launch_worker  # noqa: E402 (tests/ helpers)
from test_fsdp import fsdp_recipe, lm_dirs  # noqa: F401 (module fixture)

CASES = {
    "truncated": {"batch.max_batch_size": 6},
}


def _weights_close(a, b):
    rank1 = b.parent.parent / "rank1" / "run"  # a 2-process run: rank 1's shards under its own folder
    pa, pb = read_trainable(a), read_trainable(b, *([rank1] if rank1.is_dir() else []))
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


BANDED = {"privacy.mechanism": "banded_mf", "privacy.bands": 2, "schedule.steps": 4, "optimizer.name": "adamw",
          "optimizer.lr": 0.01, "eval.every_steps": 4, "checkpoint_every": 4}


def _check_secret_layout(run, step: int, ranks: int) -> None:
    """The DCP checkpoint of ``step``: the weights and optimizer state in ``checkpoint_shards/``, the
    banded buffers per rank in the secret folder (0700, files 0600) — and nothing secret in the
    release set (``checkpoint/``, ``checkpoint_shards/``)."""
    import os

    from dpft.step.correlated import NOISE_STATE_FILE

    st = json.loads((run / "checkpoint" / "state.json").read_text())
    top, name = st["sharded_checkpoint"].split("/")
    assert top == SHARDS_DIR and name.startswith(f"step-{step:08d}-") and (run / top / name / ".metadata").is_file()
    assert [p.name for p in (run / SHARDS_DIR).iterdir()] == [name]  # earlier steps' folders removed
    small = torch.load(run / NOISE_STATE_FILE, weights_only=True)
    assert (os.stat(run / NOISE_STATE_FILE).st_mode & 0o777) == 0o600 and small["next_step"] == step
    assert small["buffers"] == [] and small["buffers_dcp"] == f"{SECRET_SHARDS_DIR}/{name}"
    secret = run / SECRET_SHARDS_DIR
    assert [p.name for p in secret.iterdir()] == [name]  # earlier steps' folders removed
    for d in (secret, secret / name):
        assert (os.stat(d).st_mode & 0o777) == 0o700
    files = [f for f in (secret / name).rglob("*") if f.is_file()]
    assert len([f for f in files if f.suffix == ".distcp"]) == ranks
    assert all((os.stat(f).st_mode & 0o777) == 0o600 for f in files)
    released = [f.name for d in ("checkpoint", SHARDS_DIR) for f in (run / d).rglob("*")]
    assert not any("secret" in f or "noise" in f for f in released)


@pytest.mark.slow
def test_fsdp_banded_two_processes_equal_one_and_resume(lm_dirs, tmp_path):  # noqa: F811
    """Banded MF (b = 2) and AdamW under FSDP: a SIGINT reaches rank 1 during step index 2, the world
    stops with the checkpoint at step 3 — per-rank DCP shards (weights, name-keyed AdamW state; the
    secret buffers in their own 0700 folder, 0600 files, outside checkpoint/; each rank under its own run
    folder, as on hosts without a shared file system). With the ranks' files put together, as a shared
    file system shows them, ``--resume`` on 2 processes runs step 4, and ``--resume`` on 1 process runs it
    too: both equal the uninterrupted 1-process run (ledger, weights within 1e-5)."""
    import shutil

    import dpft

    ov = fsdp_recipe(lm_dirs, "gpt2", **BANDED)
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 2})
    assert failure is None, failure
    assert r0["interrupted"] == r1["interrupted"] == "interrupted (SIGINT) at step 3 of 4; checkpoint at step 3"
    run = two / "rank0" / "run"
    _check_secret_layout(run, 3, ranks=1)  # rank 1's files are under its own run folder (another host)
    cross = tmp_path / "cross"  # the ranks' files in one folder (a shared file system)
    shutil.copytree(run, cross)
    rank1 = two / "rank1" / "run"
    for sub in (SHARDS_DIR, SECRET_SHARDS_DIR):
        shutil.copytree(rank1 / sub, cross / sub, dirs_exist_ok=True)
    _check_secret_layout(cross, 3, ranks=2)
    for sub in (SHARDS_DIR, SECRET_SHARDS_DIR):  # the two ranks' folders as one shared folder would show them
        shutil.copytree(cross / sub, run / sub, dirs_exist_ok=True)
        shutil.copytree(cross / sub, rank1 / sub, dirs_exist_ok=True)
    failure, (r0, r1) = launch_worker(two, ov, resume=True)
    assert failure is None, failure
    assert set(r0["batches"]) == {"3"}
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, run))
    assert la == lb and "NoOpDpEvent" in json.dumps(la) and "PoissonSampledDpEvent" in json.dumps(la)
    _weights_close(one, run)
    dpft.train(ov, cross, resume=True, progress=False)  # 2 processes saved, 1 resumes (DCP reshards)
    assert json.loads((cross / "ledger.json").read_text()) == la
    _weights_close(one, cross)


def _interrupt_at(monkeypatch, step: int) -> None:
    """A SIGINT during logical step ``step`` (the run's handler finishes it and checkpoints)."""
    import os
    import signal

    real = Trainer.step

    def step_(self, t):
        if t == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, t)

    monkeypatch.setattr(Trainer, "step", step_)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*assuming the intent is to load in a single process")
def test_fsdp_dcp_resume_one_process_equals_uninterrupted(lm_dirs, tmp_path, monkeypatch):  # noqa: F811
    """1 process, ``perf.sharding: fsdp`` (about 30 s: four runs): banded MF + AdamW interrupted at step 3 checkpoint
    through DCP (layout and permissions of :func:`_check_secret_layout`) and ``--resume`` equals the
    uninterrupted run (a shard file missing is refused, naming the fix); an old gathered checkpoint (``trainable.safetensors`` + the optimizer's own
    state, buffers in the secret file) made from it resumes to the same run too."""
    import dpft
    from safetensors.torch import save_file

    from dpft.step.correlated import NOISE_STATE_FILE, write_secret

    ov = fsdp_recipe(lm_dirs, "gpt2", **BANDED)
    one = tmp_path / "one"
    dpft.train(ov, one, progress=False)
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _interrupt_at(m, 2)
        with pytest.raises(KeyboardInterrupt, match="checkpoint at step 3"):
            dpft.train(ov, run, progress=False)
    _check_secret_layout(run, 3, ranks=1)
    import shutil

    lost = tmp_path / "lost"  # a shard file this rank cannot see: refused with the fix, before any read
    shutil.copytree(run, lost)
    for f in (lost / SHARDS_DIR).rglob("*.distcp"):
        f.unlink()
    with pytest.raises(ValueError, match="every rank must see every rank's checkpoint files"):
        dpft.train(ov, lost, resume=True, progress=False)

    old = tmp_path / "old"  # the same checkpoint in the old, gathered format
    shutil.copytree(run, old)
    st = json.loads((old / "checkpoint" / "state.json").read_text())
    folder = old / st.pop("sharded_checkpoint")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    (old / "checkpoint" / "state.json").write_text(json.dumps(st))
    save_file({n: t.contiguous() for n, t in full["model"].items()}, str(old / "checkpoint" / "trainable.safetensors"))
    names = list(full["model"])
    ost = full["optim"]  # name-keyed (get_optimizer_state_dict) → the optimizer's own, index-keyed state
    optim = {"state": {names.index(n): v for n, v in ost["state"].items()},
             "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]} for g in ost["param_groups"]]}
    ck = torch.load(old / "checkpoint" / "optim.pt", weights_only=True)
    torch.save({"optimizer": optim, "scheduler": ck["scheduler"]}, old / "checkpoint" / "optim.pt")
    small = torch.load(old / NOISE_STATE_FILE, weights_only=True)
    bufs = {"buffers": {str(j): {n: torch.zeros_like(t) for n, t in full["model"].items()}
                        for j in range(small["buffers_count"])}}
    dcp.load(bufs, checkpoint_id=str(old / small["buffers_dcp"]), no_dist=True)
    small.update(buffers=[bufs["buffers"][str(j)] for j in range(small.pop("buffers_count"))])
    small.pop("buffers_dcp")
    write_secret(old / NOISE_STATE_FILE, small)
    shutil.rmtree(old / SHARDS_DIR)
    shutil.rmtree(old / SECRET_SHARDS_DIR)
    for d in (run, old):
        dpft.train(ov, d, resume=True, progress=False)
        assert json.loads((d / "ledger.json").read_text()) == json.loads((one / "ledger.json").read_text())
        _weights_close(one, d)


def _tiny_sharded_trainer(run_dir, seed: int):
    """What dpft/placement/fsdp_checkpoint.py reads of a driver (run/loop.Trainer), over a tiny MLP in one process:
    AdamW after two noisy banded-MF steps (b = 3: two buffers), the mechanism as FSDPStep shards it."""
    from types import SimpleNamespace

    from dpft.placement import fsdp
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.placement.world import World
    from dpft.privacy.randomness import Randomness
    from dpft.step.correlated import BandedMFMechanism, banded_coefficients

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    base = BandedMFMechanism(1.0, 1.0, Randomness(5), banded_coefficients(6, 3), 0.5)
    mech = fsdp.shard_mechanism(base, {n: (p.numel(), 0, p.numel()) for n, p in params.items()})
    mech.world, mech.shapes = World(), {n: (tuple(p.shape), tuple(p.shape)) for n, p in params.items()}
    tr = SimpleNamespace(world=World(), mechanism=mech, run_dir=run_dir, params=params, model=model, optimizer=opt,
                         scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0), ledger=PrivacyLedger(),
                         _last_checkpoint=None)
    tr._state = lambda: {"world_size": 1}
    return tr


def _tiny_steps(tr, steps) -> None:
    for t in steps:
        noisy = tr.mechanism.add_noise({n: torch.zeros_like(p) for n, p in tr.params.items()}, t)
        for n, p in tr.params.items():
            p.grad = noisy[n]
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)


def test_fsdp_state_dcp_round_trip_fast(tmp_path):
    """Fast (one process, a tiny MLP): dpft/placement/fsdp_checkpoint.py's per-rank checkpoint — weights and AdamW
    state through DCP (``checkpoint/`` names the shard folder; its safetensors is empty), the banded
    buffers in the secret folder (0700, files 0600) — loads into a fresh model, optimizer and mechanism
    (``local_buffers``), and the next steps equal the uninterrupted ones; ``read_trainable`` reads the
    weights back; an old gathered checkpoint still loads."""
    import os

    from dpft.placement import fsdp_checkpoint as fsdp_state
    from dpft.run import checkpoint as ckpt
    from dpft.step.correlated import NOISE_STATE_FILE, load_noise_state

    ref = _tiny_sharded_trainer(tmp_path / "ref", 0)
    _tiny_steps(ref, range(4))
    tr = _tiny_sharded_trainer(tmp_path / "run", 0)
    _tiny_steps(tr, range(2))
    fsdp_state.save_checkpoint(tr, 2, ckpt.save_checkpoint)
    run = tmp_path / "run"
    st = json.loads((run / "checkpoint" / "state.json").read_text())
    top, name = st["sharded_checkpoint"].split("/")
    secret = run / SECRET_SHARDS_DIR / name
    assert top == SHARDS_DIR and (run / top / name / ".metadata").is_file()
    assert all(os.stat(d).st_mode & 0o777 == 0o700 for d in (secret.parent, secret))
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in secret.iterdir()) and any(secret.iterdir())
    assert os.stat(run / NOISE_STATE_FILE).st_mode & 0o777 == 0o600
    assert not [f for f in (run / "checkpoint").iterdir() if "noise" in f.name or "secret" in f.name]
    saved = {n: p.detach().clone() for n, p in tr.params.items()}
    assert all(torch.equal(fsdp_state.read_trainable(run)[n], saved[n]) for n in saved)

    def resumed(folder):
        fresh = _tiny_sharded_trainer(folder, 1)  # other initial weights: all must come from the checkpoint
        ck = ckpt.load_checkpoint(folder)
        ck["noise_state"] = load_noise_state(folder)
        fsdp_state.load_checkpoint(fresh, ck)
        fresh.mechanism.load_state(ck["noise_state"], fresh.params)
        assert all(torch.equal(fresh.params[n], saved[n]) for n in saved)
        _tiny_steps(fresh, range(2, 4))
        for n, p in ref.params.items():
            torch.testing.assert_close(fresh.params[n], p, rtol=1e-6, atol=1e-7)

    resumed(run)
    old = tmp_path / "old"  # the old, gathered format: full tensors, the optimizer's own state, full buffers
    tr.run_dir = old
    ckpt.save_checkpoint(old, step=2, params=tr.params, optimizer=tr.optimizer, scheduler=tr.scheduler,
                         ledger_json=tr.ledger.to_json(), state={"world_size": 1})
    from dpft.step.correlated import write_secret

    write_secret(old / NOISE_STATE_FILE, tr.mechanism.state())
    resumed(old)


def _sharded_noise(mech_factory, shapes, k, steps):
    """The noise the K simulated shards of each tensor add over ``steps`` steps, reassembled."""
    from dpft.placement import fsdp

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
        if kind == "truncated":  # the event is the sampler's, handed to the release
            return GaussianMechanism(2.0, 1.0, rng, step_event=TruncatedPoissonSampler(100, 10, rng, 8).step_event)
        return GaussianMechanism(2.0, 1.0, rng)

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
        if kind == "truncated":
            assert base.event(0.1) == truncated_event(100, 0.1, 8, 2.0)
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
