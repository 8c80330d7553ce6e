"""Correlated noise: banded matrix factorization (``privacy.mechanism: banded_mf``).

The mechanism (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, NeurIPS 2023,
"(Amplified) Banded Matrix Factorization: A unified approach to private training"; MF-DP-FTRL
of Kairouz et al. 2021 / Denisov et al. 2022). Write the n steps' clipped sums as the rows of
X (n × d). A factorization of the prefix-sum workload A = B·C (A lower-triangular ones) with a
lower-triangular *b-banded* Toeplitz strategy C (``C[t, t-j] = c_j`` for 0 ≤ j < b) releases
C·X + Z, Z iid N(0, σ²C_clip²), and the optimizer gets the rows of
C⁻¹(C·X + Z) = X + C⁻¹Z: step t's gradient noise is

    y_t = (z_t − Σ_{j=1}^{b−1} c_j · y_{t−j}) / c_0          (forward substitution of C·y = z)

so the mechanism keeps the last b − 1 noises y as secret state: **memory (b − 1) × the trainable
parameters in fp32** (LoRA or a few top blocks: small; full fine-tuning of a large model: large).
The noise of the model after t steps of SGD is (A·C⁻¹·Z)_t = (B·Z)_t, whose error the coefficients
minimise.

Coefficients (:func:`banded_coefficients`): the Toeplitz c ∈ ℝᵇ with ‖c‖₂ = 1 (every column of C
has norm ≤ 1: sensitivity C_clip per participation) minimising the prefix-sum loss
‖A·C⁻¹‖_F² = Σ_{k<n} (n − k)·e_k², e_k = Σ_{i≤k} d_i, d = C⁻¹'s Toeplitz coefficients (the power
series 1/c(x)) — Choquette-Choo et al. 2023 Eq. (2) (total squared error of the prefix sums)
restricted to banded Toeplitz C as in Kalinin & Lampert 2024 ("Banded square root matrix
factorization"); numerically by L-BFGS from the banded square root c_j = binom(2j, j)/4ʲ
(the optimal infinite Toeplitz factor of Fichtenberger et al. 2023), which is the start point.

Participation (:class:`CyclicPoissonSampler`, the paper's "b-min-sep sampling"): every example
gets a secret partition in {0..b−1} (independent uniform draws, so adding or removing one
example moves no other); step t samples partition t mod b with Poisson rate p = b·B/N (B the
expected batch). Every example participates at most once in any b consecutive steps.

Accounting (Choquette-Choo et al. 2023, Theorem 4, "amplification for b-banded matrices"): since
column i of C is supported on rows i..i+b−1 and an example's participations are ≥ b apart, its
participations touch disjoint row blocks of C·X + Z; each block is a Poisson-subsampled Gaussian
mechanism with rate p, sensitivity C_clip·‖C[:, i]‖₂ ≤ C_clip and noise σ·C_clip. So n steps are
(ε, δ)-DP whenever ⌈n/b⌉ × ``PoissonSampledDpEvent(p, GaussianDpEvent(σ))`` is: the ledger records
that event at every step t ≡ 0 (mod b) and ``NoOpDpEvent`` at the others, so after any t + 1
steps it holds ⌈(t+1)/b⌉ events — the most participations of any example (partition 0) —
and σ is calibrated on the same composition. No rounding is in our favour: every column norm is
bounded by the full ‖c‖₂ = 1 (the last b − 1 columns are shorter), and ⌈·⌉ counts partial blocks.
b = 1 is DP-SGD (p = q, one event per step).

Not covered: resuming after releases past the last checkpoint (a crash between checkpoints)
would release rows that reuse pre-checkpoint batches under fresh noise; resume refuses it.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import dp_accounting as dpa
import numpy as np
import torch

from dpft.errors import TrainingError
from dpft.step.fingerprint import check_rows, rows_fingerprint
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler

if TYPE_CHECKING:
    from dpft.privacy.randomness import Randomness

__all__ = ["banded_coefficients", "strategy_matrix", "square_root_coefficients", "prefix_sum_loss",
           "inverse_coefficients", "CyclicPoissonSampler",
           "BandedMFMechanism", "banded_phase_event", "NOISE_STATE_FILE", "write_noise_state", "load_noise_state",
           "write_secret", "secret_state", "in_secret_format", "check_secret_state", "SecretState", "check_state_step",
           "SECRET_STATE_FORMAT", "SECRET_STATE_VERSION", "buffer_bytes", "check_buffer_memory", "WARN_BUFFER_BYTES",
           "MAX_BUFFER_BYTES"]

#: Secret noise state of a banded-MF run: ``run_dir/NOISE_STATE_FILE``, mode 0600, outside the
#: release set (never in checkpoint/, never pushed).
NOISE_STATE_FILE = "noise_state.secret.pt"
#: The one format of the secret state beyond the key, and its version: every way in (dpft train, DPTrainer
#: and TRL, make_private in api/state.py) reads and writes it through session/core.py
#: ``PrivateSession.secret_state`` / ``restore_secret_state``.
SECRET_STATE_FORMAT = "dpft-secret-state"
SECRET_STATE_VERSION = 1
#: make_private's own format before version 1 (read, never written)
_LEGACY_FORMATS = ("dpft-make_private-banded-noise-state",)
#: Noise buffers above this size warn; above :data:`MAX_BUFFER_BYTES` they are refused.
WARN_BUFFER_BYTES = 2 * 2**30
MAX_BUFFER_BYTES = 16 * 2**30


# ----------------------------------------------------------------------------- coefficients
def inverse_coefficients(c: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` Toeplitz coefficients d of C⁻¹ (C lower-triangular Toeplitz with first
    column c): the power series 1/c(x), i.e. an IIR filter's impulse response."""
    from scipy.signal import lfilter

    imp = np.zeros(int(n))
    imp[0] = 1.0
    return lfilter([1.0], np.asarray(c, dtype=np.float64), imp)


def strategy_matrix(coeffs, n: int) -> np.ndarray:
    """The n × n lower-triangular b-banded Toeplitz strategy C, ``C[t, t − j] = c_j`` (float64)."""
    cm = np.zeros((n, n))
    for j, v in enumerate(coeffs):
        cm += np.diag(np.full(n - j, float(v)), -j)
    return cm


def prefix_sum_loss(c: np.ndarray, n: int) -> float:
    """‖A·C⁻¹‖_F² / max column norm² of C, for the n × n prefix-sum workload A and the banded
    Toeplitz C of first column c: the total squared error of the n prefix sums per unit of noise
    variance (the objective of Choquette-Choo et al. 2023, Eq. 2, for a Toeplitz C)."""
    c = np.asarray(c, dtype=np.float64)
    e = np.cumsum(inverse_coefficients(c, n))
    weights = np.arange(n, 0, -1, dtype=np.float64)
    return float(np.sum(weights * e * e) * np.sum(c * c))


def banded_coefficients(n: int, bands: int) -> np.ndarray:
    return _banded_coefficients(int(n), int(bands)).copy()


banded_coefficients.__doc__ = """Optimal b-banded Toeplitz strategy coefficients for n steps (see the module
    docstring); cached per (n, b).

    Returns:
        ``(b,)`` float64, ‖c‖₂ = 1, c₀ > 0; b = 1 gives [1.0] (DP-SGD).

    Raises:
        ValueError: n < 1 or b < 1.
    """


def square_root_coefficients(bands: int) -> np.ndarray:
    """The banded square root c_j = binom(2j, j)/4ʲ, j < b, normalised to ‖c‖₂ = 1
    (Fichtenberger et al. 2023): :func:`banded_coefficients`' start point. ``(b,)`` float64."""
    j = range(int(bands))
    c = np.exp([math.lgamma(2 * k + 1) - 2 * math.lgamma(k + 1) - 2 * k * math.log(2) for k in j])
    return c / np.linalg.norm(c)


@functools.lru_cache(maxsize=32)
def _banded_coefficients(n: int, bands: int) -> np.ndarray:
    from scipy.optimize import minimize

    n, b = int(n), int(bands)
    if n < 1 or b < 1:
        raise ValueError(f"need n ≥ 1 steps and b ≥ 1 bands, got n = {n}, b = {b}")
    b = min(b, n)
    start = square_root_coefficients(b)
    if b == 1:
        return start

    def f(v):  # log of the scale-free loss; an unstable C⁻¹ (overflow) is +inf
        v = np.asarray(v)
        if v[0] <= 1e-6:
            return 1e300
        with np.errstate(all="ignore"):
            val = prefix_sum_loss(v / np.linalg.norm(v), n)
        return math.log(val) if np.isfinite(val) and val > 0 else 1e300

    # Derivative-free (the loss is scale-invariant in v, which stalls quasi-Newton at the start):
    # Powell, then Nelder-Mead from its answer; the best point found, never worse than the start.
    best = start
    for method in ("Powell", "Nelder-Mead"):
        res = minimize(f, best, method=method, options={"maxiter": 4000})
        if res.x[0] > 0 and f(res.x) < f(best):
            best = res.x
    return best / np.linalg.norm(best)


# ----------------------------------------------------------------------------- participation
class CyclicPoissonSampler(PoissonSampler):
    """b-min-separated participation (cyclic Poisson): the N examples are split into b secret
    partitions (independent uniform draws, stream ``partition``); step t samples each example of
    partition t mod b with probability p = b·B/N (stream ``sample``, t).

    Attributes:
        q: B/N, the marginal rate (the step divides the noisy sum by the expected batch qN = B).
        partition_rate: p, the Poisson rate within a partition (the ledger's rate).
        bands: b.

    Raises:
        ValueError: b·B > N (p would exceed 1: lower privacy.bands or batch.expected_batch_size).
    """

    def __init__(self, n: int, expected_batch_size: int, rng: "Randomness", bands: int):
        super().__init__(n, expected_batch_size, rng)
        self.bands = int(bands)
        if self.bands * expected_batch_size > n:
            raise ValueError(f"banded_mf with b = {self.bands} bands samples each of b partitions of N = {n} "
                             f"examples at rate p = b·B/N = {self.bands * expected_batch_size / n:.3g} > 1; "
                             "lower privacy.bands or batch.expected_batch_size")
        self.partition_rate = self.bands * expected_batch_size / n
        self.partition = rng.stream("partition").randint(self.bands, (n,)) if self.bands > 1 \
            else torch.zeros(n, dtype=torch.long)

    def indices(self, step: int) -> torch.Tensor:
        """Step ``step``'s batch: members of partition ``step mod b``, each with probability p."""
        draw = self.rng.stream("sample", int(step)).bernoulli((self.n,), self.partition_rate)
        return torch.nonzero(draw & (self.partition == int(step) % self.bands)).flatten()


# ----------------------------------------------------------------------------- accounting
def banded_phase_event(sigma: float, p: float, steps: int, bands: int) -> dpa.DpEvent:
    """⌈n/b⌉ × PoissonSampled(p, Gaussian(σ)): the event n banded-MF steps record (Theorem 4)."""
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(sigma)),
                                   math.ceil(int(steps) / int(bands)))


# ----------------------------------------------------------------------------- the mechanism
class BandedMFMechanism(GaussianMechanism):
    """Adds y_t = C⁻¹z's row t to step t's clipped sum, z_t ~ N(0, (σ·C_clip)² I) drawn from the
    same secret streams as :class:`~dpft.step.noise.GaussianMechanism` (``noise``, t, tensor).

    Args:
        sigma, sensitivity, rng, hardened: as :class:`GaussianMechanism`.
        coeffs: ``(b,)`` strategy coefficients, ‖c‖₂ ≤ 1 (:func:`banded_coefficients`).
        partition_rate: p of :class:`CyclicPoissonSampler` (the ledger's sampling rate).

    Steps must come in order 0, 1, 2, … (or from a restored :meth:`load_state`): the buffers
    hold y_{t−1}, …, y_{t−b+1}.

    Raises:
        ValueError: ‖c‖₂ > 1 + 1e-9 or c₀ ≤ 0; (from :meth:`add_noise`) a step out of order.
    """

    #: its buffers and the sampler's partition are secret state beyond the key (saved, restored)
    stateful = True

    def __init__(self, sigma: float, sensitivity: float, rng: "Randomness", coeffs, partition_rate: float,
                 hardened: bool = True):
        super().__init__(sigma, sensitivity, rng, hardened=hardened)
        c = [float(x) for x in coeffs]
        if not c or c[0] <= 0 or math.sqrt(sum(x * x for x in c)) > 1 + 1e-9:
            raise ValueError(f"banded coefficients need c0 > 0 and ‖c‖ ≤ 1, got {c}")
        self.coeffs = c
        self.bands = len(c)
        self.partition_rate = float(partition_rate)
        #: Secret state: the last b − 1 noises, newest first (name → fp32 tensor).
        self.buffers: list[dict[str, torch.Tensor]] = []
        #: The step whose noise comes next.
        self.next_step = 0
        #: The :class:`CyclicPoissonSampler` whose secret partition is saved and restored with the
        #: buffers (a resume under a fresh secret key must keep it, or b-min-separation breaks
        #: across the resume); None: the buffers alone.
        self.sampler: Optional[CyclicPoissonSampler] = None
        #: The training rows the sampler indexes (any map-style dataset): the state carries a
        #: keyed fingerprint of their content (step/fingerprint.py), so a resume with other or
        #: reordered rows is refused; None: no check (the audit's bare mechanisms).
        self.rows: Any = None
        self._rows_fp: Optional[dict] = None

    def add_noise(self, grad_sum: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """``{name: sum + y_step}`` (see the class docstring); updates the buffers."""
        if int(step) != self.next_step:
            raise ValueError(f"banded_mf: noise of step {step} asked, but the buffers are at step "
                             f"{self.next_step}; steps must run in order (resume restores the buffers)")
        c = self.coeffs
        out, y_now = {}, {}
        for name, t in grad_sum.items():
            z = self.noise_stream(step, name, t.device).normal(t.shape, dtype=torch.float32, device=t.device)
            y = z.mul_(self.std)
            for j, past in enumerate(self.buffers[: self.bands - 1], start=1):
                y.sub_(past[name].to(y.device), alpha=c[j])
            y.div_(c[0])
            y_now[name] = y
            out[name] = (t.float() + y).to(t.dtype)
        if self.bands > 1:
            self.buffers = [y_now, *self.buffers][: self.bands - 1]
        self.next_step += 1
        return out

    def release(self, grad_sum, sensitivity: float, q: float, step: int):
        """The noisy sum and this step's ledger event: ``PoissonSampled(p, Gaussian(σ))`` at
        t ≡ 0 (mod b), ``NoOpDpEvent`` otherwise (module docstring, Theorem 4)."""
        if float(sensitivity) != self.sensitivity and self.next_step > 0:
            raise ValueError("banded_mf needs a fixed clipping norm (the noise of earlier steps is reused)")
        self.sensitivity = float(sensitivity)
        return self.add_noise(grad_sum, step), self.event_at(step)

    def event_at(self, step: int, q: Optional[float] = None) -> dpa.DpEvent:
        """Step ``step``'s ledger event (``q`` unused: the cyclic sampler's rate p is the mechanism's):
        ``PoissonSampled(p, Gaussian(σ))`` at t ≡ 0 (mod b), ``NoOpDpEvent`` otherwise."""
        if int(step) % self.bands == 0:
            return dpa.PoissonSampledDpEvent(self.partition_rate, dpa.GaussianDpEvent(self.accounted_sigma))
        return dpa.NoOpDpEvent()

    def event(self, q: float) -> dpa.DpEvent:  # the per-step event depends on the step
        raise TypeError("BandedMFMechanism.event depends on the step: use event_at(step)")

    # -- secret state
    def state(self) -> dict:
        st = {"next_step": self.next_step, "coeffs": self.coeffs,
              "buffers": [{k: v.detach().cpu() for k, v in b.items()} for b in self.buffers]}
        if self.sampler is not None:
            st["partition"] = self.sampler.partition.detach().cpu().clone()
        if self.rows is not None:
            if self._rows_fp is None:  # the rows do not change during a run: hashed once
                self._rows_fp = rows_fingerprint(self.rows)
            st["rows"] = dict(self._rows_fp)
        return st

    def load_state(self, st: dict, device_of: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Restore :meth:`state` (and the sampler's secret partition when a sampler is attached).

        Raises:
            ValueError: other coefficients; a partition missing or of another N; (with
                :attr:`rows` set) other training rows, or the same rows reordered."""
        if [round(x, 12) for x in st["coeffs"]] != [round(x, 12) for x in self.coeffs]:
            raise ValueError("banded_mf: the saved noise state has other coefficients (another bands or steps)")
        if self.rows is not None:
            check_rows(st.get("rows"), self.rows, "banded_mf", "start a new run (the ledger keeps what was spent)")
            self._rows_fp = dict(st["rows"])
        if self.sampler is not None:
            part = st.get("partition")
            if part is None or tuple(part.shape) != tuple(self.sampler.partition.shape):
                raise ValueError("banded_mf: the saved noise state has no partition of these "
                                 f"{self.sampler.n} examples (another dataset, or written before partitions were "
                                 "saved); without it the participations would not stay b steps apart")
            self.sampler.partition = part.to(torch.long).clone()
        dev = {k: v.device for k, v in (device_of or {}).items()}
        self.buffers = [{k: v.to(dev.get(k, "cpu")) for k, v in b.items()} for b in st["buffers"]]
        self.next_step = int(st["next_step"])


def buffer_bytes(params: dict[str, torch.Tensor], bands: int) -> int:
    """Bytes of the b − 1 fp32 noise buffers for ``params``."""
    return max(0, int(bands) - 1) * 4 * sum(p.numel() for p in params.values())


def check_buffer_memory(params: dict[str, torch.Tensor], bands: int) -> int:
    """Warn above 2 GiB, refuse above 16 GiB of noise buffers. Returns the bytes.

    Raises:
        ValueError: too large, naming the fix (fewer bands, LoRA or fewer trainable blocks)."""
    nbytes = buffer_bytes(params, bands)
    if nbytes > MAX_BUFFER_BYTES:
        raise ValueError(f"banded_mf with b = {bands} keeps {bands - 1} noise buffers of the trainable parameters: "
                         f"{nbytes / 2**30:.1f} GiB > {MAX_BUFFER_BYTES / 2**30:.0f} GiB; lower privacy.bands or "
                         "train fewer parameters (trainable.mode: lora or last_k)")
    if nbytes > WARN_BUFFER_BYTES:
        warnings.warn(f"banded_mf: the noise buffers take {nbytes / 2**30:.1f} GiB", stacklevel=2)
    return nbytes


def secret_state(mechanism, at: Optional[int] = None) -> dict:
    """The secret state of ``mechanism`` beyond the key, in the one versioned format: its ``state()``
    (banded MF: buffers, next step, coefficients, partition, rows' fingerprint; a collective for a
    sharded copy) when it is ``stateful``, else nothing beyond the format. **Secret**: never released.

    Args:
        at: the step of the checkpoint the state goes with (:func:`check_state_step`, before any gather).

    Raises:
        ValueError: a stateful mechanism at another step than ``at``."""
    if at is not None:
        check_state_step(mechanism, at)
    return in_secret_format(mechanism.state() if mechanism is not None and mechanism.stateful else {})


def check_state_step(mechanism, at: int) -> None:
    """The one check that a stateful mechanism's state goes with the checkpoint of step ``at`` (its next
    step is ``at``): :func:`secret_state` (every way in's save, session/core.py) and the FSDP2 checkpoint's
    per-rank buffers (placement/fsdp_checkpoint.py). Nothing to check for a stateless mechanism.

    Raises:
        ValueError: the mechanism's state is at another step than ``at``."""
    if mechanism is not None and mechanism.stateful and mechanism.next_step != int(at):
        raise ValueError(f"noise buffers at step {mechanism.next_step}, checkpoint at step {at}")


def in_secret_format(st: dict) -> dict:
    """A mechanism's state dict ``st`` (empty: stateless) under the one format's header (format, version,
    ``stateful``): :func:`secret_state`'s, and the FSDP2 checkpoint's small part (placement/fsdp_checkpoint.py,
    whose buffers go to DCP beside it)."""
    return {"format": SECRET_STATE_FORMAT, "version": SECRET_STATE_VERSION, "stateful": bool(st), **st}


class SecretState(dict):
    """A secret state that :func:`check_secret_state` accepted: what every reader returns (``dpft train``'s
    and DPTrainer's :func:`load_noise_state`, make_private's api/state.py), so that the restore which
    follows (session/core.py ``PrivateSession.restore_secret_state``) does not check the same load twice.
    A plain dict handed to the restore is checked there. Pickles as a dict subclass (DDP broadcasts it)."""


def check_secret_state(st: dict, where: str = "resume") -> SecretState:
    """``st`` as a :class:`SecretState` if it is a secret state dpft can restore: the one format at its
    version, or a file written before it (dpft train's and DPTrainer's bare banded-MF state; make_private's
    own format). A :class:`SecretState` was checked when it was read and is returned as it is: one check per load.

    Raises:
        ValueError: another format or version, naming the fix."""
    if isinstance(st, SecretState):
        return st
    _check_format(st, where)
    return SecretState(st)


def _check_format(st: dict, where: str) -> None:
    """The format check itself (:func:`check_secret_state`), run once per load."""
    fmt = st.get("format")
    if (fmt is None and "buffers" in st) or fmt in _LEGACY_FORMATS:
        return
    if fmt != SECRET_STATE_FORMAT or st.get("version") != SECRET_STATE_VERSION:
        raise ValueError(f"{where}: not a {SECRET_STATE_FORMAT} v{SECRET_STATE_VERSION} secret state (format "
                         f"{fmt!r}, version {st.get('version')!r}); restore it with the dpft version that saved it, "
                         "or start a new run (the ledger keeps what was spent)")


def write_noise_state(run_dir, state: dict) -> Path:
    """Write a run's secret state (session/core.py ``PrivateSession.secret_state``: the one versioned
    format) to ``run_dir/NOISE_STATE_FILE``, mode 0600, atomically, outside the release set (never in
    ``checkpoint/``, never pushed): ``dpft train``'s and ``DPTrainer``'s checkpoints. Returns the path."""
    return write_secret(Path(run_dir) / NOISE_STATE_FILE, state)


def write_secret(path, obj) -> Path:
    """``torch.save(obj)`` to ``path`` atomically, owner-only (mode 0600 from creation on)."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_noise_state(run_dir, where: str = "--resume", fresh: str = "--output-dir") -> dict:
    """Read the secret noise state (:func:`check_secret_state`). Raises FileNotFoundError naming the file
    and the fix (``where``: the way in's resume option; ``fresh``: what to start anew); TrainingError: a
    file of another format or version."""
    path = Path(run_dir) / NOISE_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{where}: {path} (the secret noise buffers of this banded_mf run) is missing; "
                                f"the correlated noise cannot continue without it — start a new {fresh}")
    try:
        return check_secret_state(torch.load(path, weights_only=True, map_location="cpu"), where)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
