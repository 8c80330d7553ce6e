"""Audit checks of ``DPDPOTrainer`` at user level (issue 38; ``DPArguments(user_column=...)``,
integrations/trl/user.py ``user_pair_chunks``): a user's preference pairs are one privacy unit.

Each run builds a tiny random Llama and the word-level tokenizer of audit/checks_trl.py in-process and
trains one logical step of ``DPDPOTrainer`` with ``σ = 0``, plain SGD at learning rate 1 and the
expected batch equal to the number of users U (``q = 1``: the user sampler takes every user, each with
all of its ≤ k pairs); the released clipped sum is read back from the parameters, ``S = −Δθ · qU``.
Then (add/remove-one-user, Chua et al. 2024 "Mind the Privacy Unit!", user-level DP-SGD):

* **leave-one-user-out** — ``max_u ‖S(D) − S(D∖u)‖ ≤ C(1 + tol)`` over the users, and for a user with
  two pairs whose summed gradient ``g_u`` (read from the same step at a clip norm no gradient reaches)
  has norm above C: ``S(D) − S(D∖u) = C · g_u / ‖g_u‖`` (the user's whole gradient clipped as one group,
  every chosen and rejected row of its pairs together; relative tolerance 1e-2).
* **the ledger counts users** — N = U users (not pairs), ``q = expected users / U``, and one train step
  records one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``.

Planted bugs (undone afterwards): ``dpo_user_pair_groups`` — the user sampler's clipping groups are the
pairs (``UserPoissonSampler.groups`` returns each pair its own group, each clipped to C alone): removing
a two-pair user moves the release by up to 2C, the leave-one-user-out check fails;
``dpo_user_ledger_counts_pairs`` — the plan is built over the pairs (``N`` = pairs, ``q`` = expected
users / pairs, an ε too small): the ledger check fails.

:func:`dpo_user_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``). Importing this
module needs ``trl`` (the suite skips it, with a note, when trl is absent).
"""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from typing import Optional

import datasets
import dp_accounting as dpa
import torch
from trl import DPOConfig  # this module's checks need TRL; an ImportError skips them in the suite

from dpft.audit.checks_api import C, TOL, _no_dropout, _released_sum
from dpft.audit.checks_trl import _gc_frozen, tiny_llama, tiny_tokenizer
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.integrations.hf.trainer import DPArguments
from dpft.integrations.trl.trainer import DPDPOTrainer
from dpft.session import core as session_core
from dpft.step.sample import UserPoissonSampler

__all__ = ["PLANTED", "dpo_user_checks"]

#: Planted bugs :func:`dpo_user_checks` must catch (audit/planted.py lists them too).
PLANTED = ("dpo_user_pair_groups", "dpo_user_ledger_counts_pairs")

# (prompt, chosen, user): rows grouped by user; "b" has two pairs (the user the checks look at)
_PAIRS = [("my phone will not turn on", " charge it then try again", "a"),
          ("thanks", " you are support", "a"),
          ("what if that does not help", " bring it to a shop", "b"),
          ("my router is slow", " restart it and then try again", "b"),
          ("you are slow", " sorry to hear that", "c")]
_TWO_PAIRS = "b"
#: a clip norm no summed gradient of the tiny model reaches (the step then releases the raw sum)
_NO_CLIP = 1e6


def _counts_pairs(real):
    def plan_over_pairs(**kw):
        # the bug: N and q over the rows (pairs) while the sampler takes whole users
        rows = len(kw["rows"])
        if kw.get("sampler") is not None:
            kw["sampler"].q = kw["expected_batch_size"] / rows
        return real(**{**kw, "n": rows})

    return plan_over_pairs


planted_bug = bug_planter(PLANTED, {
    "dpo_user_pair_groups": lambda p: p.set(UserPoissonSampler, "groups",
                                            lambda self, micro: torch.arange(len(micro))),
    # the session builds every way in's plan (dpft/session/core.py): the bug planted there reaches DPDPOTrainer
    "dpo_user_ledger_counts_pairs": lambda p: p.set(session_core, "build_privacy_plan",
                                                    _counts_pairs(session_core.build_privacy_plan)),
})


def _rows(skip: Optional[str] = None):
    return datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": " sorry", "user": u}
                                       for p, c, u in _PAIRS if u != skip])


def _trainer(model, tok, rows, out: str, *, c: float, sigma: float, eb: int) -> DPDPOTrainer:
    args = DPOConfig(output_dir=out, bf16=False, max_steps=1, learning_rate=1.0, lr_scheduler_type="constant",
                     optim="sgd", weight_decay=0.0, per_device_train_batch_size=len(rows), report_to=[],
                     use_cpu=not torch.cuda.is_available(), save_strategy="no", logging_strategy="no",
                     disable_tqdm=True, beta=0.5, gradient_checkpointing=False)
    dp = DPArguments(target_delta=1.0 / (10 * len(rows)), expected_batch_size=eb, noise_multiplier=sigma,
                     max_grad_norm=c, reproducible_seed=0, user_column="user", max_rows_per_user=2,
                     user_clipping="group")
    return DPDPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, dp_args=dp)


def _users(rows) -> int:
    return len(set(rows["user"]))


def _step(model, tok, rows, *, c: float) -> torch.Tensor:
    """One logical step on a copy of ``model`` with every user sampled (expected batch = U, q = 1),
    σ = 0, SGD lr 1; the released clipped sum ``S`` (over the trainable parameters)."""
    model = copy.deepcopy(model)
    _no_dropout(model)
    u = _users(rows)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(model, tok, rows, out, c=c, sigma=0.0, eb=u)
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        with _gc_frozen():
            tr.train()
    return _released_sum(tr.model, before, u)


def louo_check(model=None, tok=None) -> Check:
    """Leave-one-user-out ≤ C, and = C · g_u/‖g_u‖ for the two-pair user whose ‖g_u‖ > C."""
    t0 = time.perf_counter()
    tok = tok or tiny_tokenizer()
    model = model if model is not None else tiny_llama(len(tok))
    full = _step(model, tok, _rows(), c=C)
    diffs = {u: full - _step(model, tok, _rows(skip=u), c=C) for u in sorted({u for *_, u in _PAIRS})}
    worst = max(float(d.norm()) for d in diffs.values())
    # the user's summed gradient: the same leave-one-user-out at a clip norm nothing reaches
    g = _step(model, tok, _rows(), c=_NO_CLIP) - _step(model, tok, _rows(skip=_TWO_PAIRS), c=_NO_CLIP)
    gn = float(g.norm())
    expected = g * min(1.0, C / gn)
    d = diffs[_TWO_PAIRS]
    off = float((d - expected).norm()) / max(float(expected.norm()), 1e-12)
    ok = worst <= C * (1 + TOL) and gn > C and off <= 1e-2
    return Check("trl user level: DPDPOTrainer leave-one-user-out", ok,
                 f"max_u ‖S(D) − S(D∖u)‖ = {worst:.4g} vs C = {C:g} (U = {len(diffs)} users, "
                 f"{len(_PAIRS)} pairs, q = 1, σ = 0); user {_TWO_PAIRS!r} (2 pairs, ‖g_u‖ = {gn:.4g}): "
                 f"‖S(D) − S(D∖u)‖ = {float(d.norm()):.4g}, relative distance to clip_C(g_u) {off:.2e}"
                 + ("" if ok else " — a user moves the release by more than C, or not as one clipped group"),
                 {"loo_over_C": worst / C, "user_grad_over_C": gn / C, "rel_off": off,
                  "seconds": round(time.perf_counter() - t0, 2)})


def ledger_check(model=None, tok=None) -> Check:
    """N = U users, q = expected users / U, one PoissonSampledDpEvent(q, Gaussian(σ)) per step."""
    t0 = time.perf_counter()
    tok = tok or tiny_tokenizer()
    model = copy.deepcopy(model if model is not None else tiny_llama(len(tok)))
    rows = _rows()
    u, eb = _users(rows), 2
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(model, tok, rows, out, c=C, sigma=1.0, eb=eb)
        with _gc_frozen():
            tr.train()
    want = [("train", 1, dpa.PoissonSampledDpEvent(eb / u, dpa.GaussianDpEvent(tr.sigma)))]
    got = [(e.phase, e.count, e.event) for e in tr.ledger.entries]
    shown = [(p, n, type(e).__name__, getattr(e, "sampling_probability", None)) for p, n, e in got]
    ok = tr.n == u and tr.plan.n == u and abs(tr.q - eb / u) <= 1e-12 and got == want
    return Check("trl user level: DPDPOTrainer's ledger counts users", ok,
                 f"N = {tr.n} (plan {tr.plan.n}) for U = {u} users in {len(rows)} pairs, q = {tr.q:.4g} vs "
                 f"{eb}/{u}; ledger {shown}"
                 + ("" if ok else " — the ledger does not count users"),
                 {"n": tr.n, "q": tr.q, "seconds": round(time.perf_counter() - t0, 2)})


def dpo_user_checks(planted: Optional[str] = None) -> list[Check]:
    """The two checks of the module docstring, with ``planted`` (one of :data:`PLANTED`) re-opened: then
    only the check it targets runs (it must fail).

    Returns:
        Two :class:`Check` rows with nothing planted (both pass), one with a planted bug.

    Raises:
        ValueError: an unknown planted bug.
    """
    with planted_bug(planted):
        tok = tiny_tokenizer()
        model = tiny_llama(len(tok))
        out = []
        if planted in (None, "dpo_user_pair_groups"):
            out.append(louo_check(model, tok))
        if planted in (None, "dpo_user_ledger_counts_pairs"):
            out.append(ledger_check(model, tok))
        return out
