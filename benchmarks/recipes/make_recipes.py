"""Writes the YAML recipes of the session-3 experiments (issues 4 and 5) beside this file.

All start from the demo's fixes (mean pooling, no dropout, head_body clipping, head lr 1e-2):
i5_* = RMT denoising curves (ε = 3, B = 512, 60 steps, eval every 5; full = all blocks without
the word embeddings, lora = r 16 on query/value + head); i4_* = the DP-SFT table (top-2 blocks +
head, B = 256, 40 steps; ε ∈ {1, 4}). Run one with
``dpft train benchmarks/recipes/NAME.yaml -o runs/NAME`` (``i4_nodp`` with ``--no-dp``).
``i4_fullwarm_*`` start from the public stage-1 model of ``runs/i4_sft_pub_e4`` (set by RUNS).
"""
import copy
import os
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RUNS = os.environ.get("RUNS", "runs")
base = {
 "seed": 0,
 "model": {"name": "minilm", "max_length": 64, "pooling": "mean", "dropout": 0.0},
 "task": {"name": "sst2"},
 "trainable": {"mode": "last_k", "last_k": 2},
 "privacy": {"target_epsilon": 3.0, "delta": 1e-5,
             "clipping": {"style": "head_body", "head_fraction": 0.5, "max_norm": 1.0}},
 "optimizer": {"name": "adamw", "lr": 3e-4, "head_lr": 1e-2, "weight_decay": 0.0},
 "schedule": {"steps": 60, "warmup_steps": 2, "decay": "linear"},
 "batch": {"expected_batch_size": 512, "max_physical_batch_size": 64},
 "eval": {"every_steps": 5, "batch_size": 256},
 "checkpoint_every": 10,
 # step times and training loss for the overhead columns: the 0600 diagnostics file (not covered)
 "log": {"private_diagnostics": True},
}
def mk(name, **upd):
    d = copy.deepcopy(base); d["name"] = name
    for k, v in upd.items():
        cur = d; ks = k.split("__")
        for kk in ks[:-1]: cur = cur.setdefault(kk, {})
        cur[ks[-1]] = v
    yaml.safe_dump(d, open(f"{HERE}/{name}.yaml", "w"), sort_keys=False, allow_unicode=True)
rmt = {"method": "rmt", "kappa": 1.05, "rank": 8}
lora = {"mode": "lora", "lora": {"r": 16, "alpha": 16.0, "target_modules": ["query", "value"]}}
# issue 5: eps 3, B 512, 60 steps
mk("i5_full", trainable={"mode": "full", "freeze_embeddings": True})
mk("i5_full_rmt", trainable={"mode": "full", "freeze_embeddings": True}, denoise=rmt)
mk("i5_lora", trainable=lora, optimizer__lr=2e-3)
mk("i5_lora_rmt", trainable=lora, optimizer__lr=2e-3, denoise=rmt)
# issue 4: last_k 2, B 256, 40 steps, eps {1,4}
for e in (1, 4):
    common = dict(privacy__target_epsilon=float(e), batch__expected_batch_size=256, schedule__steps=40, eval__every_steps=10)
    mk(f"i4_full_e{e}", **common)
    mk(f"i4_lora_e{e}", trainable=lora, optimizer__lr=2e-3, **common)
    sub = {"k": 32, "steps": 32, "expected_batch_size": 64, "start": "stage1", "optimizer_space": "full", "dtype": "float32"}
    mk(f"i4_sft_pub_e{e}", optimizer={"name": "adamw", "lr": 5e-4, "weight_decay": 0.0},
       subspace={**sub, "source": "public", "public_task": {"name": "imdb", "max_train_examples": 4096, "max_dev_examples": 500}}, **common)
    mk(f"i4_sft_priv_e{e}", subspace={**sub, "source": "private", "expected_batch_size": 256, "budget_share": 0.3}, **common)
mk("i4_nodp", batch__expected_batch_size=256, schedule__steps=40, eval__every_steps=10)
for e in (4,):  # ε = 4 only: the controls of the table (time)
    mk(f"i4_fullwarm_e{e}", privacy__target_epsilon=float(e), batch__expected_batch_size=256, schedule__steps=40,
       eval__every_steps=10, model__name=f"{RUNS}/i4_sft_pub_e4/subspace/stage1/model")
for e in (4,):
    mk(f"i4_full72_e{e}", privacy__target_epsilon=float(e), batch__expected_batch_size=256, schedule__steps=72, eval__every_steps=8)
# issue 5: a second seed of the LoRA pair (sampling, noise and head initialisation change)
mk("i5_lora_s1", trainable=lora, optimizer__lr=2e-3, seed=1)
mk("i5_lora_rmt_s1", trainable=lora, optimizer__lr=2e-3, denoise=rmt, seed=1)
