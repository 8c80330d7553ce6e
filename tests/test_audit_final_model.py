"""Final-model one-run audit (audit/final_model.py, issue 37): the secret canary coins, the canary
rows, an end-to-end audit through the Trainer on a tiny random BERT (non-private: ε̂ large; heavy
noise: ε̂ ≈ 0 ≤ ε), the CLI and the audited line in the report and model card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpft.audit import final_model as fm
from dpft.privacy.randomness import Randomness

WORDS = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull", "a", "film", "number"]


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory) -> Path:
    """A tiny random BERT with its own 8000-token word-piece vocabulary (fast per-example
    embedding gradients; the canaries draw from the ~7980 ids no data row uses, so two canaries
    rarely share a token and an excluded one is seldom carried along by an included one)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    d = tmp_path_factory.mktemp("smallbert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [str(i) for i in range(10)]
    vocab += [f"w{i}" for i in range(8000 - len(vocab))]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizer(str(d / "vocab.txt"))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    BertForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory) -> Path:
    import pandas as pd

    d = tmp_path_factory.mktemp("fmdata")
    rows = [{"text": f"a {WORDS[i % 8]} film number {i % 10}", "label": int(i % 8 % 2 == 0)} for i in range(60)]
    pd.DataFrame(rows).to_csv(d / "d.csv", index=False)
    return d / "d.csv"


def _recipe(model_dir, csv, **extra):
    from dpft.config.recipe import load_recipe

    ov = {"model.name": str(model_dir), "model.max_length": 16, "task.name": "files", "task.train_file": str(csv),
          "batch.expected_batch_size": 64, "batch.max_physical_batch_size": 128, "schedule.steps": 20,
          "eval.every_steps": 1000, "checkpoint_every": 1000, "privacy.delta": 1e-3, "optimizer.lr": 3e-2}
    ov.update(extra)
    return load_recipe(None, ov)


def test_canary_coins_are_secret_and_fair():
    a = Randomness().stream("audit_canary_coin", "random").bernoulli((4000,), 0.5)
    b = Randomness().stream("audit_canary_coin", "random").bernoulli((4000,), 0.5)
    assert a.dtype == torch.bool and not torch.equal(a, b)  # a fresh OS-CSPRNG key per run
    assert abs(a.double().mean().item() - 0.5) < 0.04  # 4000 fair coins: |mean − ½| < 5 sd
    rep1 = Randomness(7).stream("audit_canary_coin", "random").bernoulli((64,), 0.5)
    rep2 = Randomness(7).stream("audit_canary_coin", "random").bernoulli((64,), 0.5)
    assert torch.equal(rep1, rep2)  # reproducible recipes only: the seed decides the coins


def test_canary_rows_join_the_training_rows(small_bert, data_csv, tmp_path):
    from dpft.run.loop import Trainer

    r = _recipe(small_bert, data_csv, **{"privacy.enabled": False, "batch.expected_batch_size": 16})
    sets: list = []
    t = Trainer(r, tmp_path / "run", progress=False, extra_rows=fm.canary_rows_hook(["random", "mislabel"], 6,
                                                                                     Randomness(), sets))
    assert [s.design for s in sets] == ["random", "mislabel"]
    n_in = sum(int(s.included.sum()) for s in sets)
    assert t.n == 60 - 6 + n_in  # 10 % of the 60 rows are the dev split; included canaries join train
    rnd, mis = sets
    vocab_of_data = set()
    for ids in t.train_tok.select(range(54))["input_ids"]:
        vocab_of_data |= set(ids)
    for row in rnd.rows:
        ids = row["input_ids"]
        assert ids[0] == 2 and ids[-1] == 3 and len(ids) == 16  # [CLS] … [SEP], model.max_length tokens
        assert row["label"] in (0, 1)
    dev = {tuple(x["input_ids"]): x["label"] for x in t.dev_tok}
    for row in mis.rows:  # dev rows with the other label
        assert dev[tuple(row["input_ids"])] != row["label"]
    tail = t.train_tok.select(range(54, len(t.train_tok)))["input_ids"]
    expect = [row["input_ids"] for s in sets for row, c in zip(s.rows, s.included.tolist()) if c]
    assert tail == expect  # exactly the included canaries, nothing else
    losses = fm.canary_losses(t.model, t.loss_fn, rnd.rows, t.pad_id, t.with_token_types)
    ce = fm.canary_losses(t.model, lambda m, b: t.loss_fn(m, b), rnd.rows, t.pad_id, t.with_token_types)
    assert losses.shape == ce.shape == (6,) and bool((ce > 0).all())  # any other loss_fn: used as it is
    p = torch.exp(-ce)  # p(label); the classifier's score is the log-odds loss −log(p/(1−p))
    assert torch.allclose(losses, torch.log1p(-p) - torch.log(p), atol=1e-4)


def test_rare_pool_is_the_least_frequent_quarter():
    import datasets

    class Tok:
        all_special_ids = [0]

        def __len__(self):
            return 40

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3] * 5, list(range(1, 31))]})
    pool = fm._vocab_pool(Tok(), rows, "rare")
    assert set(pool.tolist()) == set(range(31, 40))  # never seen in training rows
    assert 0 not in fm._vocab_pool(Tok(), rows, "random").tolist()


def test_refusals_name_the_fix(small_bert, data_csv, tmp_path):
    r = _recipe(small_bert, data_csv)
    with pytest.raises(ValueError, match="at least 20"):
        fm.audit_final_model(r, tmp_path / "a", m=5)
    with pytest.raises(ValueError, match="random, mislabel|'random', 'mislabel'"):
        fm.audit_final_model(r, tmp_path / "a", m=50, designs=["rare"])
    with pytest.raises(ValueError, match="planted"):
        fm.audit_final_model(r, tmp_path / "a", m=50, planted="seed32")
    with pytest.raises(ValueError, match="confidence"):
        fm.audit_final_model(r, tmp_path / "a", m=50, confidence=1.0)


@pytest.mark.slow  # ~10 s alone, up to 30 s on a shared 2-core machine
def test_non_private_run_gives_a_large_bound_and_noise_a_small_one(small_bert, data_csv, tmp_path):
    # lr 1e-2: at 3e-2 the 1-layer model's tanh pooler saturates and excluded canaries of the
    # predicted label tie with the included ones (ε̂ 0.3–4.5 over 25 runs; at 1e-2, 2.5–4.5)
    free = fm.audit_final_model(_recipe(small_bert, data_csv, **{"privacy.enabled": False, "optimizer.lr": 1e-2}),
                                tmp_path / "free", m=200, progress=False)
    noisy = fm.audit_final_model(_recipe(small_bert, data_csv, **{"privacy.noise_multiplier": 20.0}),
                                 tmp_path / "noisy", m=200, progress=False)
    # the f-DP bound (beside the headline since issue 44) has the power here; Steinke's may be 0 at m = 200
    assert free["certified_epsilon"] is None and free["headline"]["gaussian"]["epsilon_hat"] > 1.0
    assert noisy["certified_epsilon"] < 0.5
    assert noisy["headline"]["epsilon_hat"] <= noisy["certified_epsilon"] and not noisy["violation"]
    assert free["headline"]["confidence"] == 0.95
    d = free["designs"][0]
    assert d["mean_score_in"] > d["mean_score_out"]
    assert len(d["scores_in"]) == d["included"] and len(d["scores_in"]) + len(d["scores_out"]) == 200
    report = (tmp_path / "noisy" / "report.md").read_text()
    assert "**Audited:** ε̂ ≥ 0 at 95% confidence by a final-model audit with m = 200 canaries" in report
    assert "does not show that the certified ε is tight" in report
    card = (tmp_path / "noisy" / "model" / "README.md").read_text()
    assert "**Audited:** ε̂ ≥" in card and "m = 200 canaries" in card and "dp_audited_epsilon_lower_bound:" in card
    # issue 44 item 6: the headline is valid for any mechanism; f-DP beside it, with its assumption
    assert "valid for any mechanism (Steinke" in card and "assuming a Gaussian trade-off curve (f-DP" in card
    assert "dp_audited_epsilon_lower_bound_gaussian_tradeoff:" in card and noisy["headline"]["method"] == "steinke"
    assert noisy["whitebox"]["m"] == 200 and "white-box upper reference" in card
    assert json.loads((tmp_path / "noisy" / "report.json").read_text())["final_model_audit"]["m"] == 200


@pytest.mark.slow
def test_cli_final_model_attaches_to_a_run(small_bert, data_csv, tmp_path):
    from typer.testing import CliRunner

    from dpft.cli.commands import app
    from dpft.config.recipe import dump_recipe
    from dpft.run.loop import Trainer

    r = _recipe(small_bert, data_csv, **{"privacy.noise_multiplier": 5.0, "schedule.steps": 5,
                                              "batch.expected_batch_size": 32})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(dump_recipe(r))
    shipped = tmp_path / "shipped"
    Trainer(r, shipped, progress=False).run()  # the model a user ships (no canaries)
    res = CliRunner().invoke(app, ["audit", str(recipe), "--final-model", "--canaries", "40", "-o",
                                   str(tmp_path / "aud"), "--attach", str(shipped)])
    assert res.exit_code == 0, res.output
    assert "random canaries (m = 40): ε̂ ≥" in res.output and "at 95% confidence" in res.output
    assert (tmp_path / "aud" / "final_model_audit.md").is_file()
    card = (shipped / "model" / "README.md").read_text()
    assert "on a run of the same recipe with the canaries added" in card
    bad = CliRunner().invoke(app, ["audit", str(recipe), "--final-model", "--canaries", "5", "-o",
                                   str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "at least 20" in bad.output


def _release_steps(sigma: float, sensitivity: float, steps: int, grads: dict) -> None:
    """``steps`` releases of a real DPStep (Gaussian mechanism σ, clip sensitivity C, q = ½) on a
    fixed clipped sum ``grads``; the optimizer's learning rate is 0."""
    from types import SimpleNamespace

    from dpft.accounting.ledger import PrivacyLedger
    from dpft.step.noise import GaussianMechanism
    from dpft.step.pipeline import DPStep, StepSpec

    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads.items()}
    spec = StepSpec(engine=SimpleNamespace(params=params), clip=SimpleNamespace(sensitivity=sensitivity),
                    mechanism=GaussianMechanism(sigma, sensitivity, Randomness()), sampler=SimpleNamespace(q=0.5),
                    optimizer=torch.optim.SGD(list(params.values()), lr=0.0))
    step = DPStep(spec, PrivacyLedger(), n=100)
    for t in range(steps):
        agg = SimpleNamespace(sum=grads, loss_sum=0.0, batch_size=0, clipped=0, overflowed=0, norms=[])
        step.release_and_update(t, agg)


def test_dirac_canaries_ride_every_release_with_the_run_noise():
    from dpft.audit.dirac import dirac_canaries
    from dpft.step import pipeline

    grads = {"a": torch.zeros(30), "b": torch.zeros(4, 5)}
    with dirac_canaries(40, Randomness()) as wb:
        assert pipeline._RELEASE_OBSERVERS == [wb]  # the DP step's release hook, not a patch
        _release_steps(0.0, 2.0, 25, grads)  # σ = 0: the release is the canaries alone
    assert pipeline._RELEASE_OBSERVERS == []  # the hook ends with the run
    assert wb.releases == 25 and grads["a"].abs().sum() == 0  # the caller's sums are not touched
    coords = [(n, int(c)) for n, _, cs in wb._where for c in cs]
    assert len(set(coords)) == 40
    inc = wb.included
    assert bool((wb.scores[~inc] == 0).all()) and bool((wb.scores[inc] > 0).all())  # q·T ≈ 12 joins each
    assert abs(wb.scores[inc].mean().item() - 12.5) < 3
    with dirac_canaries(40, Randomness()) as wb2:
        # σ = 0.5: ε̂ ≥ 1.5 in 300 secret-key runs (σ = 1 gave ε̂ = 0 in 2 of 300 with 40 canaries)
        _release_steps(0.5, 1.0, 25, grads)
    from dpft.audit.estimators import epsilon_lower_bound

    b = epsilon_lower_bound(wb2.scores[wb2.included].tolist(), wb2.scores[~wb2.included].tolist(), delta=1e-5)
    assert b.epsilon > 0  # σ = 0.5 over 25 releases: in and out separate


def test_dirac_canaries_skip_a_mechanism_they_cannot_score():
    from dpft.audit.dirac import DiracCanaries
    from dpft.step.noise import GaussianMechanism

    class Banded(GaussianMechanism):  # stands in for BandedMFMechanism (correlated noise)
        pass

    wb = DiracCanaries(10, Randomness())
    grads = {"a": torch.zeros(20)}
    mech = Banded(1.0, 1.0, Randomness())
    assert wb.before_release(grads, 1.0, 0.5, 0, mech) is grads
    wb.after_release(grads, 1.0, 0.5, 0, mech)
    assert wb.unsupported == "Banded" and wb.releases == 0
    assert fm.whitebox_result(wb, 1e-5, 0.95) is None  # no bound reported


@pytest.mark.slow  # 15–35 s: the real stories260K Llama, two canary designs, white-box on the same run
def test_causal_lm_audit_with_two_designs(shared_data, tmp_path):
    import pandas as pd

    from dpft.config.recipe import load_recipe

    words = "the cat sat on a mat and the dog ran to the park with a red ball".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(8)) for i in range(120)]
    pd.DataFrame({"text": texts}).to_csv(tmp_path / "t.csv", index=False)
    r = load_recipe(None, {
        "model.name": str(shared_data / "models" / "stories260K"), "model.max_length": 16, "task.name": "text",
        "task.unit": "document", "task.train_file": str(tmp_path / "t.csv"), "batch.expected_batch_size": 16,
        "batch.max_physical_batch_size": 64, "schedule.steps": 4, "eval.every_steps": 1000, "checkpoint_every": 1000,
        "privacy.delta": 1e-3, "privacy.noise_multiplier": 1.0, "optimizer.lr": 1e-3})
    assert fm.default_designs(r) == ["rare"]
    res = fm.audit_final_model(r, tmp_path / "run", m=24, designs=["rare", "random"], dirac=30, progress=False)
    assert [x["design"] for x in res["designs"]] == ["rare", "random"]
    assert res["whitebox"]["m"] == 30 and res["whitebox"]["releases"] == 4
    assert res["certified_epsilon"] > 0 and not res["violation"]
    for x in res["designs"]:
        assert len(x["scores_in"]) + len(x["scores_out"]) == 24
        assert all(b["confidence"] == 0.95 for b in x["bounds"].values())
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "rare canaries, black-box" in card


def test_a_row_counted_twice_fails_the_same_run_white_box_check(small_bert, data_csv, tmp_path):
    # no one-run ε̂ sees it (benchmarks/results/final_model_audit.md): the batches are checked instead
    r = _recipe(small_bert, data_csv, **{"privacy.noise_multiplier": 1.0, "schedule.steps": 3,
                                              "batch.expected_batch_size": 32})
    bad = fm.audit_final_model(r, tmp_path / "bad", m=20, planted="counted twice", dirac=0, progress=False)
    assert bad["check_rows_once_per_batch"] is False and bad["violation"]
    assert "no row twice in a logical batch — FAIL" in fm.render_audit_md(bad)
    ok = fm.audit_final_model(r, tmp_path / "ok", m=20, dirac=0, progress=False)
    assert ok["check_rows_once_per_batch"] is True


@pytest.mark.slow  # one tiny training with 1,000 Dirac canaries: ~40-100 s on 2 shared cores
def test_planted_noise_over_4_fails_the_final_model_audit_at_epsilon_4(small_bert, data_csv, tmp_path):
    """Issue 44 item 6: at ε = 4 the planted noise/4 exited 0 (Steinke ε̂ below ε, f-DP above it, and only
    Steinke counted). For a ledger of Gaussian releases the f-DP verdict counts: exit 1. (Measured on this
    recipe: white-box f-DP ε̂ 5.90 planted vs 1.98 honest, Steinke 0 for both.)"""
    from typer.testing import CliRunner

    from dpft.audit.estimators import GAUSSIAN_ASSUMPTION
    from dpft.cli.commands import app
    from dpft.config.recipe import dump_recipe

    rec = tmp_path / "r.yaml"
    rec.write_text(dump_recipe(_recipe(small_bert, data_csv, **{"privacy.target_epsilon": 4.0})))
    res = CliRunner().invoke(app, ["audit", str(rec), "--final-model", "--canaries", "100", "--dirac", "2000",
                                   "--plant", "noise/4", "-o", str(tmp_path / "aud")])
    assert res.exit_code == 1, res.output
    assert "verdict: FAIL" in res.output and "f-DP" in res.output and GAUSSIAN_ASSUMPTION in res.output
