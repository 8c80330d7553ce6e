"""Planted bugs: the auditor's self-test (``dpft audit RECIPE --plant NAME``, hidden).

Each name breaks one thing the ε depends on; the audit must then FAIL. The report of a planted
run says so in its headline: it is a test of the auditor, never an audit of the recipe.

* The mechanism's parts (issue 14; patched here for the duration of :func:`plant`):
  ``noise/4``, ``clipping off``, ``per-layer without 1/sqrt(G)``, ``clip at 2C``,
  ``same noise every step``, ``no subsampling``, ``known seed``.
* The final-model audit's calibration (audit/final_model.py; issue 37): ``counted twice`` —
  one sampled row of each logical batch is drawn twice, so its gradient is clipped and summed
  twice (sensitivity 2C for that row at that step), as an off-by-one at a batch boundary would.
  The one-step mechanism game does not look for it.
* The Trainer's path (``audit/trainer_walk.py``): ``row_level_user_recipe`` (the audit's plan
  calibrated over rows for a user-level recipe), ``user_clipping_broken``.
* The check modules' own (randomness, the ways in, DDP, FSDP2, TRL, mechanisms, methods, tune, data, guard,
  ...): planted by the module that checks them, each listed once with its module in :data:`OPTIONAL_CHECKS`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from dpft.audit.trainer_walk import PLANTED as TRAINER_PLANTED, USER_CLIPPING_BROKEN

KNOWN_SEED = 1234

MECHANISM_PLANTED = ("noise/4", "clipping off", "per-layer without 1/sqrt(G)", "clip at 2C",
                     "same noise every step", "no subsampling", "known seed")
# issue 37: the final-model audit's calibration (audit/final_model.py FINAL_MODEL_PLANTED)
DUPLICATE_PLANTED = ("counted twice",)

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
    # forward LDP's noise across ranks (DDP and FSDP2) and on the device
    ("dpft.audit.checks_device", "device_checks", ("shared_rank_ldp_noise", "ewft_fsdp_shared_stream")),
    # issue 35: private hyperparameter search (dpft tune)
    ("dpft.audit.checks_tune", "tune_checks", ("k_fixed", "score_without_noise", "losing_models_released",
                                               "profile_ratio_dropped", "uncovered_trial_hidden",
                                               "auto_single_run_sigma", "scope_schedule_uncharged",
                                               # issue 44 (audit/checks_tune_release.py)
                                               "trial_publishes", "search_skips_lock", "ledger_entry_replaced",
                                               "score_redrawn_on_resume", "trial_prints")),
    # issue 28: truncated Poisson and banded matrix factorization
    ("dpft.audit.checks_mechanisms", "mechanism_checks",
     ("truncate_first_rows", "padding_contributes", "banded_buffers_reset", "banded_unnormalised")),
    ("dpft.audit.checks_seq2seq", "seq2seq_checks", ("seq2seq_targets_across_rows", "relative_table_batch_summed")),
    ("dpft.audit.checks_ewft", "ewft_checks", ("train_pre_without_noise", "train_pre_sampled_twice")),
    # issue 28: truncated Poisson and banded MF, once on the session's plan; each way in reaches them unchanged
    ("dpft.audit.ways_in_mechanisms", "mechanisms_api_checks",
     ("api_banded_every_partition", "no_min_separation", "trainer_truncation_not_recorded",
      "truncation_not_in_ledger")),
    # issue 34: the one secret-state save/restore (kept secret; the review's two reproductions), every way in
    ("dpft.audit.checks_resume", "resume_checks", ("resume_rows_by_index", "api_stale_state_accepted",
                                                   "api_noise_state_in_optimizer")),
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
     ("ewft_fsdp_pre_cache_kept", "ewft_fsdp_eval_live_layer", "ewft_fsdp_train_pre_noise_offset",
      "ewft_fsdp_train_pre_layer_unsynced")),  # issue 38: EW-FT
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
                                                       "features_key_ignores_weights",
                                                       "features_siamese_trainable_encoder")),
)

RANDOMNESS_PLANTED = next(names for _, fn, names in OPTIONAL_CHECKS if fn == "randomness_checks")
API_PLANTED = next(names for _, fn, names in OPTIONAL_CHECKS if fn == "api_checks")
#: Every planted bug: those :func:`apply` plants (the mechanism's parts, the Trainer's path, the final-model
#: calibration) and those of :data:`OPTIONAL_CHECKS` (each planted by its check module): the one list.
ALL = MECHANISM_PLANTED + TRAINER_PLANTED + DUPLICATE_PLANTED + tuple(n for _, _, names in OPTIONAL_CHECKS
                                                                        for n in names)


class _Patches:
    def __init__(self):
        self.saved: list = []

    def set(self, obj, name: str, value) -> None:
        self.saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.saved.clear()


_MISSING = object()


@contextlib.contextmanager
def patched(*patches: tuple) -> Iterator[_Patches]:
    """Each ``(obj, attr, value)`` of ``patches`` set for the duration of the block, and whatever the block
    adds with the yielded :class:`_Patches`' ``set(obj, attr, value)``: all undone on exit (the class or
    module attribute restored, an inherited one removed again). The one patch-and-restore of the audit
    (planted bugs, simulated ranks' collectives, recorders wrapped around the session)."""
    p = _Patches()
    try:
        for obj, attr, value in patches:
            p.set(obj, attr, value)
        yield p
    finally:
        p.undo()


@contextlib.contextmanager
def planting(name: Optional[str], known: tuple[str, ...]) -> Iterator[_Patches]:
    """The frame of a check module's ``planted_bug(name)``: yields a :class:`_Patches` whose
    ``set(obj, attr, value)`` calls are undone on exit (:func:`patched`). ``name`` None: nothing is
    planted (the caller sets nothing).

    Raises:
        ValueError: ``name`` is not one of ``known`` (they are listed)."""
    if name is not None and name not in known:
        raise ValueError(f"unknown planted bug {name!r}; known: {', '.join(known)}")
    with patched() as p:
        yield p


def bug_planter(known: tuple[str, ...], plants: dict[str, Callable[[_Patches], None]]):
    """A check module's ``planted_bug(name)`` context manager, built from one function per bug:
    ``plants[name](patches)`` sets that bug's patches (``patches.set(obj, attr, value)``), undone on
    exit by :func:`planting`; ``name`` None plants nothing.

    Raises:
        ValueError: (on use) ``name`` is not one of ``known``."""
    missing = set(known) - set(plants)
    if missing:  # a name the module lists but cannot plant would pass its self-test vacuously
        raise ValueError(f"bug_planter: no plant for {sorted(missing)}")

    @contextlib.contextmanager
    def planted_bug(name: Optional[str]) -> Iterator[_Patches]:
        with planting(name, known) as p:
            if name is not None:
                plants[name](p)
            yield p

    planted_bug.__doc__ = f"Plant one bug of {', '.join(known)} for the duration (None: nothing)."
    return planted_bug


def _clip_2c(orig):
    def scales(self, sq):
        c = self.max_norm
        self.max_norm = 2 * c
        try:
            return orig(self, sq)
        finally:
            self.max_norm = c

    return scales


def apply(name: Optional[str], set_attr: Callable[[object, str, object], None]) -> dict:
    """Apply planted bug ``name`` (None or ``"honest"``: nothing) with ``set_attr(obj, attr,
    value)`` (e.g. pytest's ``monkeypatch.setattr``, which undoes it); returns extra
    ``run_audit`` arguments (``known seed``: the seed the auditor is given).

    Raises:
        ValueError: an unknown name (the message lists them)."""
    if name in (None, "honest"):
        return {}
    if name not in ALL:
        raise ValueError(f"unknown planted bug {name!r}; one of {list(ALL)}")
    from dpft.privacy.randomness import Randomness
    from dpft.step import clip as clipmod
    from dpft.step.noise import GaussianMechanism
    from dpft.step.sample import PoissonSampler, UserPoissonSampler

    styles = (clipmod.FlatClip, clipmod.PerLayerClip, clipmod.AutoClip, clipmod.HeadBodyClip)
    if name == "noise/4":
        set_attr(GaussianMechanism, "std", property(lambda self: self.sigma * self.sensitivity / 4))
    elif name == "clipping off":
        for cls in styles:
            set_attr(cls, "scales", lambda self, sq: torch.ones_like(sq))
    elif name == "per-layer without 1/sqrt(G)":
        set_attr(clipmod.PerLayerClip, "scales",
                 lambda self, sq: (self.max_norm / (sq.clamp_min(0).sqrt() + clipmod.EPS)).clamp(max=1.0))
    elif name == "clip at 2C":
        for cls in styles:
            set_attr(cls, "scales", _clip_2c(cls.scales))
    elif name == "same noise every step":
        orig_add = GaussianMechanism.add_noise
        set_attr(GaussianMechanism, "add_noise", lambda self, s, step: orig_add(self, s, 0))
    elif name == "counted twice":
        orig_draw = PoissonSampler.draw

        def draw_twice(self, step, q):
            idx = orig_draw(self, step, q)
            if len(idx) == 0:
                return idx
            j = idx[int(self.rng.stream("planted_twice", step).randint(len(idx), (1,))[0])]
            return torch.sort(torch.cat([idx, j.view(1)])).values  # that row twice in the logical batch

        set_attr(PoissonSampler, "draw", draw_twice)
    elif name == "no subsampling":
        orig_draw = PoissonSampler.draw
        set_attr(PoissonSampler, "draw", lambda self, step, q: orig_draw(self, step, 1.0))
    elif name == "known seed":
        orig_init = Randomness.__init__

        def init(self, seed=None, *a, **k):
            orig_init(self, KNOWN_SEED if seed is None else seed, *a, **k)
            self.reproducible = seed is not None

        set_attr(Randomness, "__init__", init)
        return {"known_seed": KNOWN_SEED}
    elif name == USER_CLIPPING_BROKEN:
        # every row its own "user": a user of k rows contributes up to kC
        set_attr(UserPoissonSampler, "groups", lambda self, micro: torch.arange(len(micro)))
    return {}


@contextlib.contextmanager
def plant(name: Optional[str]) -> Iterator[dict]:
    """:func:`apply` for the duration of the block (undone on exit)."""
    with patched() as p:
        yield apply(name, p.set)
