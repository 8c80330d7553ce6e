"""dpft.integrations.hf.trainer: DPTrainer (a transformers.Trainer) and DPArguments."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, tiny_classifier

from dpft.accounting.calibrate import dp_sgd_event
from dpft.accounting.ledger import PrivacyLedger, epsilon_of

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import TrainingArguments, default_data_collator  # noqa: E402

from dpft.integrations.hf.trainer import DPArguments, DPTrainer, hf_per_example_loss  # noqa: E402


def targs(out, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=4, report_to=[],
                use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def random_rows(n: int = 40, t: int = 8, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def tiny_trainer(tmp_path, args=None, dp=None, **kw) -> DPTrainer:
    dp = dp or DPArguments(target_epsilon=4.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=8)
    return DPTrainer(model=tiny_classifier("bert").train(), args=args or targs(tmp_path / "out", max_steps=2),
                     train_dataset=random_rows(), data_collator=default_data_collator, dp_args=dp, **kw)


def trainable_snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_moved(model, before, trainable: set[str]):
    after = dict(model.named_parameters())
    for n, p in after.items():
        if n in trainable:
            assert not torch.equal(p.detach(), before[n]), f"trainable {n} did not move"
        else:
            assert torch.equal(p.detach(), before[n]), f"frozen {n} moved"


# ----------------------------------------------------------------------------- BERT classifier


def test_bert_classifier(tiny_model_dir, sst_like_files, tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification, DataCollatorWithPadding

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = BertForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    ds = datasets.Dataset.from_csv(str(sst_like_files["csv"]))
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=16), batched=True)
    assert len(ds) == 60
    before = trainable_snapshot(model)
    args = targs(tmp_path / "out", max_steps=3, save_strategy="steps", save_steps=2)
    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=12,
                     max_physical_batch_size=4)
    tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorWithPadding(tok), dp_args=dp)
    assert args.max_grad_norm == 1.0 and tr.args.max_grad_norm == 0  # the caller's args are untouched
    assert tr.q == pytest.approx(12 / 60) and tr.total_steps == 3
    out = tr.train()

    assert tr.state.global_step == 3 and tr.ledger.steps == 3
    ref = epsilon_of([dp_sgd_event(tr.sigma, tr.q, 3)], 1e-3).epsilon
    assert tr.get_epsilon() == pytest.approx(ref, rel=1e-12)
    assert 3.9 < tr.get_epsilon() <= 4.0  # calibrated to the target for the steps taken
    check_moved(model, before, trainable)
    # ε is logged; the un-noised loss (private) is not.
    hist = tr.state.log_history
    assert all("loss" not in h and "train_loss" not in h and "grad_norm" not in h for h in hist)
    step_logs = [h for h in hist if "learning_rate" in h]
    assert len(step_logs) == 3 and all("epsilon" in h for h in step_logs)
    assert step_logs[-1]["epsilon"] == pytest.approx(ref)
    assert math.isnan(out.training_loss) and "train_loss" not in out.metrics
    # ledger in output_dir (live) and in the checkpoint, with the checkpoint's step count
    live = PrivacyLedger.load(tmp_path / "out" / "ledger.json")
    assert live.steps == 3
    ck = tmp_path / "out" / "checkpoint-2"
    assert PrivacyLedger.load(ck / "ledger.json").steps == 2
    state = json.loads((ck / "dp_state.json").read_text())
    assert state["sigma"] == tr.sigma and state["n"] == 60 and "reproducible_seed" not in state["dp_args"]


# ----------------------------------------------------------------------------- GPT-2 + LoRA


def lm_collate(rows):
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tiny_gpt2_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    return get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["c_attn"],
                                           lora_dropout=0.0))


TEXTS = ["the cat sat", "a dog ran far", "birds sing at dawn", "rain on the roof", "we walk home",
         "stars at night", "an old red door", "fish swim", "cold wind blows", "bread and tea",
         "the sea is calm", "leaves fall", "a quiet street", "snow on hills", "green fields", "hot sun"]


def test_gpt2_lora_causal_lm(tmp_path):
    model = tiny_gpt2_lora()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = trainable_snapshot(model)
    ds = datasets.Dataset.from_list([{"input_ids": [3 + ord(c) % 60 for c in s]} for s in TEXTS])
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-2, max_grad_norm=0.5, expected_batch_size=4,
                     max_physical_batch_size=2)
    tr = DPTrainer(model=model, args=targs(tmp_path / "out", num_train_epochs=1, learning_rate=5e-2),
                   train_dataset=ds, data_collator=lm_collate, dp_args=dp)
    assert tr.total_steps == 4  # ceil(1 epoch · 16 / 4)
    tr.train()
    assert tr.state.global_step == 4 and tr.ledger.steps == 4
    assert tr.get_epsilon() == pytest.approx(epsilon_of([dp_sgd_event(1.0, 0.25, 4)], 1e-2).epsilon, rel=1e-12)
    check_moved(model, before, trainable)


def test_per_example_losses_match_the_models_own_loss():
    """Σ of the default per-example losses = the model's loss × its normaliser."""
    model = tiny_gpt2_lora().eval()
    batch = lm_collate([{"input_ids": [3 + ord(c) % 60 for c in s]} for s in TEXTS[:4]])
    with torch.no_grad():
        per = hf_per_example_loss(causal=True)(lambda **kw: model(**kw), batch)
        ref = float(model(**batch).loss)
    n_tok = int((batch["labels"][:, 1:] != -100).sum())
    assert per.shape == (4,)
    assert float(per.sum()) / n_tok == pytest.approx(ref, rel=1e-5)
    clf = tiny_classifier("bert")
    from conftest import random_batch

    b = random_batch()
    with torch.no_grad():
        per = hf_per_example_loss(causal=False)(lambda **kw: clf(**kw), b)
        assert float(per.mean()) == pytest.approx(float(clf(**b).loss), rel=1e-5)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, match", [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps = 2.*expected_batch_size"),
    (dict(train_sampling_strategy="group_by_length"), "Poisson"),
    (dict(max_grad_norm=0.5), "DPArguments.max_grad_norm"),
    (dict(include_num_input_tokens_seen="all"), "include_num_input_tokens_seen"),
    (dict(auto_find_batch_size=True), "max_physical_batch_size"),
    (dict(fp16=True), "dynamic GradScaler.*bf16=True"),  # bf16 works (tests/test_perf.py)
])
def test_refuses_training_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_trainer(tmp_path, args=targs(tmp_path / "out", max_steps=2, **kw))


def test_refuses_custom_sampler(tmp_path):
    class Shuffled(DPTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.RandomSampler(self.train_dataset)

    with pytest.raises(ValueError, match="Poisson sampling"):
        Shuffled(model=tiny_classifier("bert"), args=targs(tmp_path / "out", max_steps=2),
                 train_dataset=random_rows(), data_collator=default_data_collator,
                 dp_args=DPArguments(target_epsilon=4, target_delta=1e-3, expected_batch_size=8))


def test_refuses_foreign_batches(tmp_path):
    tr = tiny_trainer(tmp_path, dp=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8))
    with pytest.raises(RuntimeError, match="Poisson sampler"):
        tr.training_step(tr.model, default_data_collator([tr.train_dataset[0]]))
    assert tr.ledger.steps == 0


def test_empty_poisson_batch_still_releases_noise(tmp_path):
    tr = tiny_trainer(tmp_path, args=targs(tmp_path / "out", max_steps=1, logging_steps=100),
                      dp=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8))
    tr.sampler.indices = lambda step: torch.empty(0, dtype=torch.long)
    before = trainable_snapshot(tr.model)
    tr.train()
    assert tr.ledger.steps == 1 and tr.last_private_stats["batch_size"] == 0
    check_moved(tr.model, before, set(tr.engine.params))  # the noise moved every trainable weight


def test_reproducible_seed(tmp_path):
    def run(seed, name):
        dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8, reproducible_seed=seed)
        with pytest.warns(UserWarning, match="seed") if seed is not None else _nullcontext():
            tr = tiny_trainer(tmp_path, args=targs(tmp_path / name, max_steps=2, logging_steps=100), dp=dp)
        tr.train()
        return {n: p.detach().clone() for n, p in tr.model.named_parameters()}

    a, b, c = run(7, "a"), run(7, "b"), run(None, "c")
    assert all(torch.equal(a[n], b[n]) for n in a)  # same seed: same batches, dropout and noise
    assert not all(torch.equal(a[n], c[n]) for n in a)  # secret randomness differs


def test_one_rank_check_and_the_user_unit_through_the_session(tmp_path, monkeypatch):
    """Issue 46: DPTrainer's settings are compared across ranks once, by the session (``same``: the digest
    of what the trainer adds to its settings: every DPArguments field but memory-only ones, rows, units,
    steps, the trainable shapes), and the user unit is the session's (step/unit.py), not one of its own."""
    from dpft.placement import world as ddp
    from dpft.session import PrivateSession
    from dpft.step.sample import UserPoissonSampler

    seen = []
    monkeypatch.setattr(PrivateSession, "check_same", lambda self, what: seen.append(what))
    monkeypatch.setattr(ddp, "check_same_recipe", lambda *a: pytest.fail("a second rank check"))
    rows = random_rows().add_column("who", [f"u{i % 7}" for i in range(40)])
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=3, user_column="who",
                     max_rows_per_user=2, user_clipping="per_example_over_k")
    tr = DPTrainer(model=tiny_classifier("bert").train(), args=targs(tmp_path / "out", max_steps=1),
                   train_dataset=rows, data_collator=default_data_collator, dp_args=dp)
    assert len(seen) == 1 and seen[0][:2] == (40, 7) and seen[0][-1] == ddp.recipe_digest(tr._world_config())
    cfg = tr._world_config()
    assert cfg["dp_args"]["user_column"] == "who" and cfg["trainable"] and "max_physical_batch_size" not in cfg["dp_args"]
    unit = tr.session.unit
    assert isinstance(tr.sampler, UserPoissonSampler) and tr.sampler is unit.sampler
    assert tr.n == unit.n == 7 and tr.q == pytest.approx(3 / 7) and unit.info["column"] == "who"
    assert tr.clip.sensitivity == pytest.approx(1.0) and tr.clip.inner.max_norm == pytest.approx(0.5)  # C/k


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def test_refuses_bad_dp_arguments(tmp_path):
    from dpft.accounting.calibrate import CalibrationError

    with pytest.raises(ValueError, match="exactly one"):
        DPArguments(target_epsilon=4, noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8)
    with pytest.raises(ValueError, match="clipping"):
        DPArguments(target_epsilon=4, target_delta=1e-3, expected_batch_size=8, clipping="nope")
    with pytest.raises(ValueError, match="exceeds len"):
        tiny_trainer(tmp_path, dp=DPArguments(target_epsilon=4, target_delta=1e-3, expected_batch_size=41))
    with pytest.raises(CalibrationError, match="1/N"):
        tiny_trainer(tmp_path, dp=DPArguments(target_epsilon=4, target_delta=0.05, expected_batch_size=8))
    with pytest.raises(TypeError, match="dp_args"):
        DPTrainer(model=tiny_classifier("bert"), args=targs(tmp_path), train_dataset=random_rows())


# ----------------------------------------------------------------------------- ledger and resume


def test_private_loss_only_on_request(tmp_path):
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8, log_private_train_loss=True)
    tr = tiny_trainer(tmp_path, dp=dp)
    out = tr.train()
    assert any("loss" in h for h in tr.state.log_history) and math.isfinite(out.training_loss)
    assert out.metrics["train_loss"] == out.training_loss


def test_resume_continues_the_ledger(tmp_path):
    args = targs(tmp_path / "out", max_steps=4, save_strategy="steps", save_steps=2, logging_steps=100)
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8)
    tr = tiny_trainer(tmp_path, args=args, dp=dp)
    tr.train()
    assert tr.ledger.steps == 4
    # A fresh run may not overwrite that run's ledger.
    with pytest.raises(ValueError, match="earlier run"):
        tiny_trainer(tmp_path, args=args, dp=dp).train()
    # Resuming from step 2 would replay steps 3-4: the ε cap refuses (issue 36: no step fits within the plan's ε)...
    with pytest.raises(ValueError, match="no step fits within the planned ε"):
        tiny_trainer(tmp_path, args=args, dp=dp).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    # ... and allow_overspend replays them with fresh randomness: new releases, all counted.
    dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8, allow_overspend=True)
    tr2 = tiny_trainer(tmp_path, args=args, dp=dp)
    tr2.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert tr2.state.global_step == 4 and tr2.ledger.steps == 6
    assert tr2.get_epsilon() == pytest.approx(epsilon_of([dp_sgd_event(tr.sigma, tr.q, 6)], 1e-3).epsilon)
    assert PrivacyLedger.load(tmp_path / "out" / "ledger.json").steps == 6
    # Other privacy settings cannot resume this run.
    dp3 = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=8, max_grad_norm=0.5)
    with pytest.raises(ValueError, match="max_grad_norm"):
        tiny_trainer(tmp_path, args=args, dp=dp3).train(resume_from_checkpoint=True)


@pytest.mark.slow  # the README's DPTrainer snippet end to end: ~25 s
def test_snippet_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "snippets" / "with_hf_trainer.py"), str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ε = " in res.stdout
    saved = Path(tmp_path / "run")
    assert PrivacyLedger.load(saved / "ledger.json").steps == 15
    assert (saved / "adapter_model.safetensors").is_file()


def test_readme_hf_section_is_the_snippet():
    """The README's "With the Hugging Face Trainer" example is the file the suite runs."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("## With the Hugging Face Trainer", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert block == (root / "docs" / "snippets" / "with_hf_trainer.py").read_text()
