"""Final-model privacy audit in one run (issue 37): ``dpft audit RECIPE --final-model``.

The recipe is trained once, through ``dpft train``'s own driver (:class:`~dpft.run.loop.Trainer`:
its plan, sampler, clip policy, engine, σ, ledger, report and model card), with m canary rows
added to its training data, each included with probability ½ by a secret coin drawn from the
run's randomness (stream ``audit_canary_coin``; the OS CSPRNG unless the recipe is
reproducible). Only the *final* model is then looked at (black-box): each canary's score is how
much its loss dropped from the reference (the model as the driver built it, before the first
step) to the released model,

    score_i = loss_ref(c_i) − loss_final(c_i)   (nats; classifier: the log-odds loss
                                                 −log(p/(1−p)) of the canary's label, LM: summed
                                                 next-token loss),

and the one-run estimators of :mod:`dpft.audit.estimators` (Steinke, Nasr & Jagielski 2023;
f-DP of Mahloujifar et al. 2025) turn the scores of included and excluded canaries into ε̂, a
lower bound at the stated confidence (95 % by default).

Canary designs (:data:`DESIGNS`), each its own m canaries and coins in the same run:

* classifiers — ``random``: random vocabulary tokens with a random label (out of distribution:
  their gradients barely meet the data's); ``mislabel``: dev rows with a wrong label.
* causal LMs (Panda et al. 2025, "Privacy auditing of large language models": canaries made of
  rare tokens are far easier to detect than random ones) — ``rare``: tokens drawn from the
  quarter of the vocabulary least frequent in the training rows; ``random``: uniform tokens.

What this audit is and is not: the audited model is trained with the canaries, so it is a
sibling of the model a user ships (same recipe, same code, N larger by the included canaries),
not that model itself. The count of included canaries changes N and so q = B/N by ±O(√m)/N for
every canary at once, a dependence the one-run analysis ignores (negligible for N ≫ m). A
method whose earlier private phase runs in ``Method.prepare`` (e.g. DP-SFT's stage 1) has
trained on the canaries before the reference is scored: ε̂ then bounds the whole ledger, which
is what the certified ε covers. User-level recipes and multi-process worlds are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from dpft.audit.dirac import dirac_canaries
from dpft.audit.estimators import GAUSSIAN_ASSUMPTION, METHODS, epsilon_lower_bound, gaussian_events
from dpft.audit.planted import plant
from dpft.data.prepare import is_causal
from dpft.data.tokenize import collate
from dpft.models.losses import classification_loss, model_inputs
from dpft.privacy.randomness import Randomness
from dpft.outputs.report import AUDIT_MEANING, render_markdown
from dpft.outputs.card import write_model_cards
from dpft.run.loop import Trainer

__all__ = ["DESIGNS", "CanarySet", "default_designs", "make_canary_rows", "canary_losses",
           "canary_rows_hook", "token_canaries", "log_odds_loss", "rows_once_per_batch", "audit_final_model",
           "attach_audit", "FINAL_MODEL_PLANTED"]

#: Canary designs by model kind (see the module docstring).
DESIGNS = {"classifier": ("random", "mislabel"), "causal": ("rare", "random")}
#: Planted bugs the final-model audit is calibrated on (audit/planted.py names).
FINAL_MODEL_PLANTED = ("noise/4", "clipping off", "counted twice")
#: Longest canary (tokens, specials included): long enough to be unique, short enough for CPU.
MAX_CANARY_TOKENS = 24


@dataclasses.dataclass
class CanarySet:
    """One design's canaries in one run.

    Attributes:
        design: a name from :data:`DESIGNS`.
        rows: m tokenised rows in the training rows' columns (``input_ids`` …).
        included: ``(m,)`` bool, the secret coins (True: in the training data).
        ref_loss, final_loss: ``(m,)`` float nats under the reference and the final model.
    """

    design: str
    rows: list[dict]
    included: torch.Tensor
    ref_loss: Optional[torch.Tensor] = None
    final_loss: Optional[torch.Tensor] = None

    @property
    def scores(self) -> torch.Tensor:
        """``(m,)`` loss drop ref − final (nats): higher = more likely included."""
        return self.ref_loss - self.final_loss


def default_designs(recipe) -> list[str]:
    """The design a recipe is audited with by default: ``rare`` for causal LMs (the stronger of the
    two on stories260K, benchmarks/results/final_model_audit.md), ``random`` for classifiers (its
    tokens are unused by the data, so its gradient meets little else; not yet compared with
    ``mislabel`` on a real classifier)."""
    return ["rare"] if is_causal(recipe) else ["random"]


def _check_designs(recipe, designs: Sequence[str]) -> None:
    kind = "causal" if is_causal(recipe) else "classifier"
    bad = [d for d in designs if d not in DESIGNS[kind]]
    if bad or not designs or len(set(designs)) != len(designs):
        raise ValueError(f"canary design(s) {list(designs)} for a {kind} recipe: give distinct ones of "
                         f"{list(DESIGNS[kind])}")


def _special_ids(tokenizer) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


def _vocab_pool(tokenizer, train_tok, design: str) -> torch.Tensor:
    """Token ids a canary draws from: every non-special id (``random``), or the quarter least
    frequent in the training rows (``rare``; ties broken by id)."""
    n = len(tokenizer)
    special = _special_ids(tokenizer)
    ids = torch.tensor([i for i in range(n) if i not in special], dtype=torch.long)
    if design != "rare":
        return ids
    counts = torch.zeros(n, dtype=torch.long)
    for row in train_tok["input_ids"]:
        counts += torch.bincount(torch.as_tensor(row, dtype=torch.long).clamp(0, n - 1), minlength=n)[:n]
    order = torch.argsort(counts[ids] * n + ids, stable=True)  # rarest first, then by id
    return ids[order[:max(8, len(ids) // 4)]]


def _special_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (BERT: [CLS] … [SEP])."""
    full = tokenizer("x")["input_ids"]
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return list(full[:i]), list(full[i + len(bare):])
    return [], []


def _row_like(train_tok, values: dict) -> dict:
    """A row with every column of ``train_tok``: ``values`` where given, else an empty value of
    the column's type (a canary has no text, user or other field)."""
    out = {}
    for name, feat in train_tok.features.items():
        if name in values:
            out[name] = values[name]
        else:
            dtype = getattr(feat, "dtype", None)
            out[name] = "" if dtype in ("string", "large_string") else 0 if dtype and "int" in dtype else None
    return out


def token_canaries(design: str, m: int, tokenizer, stream, *, causal: bool, length: int, num_labels: int = 1,
                   train_ids: Optional[Iterable[Sequence[int]]] = None) -> list[dict]:
    """m token canaries of ``design`` (``random`` or ``rare``), the content of every way in's canaries.

    Args:
        tokenizer: a Hugging Face tokenizer (its vocabulary, special ids and BOS / [CLS] … [SEP]).
        stream: a :class:`~dpft.privacy.randomness.SecretStream` for the canaries' content.
        causal: causal-LM canaries (BOS + tokens) or classifier ones ([CLS] tokens [SEP] + a label).
        length: tokens per canary, specials included (≥ 4).
        num_labels: classifier labels (each canary gets a uniform one).
        train_ids: the training rows' token ids (``rare``: the least frequent quarter of the vocabulary).

    Returns:
        ``[{"input_ids": [...]}]`` (causal) or ``[{"input_ids": [...], "label": int}]``.

    Raises:
        ValueError: an unknown design, or ``rare`` without ``train_ids``."""
    if design not in ("random", "rare"):
        raise ValueError(f"token canary design {design!r}: use 'random' or 'rare'")
    if design == "rare" and train_ids is None:
        raise ValueError("rare canaries need the training rows' token ids (train_ids)")
    pool = _vocab_pool(tokenizer, {"input_ids": list(train_ids or [])}, design)
    bos = getattr(tokenizer, "bos_token_id", None)
    pre, post = ([], []) if causal else _special_frame(tokenizer)
    body_len = max(1, length - (1 if causal and bos is not None else len(pre) + len(post)))
    body = pool[stream.randint(len(pool), (m, body_len))]
    labels = stream.randint(max(1, num_labels if not causal else 1), (m,))
    rows = []
    for j in range(m):
        toks = body[j].tolist()
        if causal:
            rows.append({"input_ids": ([bos] if bos is not None else []) + toks})
        else:
            rows.append({"input_ids": pre + toks + post, "label": int(labels[j])})
    return rows


def make_canary_rows(design: str, m: int, tokenizer, data, recipe, stream) -> list[dict]:
    """m canary rows of ``design`` in the columns of ``data.train_tok``.

    Args:
        data: the run's :class:`~dpft.data.prepare.TrainData` (its tokenised train / dev rows).
        stream: a :class:`~dpft.privacy.randomness.SecretStream` for the canaries' content.

    Raises:
        ValueError: ``mislabel`` with fewer dev rows than m, or a one-label task."""
    train_tok = data.train_tok
    length = max(4, min(recipe.model.max_length, MAX_CANARY_TOKENS))
    if design == "mislabel":
        dev = data.dev_tok
        k = data.task.num_labels
        if len(dev) < m or k < 2:
            raise ValueError(f"mislabel canaries need ≥ {m} dev rows and ≥ 2 labels (have {len(dev)}, {k}); "
                             "use --canary-design random or fewer --canaries")
        pick = stream.permutation(len(dev))[:m].tolist()
        shift = 1 + stream.randint(k - 1, (m,))
        rows = []
        for j, i in enumerate(pick):
            row = dev[int(i)]
            vals = {"input_ids": row["input_ids"], "label": (int(row["label"]) + int(shift[j])) % k}
            if "token_type_ids" in row:
                vals["token_type_ids"] = row["token_type_ids"]
            rows.append(_row_like(train_tok, vals))
        return rows
    causal = data.causal
    core = token_canaries(design, m, tokenizer, stream, causal=causal, length=length,
                          num_labels=getattr(data.task, "num_labels", 1) or 1,
                          train_ids=train_tok["input_ids"] if design == "rare" else None)
    rows = []
    for vals in core:
        if causal and "labels" in train_tok.column_names:  # instruct rows: loss on every canary token
            vals["labels"] = list(vals["input_ids"])
        if not causal and "token_type_ids" in train_tok.column_names:
            vals["token_type_ids"] = [0] * len(vals["input_ids"])
        rows.append(_row_like(train_tok, vals))
    return rows


def log_odds_loss(forward, batch) -> torch.Tensor:
    """``(B,)`` float64 log-odds loss −log(p_y/(1−p_y)) = logsumexp_{j≠y} l_j − l_y of a
    sequence-classification head (nats). Unlike −log p_y it does not saturate: once a memorised
    canary's margin passes ~16 nats, float32 cross-entropy is exactly 0, and included and excluded
    canaries the model is merely sure about tie at the top (LiRA's logit scaling, Carlini et al.
    2022, "Membership inference attacks from first principles", §4.2)."""
    out = forward(**model_inputs(batch))
    logits = (out.logits if hasattr(out, "logits") else out).double()
    y = batch["labels"]
    own = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return torch.logsumexp(others, dim=1) - own


@torch.no_grad()
def canary_losses(model, loss_fn, rows: Sequence[dict], pad_id: int, with_token_types: bool,
                  device=None, batch_size: int = 64) -> torch.Tensor:
    """``(len(rows),)`` float64 per-row losses (nats) of ``model``, eval mode, no grad: for the
    plain classification loss the log-odds loss (:func:`log_odds_loss`), otherwise the run's
    ``loss_fn`` (causal LM: summed next-token loss; a method's own loss, e.g. EW-FT's corrected
    one, as it is)."""
    fn = log_odds_loss if loss_fn is classification_loss else loss_fn
    was_training = model.training
    model.eval()
    out = []
    try:
        for s in range(0, len(rows), batch_size):
            batch = collate(list(rows[s:s + batch_size]), pad_id, with_token_types, device=device)
            out.append(fn(model, batch).detach().double().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def canary_rows_hook(designs: Sequence[str], m: int, rng: Randomness, sets: list) -> Callable:
    """The ``extra_rows`` hook of the driver's data build (run/plan.py ``build_plan``; ``Trainer(...,
    extra_rows=...)``): for each design, m canary rows of which those whose secret coin is heads are
    appended to the run's training rows; the :class:`CanarySet` s are appended to ``sets``. The
    coins come from ``rng``'s stream ``audit_canary_coin`` (never written anywhere)."""
    import datasets

    def extra_rows(recipe, data, tokenizer):
        added = []
        for d in designs:
            rows = make_canary_rows(d, m, tokenizer, data, recipe, rng.stream("audit_canary", d))
            coins = rng.stream("audit_canary_coin", d).bernoulli((m,), 0.5)
            sets.append(CanarySet(design=d, rows=rows, included=coins))
            added += [row for row, c in zip(rows, coins.tolist()) if c]
        if not added:
            return data
        extra = datasets.Dataset.from_list(added, features=data.train_tok.features)
        train_tok = datasets.concatenate_datasets([data.train_tok, extra])
        lengths = torch.tensor([len(x) for x in train_tok["input_ids"]])
        return dataclasses.replace(data, train_tok=train_tok, train_lengths=lengths)

    return extra_rows


def _check_recipe(recipe, m: int, confidence: float) -> None:
    if recipe.task.user_column:
        raise ValueError("--final-model audits example-level recipes only (task.user_column is set): a canary "
                         "would have to be a whole user")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--final-model runs in one process: launch dpft audit without torchrun")
    if recipe.task.name == "seq2seq":
        raise ValueError("--final-model has no canary design for seq2seq tasks yet; audit a classifier or "
                         "causal-LM recipe")
    if m < 20:
        raise ValueError(f"--canaries {m}: use at least 20 (hundreds for a useful bound)")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"--confidence {confidence}: give a level in [0.5, 1), e.g. 0.95")


def _weights_of_record(trainer):
    stack = contextlib.ExitStack()
    for meth in trainer.methods:  # a method's released weights (e.g. the EMA) are what ships
        stack.enter_context(meth.weights())
    return stack


def audit_final_model(recipe, out_dir: str | Path, *, m: int = 500, designs: Optional[Sequence[str]] = None,
                      confidence: float = 0.95, planted: Optional[str] = None, progress: bool = True,
                      dirac: Optional[int] = None) -> dict:
    """Train ``recipe`` once in ``out_dir`` with canaries and audit the final model (module docstring).

    Args:
        m: canaries per design; designs: names from :data:`DESIGNS` (default :func:`default_designs`).
        confidence: 1 − α of every ε̂ (each design and estimator on its own: Bonferroni over
            thresholds inside, none across designs or estimators).
        planted: a name of :data:`FINAL_MODEL_PLANTED`: the auditor's self-test (the bug is
            patched in for the whole run; the result says so).
        dirac: Dirac gradient canaries of the white-box audit on the same run (audit/dirac.py;
            None: as many as m; 0: none). Private recipes only.

    Returns:
        The audit as a dict (also written to ``out_dir/final_model_audit.json`` and attached to
        the run's report and model card): certified ε, δ, per design the scores and ε̂ of both
        estimators, the headline (first design, Steinke et al.'s estimator, valid for any mechanism;
        the f-DP one beside it, assuming a Gaussian trade-off curve), the verdict and the timing.

    Raises:
        ValueError: a recipe or option this audit refuses (the message names the fix), and the
        driver's errors (DataError, ModelError, CalibrationError, TrainingError)."""
    designs = list(designs or default_designs(recipe))
    _check_designs(recipe, designs)
    _check_recipe(recipe, m, confidence)
    if planted is not None and planted not in FINAL_MODEL_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r} for --final-model; one of {list(FINAL_MODEL_PLANTED)}")
    out_dir = Path(out_dir)
    r = recipe
    rng = Randomness(r.seed if r.privacy.reproducible else None)
    t0 = time.perf_counter()
    sets: list[CanarySet] = []
    dirac = m if dirac is None else int(dirac)
    white = dirac_canaries(dirac, rng) if dirac and r.privacy.enabled else contextlib.nullcontext()
    with plant(planted), white as wb:
        trainer = Trainer(r, out_dir, rng=rng, progress=progress, extra_rows=canary_rows_hook(designs, m, rng, sets))
        rows_of = dict(pad_id=trainer.pad_id, with_token_types=trainer.with_token_types, device=trainer.device)
        for s in sets:
            s.ref_loss = canary_losses(trainer.model, trainer.loss_fn, s.rows, **rows_of)
        report = trainer.run()
        batches_ok = rows_once_per_batch(trainer.dp_step, trainer.total_steps)
    with _weights_of_record(trainer):
        for s in sets:
            s.final_loss = canary_losses(trainer.model, trainer.loss_fn, s.rows, **rows_of)
    eps = trainer.epsilon_now() if trainer.private else None
    out = audit_record(recipe=r.name, planted=planted, private=trainer.private, certified_epsilon=eps,
                       delta=float(r.privacy.delta), confidence=confidence, n=trainer.n, steps=trainer.total_steps,
                       sigma=trainer.sigma, sets=sets, dirac=wb, seconds=time.perf_counter() - t0,
                       batches_ok=batches_ok, gaussian=trainer.private and gaussian_events(trainer.ledger.events()))
    (out_dir / "final_model_audit.json").write_text(json.dumps(out, indent=2))
    if report is not None:
        attach_audit(out_dir, out, same_run=True)
    return out


def rows_once_per_batch(step, steps: int) -> bool:
    """White-box check on the same run: no row appears twice in any of its ``steps`` logical
    batches, redrawn from the run's own secret sampling streams (``step.indices(t)``; the draw of
    step t is a function of the key and t, so these are the batches that were trained). A row
    counted twice has sensitivity 2C at that step, which no one-run ε̂ can see: it shifts the
    average canary by ~1/B (benchmarks/results/final_model_audit.md)."""
    return all(len(i) == len(torch.unique(i)) for i in (step.indices(t) for t in range(int(steps))))


def design_result(design: str, scores: torch.Tensor, included: torch.Tensor, delta: float,
                  confidence: float) -> dict:
    """One design's ε̂ (both estimators) from ``(m,)`` scores and ``(m,)`` bool coins."""
    sc, inc = scores.double(), included.bool()
    bounds = {meth: epsilon_lower_bound(sc[inc].tolist(), sc[~inc].tolist(), delta=delta, method=meth,
                                        confidence=confidence).as_dict() for meth in ("fdp", "steinke")}
    return {"design": design, "m": int(len(sc)), "included": int(inc.sum()), "bounds": bounds,
            "mean_score_in": float(sc[inc].mean()), "mean_score_out": float(sc[~inc].mean()),
            "scores_in": sc[inc].tolist(), "scores_out": sc[~inc].tolist()}


def whitebox_result(wb, delta: float, confidence: float) -> Optional[dict]:
    """The white-box Dirac audit's ε̂ (audit/dirac.py) from its state; None when nothing was
    released, or the mechanism is one it cannot score (``unsupported``)."""
    if wb is None or not wb.releases or wb.unsupported:
        return None
    inc = wb.included

    def bound(sc, meth):
        return epsilon_lower_bound(sc[inc].tolist(), sc[~inc].tolist(), delta=delta, method=meth,
                                   confidence=confidence).as_dict()

    return {"m": wb.m, "included": int(inc.sum()), "releases": wb.releases,
            "score": "log-likelihood ratio over every release (audit/dirac.py)",
            "bounds": {meth: bound(wb.scores, meth) for meth in ("fdp", "steinke")},
            # the plain sum of the canary's coordinate (Steinke et al.'s score), for comparison
            "bounds_sum": {meth: bound(wb.sums, meth)["epsilon"] for meth in ("fdp", "steinke")}}


def audit_record(*, recipe: str, planted: Optional[str], private: bool, certified_epsilon: Optional[float],
                 delta: float, confidence: float, n: int, steps: int, sigma: Optional[float], sets: Sequence[CanarySet],
                 dirac=None, seconds: float, way_in: str = "dpft train", batches_ok: Optional[bool] = None,
                 gaussian: bool = False) -> dict:
    """The audit as a dict (``final_model_audit.json``; :func:`attach_audit`'s input) from the scored
    canary sets and the white-box state of one run, whichever way in trained it. ``batches_ok``:
    :func:`rows_once_per_batch` of the run (None: not checked); False is a violation. ``gaussian``:
    the run's ledger holds Gaussian releases only (:func:`~dpft.audit.estimators.gaussian_events`).

    The headline is the first design's Steinke et al. ε̂, valid for any (ε, δ) mechanism; the f-DP
    ε̂ is given beside it "assuming a Gaussian trade-off curve". The verdict (``violation``) fails
    when a Steinke ε̂ (any design or the white-box Dirac canaries) exceeds the certified ε, when
    an f-DP ε̂ does and the mechanism is Gaussian (the assumption holds for the mechanisms dpft
    runs, so the stronger estimator counts), or when a row is counted twice in a batch."""
    results = [design_result(s.design, s.scores, s.included, delta, confidence) for s in sets]
    whitebox = whitebox_result(dirac, delta, confidence)
    first = results[0]["bounds"]
    eps = certified_epsilon
    every = results + ([whitebox] if whitebox else [])

    def over(meth: str) -> bool:
        return eps is not None and any(x["bounds"][meth]["epsilon"] > eps + 1e-9 for x in every)

    by = (["steinke"] if over("steinke") else []) + (["fdp"] if gaussian and over("fdp") else [])
    return {"kind": "final-model one-run audit (black-box)", "way_in": way_in, "recipe": recipe, "planted": planted,
            "private": private, "certified_epsilon": eps, "delta": delta, "confidence": confidence,
            "n_train_with_canaries": n, "steps": steps, "sigma": sigma, "designs": results, "whitebox": whitebox,
            "whitebox_unsupported": getattr(dirac, "unsupported", None),
            "check_rows_once_per_batch": batches_ok,
            "headline": {"epsilon_hat": first["steinke"]["epsilon"], "method": "steinke",
                         "design": results[0]["design"], "m": results[0]["m"], "confidence": confidence,
                         # beside the headline, never instead of it: valid only under the Gaussian curve
                         "gaussian": {"epsilon_hat": first["fdp"]["epsilon"], "method": "fdp",
                                      "assumption": GAUSSIAN_ASSUMPTION}},
            "gaussian_mechanism": bool(gaussian),
            # the Steinke bound tests the (ε, δ) claim of any mechanism; the f-DP bound tests the Gaussian curve
            # through (ε, δ), which counts for a ledger of Gaussian releases only
            "violation": bool(by) or batches_ok is False,
            "violation_by": by + (["rows counted twice"] if batches_ok is False else []),
            "gaussian_curve_rejected": over("fdp"),
            "seconds": seconds}


def audit_summary(audit: dict, same_run: bool) -> dict:
    """The report's ``final_model_audit`` section: the headline and each design's ε̂, no scores."""
    gauss = audit["headline"].get("gaussian") or {}
    return {"epsilon_hat": audit["headline"]["epsilon_hat"], "confidence": audit["confidence"],
            "m": audit["headline"]["m"], "design": audit["headline"]["design"],
            "method": METHODS[audit["headline"]["method"]], "planted": audit.get("planted"),
            "epsilon_hat_gaussian": gauss.get("epsilon_hat"), "method_gaussian": METHODS["fdp"],
            "gaussian_mechanism": audit.get("gaussian_mechanism"), "verdict": "FAIL" if audit["violation"] else "pass",
            "certified_epsilon_of_audit_run": audit["certified_epsilon"], "same_run": same_run,
            "designs": [{"design": x["design"], "m": x["m"],
                         **{k: b["epsilon"] for k, b in x["bounds"].items()}} for x in audit["designs"]],
            "whitebox": None if not audit.get("whitebox") else {
                "m": audit["whitebox"]["m"], **{k: b["epsilon"] for k, b in audit["whitebox"]["bounds"].items()}}}


def attach_audit(run_dir: str | Path, audit: dict, same_run: bool = False) -> dict:
    """Add the audit's summary to ``run_dir``'s ``report.json`` and rewrite ``report.md`` and the
    model card(s) from it (outputs/card.py). ``same_run``: the audit trained this very run (its
    model held the canaries); else the audit ran the same recipe in another folder.

    Raises:
        FileNotFoundError: ``run_dir`` has no report.json (not a finished ``dpft train`` run)."""
    run_dir = Path(run_dir)
    f = run_dir / "report.json"
    if not f.is_file():
        raise FileNotFoundError(f"{run_dir} has no report.json: give the folder of a finished `dpft train` run")
    rep = json.loads(f.read_text())
    rep["final_model_audit"] = audit_summary(audit, same_run)
    f.write_text(json.dumps(rep, indent=2, default=float))
    (run_dir / "report.md").write_text(render_markdown(rep))
    if any((run_dir / sub / "README.md").is_file() for sub in ("model", "model_merged")):
        write_model_cards(run_dir, rep)  # only where the run wrote a card (output.model_card)
    return rep


def render_audit_md(audit: dict) -> str:
    """``final_model_audit.md``: the table of ε̂ per design and estimator, and what it means."""
    eps = audit["certified_epsilon"]
    lines = [f"# Final-model audit of `{audit['recipe']}`", ""]
    if audit.get("planted"):
        lines += [f"**PLANTED BUG `{audit['planted']}`: a self-test of the auditor, not an audit of the recipe.**",
                  ""]
    lines += [f"Certified ε of the audit run = {'none (not private)' if eps is None else f'{eps:.3f}'} at "
              f"δ = {audit['delta']:g}; N = {audit['n_train_with_canaries']} rows (canaries included), "
              f"T = {audit['steps']}, σ = {audit['sigma']:.4g}; {audit['seconds']:.0f} s.", "",
              f"**Headline:** ε̂ ≥ {audit['headline']['epsilon_hat']:.3f} ({METHODS['steinke']}); "
              f"{GAUSSIAN_ASSUMPTION}: ε̂ ≥ {(audit['headline'].get('gaussian') or {}).get('epsilon_hat', float('nan')):.3f} "
              "(f-DP, Mahloujifar et al. 2025).", "",
              f"**Verdict: {verdict_line(audit)}**", "",
              f"| design | m | in | ε̂ Steinke (any mechanism) | ε̂ f-DP ({GAUSSIAN_ASSUMPTION}) | mean score in | "
              "mean score out |",
              "|---|---|---|---|---|---|---|"]
    for x in audit["designs"]:
        b = x["bounds"]
        lines.append(f"| {x['design']} | {x['m']} | {x['included']} | {b['steinke']['epsilon']:.3f} | "
                     f"{b['fdp']['epsilon']:.3f} | {x['mean_score_in']:.4g} | {x['mean_score_out']:.4g} |")
    wbx = audit.get("whitebox")
    if wbx:
        b = wbx["bounds"]
        lines.append(f"| white-box Dirac (every release) | {wbx['m']} | {wbx['included']} | "
                     f"{b['steinke']['epsilon']:.3f} | {b['fdp']['epsilon']:.3f} | | |")
    if audit.get("check_rows_once_per_batch") is not None:
        ok = audit["check_rows_once_per_batch"]
        lines += ["", f"White-box check, same run: no row twice in a logical batch — {'pass' if ok else 'FAIL'}."]
    lines += ["", f"Each ε̂ is a lower bound at {audit['confidence']:.0%} confidence on its own (threshold chosen "
              "with a Bonferroni correction; none across designs or estimators). " + AUDIT_MEANING, ""]
    return "\n".join(lines)


def verdict_line(audit: dict) -> str:
    """The verdict in words: ``pass``, or ``FAIL`` and which estimator(s) exceeded the certified ε."""
    if audit.get("certified_epsilon") is None:
        return "none (not private: no certified ε to test)"
    if not audit["violation"]:
        rule = ("Steinke and f-DP ε̂ (the mechanism is Gaussian)" if audit.get("gaussian_mechanism")
                else "Steinke ε̂ (the mechanism is not Gaussian: the f-DP ε̂ does not count)")
        return f"pass — no {rule} above the certified ε"
    names = {"steinke": "a Steinke ε̂ (valid for any mechanism)",
             "fdp": f"an f-DP ε̂ (the mechanism is Gaussian: {GAUSSIAN_ASSUMPTION} holds)",
             "rows counted twice": "the white-box check (a row counted twice in a batch)"}
    return "FAIL — " + "; ".join(names.get(k, k) for k in audit.get("violation_by") or ["steinke"]) + \
        " exceeds the certified ε"


def eps_ratio(audit: dict) -> Optional[float]:
    """Headline ε̂ / certified ε (None for a non-private run)."""
    eps = audit["certified_epsilon"]
    return None if not eps or math.isinf(eps) else audit["headline"]["epsilon_hat"] / eps
