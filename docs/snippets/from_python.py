"""DP fine-tuning in your own PyTorch loop with dpft (Opacus-shaped: change one import).

A tiny bag-of-embeddings sentiment classifier on synthetic data, trained with DP-AdamW at
ε = 3, δ = 1e-5. Runs on a CPU in a few seconds: python docs/snippets/from_python.py
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpft import PrivacyEngine  # Opacus: from opacus import PrivacyEngine

torch.manual_seed(0)
VOCAB, LENGTH, N = 100, 12, 3060

# Synthetic "sentences": label 1 when most tokens come from the first half of the vocabulary.
x = torch.randint(0, VOCAB, (N, LENGTH))
y = ((x < VOCAB // 2).float().mean(1) > 0.5).long()
train, test = TensorDataset(x[:2560], y[:2560]), (x[2560:], y[2560:])


class Classifier(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):                       # (B, T) int64 -> (B, 2) logits
        h = self.norm(torch.relu(self.fc(self.emb(tokens))))
        return self.head(h.mean(1))


model = Classifier()
engine = PrivacyEngine()                             # secret randomness; reproducible_seed=0 for tests
module, optimizer, criterion, data_loader = engine.make_private(
    module=model,
    optimizer=torch.optim.AdamW(model.parameters(), lr=5e-2),
    criterion=nn.CrossEntropyLoss(),
    data_loader=DataLoader(train, batch_size=256),   # expected batch qN = 256, Poisson-sampled
    target_epsilon=3.0, target_delta=1e-5, epochs=3,
    max_grad_norm=1.0,                               # C: each example's gradient clipped to norm 1
    clipping="flat",
    max_physical_batch_size=128,                     # memory only: never changes the guarantee
)

for epoch in range(3):
    for tokens, labels in data_loader:               # micro-batches of <= 128 examples
        optimizer.zero_grad()
        loss = criterion(module(tokens), labels)
        loss.backward()                              # one backward: per-example norms via hooks
        optimizer.step()                             # True at the end of a logical batch (noise once)
    with torch.no_grad():
        acc = (module(test[0]).argmax(1) == test[1]).float().mean().item()
    print(f"epoch {epoch + 1}: test accuracy {acc:.3f}, {optimizer.logical_steps} noisy steps")

print(f"σ = {engine.noise_multiplier:.3f}, {engine.ledger.steps} noisy steps: "
      f"ε = {engine.get_epsilon(1e-5):.3f} at δ = 1e-5 (PLD accountant of dp-accounting)")
