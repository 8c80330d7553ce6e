"""Banded matrix factorization and truncated Poisson from Python (docs/mechanisms.md):
``PrivacyEngine.make_private(mechanism="banded_mf", bands=4)`` on a plain PyTorch loop, with
its secret noise state saved and restored, and ``DPTrainer`` with
``DPArguments(mechanism="banded_mf")`` / ``DPArguments(max_batch_size=...)``. Tiny random models:
runs on a CPU in well under a minute and learns little; it shows the API.

    python docs/snippets/mechanisms_python.py [output_dir]
"""

import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpft import PrivacyEngine

out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
os.makedirs(out, exist_ok=True)

# ------------------------------------------------------------------ make_private + banded MF
torch.manual_seed(0)
data = TensorDataset(torch.randn(1000, 16), torch.randint(0, 2, (1000,)))


def private_loop(engine):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(data, batch_size=50),   # B = 50: partition rate p = b·B/N = 0.2
        max_grad_norm=1.0, target_epsilon=8.0, target_delta=1e-5, epochs=3,
        mechanism="banded_mf", bands=4)                 # or: max_batch_size=70 (truncated Poisson)


engine = PrivacyEngine()
model, optimizer, criterion, loader = private_loop(engine)
for x, y in loader:                                     # one epoch of 20 logical steps
    criterion(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
secret = os.path.join(out, "private", "noise.secret.pt")   # owner-only (0600); NEVER release it
engine.save_noise_state(secret)
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},  # no noise buffers in here
           os.path.join(out, "private", "checkpoint.pt"))
print(f"make_private banded_mf: σ = {engine.noise_multiplier:.3f}, {engine.ledger.steps} steps, "
      f"ε so far = {engine.get_epsilon(1e-5):.2f}")

# ... later (another process): the same make_private call on a fresh engine, then the checkpoint
# and the secret state; the ledger continues and the loop goes on from step 20.
engine2 = PrivacyEngine()
model, optimizer, criterion, loader = private_loop(engine2)
ck = torch.load(os.path.join(out, "private", "checkpoint.pt"))
model.load_state_dict(ck["model"])
optimizer.load_state_dict(ck["optimizer"])
engine2.load_noise_state(secret)
for epoch in range(2):
    for x, y in loader:
        criterion(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
print(f"resumed: {engine2.ledger.steps} steps, ε = {engine2.get_epsilon(1e-5):.2f} (target 8)")

# ------------------------------------------------------------------ DPTrainer
from datasets import Dataset  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification, TrainingArguments,  # noqa: E402
                          default_data_collator)

from dpft.integrations.hf import DPArguments, DPTrainer  # noqa: E402

g = torch.Generator().manual_seed(0)
rows = Dataset.from_dict({"input_ids": torch.randint(3, 100, (400, 12), generator=g).tolist(),
                          "attention_mask": [[1] * 12] * 400, "labels": torch.randint(0, 2, (400,), generator=g).tolist()})
for name, extra in (("banded", dict(mechanism="banded_mf", bands=4)),   # p = 4·20/400 = 0.2
                    ("truncated", dict(max_batch_size=32))):             # at most 32 rows per step
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=2))
    args = TrainingArguments(output_dir=os.path.join(out, name), max_steps=12, learning_rate=5e-3,
                             per_device_train_batch_size=16, save_strategy="steps", save_steps=6,
                             logging_steps=6, report_to=[], use_cpu=True, disable_tqdm=True)
    dp_args = DPArguments(target_epsilon=8.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=20, **extra)
    trainer = DPTrainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                        dp_args=dp_args)
    trainer.train()   # banded: output_dir/noise_state.secret.pt (0600), outside checkpoint-*/
    print(f"DPTrainer {name}: σ = {trainer.sigma:.3f}, ε = {trainer.get_epsilon():.2f}, ledger "
          f"{[(type(e.event).__name__, e.count) for e in trainer.ledger.entries][:3]}")
    print("  output_dir:", sorted(os.listdir(os.path.join(out, name))))
