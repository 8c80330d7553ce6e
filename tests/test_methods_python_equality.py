"""Methods through the three ways in, in reproducible mode: DP-Adam-AC's private adaptive clipping
and DP-SFT with a given subspace (a basis file whose provenance is a private stage 1) give the
same ledger and the same weights (float tolerance) from ``dpft train``, ``make_private`` and
``DPTrainer`` on one tiny random BERT (dropout 0), the same 54 training rows, SGD, 4 steps.

The ways in name their randomness differently (``make_private``'s loop draws from the child
``make_private:1`` of its seed, ``DPTrainer``'s first ``train()`` from ``hf-train-loop-1``, ``dpft train`` from the
root). The comparison hands ``dpft train``'s ``Trainer`` the way in's stream as its ``rng`` (the
driver's own argument for sub-runs, session/world.py ``session_world``), so all three draw the same
Poisson batches, the same count noise (stream ``count``) and the same gradient noise (``noise``):
what differs is only the way in's code — the front end, the plan's hooks and ``after_update``. (The 54
rows all tokenise to 7 tokens, so no way in pads and the sums run in one order: the weights came out
bit-identical, max |Δw| = 0, in all four cells when this was written.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dpft.privacy.randomness import Randomness

SEED = 7
STEPS = 4
SIGMA = 1.0
AC = {"adaptive_clip": True, "count_noise": 2.0, "clip_lr": 0.5}
K = 3


def _methods(kind: str, basis_path) -> tuple[dict, dict]:
    """(the recipe's overrides, the Python ways in's method entry) of one method."""
    if kind == "adaptive_clip":
        return {f"adam_ac.{k}": v for k, v in AC.items()}, {"name": "dp_adam_ac", **AC}
    sub = {"source": "file", "file": str(basis_path), "k": K, "start": "initial"}
    return {f"subspace.{k}": v for k, v in sub.items()}, {"name": "dpsft", **sub}


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BERT without dropout (so no way in's dropout masks enter the comparison)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from dpft.models.load import resolve_model_path

    d = tmp_path_factory.mktemp("tinybert_nodrop")
    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    # a random orthonormal basis over every parameter, recorded as built by a private stage 1
    import dp_accounting as dpa

    from dpft.accounting.ledger import PrivacyLedger
    from dpft.transforms.subspace import SubspaceBasis

    params = dict(model.named_parameters())
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), K,
                                          generator=torch.Generator().manual_seed(2)))
    blocks, o = {}, 0
    for n, p in params.items():
        blocks[n] = flat[o:o + p.numel()].T.reshape(K, *p.shape).contiguous()
        o += p.numel()
    led = PrivacyLedger()
    led.record("subspace", dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(3.0)), 5)
    SubspaceBasis(blocks=blocks, singular_values=torch.ones(K, dtype=torch.float64),
                  meta={"source": "private", "ledger": led.to_json()}).save(d / "basis.safetensors")
    return d


def _cli(bert_dir, csv, run_dir, rng, kind):
    from dpft.config.recipe import load_recipe
    from dpft.run.loop import Trainer

    ov = {"model.name": str(bert_dir), "model.max_length": 16, "task.name": "files", "task.train_file": str(csv),
          "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 8, "schedule.steps": STEPS,
          "schedule.decay": "constant", "eval.every_steps": STEPS, "checkpoint_every": STEPS, "privacy.delta": 1e-3,
          "optimizer.name": "sgd", "optimizer.lr": 0.5, "privacy.reproducible": True, "seed": SEED,
          "privacy.noise_multiplier": SIGMA, **_methods(kind, bert_dir / "basis.safetensors")[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = Trainer(load_recipe(None, ov), run_dir, progress=False, rng=rng)
        init = {k: v.detach().clone() for k, v in tr.params.items()}
        tr.run()
    return tr, init


def _ledger(ledger) -> list:
    return [(e.phase, repr(e.event), e.count) for e in ledger.entries]


def _max_dw(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, tok):
        self.rows = [{"input_ids": r["input_ids"], "token_type_ids": r["token_type_ids"], "label": r["label"]}
                     for r in tok]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adaptive_clip", "dpsft_file"])
def test_method_make_private_equals_dpft_train(kind, bert_dir, sst_like_files, tmp_path):
    from transformers import BertForSequenceClassification

    from dpft import PrivacyEngine
    from dpft.data.tokenize import collate

    cli, init = _cli(bert_dir, sst_like_files["csv"], tmp_path / "cli", Randomness(SEED).child("make_private:1"), kind)
    model = BertForSequenceClassification.from_pretrained(bert_dir).train()
    assert _max_dw(init, dict(model.named_parameters())) == 0.0  # the same starting weights
    eng = PrivacyEngine(reproducible_seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=torch.nn.CrossEntropyLoss(),
            dataset=_Rows(cli.train_tok), expected_batch_size=8, max_grad_norm=1.0, max_physical_batch_size=8,
            steps=STEPS, noise_multiplier=SIGMA, collate_fn=lambda rows: collate(rows, 0, True),
            methods=[_methods(kind, bert_dir / "basis.safetensors")[1]])
        cs = []
        while opt.logical_steps < STEPS:
            for batch in loader:
                labels = batch.pop("labels")
                crit(module(**batch).logits, labels).backward()
                if opt.step():
                    cs.append(opt.method_stats.get("clip_norm"))
                opt.zero_grad()
                if opt.logical_steps >= STEPS:
                    break
    assert _ledger(eng.ledger) == _ledger(cli.ledger)
    assert [e.phase for e in eng.ledger.entries] == (["train"] if kind == "adaptive_clip" else ["subspace", "train"])
    assert eng.ledger.entries[-1].count == STEPS  # one event per step (adaptive clip: gradient and count)
    if kind == "adaptive_clip":
        assert opt.max_grad_norm == pytest.approx(cli.clip.max_norm, rel=1e-5)  # C after the last update
        assert cs[0] == 1.0 and len(set(cs)) == STEPS  # C moved after every step
    dw = _max_dw(dict(model.named_parameters()), cli.params)
    print(f"{kind}: max |Δw| make_private vs dpft train = {dw:.3g}")
    assert dw < 1e-4, dw
    moved = _max_dw(dict(model.named_parameters()), init)
    assert moved > 100 * max(dw, 1e-7)  # the weights moved far more than the ways in differ


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adaptive_clip", "dpsft_file"])
def test_method_dptrainer_equals_dpft_train(kind, bert_dir, sst_like_files, tmp_path):
    from transformers import BertForSequenceClassification, TrainingArguments

    from dpft.data.tokenize import collate
    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    import datasets

    cli, init = _cli(bert_dir, sst_like_files["csv"], tmp_path / "cli", Randomness(SEED).child("hf-train-loop-1"), kind)
    rows = _Rows(cli.train_tok).rows
    ds = datasets.Dataset.from_list(rows)
    model = BertForSequenceClassification.from_pretrained(bert_dir).train()
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), learning_rate=0.5, optim="sgd", weight_decay=0.0,
                             lr_scheduler_type="constant", per_device_train_batch_size=8, max_steps=STEPS,
                             report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True, save_strategy="no")
    dp = DPArguments(noise_multiplier=SIGMA, target_delta=1e-3, expected_batch_size=8, max_grad_norm=1.0,
                     reproducible_seed=SEED, methods=[_methods(kind, bert_dir / "basis.safetensors")[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=lambda f: collate(f, 0, True),
                       dp_args=dp)
        tr.train()
    assert _ledger(tr.ledger) == _ledger(cli.ledger)
    if kind == "adaptive_clip":
        assert tr.clip.max_norm == pytest.approx(cli.clip.max_norm, rel=1e-5)
        assert tr.method_stats["clip_norm"] != 1.0  # C in force at the last step had moved
    dw = _max_dw({n: p for n, p in model.named_parameters()}, cli.params)
    print(f"{kind}: max |Δw| DPTrainer vs dpft train = {dw:.3g}")
    assert dw < 1e-4, dw
    assert _max_dw(dict(model.named_parameters()), init) > 100 * max(dw, 1e-7)
