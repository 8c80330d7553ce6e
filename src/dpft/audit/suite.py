"""One audit: the white-box checks and the three canary audits at a given (σ, C, q, δ)
(:func:`run_audit`), and the audit of a recipe (:func:`audit_recipe`: the Trainer ``dpft
train`` would build, its plan, the checks through its own step, then :func:`run_audit` at the
plan's σ, C, q).

Checks written in other modules join the suite when they are installed
(:data:`OPTIONAL_CHECKS`: ``checks_randomness.randomness_checks``, ``ways_in.api_checks``: the checks every
way in passes, over its adapters);
a missing one is skipped with a note in the report, never counted as passed.

Sizes: ``quick`` (CI: seconds to a minute on one core) or the default (more trials, every
engine); the canary counts set the cap (the largest ε̂ certifiable), reported with every ε̂.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Optional

from dpft.audit import planted as pl, trainer_walk as tw, whitebox as wb
from dpft.audit.blackbox import CanarySetup, multi_step_game, one_run_audit, one_step_game
from dpft.privacy.randomness import Randomness


@dataclass
class AuditReport:
    sigma: float
    c: float
    q: float
    delta: float
    checks: list = field(default_factory=list)
    results: list = field(default_factory=list)
    #: parts of the suite that did not run (a check module not installed), one line each
    notes: list = field(default_factory=list)
    #: the planted bug of a self-test run (None: a real audit)
    planted: Optional[str] = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and all(r.passed for r in self.results)

    def as_dict(self) -> dict:
        return {"sigma": self.sigma, "C": self.c, "q": self.q, "delta": self.delta,
                "verdict": "pass" if self.passed else "FAIL", "planted": self.planted, "notes": list(self.notes),
                "whitebox": [c.row() for c in self.checks], "canary": [r.row() for r in self.results]}


def sizes(quick: bool) -> dict:
    if quick:
        return dict(slots=2048, game_rounds=8, ms_rounds=2, engines=("bookkeeping:auto",), noise_draws=100,
                    sampling_steps=100)
    return dict(slots=4096, game_rounds=24, ms_rounds=4, engines=wb.ENGINES, noise_draws=400, sampling_steps=400)


def multi_step_plan(sigma: float, q: float) -> tuple[float, int]:
    """(q, T) of the multi-step game: q clamped to [0.01, 0.25]; T = 16σ² (a missing
    subsampling then shifts the summed score by ≥ 4 noise std), between 16 and 400."""
    qa = min(max(q, 0.01), 0.25)
    return qa, int(min(400, max(16, math.ceil(16 * sigma ** 2))))


def run_audit(sigma: float, c: float = 1.0, q: float = 0.01, delta: float = 1e-5, style: str = "flat",
              family: str = "bert", quick: bool = True, known_seed: Optional[int] = None,
              rng_factory=None, hardened: bool = True, whitebox: bool = True, progress=None,
              which: tuple = ("one-step game", "one-run audit", "multi-step game"),
              styles: tuple = wb.STYLES, planted: Optional[str] = None, optional: bool = True) -> AuditReport:
    """Run the audit; ``progress`` is a tqdm-like bar (``update(n)``) or None. ``which`` and
    ``styles`` (clip styles of the sensitivity sweep; () skips it) select parts of it.
    ``planted`` names the planted bug of a self-test (routed to the check module that plants
    it; the caller applies the patches of ``audit/planted.py``); ``optional`` runs the
    installed :data:`OPTIONAL_CHECKS`."""
    sz = sizes(quick)
    rep = AuditReport(sigma, c, q, delta, planted=planted)
    if optional:
        checks, notes = optional_checks(planted)
        rep.checks += checks
        rep.notes += notes
    if whitebox:
        if styles:
            rep.checks += wb.all_sensitivity_checks(c, family, styles=styles, engines=sz["engines"],
                                                    progress=progress)
        rep.checks += wb.noise_check(max(sigma, 1e-3), c, draws=sz["noise_draws"], hardened=hardened)
        rep.checks += wb.sampling_check(q=min(max(q, 0.01), 0.5), steps=sz["sampling_steps"])
    kw = dict(sigma=sigma, c=c, delta=delta, style=style if style != "adaptive" else "flat",
              slots=sz["slots"], hardened=hardened, known_seed=known_seed)
    if rng_factory is not None:
        kw["rng_factory"] = rng_factory
    s = CanarySetup(**kw)
    if "one-step game" in which:
        rep.results.append(one_step_game(s, sz["game_rounds"], progress))
    if "one-run audit" in which:
        rep.results.append(one_run_audit(s, progress=progress))
    if "multi-step game" in which:
        qa, t = multi_step_plan(sigma, q)
        rep.results.append(multi_step_game(s, qa, t, sz["ms_rounds"], progress))
    return rep


#: (module, function, the planted bugs it plants): checks other modules provide. Each function
#: is ``f(planted: str | None = None) -> list[Check]``.
OPTIONAL_CHECKS = (
    ("dpft.audit.checks_randomness", "randomness_checks", ("seed32", "shared_device_noise")),
    # the properties every way in must show, written once over the ways in's adapters (issue 46 item 4)
    ("dpft.audit.ways_in", "api_checks", ("double_capture", "unfrozen_param", "packing_collator", "session_steps_rule")),
    # make_private and DPTrainer across processes and at user level (issue 26), one table of the ways in
    ("dpft.audit.ways_in_ddp", "hf_ddp_checks", ("hf_ddp_wrapped", "hf_ddp_unsharded", "hf_user_rows_clipped_alone",
                                                 "ddp_batch_on_every_rank", "ddp_user_rows_split", "ddp_noise_per_rank")),
    # DPSFTTrainer (TRL), issue 26 item 2: skipped with a note where trl is not installed
    ("dpft.audit.ways_in_trl", "trl_checks", ("sft_packing_accepted", "dpo_pair_split")),
    ("dpft.audit.checks_fsdp", "fsdp_checks", ("fsdp_same_shard_stream", "fsdp_dummy_counted",
                                               "fsdp_banded_whole_stream", "fsdp_truncation_dropped",
                                               "fsdp_api_no_placeholder", "fsdp_api_dummy_sent",
                                               "fsdp_api_banded_restart", "fsdp_api_banded_slice_saved",
                                               "fsdp_plain_dummy_counted")),
    ("dpft.audit.checks_device", "device_checks", ("shared_rank_ldp_noise",)),
    # issue 35: private hyperparameter search (dpft tune)
    ("dpft.audit.checks_tune", "tune_checks", ("k_fixed", "score_without_noise", "losing_models_released",
                                               "profile_ratio_dropped", "uncovered_trial_hidden",
                                               "auto_single_run_sigma",
                                               # issue 44 (audit/checks_tune_release.py)
                                               "trial_publishes", "search_skips_lock", "ledger_entry_replaced",
                                               "score_redrawn_on_resume", "trial_prints")),
    # issue 28: truncated Poisson and banded matrix factorization
    ("dpft.audit.checks_mechanisms", "mechanism_checks",
     ("truncate_first_rows", "padding_contributes", "truncation_not_in_ledger", "no_min_separation",
      "banded_buffers_reset", "banded_unnormalised")),
    ("dpft.audit.checks_seq2seq", "seq2seq_checks", ("seq2seq_targets_across_rows", "relative_table_batch_summed")),
    ("dpft.audit.checks_ewft", "ewft_checks", ("train_pre_without_noise", "train_pre_sampled_twice")),
    # issue 28: truncated Poisson and banded MF through make_private and DPTrainer
    ("dpft.audit.ways_in_mechanisms", "mechanisms_api_checks",
     ("api_banded_every_partition", "api_noise_state_in_optimizer", "trainer_truncation_not_recorded")),
    # issue 34: the one state/resume path (the review's two reproductions, every way in)
    ("dpft.audit.checks_resume", "resume_checks", ("resume_rows_by_index", "api_stale_state_accepted")),
    # issue 34 item 4: DP-Adam-AC's adaptive clipping and DP-SFT (given subspace) through the Python ways in
    ("dpft.audit.ways_in_mechanisms", "methods_api_checks",
     ("api_adaptive_noise_unadjusted", "trainer_count_stream_reused", "api_subspace_unclipped")),
    # issue 38: the ways in asked for FSDP (DPTrainer by its arguments and by accelerate's plugin, QLoRA,
    # DPDPOTrainer; a way in whose package is absent left out) reach FSDPStep unchanged
    ("dpft.audit.ways_in_fsdp", "hf_fsdp_checks", ("hf_fsdp_args_kept", "hf_fsdp_env_kept", "qlora_fsdp_env_kept",
                                                   "dpo_fsdp_args_kept")),
    # issue 38: method plug-ins on FSDP2 shards (RMT's whole-matrix SVD on the gathered rows; DP-SFT's
    # all-reduced coordinates, noised once for the world; coords: each rank's rows of Θ_start + P z; stage 1: one
    # basis for the world, built on rank 0 from the gathered snapshots and broadcast)
    ("dpft.audit.checks_fsdp_methods", "fsdp_methods_checks", ("fsdp_rmt_local_rows", "fsdp_dpsft_local_coords",
                                                               "fsdp_dpsft_rank_noise", "fsdp_dpsft_coords_rows_offset",
                                                               "fsdp_dpsft_coords_stale", "dpsft_stage1_rank_basis")),
    ("dpft.audit.checks_fsdp_ewft", "fsdp_ewft_checks",
     ("ewft_fsdp_pre_cache_kept", "ewft_fsdp_shared_stream", "ewft_fsdp_eval_live_layer",
      "ewft_fsdp_train_pre_noise_offset", "ewft_fsdp_train_pre_layer_unsynced")),  # issue 38: EW-FT
    # issue 38: DPDPOTrainer at user level (a user's pairs one unit; skipped where trl is absent)
    ("dpft.audit.ways_in_trl", "dpo_user_checks", ("dpo_user_pair_groups", "dpo_user_ledger_counts_pairs")),
    # issue 44 item 5: no data error quotes a label value (a planted label driven through every refusal)
    ("dpft.audit.checks_data", "data_checks", ("label_quoted",)),
    # issue 45 item 3: LP-FT's two phases in the one ledger, ending at the target ε
    ("dpft.audit.checks_lpft", "lpft_checks", ("lpft_probe_own_ledger",)),
    # issue 44 item 2: every update of the weights is a DP release (custom loops refused, the optimizer guard)
    ("dpft.audit.checks_guard", "guard_checks", ("trainer_step_skips_release", "custom_loop_accepted",
                                                 "raw_update_accepted", "weights_moved_unreleased")),
    # issue 45: frozen features computed once (exact, private at rest, keyed to the frozen weights)
    ("dpft.audit.checks_features", "features_checks", ("features_prefix_train_mode", "features_cache_in_run_dir",
                                                       "features_key_ignores_weights")),
)


def optional_checks(planted: Optional[str] = None) -> tuple[list, list[str]]:
    """Run the installed :data:`OPTIONAL_CHECKS` (``planted`` passed to the module that plants
    it). Returns ``(checks, notes)``: a module that is not installed adds a note, no check.

    Raises:
        ValueError: ``planted`` belongs to a module that is not installed (nothing to plant)."""
    checks, notes = [], []
    for mod, fn, names in OPTIONAL_CHECKS:
        try:
            f = getattr(importlib.import_module(mod), fn)
        except ImportError:
            if planted in names:
                raise ValueError(f"planted bug {planted!r} is planted by {mod}, which this install lacks") from None
            notes.append(f"{mod}.{fn} is not in this install: its checks did not run (skipped, not passed)")
            continue
        got = f(planted=planted if planted in names else None)
        checks += list(got)
        notes += getattr(got, "notes", [])  # ways in skipped inside a module (a package they need is absent)
    return checks, notes


def audit_recipe(recipe, quick: bool = True, planted: Optional[str] = None, progress=None,
                 run_dir: Optional[str] = None) -> tuple[dict, AuditReport]:
    """Audit ``recipe`` (a :class:`~dpft.config.recipe.Recipe`) through the code ``dpft train`` runs.

    Builds the recipe's :class:`~dpft.run.loop.Trainer` (its data, model, privacy unit, sampler,
    clip policy, engine, precision, earlier ledger phases, calibrated σ), takes the plan (unit,
    N, q, σ, T, C, δ, ε of the run) from it, checks through the Trainer's own step
    (``audit/trainer_walk.py``), then runs :func:`run_audit` at the plan's σ, C, q (white-box
    checks of every clip style and engine on tiny models, the canary audits, the optional
    checks). ``planted``: a name of ``audit/planted.py`` (a self-test: the audit must FAIL).

    Returns ``(calibration dict, AuditReport)``. Raises ``ValueError`` for a non-private recipe.
    """
    r = recipe
    if not r.privacy.enabled:
        raise ValueError("the recipe is not private (privacy.enabled: false); nothing to audit")
    name = str(r.model.name).lower()
    family = "roberta" if "roberta" in name else "gpt2" if ("gpt" in name or r.task.name == "text") else "bert"
    p = r.privacy
    with pl.plant(planted) as extra:
        trainer = tw.build_trainer(r, run_dir)
        plan = tw.row_level_plan(trainer) if planted == tw.ROW_LEVEL_USER_RECIPE else tw.trainer_plan(trainer)
        cal = {**plan, "style": p.clipping.style, "family": family, "reproducible": bool(p.reproducible),
               "seed": int(r.seed), "hardened": bool(p.hardened_noise)}
        walk = tw.trainer_checks(trainer, plan, quick=quick, progress=progress)
        known = extra.get("known_seed", cal["seed"] if cal["reproducible"] else None)
        rng_factory = None
        if cal["reproducible"]:
            rng_factory = lambda: Randomness(known)  # noqa: E731 - the run's reproducible randomness
        rep = run_audit(plan["sigma"], plan["C"], plan["q"], plan["delta"], style=cal["style"], family=family,
                        quick=quick, known_seed=known, rng_factory=rng_factory, hardened=cal["hardened"],
                        progress=progress, planted=planted)
    rep.checks = walk + rep.checks
    return cal, rep


def total_units(quick: bool, whitebox: bool = True) -> int:
    """Progress-bar length of :func:`run_audit`."""
    sz = sizes(quick)
    n = len(wb.STYLES) * len(sz["engines"]) * 2 if whitebox else 0
    return n + sz["game_rounds"] + 1 + sz["ms_rounds"] + 2  # + 2: the Trainer walk
