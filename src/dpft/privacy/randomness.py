"""The run's one secret source of randomness, shared by every mechanism.

Every random draw a privacy mechanism makes — Poisson membership, user row subsets, gradient
noise, the adaptive-clipping count noise, forward-LDP noise, label randomized response, the
DP-SelFT histograms, the split client's noise — comes from one :class:`Randomness` per run,
through :meth:`Randomness.stream`. Each mechanism asks for its own *stream* (a name and parts
such as the step and the tensor's name), so streams never share draws and a step's draw does
not depend on how many draws came before it.

Secure (the default): the root key is 32 bytes from the OS CSPRNG (``secrets.token_bytes``).
It lives in memory only: it is never written to a recipe, checkpoint, report or log, cannot be
pickled, and is not shown by ``repr``. A resumed run therefore draws a fresh key, and the steps
it replays are *new* releases; the run's live ledger (``ledger.json``, written after every
release) keeps every release ever made, so nothing is spent twice without a record.

Reproducible (``privacy.reproducible: true``, for research and tests): the key is derived
from the recorded recipe seed. Two runs with the same seed draw the same batches and noise.
The ε of such a run holds only while the seed stays secret: whoever knows it can regenerate
the noise and subtract it. Reports say so in their headline.

How a draw is made, and its entropy
-----------------------------------
torch's generators keep little of a seed: the CPU generator (MT19937) keeps only the low 32
bits of ``manual_seed``, so one stream seeded that way has 2³² possible outcomes and a seed
search recovers the clean value from one release (``benchmarks/seed_search.py``); CUDA's
Philox keeps a 64-bit seed. dpft therefore never seeds a mechanism's draw with one seed:

1. stream secret = BLAKE2b-256 keyed with the full 256-bit root key, of (name, parts) —
   parts are ints or strings, type-tagged and length-prefixed so no two streams coincide;
2. draw material of the stream's i-th draw on a device type = SHAKE-256(stream secret,
   device type, i), cut into one *different* slice per generator;
3. every draw combines k independent ``torch.Generator`` s, one per slice:

   * normal: ``(z₁ + … + z_k)/√k`` (k = 4: ``/2``, exact) — N(0, 1), the same law and cost as
     the "hardened" sum of four normals (Opacus ``secure_mode``) this replaced, with a denser
     support against floating-point attacks (Mironov 2012; Jin et al. 2022);
   * uniform: ``((m₁ + … + m_k) mod 2⁵³) · 2⁻⁵³`` in float64, each mⱼ uniform on
     ``[0, 2⁵³)`` — exactly uniform on the 2⁵³-point grid if any one mⱼ is;
   * bernoulli(p): ``m < ⌊p·2⁵³⌋`` on that sum, so the rate is ``⌊p·2⁵³⌋/2⁵³ ≤ p`` exactly
     (never above p: a higher sampling rate or keep probability would be against privacy);
   * randint(n): ``(r₁ + … + r_k) mod n``; permutation(n): ``π₁∘…∘π_k``.

Entropy per draw, by device (what a seed search must guess):

* CPU (default, verified at first use): each of k = 4 MT19937 generators gets its *full*
  624-word state (19 968 bits) from SHAKE-256 of its own 256-bit slice, written with
  ``Generator.set_state``. Every generator alone depends on 256 secret bits, so there is no
  32-bit seed to search and no meet-in-the-middle over the 4 generators: 256 bits per draw
  (bounded by the key). The state layout (torch 2.13: ``CPUGeneratorImplState``, 5056
  bytes, words at byte 24 as uint64) is checked once per process by a round trip — torch's
  own ``manual_seed`` state rebuilt by our writer must give the same draws, and our state must
  read back byte for byte and change the draws when its last word changes.
* CPU fallback (only if that check fails, e.g. a future torch changes the layout; a warning
  says so): k = 8 MT19937 generators, each ``manual_seed``-ed with a different 64-bit slice,
  of which MT keeps 32: 8 × 32 = 256 bits; a meet-in-the-middle over two halves of 4 costs
  2¹²⁸ time and memory, so ≥ 128 bits.
* CUDA: k = 4 Philox4x32-10 generators on the tensor's device, each seeded with a different
  64-bit slice (Philox's key is the full 64-bit seed): 4 × 64 = 256 bits; a meet-in-the-middle
  over pairs costs 2¹²⁸, so ≥ 128 bits. Nothing is drawn on the CPU or copied.
* any other device (MPS, XPU, …): drawn by the CPU path (256 bits) and copied to the device.

The stream secret depends on the device *type*, never its index: under DDP every rank holds
the same tensor on its own ``cuda:r`` and must draw the same noise. Tensors of one release are
kept apart by their names (``GaussianMechanism`` draws stream ``noise``, (step, name)), so two
same-shaped tensors on cuda:0 and cuda:1 of one process never get the same noise.

``privacy.hardened_noise`` is still accepted for compatibility; draws are always the k-sum.

Plain, non-secret generators remain only where nothing private is released: the audit
harness's canary and filler data, DP-SelFT's public train/validation split and candidate
generation seeds, selection scoring on synthetic data, the RMT randomized SVD (post-processing
of the noisy sum), forward-LDP autoencoder pre-training on public text, and dropout masks
(:meth:`Randomness.seed_for`, secret but not a mechanism).

Source: DESIGN.md "Randomness"; issues 13 and 23.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Union

import torch

__all__ = ["Randomness", "SecretStream", "cpu_full_state_ok"]

Device = Union[str, torch.device, None]

#: Generators per draw on each device path (see the module docstring).
K_GENERATORS = 4
K_CPU_FALLBACK = 8
_BITS53 = 1 << 53
_MASK53 = _BITS53 - 1
_MT_N = 624
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState) in torch 2.x
_WORDS_AT = 24  # legacy_pod.state[624] (uint64 each): after seed (8), left (4), seeded (4), next (8)


# ------------------------------------------------------------------------- encodings
def _tag(p) -> bytes:
    """Type-tagged, length-prefixed encoding of one stream part (int or str)."""
    if isinstance(p, str):
        b = p.encode()
        return b"s" + len(b).to_bytes(8, "little") + b
    if isinstance(p, (int,)) or hasattr(p, "__index__"):
        return b"i" + int(p).to_bytes(16, "little", signed=True)
    raise TypeError(f"stream parts must be ints or strings, got {type(p).__name__}")


def _dev(device: Device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# ------------------------------------------------------------------- CPU full MT state
def _init_genrand(seed: int) -> list[int]:
    """Reference MT19937 ``init_genrand`` (what torch's ``manual_seed`` does on CPU)."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, _MT_N):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    return mt


_TEMPLATE_T: torch.Tensor | None = None
_CPU_OK: bool | None = None
_LOCK = threading.Lock()


def _mt_state_bytes(words: Sequence[int] | bytes) -> torch.Tensor:
    """A ``CPUGeneratorImplState`` whose MT19937 state is ``words`` (624 uint32, or their
    2496 little-endian bytes), with ``left = 1, next = 0`` (the next output first twists the
    state, as after ``manual_seed``), seeded, no cached normal, and ``initial_seed`` 0."""
    w = torch.frombuffer(bytearray(words), dtype=torch.int32) if isinstance(words, (bytes, bytearray)) \
        else torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)
    out = _TEMPLATE_T.clone()
    out[_WORDS_AT:_WORDS_AT + 8 * _MT_N].view(torch.int64).copy_(w.to(torch.int64) & 0xFFFFFFFF)
    return out


def _template(st: bytes) -> torch.Tensor:
    """Torch's state bytes with every field but the words fixed: seed 0 (nothing to leak),
    left 1, seeded 1, next 0, no cached double or float normal."""
    buf = bytearray(st)
    struct.pack_into("<qiiQ", buf, 0, 0, 1, 1, 0)
    struct.pack_into("<dddi", buf, _WORDS_AT + 8 * _MT_N, 0.0, 0.0, 0.0, 0)
    struct.pack_into("<f?", buf, _STATE_BYTES - 8, 0.0, False)
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def cpu_full_state_ok() -> bool:
    """Whether this torch's CPU generator state has the layout dpft writes (checked once per
    process; see the module docstring). False → the 8-generator ``manual_seed`` fallback."""
    global _TEMPLATE_T, _CPU_OK
    if _CPU_OK is not None:
        return _CPU_OK
    with _LOCK:
        if _CPU_OK is not None:
            return _CPU_OK
        ok = False
        try:
            g0 = torch.Generator()
            st = bytes(g0.get_state().tolist())
            if len(st) == _STATE_BYTES:
                _TEMPLATE_T = _template(st)
                x = 0x9E3779B9
                g1 = torch.Generator().manual_seed(x)
                s1 = bytes(g1.get_state().tolist())
                ref = _init_genrand(x)
                head = struct.unpack_from("<qiiQ", s1, 0)
                words = list(struct.unpack_from(f"<{_MT_N}Q", s1, _WORDS_AT))
                ok = head == (x, 1, 1, 0) and words == ref
                if ok:  # torch reads the words where we write them: same draws as manual_seed
                    g2 = torch.Generator()
                    g2.set_state(_mt_state_bytes(ref))
                    ok = torch.equal(torch.rand(400, dtype=torch.float64, generator=g1),
                                     torch.rand(400, dtype=torch.float64, generator=g2))
                if ok:  # a state of our own round-trips, and every word matters (the last one)
                    w = list(struct.unpack(f"<{_MT_N}I", hashlib.shake_256(b"dpft-layout-check").digest(4 * _MT_N)))
                    s = _mt_state_bytes(w)
                    g3 = torch.Generator()
                    g3.set_state(s)
                    ok = torch.equal(g3.get_state(), s)
                    a = torch.rand(400, dtype=torch.float64, generator=g3)
                    w[-1] ^= 1 << 17
                    g3.set_state(_mt_state_bytes(w))
                    ok = ok and not torch.equal(a, torch.rand(400, dtype=torch.float64, generator=g3))
        except Exception:  # noqa: BLE001 - any surprise in the layout means: do not use it
            ok = False
        if not ok:
            warnings.warn("dpft: torch's CPU generator state layout is not the one dpft writes; CPU draws "
                          f"fall back to {K_CPU_FALLBACK} MT19937 generators seeded with manual_seed "
                          "(≥ 128 bits per draw, not 256)", RuntimeWarning, stacklevel=2)
        _CPU_OK = ok
        return ok


# ------------------------------------------------------------------------ generators
def _plan(device: torch.device) -> tuple[str, int, int]:
    """(path, generators per draw, bytes of seed material per generator) for a device."""
    if device.type == "cuda":
        return "philox", K_GENERATORS, 8
    if cpu_full_state_ok():
        return "mt-state", K_GENERATORS, 32
    return "mt-seed", K_CPU_FALLBACK, 8


def _make_generators(seeds: Sequence[bytes], device: torch.device) -> list[torch.Generator]:
    """One fresh ``torch.Generator`` per seed slice (on ``device`` for CUDA, else CPU)."""
    path, _, width = _plan(device)
    gens = []
    for s in seeds:
        if len(s) != width:
            raise ValueError(f"seed material for a {path} generator must be {width} bytes, got {len(s)}")
        if path == "philox":
            g = torch.Generator(device=device)
            g.manual_seed(int.from_bytes(s, "little"))  # all 64 bits: Philox's key
        elif path == "mt-state":
            g = torch.Generator()
            g.set_state(_mt_state_bytes(hashlib.shake_256(b"dpft-mt19937\x00" + s).digest(4 * _MT_N)))
        else:
            g = torch.Generator()
            g.manual_seed(int.from_bytes(s, "little"))  # MT keeps the low 32 bits (fallback, see doc)
        gens.append(g)
    return gens


class SecretStream:
    """Secret draws of one stream (:meth:`Randomness.stream`); each call is a new draw.

    Every call (``normal``, ``uniform``, …) is the stream's next draw i = 0, 1, …: its k
    generators are seeded afresh from draw material of (stream secret, device type, i), so
    two calls never share draws. See the module docstring for the entropy per device.

    Args:
        secret: the 32-byte stream secret (derived by :meth:`Randomness.stream`).
        device: default device of the draws (CPU if None); each method also takes ``device``.
    """

    def __init__(self, secret: bytes, device: Device = None):
        self._secret = bytes(secret)
        self.device = _dev(device)
        self._count = 0

    def __repr__(self) -> str:
        return f"SecretStream(device={self.device}, draws={self._count})"

    def __getstate__(self):
        raise TypeError("a dpft SecretStream holds secret material and cannot be pickled or saved")

    def __reduce_ex__(self, protocol):
        raise TypeError("a dpft SecretStream holds secret material and cannot be pickled or saved")

    # -- seeding (hooks for tests and audit checks) ---------------------------------------
    def _seeds(self, device: torch.device, index: int) -> list[bytes]:
        """Per-generator seed slices of draw ``index`` on ``device``: SHAKE-256 of (stream
        secret, device type, index), cut into k different slices."""
        _, k, width = _plan(device)
        x = hashlib.shake_256(b"dpft-draw-v2\x00" + self._secret + _tag(device.type) + _tag(index)).digest(k * width)
        return [x[j * width:(j + 1) * width] for j in range(k)]

    def _generators(self, device: Device) -> tuple[list[torch.Generator], torch.device]:
        dev = self.device if device is None else _dev(device)
        gdev = dev if dev.type == "cuda" else torch.device("cpu")
        i = self._count
        self._count += 1
        return _make_generators(self._seeds(gdev, i), gdev), dev

    # -- draws -----------------------------------------------------------------------------
    def _summed(self, device: Device, draw: Callable) -> tuple[torch.Tensor, int, torch.device]:
        """``Σⱼ draw(gⱼ, gdev)`` over this draw's k generators (on the generators' device), k, and
        the device the caller wants the result on."""
        gens, dev = self._generators(device)
        gdev = gens[0].device
        out = draw(gens[0], gdev)
        for g in gens[1:]:
            out.add_(draw(g, gdev))
        return out, len(gens), dev

    def normal(self, shape, dtype: torch.dtype = torch.float32, device: Device = None) -> torch.Tensor:
        """Standard normal ``shape`` tensor: ``(z₁ + … + z_k)/√k`` of k independent generators."""
        out, k, dev = self._summed(device, lambda g, d: torch.randn(shape, generator=g, device=d, dtype=dtype))
        return out.mul_(1.0 / math.sqrt(k)).to(dev)  # 1/√4 = 0.5 exactly

    def _ints53(self, shape, device: Device = None) -> torch.Tensor:
        """int64 ``shape`` tensor uniform on ``[0, 2⁵³)``: Σ mⱼ mod 2⁵³ of k generators."""
        m, _, dev = self._summed(device, lambda g, d: torch.randint(0, _BITS53, shape, generator=g, device=d,
                                                                    dtype=torch.int64))
        return m.bitwise_and_(_MASK53).to(dev)

    def uniform(self, shape, device: Device = None) -> torch.Tensor:
        """float64 ``shape`` tensor uniform on the grid ``{m·2⁻⁵³ : 0 ≤ m < 2⁵³}`` ⊂ [0, 1)."""
        return self._ints53(shape, device).to(torch.float64).mul_(2.0 ** -53)

    def bernoulli(self, shape, p: float, device: Device = None) -> torch.Tensor:
        """bool ``shape`` tensor, each True with probability exactly ``⌊p·2⁵³⌋/2⁵³`` (≤ p, less
        by under 2⁻⁵³): the comparison is on 53-bit integers, never float32.

        Raises:
            ValueError: p outside [0, 1].
        """
        p = float(p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {p}")
        threshold = math.floor(p * _BITS53)  # p·2⁵³ is exact in float64 (a power-of-two scaling)
        return self._ints53(shape, device) < threshold

    def randint(self, high: int, shape, device: Device = None) -> torch.Tensor:
        """int64 ``shape`` tensor uniform on ``[0, high)``: Σ rⱼ mod high of k generators.

        Raises:
            ValueError: high < 1 or high > 2⁵³.
        """
        high = int(high)
        if not 1 <= high <= _BITS53:
            raise ValueError(f"randint needs 1 ≤ high ≤ 2^53, got {high}")
        r, _, dev = self._summed(device, lambda g, d: torch.randint(0, high, shape, generator=g, device=d,
                                                                    dtype=torch.int64))
        return r.remainder_(high).to(dev)

    def permutation(self, n: int, device: Device = None) -> torch.Tensor:
        """int64 random permutation of ``range(n)``: the composition of k independent ones."""
        gens, dev = self._generators(device)
        gdev = gens[0].device
        p = torch.randperm(int(n), generator=gens[0], device=gdev)
        for g in gens[1:]:
            p = p[torch.randperm(int(n), generator=g, device=gdev)]
        return p.to(dev)


class _FixedSeedStream(SecretStream):
    """A stream whose every draw uses the given per-generator seed slices (tests and audit
    checks only: it shows what the draws depend on; never used by a mechanism)."""

    def __init__(self, seeds: Sequence[bytes], device: Device = None):
        super().__init__(b"\x00" * 32, device)
        self._fixed = [bytes(s) for s in seeds]

    def _seeds(self, device: torch.device, index: int) -> list[bytes]:
        return list(self._fixed)


class Randomness:
    """The run's secret randomness.

    Args:
        seed: None (default) = secure: a 256-bit key from the OS CSPRNG, never written.
            An int = reproducible: the key is derived from ``seed`` (recorded by the caller).

    Use :meth:`stream` for a mechanism's draws. Stream names in use: ``sample`` (Poisson
    membership, per step), ``user_rows`` (user-level row subsets, per step), ``noise``
    (gradient noise, per step and tensor name), ``count`` (adaptive-clipping count noise, per
    step), ``ldp`` / ``ldp_eval`` (forward-LDP noise), ``label_rr`` (randomized response),
    ``synth`` (DP-SelFT histograms). :meth:`seed_for` (``dropout``, ``ddp-same-key``) is for
    non-mechanism seeds only.
    """

    def __init__(self, seed: int | None = None):
        if seed is None:
            self._key = secrets.token_bytes(32)
            self.reproducible = False
        else:
            self._key = hashlib.sha256(b"dpft-reproducible-seed:" + str(int(seed)).encode()).digest()
            self.reproducible = True
        self._stream_factory: Callable[..., SecretStream] | None = None

    @classmethod
    def from_key(cls, key: bytes) -> Randomness:
        """A source with a given 32-byte key (DDP: rank 0 draws the key and broadcasts it)."""
        if len(key) != 32:
            raise ValueError("Randomness key must be 32 bytes")
        r = cls.__new__(cls)
        r._key = bytes(key)
        r.reproducible = False
        r._stream_factory = None
        return r

    @classmethod
    def _with_streams(cls, factory: Callable[..., SecretStream]) -> Randomness:
        """A source whose :meth:`stream` returns ``factory(name, *parts, device=device)``.
        Tests and audit checks only (explicit seed material, planted bugs)."""
        r = cls.from_key(b"\x00" * 32)
        r._stream_factory = factory
        return r

    def child(self, name: str) -> Randomness:
        """An independent source for a sub-run (e.g. DP-SFT's stage 1): its streams never
        coincide with this source's, in secure and reproducible mode alike."""
        r = Randomness.__new__(Randomness)
        r._key = hashlib.blake2b(b"child:" + name.encode(), key=self._key, digest_size=32).digest()
        r.reproducible = self.reproducible
        r._stream_factory = None
        return r

    def key_tensor(self) -> torch.Tensor:
        """The key as a uint8 tensor (32,), for ``torch.distributed.broadcast`` only."""
        return torch.tensor(list(self._key), dtype=torch.uint8)

    # -- never leak the key --------------------------------------------------------------
    def __repr__(self) -> str:
        return f"Randomness(reproducible={self.reproducible})"

    def __getstate__(self):
        raise TypeError("dpft.privacy.Randomness holds the run's secret key and cannot be pickled or saved")

    def __reduce_ex__(self, protocol):
        raise TypeError("dpft.privacy.Randomness holds the run's secret key and cannot be pickled or saved")

    # -- streams ---------------------------------------------------------------------------
    def stream(self, name: str, *parts: int | str, device: Device = None) -> SecretStream:
        """The secret draws of stream ``(name, *parts)`` (see the module docstring).

        Args:
            name: the mechanism's stream name (e.g. ``"noise"``).
            parts: ints (step, index) or strings (tensor name) that tell its draws apart.
            device: default device of the draws (CPU if None).

        Returns:
            A fresh :class:`SecretStream`: its first draw is the same for the same key and
            (name, parts), whatever was drawn before.
        """
        if getattr(self, "_stream_factory", None) is not None:
            return self._stream_factory(name, *parts, device=device)
        h = hashlib.blake2b(key=self._key, digest_size=32, person=b"dpft-stream-v2")
        h.update(_tag(name))
        for p in parts:
            h.update(_tag(p))
        return SecretStream(h.digest(), device)

    def seed_for(self, stream: str, *parts: int) -> int:
        """63-bit seed of ``(stream, *parts)``: keyed BLAKE2b, unpredictable without the key.

        For non-mechanism seeds only (dropout masks, the DDP same-key check): a torch
        generator seeded with it keeps 32 bits on CPU. Mechanisms use :meth:`stream`."""
        h = hashlib.blake2b(key=self._key, digest_size=8)
        h.update(stream.encode())
        for p in parts:
            h.update(b"|" + int(p).to_bytes(16, "little", signed=True))
        return int.from_bytes(h.digest(), "little") >> 1
