"""DPTrainer on several processes (torchrun or accelerate launch), at example or user level.

The same script runs in one process and in K: launched by ``torchrun`` or ``accelerate
launch``, each process trains on its share of one Poisson logical batch for the world, the
clipped sums are all-reduced once per step, the noise is added once for the world, and the
ledger (identical to a one-process run's) and checkpoints are written by rank 0 only. A tiny
random BERT and 395 synthetic rows here (CPU, seconds; it learns little in 8 noisy steps); for a
real run load a pretrained model.

    python docs/snippets/dp_trainer_distributed.py OUT [--user-level] [--seed N]
    torchrun --nproc_per_node=2 docs/snippets/dp_trainer_distributed.py OUT [--user-level] [--seed N]
    accelerate launch --multi_gpu --num_processes 2 docs/snippets/dp_trainer_distributed.py OUT [...]

(``accelerate launch --multi_gpu`` starts the processes with torchrun; on a machine without
GPUs they train on the CPU over gloo.) With ``--user-level`` the privacy unit is a user (column
``user_id``; 100 users of 1 to 7 rows): users are sampled, at most 4 rows each per step, and
each user's summed gradient is clipped to C.
"""

import os
import sys

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from dpft.integrations.hf import DPArguments, DPTrainer

out = sys.argv[1] if len(sys.argv) > 1 else "dp_trainer_distributed_out"
user_level = "--user-level" in sys.argv
# --seed N: reproducible mode (research and tests only: ε holds only while N stays secret); the
# same N gives the same batches, noise and ledger in 1 process and in K.
seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else None
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# --- data: 395 rows of token ids, labelled by their second token; 100 users of 1 to 7 rows ----
users = [u for u in range(100) for _ in range(1 + u % 7)]
rows = {"input_ids": [], "labels": [], "user_id": []}
for i, u in enumerate(users):
    w = i % 8
    rows["input_ids"].append([2, 10 + w] + [20 + (i * 7 + j) % 40 for j in range(i % 6)] + [3])
    rows["labels"].append(int(w < 4))
    rows["user_id"].append(f"user-{u}")
train = Dataset.from_dict(rows)
dev = Dataset.from_dict({k: v[:64] for k, v in rows.items() if k != "user_id"})


def collate(batch):
    t = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["labels"] for r in batch])}


# --- model: tiny and random (every rank starts from rank 0's weights: DPTrainer broadcasts them);
#     for a real run e.g. AutoModelForSequenceClassification.from_pretrained(...)
#     Dropout 0 here: dropout masks are secret per step *and rank*, so with dropout a K-process
#     run differs from a 1-process one by its masks (ledger and ε are the same either way).
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, intermediate_size=64,
                                                 max_position_embeddings=32, num_labels=2,
                                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

args = TrainingArguments(
    output_dir=out, max_steps=8, learning_rate=5e-3, lr_scheduler_type="constant",
    per_device_train_batch_size=16,        # physical batch per process (memory only)
    per_device_eval_batch_size=32,
    save_strategy="steps", save_steps=4, logging_steps=4, report_to=[],
    use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
dp_args = DPArguments(
    target_epsilon=4.0, target_delta=1e-3, max_grad_norm=1.0,
    expected_batch_size=20 if user_level else 64,   # the world's logical batch (users at user level)
    user_column="user_id" if user_level else None, max_rows_per_user=4, reproducible_seed=seed)

trainer = DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev, data_collator=collate,
                    dp_args=dp_args)
trainer.train()
metrics = trainer.evaluate()                 # sharded over the ranks by accelerate, gathered
if trainer.is_world_process_zero():          # every rank holds the same ledger; rank 0 reports
    unit = "users" if user_level else "rows"
    print(f"world size {trainer.world.world_size}: N = {trainer.n} {unit}, q = {trainer.q:.4f}, "
          f"sigma = {trainer.sigma:.4f}, {trainer.ledger.steps} noisy steps, "
          f"epsilon = {trainer.get_epsilon():.4f} at delta = {dp_args.target_delta:g}; "
          f"eval_loss = {metrics['eval_loss']:.6f}; model wrapped as {type(trainer.model_wrapped).__name__}")
