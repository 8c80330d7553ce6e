#!/usr/bin/env python
"""DP-SFT stage 2 from a basis file on 2 gloo processes against 1 process (issue 26, item 5; a
check too slow for the test suite): a tiny random BERT, a public stage 1 writes the basis, then
the same reproducible recipe with ``subspace.source: file`` runs in 1 process and on 2 forked
ranks (tests/test_ddp.py's launcher). Prints both ledgers, ε, whether rank 1 wrote anything and
the largest weight difference. Usage: ``PYTHONPATH=src:tests python benchmarks/dpsft_ddp_check.py [WORKDIR]``
"""
import json, sys, os
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.chdir(ROOT)
import test_ddp, torch
from dpft.config.recipe import load_recipe
from dpft.run.loop import Trainer
import pandas as pd
def main():
    tmp = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dpsft_ddp_check")
    tmp.mkdir(parents=True, exist_ok=True)
    model_dir = tmp / "tinybert"
    if not (model_dir / "config.json").is_file():
        from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
        from dpft.models.load import resolve_model_path
        tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)
        BertForSequenceClassification(cfg).save_pretrained(model_dir); tok.save_pretrained(model_dir)
    words = ["good", "bad", "great", "awful"]
    csv = tmp / "d.csv"; tsv = tmp / "p.csv"
    pd.DataFrame([{"text": f"a {words[i % 4]} film {i}", "label": i % 2} for i in range(48)]).to_csv(csv, index=False)
    pd.DataFrame([{"text": f"the {words[i % 4]} movie {i}", "label": i % 2} for i in range(48)]).to_csv(tsv, index=False)
    base = {"model.name": str(model_dir), "model.max_length": 16, "model.dropout": 0.0, "task.name": "files",
            "task.train_file": str(csv), "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 4,
            "schedule.steps": 3, "schedule.warmup_steps": 0, "eval.every_steps": 3, "checkpoint_every": 3,
            "privacy.noise_multiplier": 1.0, "privacy.delta": 1e-3, "privacy.engine": "bookkeeping",
            "privacy.reproducible": True, "optimizer.lr": 1e-2, "trainable.mode": "last_k", "trainable.last_k": 1,
            "subspace.k": 2, "subspace.steps": 2}
    # basis from a public stage 1, one process
    t = Trainer(load_recipe(None, {**base, "subspace.source": "public",
                                   "subspace.public_task": {"name": "files", "train_file": str(tsv)}}), tmp / "basis", progress=False)
    t.run()
    f = tmp / "basis" / "subspace" / "basis.safetensors"
    ov = {**base, "subspace.source": "file", "subspace.file": str(f)}
    one = Trainer(load_recipe(None, ov), tmp / "one", progress=False); rep1 = one.run()
    failure, logs = test_ddp.launch_worker(tmp / "two", ov)
    print("failure:", failure)
    print("ledger 1:", [(e.phase, e.count, repr(e.event)) for e in one.ledger.entries])
    l2 = json.loads((tmp / "two" / "rank0" / "run" / "ledger.json").read_text())
    print("ledger 2 (rank0):", l2["entries"])
    print("eps 1 proc", rep1["privacy"]["epsilon"], "eps 2 proc", [lg.get("epsilon") for lg in logs])
    print("digests equal across ranks:", logs[0].get("digest") == logs[1].get("digest"))
    print("rank1 files:", test_ddp.files_under(tmp / "two" / "rank1"))
    import hashlib
    h = hashlib.sha256()
    for n in sorted(one.params): h.update(one.params[n].detach().float().contiguous().numpy().tobytes())
    print("1-proc digest == 2-proc digest:", h.hexdigest() == logs[0].get("digest"))
    from safetensors.torch import load_file
    a = load_file(str(tmp / "one" / "checkpoint" / "trainable.safetensors")); b = load_file(str(tmp / "two" / "rank0" / "run" / "checkpoint" / "trainable.safetensors"))
    print("max |w1 - w2|:", max(float((a[k] - b[k]).abs().max()) for k in a))


if __name__ == "__main__":
    main()
