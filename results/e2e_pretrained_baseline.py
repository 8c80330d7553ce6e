"""BLEU / ROUGE-L of the pretrained stories260K before any fine-tuning, decoded and scored exactly
as the E2E instruct runs do (same recipe, template, prompts and metrics; no training step).

    DPFT_DATA_DIR=../shared/data PYTHONPATH=src python results/e2e_pretrained_baseline.py ../shared/data
"""

import json
import sys

from dpft.config import load_recipe
from dpft.data.instruct import load_instruct_task
from dpft.eval.generate import generation_eval
from dpft.eval.lm import lm_eval
from dpft.models.causal import load_causal_lm

D = sys.argv[1] if len(sys.argv) > 1 else "../shared/data"
r = load_recipe("recipes/e2e-instruct-stories260k.yaml", {
    "model.name": f"{D}/models/stories260K", "task.train_file": f"{D}/e2e/trainset.csv",
    "task.dev_file": f"{D}/e2e/devset.csv"})
tok, model = load_causal_lm(r.model.name, seed=r.seed)
task = load_instruct_task(r.task, tok, r.model.max_length, seed=r.seed)
e = r.eval
g = generation_eval(model, tok, task.groups, e.max_new_tokens, e.num_beams, e.batch_size, e.max_generate_prompts,
                    e.num_samples)
out = {**g["metrics"], **lm_eval(model, list(task.dev), tok.pad_token_id, e.batch_size), "samples": g["samples"]}
print(json.dumps(out, indent=1))
