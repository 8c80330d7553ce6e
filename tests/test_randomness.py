"""The mechanisms' secret randomness (privacy/randomness.py; issue 23 findings 1, 5, 7): every
draw depends on every key bit and on no 32-bit projection of its seeds, streams never coincide
(per tensor, per device), laws are exact, samplers compare 53-bit integers, reproducible mode
reproduces, and the audit's randomness checks catch their planted bugs."""

import math
import pickle

import pytest
import torch

from dpft.privacy import randomness as R
from dpft.privacy.label_rr import randomized_response
from dpft.privacy.ldp import GaussianLDP
from dpft.privacy.randomness import (
    Randomness,
    SecretStream,
    _FixedSeedStream,
    _plan,
    cpu_full_state_ok,
)
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler, UserPoissonSampler

torch.set_num_threads(1)

KEY = bytes(range(32))


def _flip(b: bytes, bit: int) -> bytes:
    x = bytearray(b)
    x[bit // 8] ^= 1 << (bit % 8)
    return bytes(x)


# ------------------------------------------------------------------------------ entropy
def test_cpu_generators_get_their_full_state_on_this_torch():
    """The layout check passes on the pinned torch, so CPU draws use 4 full-state MT19937s
    (the 32-bit manual_seed fallback is not silently in use)."""
    assert cpu_full_state_ok()
    assert _plan(torch.device("cpu")) == ("mt-state", 4, 32)
    assert _plan(torch.device("cuda", 1)) == ("philox", 4, 8)


def test_full_state_writer_matches_torch_manual_seed():
    """Our state writer, given MT19937's init_genrand words, reproduces torch's manual_seed draws;
    a state of our own reads back byte for byte."""
    x = 123456789
    g1 = torch.Generator().manual_seed(x)
    g2 = torch.Generator()
    g2.set_state(R._mt_state_bytes(R._init_genrand(x)))
    assert torch.equal(torch.randn(100, generator=g1), torch.randn(100, generator=g2))
    s = R._mt_state_bytes(bytes(range(256)) * 9 + bytes(192))
    g2.set_state(s)
    assert torch.equal(g2.get_state(), s)


@pytest.mark.parametrize("draw", ["normal", "uniform"])
def test_every_key_bit_changes_the_draw(draw):
    base = getattr(Randomness.from_key(KEY).stream("noise", 0, "w"), draw)((4,))
    for bit in range(256):
        other = getattr(Randomness.from_key(_flip(KEY, bit)).stream("noise", 0, "w"), draw)((4,))
        assert not torch.equal(base, other), bit


def test_every_bit_of_every_generator_seed_slice_changes_the_draw():
    _, k, width = _plan(torch.device("cpu"))
    seeds = [bytes([j]) * width for j in range(k)]
    base = _FixedSeedStream(seeds).normal((4,))
    for j in range(k):
        for bit in range(8 * width):
            s = list(seeds)
            s[j] = _flip(s[j], bit)
            assert not torch.equal(_FixedSeedStream(s).normal((4,)), base), (j, bit)


def _agree_in_window(a: list[bytes], other: list[bytes], w: int) -> list[bytes]:
    return [o[:w] + s[w:w + 4] + o[w + 4:] for s, o in zip(a, other)]


def test_seeds_agreeing_in_any_32_bit_window_give_different_draws():
    """Two seed sets whose every generator agrees in one aligned 32-bit window (the low 32 bits:
    what torch's manual_seed keeps; and every other window) but differ elsewhere draw
    differently. A scheme whose generators keep 32 bits fails this for the low window."""
    _, k, width = _plan(torch.device("cpu"))
    a = [bytes([7 * j + 1]) * width for j in range(k)]
    other = [bytes([200 - j]) * width for j in range(k)]
    base = _FixedSeedStream(a)
    draws = {"normal": base.normal((8,)), "uniform": base.uniform((8,)), "randint": base.randint(1000, (8,))}
    for w in range(0, width, 4):
        s = _FixedSeedStream(_agree_in_window(a, other, w))
        assert not torch.equal(s.normal((8,)), draws["normal"]), w
        assert not torch.equal(s.uniform((8,)), draws["uniform"]), w
        assert not torch.equal(s.randint(1000, (8,)), draws["randint"]), w
    # the test has teeth: generators that keep the low 32 bits of their seed draw the same
    from dpft.audit.checks_randomness import _Seed32FixedStream

    b = _agree_in_window(a, other, 0)
    assert torch.equal(_Seed32FixedStream(a).normal((8,)), _Seed32FixedStream(b).normal((8,)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_philox_keeps_all_64_bits_of_each_seed():  # pragma: no cover - GPU only
    _, k, width = _plan(torch.device("cuda"))
    a = [bytes([j + 1]) * width for j in range(k)]
    base = _FixedSeedStream(a, device="cuda").normal((8,))
    for j in range(k):
        for bit in range(64):
            s = list(a)
            s[j] = _flip(s[j], bit)
            assert not torch.equal(_FixedSeedStream(s, device="cuda").normal((8,)), base), (j, bit)


def test_fallback_path_still_draws_from_eight_generators(monkeypatch):
    monkeypatch.setattr(R, "_CPU_OK", False)
    assert _plan(torch.device("cpu")) == ("mt-seed", 8, 8)
    z = Randomness(0).stream("t").normal((100_000,))
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
    assert not torch.equal(Randomness.from_key(KEY).stream("t").normal((4,)),
                           Randomness.from_key(_flip(KEY, 200)).stream("t").normal((4,)))


# ------------------------------------------------------------------------------ streams
def test_streams_never_coincide():
    r = Randomness.from_key(KEY)
    names = [("noise", 0, "w"), ("noise", 0, "v"), ("noise", 1, "w"), ("noise", 0, 1), ("noise", 0, "1"),
             ("noise", 10), ("noise", 1, 0), ("sample", 0), ("count", 0), ("ldp", 0)]
    draws = [r.stream(*n).normal((8,)) for n in names]
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.equal(draws[i], draws[j]), (names[i], names[j])
    s = r.stream("noise", 0, "w")
    assert not torch.equal(s.normal((8,)), s.normal((8,)))  # successive draws of one stream
    # a stream's first draw does not depend on what was drawn elsewhere before
    assert torch.equal(r.stream("noise", 0, "w").normal((8,)), draws[0])
    with pytest.raises(TypeError, match="ints or strings"):
        r.stream("noise", 1.5)


def test_same_shaped_tensors_of_one_release_get_different_noise():
    mech = GaussianMechanism(1.0, 1.0, Randomness.from_key(KEY))
    out = mech.add_noise({"a.w": torch.zeros(3, 5), "b.w": torch.zeros(3, 5)}, 7)
    assert not torch.equal(out["a.w"], out["b.w"])
    # devices, simulated by the streams the mechanism takes for cuda:0 and cuda:1
    z0 = mech.noise_stream(7, "a.w", torch.device("cuda", 0)).normal((15,), device="cpu")
    z1 = mech.noise_stream(7, "b.w", torch.device("cuda", 1)).normal((15,), device="cpu")
    assert not torch.equal(z0, z1)
    # ...while one tensor's stream is the same on every rank's device (DDP draws one noise)
    s0 = mech.noise_stream(7, "a.w", torch.device("cuda", 0))
    s1 = mech.noise_stream(7, "a.w", torch.device("cuda", 1))
    assert s0._seeds(torch.device("cuda", 0), 0) == s1._seeds(torch.device("cuda", 1), 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_get_different_noise():  # pragma: no cover - GPU only
    mech = GaussianMechanism(1.0, 1.0, Randomness())
    out = mech.add_noise({"a": torch.zeros(64, device="cuda:0"), "b": torch.zeros(64, device="cuda:1")}, 0)
    assert out["a"].device.index == 0 and out["b"].device.index == 1
    assert not torch.equal(out["a"].cpu(), out["b"].cpu())


# ------------------------------------------------------------------------------ laws
def test_laws():
    s = Randomness(1).stream("law")
    z = s.normal((400_000,))
    assert z.dtype == torch.float32 and abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    z64 = s.normal((200_000,), dtype=torch.float64)
    assert z64.dtype == torch.float64 and abs(float(z64.std()) - 1) < 0.01
    assert abs(float((z64 ** 4).mean()) - 3) < 0.1  # Gaussian kurtosis
    u = s.uniform((400_000,))
    assert u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    m = u * 2.0 ** 53
    assert torch.equal(m, m.floor())  # the 53-bit grid, every bit used
    assert float((m.remainder(2) == 1).double().mean()) == pytest.approx(0.5, abs=0.005)  # lowest bit random
    r = s.randint(5, (100_000,))
    counts = torch.bincount(r, minlength=5).double() / 100_000
    assert r.min() >= 0 and r.max() < 5 and torch.allclose(counts, torch.full((5,), 0.2, dtype=torch.float64),
                                                          atol=0.006)
    p = s.permutation(50)
    assert sorted(p.tolist()) == list(range(50))
    b = s.bernoulli((200_000,), 0.3)
    assert b.dtype == torch.bool and float(b.double().mean()) == pytest.approx(0.3, abs=0.004)
    with pytest.raises(ValueError):
        s.bernoulli((2,), 1.5)
    assert bool(s.bernoulli((100,), 1.0).all()) and not bool(s.bernoulli((100,), 0.0).any())


class _Crafted(SecretStream):
    def __init__(self, values):
        super().__init__(b"\x00" * 32)
        self.values = values

    def _ints53(self, shape, device=None):
        return torch.tensor(self.values, dtype=torch.int64).reshape(shape)


def test_sampler_comparisons_are_exact_53_bit():
    """Membership is m < ⌊q·2⁵³⌋ on 53-bit integers: rate ≤ q exactly (float32 rand < q had
    ⌈q·2²⁴⌉/2²⁴, +19 % at q = 1e-7)."""
    q = 1e-7
    t = math.floor(q * 2 ** 53)
    assert t / 2 ** 53 <= q < (t + 1) / 2 ** 53
    assert _Crafted([t - 1, t]).bernoulli((2,), q).tolist() == [True, False]
    n, e = 64, 19
    thr = math.floor(e / n * 2 ** 53)
    vals = [thr - 1, thr] * (n // 2)
    crafted = Randomness._with_streams(lambda name, *parts, device=None: _Crafted(vals))
    assert torch.equal(PoissonSampler(n, e, crafted).indices(0), torch.arange(0, n, 2))
    assert torch.equal(UserPoissonSampler(torch.arange(n), e, 1, crafted).sampled_users(0), torch.arange(0, n, 2))


def test_poisson_rate_at_moderate_q():
    s = PoissonSampler(20_000, 200, Randomness(5))
    k = sum(len(s.indices(t)) for t in range(50))
    mu, sd = 50 * 200, math.sqrt(50 * 20_000 * 0.01 * 0.99)
    assert abs(k - mu) < 5 * sd


def test_user_rows_use_float64_keys_and_are_reproducible():
    users = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    a = UserPoissonSampler(users, 3, 2, Randomness(3))
    b = UserPoissonSampler(users, 3, 2, Randomness(3))
    assert all(torch.equal(a.indices(t), b.indices(t)) for t in range(5))
    assert Randomness(3).stream("user_rows", 0).uniform((9,)).dtype == torch.float64


# ------------------------------------------------------------------------------ modes, secrecy
def test_reproducible_reproduces_and_secure_differs():
    for draw in (lambda s: s.normal((16,)), lambda s: s.uniform((16,)), lambda s: s.randint(7, (16,)),
                 lambda s: s.permutation(16), lambda s: s.bernoulli((16,), 0.5)):
        assert torch.equal(draw(Randomness(11).stream("x", 2)), draw(Randomness(11).stream("x", 2)))
        assert not torch.equal(draw(Randomness(11).stream("x", 2)), draw(Randomness(12).stream("x", 2)))
    assert not torch.equal(Randomness().stream("x").normal((16,)), Randomness().stream("x").normal((16,)))
    assert torch.equal(PoissonSampler(500, 50, Randomness(4)).indices(3), PoissonSampler(500, 50, Randomness(4)).indices(3))
    assert not torch.equal(PoissonSampler(500, 50, Randomness()).indices(3),
                           PoissonSampler(500, 50, Randomness()).indices(3))


def test_key_and_streams_cannot_be_pickled_or_printed():
    r = Randomness()
    s = r.stream("noise", 0)
    for obj in (r, s):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)
    assert r._key.hex() not in repr(r) and s._secret.hex() not in repr(s)
    assert not hasattr(r, "generator") and not hasattr(Randomness, "gaussian")  # no 32-bit generator for a mechanism


def test_mechanisms_refuse_plain_torch_generators():
    with pytest.raises(TypeError, match="SecretStream"):
        GaussianLDP(1.0, 1.0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="SecretStream"):
        randomized_response(torch.tensor([0, 1]), 1.0, 2, torch.Generator().manual_seed(0))
    layer = GaussianLDP(1.0, 1.0)  # no stream given: a fresh secret one, never torch's global generator
    torch.manual_seed(0)
    a = layer.release(torch.zeros(2, 3, 4))
    torch.manual_seed(0)
    assert not torch.equal(a, GaussianLDP(1.0, 1.0).release(torch.zeros(2, 3, 4)))
    # a copy or pickle of the layer (model deepcopy, torch.save) never carries its secret stream
    import copy

    layer.generator = Randomness().stream("ldp")
    assert copy.deepcopy(layer).generator is None and pickle.loads(pickle.dumps(layer)).generator is None
    assert layer.generator is not None


# ------------------------------------------------------------------------------ the audit checks
def test_audit_randomness_checks_pass_on_the_real_code():
    from dpft.audit.checks_randomness import randomness_checks

    checks = randomness_checks()
    assert len(checks) >= 5 and all(c.passed for c in checks), [c.row() for c in checks if not c.passed]


@pytest.mark.parametrize("planted,failing", [("seed32", "no 32-bit projection"),
                                             ("shared_device_noise", "per-tensor and per-device")])
def test_audit_randomness_checks_catch_planted_bugs(planted, failing):
    from dpft.audit.checks_randomness import randomness_checks

    failed = [c.name for c in randomness_checks(planted) if not c.passed]
    assert failed and all(failing in n for n in failed), failed
    with pytest.raises(ValueError, match="unknown planted"):
        randomness_checks("nope")


def test_seed_search_demonstration_small():
    """benchmarks/seed_search.py at toy width: the old scheme is found, the new one is not, and
    every key and seed-slice bit changes the new release."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "seed_search.py"
    spec = importlib.util.spec_from_file_location("seed_search", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.main(["--bits", "6", "--dim", "256", "--batch", "4"])
    rows = [line for line in text.splitlines() if line.startswith(("| old", "| new"))]
    assert "FOUND" in rows[0] and all("nothing" in r for r in rows[1:]), rows
    assert "256/256 one-bit key flips" in text and "1024/1024 one-bit flips" in text
