"""The ``seq2seq`` task (issue 27 item 4): source → target pairs for encoder-decoder models (T5,
BART), loss on the target tokens summed per example; per-example clipping equal to one backward
per example (q = 1, σ = 0); T5 full fine-tuning refused before any data is read; a tiny
end-to-end ``dpft train`` run (ledger ε, BLEU/ROUGE-L of generations, the saved model reloaded with
``AutoModelForSeq2SeqLM`` / PEFT).

Tiny random-initialised T5 and BART and a word-level tokenizer built in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dpft.config.recipe import TaskCfg, load_recipe
from dpft.data.seq2seq import encode_pairs, load_seq2seq_task
from dpft.data.tasks import DataError
from dpft.data.tokenize import collate
from dpft.models.losses import seq2seq_lm_loss

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("name eat type pub food french near river cheap serves family friendly the is a an in city centre it "
         "and not area price range rating high low average customer coffee shop restaurant").split()


def tiny_tokenizer():
    """Word-level fast tokenizer that appends ``</s>`` (as T5's does); pad id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    special = ["<pad>", "</s>", "<unk>", "<s>"]
    vocab = {w: i for i, w in enumerate(special + ["[", "]", ",", "."] + sorted(set(WORDS)))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    t.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", bos_token="<s>")


def tiny_model(family: str, vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    tf = transformers
    if family == "T5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    return tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=vocab, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=3, decoder_start_token_id=1, forced_bos_token_id=None,
        forced_eos_token_id=1))


PAIRS = [("name [ the eagle ] food [ french ]", "the eagle serves french food ."),
         ("name [ pub ] area [ city centre ]", "a pub in the city centre"),
         ("name [ the eagle ] price range [ cheap ] near [ river ]", "cheap ."),
         ("eat type [ coffee shop ]", "it is a coffee shop , not a restaurant , with high customer rating")]


#: Three examples whose targets are 3 tokens long: the decoder's position ids (T,) then have the
#: micro-batch's size as their leading dim (a shared tensor that looks per example).
SHORT = [("name [ pub ]", "cheap ."), ("food [ french ]", "a pub"), ("area [ river ] near [ city centre ]", "french food")]


def _batch(tok, pairs=PAIRS):
    enc = encode_pairs([s for s, _ in pairs], [t for _, t in pairs], tok, 64, 64)
    return enc, collate([{"input_ids": a, "target_ids": b} for a, b in zip(enc["input_ids"], enc["target_ids"])],
                        tok.pad_token_id)


def test_targets_end_with_eos_and_only_target_tokens_carry_loss():
    tok = tiny_tokenizer()
    enc, batch = _batch(tok)
    assert all(t[-1] == tok.eos_token_id for t in enc["target_ids"])
    assert tok.convert_ids_to_tokens(enc["target_ids"][2]) == ["cheap", ".", "</s>"]
    assert set(batch) == {"input_ids", "attention_mask", "labels"}  # no position ids: T5/BART take none
    assert (batch["labels"][2, 3:] == -100).all() and (batch["input_ids"][2][batch["attention_mask"][2] == 0] == 0).all()
    model = tiny_model("BART", len(tok)).eval()
    losses = seq2seq_lm_loss(model, batch)
    for i, (s, t) in enumerate(zip(enc["input_ids"], enc["target_ids"])):  # alone, unpadded: the same sum
        one = model(input_ids=torch.tensor([s]), labels=torch.tensor([t])).logits[0]
        assert losses[i].item() == pytest.approx(float(F.cross_entropy(one, torch.tensor(t), reduction="sum")),
                                                 rel=1e-5)
    # truncation keeps EOS last; an EOS-less tokenizer is refused
    cut = encode_pairs(["name [ pub ]"], ["a pub in the city centre"], tok, 3, 3)
    assert cut["target_ids"][0][-1] == tok.eos_token_id and len(cut["target_ids"][0]) == 3 and cut["cut_target"][0]
    assert cut["input_ids"][0][-1] == tok.eos_token_id and len(cut["input_ids"][0]) == 3


def _per_example_grads(model, batch) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Per-example gradients from one backward per example (its unpadded rows alone) and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(batch["input_ids"].shape[0]):
        s = int(batch["attention_mask"][i].sum())
        t = int((batch["labels"][i] != -100).sum())
        one = {"input_ids": batch["input_ids"][i:i + 1, :s], "attention_mask": batch["attention_mask"][i:i + 1, :s],
               "labels": batch["labels"][i:i + 1, :t]}
        g = torch.autograd.grad(seq2seq_lm_loss(model, one).sum(), params, allow_unused=True)
        grads.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return torch.stack([torch.sqrt(sum(x.pow(2).sum() for x in g)) for g in grads]), grads


@pytest.mark.parametrize("family,mode,pairs", [("T5", "lora", PAIRS), ("BART", "lora", PAIRS), ("BART", "full", SHORT)])
def test_bookkeeping_equals_one_backward_per_example(family, mode, pairs):
    """q = 1, σ = 0: the book-keeping engine's clipped sum on a padded seq2seq batch equals the
    per-example reference (each example alone, clipped, summed) to fp32 rounding. BART in full
    fine-tuning on SHORT: its decoder position ids (T,) have the micro-batch's size as leading dim."""
    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.step.clip import make_clip_policy

    tok = tiny_tokenizer()
    _, batch = _batch(tok, pairs)
    model = tiny_model(family, len(tok))
    if mode == "lora":
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(
            task_type="SEQ_2_SEQ_LM", r=2, lora_alpha=4, init_lora_weights=False,
            target_modules=["q", "k", "v", "o", "wi", "wo"] if family == "T5" else
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]))
    model.eval()
    norms, grads = _per_example_grads(model, batch)
    k = len(grads) // 2
    C = float(norms.sort().values[k - 1:k + 1].mean())  # half the examples clipped, half not
    scale = (C / (norms + 1e-6)).clamp(max=1.0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ref = {n: sum(scale[i] * grads[i][j] for i in range(len(grads))) for j, n in enumerate(names)}
    bk = BookKeepingEngine(model, seq2seq_lm_loss, make_clip_policy("flat", C)).clipped_sum(batch)
    assert torch.allclose(bk.norms, norms, rtol=1e-4)
    total = torch.sqrt(sum(r.pow(2).sum() for r in ref.values()))
    for n, r in ref.items():
        err = float((bk.grad_sum[n] - r).norm() / max(float(r.norm()), 1e-3 * float(total)))
        assert err <= 1e-4, (n, err)


def _files(tmp_path: Path) -> dict[str, Path]:
    import pandas as pd

    rows = [{"mr": s, "ref": t} for s, t in PAIRS] * 6
    pd.DataFrame(rows).to_csv(tmp_path / "train.csv", index=False)
    pd.DataFrame(rows[:6] + [{"mr": PAIRS[0][0], "ref": "the eagle is a french pub ."}]).to_csv(
        tmp_path / "dev.csv", index=False)
    return {"train": tmp_path / "train.csv", "dev": tmp_path / "dev.csv"}


def _model_dir(tmp_path: Path, family: str) -> Path:
    tok = tiny_tokenizer()
    d = tmp_path / f"tiny-{family.lower()}"
    tiny_model(family, len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _overrides(tmp_path, family, mode, **extra):
    f = _files(tmp_path)
    ov = {"model.name": str(_model_dir(tmp_path, family)), "model.max_length": 32, "task.train_file": str(f["train"]),
          "task.dev_file": str(f["dev"]), "trainable.mode": mode, "privacy.target_epsilon": None,
          "privacy.noise_multiplier": 1.0, "privacy.delta": 1e-3, "schedule.epochs": None, "schedule.steps": 2,
          "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 4, "eval.every_steps": 2,
          "eval.max_new_tokens": 4, "checkpoint_every": 2}
    if family == "BART":
        ov["trainable.lora.target_modules"] = ["q_proj", "v_proj"]
    ov.update(extra)
    return ov


def test_seq2seq_recipe_validates():
    r = load_recipe(ROOT / "recipes/e2e-t5-lora.yaml")
    assert r.task.name == "seq2seq" and r.trainable.mode == "lora" and r.task.prompt_column == "mr"
    with pytest.raises(Exception, match="test_file"):
        load_recipe(None, {"task.name": "seq2seq", "task.test_file": "x.csv"})


# T5 full: its relative-attention bias table has an exact rule (grads/relbias.py, issue 36); it was
# refused before.
@pytest.mark.parametrize("family,mode", [("T5", "lora"), ("T5", "full"), ("BART", "full")])
def test_dpft_train_seq2seq_two_steps_ledger_generation_and_reload(tmp_path, monkeypatch, family, mode):
    import dp_accounting as dpa

    import dpft
    from dpft.accounting.ledger import PrivacyLedger

    monkeypatch.chdir(ROOT)
    ov = _overrides(tmp_path, family, mode)
    rep = dpft.train(ROOT / "recipes/e2e-t5-lora.yaml", tmp_path / "run", progress=False, overrides=ov)
    run = tmp_path / "run"
    led = PrivacyLedger.load(run / "ledger.json")
    want = dpa.PoissonSampledDpEvent(8 / 24, dpa.GaussianDpEvent(1.0))
    assert [e.event for e in led.entries] == [want] and led.steps == 2
    assert rep["privacy"]["epsilon"] == pytest.approx(led.epsilon(1e-3).epsilon)
    m = rep["metrics"]
    assert m["dev_generated"] == 4  # 7 dev rows, 4 distinct sources (one with two references)
    assert rep["generation"]["settings"]["references"] == 7
    assert all(0.0 <= m[k] <= 100.0 for k in ("dev_bleu", "dev_rouge_l", "dev_exact_match"))
    assert math.isfinite(m["dev_loss"]) and m["dev_tokens"] > 0
    md = (run / "report.md").read_text()
    assert "Sequence-to-sequence model" in md and "loss on target tokens only" in md
    card = (run / "model" / "README.md").read_text()
    assert "pipeline_tag: text2text-generation" in card
    # the saved model loads with the standard classes, and generates the run's own dev outputs
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "model")
    if mode == "lora":
        assert (run / "model" / "adapter_config.json").is_file()
        model = peft.AutoPeftModelForSeq2SeqLM.from_pretrained(run / "model")
        assert json.loads((run / "model" / "dpft_adapter.json").read_text())["task"] == "seq2seq_lm"
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(run / "model")
    from dpft.models.export import load_for_inference

    _, m2, kind = load_for_inference(run / "model")
    assert kind == "seq2seq_lm"
    enc = tok([PAIRS[0][0]], return_tensors="pt")
    a = model.eval().generate(**enc, max_new_tokens=4, do_sample=False)
    b = m2.generate(**enc, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)
    # dpft predict on a file of sources
    from dpft.run.predict import predict

    out = predict(run, tmp_path / "dev.csv", progress=False, max_new_tokens=4)
    assert out["kind"] == "seq2seq_lm" and out["n"] == 7


def test_clear_errors_for_bad_seq2seq_data(tmp_path):
    import pandas as pd

    tok = tiny_tokenizer()
    pd.DataFrame([{"mr": "name [ pub ]", "ref": ""}, {"mr": "x", "ref": "y"}]).to_csv(tmp_path / "e.csv", index=False)
    with pytest.raises(DataError, match="row 1 has an empty target"):
        load_seq2seq_task(TaskCfg(name="seq2seq", train_file=str(tmp_path / "e.csv"), prompt_column="mr",
                                  completion_column="ref"), tok, 16)
    with pytest.raises(DataError, match=r"no source/target column\(s\) \['source'\]"):
        load_seq2seq_task(TaskCfg(name="seq2seq", train_file=str(tmp_path / "e.csv"), prompt_column="source",
                                  completion_column="ref"), tok, 16)


def test_audit_seq2seq_leave_one_out_passes_and_catches_its_planted_bug():
    """``dpft audit``'s seq2seq checks (audit/checks_seq2seq.py): leave-one-out of the step on T5 +
    LoRA and BART within C; with each source collated with the next row's target, a row moves the
    sum by more than C (the planted bug is in the registry ``dpft audit --plant`` takes)."""
    from dpft.audit import planted, suite
    from dpft.audit.checks_seq2seq import PLANTED, seq2seq_checks

    honest = seq2seq_checks(None)
    assert len(honest) == 4 and all(c.passed for c in honest), [c.message for c in honest]
    bad = seq2seq_checks("seq2seq_targets_across_rows")
    assert any(not c.passed for c in bad) and max(c.stats["loo_over_C"] for c in bad) > 1.5
    # issue 36: the shared relative tables' rules, with every example given the batch's gradient
    bad = {c.name: c for c in seq2seq_checks("relative_table_batch_summed")}
    failed = [n for n, c in bad.items() if not c.passed]
    assert any("T5 full" in n for n in failed) and any("DeBERTa-v2" in n for n in failed), \
        {n: c.stats["loo_over_C"] for n, c in bad.items()}
    assert set(PLANTED) <= set(planted.ALL)
    assert ("dpft.audit.checks_seq2seq", "seq2seq_checks", PLANTED) in suite.OPTIONAL_CHECKS
