"""make_private on several processes (torchrun), at example or user level — docs/make_private_distributed.md.

A tiny bag-of-embeddings classifier on synthetic data (CPU, seconds). The same script runs alone
or under torchrun; with --reproducible the K-process run draws the 1-process batches and noise,
so their results can be compared:

    python docs/snippets/make_private_ddp.py --reproducible --out one.json
    torchrun --nproc_per_node=2 docs/snippets/make_private_ddp.py --reproducible --out two.json
    python docs/snippets/make_private_ddp.py --compare one.json two.json

Add --users for user-level DP (each synthetic user owns 1-8 rows; the privacy unit is a user).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from dpft import PrivacyEngine

VOCAB, LENGTH, N = 100, 12, 2048


class Classifier(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens):  # (B, T) int64 -> (B, 2) logits
        h = self.emb(tokens).mean(1)
        return self.head(self.norm(torch.tanh(self.fc(h))))


def data():
    g = torch.Generator().manual_seed(0)  # the same rows on every rank
    x = torch.randint(0, VOCAB, (N, LENGTH), generator=g)
    y = ((x < VOCAB // 2).float().mean(1) > 0.5).long()
    user = torch.randint(0, N // 4, (N,), generator=g)  # ~512 users of about 4 rows each
    return [{"tokens": x[i], "label": y[i], "user": int(user[i])} for i in range(N)]


def train(args):
    if "RANK" in os.environ:  # under torchrun; make_private would also create the group itself
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(rank)  # each rank its own init (make_private broadcasts rank 0's) and dropout
    model = Classifier()
    rows = data()
    engine = PrivacyEngine(reproducible_seed=0 if args.reproducible else None)
    module, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=2e-3),
        criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(rows, batch_size=64 if not args.users else 32),
        target_epsilon=3.0, target_delta=1e-5 if not args.users else 1e-4, epochs=args.epochs, max_grad_norm=1.0,
        max_physical_batch_size=16, user_ids="user" if args.users else None, max_rows_per_user=4)
    for _ in range(args.epochs):
        for batch in loader:  # this rank's share of each logical batch, in micro-batches
            optimizer.zero_grad()
            criterion(module(batch["tokens"]), batch["label"]).backward()
            optimizer.step()  # the last micro-batch: all-reduce, noise once for the world, update
    with torch.no_grad():
        acc = float((module(torch.stack([r["tokens"] for r in rows[:512]])).argmax(1)
                     == torch.stack([r["label"] for r in rows[:512]])).float().mean())
    eps = engine.get_epsilon(1e-5 if not args.users else 1e-4)
    if rank == 0:
        print(f"world {loader.world_size}, {'user' if args.users else 'example'} level: "
              f"{optimizer.logical_steps} noisy steps, σ = {optimizer.noise_multiplier:.4f}, ε = {eps:.3f}, "
              f"train accuracy {acc:.3f}")
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": loader.world_size, "ledger": engine.ledger.to_json(), "epsilon": eps,
                       "accuracy": acc,
                       "weights": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}, f)
    engine.save_ledger(args.out + ".ledger.json" if args.out else "ledger.json")  # rank 0 alone writes


def compare(a_path, b_path):
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    diff = max(max(abs(x - y) for x, y in zip(a["weights"][n], b["weights"][n])) for n in a["weights"])
    scale = max(max(abs(x) for x in a["weights"][n]) for n in a["weights"])
    print("| | " + " | ".join(f"{d['world_size']} process(es)" for d in (a, b)) + " | equal |")
    print("|---|---|---|---|")
    print(f"| ledger events (count) | {sum(e['count'] for e in a['ledger']['entries'])} | "
          f"{sum(e['count'] for e in b['ledger']['entries'])} | {a['ledger'] == b['ledger']} |")
    print(f"| ε | {a['epsilon']:.6f} | {b['epsilon']:.6f} | {a['epsilon'] == b['epsilon']} |")
    print(f"| train accuracy | {a['accuracy']:.4f} | {b['accuracy']:.4f} | {a['accuracy'] == b['accuracy']} |")
    print(f"| max abs weight difference | | | {diff:.3g} (largest weight {scale:.3g}) |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--reproducible", action="store_true", help="seeded randomness (tests; ε holds only while the "
                                                                   "seed is secret)")
    p.add_argument("--users", action="store_true", help="user-level DP (the privacy unit is a user)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", default="")
    p.add_argument("--compare", nargs=2)
    a = p.parse_args()
    compare(*a.compare) if a.compare else train(a)
