"""Issue 36 item 5: a run's model folder loads with transformers alone.

The mean-pooling head (dpft's default classifier) has no standard transformers class, so the
folder carries its modeling code (``hf_mean_pool.py``) with ``auto_map`` in ``config.json``, the
Hugging Face convention for custom heads. A fresh interpreter that never imports dpft loads it
with ``pipeline(..., trust_remote_code=True)`` and ``AutoModelForSequenceClassification`` and
gets the logits dpft computes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

TEXTS = ["a good film", "a dull and poor film number 3", "lovely", "an awful, awful story about nothing at all"]

_SCRIPT = r"""
import json, sys
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline
folder, texts = sys.argv[1], json.loads(sys.argv[2])
clf = pipeline("text-classification", model=folder, trust_remote_code=True, device="cpu")
out = clf(texts, function_to_apply="none", top_k=None, batch_size=4)
pipe = [[next(d["score"] for d in o if d["label"] == lab) for lab in ("neg", "pos")] for o in out]
model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
enc = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    auto = model(**enc).logits.tolist()
print(json.dumps({"dpft_imported": "dpft" in sys.modules or any(m.startswith("dpft.") for m in sys.modules),
                  "pipeline": pipe, "auto": auto, "class": type(model).__name__}))
"""


def _without_dpft(folder, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    # transformers copies remote code into HF_MODULES_CACHE: keep it inside the test's folder.
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(folder), json.dumps(TEXTS)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_mean_pool_model_folder_loads_with_transformers_alone(tiny_model_dir, tmp_path):
    from dpft.models.export import save_standard
    from dpft.models.load import load_classifier

    tok, model = load_classifier(str(tiny_model_dir), 2, pooling="mean", head_dropout=0.0)
    torch.manual_seed(3)
    with torch.no_grad():  # a trained-looking head (not the zero-ish init)
        model.classifier.weight.normal_(0, 1.0)
        model.classifier.bias.normal_(0, 1.0)
    out = tmp_path / "run" / "model"
    save_standard(model.eval(), tok, out, labels=["neg", "pos"])  # what a run writes (run/loop.py)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "dpft_mean_pool"
    assert cfg["auto_map"] == {"AutoConfig": "hf_mean_pool.DpftMeanPoolConfig",
                               "AutoModelForSequenceClassification": "hf_mean_pool.DpftMeanPoolForSequenceClassification"}
    code = (out / "hf_mean_pool.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+dpft\b", code, re.M)
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model(**{k: v for k, v in enc.items() if k in ("input_ids", "attention_mask")}).logits

    got = _without_dpft(out, tmp_path)
    assert got["dpft_imported"] is False
    assert got["class"] == "DpftMeanPoolForSequenceClassification"
    torch.testing.assert_close(torch.tensor(got["auto"]), ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(got["pipeline"]), ours, atol=1e-5, rtol=0)
