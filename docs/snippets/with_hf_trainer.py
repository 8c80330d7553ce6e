"""Differentially private fine-tuning with the Hugging Face Trainer: swap `Trainer` for
`DPTrainer` and add `DPArguments`. Runs on a CPU in seconds with a tiny random in-process
BERT and LoRA, which shows the API but learns little under DP noise in 15 steps; for a real
run, load a pretrained checkpoint instead (see the comments).

    python docs/snippets/with_hf_trainer.py [output_dir]
"""

import sys
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BertConfig, BertForSequenceClassification, DataCollatorWithPadding,
                          PreTrainedTokenizerFast, TrainingArguments)

from dpft.integrations.hf import DPArguments, DPTrainer

# --- data: 200 labelled sentences (one row = one person's record = one privacy unit) -------
good, bad = ["good", "great", "lovely", "fine"], ["bad", "awful", "dull", "poor"]
rows = [{"text": f"a {(good if i % 2 else bad)[i % 4]} film number {i}", "label": i % 2} for i in range(200)]
words = sorted({w for r in rows for w in r["text"].split()})

# --- tokenizer and model: tiny and random here; for a real run use e.g.
#     tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")
#     model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=2)
vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, intermediate_size=64, num_labels=2))
# LoRA adapters on the attention projections; the classifier head is trained in full.
model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"]))

ds = Dataset.from_list(rows).map(lambda b: tokenizer(b["text"], truncation=True, max_length=32), batched=True)
split = ds.train_test_split(test_size=40, seed=0)  # the eval split stands in for public data

output_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
args = TrainingArguments(
    output_dir=output_dir,
    num_train_epochs=3,
    learning_rate=5e-3,
    per_device_train_batch_size=16,  # physical batch (memory only)
    logging_steps=5,
    eval_strategy="epoch",
    save_strategy="no",
    report_to=[],
    use_cpu=True,
)
dp_args = DPArguments(
    target_epsilon=8.0,        # ε for the whole run
    target_delta=1e-3,         # δ < 1/N
    max_grad_norm=1.0,         # per-example clip norm C
    expected_batch_size=32,    # logical batch: Poisson sampling with q = 32 / N
)


trainer = DPTrainer(model=model, args=args, train_dataset=split["train"], eval_dataset=split["test"],
                    data_collator=DataCollatorWithPadding(tokenizer), dp_args=dp_args)
trainer.train()
print(f"σ = {trainer.sigma:.3f}, q = {trainer.q:.3f}, {trainer.state.global_step} steps, "
      f"ε = {trainer.get_epsilon():.3f} at δ = {dp_args.target_delta:g}")
print(trainer.evaluate())
trainer.save_model()  # model + ledger.json + dp_state.json in output_dir
