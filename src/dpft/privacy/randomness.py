"""The run's one secret source of randomness, shared by every mechanism.

Every random draw a privacy mechanism makes — Poisson membership, gradient noise, the
adaptive-clipping count noise, forward-LDP noise, label randomized response, the DP-SelFT
histograms, the split client's noise — comes from one :class:`Randomness` per run. Each
mechanism asks for its own *stream* (a name and integers such as the step), so streams never
share draws and a step's draw does not depend on how many draws came before it.

Secure (the default): the root key is 32 bytes from the OS CSPRNG (``secrets.token_bytes``).
It lives in memory only: it is never written to a recipe, checkpoint, report or log, cannot be
pickled, and is not shown by ``repr``. A resumed run therefore draws a fresh key, and the steps
it replays are *new* releases; the run's live ledger (``ledger.json``, written after every
release) keeps every release ever made, so nothing is spent twice without a record.

Reproducible (``privacy.reproducible: true``, for research and tests): the key is derived
from the recorded recipe seed. Two runs with the same seed draw the same batches and noise.
The ε of such a run holds only while the seed stays secret: whoever knows it can regenerate
the noise and subtract it. Reports say so in their headline.

How draws are made: the per-stream seed is a keyed BLAKE2b hash of (stream, parts) under the
root key, truncated to 63 bits, seeding a ``torch.Generator`` (MT19937 on CPU, Philox on
CUDA). The generators are fast but not cryptographic; their 63-bit seeds are unpredictable
without the 256-bit key. Floating-point attacks on the Gaussian sampler (Mironov 2012; Jin et
al. 2022, "Are we there yet? Timing and floating-point attacks on differential privacy
systems") exploit the gaps in the set of floats a single sampled Gaussian can take. Like
Opacus's ``secure_mode``, :meth:`gaussian` can draw the noise as the sum of four independent
standard normals divided by 2 (the same N(0, 1) law, a much denser support); dpft does this
by default (``privacy.hardened_noise``). Neither dpft nor Opacus makes the float sampler
provably immune; the guarantee printed is the one for the ideal Gaussian mechanism.

Source: DESIGN.md "Randomness"; issue 13.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Optional, Union

import torch

__all__ = ["Randomness"]

Device = Union[str, torch.device, None]


class Randomness:
    """The run's secret randomness.

    Args:
        seed: None (default) = secure: a 256-bit key from the OS CSPRNG, never written.
            An int = reproducible: the key is derived from ``seed`` (recorded by the caller).

    Use :meth:`generator` for a ``torch.Generator`` of one stream, or :meth:`gaussian` /
    :meth:`uniform` for draws. Stream names in use: ``sample`` (Poisson membership, per step),
    ``noise`` (gradient noise, per step), ``count`` (adaptive-clipping count noise, per step),
    ``ldp`` (forward-LDP noise), ``label_rr`` (randomized response), ``synth`` (DP-SelFT
    histograms), ``dropout`` (dropout masks; not a mechanism, kept secret anyway).
    """

    def __init__(self, seed: Optional[int] = None):
        if seed is None:
            self._key = secrets.token_bytes(32)
            self.reproducible = False
        else:
            self._key = hashlib.sha256(b"dpft-reproducible-seed:" + str(int(seed)).encode()).digest()
            self.reproducible = True

    @classmethod
    def from_key(cls, key: bytes) -> "Randomness":
        """A source with a given 32-byte key (DDP: rank 0 draws the key and broadcasts it)."""
        if len(key) != 32:
            raise ValueError("Randomness key must be 32 bytes")
        r = cls.__new__(cls)
        r._key = bytes(key)
        r.reproducible = False
        return r

    def child(self, name: str) -> "Randomness":
        """An independent source for a sub-run (e.g. DP-SFT's stage 1): its streams never
        coincide with this source's, in secure and reproducible mode alike."""
        r = Randomness.__new__(Randomness)
        r._key = hashlib.blake2b(b"child:" + name.encode(), key=self._key, digest_size=32).digest()
        r.reproducible = self.reproducible
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
    def seed_for(self, stream: str, *parts: int) -> int:
        """63-bit seed of ``(stream, *parts)``: keyed BLAKE2b, unpredictable without the key."""
        h = hashlib.blake2b(key=self._key, digest_size=8)
        h.update(stream.encode())
        for p in parts:
            h.update(b"|" + int(p).to_bytes(16, "little", signed=True))
        return int.from_bytes(h.digest(), "little") >> 1

    def generator(self, stream: str, *parts: int, device: Device = None) -> torch.Generator:
        """A fresh ``torch.Generator`` on ``device`` (CPU by default) for one stream."""
        g = torch.Generator(device=device) if device is not None else torch.Generator()
        g.manual_seed(self.seed_for(stream, *parts))
        return g

    @staticmethod
    def gaussian(shape, generator: torch.Generator, hardened: bool = True, device: Device = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws of ``shape``; ``hardened`` = Σ of 4 normals / 2 (Opacus secure_mode)."""
        dev = device if device is not None else generator.device
        if not hardened:
            return torch.randn(shape, generator=generator, device=dev, dtype=dtype)
        out = torch.randn(shape, generator=generator, device=dev, dtype=dtype)
        for _ in range(3):
            out.add_(torch.randn(shape, generator=generator, device=dev, dtype=dtype))
        return out.mul_(0.5)
