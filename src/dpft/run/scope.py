"""The trainable scope chosen from N, ε and the compute budget: ``trainable.mode: auto`` (issue 45 item 4).

At thousands of rows a DP linear probe on good fixed features often beats end-to-end DP fine-tuning
(Tramèr & Boneh, ICLR 2021), and costs one forward pass over the data plus seconds of steps with the
frozen features computed once (run/features.py). At tens of thousands of rows the noise per averaged
gradient, σ/B, is small enough that training the top blocks wins. The rule follows the project's own
measurements (benchmarks/results/scope_evidence.md, probe_minilm.md, probe_encoders.md) and prints them
with its choice. It reads only N (a count, public by convention as in every q = B/N), the target ε and the
compute budget, never the private rows: choosing a scope this way spends no privacy.

The chosen scope is a bundle of recipe keys (:data:`SCOPES`); a key the recipe already set away from the
default classification recipe's value (run/defaults.py) is kept as the user set it.
"""

from __future__ import annotations

from typing import Any, Optional

from dpft.config.recipe import apply_overrides, load_recipe
from dpft.config.tasks import is_pair_task
from dpft.models import embedded
from dpft.run.defaults import CLASSIFICATION

__all__ = ["SCOPES", "HEAD_MAX_ROWS", "choose_scope", "scope_overrides", "has_auto_scope"]

#: At or below this many training rows the rule picks the DP linear probe (``head``); above, the top blocks.
#: From the evidence table (benchmarks/results/scope_evidence.md, SST-2, ε = 8): at 5,000 rows the probe is at
#: or above every fine-tuning arm (SST-2, SST-5) at a fifth to a twentieth of the compute; at 20,000 rows the top
#: 2 blocks are ahead (0.814 against 0.803, the 2 seeds both ran; +1.1 points) and at 67,349 rows (0.81 against the
#: probe's 0.80 ceiling): the crossover lies between 5k and 20k, taken at 10k.
HEAD_MAX_ROWS = 10_000


def _probe(n: int) -> dict[str, Any]:
    """recipes/probe-minilm.yaml's settings, scaled to N: q = 1/4, 25 epochs (100 steps), flat C."""
    b = max(1, round(n / 4))
    return {"trainable.mode": "head", "model.head_dropout": 0.0,
            "privacy.clipping.style": "flat", "optimizer.name": "adamw", "optimizer.lr": 0.02,
            "optimizer.head_lr": None, "optimizer.weight_decay": 0.0,
            "schedule.epochs": 25.0, "schedule.steps": None, "schedule.warmup_steps": 0,
            "batch.expected_batch_size": b, "batch.max_physical_batch_size": max(b, 64),
            "eval.every_steps": 25, "checkpoint_every": 50, "checkpoint_every_release": False}


def _every_block(mode: str, lr: Optional[float] = None):
    """``mode`` (``full`` / ``lora``) at q = 1/8 for 5 epochs (40 steps): the schedule of scope_evidence.py's
    ``full_dp`` / ``lora_dp`` arms, the measured source (SST-2, 5,000 rows, ε = 8, 3 seeds: 0.797 ± 0.006 /
    0.783 ± 0.009, against the probe's 0.796 ± 0.002)."""
    def bundle(n: int) -> dict[str, Any]:
        out = {"trainable.mode": mode, "batch.expected_batch_size": max(1, round(n / 8)),
               "schedule.epochs": 5.0, "schedule.steps": None}
        return {**out, "optimizer.lr": lr} if lr is not None else out
    return bundle


#: scope → (the recipe keys it sets given N, the sentence that says what it is). ``auto`` picks ``head`` or
#: ``last_k`` (:func:`choose_scope`); a search (``tune.space.trainable.mode``) may choose among all four.
SCOPES: dict[str, tuple[Any, str]] = {
    "head": (_probe, "a DP linear probe: the head alone on frozen mean-pooled features computed once, q = 1/4, "
                     "25 epochs (recipes/probe-minilm.yaml)"),
    "last_k": (lambda n: {"trainable.mode": "last_k", "trainable.last_k": 2},
               "the top 2 blocks and the head (recipes/sst2-minilm.yaml)"),
    "full": (_every_block("full"), "every block but the word embeddings and the head, q = 1/8, 5 epochs, the "
                                   "recipe's learning rates"),
    "lora": (_every_block("lora", 1e-3), "LoRA on every block's query and value projections (trainable.lora) "
                                         "and the head, q = 1/8, 5 epochs, lr 1e-3"),
}


def has_auto_scope(recipe) -> bool:
    return recipe.trainable.mode == "auto"


def choose_scope(n: int, epsilon: Optional[float], pair: bool = False) -> tuple[str, str]:
    """(scope, why) for N training rows at target ε (None: non-private); ``pair``: rows of two texts."""
    if pair and n <= HEAD_MAX_ROWS:
        return "head", (f"N = {n} ≤ {HEAD_MAX_ROWS}, rows of two texts: the probe on siamese pair features (each "
                        "text encoded alone, the head on [u, v, |u - v|, sqrt(H) * u * v]; model.pair: siamese) is "
                        "the best private arm measured (QNLI, 4,000 rows, 3 seeds: 0.736 ± 0.012 at ε = 8, "
                        "0.717 ± 0.009 at ε = 1, against the jointly encoded probe's 0.542 ± 0.007 and the top 2 "
                        "blocks' 0.514 in one 21-minute run at ε = 8; chance 0.50; "
                        "benchmarks/results/scope_evidence.md); without DP the top 2 blocks reach 0.734 and every "
                        "block 0.810 on the same rows (one run each): expect about 7 points under what the data "
                        "allows at this size — more rows or a larger ε move a fine-tune ahead")
    if n <= HEAD_MAX_ROWS:
        return "head", (f"N = {n} ≤ {HEAD_MAX_ROWS}: at this size a DP linear probe on the frozen features is at or "
                        "above fine-tuning the top blocks (5,000 rows, ε = 8, 3 seeds: SST-2 0.796 ± 0.002 against "
                        "0.791 ± 0.005; SST-5 0.418 ± 0.012 against 0.395 ± 0.012) in a fifth to a seventh of the time "
                        "(benchmarks/results/scope_evidence.md)")
    return "last_k", (f"N = {n} > {HEAD_MAX_ROWS}: with this many rows the noise per averaged gradient is small "
                      "enough that training the top 2 blocks beats the probe (SST-2, ε = 8: 0.814 against 0.803 at 20k rows, "
                      "2 seeds; 0.81 against the probe's 0.80 ceiling at 67k)")


def encoder_hint() -> str:
    """The stronger frozen encoder's measured gain for the probe, and whether it is installed here."""
    there = embedded.problem(embedded.MPNET) is None
    return ("a stronger frozen encoder: --model mpnet (all-mpnet-base-v2, 6.5x MiniLM's cost per row, once) gave "
            "the DP probe +6.1 points on SST-2 at 5k rows through dpft train (0.857 against 0.796 at eps = 8, 0.850 "
            "against 0.789 at eps = 1, 3 seeds; benchmarks/results/scope_evidence.md) and +3.8 to +5.4 on SST-5 "
            "(0.456 against 0.418 at eps = 8, 0.426 against 0.372 at eps = 1, 3 seeds); its private search lands "
            "within 2 points of its own non-private fine-tune on SST-2 and SST-5; "
            + ("installed here" if there else "not installed: " + embedded.MPNET_INSTALL))


def _baseline():
    return load_recipe(None, dict(CLASSIFICATION, **{"trainable.mode": "last_k"}))


def _get(r, key: str) -> Any:
    obj = r
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def scope_overrides(recipe, scope: str, n: int, keep_length: bool = True) -> dict[str, Any]:
    """The keys of ``scope``'s bundle that the recipe left at the default classification recipe's value (or
    ``auto``: the scope's own batch and schedule are the tuned choice for it).

    The length (``schedule.steps`` / ``schedule.epochs``) moves whole, never one of the two (a recipe refuses
    both): where the recipe set its own, ``keep_length`` keeps it (``dpft train``'s auto scope), else the
    scope's length replaces it (a scope in ``tune.space`` runs, and is accounted with, its own schedule)."""
    base = _baseline()
    out = {}
    bundle = SCOPES[scope][0](n)
    if recipe.schedule.time_budget is not None or recipe.schedule.compute_budget is not None:
        # a time or compute budget chooses B and T (accounting/budget.py) for the chosen scope
        bundle = {k: v for k, v in bundle.items() if not k.startswith(("schedule.", "batch.expected"))}
    for k, v in bundle.items():
        cur = _get(recipe, k)
        if k == "trainable.mode" or cur == _get(base, k) or cur == "auto":
            out[k] = v
    if "schedule.epochs" in out and _get(recipe, "schedule.steps") == "auto":
        out["schedule.steps"] = None  # the scope's epochs replace the accountant's T
    length = [k for k in ("schedule.steps", "schedule.epochs") if k in bundle]
    if any(k not in out for k in length):
        for k in length:
            if keep_length:
                out.pop(k, None)
            else:
                out[k] = bundle[k]
    if scope == "head" and _pairs(recipe) and recipe.model.pooling == "mean" and recipe.model.pair == "joint":
        out["model.pair"] = "siamese"  # rows of two texts: each encoded alone (docs/features.md, +19 points on QNLI)
        if recipe.model.max_length == _get(base, "model.max_length"):
            out["model.max_length"] = 128  # two texts in one encoding (scope_evidence.py's probe_pair arm)
    return out


def _pairs(recipe) -> bool:
    """Rows of two texts: a text-pair column, or a registered pair task (config/tasks.py: QNLI)."""
    return is_pair_task(recipe.task.name, recipe.task.text_pair_column)


def resolve_scope(recipe, n: int) -> tuple[Any, str]:
    """``recipe`` with ``trainable.mode: auto`` resolved for N rows, and the lines to print."""
    eps = recipe.privacy.target_epsilon if recipe.privacy.enabled else None
    if recipe.model.pair == "siamese":
        scope, why = "head", "model.pair: siamese reads frozen features: only the head trains"
    else:
        scope, why = choose_scope(n, eps, _pairs(recipe))
    ov = scope_overrides(recipe, scope, n)
    d = apply_overrides(recipe.model_dump(mode="json"), ov)
    kept = sorted(set(SCOPES[scope][0](n)) - set(ov))
    msg = f"trainable scope (auto): {scope} — {SCOPES[scope][1]}\n  why: {why}"
    if scope == "head" and str(recipe.model.name).lower() in ("minilm", "all-minilm-l6-v2"):
        msg += "\n  " + encoder_hint()
    if kept:
        msg += f"\n  kept as the recipe sets them: {', '.join(kept)}"
    return load_recipe(None, d), msg
