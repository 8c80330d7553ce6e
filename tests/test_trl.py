"""dpft.integrations.trl.trainer: DPSFTTrainer (TRL's SFTTrainer with DPTrainer's DP step).

Tiny random-initialised Llama models and a word-level tokenizer with a ChatML template, built
in-process; the integration test runs the docs' example on stories260K and E2E."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SHARED_DATA

from dpft.accounting.calibrate import dp_sgd_event
from dpft.accounting.ledger import PrivacyLedger, epsilon_of

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

from trl import SFTConfig  # noqa: E402

from dpft.api import PackedBatchError  # noqa: E402
from dpft.integrations.hf.trainer import DPArguments  # noqa: E402
from dpft.integrations.trl.trainer import DPSFTTrainer, sft_per_example_loss  # noqa: E402

WORDS = ("my router phone is slow will not turn on restart it charge the and then try again thanks what if "
         "that does help bring to a shop you are support agent answer briefly sorry hear").split()
# ChatML with TRL's {% generation %} markers around the assistant turns (assistant_only_loss).
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
          "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PAIRS = [("my router is slow", "restart it"), ("my phone will not turn on", "charge it then try again"),
         ("what if that does not help", "bring it to a shop"), ("my phone is slow", "restart it and try again"),
         ("thanks", "sorry to hear that"), ("my router will not turn on", "charge it"),
         ("what if it is slow", "restart the router"), ("you are slow", "sorry")]


@pytest.fixture(autouse=True)
def _fast_gc():
    """Trainer.train ends with accelerate's gc.collect(), which scans the whole heap of the test
    process (most of a tiny run's time); frozen objects are skipped. Speed only."""
    import gc

    gc.freeze()
    yield
    gc.unfreeze()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(special + sorted(set(WORDS)) + ["user", "assistant", "system"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>",
                                               additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


def tiny_llama(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return transformers.LlamaForCausalLM(cfg)


def prompt_completion(n: int = 8):
    return datasets.Dataset.from_list([{"prompt": p, "completion": " " + c} for p, c in PAIRS[:n]])


def conversations(n: int = 8):
    return datasets.Dataset.from_list([{"messages": [{"role": "system", "content": "you are support"},
                                                     {"role": "user", "content": p},
                                                     {"role": "assistant", "content": c}]} for p, c in PAIRS[:n]])


def sft_args(out, **kw) -> SFTConfig:
    base = dict(output_dir=str(out), max_steps=2, learning_rate=1e-2, per_device_train_batch_size=4, report_to=[],
                use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
                gradient_checkpointing=False, dataset_num_proc=None)
    base.update(kw)
    return SFTConfig(**base)


def dp(**kw) -> DPArguments:
    base = dict(noise_multiplier=1.0, target_delta=1e-2, max_grad_norm=1.0, expected_batch_size=4)
    base.update(kw)
    return DPArguments(**base)


def trainer(tmp_path, ds=None, args=None, dp_args=None, model=None, **kw) -> DPSFTTrainer:
    tok = kw.pop("processing_class", None) or tiny_tokenizer()
    return DPSFTTrainer(model=model or tiny_llama(len(tok)), args=args or sft_args(tmp_path / "out"),
                        train_dataset=prompt_completion() if ds is None else ds, processing_class=tok,
                        dp_args=dp_args or dp(), **kw)


# ----------------------------------------------------------------------------- steps, ledger, files


def test_prompt_completion_steps_ledger_and_files(tmp_path):
    args = sft_args(tmp_path / "out", max_steps=3, save_strategy="steps", save_steps=2)
    tr = trainer(tmp_path, args=args)
    assert tr.completion_only_loss and tr.n == 8 and tr.q == pytest.approx(0.5)
    tr.train()
    assert tr.state.global_step == 3 and tr.ledger.steps == 3
    ref = epsilon_of([dp_sgd_event(1.0, 0.5, 3)], 1e-2).epsilon
    assert tr.get_epsilon() == pytest.approx(ref, rel=1e-12)
    # the ledger events are the DP-SGD events, one per logical step
    assert PrivacyLedger.load(tmp_path / "out" / "ledger.json").steps == 3
    ck = tmp_path / "out" / "checkpoint-2"
    assert PrivacyLedger.load(ck / "ledger.json").steps == 2
    state = json.loads((ck / "dp_state.json").read_text())
    assert state["n"] == 8 and state["sigma"] == 1.0 and "reproducible_seed" not in state["dp_args"]
    # ε logged at every step; nothing computed from the private batches (loss, token accuracy, entropy, tokens)
    steps = [h for h in tr.state.log_history if "learning_rate" in h]
    assert len(steps) == 3 and all("epsilon" in h for h in steps)
    private = {"loss", "train_loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens"}
    assert all(not (private & set(h)) for h in tr.state.log_history)


def test_conversational_assistant_only_loss_and_chat_template(tmp_path):
    tok = tiny_tokenizer()
    args = sft_args(tmp_path / "out", assistant_only_loss=True)
    tr = trainer(tmp_path, ds=conversations(), args=args, processing_class=tok)
    row = tr.train_dataset[2]
    # the chat template rendered the conversation; only the assistant turn (with its end marker) is a target
    assert row["input_ids"] == tok.apply_chat_template(conversations()[2]["messages"], tokenize=True,
                                                       return_dict=True)["input_ids"]
    targets = tok.convert_ids_to_tokens([t for t, y in zip(row["input_ids"], row["labels"]) if y != -100])
    assert targets == ["bring", "it", "to", "a", "shop", "<|im_end|>"]
    tr.train()
    assert tr.ledger.steps == 2


# ----------------------------------------------------------------------------- white-box: completion-only


def reference_clipped_sum(model, tok, pairs, c: float, conversational: bool = False) -> torch.Tensor:
    """Σ_i clip_C(∇ Σ_{completion tokens t} −log p(x_t | x_<t)) from a plain copy of the model, one
    example at a time, with the completion tokens found from the tokenized prompt's length (not
    from TRL's labels)."""
    total = None
    params = [p for p in model.parameters() if p.requires_grad]
    for p_text, c_text in pairs:
        if conversational:
            prompt = tok.apply_chat_template([{"role": "user", "content": p_text}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
            ids = tok.apply_chat_template([{"role": "user", "content": p_text},
                                           {"role": "assistant", "content": c_text}], tokenize=True,
                                          return_dict=True)["input_ids"]
        else:
            prompt = tok(p_text)["input_ids"]
            ids = tok(p_text + " " + c_text + tok.eos_token)["input_ids"]
        assert ids[:len(prompt)] == prompt
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
        tgt = x[0, 1:]
        tok_nll = -logp.gather(1, tgt[:, None])[:, 0]
        loss = tok_nll[len(prompt) - 1:].sum()  # predicting tokens len(prompt).. (the completion)
        g = torch.cat([gr.flatten() for gr in torch.autograd.grad(loss, params)])
        g = g * min(1.0, c / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total


@pytest.mark.parametrize("conversational", [False, True])
def test_clipped_update_equals_completion_only_reference(tmp_path, conversational):
    """q = 1, σ = 0, SGD at lr 1: the released sum −Δθ·N equals Σ_i clip_C(g_i) with g_i the
    gradient of the completion tokens' NLL alone (prompt tokens contribute nothing), under TRL's
    default gradient checkpointing."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    ref_model = copy.deepcopy(model)
    pairs = PAIRS[:4]
    if conversational:
        ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}],
                                          "completion": [{"role": "assistant", "content": c}]} for p, c in pairs])
    else:
        ds = datasets.Dataset.from_list([{"prompt": p, "completion": " " + c} for p, c in pairs])
    c = 0.05
    args = sft_args(tmp_path / "out", max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                    weight_decay=0.0, per_device_train_batch_size=3, gradient_checkpointing=True)
    with pytest.warns(UserWarning, match="seed"):
        tr = DPSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                          dp_args=dp(noise_multiplier=0.0, max_grad_norm=c, expected_batch_size=4, reproducible_seed=0))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    tr.sampler.indices = lambda step: torch.arange(4)  # q = 1: every row, two physical batches (3 + 1)
    tr.train()
    released = -(torch.cat([p.detach().flatten() for p in model.parameters()]) - before) * 4
    ref = reference_clipped_sum(ref_model, tok, pairs, c, conversational)
    assert float(ref.norm()) > c  # clipping is active (each example norm > C here)
    torch.testing.assert_close(released, ref, rtol=1e-4, atol=1e-6)


def test_per_example_loss_counts_only_label_tokens():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    ids = torch.tensor([tok("my router is slow restart it")["input_ids"]] * 2)
    labels = ids.clone()
    labels[1, :4] = -100  # the second example: prompt masked
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    per = sft_per_example_loss()(lambda **kw: model(**kw), batch)
    with torch.no_grad():
        tok_nll = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                                    reduction="none")
    assert float(per[0]) == pytest.approx(float(tok_nll[0].sum()), rel=1e-5)
    assert float(per[1]) == pytest.approx(float(tok_nll[1, 3:].sum()), rel=1e-5)
    dft = sft_per_example_loss("dft")(lambda **kw: model(**kw), batch)
    assert float(dft[1]) == pytest.approx(float((tok_nll[1, 3:] * torch.exp(-tok_nll[1, 3:])).sum()), rel=1e-5)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, match", [
    (dict(packing=True), r"packing=True.*SFTConfig\(packing=False, padding_free=False\)"),
    (dict(packing=True, packing_strategy="wrapped"), r"SFTConfig\(packing=False, padding_free=False\)"),
    (dict(padding_free=True, max_length=None), r"padding_free=True.*SFTConfig\(packing=False, padding_free=False\)"),
    (dict(activation_offloading=True), "gradient_checkpointing"),
    (dict(gradient_accumulation_steps=2), "expected_batch_size"),  # DPTrainer's own refusals hold too
    (dict(fp16=True, bf16=False), "GradScaler"),
])
def test_refused_before_the_dataset_is_prepared(tmp_path, monkeypatch, kw, match):
    from trl import SFTTrainer

    def boom(*a, **k):
        raise AssertionError("the dataset was prepared before the refusal")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", boom)
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, args=sft_args(tmp_path / "out", **kw))


def test_refuses_prepacked_streaming_and_batch_losses(tmp_path):
    packed = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8]], "labels": [[5, 6, 7, 8]], "seq_lengths": [[2, 2]]})
    with pytest.raises(ValueError, match="seq_lengths.*packing=False"):
        trainer(tmp_path, ds=packed)
    with pytest.raises(ValueError, match="IterableDataset"):
        trainer(tmp_path, ds=prompt_completion().to_iterable_dataset())
    with pytest.raises(ValueError, match="one loss per example"):
        trainer(tmp_path, compute_loss_func=lambda out, labels, num_items_in_batch=None: out.logits.sum())
    with pytest.raises(TypeError, match="dp_args"):
        DPSFTTrainer(model=tiny_llama(40), args=sft_args(tmp_path), train_dataset=prompt_completion())


def test_packing_collator_refused_at_the_first_step(tmp_path):
    """A padding-free collator passed by hand (not through SFTConfig) is refused by DPTrainer's
    per-batch check before anything is released."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    tr = trainer(tmp_path, data_collator=DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    with pytest.raises(PackedBatchError, match="packing"):
        tr.train()
    assert tr.ledger.steps == 0


# ----------------------------------------------------------------------------- PEFT


def test_lora_peft_config_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig, PeftModel

    tok = tiny_tokenizer()
    tr = trainer(tmp_path, model=tiny_llama(len(tok)), processing_class=tok,
                 peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                        task_type="CAUSAL_LM"))
    assert isinstance(tr.model, PeftModel)
    assert tr.engine.params and all("lora_" in n for n in tr.engine.params)
    assert set(tr.engine.params) == {n for n, p in tr.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    lora_b = {n: p for n, p in before.items() if "lora_B" in n}
    tr.train()
    assert tr.ledger.steps == 2
    for n, p in tr.model.named_parameters():  # the frozen base model did not move
        if "lora_" not in n:
            assert torch.equal(p.detach(), before[n]), n
    moved = {n: p for n, p in tr.model.named_parameters() if "lora_B" in n}
    assert all(not torch.equal(moved[n].detach(), lora_b[n]) for n in lora_b)  # lora_B starts at 0; noise moved it


# ----------------------------------------------------------------------------- DP-DPO


def preference_rows(n: int = 4):
    return datasets.Dataset.from_list([{"prompt": p, "chosen": " " + c, "rejected": " sorry"} for p, c in PAIRS[:n]])


def dpo_args(out, **kw):
    from trl import DPOConfig

    base = dict(output_dir=str(out), max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                weight_decay=0.0, per_device_train_batch_size=3, use_cpu=True, bf16=False, report_to=[],
                save_strategy="no", logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, beta=0.5)
    base.update(kw)
    return DPOConfig(**base)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_clipped_update_equals_per_pair_reference(tmp_path, loss_type):
    """q = 1, σ = 0, SGD at lr 1: −Δθ·N = Σ_pairs clip_C(∇ DPO loss of the pair), the pair's chosen
    and rejected sequences clipped as one unit; one ledger event."""
    import torch.nn.functional as F

    from dpft.integrations.trl.trainer import DPDPOTrainer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    ref = copy.deepcopy(model)
    rows = preference_rows()
    c, beta = 0.05, 0.5
    with pytest.warns(UserWarning, match="seed"):
        tr = DPDPOTrainer(model=model, args=dpo_args(tmp_path / "out", beta=beta, loss_type=[loss_type]), train_dataset=rows,
                          processing_class=tok, dp_args=dp(noise_multiplier=0.0, max_grad_norm=c, reproducible_seed=0))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    tr.sampler.indices = lambda step: torch.arange(4)  # every pair; physical batches of 3 + 1 pairs
    tr.train()
    assert tr.ledger.steps == 1
    released = -(torch.cat([p.detach().flatten() for p in model.parameters()]) - before) * 4

    def logp(m, prompt, completion):
        p_ids, ids = tok(prompt)["input_ids"], tok(prompt + completion + tok.eos_token)["input_ids"]
        x = torch.tensor([ids])
        lp = torch.log_softmax(m(input_ids=x).logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]
        n = len(ids) - len(p_ids)  # completion tokens (IPO averages over them)
        return lp[len(p_ids) - 1:].sum() / (n if loss_type == "ipo" else 1)

    params, total = list(ref.parameters()), 0
    for r in rows:
        with torch.no_grad():
            rc, rr = logp(ref, r["prompt"], r["chosen"]), logp(ref, r["prompt"], r["rejected"])
        delta = (logp(ref, r["prompt"], r["chosen"]) - rc) - (logp(ref, r["prompt"], r["rejected"]) - rr)
        loss = {"sigmoid": lambda d: -F.logsigmoid(beta * d), "hinge": lambda d: torch.relu(1 - beta * d),
                "ipo": lambda d: (d - 1 / (2 * beta)) ** 2}[loss_type](delta)  # Rafailov eq. 7, SLiC, IPO eq. 17
        g = torch.cat([x.flatten() for x in torch.autograd.grad(loss, params)])
        assert float(g.norm()) > c
        total = total + g * min(1.0, c / (float(g.norm()) + 1e-6))
    torch.testing.assert_close(released, total, rtol=1e-4, atol=1e-6)
    assert all(not ({"loss", "rewards/chosen", "rewards/accuracies"} & set(h)) for h in tr.state.log_history)


@pytest.mark.parametrize("kw, match", [
    (dict(loss_type=["aot"]), "sort the log-ratios"),
    (dict(loss_type=["sigmoid", "sft"]), "not supported per pair"),
    (dict(sync_ref_model=True), "sync_ref_model=False"),
    (dict(padding_free=True), "padding_free=False"),
    (dict(use_weighting=True), "use_weighting=False"),
])
def test_dpo_refusals(tmp_path, kw, match):
    from dpft.integrations.trl.trainer import DPDPOTrainer

    with pytest.raises(ValueError, match=match):
        DPDPOTrainer(model=tiny_llama(40), args=dpo_args(tmp_path / "out", **kw), train_dataset=preference_rows(),
                     processing_class=tiny_tokenizer(), dp_args=dp())


def test_dpo_user_level_counts_users(tmp_path):
    """User level is built (tests/test_dpo_user.py: leave-one-user-out, ledger, k): N and q count
    users, not pairs; a user column missing from the pairs is refused naming the fix."""
    from dpft.integrations.trl.trainer import DPDPOTrainer

    rows = preference_rows().add_column("user", ["a", "a", "b", "c"])
    tr = DPDPOTrainer(model=tiny_llama(40), args=dpo_args(tmp_path / "out"), train_dataset=rows,
                      processing_class=tiny_tokenizer(), dp_args=dp(user_column="user", expected_batch_size=2))
    assert tr.user_level and tr.n == 3 and tr.q == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="not a column of train_dataset"):
        DPDPOTrainer(model=tiny_llama(40), args=dpo_args(tmp_path / "out2"), train_dataset=preference_rows(),
                     processing_class=tiny_tokenizer(), dp_args=dp(user_column="user", expected_batch_size=2))


def test_dpo_micro_batches_hold_this_ranks_pairs_only(tmp_path):
    """Under DDP each rank clips only its share of the sampled pairs (every rank clipping all of
    them would count each pair K times against noise for one)."""
    from dpft.placement import world as ddp
    from dpft.integrations.trl.trainer import DPDPOTrainer

    tr = DPDPOTrainer(model=tiny_llama(40), args=dpo_args(tmp_path / "out"), train_dataset=preference_rows(),
                      processing_class=tiny_tokenizer(), dp_args=dp())
    tr.get_train_dataloader()  # binds the prepared rows and the collator
    idx = torch.arange(4)
    tr.world = ddp.World(1, 2)
    seen = sum(len(b["input_ids"]) for b in tr._micro_batches(idx))
    assert seen == 2 * len(ddp.shard(idx, tr.world)) == 4


def test_layout_probe_allows_mixing_within_a_group_only():
    """The engine's layout probe (grads/kinds.py) with clipping groups: rows of one group may feed
    each other's losses (a DPO pair), rows of different groups may not."""
    from dpft.grads.contrib import BatchLayoutError
    from dpft.grads.kinds import check_example_support

    out = torch.randn(4, 3, requires_grad=True)
    pair = out.sum(1).view(2, 2)
    within = torch.stack([pair[:, 0] * pair[:, 1], torch.zeros(2)], 1).reshape(-1)  # pair loss on the chosen row
    check_example_support(within, [(out, "x")], torch.tensor([0, 0, 1, 1]))
    with pytest.raises(BatchLayoutError):
        check_example_support(within, [(out, "x")])  # without groups it is mixing
    across = within + out.sum() * torch.tensor([1.0, 0, 0, 0])  # row 0's loss sees every row
    with pytest.raises(BatchLayoutError):
        check_example_support(across, [(out, "x")], torch.tensor([0, 0, 1, 1]))


# ----------------------------------------------------------------------------- the audit


def test_trl_audit_checks_pass_and_catch_the_planted_bug():
    """The honest run of every TRL check is tests/test_audit.py::test_honest_step_passes (the suite's
    optional checks include ways_in_trl.trl_checks); here each planted bug through the check that catches it,
    and the same check passing without it."""
    from dpft.audit.ways_in_trl import dpo_checks, packing_check, planted_bug

    assert packing_check().passed
    with planted_bug("sft_packing_accepted"):
        bad = packing_check()
    assert not bad.passed and "several conversations clipped as one" in bad.message
    with planted_bug("dpo_pair_split"):
        (bad,) = dpo_checks()
    assert not bad.passed and "one pair moves the release by more than C" in bad.message
    # undone afterwards
    from dpft.grads import bookkeeping
    from dpft.integrations.trl import trainer as dtrl

    assert dtrl.check_sft_config.__name__ == "check_sft_config" and dtrl.pair_rows.__name__ == "pair_rows"
    assert bookkeeping.check_example_support.__name__ == "check_example_support"


# ----------------------------------------------------------------------------- real model, real data


@pytest.mark.integration
@pytest.mark.slow
def test_docs_example_stories260k_e2e(tmp_path):
    if not (SHARED_DATA / "models" / "stories260K" / "config.json").is_file():
        pytest.skip("stories260K not present")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "DPFT_DATA_DIR": str(SHARED_DATA),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "snippets" / "dp_sft_trl.py"), str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "ε = " in out and "BLEU" in out and "generation:" in out
    eps = float(out.split("ε = ")[1].split()[0])
    assert 0 < eps <= 8.0 + 1e-6
    assert PrivacyLedger.load(tmp_path / "run" / "ledger.json").steps > 0


def test_docs_trl_example_is_the_snippet():
    doc = (ROOT / "docs" / "trl.md").read_text()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (ROOT / "docs" / "snippets" / "dp_sft_trl.py").read_text()
