"""Final-model audit from the Python ways in (issue 37): a ``make_private`` loop, ``DPTrainer`` and
``DPSFTTrainer`` (docs/audit_final_model.md).

The same one-run game as ``dpft audit RECIPE --final-model`` (audit/final_model.py): m canary rows,
each added to *your* training rows with probability ½ by a secret coin (stream
``audit_canary_coin`` of a fresh OS-CSPRNG key unless a reproducible seed is given), *your* loop or
trainer run once on those rows, and only the final model looked at: each canary's score is its loss
drop from the model before training to the model after,

    score_i = loss_before(c_i) − loss_after(c_i)   (nats; classifiers: the log-odds loss),

turned into ε̂ — a lower bound at the stated confidence — by the one-run estimators of
audit/estimators.py (Steinke, Nasr & Jagielski 2023; the f-DP estimator of Mahloujifar et al.
2025), next to the certified ε of that run's ledger. With ``dirac=M`` the white-box audit rides the
same run (audit/dirac.py: gradient canaries on every release, through the DP step's release hook).

* :func:`audit_final_model_make_private` — ``train(model, rows) -> PrivacyEngine`` is your own
  loop (``make_private`` + your epochs); ``loss(model, batch) -> (B,)`` scores collated canary rows
  (:func:`log_odds` for a classifier's logits).
* :func:`audit_final_model_trainer` — ``make_trainer(train_dataset) -> DPTrainer | DPSFTTrainer``
  builds your trainer on the dataset it is given; canaries of random (or, for a causal LM, rare)
  tokens are made from your tokenizer in your dataset's format (tokenised rows, or TRL's ``text``
  rows).

What it is and is not: the audited model is trained with the canaries, so it is a sibling of the
model you ship (same code, N larger by the included canaries), and ε̂ is a lower bound — a value
above the certified ε shows a bug; a small one does not show the ε is tight. One process only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from dpft.audit.dirac import dirac_canaries
from dpft.audit.estimators import gaussian_events
from dpft.audit.final_model import (FINAL_MODEL_PLANTED, MAX_CANARY_TOKENS, CanarySet, audit_record, audit_summary,
                                    canary_losses, log_odds_loss, rows_once_per_batch, token_canaries)
from dpft.audit.planted import plant
from dpft.integrations.hf.card import trainer_report
from dpft.models.losses import causal_lm_loss, classification_loss
from dpft.privacy.randomness import Randomness
from dpft.outputs.card import build_card

__all__ = ["audit_final_model_make_private", "audit_final_model_trainer", "log_odds", "add_rows", "audit_line",
           "write_audited_card"]


def log_odds(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float64 log-odds loss −log(p_y/(1−p_y)) of ``(B, C)`` logits and ``(B,)`` int labels
    (nats; the classifier canary score of audit/final_model.py ``log_odds_loss``, which does not
    saturate in float32 as −log p_y does)."""
    batch = {"labels": labels.long()}
    return log_odds_loss(lambda **_: logits, batch)


def add_rows(rows: Any, extra: Sequence[Any]) -> Any:
    """``rows`` with ``extra`` appended, in ``rows``' kind: a list (or tuple), a
    ``datasets.Dataset`` (``extra`` as dicts of its columns) or a map-style torch ``Dataset``.

    Raises:
        TypeError: an iterable-style dataset (no fixed N to add rows to)."""
    extra = list(extra)
    if isinstance(rows, (list, tuple)):
        return list(rows) + extra
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(rows, datasets.Dataset):
        if not extra:
            return rows
        return datasets.concatenate_datasets([rows, datasets.Dataset.from_list(extra, features=rows.features)])
    if isinstance(rows, torch.utils.data.IterableDataset) or not hasattr(rows, "__len__"):
        raise TypeError("the audit adds canary rows to a map-style dataset (a list, datasets.Dataset or a torch "
                        "Dataset with __len__ and __getitem__); materialise an iterable dataset first")
    return torch.utils.data.ConcatDataset([rows, _ListDataset(extra)])


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _check(m: int, confidence: float, planted: Optional[str]) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("the final-model audit runs in one process: launch it without torchrun")
    if m < 20:
        raise ValueError(f"{m} canaries: use at least 20 (hundreds for a useful bound)")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence {confidence}: give a level in [0.5, 1), e.g. 0.95")
    if planted is not None and planted not in FINAL_MODEL_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; one of {list(FINAL_MODEL_PLANTED)}")


def _coins(rng: Randomness, design: str, m: int) -> torch.Tensor:
    return rng.stream("audit_canary_coin", design).bernoulli((m,), 0.5)


def _epsilon(ledger, delta: float) -> Optional[float]:
    """ε(δ) of a ledger (None for no ledger: a non-private run; ∞ for σ = 0)."""
    if ledger is None:
        return None
    if not getattr(ledger, "certified", True):
        raise ValueError("the run's ledger is NOT CERTIFIED: there is no certified ε to audit against")
    return float(ledger.epsilon(delta).epsilon) if len(ledger.events()) else 0.0


def audit_line(audit: dict) -> str:
    """One line: the headline ε̂ (Steinke et al., valid for any mechanism), the f-DP ε̂ assuming a
    Gaussian trade-off curve, next to the certified ε of the audited run, and the verdict."""
    h, eps = audit["headline"], audit["certified_epsilon"]
    cert = "not private" if eps is None else f"certified ε = {eps:.3g}"
    wb = audit.get("whitebox")
    g = (h.get("gaussian") or {}).get("epsilon_hat")
    gauss = f"; assuming a Gaussian trade-off curve (f-DP): ε̂ ≥ {g:.3g}" if g is not None else ""
    white = (f"; white-box ε̂ ≥ {wb['bounds']['steinke']['epsilon']:.3g} (f-DP, Gaussian curve: "
             f"{wb['bounds']['fdp']['epsilon']:.3g}; {wb['m']} Dirac canaries)" if wb else "")
    return (f"{audit['way_in']}: ε̂ ≥ {h['epsilon_hat']:.3g} at {h['confidence']:.0%} confidence by a final-model "
            f"audit with m = {h['m']} {h['design']} canaries (black-box, Steinke et al., valid for any mechanism)"
            f"{gauss}{white}; verdict {'FAIL' if audit.get('violation') else 'pass'}; {cert} at "
            f"δ = {audit['delta']:g}")


def audit_final_model_make_private(train: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module, rows: Any,
                       canaries: Sequence[Any], loss: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                       delta: float, collate_fn: Optional[Callable] = None, confidence: float = 0.95,
                       dirac: int = 0, design: str = "yours", reproducible_seed: Optional[int] = None,
                       planted: Optional[str] = None, batch_size: int = 64) -> dict:
    """Audit the final model of your own ``make_private`` loop (module docstring).

    Args:
        train: ``train(model, rows) -> engine``: your loop, run once. It gets ``model`` (trained in
            place) and your rows with the included canaries appended (``rows``' kind, see
            :func:`add_rows`), calls ``PrivacyEngine().make_private(...)`` on them and trains;
            returns the ``PrivacyEngine`` (or its ``PrivacyLedger``; None for a non-private loop).
        model: the model before training (its canary losses are the reference).
        rows: your training rows; canaries: m ≥ 20 canary rows in the same format, distinct from
            ``rows`` (e.g. random tokens with a random label, :func:`~dpft.audit.final_model.token_canaries`).
        loss: ``loss(model, batch) -> (B,)`` per-row loss in nats of a collated batch of canaries,
            called under ``torch.no_grad`` in eval mode (a classifier: ``log_odds(model(x), y)``).
        delta: δ of the certified ε and of every ε̂.
        collate_fn: batches canary rows for ``loss`` (default torch's ``default_collate``).
        dirac: white-box Dirac canaries on every release of the same run (0: none).
        reproducible_seed: coins (and Dirac canaries) from this seed — tests only: the coins
            must be secret from whatever trains.
        planted: a name of :data:`~dpft.audit.final_model.FINAL_MODEL_PLANTED` (auditor self-test).

    Returns:
        The audit dict of audit/final_model.py ``audit_record`` (``way_in`` ``make_private``): certified
        ε, δ, per design the scores and ε̂ of both estimators, the headline, the white-box result.

    Raises:
        ValueError: fewer than 20 canaries, a bad confidence or planted name, several processes,
        a NOT CERTIFIED ledger, ``loss`` returning another shape; TypeError: ``train`` returned
        neither an engine, a ledger nor None."""
    canaries = list(canaries)
    m = len(canaries)
    _check(m, confidence, planted)
    rng = Randomness(reproducible_seed)
    t0 = time.perf_counter()
    s = CanarySet(design=design, rows=canaries, included=_coins(rng, design, m))
    collate = collate_fn or torch.utils.data.default_collate

    @torch.no_grad()
    def score() -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            out = [loss(model, collate(canaries[i:i + batch_size])).detach().double().cpu().reshape(-1)
                   for i in range(0, m, batch_size)]
        finally:
            model.train(was)
        res = torch.cat(out)
        if res.shape != (m,):
            raise ValueError(f"loss(model, batch) must return one loss per row ((B,)); got {tuple(res.shape)} for "
                             f"{m} canaries")
        return res

    s.ref_loss = score()
    train_rows = add_rows(rows, [c for c, inc in zip(canaries, s.included.tolist()) if inc])
    white = dirac_canaries(dirac, rng) if dirac else contextlib.nullcontext()
    with plant(planted), white as wb:
        got = train(model, train_rows)
    s.final_loss = score()
    ledger = getattr(got, "ledger", got)
    if ledger is not None and not hasattr(ledger, "epsilon"):
        raise TypeError("train(model, rows) must return the PrivacyEngine it used (or its ledger, or None for a "
                        f"non-private loop); got {type(got).__name__}")
    eps = _epsilon(ledger, delta)
    sigma = getattr(got, "noise_multiplier", None)
    steps = getattr(ledger, "steps", None)
    return audit_record(recipe="make_private loop", planted=planted, private=ledger is not None,
                        certified_epsilon=eps, delta=float(delta), confidence=confidence, n=len(train_rows),
                        steps=steps, sigma=sigma, sets=[s], dirac=wb, seconds=time.perf_counter() - t0,
                        way_in="make_private", gaussian=ledger is not None and gaussian_events(ledger.events()))


# ----------------------------------------------------------------------------- DPTrainer / DPSFTTrainer


def _dataset_kind(ds) -> str:
    cols = set(getattr(ds, "column_names", None) or [])
    if "input_ids" in cols:
        return "tokenised"
    if "text" in cols:
        return "text"
    raise ValueError(f"audit_final_model_trainer makes canaries for tokenised rows (an `input_ids` column) or "
                     f"TRL's language-modeling rows (a `text` column); this dataset has {sorted(cols)}: map it to "
                     "one of these first (e.g. tokenize it, or render prompt/completion or messages as text)")


def _label_column(ds) -> Optional[str]:
    cols = set(ds.column_names)
    for c in ("label", "labels"):
        if c in cols:
            feat = ds.features[c]
            if getattr(feat, "dtype", "").startswith("int") or type(feat).__name__ == "ClassLabel":
                return c
    return None


def _as_dataset_row(core: dict, ds, tokenizer, kind: str, label_col: Optional[str]) -> dict:
    """A canary (``{"input_ids", "label"?}``) in the columns of ``ds``."""
    if kind == "text":
        text = tokenizer.decode(core["input_ids"], skip_special_tokens=True)
        row = {c: ("" if getattr(ds.features[c], "dtype", "") == "string" else None) for c in ds.column_names}
        row["text"] = text
        return row
    ids = list(core["input_ids"])
    row = {}
    for c in ds.column_names:
        if c == "input_ids":
            row[c] = ids
        elif c == "attention_mask":
            row[c] = [1] * len(ids)
        elif c == "token_type_ids":
            row[c] = [0] * len(ids)
        elif c == label_col:
            row[c] = int(core["label"])
        elif c == "labels":  # per-token targets of a causal LM: every canary token
            row[c] = list(ids)
        else:
            dtype = getattr(ds.features[c], "dtype", None)
            row[c] = "" if dtype in ("string", "large_string") else 0 if dtype and "int" in dtype else None
    return row


def _score_rows(core: list[dict], tokenizer, kind: str) -> list[dict]:
    """Canaries as dpft-collated scoring rows: a text canary re-tokenised as the trainer sees it."""
    if kind != "text":
        return [dict(c) for c in core]
    out = []
    for c in core:
        text = tokenizer.decode(c["input_ids"], skip_special_tokens=True)
        out.append({"input_ids": list(tokenizer(text)["input_ids"])})
    return out


def audit_final_model_trainer(make_trainer: Callable[[Any], Any], train_dataset, *, tokenizer, m: int = 200,
                  design: Optional[str] = None, confidence: float = 0.95, dirac: int = 0,
                  reproducible_seed: Optional[int] = None, planted: Optional[str] = None,
                  canary_length: int = MAX_CANARY_TOKENS, output_dir: Optional[str | Path] = None) -> dict:
    """Audit the final model of a :class:`~dpft.integrations.hf.trainer.DPTrainer` (or ``DPSFTTrainer``) run.

    Args:
        make_trainer: ``make_trainer(train_dataset) -> trainer``: builds your trainer, not yet
            trained, on the dataset it is given (your rows + the included canaries).
        train_dataset: your ``datasets.Dataset``: tokenised rows (``input_ids`` [+ ``attention_mask``,
            ``label``/``labels``]) or TRL's ``text`` rows.
        tokenizer: the tokenizer of the model (canary tokens, [CLS]/[SEP] or BOS).
        m: canaries (≥ 20); design: ``random`` (default for classifiers) or ``rare`` (default for
            causal LMs: tokens from the least frequent quarter of the vocabulary in your rows;
            Panda et al. 2025).
        canary_length: tokens per canary, specials included.
        dirac: white-box Dirac canaries on every release of the same run (0: none).
        output_dir: where to write ``final_model_audit.json``, the trained model and its card with
            the audited line (:func:`write_audited_card`); None: nothing is written by the audit.
        confidence, reproducible_seed, planted: as :func:`audit_final_model_make_private`.

    Returns:
        The audit dict (``way_in`` the trainer's class name), as :func:`audit_final_model_make_private`.

    Raises:
        ValueError: the checks of :func:`audit_final_model_make_private`; a dataset format without a
        canary maker (the message names the fix); a user-level trainer (a canary would have to be a user);
        a classifier dataset without an integer label column."""
    _check(m, confidence, planted)
    kind = _dataset_kind(train_dataset)
    label_col = _label_column(train_dataset) if kind == "tokenised" else None
    causal = label_col is None
    design = design or ("rare" if causal else "random")
    rng = Randomness(reproducible_seed)
    t0 = time.perf_counter()
    train_ids = None
    if design == "rare":
        train_ids = (train_dataset["input_ids"] if kind == "tokenised"
                     else [tokenizer(t)["input_ids"] for t in train_dataset["text"]])
    num_labels = 1
    if not causal:
        feat = train_dataset.features[label_col]
        num_labels = int(getattr(feat, "num_classes", 0) or (max(train_dataset[label_col]) + 1))
    core = token_canaries(design, m, tokenizer, rng.stream("audit_canary", design), causal=causal,
                          length=max(4, int(canary_length)), num_labels=num_labels, train_ids=train_ids)
    s = CanarySet(design=design, rows=_score_rows(core, tokenizer, kind), included=_coins(rng, design, m))
    added = [_as_dataset_row(c, train_dataset, tokenizer, kind, label_col)
             for c, inc in zip(core, s.included.tolist()) if inc]
    white = dirac_canaries(dirac, rng) if dirac else contextlib.nullcontext()
    with plant(planted), white as wb:
        trainer = make_trainer(add_rows(train_dataset, added))
        if getattr(trainer, "user_level", False):
            raise ValueError("the final-model audit is example-level: this trainer's dp_args.user_column is set "
                             "(a canary would have to be a whole user)")
        model = trainer.model
        device = next(model.parameters()).device
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        loss_fn = causal_lm_loss if causal else classification_loss  # classifiers: scored by log-odds

        def score() -> torch.Tensor:
            return canary_losses(trainer.model, loss_fn, s.rows, pad, with_token_types=False, device=device)

        s.ref_loss = score()
        trainer.train()
        batches_ok = rows_once_per_batch(trainer.dp_step, trainer.total_steps)
    s.final_loss = score()
    audit = audit_record(recipe=type(trainer).__name__, planted=planted, private=True,
                         certified_epsilon=_epsilon(trainer.ledger, trainer.dp_args.target_delta),
                         delta=float(trainer.dp_args.target_delta), confidence=confidence, n=int(trainer.n),
                         steps=int(trainer.total_steps), sigma=trainer.sigma, sets=[s], dirac=wb,
                         seconds=time.perf_counter() - t0, way_in=type(trainer).__name__, batches_ok=batches_ok,
                         gaussian=gaussian_events(trainer.ledger.events()))
    if output_dir is not None:
        out = Path(output_dir)
        trainer.save_model(str(out))
        write_audited_card(trainer, audit, out)
        (out / "final_model_audit.json").write_text(json.dumps(audit, indent=2))
    return audit


def write_audited_card(trainer, audit: dict, directory: str | Path) -> Path:
    """Write the trainer's model card (integrations/hf/card.py) with the audited line "Audited: ε̂ ≥ x
    at 95 % confidence by a final-model audit with m canaries …" beside the certified ε, to
    ``directory/README.md``; returns its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rep = trainer_report(trainer)
    rep["final_model_audit"] = audit_summary(audit, same_run=True)
    path = d / "README.md"
    build_card(rep, d).save(path)
    return path
