"""Equality of every way in before and after a refactor of the privacy plan (issue 34).

Runs, in reproducible mode (seeded randomness: NOT CERTIFIED, for comparison only), each way in
— ``dpft train`` (tiny BERT on 60 rows), ``make_private`` (a linear model), ``DPTrainer`` and
``DPSFTTrainer`` (tiny BERT / tiny GPT-2) — with each mechanism (plain Poisson + Gaussian,
truncated Poisson, banded MF b = 2), and saves the ledger (events and counts) and the trained
weights of each cell to ``--out`` (a ``torch.save`` file). ``--compare A B`` prints the table:
ledger equal, max |Δw| over all trained weights.

    python benchmarks/plan_equality.py --out /tmp/before.pt      # at the old commit
    python benchmarks/plan_equality.py --out /tmp/after.pt       # at the new one
    python benchmarks/plan_equality.py --compare /tmp/before.pt /tmp/after.pt
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch

SEED = 7
MECHS = {"gaussian": {}, "truncated": {"max_batch_size": 9}, "banded_mf": {"mechanism": "banded_mf", "bands": 2}}


def _ledger(ledger) -> list:
    return [(e.phase, repr(e.event), e.count) for e in ledger.entries]


def _tiny_bert(num_labels=2, vocab=64):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=num_labels)
    return BertForSequenceClassification(cfg).train()


def make_private_cell(mech: dict):
    from torch import nn
    from torch.utils.data import TensorDataset

    from dpft import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g))
    eng = PrivacyEngine(reproducible_seed=SEED)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        dataset=data, expected_batch_size=8, max_grad_norm=1.0, steps=6, target_epsilon=4.0, target_delta=1e-3,
        **mech)
    while opt.logical_steps < 6:
        for x, y in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.logical_steps >= 6:
                break
    return _ledger(eng.ledger), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rows(n=40, t=6, causal=False):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (n, t), generator=g)
    d = {"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist()}
    d["labels"] = ids.tolist() if causal else torch.randint(0, 2, (n,), generator=g).tolist()
    return datasets.Dataset.from_dict(d)


def trainer_cell(mech: dict, sft: bool = False):
    from transformers import TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=8, reproducible_seed=SEED,
                     max_grad_norm=1.0, **mech)
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, learning_rate=5e-2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=4, save_strategy="no")
        if sft:
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)).train()
            tr = DPTrainer(model=model, args=args, train_dataset=_rows(causal=True),
                           data_collator=default_data_collator, dp_args=dp)
        else:
            tr = DPTrainer(model=_tiny_bert(), args=args, train_dataset=_rows(), data_collator=default_data_collator,
                           dp_args=dp)
        tr.train()
        return _ledger(tr.ledger), {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def cli_cell(mech: dict, extra: dict | None = None):
    import pandas as pd
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from dpft.config.recipe import load_recipe
    from dpft.models.load import resolve_model_path
    from dpft.run.loop import Trainer

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)
        BertForSequenceClassification(cfg).save_pretrained(d / "m")
        tok.save_pretrained(d / "m")
        words = ["good", "bad", "great", "awful", "fine", "poor", "lovely", "dull"]
        pd.DataFrame([{"text": f"a {words[i % 8]} film number {i}", "label": int(i % 8 % 2 == 0)}
                      for i in range(60)]).to_csv(d / "d.csv", index=False)
        ov = {"model.name": str(d / "m"), "model.max_length": 16, "task.name": "files",
              "task.train_file": str(d / "d.csv"), "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 8,
              "schedule.steps": 4, "eval.every_steps": 4, "checkpoint_every": 4, "privacy.delta": 1e-3,
              "optimizer.lr": 1e-2, "privacy.reproducible": True, "seed": SEED, "privacy.target_epsilon": 4.0}
        if mech.get("mechanism"):
            ov.update({"privacy.mechanism": "banded_mf", "privacy.bands": mech["bands"]})
        if mech.get("max_batch_size"):
            ov["batch.max_batch_size"] = mech["max_batch_size"]
        ov.update(extra or {})
        r = load_recipe(None, ov)
        tr = Trainer(r, d / "run", progress=False)
        tr.run()
        return _ledger(tr.ledger), {k: v.detach().clone() for k, v in tr.params.items()}


WAYS = {"dpft train": cli_cell, "make_private": make_private_cell, "DPTrainer": trainer_cell,
        "DPSFTTrainer-like (causal LM)": lambda m: trainer_cell(m, sft=True),
        # methods through the plan's hooks (plain mechanism only: the others refuse methods)
        "dpft train + RMT": lambda m: cli_cell(m, {"denoise.method": "rmt", "denoise.min_dim": 2}),
        "dpft train + DP-Adam-AC (adaptive clip)": lambda m: cli_cell(
            m, {"adam_ac.adaptive_clip": True, "adam_ac.bias_correction": True})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--ways", default=",".join(WAYS))
    a = ap.parse_args()
    if a.compare:
        x, y = (torch.load(p, weights_only=False) for p in a.compare)
        print("| way in | mechanism | ledger equal | max abs dw |\n|---|---|---|---|")
        for key in x:
            if key not in y:
                continue
            (la, wa), (lb, wb) = x[key], y[key]
            dw = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
            print(f"| {key[0]} | {key[1]} | {la == lb} | {dw:.3g} |")
        return
    warnings.simplefilter("ignore")
    res = {}
    for way in a.ways.split(","):
        for mname, mech in MECHS.items():
            if "+" in way and mname != "gaussian":
                continue
            try:
                res[(way, mname)] = WAYS[way](mech)
            except Exception as exc:  # noqa: BLE001 - a cell that fails is reported, the rest still run
                print(f"{way} × {mname}: {type(exc).__name__}: {exc}")
    torch.save(res, a.out)
    print(f"wrote {len(res)} cells to {a.out}")


if __name__ == "__main__":
    main()
