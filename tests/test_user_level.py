"""User-level DP (issue 17, item 2): the privacy unit is a user with any number of rows.

Sampling over users (inclusion rate ≈ q per user, ≤ k rows per user per step, fresh subsets),
the sensitivity of the clipped sum to one user (leave-one-user-out ≤ C however many rows the
user has), exact group clipping equal to the torch.func reference (per-row grads → sum per
user → clip to C → sum), the conservative C/k option against its reference, accounting over
users equal to a ``dp_accounting`` computation done here, the report's unit and N users, and
clear errors."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import pandas as pd
import pytest
import torch

from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.groups import GROUP_KEY, PerExampleOverK, split_groups
from dpft.grads.reference import ReferenceEngine
from dpft.models.losses import causal_lm_loss, classification_loss
from dpft.step.clip import make_clip_policy
from dpft.privacy.randomness import Randomness
from dpft.step.sample import UserPoissonSampler, user_index

transformers = pytest.importorskip("transformers")

V = 50


# ----------------------------------------------------------------------------- tiny models


def _bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=32, pad_token_id=0)
    return transformers.BertForSequenceClassification(cfg), classification_loss


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), causal_lm_loss


def _llama_tied():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg), causal_lm_loss


MODELS = {"bert": _bert, "gpt2_lm": _gpt2, "llama_tied": _llama_tied}


def _batch(b=7, t=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, t - 3:] = 0  # a padded row
    ids[1, t - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(t).expand(b, t).contiguous(),
            "labels": torch.randint(0, 2, (b,), generator=g)}


#: users of the 7 rows: user 0 has 3 rows, user 1 has 3, user 2 has 1 (not contiguous on purpose)
GROUPS = torch.tensor([0, 1, 1, 0, 2, 1, 0])


def _model(kind):
    torch.manual_seed(0)
    m, loss = MODELS[kind]()
    return m.eval(), loss


def _per_row(model, loss, batch):
    grads, _ = ReferenceEngine(model, loss, make_clip_policy("flat", 1.0)).per_example_grads(batch)
    return grads


def _reference_group_clip(per_row, groups, c, style="flat"):
    """The definition: sum each user's rows' gradients, clip that sum with the policy, add up."""
    names = list(per_row)
    out = {n: torch.zeros_like(per_row[n][0]) for n in names}
    policy = make_clip_policy(style, c)
    for u in range(int(groups.max()) + 1):
        gu = {n: per_row[n][groups == u].sum(0) for n in names}
        sq = torch.stack([gu[n].pow(2).sum() for n in names])[None, :]
        s = policy.scales(sq)[0]
        for j, n in enumerate(names):
            out[n] += s[j] * gu[n]
    return out


def _close(a, b, rel=1e-4):
    scale = max(float(v.abs().max()) for v in b.values())
    err = max(float((a[n] - b[n]).abs().max()) for n in b)
    assert err <= rel * scale + 1e-8, (err, scale)


def _norm(d):
    return math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))


# ----------------------------------------------------------------------------- sampling


def test_user_sampler_inclusion_rate_and_at_most_k_rows():
    """Each user is in a step's batch with probability q (tolerance: 5 binomial sd over 3,000
    steps ≈ ±0.042); every batch has ≤ k rows of each user and only sampled users' rows; a
    user with more than k rows gets a fresh random subset (each of its rows ≈ q·k/n_u)."""
    counts = [1, 2, 3, 5, 10, 1, 4, 7, 2, 6]
    users = torch.tensor([u for u, c in enumerate(counts) for _ in range(c)])
    users = users[torch.randperm(len(users), generator=torch.Generator().manual_seed(0))]  # rows interleaved
    k, steps = 3, 3000
    s = UserPoissonSampler(users, expected_users=3, k=k, rng=Randomness(seed=7))
    assert s.n == 10 and s.q == pytest.approx(0.3)
    in_batch = torch.zeros(10)
    row_hits = torch.zeros(len(users))
    for t in range(steps):
        idx = s.indices(t)
        u = users[idx]
        per_user = torch.bincount(u, minlength=10)
        assert int(per_user.max()) <= k
        assert len(set(idx.tolist())) == len(idx)  # no row twice
        sampled = set(s.sampled_users(t).tolist())
        assert set(u.tolist()) == sampled  # every sampled user contributes, no other does
        for v in sampled:
            assert int(per_user[v]) == min(k, counts[v])
        in_batch += per_user > 0
        row_hits[idx] += 1
    rate = in_batch / steps
    tol = 5 * math.sqrt(0.3 * 0.7 / steps)
    assert (rate - 0.3).abs().max() <= tol, rate
    big = 4  # 10 rows, k = 3: each row with probability q·3/10 = 0.09
    rows = row_hits[users == big] / steps
    assert (rows - 0.09).abs().max() <= 5 * math.sqrt(0.09 * 0.91 / steps), rows


def test_user_sampler_secret_by_default_and_reproducible_on_request():
    users = torch.arange(40) % 17
    a = UserPoissonSampler(users, 5, 2, Randomness(seed=1))
    b = UserPoissonSampler(users, 5, 2, Randomness(seed=1))
    assert all(torch.equal(a.indices(t), b.indices(t)) for t in range(20))
    c, d = (UserPoissonSampler(users, 5, 2, Randomness()) for _ in range(2))
    assert any(not torch.equal(c.indices(t), d.indices(t)) for t in range(20))


def test_micro_batches_keep_users_whole():
    users = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    s = UserPoissonSampler(users, 4, 4, Randomness(seed=0))
    idx = torch.arange(10)
    micros = s.micro_batches(idx, max_physical=3)
    assert torch.equal(torch.cat(micros), idx)
    for m in micros:
        assert len(m) <= 4  # max(max_physical, k)
    seen = [set(users[m].tolist()) for m in micros]
    for i in range(len(seen)):
        for j in range(i + 1, len(seen)):
            assert not seen[i] & seen[j]  # no user split across micro-batches
    assert torch.equal(s.groups(torch.tensor([4, 5, 6, 7])), torch.tensor([0, 0, 1, 1]))


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("mode", ["ghost", "instantiate"])
def test_exact_group_clipping_equals_reference(kind, mode):
    """Book-keeping group clipping (group ghost norms over the concatenated rows) = per-row
    grads summed per user, clipped to C, summed; and the reference engine's own group path."""
    model, loss = _model(kind)
    batch = _batch()
    per_row = _per_row(model, loss, batch)
    for c in (0.05, 1e3):  # every user clipped / none clipped
        want = _reference_group_clip(per_row, GROUPS, c)
        bk = BookKeepingEngine(model, loss, make_clip_policy("flat", c), norm_mode=mode)
        got = bk.clipped_sum({**batch, GROUP_KEY: GROUPS})
        _close(got.grad_sum, want)
        ref = ReferenceEngine(model, loss, make_clip_policy("flat", c)).clipped_sum({**batch, GROUP_KEY: GROUPS})
        _close(ref.grad_sum, want)
        # the rows of a user share one factor; the norm reported per row is its user's
        for u in range(3):
            assert torch.unique(got.scales[GROUPS == u]).numel() == 1
    # per-layer clipping over users too
    want = _reference_group_clip(per_row, GROUPS, 0.05, style="per_layer")
    got = BookKeepingEngine(model, loss, make_clip_policy("per_layer", 0.05), norm_mode=mode).clipped_sum(
        {**batch, GROUP_KEY: GROUPS})
    _close(got.grad_sum, want)


def _without_user(batch, groups, u):
    keep = groups != u
    b = {k: v[keep] for k, v in batch.items()}
    return b, torch.unique(groups[keep], return_inverse=True)[1]


@pytest.mark.parametrize("option", ["group", "per_example_over_k"])
def test_one_user_changes_the_clipped_sum_by_at_most_C(option):
    """Leave-one-user-out: removing all rows of a user moves the clipped sum by ≤ C, however
    many rows (up to k) the user has; naive per-row clipping to C would not (≈ 3C here)."""
    model, loss = _model("gpt2_lm")
    batch = _batch()
    c, k = 0.01, 3  # far below every gradient norm: every row/user is clipped
    if option == "group":
        eng = BookKeepingEngine(model, loss, make_clip_policy("flat", c))

        def clipped(b, g):
            return eng.clipped_sum({**b, GROUP_KEY: g}).grad_sum
    else:
        eng = BookKeepingEngine(model, loss, PerExampleOverK(make_clip_policy("flat", c / k), k))
        assert eng.clip.sensitivity == pytest.approx(c)

        def clipped(b, g):
            return eng.clipped_sum(b).grad_sum
    full = clipped(batch, GROUPS)
    for u in range(3):
        b, g = _without_user(batch, GROUPS, u)
        rest = clipped(b, g)
        d = _norm({n: full[n] - rest[n] for n in full})
        assert d <= c * (1 + 1e-4), (u, d)
        if u == 0 and option == "group":
            assert d >= c * (1 - 1e-3)  # a clipped user contributes exactly C
    naive = BookKeepingEngine(model, loss, make_clip_policy("flat", c))
    b, _ = _without_user(batch, GROUPS, 0)
    f, r = naive.clipped_sum(batch).grad_sum, naive.clipped_sum(b).grad_sum
    assert _norm({n: f[n] - r[n] for n in f}) > 1.5 * c  # the test has teeth: 3 rows clipped to C each


def test_conservative_option_matches_its_reference():
    """Per-row clipping to C/k then summing = the reference engine's per-row grads, each scaled
    to norm ≤ C/k, summed; sensitivity C."""
    model, loss = _model("bert")
    batch = _batch()
    c, k = 0.05, 3
    per_row = _per_row(model, loss, batch)
    sq = torch.stack([per_row[n].reshape(7, -1).pow(2).sum(1) for n in per_row], 1)
    f = (c / k / (sq.sum(1).sqrt() + 1e-6)).clamp(max=1.0)
    want = {n: torch.einsum("b,b...->...", f, per_row[n]) for n in per_row}
    pol = PerExampleOverK(make_clip_policy("flat", c / k), k)
    got = BookKeepingEngine(model, loss, pol).clipped_sum(batch)
    _close(got.grad_sum, want)
    assert pol.sensitivity == pytest.approx(c) and pol.max_norm == pytest.approx(c)


def test_group_ids_are_checked():
    b = _batch(b=3)
    with pytest.raises(ValueError, match="group ids"):
        split_groups({**b, GROUP_KEY: torch.tensor([0, 2, 2])})  # id 1 unused
    with pytest.raises(ValueError, match="int64"):
        split_groups({**b, GROUP_KEY: torch.tensor([0.0, 1.0, 1.0])})


# ----------------------------------------------------------------------------- the trainer


def _user_files(tmp_path):
    words = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull"]
    # 60 rows, 30 users: users u0..u9 have 4 rows each, the other 20 users 1 row each
    rows = [{"text": f"a {words[i % 8]} film number {i}", "label": int(i % 8 % 2 == 0),
             "person": f"u{i % 10}" if i < 40 else f"v{i}"} for i in range(60)]
    pd.DataFrame(rows).to_csv(tmp_path / "u.csv", index=False)
    dev = [{"text": f"a {words[i % 8]} film {i}", "label": int(i % 8 % 2 == 0)} for i in range(8)]
    pd.DataFrame(dev).to_csv(tmp_path / "dev.csv", index=False)
    return tmp_path / "u.csv", tmp_path / "dev.csv"


def _recipe(model_dir, train, dev, **extra):
    from dpft.config.recipe import load_recipe

    ov = {"model.name": str(model_dir), "model.max_length": 16, "task.name": "files",
          "task.train_file": str(train), "task.dev_file": str(dev), "task.user_column": "person",
          "task.max_rows_per_user": 2, "batch.expected_batch_size": 6, "batch.max_physical_batch_size": 4,
          "schedule.steps": 3, "eval.every_steps": 3, "checkpoint_every": 3,
          "privacy.target_epsilon": 4.0, "privacy.delta": 1e-3, "optimizer.lr": 1e-2}
    ov.update(extra)
    return load_recipe(None, ov)


@pytest.mark.parametrize("clipping", ["group", "per_example_over_k"])
def test_accounting_over_users_equals_dp_accounting_and_report_names_the_unit(
        tiny_model_dir, tmp_path, clipping):
    from dpft.run.loop import Trainer

    train, dev = _user_files(tmp_path)
    t = Trainer(_recipe(tiny_model_dir, train, dev, **{"task.user_clipping": clipping}), tmp_path / "r",
                progress=False)
    assert t.n == 30 and t.q == pytest.approx(6 / 30)  # N and q count users, not the 60 rows
    rep = t.run()
    ev = dpa.PoissonSampledDpEvent(6 / 30, dpa.GaussianDpEvent(t.sigma))
    acc = dpa.pld.PLDAccountant()
    acc.compose(ev, 3)
    eps = acc.get_epsilon(1e-3)
    assert rep["privacy"]["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert eps <= 4.0 + 1e-9 and eps >= 3.5  # σ calibrated over users to the target
    assert [(e.phase, e.count, e.event) for e in t.ledger.entries] == [("train", 3, ev)]
    assert t.clip.sensitivity == pytest.approx(1.0)
    u = rep["dp"]["privacy_unit"]
    assert u == {"unit": "user", "column": "person", "n_units": 30, "max_rows_per_user": 2,
                 "user_clipping": clipping}
    assert json.loads((tmp_path / "r" / "report.json").read_text())["task"]["n_train"] == 30
    md = (tmp_path / "r" / "report.md").read_text()
    head = md.split("## Ledger")[0].replace(str(tmp_path.parent), "")  # a temp path may hold "60" (pytest-608)
    assert "N = 30 users" in md and "privacy unit: user" in md and "60" not in head
    assert "with and without all of that user's rows" in md


def test_example_level_stays_the_default(tiny_model_dir, tmp_path):
    from dpft.run.loop import Trainer

    train, dev = _user_files(tmp_path)
    t = Trainer(_recipe(tiny_model_dir, train, dev, **{"task.user_column": None}), tmp_path / "r", progress=False)
    assert not t.user_level and t.n == 60 and t.privacy_unit == {"unit": "example", "n_units": 60}


def test_clear_errors(tiny_model_dir, tmp_path):
    from dpft.config.recipe import RecipeError
    from dpft.data.tasks import DataError
    from dpft.run.loop import Trainer, TrainingError

    train, dev = _user_files(tmp_path)
    with pytest.raises(DataError, match="no user column 'who'"):
        Trainer(_recipe(tiny_model_dir, train, dev, **{"task.user_column": "who"}), tmp_path / "a", progress=False)
    with pytest.raises(RecipeError, match="max_rows_per_user"):
        _recipe(tiny_model_dir, train, dev, **{"task.max_rows_per_user": 0})
    with pytest.raises(ValueError, match="k\\) must be ≥ 1"):
        UserPoissonSampler(torch.tensor([0, 1]), 1, 0, Randomness(seed=0))
    with pytest.raises(ValueError, match="empty"):
        user_index([])
    with pytest.raises(ValueError, match="row 2 has no user id"):
        user_index(["a", None])
    df = pd.read_csv(train)
    df.loc[3, "person"] = None
    df.to_csv(tmp_path / "holes.csv", index=False)
    with pytest.raises(DataError, match="no user id in column 'person'"):
        Trainer(_recipe(tiny_model_dir, tmp_path / "holes.csv", dev), tmp_path / "b", progress=False)
    with pytest.raises(DataError, match="number of users U = 30"):
        Trainer(_recipe(tiny_model_dir, train, dev, **{"batch.expected_batch_size": 31}), tmp_path / "c",
                progress=False)
    with pytest.raises(TrainingError, match="batch.schedule"):
        Trainer(_recipe(tiny_model_dir, train, dev, **{"batch.schedule": [[0, 4]],
                                                        "privacy.noise_multiplier": 1.0}),
                tmp_path / "d", progress=False)


def test_text_task_blocks_never_mix_users():
    from dpft.data.text import chunk_blocks_by_user

    docs = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    users = ["a", "b", "a", "b"]
    out = chunk_blocks_by_user(docs, users, block_size=3)
    # a: 1..5 + 9..12 → [1,2,3] [4,5,9] [10,11,12]; b: 6,7,8,13,14 → [6,7,8]
    assert out["input_ids"] == [[1, 2, 3], [4, 5, 9], [10, 11, 12], [6, 7, 8]]
    assert out["user"] == ["a", "a", "a", "b"]
    doc = chunk_blocks_by_user(docs, users, block_size=3, unit="document")
    assert doc["user"] == users and doc["input_ids"][0] == [1, 2, 3]


# ----------------------------------------------------------------------------- instruction data


def test_user_level_on_instruction_data(tmp_path, monkeypatch):
    """The instruct path (data/instruct.py keeps the ``user`` column per row) plugs in the same
    way: N = users of the chat example, completion-only loss, group clipping equal to the
    reference on a collated batch with per-token labels."""
    from test_instruct import ROOT, _tiny_model_dir

    from dpft.config.recipe import load_recipe
    from dpft.data.tokenize import collate
    from dpft.run.loop import Trainer

    monkeypatch.chdir(ROOT)
    model_dir = _tiny_model_dir(tmp_path)
    rec = load_recipe(ROOT / "examples/chat-support/recipe.yaml", {
        "model.name": str(model_dir), "model.max_length": 48, "task.max_train_examples": 64,
        "task.user_column": "user", "task.max_rows_per_user": 2,
        "privacy.target_epsilon": None, "privacy.noise_multiplier": 1.0, "schedule.steps": 2,
        "schedule.epochs": None, "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 8,
        "eval.every_steps": 2, "eval.max_new_tokens": 2, "eval.max_generate_prompts": 2})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    users = pd.Series(tr.train_tok["user"])
    assert tr.user_level and tr.n == users.nunique() < len(users)
    # completion-only loss with group clipping equals the reference on a real batch of this data
    rows = tr.sampler.indices(0)[:6]
    batch = collate(list(tr.train_tok.select(rows.tolist())), tr.pad_id, False)
    assert batch["labels"].dim() == 2 and bool((batch["labels"] == -100).any())
    g = tr.sampler.groups(rows)
    per_row = _per_row(tr.model, tr.loss_fn, batch)
    want = _reference_group_clip(per_row, g, 0.01)
    got = BookKeepingEngine(tr.model, tr.loss_fn, make_clip_policy("flat", 0.01)).clipped_sum({**batch, GROUP_KEY: g})
    _close(got.grad_sum, want)
    rep = tr.run()
    assert rep["dp"]["privacy_unit"]["n_units"] == tr.n and "bleu" in json.dumps(rep["metrics"]).lower()
