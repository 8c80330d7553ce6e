"""Multi-process data parallel (distributed.py): 2 CPU processes (gloo) against 1 process,
on a tiny random BERT. The ranks are forked from pytest with the environment torchrun sets
(``torch.multiprocessing.start_processes`` from a fork server: torch is imported once, not
once per rank and launch, which keeps the tests fast on a loaded machine); one test launches
the CLI with torchrun itself.

- a 2-process run equals a 1-process run in reproducible mode: same ledger and ε, same
  logical batches (the ranks' shares are disjoint and cover each), weights within float
  tolerance (dropout 0; only the order of the float sums differs), identical weights on both
  ranks; rank 0 alone writes (rank 1 runs in a directory of its own, which stays empty);
- secure mode: the ranks draw the same logical batch from rank 0's broadcast key; a run
  killed (SIGKILL) after a checkpoint resumes with the single-process ledger rules (the live
  ledger never shrinks; the replayed step is counted again);
- a checkpoint is resumed only by as many processes as wrote it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from dpft.accounting.ledger import PrivacyLedger
from dpft.config.recipe import load_recipe
from dpft.privacy.randomness import Randomness
from dpft.placement import world as ddp
from dpft.run.checkpoint import check_world_size
from dpft.run.loop import Trainer, TrainingError

import ddp_worker  # tests/ddp_worker.py: one rank of a run, with logs

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=2 ARGS`` (a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def overrides(model_dir, csv, **extra) -> dict:
    ov = {
        "model.name": str(model_dir), "model.max_length": 16, "model.dropout": 0.0,
        "task.name": "files", "task.train_file": str(csv),
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 3,
        "schedule.steps": 6, "schedule.warmup_steps": 1, "eval.every_steps": 6, "checkpoint_every": 3,
        "privacy.target_epsilon": 6.0, "privacy.delta": 1e-3, "privacy.engine": "bookkeeping",
        "optimizer.lr": 1e-2,
    }
    ov.update(extra)
    return ov


@pytest.fixture(scope="module")
def csv(tmp_path_factory) -> Path:
    import pandas as pd

    words = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull"]
    rows = [{"text": f"a {words[i % 8]} film number {i}" + " long" * (i % 5), "label": int(i % 8 % 2 == 0)}
            for i in range(60)]
    p = tmp_path_factory.mktemp("ddpdata") / "d.csv"
    pd.DataFrame(rows).to_csv(p, index=False)
    return p


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_then_two(worker, jobs: dict, root: Path) -> tuple[dict, list[dict]]:
    """``worker.run_jobs`` on ``jobs`` in this process (a 1-process gloo group: the same sharded step),
    then on 2 ranks forked from the fork server (``worker.forked_entry``). Returns (the 1-process
    result, [rank 0's, rank 1's] logs)."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        one = worker.run_jobs({"jobs": jobs, "out": str(root / "one")}, 0)
    finally:
        dist.destroy_process_group()
    logs = root / "logs"
    logs.mkdir()
    torch.multiprocessing.start_processes(worker.forked_entry, args=(
        {"jobs": jobs, "log_dir": str(logs), "out": str(root / "two")}, free_port()), nprocs=2, join=True,
        start_method="forkserver")
    return one, [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]


# Ranks are started from a fork server that imported dpft once and never ran a parallel torch
# op (forking pytest itself would inherit its OpenMP thread pool, which deadlocks libgomp).
multiprocessing.set_forkserver_preload(["ddp_worker", "dpft.run.loop", "dpft.outputs.report", "matplotlib.pyplot",
                                        "transformers.models.bert.modeling_bert",
                                        "transformers.models.bert.tokenization_bert"])


def launch_worker(tmp: Path, recipe: dict, **cfg) -> tuple[Exception | None, list[dict]]:
    """tests/ddp_worker.py on 2 ranks with the torchrun environment, forked from a fork server
    (no second import of torch per rank); like torchrun's agent, when one rank dies the other
    is terminated. Returns the failure (None = both ranks finished) and each rank's log."""
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for f in logs.glob("rank*.json"):
        f.unlink()
    conf = {"recipe": recipe, "output_dir": "run", "cwds": [str(tmp / "rank0"), str(tmp / "rank1")],
            "log_dir": str(logs), **cfg}
    failure = None
    try:
        torch.multiprocessing.start_processes(ddp_worker.forked_entry, args=(conf, free_port()), nprocs=2,
                                              join=True, start_method="forkserver")
    except ProcessException as exc:
        failure = exc
    out = [json.loads((logs / f"rank{r}.json").read_text()) if (logs / f"rank{r}.json").is_file() else {}
           for r in range(2)]
    return failure, out


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


@pytest.fixture(scope="module")
def one_and_two(tiny_model_dir, csv, tmp_path_factory):
    """The same reproducible recipe run by 1 process (in-process) and by 2 (torchrun)."""
    # A fixed σ (calibration runs on rank 0 like every other file-free decision, via on_rank0;
    # it costs seconds of PLD per process on a loaded machine).
    ov = overrides(tiny_model_dir, csv, **{"privacy.reproducible": True, "privacy.noise_multiplier": 0.8})
    one_dir = tmp_path_factory.mktemp("one") / "run"
    batches: dict[int, list[int]] = {}
    real_shard = ddp.shard
    trainer = Trainer(load_recipe(None, ov), one_dir, progress=False)
    step = {"t": 0}
    real_step = trainer.step

    def counting_step(t):
        step["t"] = t
        return real_step(t)

    def recording_shard(idx, world):
        batches[step["t"]] = sorted(int(i) for i in idx)
        return real_shard(idx, world)

    trainer.step = counting_step
    ddp.shard = recording_shard
    try:
        rep_one = trainer.run()
    finally:
        ddp.shard = real_shard
    two = tmp_path_factory.mktemp("two")
    failure, logs = launch_worker(two, ov, probe=True)
    assert failure is None, failure
    return {"one_dir": one_dir, "rep_one": rep_one, "batches": batches, "trainer": trainer,
            "two_dir": two / "rank0" / "run", "two_root": two, "logs": logs}


def test_two_processes_equal_one_in_reproducible_mode(one_and_two):
    d = one_and_two
    one, two = d["one_dir"], d["two_dir"]
    # Same ledger (every event, count and certification) and the same ε.
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    assert PrivacyLedger.load(two / "ledger.json").steps == 6
    rep_two = json.loads((two / "report.json").read_text())
    assert rep_two["privacy"]["epsilon"] == d["rep_one"]["privacy"]["epsilon"]
    assert json.loads((two / "checkpoint" / "state.json").read_text())["world_size"] == 2
    # Same logical batches: both ranks drew the 1-process batch; their shares split it.
    r0, r1 = d["logs"]
    for t in range(6):
        full = d["batches"][t]
        assert r0["batches"][str(t)] == r1["batches"][str(t)] == full
        s0, s1 = r0["shares"][str(t)], r1["shares"][str(t)]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == full
    assert any(len(d["batches"][t]) > 3 for t in range(6))  # several micro-batches per rank at times
    # Weights: equal up to the order of float sums; bit-identical on the two ranks.
    pa, pb = load_file(str(one / "checkpoint" / "trainable.safetensors")), \
        load_file(str(two / "checkpoint" / "trainable.safetensors"))
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)
    assert r0["digest"] == r1["digest"]
    # A secret key made on each rank (K different logical batches) is refused on every rank.
    assert "different secret randomness" in r0["own_rng"] and "different secret randomness" in r1["own_rng"]
    # A weight changed on rank 1 after the run: found, and rank 0's copy restored everywhere.
    assert r0["in_sync"] == r1["in_sync"] == [False, True, True]
    # Every rank's dpft.train returned rank 0's report; the metrics agree with 1 process.
    assert r0["epsilon"] == r1["epsilon"] == rep_two["privacy"]["epsilon"]
    for k, v in d["rep_one"]["metrics"].items():
        assert rep_two["metrics"][k] == pytest.approx(v, rel=1e-5)


def test_user_level_two_processes_equal_one(tiny_model_dir, tmp_path):
    """User level under DDP (`task.user_column`): each rank clips whole users
    (distributed.shard_units), so 2 processes release what 1 does: same ledger over users, weights
    within float tolerance, bit-identical on both ranks."""
    import pandas as pd

    words = ["good", "bad", "great", "awful", "fine", "poor"]
    rows = [{"text": f"a {words[i % 6]} film {i}" + " long" * (i % 3), "label": int(i % 6 % 2 == 0),
             "who": f"u{i % 15}"} for i in range(60)]
    csv_u = tmp_path / "users.csv"
    pd.DataFrame(rows).to_csv(csv_u, index=False)
    ov = overrides(tiny_model_dir, csv_u, **{"privacy.reproducible": True, "privacy.noise_multiplier": 0.8,
                                             "task.user_column": "who", "task.max_rows_per_user": 2,
                                             "batch.expected_batch_size": 6, "schedule.steps": 3,
                                             "eval.every_steps": 3})
    one = tmp_path / "one" / "run"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, (r0, r1) = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    led = json.loads((one / "ledger.json").read_text())
    assert led == json.loads((two / "ledger.json").read_text())
    assert json.loads((two / "report.json").read_text())["dp"]["privacy_unit"]["unit"] == "user"
    pa, pb = load_file(str(one / "checkpoint" / "trainable.safetensors")), \
        load_file(str(two / "checkpoint" / "trainable.safetensors"))
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)
    assert r0["digest"] == r1["digest"]
    assert files_under(tmp_path / "two" / "rank1") == []


def test_shard_units_keeps_each_users_rows_on_one_rank():
    idx = torch.tensor([7, 3, 9, 1, 4, 8])
    users = torch.tensor([2, 2, 5, 0, 0, 0])  # users' rows contiguous, in the logical batch's order
    a, b = ddp.shard_units(idx, users, ddp.World(0, 2)), ddp.shard_units(idx, users, ddp.World(1, 2))
    assert a.tolist() == [7, 3, 1, 4, 8] and b.tolist() == [9]
    with pytest.raises(ValueError, match="contiguous"):
        ddp.shard_units(idx, torch.tensor([2, 5, 2, 0, 0, 0]), ddp.World(0, 2))


def test_rank0_alone_writes(one_and_two):
    """Rank 1 ran in a working directory of its own with the same relative --output-dir:
    nothing appeared there (and it never needed to read it)."""
    root = one_and_two["two_root"]
    assert files_under(root / "rank1") == []
    written = set(files_under(root / "rank0" / "run"))
    assert {"ledger.json", "metrics.jsonl", "recipe.yaml", "report.json", "report.md",
            "checkpoint/trainable.safetensors", "checkpoint/state.json", "model/config.json"} <= written
    rows = [json.loads(x) for x in (root / "rank0" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # one row per step, not one per rank


def test_resume_needs_the_same_world_size(one_and_two, tiny_model_dir, csv, tmp_path):
    # A 2-process checkpoint resumed by 1 process: refused, naming the torchrun command.
    rec = load_recipe(None, json.loads(json.dumps(one_and_two["trainer"].recipe.model_dump(mode="json"))))
    with pytest.raises(TrainingError, match=r"written by 2 process\(es\).*torchrun --nproc_per_node=2"):
        Trainer(rec, one_and_two["two_dir"], resume=True, progress=False).run()
    # A 1-process checkpoint resumed by 2 (the CLI under torchrun): both ranks refuse, exit ≠ 0.
    one = tmp_path / "one"
    Trainer(load_recipe(None, overrides(tiny_model_dir, csv, **{"schedule.steps": 1, "privacy.noise_multiplier": 1.0})),
            one, progress=False).run()
    (one / "report.json").unlink()  # else --resume refuses a finished run first (issue 36)
    flags = ["-m", "dpft", "train", str(one / "recipe.yaml"), "-o", str(one), "--resume", "--quiet"]
    proc = torchrun(flags)
    assert proc.returncode != 0
    assert proc.stderr.count("written by 1 process(es) but this run has 2") == 2, proc.stderr[-3000:]
    assert "without torchrun" in proc.stderr


def test_killed_run_resumes_with_the_single_process_ledger_rules(tiny_model_dir, csv, tmp_path):
    """Secure mode (the key is drawn by rank 0 and broadcast). Rank 0 is SIGKILLed at the start
    of step 5 (index 4), after the checkpoint of step 3: the live ledger holds steps 1-4; the
    resumed 2-process run replays step 4 with fresh randomness, appends it and stops at step 5
    of 6 so that ε stays within the plan's (issue 36: 6 releases, as planned; rank 0 decides and
    every rank stops there)."""
    ov = overrides(tiny_model_dir, csv, **{"privacy.noise_multiplier": 1.0})
    failure, logs = launch_worker(tmp_path, ov, kill={"rank": 0, "step": 4})
    assert isinstance(failure, ProcessExitedException)
    run = tmp_path / "rank0" / "run"
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 3
    before = PrivacyLedger.load(run / "ledger.json")
    assert before.steps == 4
    # One logical batch for the world from the broadcast secret key.
    r0, r1 = logs
    for t in ("0", "1", "2", "3"):
        assert r0["batches"][t] == r1["batches"][t]
        assert sorted(r0["shares"][t] + r1["shares"][t]) == r0["batches"][t]

    failure, logs = launch_worker(tmp_path, ov, resume=True)
    assert failure is None, failure
    after = PrivacyLedger.load(run / "ledger.json")
    assert after.steps == 6  # 4 before the kill + steps 4-5 after it: never shrunk, never above the plan
    assert after.to_json()["entries"][0]["event"] == before.to_json()["entries"][0]["event"]
    assert logs[0]["ledger_steps"] == logs[1]["ledger_steps"] == 6
    assert logs[0]["digest"] == logs[1]["digest"]
    assert set(logs[0]["batches"]) == set(logs[1]["batches"]) == {"3", "4"}
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert files_under(tmp_path / "rank1") == []


@pytest.mark.parametrize("plant", ["tokenise", "noise"])
def test_step_digest_stops_a_rank_mismatch_before_release(tiny_model_dir, csv, tmp_path, plant):
    """Rank 1 tokenises differently (its share overlaps rank 0's: an example counted twice) or
    draws its noise from another key: the per-step digest stops the run at the first step, on
    both ranks, naming rank 1, before any metrics row, checkpoint or report is written."""
    # Reproducible streams: with a secret key the first logical batch can hold so few rows that
    # rank 1's flipped lengths sort them in the same order (no mismatch until a later step).
    ov = overrides(tiny_model_dir, csv, **{"privacy.noise_multiplier": 1.0, "schedule.steps": 2,
                                           "privacy.reproducible": True})
    failure, logs = launch_worker(tmp_path, ov, plant=plant)
    assert failure is not None
    for log in logs:
        assert "DistributedError" in log["error"] and "DDP step 0" in log["error"], log
        assert "ranks [1]" in log["error"]
        assert ("logical batch" in log["error"]) == (plant == "tokenise")
    run = tmp_path / "rank0" / "run"
    assert (run / "metrics.jsonl").read_text() == ""
    assert not (run / "checkpoint").exists() and not (run / "report.md").exists() and not (run / "model").exists()


def test_step_digest_is_a_no_op_alone_and_sees_every_bit():
    p = {"w": torch.arange(6.0)}
    ddp.check_step_digest(ddp.World(), 0, torch.tensor([3, 1]), p)  # one process: nothing to compare
    a = ddp.step_digest(0, torch.tensor([3, 1]), p)
    assert torch.equal(a, ddp.step_digest(0, torch.tensor([3, 1]), {"w": torch.arange(6.0)}))
    assert a[1] != ddp.step_digest(0, torch.tensor([1, 3]), p)[1]  # the order the shares are cut from
    q = {"w": torch.arange(6.0)}
    q["w"][5] = torch.nextafter(q["w"][5], torch.tensor(10.0))  # one bit of one weight
    assert a[2] != ddp.step_digest(0, torch.tensor([3, 1]), q)[2]


# -- in-process units (no second process) ----------------------------------------------------
def test_shared_key_round_trip_and_shares():
    a = Randomness()
    b = Randomness.from_key(bytes(a.key_tensor().tolist()))
    assert a.seed_for("sample", 3) == b.seed_for("sample", 3) and not b.reproducible
    idx = torch.arange(11)
    worlds = [ddp.World(r, 3) for r in range(3)]
    shares = [ddp.shard(idx, w) for w in worlds]
    assert sorted(torch.cat(shares).tolist()) == idx.tolist()
    assert ddp.shard(idx, ddp.World()) is idx
    # Dropout: the single-process stream alone; per rank under DDP.
    assert ddp.dropout_seed(a, 5, ddp.World()) == a.seed_for("dropout", 5)
    assert len({ddp.dropout_seed(a, 5, w) for w in worlds}) == 3


def test_single_process_needs_no_launcher(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
              "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert ddp.init_from_env() == ddp.World()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ddp.init_from_env() == ddp.World()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ddp.DistributedError, match="RANK.*torchrun --nproc_per_node"):
        ddp.init_from_env()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # K independent runs of one directory: refused
    with pytest.raises(ddp.DistributedError, match="MPI launcher.*torchrun"):
        ddp.init_from_env()
    assert ddp.on_rank0(ddp.World(), lambda: 7) == 7 and ddp.all_sum(ddp.World(), [1, 2.5]) == [1.0, 2.5]


def test_world_size_check_and_refused_methods():
    assert check_world_size({"step": 3}, 1, Path("r")) is None  # written before DDP: one process
    msg = check_world_size({"world_size": 4}, 2, Path("r"))
    assert "written by 4 process(es) but this run has 2" in msg and "--nproc_per_node=4" in msg

    class M:
        def __init__(self, name):
            self.name = name

    from dpft.methods.base import registered

    two = ddp.World(0, 2)
    ddp.check_methods(two, [M("rmt"), M("dp_adam_ac")], registry=registered())  # looked up in the caller's registry
    ddp.check_methods(two, [M("dpsft")], registry=registered())  # stage 1 too runs as a world (issue 38)
    with pytest.raises(ddp.DistributedError, match="rmt"):
        ddp.check_methods(two, [M("rmt")])  # no registry handed in: an undeclared object is refused
    with pytest.raises(ddp.DistributedError, match="percentile"):
        ddp.check_methods(two, [], keep_norms=True)
    ddp.check_methods(ddp.World(), [M("ewft")], keep_norms=True)  # one process: everything runs
