"""What ``dpft train`` runs when no recipe is given (issue 36 item 7): the tuned recipe of the
task, not the schema's bare defaults (full fine-tuning, flat clipping, one learning rate), which
end at the majority class on a pretrained encoder with a fresh head (README, "On a real model").

- classification: ``recipes/sst2-minilm.yaml``'s method — the top 2 blocks and the head,
  head_body clipping (f = 0.5), AdamW at 3e-4 with the head at 1e-2, mean pooling, no dropout;
- generation (``instruct``, ``text``, ``seq2seq``): ``recipes/e2e-instruct-stories260k-lora.yaml``
  and ``e2e-t5-lora.yaml``'s — LoRA r = 8 on the attention and MLP Linear layers (named by the
  model's family, read from its config.json), flat clipping, AdamW at 1e-2, one epoch at an
  expected batch of 128; a family whose Linear names are unknown keeps full fine-tuning.

Flags and ``--set`` override any of these keys; task, data and budget keys are not set here.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["CLASSIFICATION", "GENERATION_TASKS", "default_overrides", "lora_targets"]

#: recipes/sst2-minilm.yaml minus its task, data and budget (README "On a real model").
CLASSIFICATION: dict[str, Any] = {
    "model.pooling": "mean", "model.dropout": 0.0,
    "trainable.mode": "auto", "trainable.last_k": 2,  # auto: the probe at N ≤ 10k, else last_k (run/scope.py)
    "privacy.clipping.style": "head_body", "privacy.clipping.head_fraction": 0.5,
    "optimizer.name": "adamw", "optimizer.lr": 3e-4, "optimizer.head_lr": 1e-2,
    "schedule.steps": 100, "schedule.warmup_steps": 2, "schedule.decay": "linear",  # steps: the schema's default
}

#: recipes/e2e-instruct-stories260k-lora.yaml (causal LM) and e2e-t5-lora.yaml (seq2seq).
GENERATION: dict[str, Any] = {
    "trainable.mode": "lora", "trainable.lora.r": 8, "trainable.lora.alpha": 16.0,
    "privacy.clipping.style": "flat", "optimizer.name": "adamw", "optimizer.lr": 1e-2,
    "schedule.steps": None, "schedule.epochs": 1.0, "schedule.decay": "linear",
    "batch.expected_batch_size": 128,
}

GENERATION_TASKS = ("instruct", "text", "seq2seq")

_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Linear layers of the attention and MLP blocks by ``config.model_type``.
_TARGETS: dict[str, list[str]] = {
    **{t: _LLAMA for t in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "smollm3")},
    "t5": ["q", "k", "v", "o", "wi", "wo"], "mt5": ["q", "k", "v", "o", "wi_0", "wi_1", "wo"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


def lora_targets(model_name: str) -> Optional[list[str]]:
    """LoRA target modules for ``model_name``'s family (its config.json only; no weights are
    read), or None when the family is not in the table or the config cannot be read offline."""
    try:
        from transformers import AutoConfig

        from dpft.models.load import resolve_model_path

        mt = AutoConfig.from_pretrained(resolve_model_path(model_name)).model_type
    except Exception:  # noqa: BLE001 - offline hub id, no config: keep full fine-tuning
        return None
    return _TARGETS.get(mt)


def default_overrides(task_name: str, model_name: str) -> tuple[dict[str, Any], str]:
    """``(overrides, what)`` of the tuned recipe for a run given no recipe; ``what`` is the line
    that says which (printed on stderr)."""
    if task_name not in GENERATION_TASKS:
        return dict(CLASSIFICATION), ("no recipe: the tuned classification defaults of recipes/sst2-minilm.yaml "
                                      "(top 2 blocks + head, head_body clipping, AdamW 3e-4 / head 1e-2, mean "
                                      "pooling, no dropout); flags and --set override them")
    targets = lora_targets(model_name)
    if targets is None:
        ov = {k: v for k, v in GENERATION.items() if not k.startswith("trainable.")}
        ov["optimizer.lr"] = 5e-4
        return ov, ("no recipe: the instruction defaults (full fine-tuning: LoRA target layers unknown for this "
                    "model; flat clipping, AdamW 5e-4, 1 epoch at an expected batch of 128); --trainable lora with "
                    "--set trainable.lora.target_modules=[...] for LoRA")
    return {**GENERATION, "trainable.lora.target_modules": targets}, (
        f"no recipe: the tuned instruction defaults of recipes/e2e-instruct-stories260k-lora.yaml (LoRA r = 8 on "
        f"{', '.join(targets)}; flat clipping, AdamW 1e-2, 1 epoch at an expected batch of 128); flags and --set "
        "override them")
