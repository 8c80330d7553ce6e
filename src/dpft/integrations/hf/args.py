"""``DPArguments``: the privacy settings of :class:`~dpft.integrations.hf.trainer.DPTrainer` and the TRL
trainers (checked when made; the mechanism part is step/mechanisms.py's, as in every way in)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dpft.config.refusals import refuse
from dpft.errors import PlanError
from dpft.methods.python import python_methods
from dpft.session import SessionSettings
from dpft.step.clip import ClipSettings, build_clip_policy
from dpft.step.mechanisms import Mechanism, mechanism_of

__all__ = ["DPArguments"]

_CLIP_STYLES = ("flat", "per_layer", "automatic", "auto", "auto_s", "head_body")


@dataclass(kw_only=True)
class DPArguments:
    """Privacy settings of a :class:`DPTrainer` (keyword-only; usable with ``HfArgumentParser``).

    Attributes:
        target_delta: δ of the guarantee; must be below 1/N.
        expected_batch_size: expected logical batch size qN (Poisson sampling with
            ``q = expected_batch_size / len(train_dataset)``).
        target_epsilon: ε to calibrate σ for (over all steps of ``train()``); give this or
            ``noise_multiplier``.
        noise_multiplier: σ, fixed (ε is then whatever the ledger says).
        max_grad_norm: the per-example clip norm C (L2 sensitivity of the clipped sum).
        clipping: ``flat`` | ``per_layer`` | ``automatic`` (AUTO-S) | ``head_body``.
        clipping_gamma: AUTO-S stability constant.
        head_fraction: share of C² given to the task head with ``head_body``.
        head_learning_rate: learning rate of the task head (parameters named ``classifier``/
            ``score``/``pooler``/``lm_head``) in the optimizer ``Trainer`` creates; None: the
            head uses ``TrainingArguments.learning_rate`` like the rest. A fresh head under DP
            needs far larger steps than pretrained weights (the CLI's ``optimizer.head_lr``).
            With your own ``optimizers=(opt, sched)``, use its param groups instead.
        max_physical_batch_size: rows per forward/backward (memory only, never privacy);
            default ``TrainingArguments.per_device_train_batch_size``.
        reproducible_seed: None (default) = secret randomness from the OS CSPRNG. An int makes
            batches and noise reproducible; ε then holds only while that seed stays secret.
        hardened_noise: draw each noise coordinate as the sum of four normals / 2.
        engine: ``bookkeeping`` (fast path) or ``reference`` (``torch.func``, exact, slower).
        log_private_train_loss: also log the un-noised training loss (a private statistic,
            not covered by ε; off by default).
        user_column: None (default) = one row is one privacy unit. The name of a column of
            ``train_dataset`` holding a user id per row = **user-level** DP (add/remove one
            user): users are Poisson-sampled with ``q = expected_batch_size / U`` (U distinct
            ids; ``expected_batch_size`` then counts users), a sampled user brings a fresh
            random subset of at most ``max_rows_per_user`` of its rows, and the user's summed
            gradient is clipped to ``max_grad_norm`` (:class:`~dpft.step.sample.UserPoissonSampler`,
            grads/groups.py; Chua et al. 2024 "Mind the Privacy Unit!", Alg. 1). δ < 1/U, the
            ledger's q, ε and epochs count users. The column is dropped before collation.
        max_rows_per_user: k, the most rows of a sampled user per step (user level only).
        user_clipping: ``group`` (exact: the user's summed gradient clipped to C) or
            ``per_example_over_k`` (each row clipped to C/k: ≤ k · C/k = C; cheaper, harsher).
        max_batch_size: truncated Poisson (docs/mechanisms.md, step/truncated.py): at most this
            many rows per logical batch (a uniformly random subset when more are drawn); the
            ledger records ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` and σ is
            calibrated on it. Example level only; physical batches stay the collator's.
        mechanism: ``gaussian`` (default, DP-SGD) or ``banded_mf`` (banded matrix factorization,
            Choquette-Choo et al. 2023; step/correlated.py): secret partitions, step t samples
            partition t mod b at p = b·B/N, step t's noise is row t of C⁻¹Z, the ledger records
            PoissonSampled(p, Gaussian(σ)) at t ≡ 0 (mod b) and NoOp otherwise. Its secret noise
            buffers ((b − 1) × trainable parameters, fp32) are written at every checkpoint to
            ``output_dir/noise_state.secret.pt`` (mode 0600, outside ``checkpoint-*``: never
            publish it); ``resume_from_checkpoint`` restores them and refuses without them.
            Example level only, not with ``max_batch_size``.
        bands: b ≥ 1 of ``banded_mf`` (default 4; b = 1 is DP-SGD).
    allow_overspend: a resumed run may end above the target ε (default False: after a crash
        between checkpoints the replayed releases are counted and the run stops early so that
        ε stays within the target; accounting/cap.py).
    methods: method plug-ins, as ``dpft train``'s ``methods:`` list (``[{"name": "rmt", "method":
        "rmt"}]``), applied to the step through the same plan (methods/python.py); one that needs
        ``dpft train``'s driver refuses with its reason.

    Raises:
        ValueError: an out-of-range value, or neither/both of ``target_epsilon`` and
            ``noise_multiplier``.
    """

    target_delta: float
    expected_batch_size: int
    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    clipping_gamma: float = 0.01
    head_fraction: float = 0.5
    head_learning_rate: Optional[float] = None
    max_physical_batch_size: Optional[int] = None
    reproducible_seed: Optional[int] = None
    hardened_noise: bool = True
    engine: str = "bookkeeping"
    log_private_train_loss: bool = False
    allow_overspend: bool = False
    user_column: Optional[str] = None
    max_rows_per_user: int = 4
    user_clipping: str = "group"
    max_batch_size: Optional[int] = None
    mechanism: str = "gaussian"
    bands: Optional[int] = None
    methods: Optional[list] = None

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise refuse("privacy.noise_multiplier:both_or_neither", "DPTrainer")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise refuse("privacy.target_epsilon:range", "DPTrainer", got=self.target_epsilon)
        if self.noise_multiplier is not None and not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise refuse("privacy.noise_multiplier:range", "DPTrainer", got=self.noise_multiplier)
        if not 0 < self.target_delta < 1:
            raise refuse("privacy.delta:range", "DPTrainer", got=self.target_delta)
        if int(self.expected_batch_size) != self.expected_batch_size or self.expected_batch_size < 1:
            raise ValueError(f"DPArguments.expected_batch_size must be a positive integer, got {self.expected_batch_size}")
        mpb = self.max_physical_batch_size
        if mpb is not None and (isinstance(mpb, bool) or int(mpb) != mpb or mpb < 1):
            raise refuse("batch.max_physical_batch_size:range", "DPTrainer", got=mpb)
        if self.clipping not in _CLIP_STYLES:
            raise refuse("privacy.clipping.style:unknown", "DPTrainer", allowed=_CLIP_STYLES, got=self.clipping)
        if self.head_learning_rate is not None and not self.head_learning_rate > 0:
            raise ValueError(f"DPArguments.head_learning_rate must be > 0, got {self.head_learning_rate}")
        if self.engine not in ("bookkeeping", "reference"):
            raise ValueError(f"DPArguments.engine must be 'bookkeeping' or 'reference', got {self.engine!r}")
        if self.user_column is not None and (not isinstance(self.user_column, str) or not self.user_column):
            raise ValueError(f"DPArguments.user_column must be a column name, got {self.user_column!r}")
        if int(self.max_rows_per_user) != self.max_rows_per_user or self.max_rows_per_user < 1:
            raise refuse("task.max_rows_per_user:range", "DPTrainer", got=self.max_rows_per_user)
        if self.user_clipping not in ("group", "per_example_over_k"):
            raise refuse("task.user_clipping:unknown", "DPTrainer", got=self.user_clipping)
        build_clip_policy(self.clip_settings())  # checks C, f, γ
        if self.max_batch_size is not None and (isinstance(self.max_batch_size, bool)
                                                or int(self.max_batch_size) != self.max_batch_size
                                                or self.max_batch_size < 1):
            raise ValueError(f"DPArguments.max_batch_size must be a positive integer, got {self.max_batch_size}")
        if self.mechanism == "banded_mf" and self.bands is None:
            self.bands = 4
        try:
            part = self.mechanism_part()
        except PlanError as exc:
            raise PlanError(f"DPArguments: {exc}") from None
        names = [m.name for m in python_methods(self.methods, "DPArguments")]
        why = part.refusals(user_level=self.user_column is not None, methods=names)
        if why:
            raise PlanError("DPArguments: " + "; ".join(why))

    def mechanism_part(self) -> Mechanism:
        """The mechanism these settings ask for (step/mechanisms.py).

        Raises:
            PlanError: as :func:`~dpft.step.mechanisms.mechanism_of`."""
        return mechanism_of(self.mechanism, self.bands, self.max_batch_size)

    def clip_settings(self) -> ClipSettings:
        """These settings' clip, for the one clip builder (step/clip.py ``build_clip_policy``): at user
        level with ``per_example_over_k`` each row is clipped to ``max_grad_norm / max_rows_per_user``."""
        over_k = self.user_column is not None and self.user_clipping == "per_example_over_k"
        return ClipSettings(self.clipping, self.max_grad_norm, self.clipping_gamma, self.head_fraction,
                            int(self.max_rows_per_user) if over_k else None)

    def session_settings(self, steps: Optional[int], epochs: Optional[float]) -> SessionSettings:
        """These settings as the private session's (session/core.py), for ``steps`` logical steps, else
        ``epochs`` over the units (the session counts them: step/plan.py ``planned_steps``)."""
        return SessionSettings(
            max_grad_norm=float(self.max_grad_norm), expected_batch_size=int(self.expected_batch_size),
            mechanism=self.mechanism_part(), steps=None if steps is None else int(steps),
            epochs=None if steps is not None else float(epochs), noise_multiplier=self.noise_multiplier,
            target_epsilon=self.target_epsilon, target_delta=self.target_delta, clipping=self.clipping,
            hardened=self.hardened_noise, max_rows_per_user=int(self.max_rows_per_user),
            user_clipping=self.user_clipping)
