"""Instruction and chat data (issue 17, items 1, 3, 4): completion-only loss per example, chat
template rendering, left truncation and its counts, clear errors, generation metrics checked
against hand-computed values, multi-reference grouping, and a tiny end-to-end run.

Tiny random-initialised Llama models and a word-level tokenizer built in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F

from dpft.config.recipe import TaskCfg, load_recipe
from dpft.data.instruct import IGNORE, encode, group_references, load_instruct_task, read_conversations, render
from dpft.data.tasks import DataError
from dpft.data.tokenize import collate
from dpft.eval.metrics import corpus_bleu, exact_match, rouge_l, score_generations
from dpft.models.losses import causal_lm_loss

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("hello my router phone is slow will not turn on restart it charge the and then try again thanks what if "
         "that does help bring to a shop name eat type pub food french near river cheap serves family friendly "
         "you are support agent answer briefly sorry hear").split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template: str | None = None):
    """Word-level fast tokenizer (offsets available) with <s>, </s>, <pad>, <unk> and ChatML markers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    punct = [".", ",", "?", ":", "[", "]", "!"]
    vocab = {w: i for i, w in enumerate(special + punct + sorted(set(WORDS)) + ["user", "assistant", "system"])}
    vocab.update({w.capitalize(): len(vocab) + i for i, w in enumerate(["user", "assistant", "system"])})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>",
                                               additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        tok.chat_template = chat_template
    return tok


def tiny_llama(vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return transformers.LlamaForCausalLM(cfg).eval()


def pc(prompt: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


# ------------------------------------------------------------------ rendering and masking
def test_simple_template_prompt_completion_targets_are_the_completion_and_eos():
    tok = tiny_tokenizer()
    text, spans = render(pc("my router is slow", "restart it"), tok, "simple", "\n", prompt_completion=True)
    assert text == "<s>my router is slow\nrestart it</s>"
    assert text[spans[0][0]:spans[0][1]] == "restart it</s>"
    enc = encode([pc("my router is slow", "restart it")], tok, "simple", 64, "\n", True)
    ids, labels = enc["input_ids"][0], enc["labels"][0]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "my", "router", "is", "slow", "restart", "it", "</s>"]
    assert labels == [IGNORE] * 5 + ids[5:]
    assert enc["prompt_len"] == [5] and enc["prompt_ids"][0] == ids[:5]


def test_simple_template_chat_masks_every_non_assistant_turn():
    tok = tiny_tokenizer()
    conv = [{"role": "system", "content": "you are support"}, {"role": "user", "content": "my phone is slow"},
            {"role": "assistant", "content": "restart it"}, {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "bring it to a shop"}]
    text, spans = render(conv, tok, "simple")
    assert text == ("<s>System: you are support\nUser: my phone is slow\nAssistant: restart it</s>\n"
                    "User: thanks\nAssistant: bring it to a shop</s>\n")
    assert [text[a:b] for a, b in spans] == ["restart it</s>", "bring it to a shop</s>"]
    enc = encode([conv], tok, "simple", 128)
    ids, labels = enc["input_ids"][0], enc["labels"][0]
    targets = tok.convert_ids_to_tokens([i for i, x in zip(ids, labels) if x != IGNORE])
    assert targets == ["restart", "it", "</s>", "bring", "it", "to", "a", "shop", "</s>"]
    # the generation prompt ends where the last assistant turn starts
    prompt = tok.convert_ids_to_tokens(enc["prompt_ids"][0])
    assert prompt[-3:] == ["thanks", "Assistant", ":"]


def test_tokenizer_chat_template_is_used_and_assistant_turns_with_end_marker_are_targets():
    tok = tiny_tokenizer(CHATML)
    from dpft.data.instruct import resolve_template

    assert resolve_template("auto", tok) == "chat" and resolve_template("auto", tiny_tokenizer()) == "simple"
    conv = [{"role": "user", "content": "my phone is slow"}, {"role": "assistant", "content": "restart it"},
            {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bring it to a shop"}]
    text, spans = render(conv, tok, "chat")
    assert text == tok.apply_chat_template(conv, tokenize=False)
    assert [text[a:b] for a, b in spans] == ["restart it<|im_end|>\n", "bring it to a shop<|im_end|>\n"]
    enc = encode([conv], tok, "chat", 128)
    ids, labels = enc["input_ids"][0], enc["labels"][0]
    targets = tok.convert_ids_to_tokens([i for i, x in zip(ids, labels) if x != IGNORE])
    assert targets == ["restart", "it", "<|im_end|>", "bring", "it", "to", "a", "shop", "<|im_end|>"]
    # the generation prompt is the template's rendering with the generation prompt
    want = tok(tok.apply_chat_template(conv[:3], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert enc["prompt_ids"][0] == want
    with pytest.raises(DataError, match="no chat template"):
        from dpft.data.instruct import resolve_template as rt
        rt("chat", tiny_tokenizer())


def test_chat_template_that_rewrites_earlier_turns_is_refused():
    tok = tiny_tokenizer("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %} {% endfor %}")
    with pytest.raises(DataError, match="template: simple"):
        render(pc("hello", "restart it"), tok, "chat")


def test_loss_is_completion_only_and_per_example():
    """Per example: the loss is the sum of the completion tokens' cross-entropies; logits at
    positions that predict prompt or padding tokens get exactly zero gradient, and example i's
    loss does not depend on example j's logits."""
    tok = tiny_tokenizer()
    convs = [pc("my router is slow", "restart it"), pc("hello", "charge the phone and then try again"),
             pc("my phone will not turn on", "bring it to a shop")]
    enc = encode(convs, tok, "simple", 64, "\n", True)
    rows = [{"input_ids": a, "labels": b} for a, b in zip(enc["input_ids"], enc["labels"])]
    batch = collate(rows, tok.pad_token_id, with_token_types=False)
    assert batch["labels"].shape == batch["input_ids"].shape
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE).all()  # padding is never a target
    model = tiny_llama(len(tok))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    logits.requires_grad_(True)
    losses = causal_lm_loss(lambda **kw: logits, batch)
    # reference: per example, CE over completion tokens only
    for i, (ids, lab) in enumerate(zip(enc["input_ids"], enc["labels"])):
        want = sum(F.cross_entropy(logits[i, t - 1].detach(), torch.tensor(ids[t]), reduction="sum")
                   for t in range(1, len(ids)) if lab[t] != IGNORE)
        assert losses[i].item() == pytest.approx(float(want), rel=1e-5)
    for i in range(len(rows)):
        (g,) = torch.autograd.grad(losses[i], logits, retain_graph=True)
        active = (batch["labels"][i, 1:] != IGNORE)
        assert g[i, :-1][~active].abs().max() == 0  # prompt and padding positions: no loss
        assert g[i, :-1][active].abs().sum(-1).min() > 0
        assert g[[j for j in range(len(rows)) if j != i]].abs().max() == 0  # other examples: untouched
    # other tokens at the prompt and padding positions, the same logits: the same loss (the
    # loss reads its targets from the completion positions only)
    changed = dict(batch)
    ids = batch["input_ids"].clone()
    ids[batch["labels"] == IGNORE] = (ids[batch["labels"] == IGNORE] + 5) % len(tok)
    changed["input_ids"] = ids
    assert torch.equal(causal_lm_loss(lambda **kw: logits.detach(), changed), losses.detach())


def test_bookkeeping_engine_matches_reference_on_instruct_batches():
    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.grads.reference import ReferenceEngine
    from dpft.step.clip import make_clip_policy

    tok = tiny_tokenizer()
    convs = [pc("my router is slow", "restart it"), pc("hello", "charge the phone and then try again"),
             pc("my phone will not turn on and is slow", "bring it")]
    enc = encode(convs, tok, "simple", 64, "\n", True)
    batch = collate([{"input_ids": a, "labels": b} for a, b in zip(enc["input_ids"], enc["labels"])],
                    tok.pad_token_id, with_token_types=False)
    model = tiny_llama(len(tok))
    bk = BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 0.05)).clipped_sum(batch)
    ref = ReferenceEngine(model, causal_lm_loss, make_clip_policy("flat", 0.05)).clipped_sum(batch)
    assert torch.allclose(bk.norms, ref.norms, rtol=1e-4)
    assert bk.loss_sum == pytest.approx(ref.loss_sum, rel=1e-5)
    for n in ref.grad_sum:
        assert torch.allclose(bk.grad_sum[n], ref.grad_sum[n], atol=1e-6, rtol=1e-4), n


# ------------------------------------------------------------------ truncation
def test_left_truncation_keeps_the_completion_and_is_counted():
    tok = tiny_tokenizer()
    long_prompt = " ".join(["my router is slow"] * 6)  # 24 words: BOS + 24 + 2 + EOS = 28 tokens
    enc = encode([pc(long_prompt, "restart it"), pc("hello", "restart it")], tok, "simple", 10, "\n", True)
    ids, labels = enc["input_ids"][0], enc["labels"][0]
    assert len(ids) == 10 and enc["cut_left"] == [18, 0] and enc["cut_right"] == [0, 0]
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["restart", "it", "</s>"]  # completion whole, at the end
    assert labels[:7] == [IGNORE] * 7 and labels[7:] == ids[7:]
    assert len(enc["prompt_ids"][0]) == 9  # generation prompt: the last max_length - 1 prompt tokens
    # a completion longer than max_length: one prompt token kept, the completion cut on the right
    enc = encode([pc("hello my phone", "charge the phone and then try again")], tok, "simple", 5, "\n", True)
    assert tok.convert_ids_to_tokens(enc["input_ids"][0]) == ["phone", "charge", "the", "phone", "and"]
    assert enc["cut_left"] == [3] and enc["cut_right"] == [4]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_truncation_counts_reported_for_dev_only_when_private(tmp_path):
    tok = tiny_tokenizer()
    long = " ".join(["my router is slow"] * 6)
    rows = [{"prompt": long if i % 2 else "hello", "completion": "restart it", "user": f"u{i % 3}"} for i in range(8)]
    cfg = TaskCfg(name="instruct", train_file=str(_write_jsonl(tmp_path / "t.jsonl", rows)),
                  dev_file=str(_write_jsonl(tmp_path / "d.jsonl", rows[:3])))
    d = load_instruct_task(cfg, tok, 12, private=True)
    assert d.truncated["train"] == 4 and d.truncated["dev"] == 1
    notes = " ".join(d.notes)
    assert "1 of 3 dev rows" in notes and "private training set is not released" in notes
    assert "training rows" not in notes  # the private count is not in the notes (report)
    d2 = load_instruct_task(cfg, tok, 12, private=False)
    assert "4 of 8 training rows" in " ".join(d2.notes)
    # extra columns (a user id for user-level privacy) ride along on every tokenised row
    assert d.train.column_names == ["input_ids", "labels", "user"] and d.train[4]["user"] == "u1"


def test_user_column_that_is_also_the_prompt_is_kept_per_row(tmp_path):
    # e.g. user level over a chat log whose prompt column names the customer's account
    rows = [{"who": f"acct{i % 3}", "completion": "restart it"} for i in range(6)]
    f = _write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = TaskCfg(name="instruct", train_file=str(f), dev_file=str(f), prompt_column="who", user_column="who")
    d = load_instruct_task(cfg, tiny_tokenizer(), 16)
    assert "who" in d.train.column_names and d.train["who"] == [r["who"] for r in rows]


# ------------------------------------------------------------------ errors
def test_clear_errors_for_bad_data(tmp_path):
    tok = tiny_tokenizer()

    def load(rows, **kw):
        f = _write_jsonl(tmp_path / "x.jsonl", rows)
        return load_instruct_task(TaskCfg(name="instruct", train_file=str(f), dev_file=str(f), **kw), tok, 32)

    with pytest.raises(DataError, match=r"prompt_column.*completion_column|columns are"):
        load([{"question": "hello", "answer": "restart it"}])
    with pytest.raises(DataError, match="empty completion"):
        load([{"prompt": "hello", "completion": "  "}])
    with pytest.raises(DataError, match="no assistant message"):
        load([{"messages": [{"role": "user", "content": "hello"}]}])
    with pytest.raises(DataError, match="role.*content"):
        load([{"messages": [{"role": "user", "text": "hello"}, {"role": "assistant", "content": "hi"}]}])
    with pytest.raises(DataError, match="reserved|names dpft uses"):
        load([{"prompt": "hello", "completion": "restart it", "labels": "x"}])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_instruct_task(TaskCfg(name="instruct", train_file=str(tmp_path / "empty.jsonl")), tok, 32)
    with pytest.raises(DataError, match="--train-file"):
        load_instruct_task(TaskCfg(name="instruct"), tok, 32)
    with pytest.raises(DataError, match="not JSON"):
        read_conversations(__import__("datasets").Dataset.from_dict({"messages": ["{oops"]}), TaskCfg(), "f.csv")
    # CSV cells holding JSON message lists are parsed
    convs, used = read_conversations(__import__("datasets").Dataset.from_dict(
        {"messages": [json.dumps(pc("hello", "restart it"))]}), TaskCfg(), "f.csv")
    assert convs == [pc("hello", "restart it")] and used == ["messages"]


# ------------------------------------------------------------------ metrics
HYP, REF = "the cat sat on the mat", "the cat sat on a mat"


def test_bleu_equals_hand_computed_value():
    # modified n-gram precisions of HYP against REF: 5/6, 3/5, 2/4, 1/3; lengths equal: BP = 1
    want = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert corpus_bleu([HYP], [[REF]]) == pytest.approx(want, abs=1e-6)
    assert corpus_bleu([HYP], [[REF, HYP]]) == pytest.approx(100.0)  # multi-reference: the exact one counts
    # corpus level with different numbers of references per prompt (missing streams skipped):
    # counts pooled over both sentences: 1-grams (5+2)/(6+2), 2-grams (3+1)/(5+1), 3-grams 2/4, 4-grams 1/3
    want2 = 100 * (7 / 8 * 4 / 6 * 2 / 4 * 1 / 3) ** 0.25
    assert corpus_bleu([HYP, "hello there"], [[REF], ["hello there", "hi there"]]) == pytest.approx(want2, abs=1e-6)
    import sacrebleu  # the library's own value for the same streams

    assert corpus_bleu([HYP], [[REF]]) == pytest.approx(sacrebleu.corpus_bleu([HYP], [[REF]]).score)


def test_rouge_l_and_exact_match_equal_hand_values():
    # LCS(HYP, REF) = "the cat sat on mat" = 5 of 6 tokens each: P = R = F = 5/6
    assert rouge_l([HYP], [[REF]]) == pytest.approx(100 * 5 / 6)
    assert rouge_l([HYP], [["a dog", REF]]) == pytest.approx(100 * 5 / 6)  # best reference
    assert rouge_l([HYP, "a dog"], [[REF], ["a dog"]]) == pytest.approx(100 * (5 / 6 + 1) / 2)
    assert exact_match(["restart  it ", "no"], [["x", "restart it"], ["yes"]]) == pytest.approx(50.0)
    s = score_generations([HYP], [[REF]])
    assert set(s) == {"dev_bleu", "dev_rouge_l", "dev_exact_match"}
    with pytest.raises(ValueError, match="reference"):
        corpus_bleu(["a"], [[]])
    with pytest.raises(ValueError, match="hypotheses"):
        rouge_l(["a", "b"], [["a"]])


def test_multi_reference_grouping_by_prompt():
    tok = tiny_tokenizer()
    convs = [pc("name pub", "a pub"), pc("name pub", "the pub is cheap"), pc("food french", "french food"),
             pc("name pub", "a cheap pub")]
    enc = encode(convs, tok, "simple", 64, "\n", True)
    groups = group_references(enc, convs, ["name pub", "name pub", "food french", "name pub"])
    assert [g["prompt"] for g in groups] == ["name pub", "food french"]
    assert groups[0]["references"] == ["a pub", "the pub is cheap", "a cheap pub"]
    # truncation does not split a group: the prompt does not depend on the completion's length
    enc = encode(convs, tok, "simple", 6, "\n", True)
    assert len(group_references(enc, convs, ["x"] * 4)) == 2


def test_batched_greedy_generation_equals_one_by_one():
    from dpft.eval.generate import generate_ids

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=1)
    prompts = [[2, 10, 11, 12], [2, 13], [2, 14, 15, 16, 17, 18]]
    batched = generate_ids(model, prompts, tok.pad_token_id, tok.eos_token_id, max_new_tokens=6, batch_size=3)
    single = [generate_ids(model, [p], tok.pad_token_id, tok.eos_token_id, max_new_tokens=6)[0] for p in prompts]
    assert batched == single and all(len(x) <= 6 and tok.eos_token_id not in x for x in batched)
    beams = generate_ids(model, prompts, tok.pad_token_id, tok.eos_token_id, max_new_tokens=6, num_beams=2)
    assert len(beams) == 3


# ------------------------------------------------------------------ end to end
def _tiny_model_dir(tmp_path: Path, chat_template: str | None = None) -> Path:
    tok = tiny_tokenizer(chat_template)
    d = tmp_path / "tiny-llama"
    tiny_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("chat", [False, True])
def test_end_to_end_chat_example_reports_bleu_rouge_and_ledger_epsilon(tmp_path, chat, monkeypatch):
    from dpft.run.loop import Trainer

    monkeypatch.chdir(ROOT)
    model_dir = _tiny_model_dir(tmp_path, CHATML if chat else None)
    rec = load_recipe(ROOT / "examples/chat-support/recipe.yaml", {
        "model.name": str(model_dir), "model.max_length": 48, "task.max_train_examples": 64,
        "privacy.target_epsilon": None, "privacy.noise_multiplier": 1.0, "schedule.steps": 3,
        "schedule.epochs": None, "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 8,
        "eval.every_steps": 3, "eval.max_new_tokens": 4, "eval.max_generate_prompts": 6})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    assert tr.task.template == ("chat" if chat else "simple")
    rep = tr.run()
    want = dpa.PoissonSampledDpEvent(16 / 64, dpa.GaussianDpEvent(1.0))
    assert [e.event for e in tr.ledger.entries] == [want] and tr.ledger.steps == 3
    acc = dpa.pld.PLDAccountant()
    acc.compose(want, 3)
    assert rep["privacy"]["epsilon"] == pytest.approx(acc.get_epsilon(rec.privacy.delta), rel=1e-6)
    m = rep["metrics"]
    for k in ("dev_bleu", "dev_rouge_l", "dev_exact_match"):
        assert 0.0 <= m[k] <= 100.0
    assert m["dev_generated"] == 6 and math.isfinite(m["dev_loss"])
    g = rep["generation"]
    # The example's dev file is the user's own data (not a public benchmark under DPFT_DATA_DIR):
    # its texts are not covered by ε, so the released report keeps only how many samples it had.
    assert rep["coverage"]["dev_public"] is False
    assert g["samples"] == [] and g["samples_withheld"] == 3
    md = (tmp_path / "run" / "report.md").read_text()
    assert "Generation on the dev prompts" in md and "BLEU" in md and "loss on completion tokens only" in md
    assert "training rows" not in json.dumps(rep)  # the private truncation count is never written


def test_e2e_recipes_validate():
    for name in ("e2e-instruct-stories260k.yaml", "e2e-instruct-stories260k-lora.yaml"):
        r = load_recipe(ROOT / "recipes" / name)
        assert r.task.name == "instruct" and r.task.prompt_column == "mr" and r.task.completion_column == "ref"
    assert load_recipe(ROOT / "recipes/e2e-instruct-stories260k-lora.yaml").trainable.mode == "lora"


def test_dpft_train_lora_on_a_causal_lm_trains_adapters_only(tmp_path, monkeypatch):
    """``dpft.train`` on the E2E LoRA recipe (tiny model, the chat example's files): only the
    LoRA matrices train (the tied LM head stays frozen), ε comes from ledger.json."""
    import dpft
    from dpft.accounting.ledger import PrivacyLedger

    monkeypatch.chdir(ROOT)
    rep = dpft.train(ROOT / "recipes/e2e-instruct-stories260k-lora.yaml", tmp_path / "run", progress=False, overrides={
        "model.name": str(_tiny_model_dir(tmp_path)), "model.max_length": 32,
        "task.train_file": "examples/chat-support/train.jsonl", "task.dev_file": "examples/chat-support/dev.jsonl",
        "task.max_train_examples": 32, "task.max_dev_examples": 8, "trainable.lora.target_modules": ["q_proj", "v_proj"],
        "privacy.target_epsilon": 3.0, "schedule.epochs": None, "schedule.steps": 2,
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 8, "eval.max_new_tokens": 3,
        "eval.max_generate_prompts": 4})
    # r = 8 on q_proj (16 -> 16) and v_proj (16 -> 8: one KV head of 8) of the one block
    assert rep["model"]["trainable"] == "lora" and rep["model"]["trainable_parameters"] == (16 * 8 + 8 * 16) + (16 * 8 + 8 * 8)
    led = PrivacyLedger.load(tmp_path / "run" / "ledger.json")
    assert led.steps == 2 and rep["privacy"]["epsilon"] == pytest.approx(led.epsilon(rep["privacy"]["delta"]).epsilon)
    assert rep["privacy"]["epsilon"] <= 3.0 + 1e-6 and rep["metrics"]["dev_generated"] == 4


def test_cli_no_dp_run_of_an_instruct_recipe(tmp_path, monkeypatch):
    """``dpft train … --no-dp`` (the CLI looked for a forward-LDP run on the Trainer and crashed)."""
    from typer.testing import CliRunner

    from dpft.cli.commands import app

    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(app, [
        "train", "examples/chat-support/recipe.yaml", "--no-dp", "--quiet", "-o", str(tmp_path / "run"),
        "--model", str(_tiny_model_dir(tmp_path)), "--steps", "2", "--set", "task.max_train_examples=16", "--set", "batch.expected_batch_size=8",
        "--set", "model.max_length=32", "--set", "eval.max_new_tokens=2", "--set", "eval.max_generate_prompts=2"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["privacy"]["guarantee"].startswith("NONE") and rep["metrics"]["dev_generated"] == 2
