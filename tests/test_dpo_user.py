"""DPDPOTrainer at user level (DPArguments.user_column): a user's preference pairs are one privacy
unit, all of its chosen and rejected rows one clipping group; users Poisson-sampled, at most k
pairs per sampled user; the ledger counts users.

Tiny random-initialised Llama and word-level tokenizer from test_trl, built in-process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
dpa = pytest.importorskip("dp_accounting")

from test_trl import PAIRS, dp, dpo_args, tiny_llama, tiny_tokenizer  # noqa: E402

# 3 users: u0 two pairs, u1 two pairs, u2 one pair (rows grouped by user, as the sampler returns them)
USERS = ["a", "a", "b", "b", "c"]


def user_pairs(users=USERS, skip=None):
    return datasets.Dataset.from_list([{"prompt": p, "chosen": " " + c, "rejected": " sorry", "user": u}
                                       for (p, c), u in zip(PAIRS, users) if u != skip])


def _trainer(tmp_path, rows, name="out", **dpkw):
    from dpft.integrations.trl.trainer import DPDPOTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    kw = dict(user_column="user", max_rows_per_user=2, expected_batch_size=2)
    kw.update(dpkw)
    with pytest.warns(UserWarning, match="seed") if "reproducible_seed" in kw else _null():
        tr = DPDPOTrainer(model=model, args=dpo_args(tmp_path / name), train_dataset=rows, processing_class=tok,
                          dp_args=dp(**kw))
    return tr, model, tok


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _released(tmp_path, rows, name, c, clipping="group", planted=False):
    """q = 1 (every pair of every user), σ = 0, SGD at lr 1: the clipped sum −Δθ·E[B]. ``planted``:
    the bug of a pair-level group under ``group`` clipping (each pair its own group, clipped to C)."""
    tr, model, tok = _trainer(tmp_path, rows, name, noise_multiplier=0.0, max_grad_norm=c, reproducible_seed=0,
                              user_clipping=clipping)
    ref = tiny_llama(len(tok))  # seeded: the policy's initial weights (a copy of the hooked model is not)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    tr.sampler.indices = lambda step: torch.arange(len(rows))
    if planted:
        tr.sampler.groups = lambda micro: torch.arange(len(micro))
    tr.train()
    assert tr.ledger.steps == 1
    return -(torch.cat([p.detach().flatten() for p in model.parameters()]) - before) * 2, ref, tok


def _pair_grad(ref, tok, r, beta=0.5):
    """∇ of the sigmoid DPO loss of one pair (Rafailov et al. 2023, eq. 7) at the reference."""
    import torch.nn.functional as F

    def logp(prompt, completion):
        p_ids, ids = tok(prompt)["input_ids"], tok(prompt + completion + tok.eos_token)["input_ids"]
        x = torch.tensor([ids])
        lp = torch.log_softmax(ref(input_ids=x).logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]
        return lp[len(p_ids) - 1:].sum()

    with torch.no_grad():
        rc, rr = logp(r["prompt"], r["chosen"]), logp(r["prompt"], r["rejected"])
    delta = (logp(r["prompt"], r["chosen"]) - rc) - (logp(r["prompt"], r["rejected"]) - rr)
    g = torch.autograd.grad(-F.logsigmoid(beta * delta), list(ref.parameters()))
    return torch.cat([x.flatten() for x in g])


def test_leave_one_user_out_changes_the_clipped_sum_by_at_most_c(tmp_path):
    """Removing user "b" (two pairs, four rows) changes the released clipped sum by exactly
    clip_C(the user's summed gradient): norm C. Clipping each pair alone would move it by up to 2C
    (the reference below shows it would here)."""
    c = 0.05
    full, ref, tok = _released(tmp_path, user_pairs(), "all", c)
    without, _, _ = _released(tmp_path, user_pairs(skip="b"), "without_b", c)
    diff = full - without
    assert float(diff.norm()) <= c * (1 + 1e-4)
    g = [_pair_grad(ref, tok, r) for r in user_pairs() if r["user"] == "b"]
    assert all(float(x.norm()) > c for x in g)
    per_pair = sum(x * (c / float(x.norm())) for x in g)
    assert float(per_pair.norm()) > 1.5 * c  # the bug a pair-level group would be: sensitivity ~2C
    user = g[0] + g[1]
    expected = user * min(1.0, c / (float(user.norm()) + 1e-6))
    torch.testing.assert_close(diff, expected, rtol=1e-3, atol=1e-6)
    assert float(diff.norm()) == pytest.approx(c, rel=1e-3)


def test_leave_one_user_out_catches_the_planted_pair_level_group(tmp_path):
    """Planted bug: a user's pairs clipped each to C (groups of one pair) → removing user "b" moves
    the sum by more than C; the check above fails on it."""
    c = 0.05
    full, _, _ = _released(tmp_path, user_pairs(), "all", c, planted=True)
    without, _, _ = _released(tmp_path, user_pairs(skip="b"), "without_b", c, planted=True)
    assert float((full - without).norm()) > 1.5 * c


def test_leave_one_user_out_per_example_over_k(tmp_path):
    """``per_example_over_k``: each pair clipped to C/k, so a user's ≤ k pairs move the sum by ≤ C."""
    c = 0.05
    full, _, _ = _released(tmp_path, user_pairs(), "all", c, clipping="per_example_over_k")
    without, _, _ = _released(tmp_path, user_pairs(skip="b"), "without_b", c, clipping="per_example_over_k")
    assert c / 2 < float((full - without).norm()) <= c * (1 + 1e-4)


def test_the_ledger_counts_users(tmp_path):
    """N = U = 3 users (not 5 pairs), q = expected users / U; one Poisson-Gaussian event per step."""
    tr, _, _ = _trainer(tmp_path, user_pairs(), noise_multiplier=1.0)
    assert tr.n == 3 and tr.q == pytest.approx(2 / 3)
    tr.train()
    ev = dpa.PoissonSampledDpEvent(2 / 3, dpa.GaussianDpEvent(tr.sigma))
    assert [(e.phase, e.count, e.event) for e in tr.ledger.entries] == [("train", 1, ev)]


def test_at_most_k_pairs_per_sampled_user_and_one_group_per_user(tmp_path):
    """A sampled user brings at most k pairs; every clipping group of a physical batch is whole
    pairs (2 rows each) of one user, and a user is never split across batches."""
    users = [u for u in "abcd" for _ in range(2)]  # 4 users × 2 pairs, k = 1
    rows = user_pairs(users)
    tr, _, _ = _trainer(tmp_path, rows, max_rows_per_user=1, expected_batch_size=3)
    tr.get_train_dataloader()
    seen_any = False
    for step in range(6):
        idx = tr.sampler.indices(step)
        u = tr.sampler.users[idx]
        if len(u):
            assert int(torch.bincount(u, minlength=4).max()) <= 1
        for b in tr._micro_batches(tr._logical_order(idx)):
            g = b[_group_key()]
            assert len(g) % 2 == 0 and torch.equal(g[0::2], g[1::2])  # a pair's two rows, one group
            assert torch.bincount(g).max() <= 2 * 1
            seen_any = True
    assert seen_any
    # k = 2: a user's two pairs form one group of four rows
    tr2, _, _ = _trainer(tmp_path, rows, "k2", max_rows_per_user=2, expected_batch_size=3)
    tr2.get_train_dataloader()
    idx = torch.arange(8)
    counts = [torch.bincount(b[_group_key()]).tolist() for b in tr2._micro_batches(idx)]
    assert sorted(n for cs in counts for n in cs) == [4, 4, 4, 4]  # each user's 2 pairs: one group of 4 rows


def _group_key():
    from dpft.grads.groups import GROUP_KEY

    return GROUP_KEY


# ----------------------------------------------------------------------------- 2 processes = 1

JOBS = {"dpo_user_ddp": {"ddp": True}, "dpo_user_fsdp": {}}


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    import json
    import multiprocessing

    import torch.distributed as dist

    import dpo_user_worker as worker  # tests/dpo_user_worker.py
    from test_ddp import free_port

    if dist.is_initialized():  # pragma: no cover - another test left one
        pytest.skip("a process group is already initialised")
    multiprocessing.set_forkserver_preload(["dpo_user_worker", "hf_fsdp_worker", "dpft", "dpft.integrations.trl.trainer"])
    root = tmp_path_factory.mktemp("dpo_user")
    one = worker.run_jobs({"jobs": JOBS, "out": str(root / "one")}, 0)
    logs = root / "logs"
    logs.mkdir()
    torch.multiprocessing.start_processes(worker.forked_entry, args=({"jobs": JOBS, "log_dir": str(logs),
                                                                      "out": str(root / "two")}, free_port()),
                                          nprocs=2, join=True, start_method="forkserver")
    return one, [json.loads((logs / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_dpo_user_level_two_processes_equal_one(one_and_two, job):
    """DDP and FSDP2 (``fsdp=``): the same ledger over users, the same logical batches, whole users
    per rank (disjoint, covering), the ranks' weights identical and within float tolerance of one process."""
    from sft_fsdp_worker import USERS

    one, two = one_and_two
    a = one["jobs"][job]
    r0, r1 = (log["jobs"][job] for log in two)
    assert (a["world_size"], r0["world_size"], r1["rank"]) == (1, 2, 1)
    assert a["user_level"] and r0["user_level"] and r1["user_level"]
    if job == "dpo_user_fsdp":
        assert r0["sharded"] and r0["fsdp_step"] and r0["step"] == "FSDPStep"
    assert r0["ledger"] == r1["ledger"] == a["ledger"]
    assert a["ledger"]["entries"][0]["event"]["sampling_probability"] == pytest.approx(3 / 5)  # users, not pairs
    both = False
    for t, full in a["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
        assert not {USERS[i] for i in s0} & {USERS[i] for i in s1}  # whole users per rank
        both = both or bool(s0 and s1)
    assert both
    assert r0["weights"] == r1["weights"]
    for n, w in a["weights"].items():
        torch.testing.assert_close(torch.tensor(r0["weights"][n]), torch.tensor(w), rtol=1e-5, atol=1e-6)
