"""DP supervised fine-tuning with TRL: stories260K on E2E NLG (prompt = meaning representation,
completion = reference text), LoRA adapters via peft_config, ε = 8 at δ = 1e-5.

Usage: python docs/snippets/dp_sft_trl.py [OUTPUT_DIR]   (data: $DPFT_DATA_DIR, default ../shared/data)
"""
import csv
import os
import sys
from collections import defaultdict

import datasets
import sacrebleu
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from dpft.integrations.hf import DPArguments
from dpft.integrations.trl import DPSFTTrainer

data = os.environ.get("DPFT_DATA_DIR", "../shared/data")
out = sys.argv[1] if len(sys.argv) > 1 else "dp-sft-trl"
model_dir = f"{data}/models/stories260K"
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)


def read(split, n):
    with open(f"{data}/e2e/{split}.csv", newline="") as f:
        return [row for _, row in zip(range(n), csv.DictReader(f))]


# One row = one privacy unit: a (meaning representation, reference) pair, prompt/completion format;
# TRL masks the prompt tokens (completion-only loss) and appends the EOS token to the completion.
train = datasets.Dataset.from_list([{"prompt": r["mr"] + " =", "completion": " " + r["ref"]}
                                    for r in read("trainset", 2048)])

trainer = DPSFTTrainer(
    model=model,
    args=SFTConfig(output_dir=out, max_steps=6, learning_rate=1e-2, per_device_train_batch_size=64,
                   max_length=96, bf16=False, gradient_checkpointing=False, logging_steps=3,
                   save_strategy="no", report_to=[], disable_tqdm=True),
    train_dataset=train,
    processing_class=tokenizer,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
    dp_args=DPArguments(target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0, expected_batch_size=64),
)
trainer.train()
trainer.save_model(out)  # adapters + ledger.json + dp_state.json
print(f"ε = {trainer.get_epsilon():.3f} at δ = 1e-5 after {trainer.ledger.steps} steps (σ = {trainer.sigma:.3f})")

# Greedy generations on public dev meaning representations, BLEU against all their references.
refs = defaultdict(list)
for r in read("devset", 400):
    refs[r["mr"]].append(r["ref"])
mrs = list(refs)[:8]
model = trainer.model.eval()
tokenizer.padding_side = "left"
gens = []
with torch.no_grad():
    enc = tokenizer([mr + " =" for mr in mrs], return_tensors="pt", padding=True)
    ids = model.generate(**enc, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    gens = [g.strip() for g in tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
n_refs = max(len(refs[m]) for m in mrs)
bleu = sacrebleu.corpus_bleu(gens, [[refs[m][k] if k < len(refs[m]) else "" for m in mrs] for k in range(n_refs)])
print(f"BLEU = {bleu.score:.2f} on {len(mrs)} dev meaning representations")
print(f"generation: {mrs[0]} = {gens[0]}")
