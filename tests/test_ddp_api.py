"""``PrivacyEngine.make_private`` under ``torch.distributed`` (2 CPU processes, gloo) and at user
level (issue 26, items 1 and 4).

- 2 processes equal 1 process in reproducible mode, at example and at user level: the same
  ledger and ε, the same logical batches (the ranks' shares are disjoint and cover each; at user
  level whole users per rank), weights within float tolerance (the ranks start from different
  initialisations: rank 0's are broadcast), identical weights on both ranks; rank 0 alone writes
  (``save_ledger``); a ``DistributedDataParallel``-wrapped model is refused naming the fix.
- user level in one process (white box): the change of the released clipped sum when one user
  is left out is ≤ C however many rows the user has, with group and with C/k clipping; q and N
  count users; user ids given as a field name, a sequence or a tensor agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import ddp_api_worker as worker  # tests/ddp_api_worker.py: the loop each rank runs
from test_ddp import free_port, files_under

JOBS = {"example": {}, "user": {"user_level": True}, "banded": {"mechanism": "banded_mf", "bands": 2}}
SECURE = {"secure_user": {"user_level": True, "seed": None, "steps": 3}}  # 2 processes only


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    """The same jobs by 1 process (in-process) and by 2 (forked with torchrun's environment)."""
    root = tmp_path_factory.mktemp("ddp_api")
    one = worker.run_jobs({"jobs": JOBS, "cwds": [str(root / "one")]}, 0)
    logs = root / "logs"
    logs.mkdir()
    cfg = {"jobs": {**JOBS, **SECURE}, "cwds": [str(root / "rank0"), str(root / "rank1")], "log_dir": str(logs), "probe": True}
    torch.multiprocessing.start_processes(worker.forked_entry, args=(cfg, free_port()), nprocs=2, join=True,
                                          start_method="forkserver")
    two = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]
    return {"one": one, "two": two, "root": root}


@pytest.mark.parametrize("job", list(JOBS))
def test_two_processes_equal_one(one_and_two, job):
    one = one_and_two["one"]["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in one_and_two["two"])
    assert (one["world_size"], r0["world_size"], r1["world_size"]) == (1, 2, 2) and r1["rank"] == 1
    # Same ledger (events, counts), same ε on every rank and in one process.
    assert r0["ledger"] == r1["ledger"] == one["ledger"]
    assert r0["epsilon"] == r1["epsilon"] == one["epsilon"]
    assert sum(e["count"] for e in one["ledger"]["entries"]) == 5
    # One logical batch for the world, the 1-process batch; the shares split it.
    _, _, users = worker._data()
    assert set(one["batches"]) == set(r0["batches"]) == {str(t) for t in range(5)}
    several = False
    for t, full in one["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full == one["shares"][t]
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        several |= bool(s0) and bool(s1)
        if job == "user":  # whole users per rank: no user's rows on both ranks
            assert not {users[i] for i in s0} & {users[i] for i in s1}
            assert max(sum(users[i] == u for i in full) for u in set(users)) <= 2  # k = 2 rows per user
    assert several
    # Weights: rank 1 started from other weights (broadcast from rank 0); equal up to float order.
    for n, w in one["weights"].items():
        assert r0["weights"][n] == r1["weights"][n]
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)


def test_banded_noise_buffers_identical_on_every_rank(one_and_two):
    """make_private(mechanism="banded_mf") under 2 processes (issue 28): the secret partition and the
    noise buffers (C⁻¹Z from the shared key) are bit-identical on both ranks and equal the
    1-process run's; the ledger holds the banded events (PoissonSampled at t ≡ 0 mod b, NoOp else)."""
    one = one_and_two["one"]["jobs"]["banded"]
    r0, r1 = (log["jobs"]["banded"] for log in one_and_two["two"])
    assert r0["buffers"] and r0["buffers"] == r1["buffers"] and r0["partition"] == r1["partition"]
    assert r0["partition"] == one["partition"] and set(r0["partition"]) == {0, 1}
    for b0, b1 in zip(r0["buffers"], one["buffers"]):
        for k in b0:  # the noise itself is exact; float order of the all-reduce does not enter it
            assert b0[k] == b1[k]
    kinds = [(e["event"]["type"], e["count"]) for e in r0["ledger"]["entries"]]
    assert kinds == [("PoissonSampledDpEvent", 1), ("NoOpDpEvent", 1)] * 2 + [("PoissonSampledDpEvent", 1)]


def test_secure_mode_one_batch_for_the_world(one_and_two):
    """No seed: rank 0's key, broadcast; both ranks draw one logical batch and hold one model."""
    r0, r1 = (log["jobs"]["secure_user"] for log in one_and_two["two"])
    assert r0["batches"] == r1["batches"] and len(r0["batches"]) == 3
    for t, full in r0["batches"].items():
        assert sorted(r0["shares"][t] + r1["shares"][t]) == sorted(full)
    assert r0["ledger"] == r1["ledger"] and r0["weights"] == r1["weights"]
    reproducible = one_and_two["two"][0]["jobs"]["user"]["batches"]
    assert any(r0["batches"][t] != reproducible[t] for t in r0["batches"])  # not the seeded draws


def test_rank0_alone_writes_and_ddp_wrapper_refused(one_and_two):
    root = one_and_two["root"]
    r0, r1 = one_and_two["two"]
    assert all(r0["jobs"][j]["wrote"] and not r1["jobs"][j]["wrote"] for j in r0["jobs"])
    assert files_under(root / "rank1") == []
    assert files_under(root / "rank0") == sorted(f"{j}{f}" for j in r0["jobs"] for f in ("", "/ledger.json"))
    for log in (r0, r1):
        assert log["ddp_wrapper"].startswith("DistributedError") and "model.module" in log["ddp_wrapper"]


# --------------------------------------------------------------------------- user level, 1 process

C = 0.5


def _released(rows, user_ids, user_clipping="group", k=2, sigma=0.0, physical=None):
    """One logical step over every user (q = 1, SGD lr 1, σ): the released sum S = −Δθ·qU."""
    from dpft import PrivacyEngine

    model = worker._model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(reproducible_seed=3)
    n_users = len(set(user_ids.tolist() if isinstance(user_ids, torch.Tensor) else user_ids
                      if not isinstance(user_ids, str) else [r.get(user_ids) for r in rows]))
    module, opt, crit, dl = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(rows, batch_size=n_users), noise_multiplier=sigma, max_grad_norm=C, steps=1,
        user_ids=user_ids, max_rows_per_user=k, user_clipping=user_clipping, max_physical_batch_size=physical)
    for b in dl:
        opt.zero_grad()
        crit(module(b["x"]), b["y"]).backward()
        opt.step()
    engine.detach()
    s = torch.cat([-(p.detach() - before[n]).flatten() * n_users for n, p in model.named_parameters()])
    return s, engine, dl


@pytest.mark.parametrize("user_clipping", ["group", "per_example_over_k"])
def test_user_level_leave_one_user_out_is_at_most_c(user_clipping):
    x, y, _ = worker._data()
    x, y = x[:8].clone(), y[:8].clone()
    x[:3], y[:3] = 20.0 * x[0], y[0]  # user 0's three rows: one large gradient, three times
    users = [0, 0, 0, 1, 1, 2, 3, 3]
    rows = [{"x": x[i], "y": y[i], "u": users[i]} for i in range(8)]
    k = 3  # every row of every user is sampled (q = 1, k ≥ rows of any user)
    full, engine, dl = _released(rows, "u", user_clipping, k=k, physical=2)
    assert dl.user_level and dl.sample_rate == 1.0 and dl.expected_batch_size == 4  # q and N count users
    assert engine.ledger.steps == 1
    worst = 0.0
    for u in set(users):
        keep = [r for r in rows if r["u"] != u]
        worst = max(worst, float((full - _released(keep, "u", user_clipping, k=k, physical=2)[0]).norm()))
    assert worst <= C * (1 + 1e-4)
    assert worst > 0.9 * C  # user 0 is clipped to C, not less
    if user_clipping != "group":
        return
    # The rows of user 0 counted as three users (example level) would move S by up to 3C.
    row_level, _, _ = _released([dict(r, u=i) for i, r in enumerate(rows)], "u", user_clipping, k=k)
    no_u0, _, _ = _released([dict(r, u=i) for i, r in enumerate(rows) if r["u"] != 0], "u", user_clipping, k=k)
    assert float((row_level - no_u0).norm()) > 1.5 * C


def test_user_ids_as_field_sequence_or_tensor_agree_and_errors():
    x, y, users = worker._data()
    rows = [{"x": x[i], "y": y[i], "user": users[i]} for i in range(len(users))]
    a, _, _ = _released(rows, "user")
    b, _, _ = _released(rows, users)
    c, _, _ = _released(rows, torch.tensor(users))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    with pytest.raises(ValueError, match="no field 'who'"):
        _released(rows, "who")
    with pytest.raises(ValueError, match="3 entries for a dataset of 40 rows"):
        _released(rows, [0, 1, 2])
    with pytest.raises(ValueError, match="user_clipping"):
        _released(rows, users, user_clipping="rows")


# --------------------------------------------------------------------------- audit


def test_audit_walks_the_distributed_user_path_and_catches_each_planted_bug():
    """audit/ways_in_ddp.py, make_private's row of its table of ways in: the honest code passes every check;
    each planted bug fails the check that names its hole (one 2-process launch per configuration)."""
    from dpft.audit import planted, suite
    from dpft.audit.ways_in_ddp import API_PLANTED, PLANTED, WAYS, ddp_way_checks

    mp = (WAYS[1],)
    assert WAYS[1].name == "make_private" and set(PLANTED) <= set(planted.ALL)
    assert ("dpft.audit.ways_in_ddp", "hf_ddp_checks", PLANTED) in suite.OPTIONAL_CHECKS
    honest = ddp_way_checks(None, ways=mp)
    assert len(honest) == 6 and all(c.passed for c in honest), [c.row() for c in honest]
    failed = {p: [c for c in ddp_way_checks(p, ways=mp) if not c.passed] for p in API_PLANTED}
    names = {p: [c.name for c in cs] for p, cs in failed.items()}
    # every rank clipping the whole batch breaks both levels (shard_units shards the users with shard)
    assert "api-ddp: make_private leave-one-out under 2 processes" in names["ddp_batch_on_every_rank"], names
    assert "api-ddp: make_private leave-one-user-out under 2 processes" in names["ddp_user_rows_split"], names
    assert "api-ddp: make_private noise once for the world" in names["ddp_noise_per_rank"], names
    loo = {c.name: c.stats["loo_over_C"] for cs in failed.values() for c in cs if "loo_over_C" in c.stats}
    assert loo and all(v > 1.5 for v in loo.values()), loo  # an example (a user) counted twice: ~2C
