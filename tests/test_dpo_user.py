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
    from dpft.integrations.trl import DPDPOTrainer

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


def _released(tmp_path, rows, name, c, clipping="group"):
    """q = 1 (every pair of every user), σ = 0, SGD at lr 1: the clipped sum −Δθ·E[B]."""
    tr, model, tok = _trainer(tmp_path, rows, name, noise_multiplier=0.0, max_grad_norm=c, reproducible_seed=0,
                              user_clipping=clipping)
    ref = tiny_llama(len(tok))  # seeded: the policy's initial weights (a copy of the hooked model is not)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    tr.sampler.indices = lambda step: torch.arange(len(rows))
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
