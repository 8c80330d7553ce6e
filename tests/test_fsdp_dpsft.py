"""DP-SFT stage 2 on a given basis (``subspace.source: file``) under FSDP2 (issue 38; methods/dpsft/method.py,
dpft/placement/fsdp_methods.py ``ReplicatedSum``): each rank projects its own examples' full-layer gradients on the
replicated basis P (s_i = Σ_l P_lᵀ g_{i,l}), clips in R^k, the (k,) clipped sums are all-reduced once per
logical step and noised once for the world (the same draw on every rank), and each rank writes its own
rows of P z (``optimizer_space: coords``: every rank steps the same z and writes its rows of Θ_start + P z after
each step and after a load).

Slow: 2 CPU processes (gloo) equal 1 process — ``dpft train`` (``perf.sharding: fsdp``, a tiny BERT; with
``optimizer_space`` full and coords; and ``--resume`` after a stop at step 2 of 4 equal to the uninterrupted run),
``make_private`` on a caller ``fully_shard``-ed MLP, and ``DPTrainer`` (caller-sharded and ``fsdp=``): the
same ledger and ε, the weights within float tolerance. Fast: the maths on simulated ranks (the all-reduced
clipped coordinate sums of the ranks' shares, placeholders included, equal one process's; the ranks' rows
of P z put together equal P z), the audit's white-box check and its planted bugs, and that nothing is refused
(stage 1 in a world: tests/test_dpsft_stage1_world.py)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_dpsft_worker as worker  # tests/fsdp_dpsft_worker.py: a make_private loop / a DPTrainer run per rank
from dpft.config.recipe import load_recipe
from dpft.placement.world import World, shard
from dpft.placement.fsdp_methods import ReplicatedSum
from dpft.grads.subspace import COORDS, SubspaceEngine
from dpft.methods.dpsft import method as dpsft
from dpft.methods.dpsft.method import DPSFT, SubspaceCfg
from dpft.run.loop import Trainer
from dpft.placement.shards import chunk_rows
from dpft.step.aggregate import Aggregator
from dpft.step.clip import FlatClip
from dpft.transforms.subspace import SubspaceBasis

from test_ddp import files_under, launch_worker, one_then_two  # noqa: E402 (tests/ helpers)
from test_fsdp import fsdp_recipe, lm_dirs  # noqa: E402,F401 (module fixture)
from test_fsdp_methods import _weights_close  # noqa: E402

multiprocessing.set_forkserver_preload(["fsdp_dpsft_worker", "fsdp_methods_worker", "dpft", "dpft.api", "torch.distributed.fsdp"])

K = 3


def make_basis(model: nn.Module, path: Path, k: int = K, with_start: bool = False, seed: int = 2) -> Path:
    """A random orthonormal basis over ``model``'s trainable parameters, recorded as built by a private
    stage 1 (one PoissonSampled Gaussian event ×5 that the run's ledger must compose), saved to ``path``;
    ``with_start``: Θ* = the weights + a small perturbation (``subspace.start: stage1``)."""
    import dp_accounting as dpa

    from dpft.accounting.ledger import PrivacyLedger

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(seed)
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), k, generator=g))
    blocks, start, o = {}, {}, 0
    for n, p in params.items():
        blocks[n] = flat[o:o + p.numel()].T.reshape(k, *p.shape).contiguous()
        start[n] = p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        o += p.numel()
    led = PrivacyLedger()
    led.record("subspace", dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(3.0)), 5)
    SubspaceBasis(blocks=blocks, singular_values=torch.ones(k, dtype=torch.float64),
                  meta={"source": "private", "ledger": led.to_json()}, start=start if with_start else None).save(path)
    return path


# -- the maths on simulated ranks (fast) -----------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _loss(fwd, b):
    return nn.functional.cross_entropy(fwd(input=b["x"]), b["y"], reduction="none")


def _basis(model: nn.Module) -> SubspaceBasis:
    params = dict(model.named_parameters())
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), K,
                                          generator=torch.Generator().manual_seed(1)))
    blocks, o = {}, 0
    for n, p in params.items():
        blocks[n] = flat[o:o + p.numel()].T.reshape(K, *p.shape).contiguous()
        o += p.numel()
    return SubspaceBasis(blocks=blocks, singular_values=torch.ones(K, dtype=torch.float64), meta={"source": "public"})


def _batch(n: int = 9) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    x[2] *= 40  # a clipped example
    return {"x": x, "y": torch.randint(0, 3, (n,), generator=g)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduced_clipped_coordinate_sums_of_the_shares_equal_one_process(world_size):
    """Each simulated rank runs its share (every K-th example) in micro-batches of 2 through the engine with
    the sharded step's hook, a short rank padding with placeholders (which must add nothing); the
    simulated all-reduce of the ranks' (k,) sums equals the one-process clipped sum. Without the all-reduce
    (a rank's own sum) it does not."""
    n = {2: 9, 3: 7}[world_size]  # some rank runs a placeholder micro-batch
    model, batch = _mlp(), _batch(n)
    basis = _basis(model)
    eng = SubspaceEngine(model, _loss, FlatClip(0.3), basis)
    one = eng.clipped_sum(batch)
    assert one.sq_norms.max() > 0.09 > one.sq_norms.min()  # some examples clipped, some not
    idx = torch.arange(n)
    shares = [shard(idx, World(r, world_size)) for r in range(world_size)]
    counts = [-(-len(s) // 2) for s in shares]
    most = max(counts)
    assert min(counts) < most
    aggs = []
    for r, mine in enumerate(shares):
        hook = ReplicatedSum(World(r, world_size))
        eng.on_param_sum = hook
        agg = Aggregator({COORDS: torch.zeros(K)})
        chunks = list(mine.split(2))
        for i in range(most):
            dummy = i >= len(chunks)
            hook.start(dummy)
            c = idx[:1] if dummy else chunks[i]  # a placeholder: row 0, the same on every rank
            res = eng.clipped_sum({k: v[c] for k, v in batch.items()})
            if dummy:
                assert torch.equal(res.grad_sum[COORDS], torch.zeros(K))
                agg.sum[COORDS].add_(res.grad_sum[COORDS])
            else:
                agg.add(res)
        aggs.append((hook, agg))
    eng.on_param_sum = None
    own = [a.sum[COORDS].clone() for _, a in aggs]
    assert not torch.allclose(own[0], one.grad_sum[COORDS], atol=1e-6)  # a rank's own sum is not the world's
    total = torch.stack(own).sum(0)
    for hook, agg in aggs:
        hook.reduce = lambda n, buf: buf.copy_(total)  # the simulated all-reduce
        hook.finish(agg)
        torch.testing.assert_close(agg.sum[COORDS], one.grad_sum[COORDS], rtol=1e-5, atol=1e-6)
    assert sum(a.batch_size for _, a in aggs) == n


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_ranks_rows_of_the_unprojection_equal_the_full_update(monkeypatch, world_size):
    """DP-SFT's unprojection (the transform ``build`` inserts) on simulated ranks, each holding FSDP's dim-0
    chunk of every parameter (``local_rows`` simulated): the rank's rows of P z, put together, equal P z."""
    model = _mlp()
    basis = _basis(model)
    params = dict(model.named_parameters())
    z = torch.randn(K, generator=torch.Generator().manual_seed(5))
    full = dpsft.unproject_held(basis, params)({COORDS: z}, {})
    for n, b in basis.blocks.items():
        torch.testing.assert_close(full[n], torch.einsum("k,k...->...", z, b))
    parts: dict[str, list] = {n: [] for n in params}
    for r in range(world_size):
        monkeypatch.setattr(dpsft, "local_rows", lambda p, r=r: chunk_rows(p.shape[0], r, world_size))
        out = dpsft.unproject_held(basis, params)({COORDS: z}, {})
        for n in params:
            a, b = chunk_rows(params[n].shape[0], r, world_size)
            assert out[n].shape == (b - a, *params[n].shape[1:])
            parts[n].append(out[n])
    for n in params:
        torch.testing.assert_close(torch.cat(parts[n]), full[n], rtol=0, atol=1e-7)


def test_nothing_is_refused_under_fsdp2_or_ddp():
    """Every source runs sharded and across processes (issue 38): a given basis (optimizer_space full or
    coords), the paper's noise placement alone, and stage 1 (public/private: a world run of the driver)."""
    from dpft.placement import world as ddp

    for cfg in (SubspaceCfg(source="file", file="b.safetensors"),
                SubspaceCfg(source="file", file="b.safetensors", optimizer_space="coords"),
                SubspaceCfg(source="none", paper_noise_placement=True), SubspaceCfg(source="private"),
                SubspaceCfg(source="private", optimizer_space="coords"),
                SubspaceCfg(source="public", public_task={"name": "imdb"})):
        assert DPSFT.sharded_refusal(cfg) is None
    assert DPSFT.supports_ddp
    ddp.check_methods(ddp.World(0, 2), [DPSFT(SubspaceCfg(source="private"), None)])


def test_dpft_train_fsdp_check_accepts_a_basis_file_and_stage1(lm_dirs):  # noqa: F811
    """``perf.sharding: fsdp``'s recipe check (before any loading): DP-SFT on a file and with a stage 1 of
    its own (private or public) pass."""
    from dpft.placement.fsdp import check_recipe
    from dpft.methods.base import active_methods

    for ov in ({"subspace.source": "file", "subspace.k": K, "subspace.file": "/nonexistent/basis.safetensors"},
               {"subspace.source": "private"}):
        r = load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **ov))
        check_recipe(r, 2, active_methods(r), True, False)  # no refusal


def test_fsdp_dpsft_audit_check_passes_and_catches_the_planted_bugs():
    """audit/checks_fsdp_methods.py: the sharded DP-SFT step on 2 and 3 simulated ranks equals one
    process, and with optimizer_space coords each rank's rows of Θ_start + P z (after the step, after a
    load) make the one-process Θ, and stage 1's basis (gathered snapshots, built on rank 0, broadcast) is the
    one-process basis on every rank; each planted bug (a rank's own coordinate sum, a rank's own noise, a
    rank's rows of P z without its offset, no write after the step, a rank's basis from its own rows) is caught."""
    from dpft.audit.checks_fsdp_methods import PLANTED, fsdp_dpsft_check

    honest = fsdp_dpsft_check()
    assert honest and all(c.passed for c in honest), [c.row() for c in honest if not c.passed]
    assert len(honest) == 7  # 2 and 3 ranks' step; 1, 2 and 3 ranks' coords writes; 2 and 3 ranks' stage-1 basis
    for name in ("fsdp_dpsft_local_coords", "fsdp_dpsft_rank_noise", "fsdp_dpsft_coords_rows_offset",
                 "fsdp_dpsft_coords_stale", "dpsft_stage1_rank_basis"):
        assert name in PLANTED
        from dpft.audit.checks_fsdp_methods import _planted

        with _planted(name):
            assert not all(c.passed for c in fsdp_dpsft_check()), name


# -- 2 processes = 1 process (slow) ------------------------------------------------------------------------
def _train_recipe(model_dir: Path, csv: Path, basis: Path, **extra) -> dict:
    ov = {"model.name": str(model_dir), "model.max_length": 16, "model.dropout": 0.0, "task.name": "files",
          "task.train_file": str(csv), "privacy.noise_multiplier": 1.0, "privacy.target_epsilon": None,
          "privacy.delta": 1e-3, "privacy.reproducible": True, "schedule.steps": 3, "schedule.decay": "constant",
          "batch.expected_batch_size": 9, "batch.max_physical_batch_size": 2, "eval.every_steps": 3,
          "checkpoint_every": 3, "perf.sharding": "fsdp", "optimizer.name": "sgd", "optimizer.lr": 0.5,
          "subspace.source": "file", "subspace.file": str(basis), "subspace.k": K}
    ov.update(extra)
    return ov


@pytest.mark.slow
def test_dpft_train_dpsft_file_two_processes_equal_one(tiny_model_dir, sst_like_files, tmp_path):
    """``dpft train`` with DP-SFT on a saved basis (Θ* in it: ``start: stage1``), ``perf.sharding: fsdp``:
    2 processes = 1 process (ledger with the basis's stage-1 events and one event per step, weights)."""
    from transformers import BertForSequenceClassification

    basis = make_basis(BertForSequenceClassification.from_pretrained(tiny_model_dir), tmp_path / "basis.safetensors",
                       with_start=True)
    ov = _train_recipe(tiny_model_dir, sst_like_files["csv"], basis)
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    r0, r1 = logs
    assert r0["world_size"] == 2 and all(not set(r0["shares"][t]) & set(r1["shares"][t]) for t in ("0", "1", "2"))
    # at some step one rank ran a placeholder micro-batch (its coordinates must count as zeros)
    assert any(-(-len(r0["shares"][t]) // 2) != -(-len(r1["shares"][t]) // 2) for t in ("0", "1", "2"))
    assert any(f.startswith("run/checkpoint_shards") for f in files_under(tmp_path / "two" / "rank1"))  # sharded
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, two))
    assert la == lb
    assert [e["phase"] for e in la["entries"]] == ["subspace", "train"] and la["entries"][1]["count"] == 3
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (one, two))
    assert ra["privacy"]["epsilon"] == rb["privacy"]["epsilon"]
    _weights_close(one, two, 1e-6)
    from dpft.placement.fsdp_checkpoint import read_trainable

    start = SubspaceBasis.load(basis).start
    w, w2 = read_trainable(one), read_trainable(two, tmp_path / "two" / "rank1" / "run")
    moved = max(float((w[n] - start[n]).abs().max()) for n in w)
    dw = max(float((w[n] - w2[n]).abs().max()) for n in w)
    print(f"dpft train dpsft file: max |Δw| 2 vs 1 process = {dw:.3g}; moved off Θ* by {moved:.3g}; "
          f"d = {sum(t.numel() for t in w.values()):,}")
    assert moved > 1e-4  # stage 2 moved the weights off Θ*


@pytest.fixture(scope="module")
def api_one_and_two(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    from ddp_api_worker import _model

    from dpft.audit.ways_in_ddp import tiny_model

    root = tmp_path_factory.mktemp("fsdp_dpsft_api")
    init = {n: p.detach().flatten().tolist() for n, p in _model(0).named_parameters()}  # make_private's start
    mlp = make_basis(_model(0), root / "mlp_basis.safetensors")
    bert = make_basis(tiny_model(), root / "bert_basis.safetensors")
    spec = {"name": "dpsft", "source": "file", "k": K, "start": "initial"}
    jobs = {"api_dpsft": {"methods": [{**spec, "file": str(mlp)}]},
            "trainer_dpsft": {"methods": [{**spec, "file": str(bert)}], "trainer": True},
            "trainer_args_dpsft": {"methods": [{**spec, "file": str(bert)}], "trainer": True, "fsdp_args": True}}
    one, two = one_then_two(worker, jobs, root)
    one["jobs"]["api_dpsft"]["init"] = init
    return jobs, one, two


@pytest.mark.slow
@pytest.mark.parametrize("job", ["api_dpsft", "trainer_dpsft", "trainer_args_dpsft"])
def test_dpsft_file_python_ways_in_two_processes_equal_one(api_one_and_two, job):
    """``make_private`` on a ``fully_shard``-ed MLP, ``DPTrainer`` on a caller-sharded BERT and with
    ``TrainingArguments.fsdp``: 2 processes = 1 process (ledger: the basis's events then one per step; ε;
    the gathered weights)."""
    _, one, two = api_one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"]) == (1, 2)
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert [e["phase"] for e in a["ledger"]["entries"]] == ["subspace", "train"]
    assert a["ledger"]["entries"][1]["count"] == (3 if "trainer" in job else 4)
    if "epsilon" in a:
        assert r0["epsilon"] == r1["epsilon"] == a["epsilon"]
    assert r0["weights"] == r1["weights"]  # gathered: one model for the world
    assert a["weights"]
    assert a["weights"].keys() == a["init"].keys()  # the spanned model parameters, not the k coordinates
    moved = max(float((torch.tensor(w) - torch.tensor(a["init"][n])).abs().max()) for n, w in a["weights"].items())
    assert moved > 1e-3
    dw = max(float((torch.tensor(r0["weights"][n]) - torch.tensor(w)).abs().max()) for n, w in a["weights"].items())
    print(f"{job}: max |Δw| 2 vs 1 process = {dw:.3g}; moved {moved:.3g}")
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)


def _model_weights(run: Path) -> dict[str, torch.Tensor]:
    """The final model ``dpft train`` saved (``model/``: Θ itself, also for ``optimizer_space: coords``,
    whose checkpoint holds the k coordinates only)."""
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def _dev_rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k.startswith("dev_")} | {"step": r["step"]} for r in rows
            if "dev_loss" in r]


def _same_final_model(one: Path, two: Path, start: dict, atol: float, last_eval: bool = False) -> float:
    """Equal saved models (within ``atol``) and equal dev evaluations (``last_eval``: the final one only: an
    interrupted run skips the evaluation of the step it stops at); returns how far the spanned weights moved
    off ``start``."""
    wa, wb = _model_weights(one), _model_weights(two)
    assert wa.keys() == wb.keys() and wa
    for n in wa:
        torch.testing.assert_close(wb[n], wa[n], rtol=1e-5, atol=atol)
    da, db = _dev_rows(one), _dev_rows(two)
    if last_eval:
        da, db = da[-1:], db[-1:]
    assert [r["step"] for r in da] == [r["step"] for r in db] and da
    for ra, rb in zip(da, db):  # evaluation saw the same weights (no stale gathered copy)
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (k, ra, rb)
    return max(float((wa[n] - start[n]).abs().max()) for n in start if n in wa)


@pytest.mark.slow
def test_dpft_train_dpsft_coords_two_processes_equal_one(tiny_model_dir, sst_like_files, tmp_path):
    """``optimizer_space: coords`` (Adam on the k coordinates, Θ = Θ* + P z written after every step, each
    rank its rows) with ``perf.sharding: fsdp``: 2 processes = 1 process (the sharded noise layout) — the
    ledger, the coordinates in the checkpoint, the saved model Θ and the dev evaluation after every step
    (evaluation on gathered weights must see the rows written after the update, not a stale gathered copy)."""
    from transformers import BertForSequenceClassification

    basis = make_basis(BertForSequenceClassification.from_pretrained(tiny_model_dir), tmp_path / "basis.safetensors",
                       with_start=True)
    ov = _train_recipe(tiny_model_dir, sst_like_files["csv"], basis, **{
        "subspace.optimizer_space": "coords", "optimizer.name": "adamw", "optimizer.lr": 0.05,
        "eval.every_steps": 1})
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    assert logs[0]["world_size"] == 2
    assert any(f.startswith("run/checkpoint_shards") for f in files_under(tmp_path / "two" / "rank1"))  # sharded
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, two))
    assert la == lb and [e["phase"] for e in la["entries"]] == ["subspace", "train"]
    _weights_close(one, two, 1e-6)  # the checkpoint: the k coordinates z
    from dpft.placement.fsdp_checkpoint import read_trainable

    assert list(read_trainable(one)) == [COORDS]
    moved = _same_final_model(one, two, SubspaceBasis.load(basis).start, 1e-6)
    print(f"dpft train dpsft coords: 2 vs 1 process equal; Θ moved off Θ* by {moved:.3g}")
    assert moved > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("space", ["full", "coords"])
def test_dpft_train_dpsft_sharded_resume_equals_uninterrupted(tiny_model_dir, sst_like_files, tmp_path, space):
    """``--resume`` of a sharded DP-SFT stage 2 (``source: file``, Adam): a SIGINT reaches rank 1 during step
    index 1, the world checkpoints at step 2 of 4 (per-rank DCP shards: the weights and Adam's state for
    ``full``, the coordinates and their Adam state for ``coords``); with the ranks' files in one folder (a
    shared file system), ``--resume`` on 2 processes runs steps 3-4 and equals the uninterrupted 1-process
    run: the ledger (the basis's events, then 4 steps; nothing replayed), the checkpoint and the saved model."""
    import shutil

    from transformers import BertForSequenceClassification

    basis = make_basis(BertForSequenceClassification.from_pretrained(tiny_model_dir), tmp_path / "basis.safetensors",
                       with_start=True)
    ov = _train_recipe(tiny_model_dir, sst_like_files["csv"], basis, **{
        "subspace.optimizer_space": space, "optimizer.name": "adamw", "optimizer.lr": 0.05, "schedule.steps": 4,
        "checkpoint_every": 2, "eval.every_steps": 2})
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 1})
    assert failure is None, failure
    assert r0["interrupted"] == r1["interrupted"] == "interrupted (SIGINT) at step 2 of 4; checkpoint at step 2"
    run, rank1 = two / "rank0" / "run", two / "rank1" / "run"
    for a, b in ((rank1, run), (run, rank1)):  # the two ranks' shard folders as one shared folder shows them
        shutil.copytree(a / "checkpoint_shards", b / "checkpoint_shards", dirs_exist_ok=True)
    failure, (r0, r1) = launch_worker(two, ov, resume=True)
    assert failure is None, failure
    assert set(r0["batches"]) == set(r1["batches"]) == {"2", "3"}
    la, lb = (json.loads((d / "ledger.json").read_text()) for d in (one, run))
    assert la == lb and [(e["phase"], e["count"]) for e in la["entries"]] == [("subspace", 5), ("train", 4)]
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (one, run))
    assert ra["privacy"]["epsilon"] == rb["privacy"]["epsilon"]
    _weights_close(one, run, 1e-6)
    moved = _same_final_model(one, run, SubspaceBasis.load(basis).start, 1e-6, last_eval=True)
    print(f"dpft train dpsft {space} sharded resume at step 2 of 4 = uninterrupted; moved {moved:.3g}")
    assert moved > 1e-4
