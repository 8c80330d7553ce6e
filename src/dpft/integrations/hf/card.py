"""The model card of a :class:`~dpft.integrations.hf.trainer.DPTrainer` (and its TRL subclasses): the same
card as ``dpft train``'s (outputs/card.py ``build_card``: ε, δ, the privacy unit and N, the mechanism,
what the ε covers), built from the trainer's plan and ledger. It replaces ``Trainer``'s and PEFT's
cards in ``output_dir/README.md`` so that what is saved and pushed states the guarantee. No
absolute local path is written: a local base model is named by its folder name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpft.outputs.card import build_card
from dpft.outputs.report import plan_section

__all__ = ["trainer_report", "write_trainer_card"]


def _public_name(name: str) -> str:
    """A hub id as is; a local folder by its last component (no absolute path in a card)."""
    p = Path(str(name))
    return p.name if (p.is_absolute() or p.exists()) else str(name)


def trainer_report(tr) -> dict[str, Any]:
    """A ``report.json``-shaped dict of the trainer's run (public quantities only)."""
    dp_args, delta = tr.dp_args, tr.dp_args.target_delta
    model = tr.model
    base = getattr(model, "get_base_model", lambda: model)()
    name = _public_name(getattr(getattr(base, "config", None), "_name_or_path", "") or type(base).__name__)
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if tr.ledger.certified:
        eps = tr.ledger.epsilon(delta)
        privacy = {"guarantee": "certified", "epsilon": float(eps.epsilon), "delta": delta,
                   "accountant": eps.accountant, "epsilon_rdp": float(eps.epsilon_rdp)}
    else:
        privacy = {"guarantee": "NOT CERTIFIED", "reason": tr.ledger.not_certified_reason or "marked not certified"}
    if dp_args.reproducible_seed is not None and privacy["guarantee"] == "certified":
        privacy["reproducible"] = True
    unit = "user" if tr.user_level else "example"
    pu = {"unit": unit, "n_units": tr.n}
    if tr.user_level:
        pu.update(column=dp_args.user_column, max_rows_per_user=dp_args.max_rows_per_user,
                  user_clipping=dp_args.user_clipping)
    dp = {"private": True, "noise_multiplier": tr.sigma, "sampling_rate": tr.q,
          "expected_batch_size": dp_args.expected_batch_size, "steps": tr.total_steps,
          "released_steps": tr.ledger.steps, "clipping": {"max_norm": dp_args.max_grad_norm, "style": dp_args.clipping},
          "privacy_unit": pu, "n_units": tr.n,
          "randomness": ("reproducible seed (NOT for release)" if dp_args.reproducible_seed is not None
                         else "secret key from the OS CSPRNG, never written"),
          "mechanism": tr.plan.info(), **plan_section(tr.plan)}
    who = "user (all of that user's rows)" if tr.user_level else "training example"
    coverage = {
        "statement": (f"For any one {who}, the probability of any outcome of this run — the saved model, every "
                      "checkpoint and the ledger — changes by at most a factor e^ε between the training data with "
                      f"and without it, except with probability δ (add/remove-one {unit}, N = {tr.n})."
                      if privacy["guarantee"] == "certified" else
                      "This run is NOT CERTIFIED: nothing it writes is covered by a proven ε."),
        "dev": ("Evaluation metrics on eval_dataset are computed exactly, without noise: they are covered only if "
                "that data is public."),
        "not_released": ("The un-noised training loss is not logged (unless DPArguments.log_private_train_loss, "
                         "which is not covered)."),
        "timing": "Wall-clock times grow with the realised batch sizes: a side channel not covered by ε.",
        "public": "The pre-trained model, the privacy settings and N are treated as public.",
    }
    meths = getattr(tr, "methods", None)
    if privacy.get("reproducible"):
        coverage["reproducible"] = "NOT FOR RELEASE: DPArguments.reproducible_seed was set; ε holds only while it is secret."
    return {
        "name": f"{name}-dp" if name else "dpft-model",
        "task": {"name": type(tr).__name__, "source": f"train_dataset of {len(tr.train_dataset):,} rows",
                 "n_train": len(tr.train_dataset), "labels": getattr(getattr(base, "config", None), "id2label", None)},
        # max_length None: the card names no truncation (the user's tokenizer or collator sets it)
        "model": {"name": name, "kind": _kind(base), "trainable": "parameters with requires_grad",
                  "trainable_parameters": trainable, "total_parameters": sum(p.numel() for p in params),
                  "max_length": None},
        "optimizer": {"name": str(getattr(tr.args.optim, "value", tr.args.optim)), "lr": float(tr.args.learning_rate)},
        "privacy": privacy, "dp": dp, "coverage": coverage, "metrics": {},
        # DPArguments.methods: their names and report sections (methods/python.py), as report.json's
        "methods": list(meths.names) if meths else [], **(meths.report() if meths else {}),
    }


def _kind(model) -> str:
    """``classifier`` · ``causal`` · ``seq2seq``, from the model's config (as outputs/card.py names them)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        return "seq2seq"
    archs = getattr(cfg, "architectures", None) or [type(model).__name__]
    return "causal" if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) else "classifier"


def write_trainer_card(tr, directory) -> Path:
    """Write dpft's card to ``directory/README.md`` (over ``Trainer``'s or PEFT's); returns its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "README.md"
    build_card(trainer_report(tr), d).save(path)
    return path
