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
* Randomness (``audit/checks_randomness.py``, when installed): ``seed32``, ``shared_device_noise``.
* The Python ways in (``audit/ways_in.py``): ``double_capture``,
  ``unfrozen_param``, ``packing_collator``; the session they plan through: ``session_steps_rule``.
* make_private across processes and at user level (``audit/ways_in_ddp.py``, planted in its
  2-process workers): ``ddp_batch_on_every_rank``, ``ddp_user_rows_split``, ``ddp_noise_per_rank``.
* TRL (``audit/ways_in_trl.py``, when trl is installed): ``sft_packing_accepted``, ``dpo_pair_split``.
* Every update a DP release (``audit/checks_guard.py``, issue 44): ``trainer_step_skips_release``,
  ``custom_loop_accepted``, ``raw_update_accepted``, ``weights_moved_unreleased``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from dpft.audit.trainer_walk import PLANTED as TRAINER_PLANTED, USER_CLIPPING_BROKEN

KNOWN_SEED = 1234

MECHANISM_PLANTED = ("noise/4", "clipping off", "per-layer without 1/sqrt(G)", "clip at 2C",
                     "same noise every step", "no subsampling", "known seed")
RANDOMNESS_PLANTED = ("seed32", "shared_device_noise")
API_PLANTED = ("double_capture", "unfrozen_param", "packing_collator", "session_steps_rule")
ALL = MECHANISM_PLANTED + TRAINER_PLANTED + RANDOMNESS_PLANTED + API_PLANTED
# make_private across processes / at user level (audit/ways_in_ddp.py; planted in its 2-process jobs)
API_DDP_PLANTED = ("ddp_batch_on_every_rank", "ddp_user_rows_split", "ddp_noise_per_rank")
ALL = ALL + API_DDP_PLANTED
# DPTrainer under torchrun and at user level (audit/ways_in_ddp.py, issue 26): the model wrapped
# in DDP, each rank clipping the whole logical batch, a user's rows clipped one by one.
HF_DDP_PLANTED = ("hf_ddp_wrapped", "hf_ddp_unsharded", "hf_user_rows_clipped_alone")
ALL = ALL + HF_DDP_PLANTED
# TRL (audit/ways_in_trl.py, when trl is installed): DPSFTTrainer accepting packed batches, DPDPOTrainer
# clipping a pair's two rows separately.
TRL_PLANTED = ("sft_packing_accepted", "dpo_pair_split")
ALL = ALL + TRL_PLANTED
# methods on the device / across processes (issue 26 item 5; audit/checks_device.py)
DEVICE_PLANTED = ("shared_rank_ldp_noise",)
ALL = ALL + DEVICE_PLANTED
# issue 28 (mechanisms beyond the independent Gaussian): planted by audit/checks_mechanisms.py
MECHANISMS_PLANTED = ("truncate_first_rows", "padding_contributes", "truncation_not_in_ledger",
                      "no_min_separation", "banded_buffers_reset", "banded_unnormalised")
ALL = ALL + MECHANISMS_PLANTED
# issue 35 (private hyperparameter search): planted by audit/checks_tune.py
TUNE_PLANTED = ("k_fixed", "score_without_noise", "losing_models_released", "profile_ratio_dropped",
                "uncovered_trial_hidden", "auto_single_run_sigma",
                # issue 44: what a search lets out, and its folder (audit/checks_tune_release.py)
                "trial_publishes", "search_skips_lock", "ledger_entry_replaced", "score_redrawn_on_resume",
                "trial_prints")
ALL = ALL + TUNE_PLANTED


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
def planting(name: Optional[str], known: tuple[str, ...]) -> Iterator[_Patches]:
    """The frame of a check module's ``planted_bug(name)``: yields a :class:`_Patches` whose
    ``set(obj, attr, value)`` calls are undone on exit (the class or module attribute restored,
    an inherited one removed again). ``name`` None: nothing is planted (the caller sets nothing).

    Raises:
        ValueError: ``name`` is not one of ``known`` (they are listed)."""
    if name is not None and name not in known:
        raise ValueError(f"unknown planted bug {name!r}; known: {', '.join(known)}")
    p = _Patches()
    try:
        yield p
    finally:
        p.undo()


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
    p = _Patches()
    try:
        yield apply(name, p.set)
    finally:
        p.undo()


# -- FSDP2 (issue 26 item 3; audit/checks_fsdp.py plants them itself) --------------------------
FSDP_PLANTED = ("fsdp_same_shard_stream", "fsdp_dummy_counted", "fsdp_banded_whole_stream", "fsdp_truncation_dropped",
                "fsdp_api_no_placeholder", "fsdp_api_dummy_sent", "fsdp_api_banded_restart",
                "fsdp_api_banded_slice_saved")
ALL = ALL + FSDP_PLANTED
# DPTrainer under TrainingArguments.fsdp / accelerate's FSDP2 plugin (issue 38; audit/ways_in_fsdp.py plants them)
HF_FSDP_PLANTED = ("hf_fsdp_args_kept", "hf_fsdp_env_kept")
ALL = ALL + HF_FSDP_PLANTED
# methods on FSDP2 shards (issue 38; audit/checks_fsdp_methods.py plants them): RMT denoising each rank's rows;
# DP-SFT noising a rank's own coordinate sum (no all-reduce), each rank drawing its own noise for z; coords: a rank
# writing P z's rows without its offset, nothing written after the step (stale Θ); stage 1: each rank building
# the basis from its own rows of the snapshots
FSDP_METHODS_PLANTED = ("fsdp_rmt_local_rows", "fsdp_dpsft_local_coords", "fsdp_dpsft_rank_noise",
                        "fsdp_dpsft_coords_rows_offset", "fsdp_dpsft_coords_stale", "dpsft_stage1_rank_basis")
ALL = ALL + FSDP_METHODS_PLANTED
# EW-FT under FSDP2 (issue 38; audit/checks_fsdp_ewft.py plants them)
ALL = ALL + ("ewft_fsdp_pre_cache_kept", "ewft_fsdp_shared_stream", "ewft_fsdp_eval_live_layer",
             "ewft_fsdp_train_pre_noise_offset", "ewft_fsdp_train_pre_layer_unsynced")
# ---- seq2seq task (issue 27 item 4; audit/checks_seq2seq.py, when installed): each source
# collated with the next row's target; relative-position table rules (issue 36) giving every example the
# batch-summed gradient of the shared table.
SEQ2SEQ_PLANTED = ("seq2seq_targets_across_rows", "relative_table_batch_summed")
ALL = ALL + SEQ2SEQ_PLANTED
# EW-FT ldp.train_pre (issue 29; audit/checks_ewft.py plants them): pre(·) updated from the
# un-noised clipped sum; the two releases of a step recorded as two separately sampled events.
EWFT_PLANTED = ("train_pre_without_noise", "train_pre_sampled_twice")
ALL = ALL + EWFT_PLANTED
# issue 28: mechanisms in make_private / DPTrainer (audit/ways_in_mechanisms.py plants them):
# make_private's cyclic sampler ignoring the partitions, the banded noise buffers in the DP
# optimizer's state_dict, DPTrainer recording plain Poisson events under max_batch_size.
MECHANISMS_API_PLANTED = ("api_banded_every_partition", "api_noise_state_in_optimizer",
                          "trainer_truncation_not_recorded")
ALL = ALL + MECHANISMS_API_PLANTED
# issue 34: the one resume path (audit/checks_resume.py plants them): the banded state restored by
# row index without the rows' fingerprint; make_private loading a state older than its last release.
RESUME_PLANTED = ("resume_rows_by_index", "api_stale_state_accepted")
ALL = ALL + RESUME_PLANTED
# issue 37: the final-model audit's calibration (audit/final_model.py FINAL_MODEL_PLANTED)
DUPLICATE_PLANTED = ("counted twice",)
ALL = ALL + DUPLICATE_PLANTED
# issue 34 item 4: methods through the Python ways in (audit/ways_in_mechanisms.py plants them): the
# adaptive clip's gradient noised at σ instead of σ_Δ, DPTrainer's count noise reused across train()
# loops, DP-SFT's live projection unclipped.
METHODS_API_PLANTED = ("api_adaptive_noise_unadjusted", "trainer_count_stream_reused", "api_subspace_unclipped")
ALL = ALL + METHODS_API_PLANTED
# issue 38: DPDPOTrainer / QLoRA DPTrainer under fsdp (audit/ways_in_fsdp.py plants them) and the --no-dp FSDP
# step (audit/checks_fsdp.py): accelerate handed FSDP plugin arguments (DPO) or environment (QLoRA); the placeholder's loss not zeroed.
FSDP_TRL_PLANTED = ("dpo_fsdp_args_kept", "qlora_fsdp_env_kept", "fsdp_plain_dummy_counted")
ALL = ALL + FSDP_TRL_PLANTED
# issue 38: DPDPOTrainer at user level (audit/ways_in_trl.py plants them, when trl is installed): each pair its
# own clipping group instead of the user's pairs together; the plan (N, q) built over pairs instead of users.
DPO_USER_PLANTED = ("dpo_user_pair_groups", "dpo_user_ledger_counts_pairs")
ALL = ALL + DPO_USER_PLANTED
# issue 44 item 5: no data error quotes a label value (audit/checks_data.py plants it): the helper that describes an
# offending label quotes its value
DATA_PLANTED = ("label_quoted",)
ALL = ALL + DATA_PLANTED
# issue 44 item 2 (audit/checks_guard.py plants them): DPTrainer's step falling back to a stock backward (a Trainer
# path that updates without the DP step), the custom-loop refusal off, the optimizer's release hook off, the
# end-of-training check (weights moved with no release) off.
GUARD_PLANTED = ("trainer_step_skips_release", "custom_loop_accepted", "raw_update_accepted",
                 "weights_moved_unreleased")
ALL = ALL + GUARD_PLANTED
# issue 45: frozen features computed once (audit/checks_features.py plants them): the cache computed with
# the frozen part in train mode (dropout), the memmap written inside the run folder and kept, the key
# blind to the frozen weights.
FEATURES_PLANTED = ("features_prefix_train_mode", "features_cache_in_run_dir", "features_key_ignores_weights")
ALL = ALL + FEATURES_PLANTED
# issue 45 item 3 (audit/checks_lpft.py plants it): LP-FT's probe phase records its releases in a ledger of its own
LPFT_PLANTED = ("lpft_probe_own_ledger",)
ALL = ALL + LPFT_PLANTED
