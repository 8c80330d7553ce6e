"""Final-model audit from the Python ways in (audit/final_model_python.py, issue 37): a make_private
loop on a tiny bag-of-embeddings classifier, DPTrainer on a tiny random BERT, DPSFTTrainer on a tiny
random Llama; the planted bug "counted twice"."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dpft import PrivacyEngine
from dpft.audit import final_model_python as fmp
from dpft.audit.planted import plant
from dpft.privacy.randomness import Randomness

VOCAB, DATA_VOCAB, LENGTH = 8000, 100, 12


class Bag(nn.Module):
    """Mean of token embeddings → linear head. The data uses tokens < 100 and the canaries the
    ~7900 others, so a canary's embeddings are moved by that canary alone."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):  # (B, T) int64 -> (B, 2)
        return self.head(self.emb(tokens).mean(1))


def rows(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, DATA_VOCAB, (n, LENGTH), generator=g)
    y = ((x < DATA_VOCAB // 2).float().mean(1) > 0.5).long()
    return [{"tokens": x[i], "label": y[i]} for i in range(n)]


def canaries(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(DATA_VOCAB, VOCAB, (m, LENGTH), generator=g)
    y = torch.randint(0, 2, (m,), generator=g)
    return [{"tokens": x[i], "label": y[i]} for i in range(m)]


def make_train(sigma: float, epochs: int, lr: float = 100.0, seen: list | None = None):
    def train(model, train_rows):
        if seen is not None:
            seen.append(train_rows)
        engine = PrivacyEngine()
        module, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(train_rows, batch_size=32), noise_multiplier=sigma, epochs=epochs,
            max_grad_norm=1.0, max_physical_batch_size=64)
        for _ in range(epochs):
            for b in loader:
                opt.zero_grad()
                crit(module(b["tokens"]), b["label"]).backward()
                opt.step()
        return engine

    return train


def loss(model, b):
    return fmp.log_odds(model(b["tokens"]), b["label"])


def test_log_odds_is_the_classifier_score():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0]])
    y = torch.tensor([0, 2])
    p = torch.softmax(logits.double(), 1)[torch.arange(2), y]
    assert torch.allclose(fmp.log_odds(logits, y), torch.log1p(-p) - torch.log(p))


def test_add_rows_keeps_the_kind():
    import datasets

    assert fmp.add_rows([1, 2], [3]) == [1, 2, 3]
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "label": [0]})
    both = fmp.add_rows(ds, [{"input_ids": [5, 6, 7], "label": 1}])
    assert isinstance(both, datasets.Dataset) and both["label"] == [0, 1] and both.features == ds.features
    t = fmp.add_rows(torch.utils.data.TensorDataset(torch.zeros(3, 2)), [(torch.ones(2),)])
    assert len(t) == 4 and torch.equal(t[3][0], torch.ones(2))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(TypeError, match="map-style"):
        fmp.add_rows(Stream(), [2])


def test_make_private_audit_trains_on_the_included_canaries_and_reports_both_epsilons():
    torch.manual_seed(0)
    seen: list = []
    data, cans = rows(120), canaries(40)
    audit = fmp.audit_final_model_make_private(make_train(1.0, 1, lr=1.0, seen=seen), Bag(), data, cans, loss, delta=1e-4,
                                   dirac=50)
    (train_rows,) = seen
    included = audit["designs"][0]["included"]
    assert len(train_rows) == 120 + included == audit["n_train_with_canaries"]
    extra = train_rows[120:]
    assert all(any(torch.equal(r["tokens"], c["tokens"]) for c in cans) for r in extra)  # only canaries added
    assert 0 < included < 40  # 40 fair secret coins
    assert 0 < audit["certified_epsilon"] < float("inf") and audit["sigma"] == 1.0
    assert audit["steps"] == audit["whitebox"]["releases"] > 0  # the Dirac canaries rode every release
    d = audit["designs"][0]
    assert len(d["scores_in"]) == included and len(d["scores_in"]) + len(d["scores_out"]) == 40
    assert set(d["bounds"]) == {"fdp", "steinke"} and d["bounds"]["fdp"]["confidence"] == 0.95
    line = fmp.audit_line(audit)
    assert line.startswith("make_private: ε̂ ≥") and "m = 40" in line and "certified ε =" in line
    assert "white-box ε̂ ≥" in line
    json.dumps(audit)  # serialisable as written by the CLI audit


def test_make_private_audit_refusals_name_the_fix():
    with pytest.raises(ValueError, match="at least 20"):
        fmp.audit_final_model_make_private(make_train(1.0, 1), Bag(), rows(40), canaries(10), loss, delta=1e-3)
    with pytest.raises(ValueError, match="confidence"):
        fmp.audit_final_model_make_private(make_train(1.0, 1), Bag(), rows(40), canaries(20), loss, delta=1e-3, confidence=1.0)
    with pytest.raises(ValueError, match="planted"):
        fmp.audit_final_model_make_private(make_train(1.0, 1), Bag(), rows(40), canaries(20), loss, delta=1e-3, planted="seed32")
    with pytest.raises(ValueError, match="one loss per row"):
        fmp.audit_final_model_make_private(make_train(1.0, 1), Bag(), rows(40), canaries(20), lambda m, b: loss(m, b).sum(),
                               delta=1e-3)
    with pytest.raises(TypeError, match="PrivacyEngine"):
        fmp.audit_final_model_make_private(lambda model, r: "done", Bag(), rows(40), canaries(20), loss, delta=1e-3)


@pytest.mark.slow  # 2 runs of ~10–40 s each on a shared 2-core machine
def test_make_private_non_private_run_gives_a_large_bound_and_noise_a_bound_below_epsilon():
    # Probed 10 runs each before choosing the thresholds (benchmarks/results/final_model_audit.md):
    # σ = 0: ε̂ 2.11–3.96 (> 1.0); σ = 3 (ε ≈ 0.67): black-box ε̂ 0 in all 10, white-box ≤ 0.26.
    torch.manual_seed(0)
    free = fmp.audit_final_model_make_private(make_train(0.0, 3), Bag(), rows(300), canaries(200), loss, delta=1e-5)
    assert free["certified_epsilon"] == float("inf") and free["headline"]["epsilon_hat"] > 1.0
    assert free["designs"][0]["mean_score_in"] > free["designs"][0]["mean_score_out"]
    noisy = fmp.audit_final_model_make_private(make_train(3.0, 3), Bag(), rows(300), canaries(200), loss, delta=1e-5, dirac=200)
    eps = noisy["certified_epsilon"]
    assert 0 < eps < float("inf") and not noisy["violation"]
    assert noisy["headline"]["epsilon_hat"] <= eps and noisy["whitebox"]["bounds"]["fdp"]["epsilon"] <= eps


def test_counted_twice_draws_one_sampled_row_twice():
    from dpft.step.sample import PoissonSampler

    s = PoissonSampler(200, 40, Randomness())
    with plant("counted twice"):
        idx = s.indices(3)
    assert len(idx) == len(torch.unique(idx)) + 1  # exactly one row twice
    assert bool((idx[1:] >= idx[:-1]).all())
    clean = s.indices(4)
    assert len(clean) == len(torch.unique(clean))  # the patch ends with the block


def test_counted_twice_reaches_a_make_private_loop():
    from dpft.step.sample import PoissonSampler

    seen = []
    orig = PoissonSampler.draw

    with plant("counted twice"):
        patched = PoissonSampler.draw

        def spy(self, step, q):
            out = patched(self, step, q)
            seen.append(out)
            return out

        PoissonSampler.draw = spy
        try:
            make_train(1.0, 1, lr=0.1)(Bag(), rows(64))
        finally:
            PoissonSampler.draw = patched
    assert PoissonSampler.draw is orig
    assert seen and all(len(i) == len(torch.unique(i)) + 1 for i in seen if len(i))


# ----------------------------------------------------------------------------- DPTrainer / DPSFTTrainer

WORDS = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull", "a", "film", "number"]


@pytest.fixture(scope="module")
def bert_and_rows(tmp_path_factory):
    """A tiny random BERT classifier with an 8000-id vocabulary (the data use 25 ids, the canaries
    the others) and 200 tokenised rows."""
    datasets = pytest.importorskip("datasets")
    from transformers import BertConfig, BertTokenizer

    d = tmp_path_factory.mktemp("bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [str(i) for i in range(10)]
    vocab += [f"w{i}" for i in range(8000 - len(vocab))]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizer(str(d / "vocab.txt"))
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64)
    texts = [f"a {WORDS[i % 8]} film number {i % 10}" for i in range(200)]
    enc = tok(texts, truncation=True, max_length=16)
    ds = datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                     "label": [int(i % 8 % 2 == 0) for i in range(200)]})
    return tok, cfg, ds


def _dp_trainer_factory(tok, cfg, tmp_path, sigma: float, steps: int, seen: list):
    from transformers import BertForSequenceClassification, DataCollatorWithPadding, TrainingArguments

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)

    def make(train_dataset):
        seen.append(train_dataset)
        return DPTrainer(model=model, args=TrainingArguments(
            output_dir=str(tmp_path / f"out-{sigma}-{len(seen)}"), learning_rate=2e-2, max_steps=steps,
            per_device_train_batch_size=128, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
            logging_steps=1000), train_dataset=train_dataset, data_collator=DataCollatorWithPadding(tok),
            dp_args=DPArguments(noise_multiplier=sigma, target_delta=1e-5, max_grad_norm=1.0, expected_batch_size=64))

    return make


def test_dp_trainer_audit_adds_canaries_in_the_dataset_format_and_writes_the_audited_card(bert_and_rows, tmp_path):
    tok, cfg, ds = bert_and_rows
    seen: list = []
    audit = fmp.audit_final_model_trainer(_dp_trainer_factory(tok, cfg, tmp_path, 2.0, 2, seen), ds, tokenizer=tok, m=30,
                              dirac=40, canary_length=16, output_dir=tmp_path / "audited")
    (train_ds,) = seen
    inc = audit["designs"][0]["included"]
    assert len(train_ds) == 200 + inc == audit["n_train_with_canaries"] and train_ds.features == ds.features
    extra = train_ds.select(range(200, len(train_ds)))
    special = set(tok.all_special_ids)
    assert all(len(ids) == 16 and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
               and not special & set(ids[1:-1]) for ids in extra["input_ids"])  # [CLS] random vocabulary tokens [SEP]
    assert set(extra["label"]) <= {0, 1} and audit["designs"][0]["design"] == "random"
    assert audit["way_in"] == "DPTrainer" and audit["steps"] == 2 and 0 < audit["certified_epsilon"] < float("inf")
    assert audit["whitebox"]["releases"] == 2 and audit["check_rows_once_per_batch"] is True
    card = (tmp_path / "audited" / "README.md").read_text()
    assert "**Audited:** ε̂ ≥" in card and "m = 30 canaries" in card and "dp_audited_epsilon_lower_bound:" in card
    assert json.loads((tmp_path / "audited" / "final_model_audit.json").read_text())["way_in"] == "DPTrainer"


@pytest.mark.slow  # two DPTrainer runs of 20 steps, 20–60 s each on a shared 2-core machine
def test_dp_trainer_non_private_run_gives_a_large_bound_and_noise_a_bound_below_epsilon(bert_and_rows, tmp_path):
    # Probed 10 runs each before choosing the thresholds (benchmarks/results/final_model_audit.md):
    # σ = 0: ε̂ 1.86–4.61 (> 1.0); σ = 2 (ε ≈ 2.3–2.5): black-box ε̂ ≤ 0.36, white-box ≤ 0.81.
    tok, cfg, ds = bert_and_rows
    free = fmp.audit_final_model_trainer(_dp_trainer_factory(tok, cfg, tmp_path, 0.0, 20, []), ds, tokenizer=tok, m=200,
                             canary_length=16)
    assert free["certified_epsilon"] == float("inf") and free["headline"]["epsilon_hat"] > 1.0
    noisy = fmp.audit_final_model_trainer(_dp_trainer_factory(tok, cfg, tmp_path, 2.0, 20, []), ds, tokenizer=tok, m=200,
                              canary_length=16, dirac=200)
    eps = noisy["certified_epsilon"]
    assert not noisy["violation"] and noisy["headline"]["epsilon_hat"] <= eps
    assert noisy["whitebox"]["bounds"]["fdp"]["epsilon"] <= eps


def _word_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<unk>", "<s>", "</s>"]
    words = [f"t{i}" for i in range(200)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(special + words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>")


def test_dp_sft_trainer_audit_on_text_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    import transformers
    from trl import SFTConfig

    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPSFTTrainer

    tok = _word_tokenizer()
    ds = datasets.Dataset.from_dict({"text": [" ".join(f"t{(i + j) % 40}" for j in range(6)) for i in range(40)]})
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=2, eos_token_id=3)
    model = transformers.LlamaForCausalLM(cfg)
    made = []

    def make(train_dataset):
        made.append(DPSFTTrainer(model=model, args=SFTConfig(
            output_dir=str(tmp_path / "out"), max_steps=2, learning_rate=1e-2, per_device_train_batch_size=64,
            report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, dataset_num_proc=None),
            train_dataset=train_dataset, processing_class=tok,
            dp_args=DPArguments(noise_multiplier=1.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=16)))
        return made[0]

    audit = fmp.audit_final_model_trainer(make, ds, tokenizer=tok, m=24, canary_length=8)
    (tr,) = made
    inc = audit["designs"][0]["included"]
    assert audit["designs"][0]["design"] == "rare" and audit["way_in"] == "DPSFTTrainer"
    assert tr.n == 40 + inc == audit["n_train_with_canaries"]
    # rare canaries: words the 40 rows never use (t40…t199), tokenised by TRL as the trainer trains them
    canary_ids = [ids for ids in tr.train_dataset["input_ids"] if any(i >= 4 + 40 for i in ids)]
    assert len(canary_ids) == inc and all(min(i for i in ids if i >= 4) >= 44 for ids in canary_ids)
    assert 0 < audit["certified_epsilon"] < float("inf")
    assert len(audit["designs"][0]["scores_in"]) + len(audit["designs"][0]["scores_out"]) == 24


def test_trainer_audit_refuses_a_dataset_format_it_has_no_canaries_for():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"prompt": ["hi"], "completion": ["there"]})
    with pytest.raises(ValueError, match="map it to one of these first"):
        fmp.audit_final_model_trainer(lambda d: None, ds, tokenizer=_word_tokenizer(), m=20)
    with pytest.raises(ValueError, match="at least 20"):
        fmp.audit_final_model_trainer(lambda d: None, ds, tokenizer=_word_tokenizer(), m=5)
