"""DP-SelFT recipe (Sha et al., "DP-SelFT: Differentially Private Selective Fine-Tuning for
Large Language Models"; Algorithm 1). Wires existing pieces, holds no math of its own:

1. candidate pool (``synth/generators.py``; free) → DP select-and-label
   (``synth/select_label.py``; two Gaussian releases, ε_syn, recorded in the run's ledger);
2. unit scoring on the synthetic train/validation split (``selection/scoring.py``; free:
   synthetic data only) → top-k units (or a baseline selector);
3. DP-AdamW on the selected units only (``trainable.mode: units``), a training phase the
   driver runs (its phase runner, methods/base.py ``PhaseRunner``), σ calibrated *after* the
   synthetic-data events (PLD composition of both phases to the run's target ε; never ε's
   added by hand). Both phases append to the one ledger.

Selectors: ``selft`` (worst-case ξ, the paper), ``random_noise`` (clipping + random noise),
``no_noise`` (clean temporary training), ``loss`` (lowest synthetic val loss after clean
training), ``gradient`` (largest clipped-gradient norm per √d), ``attention`` (heuristic:
every block's attention, no scoring).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from dpft.accounting.calibrate import calibrate_sigma, check_delta
from dpft.accounting.io import atomic_write_text
from dpft.accounting.ledger import PrivacyLedger
from dpft.data.tasks import load_task
from dpft.data.tokenize import tokenize_split
from dpft.models.load import load_classifier, set_dropout
from dpft.models.units import attention_units, unit_map
from dpft.selection.scoring import ScoreCache, ScoreSettings, rank_units, score_units
from dpft.synth.generators import load_candidate_file
from dpft.synth.select_label import dp_select_and_label
from dpft.methods.base import PhaseRunner, phase_runner
from dpft.placement.device import resolve_device
from dpft.privacy.randomness import Randomness

SELECTORS = ("selft", "random_noise", "no_noise", "loss", "gradient", "attention")


class SelFTCfg(BaseModel):
    """Settings of the DP-SelFT stages (defaults: paper's Appendix B where it gives one)."""

    model_config = ConfigDict(extra="forbid")
    #: ε of the select-and-label releases (paper default 0.3), at the run's δ.
    epsilon_syn: float = Field(0.3, gt=0)
    candidates_file: Optional[str] = None
    candidates_column: str = "text"
    #: candidates kept by noisy votes (default: min(pool size, N)).
    n_select: Optional[int] = Field(None, ge=2)
    label_ratio: float = Field(1.0, gt=0)
    val_fraction: float = Field(0.3, gt=0, lt=1)
    encoder: str = "minilm"
    selector: Literal["selft", "random_noise", "no_noise", "loss", "gradient", "attention"] = "selft"
    granularity: Literal["block", "linear"] = "block"
    #: number of units kept (paper: 15 of RoBERTa-large's units).
    top_k: int = Field(3, ge=1)
    #: the (new) classification head trains in every scored subset and in the final run.
    with_head: bool = True
    #: ``eq21``: the paper's scorer (head warm-up without ξ, then one SGD step on Λ with ξ on Λ
    #: only; selection/scoring.py). ``adamw``: the pre-issue-18 scorer, for comparison only.
    score_update: Literal["eq21", "adamw"] = "eq21"
    #: ``eq21``: AdamW steps of the shared head's warm-up on the synthetic train split.
    head_warmup_steps: int = Field(50, ge=0)
    #: ``adamw`` only: temporary-training steps per unit.
    score_steps: int = Field(30, ge=1)
    score_batch_size: int = Field(32, ge=1)
    #: temporary-training learning rate (default: the recipe's optimizer.lr).
    score_lr: Optional[float] = Field(None, gt=0)
    #: DP-SelFT+LoRA: LoRA (recipe's trainable.lora) on the selected units only.
    lora: bool = False
    cache_dir: Optional[str] = None


def _score_settings(cfg: SelFTCfg, recipe: Any, sigma: float) -> ScoreSettings:
    pert = {"selft": "worst", "random_noise": "random"}.get(cfg.selector, "none")
    return ScoreSettings(
        perturbation=pert, update=cfg.score_update, head_warmup_steps=cfg.head_warmup_steps, steps=cfg.score_steps, batch_size=cfg.score_batch_size,
        lr=cfg.score_lr or recipe.optimizer.lr, clip_norm=recipe.privacy.clipping.max_norm, sigma=sigma,
        downstream_batch=recipe.batch.expected_batch_size, with_head=cfg.with_head,
        clip=cfg.selector not in ("no_noise", "loss"), max_length=recipe.model.max_length, seed=recipe.seed,
        clip_style=recipe.privacy.clipping.style, head_fraction=recipe.privacy.clipping.head_fraction,
        head_lr=None if cfg.score_lr else recipe.optimizer.head_lr)


def select_units(recipe: Any, cfg: SelFTCfg, candidates: Optional[list[str]] = None,
                 log=print, rng=None) -> dict[str, Any]:
    """Stages 1–2: DP select-and-label, then unit scoring and top-k.

    Returns a dict with ``units`` (selected, best first), ``ledger`` (the synthetic phase),
    ``sigma`` (downstream σ used for ρ_Λ), ``scores`` and synthetic-data sizes.

    Raises:
        ValueError: no candidates; CalibrationError: ε_syn leaves nothing for training.
    """
    r = recipe
    if not r.privacy.enabled:
        raise ValueError("DP-SelFT is a private method: set privacy.enabled (and target_epsilon, the total budget)")
    if cfg.selector == "attention":
        # The heuristic needs no synthetic data: it spends none of the budget on it.
        return _attention_selection(r, log)
    if candidates is None:
        if not cfg.candidates_file:
            raise ValueError("DP-SelFT needs candidates: set selft.candidates_file or pass a generated pool")
        candidates = load_candidate_file(cfg.candidates_file, cfg.candidates_column)
    task = load_task(r.task, seed=r.seed)
    n = len(task.train)
    check_delta(r.privacy.delta, n)
    if task.has_pair:
        raise ValueError("this DP-SelFT implementation scores single-text tasks; pair tasks need pair candidates")
    t0 = time.time()
    device = _device(r)
    ledger = PrivacyLedger()
    n_select = min(cfg.n_select or n, len(candidates))
    syn = dp_select_and_label(list(task.train["text"]), list(task.train["label"]), list(candidates), task.num_labels,
                              cfg.epsilon_syn, r.privacy.delta, n_select, ledger=ledger,
                              label_ratio=cfg.label_ratio, val_fraction=cfg.val_fraction, seed=r.seed,
                              rng=rng, encoder=cfg.encoder, device=device)
    log(f"select-and-label: {len(candidates)} candidates → {n_select} kept "
        f"({len(syn.train)} train / {len(syn.val)} val), σ_sel={syn.sigma_select:.3g}, σ_lab={syn.sigma_label:.3g}, "
        f"ε_syn={ledger.epsilon(r.privacy.delta).epsilon:.4g} ({time.time() - t0:.0f}s)")
    sigma = _training_sigma(r, n, ledger)
    # The model the final run trains (pooling, dropout), so each unit is scored on it.
    tok, model = load_classifier(r.model.name, task.num_labels, seed=r.seed,
                                 pooling=r.model.pooling, head_dropout=r.model.head_dropout)
    if r.model.dropout is not None:
        set_dropout(model, r.model.dropout)
    model.to(device)  # scoring runs where fine-tuning will (perf.device)
    with_tt = "token_type_ids" in tok.model_input_names
    import datasets

    def rows(pairs):
        ds = datasets.Dataset.from_dict({"text": [t for t, _ in pairs], "label": [y for _, y in pairs]})
        return list(tokenize_split(ds, tok, r.model.max_length))

    scores: dict[str, Any] = {}
    if cfg.selector == "attention":
        units = attention_units(model)
    else:
        s = _score_settings(cfg, r, sigma)
        cache = ScoreCache(cfg.cache_dir) if cfg.cache_dir else None
        t1 = time.time()
        # With the head in every subset, "head" alone is the baseline every unit adds to: not a candidate.
        exclude = ["head"] if cfg.with_head else []
        cand_units = [u for u in unit_map(model, cfg.granularity) if u not in exclude]
        sc = score_units(model, rows(syn.train), rows(syn.val), s, cfg.granularity, units=cand_units, cache=cache,
                         model_name=r.model.name, data_digest=syn.digest(), pad_id=tok.pad_token_id or 0,
                         with_token_types=with_tt, log=lambda m: log("  score " + m))
        log(f"scored {len(sc)} units in {time.time() - t1:.0f}s")
        crit = {"loss": "loss", "gradient": "gradient"}.get(cfg.selector, "accuracy")
        units = rank_units(sc, cfg.top_k, crit, exclude=exclude)
        scores = {u: {"accuracy": v.accuracy, "val_loss": v.val_loss, "dim": v.dim, "rho": v.rho,
                      "grad_norm": v.grad_norm} for u, v in sc.items()}
    return {"units": units, "ledger": ledger, "sigma": sigma, "scores": scores,
            "synthetic": {"spent": True, "n_candidates": len(candidates), "n_select": n_select, "train": len(syn.train),
                          "val": len(syn.val), "sigma_select": syn.sigma_select, "sigma_label": syn.sigma_label,
                          "digest": syn.digest(),
                          "label_counts": [sum(1 for _, y in syn.train + syn.val if y == c)
                                           for c in range(task.num_labels)]}}


def _device(r: Any):
    """The recipe's ``perf.device`` (checked against this machine): the encoder of
    select-and-label and the unit scorer run there, as the fine-tuning phase does."""
    return resolve_device(r.perf.device)


#: Why DP-SelFT runs in one process (the CLI's and :func:`run_selft`'s refusal under torchrun).
DDP_REFUSAL = ("DP-SelFT's select-and-label is one Gaussian release of two histograms over ALL N private "
               "examples (each example's nearest-candidate vote and its label, Sha et al. Eq. 6-8), added once "
               "by the one process that holds every example's embedding, and the unit scoring that follows is "
               "sequential temporary training on its output; the selection is not split across ranks (nor run "
               "on rank 0 and broadcast: not wired). Run `dpft selft` in one process (without torchrun)")


def _training_sigma(r: Any, n: int, prior: PrivacyLedger) -> float:
    """σ of the fine-tuning phase: the recipe's fixed σ, or calibrated so that ``prior``'s events
    and the training steps compose (PLD) to the target ε — what the trainer will use."""
    if r.privacy.noise_multiplier is not None:  # fixed σ: the ledger then reports the composed ε
        return float(r.privacy.noise_multiplier)
    q = r.batch.expected_batch_size / n
    steps = r.schedule.steps or max(1, int(-(-r.schedule.epochs * n // r.batch.expected_batch_size)))
    return calibrate_sigma(r.privacy.target_epsilon, r.privacy.delta, q, steps, prior=prior.events())


def _attention_selection(r: Any, log) -> dict[str, Any]:
    """The heuristic baseline (every block's attention): no synthetic phase, the whole target ε
    goes to fine-tuning."""
    task = load_task(r.task, seed=r.seed)
    n = len(task.train)
    check_delta(r.privacy.delta, n)
    sigma = _training_sigma(r, n, PrivacyLedger())
    _, model = load_classifier(r.model.name, task.num_labels, seed=r.seed, pooling=r.model.pooling)
    units = attention_units(model)
    log(f"heuristic selection (no synthetic data, ε_syn = 0): {units}")
    return {"units": units, "ledger": PrivacyLedger(), "sigma": sigma, "scores": {},
            "synthetic": {"n_candidates": 0, "n_select": 0, "train": 0, "val": 0, "spent": False}}


def run_selft(recipe: Any, cfg: SelFTCfg, run_dir: str | Path, candidates: Optional[list[str]] = None,
              progress: bool = True, log=print, train_phase: Optional[PhaseRunner] = None) -> dict[str, Any]:
    """Algorithm 1 end to end, as two phases on one ledger: selection (:func:`select_units`),
    then fine-tuning of the selected units through the driver's phase runner ``train_phase``
    (``dpft.run.loop.train_phase``, which the CLI hands; default: the one the driver registered,
    :func:`~dpft.methods.base.phase_runner`). Writes the usual run report plus a
    ``selft`` section.

    Raises:
        the errors of :func:`select_units` and of the driver (``TrainingError``…).
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ValueError(DDP_REFUSAL)
    train_phase = train_phase or phase_runner()  # before the selection: no runner is refused at once
    # One secret source for the whole run: the histograms (stream synth) and training.
    rng = Randomness(recipe.seed if recipe.privacy.reproducible else None)
    sel = select_units(recipe, cfg, candidates, log=log, rng=rng)
    tr = recipe.trainable.model_copy(update={"mode": "units", "units": list(sel["units"]),
                                             "units_with_head": cfg.with_head, "units_lora": cfg.lora})
    r2 = recipe.model_copy(update={"trainable": tr})
    log(f"selected units ({cfg.selector}): {sel['units']}")
    # The fine-tuning phase continues the selection ledger (appends; NOT CERTIFIED marks survive).
    trainer = train_phase(r2, run_dir, progress=progress, ledger=sel["ledger"], rng=rng)
    if abs(trainer.sigma - sel["sigma"]) > 1e-9 * max(1.0, sel["sigma"]):
        raise RuntimeError("σ of the training phase differs from the σ used for ρ_Λ; report this as a bug")
    rep = trainer.run()
    rep["selft"] = {"config": cfg.model_dump(), "selected_units": sel["units"], "scores": sel["scores"],
                    "synthetic": sel["synthetic"], "sigma_train": trainer.sigma}
    atomic_write_text(Path(run_dir) / "report.json", json.dumps(rep, indent=1))
    return rep
