"""Audit checks of the mechanisms' randomness (issue 23, findings 1, 5 and 7).

They run the real :class:`~dpft.step.noise.GaussianMechanism`, :class:`~dpft.step.sample.PoissonSampler`
and :class:`~dpft.step.sample.UserPoissonSampler` on :class:`~dpft.privacy.randomness.Randomness`
test doubles that fix the seed material, and check:

* **key-bit dependence** — the noise of one release and one Poisson batch change when any
  one of the 256 key bits is flipped;
* **no 32-bit projection decides a draw** — two sets of per-generator seed slices that agree
  in a 32-bit window of every slice (the low 32 bits: what torch's CPU ``manual_seed`` keeps;
  and every other aligned window) but differ elsewhere give different noise. A stream whose
  generators keep only 32 bits of seed (planted ``"seed32"``, finding 1) gives the SAME noise
  for the low window, i.e. 2³² outcomes per draw, searchable from one release;
* **per-tensor and per-device streams** — two same-shaped tensors of one release get
  different noise, on one device and on two devices (simulated on a CPU-only machine by
  asking the mechanism for the streams of ``cuda:0`` and ``cuda:1``; real when two GPUs are
  present). The old per-device stream (planted ``"shared_device_noise"``, finding 5) gives
  tensors on cuda:0 and cuda:1 identical noise;
* **samplers compare 53-bit integers** — membership is ``m < ⌊q·2⁵³⌋`` for the stream's
  53-bit integers m (rate ≤ q exactly, never the ⌈q·2²⁴⌉/2²⁴ of a float32 comparison,
  finding 7), checked by feeding the real samplers crafted integers on both sides of the
  threshold.

Not wired into ``dpft audit`` here; :func:`randomness_checks` is the entry point.
"""

from __future__ import annotations

import hashlib
import math
import pickle

import torch

from dpft.audit.whitebox import Check
from dpft.privacy.randomness import (
    Randomness,
    SecretStream,
    _FixedSeedStream,
    _plan,
    cpu_full_state_ok,
)
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler, UserPoissonSampler

__all__ = ["PLANTED", "randomness_checks"]

#: Planted bugs :func:`randomness_checks` must catch.
PLANTED = ("seed32", "shared_device_noise")


# ----------------------------------------------------------------------------- planted bugs
class _Seed32FixedStream(_FixedSeedStream):
    """Planted bug ``seed32``: each generator seeded with ``manual_seed`` of its slice, keeping
    only the low 32 bits (what torch's CPU generator does with any seed)."""

    def _generators(self, device):
        dev = self.device if device is None else torch.device(device)
        i = self._count
        self._count += 1
        seeds = self._seeds(torch.device("cpu"), i)
        return [torch.Generator().manual_seed(int.from_bytes(s[:4], "little")) for s in seeds], dev


class _Seed32Stream(SecretStream):
    """Planted bug ``seed32`` on a keyed stream (used for the key-bit check)."""

    _generators = _Seed32FixedStream._generators


class _SharedDeviceNoise(GaussianMechanism):
    """Planted bug ``shared_device_noise``: the pre-issue-23 code — one stream ``noise``, step
    per device, seeded the same on every device, drawn in order by that device's tensors."""

    def add_noise(self, grad_sum, step):
        self._shared: dict = {}
        return super().add_noise(grad_sum, step)

    def noise_stream(self, step, name, device):
        cache = self.__dict__.setdefault("_shared", {})
        key = (int(step), str(torch.device(device)))
        if key not in cache:
            cache[key] = self.rng.stream("noise", int(step), device=device)
        return cache[key]


def _mechanism(rng: Randomness, planted: str | None) -> GaussianMechanism:
    cls = _SharedDeviceNoise if planted == "shared_device_noise" else GaussianMechanism
    return cls(1.0, 1.0, rng)


def _keyed(key: bytes, planted: str | None) -> Randomness:
    r = Randomness.from_key(key)
    if planted != "seed32":
        return r

    def factory(name, *parts, device=None):
        real = Randomness.stream(r, name, *parts, device=device)
        return _Seed32Stream(real._secret, device)

    return Randomness._with_streams(factory)


def _fixed(seeds: list[bytes], planted: str | None) -> Randomness:
    """A source whose every stream draws from exactly these per-generator seed slices."""
    cls = _Seed32FixedStream if planted == "seed32" else _FixedSeedStream
    return Randomness._with_streams(lambda name, *parts, device=None: cls(seeds, device))


def _noise(rng: Randomness, planted: str | None, dim: int = 32) -> torch.Tensor:
    return _mechanism(rng, planted).add_noise({"w": torch.zeros(dim)}, 0)["w"]


# ----------------------------------------------------------------------------------- checks
def _key_bits(planted: str | None) -> Check:
    key = hashlib.sha256(b"dpft-audit-randomness-key").digest()
    base = _noise(_keyed(key, planted), planted)
    base_rows = PoissonSampler(256, 128, _keyed(key, planted)).indices(0)
    same, same_rows = [], []
    for bit in range(256):
        k = bytearray(key)
        k[bit // 8] ^= 1 << (bit % 8)
        rng = _keyed(bytes(k), planted)
        if torch.equal(_noise(rng, planted), base):
            same.append(bit)
        if torch.equal(PoissonSampler(256, 128, rng).indices(0), base_rows):
            same_rows.append(bit)
    ok = not same and not same_rows
    return Check("randomness: noise and batches depend on every key bit", ok,
                 f"{256 - len(same)}/256 one-bit key flips changed the noise of a release, {256 - len(same_rows)}/256 "
                 "the Poisson batch" + (f"; unchanged for bits {(same + same_rows)[:8]}" if not ok else ""),
                 {"unchanged_noise_bits": len(same), "unchanged_batch_bits": len(same_rows)})


def _projections(planted: str | None) -> Check:
    _, k, width = _plan(torch.device("cpu"))
    a = [hashlib.shake_256(b"dpft-audit-seeds-a" + bytes([j])).digest(width) for j in range(k)]
    other = [hashlib.shake_256(b"dpft-audit-seeds-b" + bytes([j])).digest(width) for j in range(k)]
    base = _noise(_fixed(a, planted), planted)
    base_rows = PoissonSampler(256, 128, _fixed(a, planted)).indices(0)
    windows, same = list(range(0, width, 4)), []
    for w in windows:  # B agrees with A on bytes [w, w+4) of every slice, differs elsewhere
        b = [o[:w] + s[w:w + 4] + o[w + 4:] for s, o in zip(a, other)]
        if torch.equal(_noise(_fixed(b, planted), planted), base) or \
                torch.equal(PoissonSampler(256, 128, _fixed(b, planted)).indices(0), base_rows):
            same.append(w * 8)
    ok = not same
    return Check("randomness: no 32-bit projection of the seeds decides a draw", ok,
                 f"seed slices agreeing in one 32-bit window of each of the {k} generators' {8 * width}-bit "
                 f"seeds, differing elsewhere: {len(windows) - len(same)}/{len(windows)} windows gave different "
                 "noise and Poisson batches" + (f"; the SAME noise when agreeing in bits {same[:4]}.. (a generator keeps only "
                            "32 bits: 2^32 outcomes per draw, a seed search recovers the clean sum)" if same else ""),
                 {"windows": len(windows), "same": len(same), "generators": k, "seed_bits": 8 * width})


def _streams(planted: str | None) -> Check:
    rng = Randomness.from_key(hashlib.sha256(b"dpft-audit-streams").digest())
    mech = _mechanism(rng, planted)
    shape = (64,)
    # one device: two same-shaped tensors of one release
    out = mech.add_noise({"layer.0.w": torch.zeros(shape), "layer.1.w": torch.zeros(shape)}, 3)
    one_device = not torch.equal(out["layer.0.w"], out["layer.1.w"])
    # add_noise draws from noise_stream (so the device check below reads the code add_noise runs)
    mech2 = _mechanism(rng, planted)
    ref = mech2.noise_stream(3, "layer.0.w", torch.device("cpu")).normal(shape) * mech2.std
    plumbed = torch.equal(out["layer.0.w"], ref)
    # two devices, simulated: the streams the mechanism takes for tensors on cuda:0 and cuda:1
    mech3 = _mechanism(rng, planted)
    z0 = mech3.noise_stream(3, "layer.0.w", torch.device("cuda", 0)).normal(shape, device="cpu")
    z1 = mech3.noise_stream(3, "layer.1.w", torch.device("cuda", 1)).normal(shape, device="cpu")
    two_devices = not torch.equal(z0, z1)
    real = "not run (fewer than 2 CUDA devices)"
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        o = _mechanism(rng, planted).add_noise({"layer.0.w": torch.zeros(shape, device="cuda:0"),
                                                 "layer.1.w": torch.zeros(shape, device="cuda:1")}, 3)
        real_ok = not torch.equal(o["layer.0.w"].cpu(), o["layer.1.w"].cpu())
        two_devices = two_devices and real_ok
        real = "different" if real_ok else "the SAME"
    ok = one_device and two_devices and plumbed
    return Check("randomness: per-tensor and per-device noise streams are distinct", ok,
                 f"same-shaped tensors of one release: one device {'different' if one_device else 'the SAME'}, "
                 f"cuda:0 vs cuda:1 (simulated) {'different' if two_devices else 'the SAME'}, real 2 GPUs {real}; "
                 f"add_noise draws from noise_stream: {plumbed}",
                 {"one_device": one_device, "two_devices": two_devices, "plumbed": plumbed})


class _CraftedStream(SecretStream):
    """Yields crafted 53-bit integers (alternating ``lo``, ``hi``) instead of random ones."""

    def __init__(self, lo: int, hi: int):
        super().__init__(b"\x00" * 32)
        self.lo, self.hi = lo, hi

    def _ints53(self, shape, device=None):
        n = math.prod(shape) if shape else 1
        v = torch.tensor([self.lo, self.hi], dtype=torch.int64).repeat((n + 1) // 2)[:n]
        return v.reshape(shape)


def _sampler(planted: str | None) -> Check:
    n, expected = 64, 19
    q = expected / n
    thr = math.floor(q * 2 ** 53)
    crafted = Randomness._with_streams(lambda name, *parts, device=None: _CraftedStream(thr - 1, thr))
    want = torch.arange(0, n, 2)  # m = thr − 1 joins, m = thr does not
    got = PoissonSampler(n, expected, crafted).indices(0)
    ok_rows = torch.equal(got, want)
    users = torch.arange(n)
    got_u = UserPoissonSampler(users, expected, 1, crafted).sampled_users(0)
    ok_users = torch.equal(got_u, want)
    # at q = 1e-7 the rate is ⌊q·2⁵³⌋/2⁵³ ≤ q (a float32 rand < q: ⌈q·2²⁴⌉/2²⁴)
    q_small = 1e-7
    t_small = math.floor(q_small * 2 ** 53)
    s = _CraftedStream(t_small - 1, t_small)
    small_ok = s.bernoulli((2,), q_small).tolist() == [True, False] and t_small / 2 ** 53 <= q_small
    rate32 = math.ceil(q_small * 2 ** 24) / 2 ** 24
    ok = ok_rows and ok_users and small_ok
    return Check("randomness: samplers compare 53-bit integers (rate ≤ q exactly)", ok,
                 f"rows {'exact' if ok_rows else 'NOT the 53-bit comparison'}, users "
                 f"{'exact' if ok_users else 'NOT the 53-bit comparison'}; at q = 1e-7 the rate is "
                 f"{t_small / 2 ** 53:.10g} (float32 rand < q would give {rate32:.4g})",
                 {"rate_q1e-7": t_small / 2 ** 53, "float32_rate_q1e-7": rate32})


def _layout() -> Check:
    ok = cpu_full_state_ok()
    path, k, width = _plan(torch.device("cpu"))
    return Check("randomness: CPU generators seeded with their full state", True,
                 f"CPU path {path}: {k} MT19937 generators, {8 * width}-bit seed slice each"
                 + ("" if ok else " (torch's state layout changed: manual_seed fallback, 8 × 32 bits)"),
                 {"full_state": ok, "generators": k})


def _unpicklable() -> Check:
    r = Randomness()
    bad = []
    for obj in (r, r.stream("noise", 0)):
        try:
            pickle.dumps(obj)
            bad.append(type(obj).__name__)
        except TypeError:
            pass
    leaked = r._key.hex() in repr(r)
    ok = not bad and not leaked
    return Check("randomness: the key cannot be pickled or printed", ok,
                 "pickling refused, repr shows no key" if ok else f"pickled: {bad}, key in repr: {leaked}")


def randomness_checks(planted: str | None = None) -> list[Check]:
    """Run the randomness checks (about a second on a CPU).

    Args:
        planted: None (the real code), or a planted bug that at least one check must catch:
            ``"seed32"`` (every generator keeps only 32 bits of its seed) or
            ``"shared_device_noise"`` (one noise stream per (step, device), the same on every
            device).

    Returns:
        The :class:`~dpft.audit.whitebox.Check` list (all pass on the real code).

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in PLANTED:
        raise ValueError(f"unknown planted randomness bug {planted!r}; known: {PLANTED}")
    return [_layout(), _key_bits(planted), _projections(planted), _streams(planted), _sampler(planted),
            _unpicklable()]
