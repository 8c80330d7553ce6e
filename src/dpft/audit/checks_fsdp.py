"""Audit checks of the FSDP2 DP step (``perf.sharding: fsdp``; dpft/placement/fsdp.py; issue 26 item 3).

White-box, in one process (no process group needed), on the real classes of dpft/placement/fsdp.py:

* **every mechanism shards as one draw** (issues 26, 38) — one check over the mechanism family (the
  Gaussian, truncated Poisson, banded MF) through :func:`~dpft.placement.fsdp.shard_mechanism`: every
  simulated rank (K = 2, 3; FSDP's dim-0 chunk layout, :func:`~dpft.placement.fsdp.chunk_range`) adds noise
  to its shard over several steps; the shards put together must equal the noise one process draws for the
  whole tensors (the streams are disjoint and cover each element once: together exactly one N(0, σ²C²I)
  draw, whatever K; banded: the correlated y_t from per-shard buffers), and each sharded mechanism records
  its base mechanism's ledger event. The Gaussian's noise has standard deviation σC, and other tensors,
  blocks and steps get other noise. Planted ``fsdp_same_shard_stream``: every rank numbers its noise blocks
  from its own shard's start (the same streams on each rank: the shards' noise is correlated, the sum is
  not one Gaussian draw); ``fsdp_banded_whole_stream``: the sharded mechanisms draw from the whole-tensor
  stream, so every rank's shard gets the first elements of it; ``fsdp_truncation_dropped``: the sharded
  copy loses the truncation, so the ledger records a plain Poisson event for a truncated batch (ε
  understated).
* **a placeholder micro-batch adds nothing** — a rank with fewer micro-batches than another runs a
  dummy one to keep the collectives in step; it must reduce-scatter zeros, one check over the ways that open
  one: FSDPStep's :class:`~dpft.placement.fsdp.ReduceScatter` (``dpft train``, DPTrainer) and make_private's
  :class:`~dpft.api.sharded.ShardedDPOptimizer`. Planted ``fsdp_dummy_counted``: the dummy's clipped sum is
  sent (an example counted twice: sensitivity 2C); ``fsdp_api_dummy_sent``: the optimizer opens a
  placeholder as a real micro-batch (dataset row 0 added again on that rank — sensitivity above C).
* **make_private under FSDP2** (api/sharded.py) — simulated ranks' :class:`~dpft.api.sharded.ShardedMicroBatches`
  yield the same number of micro-batches per logical step (the forwards are collectives), their real
  rows are disjoint and cover the world's logical batch, short ranks fill up with placeholders. Planted
  ``fsdp_api_no_placeholder`` (each rank counts only its own micro-batches).
* **the non-private FSDP step adds nothing for a placeholder** — :class:`~dpft.placement.fsdp_plain.PlainFSDPStep`
  on a short rank (one real micro-batch, the world's count two: a placeholder runs) updates the weights
  exactly as the unsharded ``--no-dp`` step (``DPStep`` with ``NonPrivateEngine``) on the real one, and
  records no ledger event. Planted ``fsdp_plain_dummy_counted``: the placeholder's loss is not zeroed
  (row 0 counted again on that rank).
* The ways in asked for FSDP (DPTrainer, QLoRA, DPDPOTrainer) are audit/ways_in_fsdp.py's.
* **norms are complete on each rank** — on a tiny GPT-2 LM (tied embeddings), the book-keeping clipped
  sums of two simulated ranks' halves of a batch, summed and cut into FSDP shards, equal the shards of
  one process's clipped sum over the whole batch, and every example's contribution is ≤ C (each rank
  computes its examples' full-parameter norms from gathered weights: no per-shard norm).

:func:`fsdp_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from dpft.placement import fsdp, fsdp_plain
from dpft.api import sharded
from dpft.api.sharded import ShardedDPOptimizer, ShardedMicroBatches
from dpft.accounting.ledger import PrivacyLedger
from dpft.audit.planted import bug_planter, patched
from dpft.audit.whitebox import Check
from dpft.placement.world import World
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.base import NonPrivateEngine
from dpft.models.losses import causal_lm_loss
from dpft.privacy.randomness import Randomness
from dpft.step import DPStep
from dpft.step.build import build_step_spec
from dpft.step.clip import make_clip_policy
from dpft.step.correlated import BandedMFMechanism, banded_coefficients, write_secret
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler
from dpft.step.truncated import TruncatedPoissonSampler

__all__ = ["PLANTED", "fsdp_checks"]

#: Planted bugs :func:`fsdp_checks` must catch.
PLANTED = ("fsdp_same_shard_stream", "fsdp_dummy_counted", "fsdp_banded_whole_stream", "fsdp_truncation_dropped",
           "fsdp_api_no_placeholder", "fsdp_api_dummy_sent", "fsdp_plain_dummy_counted")


def _same_stream(real):
    def same_stream(mech, step, tname, numel, offset, count, device):
        # every rank starts at block 0 of its own shard: the same streams on each rank
        return real(mech, step, tname, count, 0, count, device)

    return same_stream


def _truncation_dropped(real_init):
    def drop(self, base, layout):
        real_init(self, base, layout)
        self.step_event = None

    return drop


def _own_count(self, idx):
    """Planted: each rank counts only its own micro-batches (no placeholders)."""
    mine = self.share(idx)
    return len(self.sampler.micro_batches(mine, self.max_physical)) if len(mine) else 0


def _dummy_as_real(real_begin):
    def as_real(self, *a, **k):
        self.batches.dummies = type(self.batches.dummies)(False for _ in self.batches.dummies)
        return real_begin(self, *a, **k)

    return as_real


def _restart(real_load):
    def restart(self, st, device_of=None):
        real_load(self, st, device_of)
        self.buffers = []  # the stream starts over on every rank

    return restart


def _placeholder_check() -> list[Check]:
    """A placeholder micro-batch reduce-scatters zeros, opened by FSDPStep (``dpft train``, DPTrainer: its
    :class:`~dpft.placement.fsdp.ReduceScatter` started as a placeholder) and by make_private's
    :class:`~dpft.api.sharded.ShardedDPOptimizer` (the placeholder its micro-batches queued)."""

    def fsdp_step(p):
        rs = fsdp.ReduceScatter({"p": p}, ["p"], World())
        rs.start(dummy=True)
        return rs

    def make_private(p):
        step = SimpleNamespace(spec=SimpleNamespace(mechanism=None, clip=SimpleNamespace(max_norm=1.0),
                                                    engine=SimpleNamespace(params={"p": p})), params={"p": p},
                               scatter=fsdp.ReduceScatter({"p": p}, ["p"], World()), _reshard=lambda: None)
        mb = ShardedMicroBatches(PoissonSampler(40, 8, Randomness(5)), 6, 3, 6, world=World(1, 2))
        opt = ShardedDPOptimizer(torch.optim.SGD([p], lr=0.1), step, 6, World(1, 2), mb)
        mb.dummies.extend([True])
        opt._begin_micro_batch(0, 1, True)
        return step.scatter

    out = []
    for way, opened in (("FSDPStep", fsdp_step), ("make_private", make_private)):
        p = torch.nn.Parameter(torch.ones(4, 3))
        zero = bool(torch.count_nonzero(opened(p)("p", torch.full((4, 3), 5.0))) == 0)
        out.append(Check(f"fsdp {way}: a placeholder micro-batch reduce-scatters zeros", zero,
                         "its clipped sum replaced by zeros" if zero else "the placeholder's clipped sum was sent: "
                         "its example (dataset row 0) counts again on that rank (sensitivity 2C)"))
    return out


def _mechanism_check(sigma: float = 0.9, c: float = 1.5, steps: int = 4) -> list[Check]:

    def make(kind):
        if kind == "banded_mf":
            return BandedMFMechanism(sigma, c, Randomness(11), banded_coefficients(steps, 3), 0.25)
        trunc = TruncatedPoissonSampler(200, 12, Randomness(12), 12).step_event if kind == "truncated" else None
        return GaussianMechanism(sigma, c, Randomness(11), step_event=trunc)

    shapes = {"w": (7, 4), "b": (3,), "big": (2 * fsdp.NOISE_BLOCK + 5,)}  # "big": several noise blocks
    out = []
    for kind in ("gaussian", "truncated", "banded_mf"):
        one, _ = _world_steps(_sharded_world(1, shapes, lambda: make(kind)), range(steps), c)
        same = True
        for k in (2, 3):
            many, _ = _world_steps(_sharded_world(k, shapes, lambda: make(kind)), range(steps), c)
            same &= all(torch.equal(many[t][n], one[t][n]) for t in range(steps) for n in shapes)
        out.append(Check(f"fsdp {kind}: 2 and 3 shards' noise over {steps} steps is the one-rank noise", same,
                         "each shard draws its slice of the block layout (banded: y_t from per-shard buffers)"
                         if same else "the shards' noise is not the one draw (streams repeated across ranks)"))
        base = make(kind)
        want = [base.event_at(t, 0.06) for t in range(steps)]
        _, got = _world_steps(_sharded_world(2, shapes, lambda: make(kind)), range(steps), c)
        ok = got == want
        out.append(Check(f"fsdp {kind}: the sharded mechanism records the base mechanism's event", ok,
                         f"{type(want[0]).__name__} per step" if ok else
                         f"recorded {type(got[0]).__name__}, the mechanism is {type(want[0]).__name__}"))
        if kind == "gaussian":
            big, h = one[0]["big"], fsdp.NOISE_BLOCK
            std = float(big.std())
            ok = abs(std / (sigma * c) - 1) < 0.03 and abs(float(big.mean())) < 0.05 * sigma * c
            out.append(Check("fsdp gaussian: standard deviation σC", ok, f"std {std:.4f} vs σC = {sigma * c:.4f}",
                             {"std": std, "target": sigma * c}))
            distinct = (not torch.equal(one[1]["w"], one[0]["w"]) and not torch.equal(big[:h], big[h:2 * h])
                        and not torch.equal(one[0]["w"][:3], one[0]["b"]))
            out.append(Check("fsdp gaussian: other steps, blocks and tensors get other noise", distinct,
                             "distinct streams" if distinct else "two releases or blocks share noise"))
    return out


def _api_check() -> list[Check]:
    """make_private's sharded micro-batches: the same count on every rank, real rows disjoint and covering."""
    sampler = PoissonSampler(40, 8, Randomness(5))
    runs = []
    for r in range(2):
        mb = ShardedMicroBatches(sampler, 10, 2, 10, world=World(r, 2))
        rows = list(iter(mb))
        runs.append((mb, rows, list(mb.dummies), list(mb.plan)))
    counts = [[sum(1 for e in plan if e.step == t and not e.empty) for t in range(10)] for _, _, _, plan in runs]
    equal = counts[0] == counts[1]
    cover, placeholders = True, False
    for t in range(10):
        idx = sorted(int(i) for i in sampler.indices(t))
        real = []
        for _, rows, dummies, plan in runs:
            entries = [e for e in plan if not e.empty]
            real.append([i for e, rw, d in zip(entries, rows, dummies) if e.step == t and not d for i in rw])
            placeholders |= any(d for e, d in zip(entries, dummies) if e.step == t)
        cover &= not set(real[0]) & set(real[1]) and sorted(real[0] + real[1]) == idx
    return [Check("fsdp make_private: every rank runs the same number of micro-batches per step", equal and placeholders,
                  f"micro-batches per step {counts[0]} on both ranks (placeholders fill the short rank)" if equal else
                  f"rank 0 runs {counts[0]}, rank 1 {counts[1]}: FSDP's collectives would pair unlike calls"),
            Check("fsdp make_private: the ranks' real rows are disjoint and cover the logical batch", cover,
                  "shares of one Poisson batch" if cover else "a row on two ranks, or missing")]


def _norm_check(c: float = 0.05) -> list[Check]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=16, vocab_size=32,
                                   bos_token_id=1, eos_token_id=1)).eval()
    ids = torch.randint(0, 32, (6, 7))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    eng = BookKeepingEngine(m, causal_lm_loss, make_clip_policy("flat", c))
    whole = eng.clipped_sum(batch)
    halves = [eng.clipped_sum({k: v[r::2] for k, v in batch.items()}) for r in range(2)]
    ok, worst = True, 0.0
    for n, p in eng.params.items():
        tot = (halves[0].grad_sum[n] + halves[1].grad_sum[n]).flatten()
        ref = whole.grad_sum[n].flatten()
        for r in range(2):
            off, cnt = fsdp.chunk_range(tuple(p.shape), r, 2)
            d = float((tot[off:off + cnt] - ref[off:off + cnt]).abs().max()) if cnt else 0.0
            worst = max(worst, d)
    ok = worst < 1e-5
    # every example's clipped contribution ≤ C: one example alone
    single = [eng.clipped_sum({k: v[i:i + 1] for k, v in batch.items()}) for i in range(2)]
    norms = [float(torch.sqrt(sum((s.grad_sum[n].double() ** 2).sum() for n in eng.params))) for s in single]
    bounded = max(norms) <= c * (1 + 1e-4)
    return [Check("fsdp: two ranks' clipped sums, sharded, equal one process's", ok,
                  f"max shard difference {worst:.2e}", {"max_abs_diff": worst}),
            Check("fsdp: each example's contribution ≤ C", bounded,
                  f"largest single-example norm {max(norms):.4g} vs C = {c}", {"max_norm": max(norms)})]


def _plain_check() -> list[Check]:
    """PlainFSDPStep with a placeholder (a short rank) = the unsharded --no-dp step on the real batch."""
    def run(step_cls, force_placeholder: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        loss = lambda fwd, b: ((fwd(input=b["x"]) - b["y"]) ** 2).sum(dim=1)  # noqa: E731
        eng = NonPrivateEngine(model, loss, make_clip_policy("flat", 1.0))
        spec = build_step_spec(engine=eng, clip=eng.clip, sigma=None, rng=None, sampler=None,
                               optimizer=torch.optim.SGD(list(eng.params.values()), lr=0.5))
        spec.sampler = type("Q", (), {"q": 0.5})()
        g = torch.Generator().manual_seed(1)
        real = {"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, 3, generator=g)}
        dummy = {"x": torch.randn(1, 4, generator=g) * 5, "y": torch.zeros(1, 3)}
        ledger = PrivacyLedger()
        if step_cls is DPStep:
            step = DPStep(spec, ledger, 8)
        else:
            step = step_cls(spec, ledger, 8, World(0, 1), lambda: dummy)
            if force_placeholder:
                step._count = lambda n: n + 1  # the world's most micro-batches: one more than this rank's
        step.run(0, [real])
        return torch.cat([p.detach().flatten() for p in model.parameters()]), len(ledger.entries)

    ref, _ = run(DPStep, False)
    got, events = run(fsdp_plain.PlainFSDPStep, True)
    diff = float((got - ref).abs().max())
    ok = diff <= 1e-6 and events == 0
    return [Check("fsdp --no-dp step: a placeholder micro-batch adds nothing", ok,
                  f"max |Δw| against the unsharded --no-dp step {diff:.2e}, {events} ledger events"
                  + ("" if ok else ": the placeholder's gradient entered the update"), {"max_diff": diff})]


def _step_checks(planted: Optional[str] = None) -> list[Check]:
    """The FSDP step's white-box checks (see the module docstring)."""
    # the norm check exercises no planted bug (it builds a model: skipped when planting)
    return (_mechanism_check() + _placeholder_check() + _api_check() + _plain_check()
            + (_norm_check() if planted is None else []))


# -- make_private + banded MF under FSDP2: the sharded secret state (issue 38; helper i38-api-dcp) --------------
# * **banded MF's state round-trips across worlds** — K = 2 simulated ranks run the sharded banded
#   mechanism (each keeping the buffers of its shard) for 3 steps (their noise put together is one rank's:
#   ``_mechanism_check``). The state ``make_private``'s ``save_noise_state`` writes (``ShardedBandedMFMechanism.state``:
#   every rank's buffer slices gathered, here through a simulated ``all_gather_object``) goes through
#   the owner-only file (0600) and is loaded by 1 and by 3 fresh ranks (``load_state`` keeps each rank's
#   slice): the next 3 steps' noise equals the uninterrupted one-rank noise. Planted
#   ``fsdp_api_banded_restart`` (each rank restarts the banded stream after a resume: the buffers are
#   dropped, so the resumed y_t is no longer C⁻¹Z's row t — more noise than accounted for, or, with
#   other coefficients, less) and ``fsdp_api_banded_slice_saved`` (the state holds this rank's slice
#   only, not the gathered buffers: rank 0 writes its own shard's buffers and the other ranks' are lost).

#: Planted bugs of this block (added to :data:`PLANTED`; audit/suite.py and audit/planted.py list them too).
API_BANDED_PLANTED = ("fsdp_api_banded_restart", "fsdp_api_banded_slice_saved")
PLANTED = PLANTED + API_BANDED_PLANTED


planted_bug = bug_planter(PLANTED, {
    "fsdp_same_shard_stream": lambda p: p.set(fsdp, "shard_noise", _same_stream(fsdp.shard_noise)),
    "fsdp_dummy_counted": lambda p: p.set(fsdp.ReduceScatter, "start",
                                          lambda self, dummy, real=fsdp.ReduceScatter.start: real(self, False)),
    "fsdp_banded_whole_stream": lambda p: p.set(fsdp._ShardedNoise, "noise_stream", GaussianMechanism.noise_stream),
    "fsdp_truncation_dropped": lambda p: p.set(fsdp._ShardedNoise, "__init__",
                                               _truncation_dropped(fsdp._ShardedNoise.__init__)),
    "fsdp_api_no_placeholder": lambda p: p.set(sharded.ShardedMicroBatches, "_count", _own_count),
    "fsdp_api_dummy_sent": lambda p: p.set(sharded.ShardedDPOptimizer, "_begin_micro_batch",
                                           _dummy_as_real(sharded.ShardedDPOptimizer._begin_micro_batch)),
    "fsdp_plain_dummy_counted": lambda p: p.set(fsdp_plain.PlainFSDPStep, "DUMMY_WEIGHT", 1.0),
    "fsdp_api_banded_restart": lambda p: p.set(fsdp.ShardedBandedMFMechanism, "load_state",
                                               _restart(fsdp.ShardedBandedMFMechanism.load_state)),
    # this rank's slices, not gathered
    "fsdp_api_banded_slice_saved": lambda p: p.set(fsdp.ShardedBandedMFMechanism, "state", BandedMFMechanism.state),
})


def _simulated_all_gather(mechs: list):
    """``torch.distributed.all_gather_object`` as K simulated ranks (``mechs[r]``) see it during one
    rank's :meth:`~dpft.placement.fsdp.ShardedBandedMFMechanism.state`: its j-th call gathers every rank's flat
    slices of buffer j, in rank order (what the real collective returns when every rank calls it); for a ``with``."""
    calls = {"j": 0}

    def gather(parts, obj, group=None):
        j = calls["j"]
        calls["j"] += 1
        for r, m in enumerate(mechs):
            parts[r] = {n: t.detach().float().cpu().reshape(-1) for n, t in m.buffers[j].items()}

    return patched((dist, "all_gather_object", gather))


def _sharded_world(k: int, shapes: dict, make) -> list:
    """K simulated ranks' sharded copies of ``make()`` (FSDP's dim-0 chunks), as an FSDPStep sets them up."""
    mechs = []
    for r in range(k):
        layout = {n: (int(torch.Size(s).numel()), *fsdp.chunk_range(s, r, k)) for n, s in shapes.items()}
        m = fsdp.shard_mechanism(make(), layout)
        m.world = World(r, k)
        m.shapes = {n: (tuple(s), (layout[n][2] // max(1, int(torch.Size(s[1:]).numel())), *s[1:]) if len(s) > 1
                        else (layout[n][2],)) for n, s in shapes.items()}
        mechs.append(m)
    return mechs


def _world_steps(mechs: list, steps, c: float) -> tuple[list[dict[str, torch.Tensor]], list]:
    """The simulated ranks' noise of zero gradients at each of ``steps``, put together, and the events recorded."""
    out, events = [], []
    for t in steps:
        parts: dict[str, list] = {}
        for m in mechs:
            noisy, ev = m.release({n: torch.zeros(m.shapes[n][1]) for n in m.shapes}, c, 0.06, t)
            for n, v in noisy.items():
                parts.setdefault(n, []).append(v.reshape(-1))
        out.append({n: torch.cat(v) for n, v in parts.items()})
        events.append(ev)
    return out, events


def _api_banded_check(sigma: float = 0.9, c: float = 1.5, steps: int = 6) -> Check:
    shapes = {"w": (7, 4), "b": (3,)}

    def make():
        return BandedMFMechanism(sigma, c, Randomness(13), banded_coefficients(steps, 3), 0.25)

    ref, _ = _world_steps(_sharded_world(1, shapes, make), range(steps), c)
    two = _sharded_world(2, shapes, make)  # their noise is the one-rank noise: _mechanism_check
    _world_steps(two, range(3), c)
    try:
        states = []
        for r, m in enumerate(two):  # every rank calls state() (a collective); rank 0's is written
            with _simulated_all_gather(two):
                states.append(m.state())
        with tempfile.TemporaryDirectory() as tmp:
            path = write_secret(Path(tmp) / "noise.pt", states[0])
            mode = os.stat(path).st_mode & 0o777
            st = torch.load(path, weights_only=True)
        resumed = {}
        for k in (1, 3):
            mechs = _sharded_world(k, shapes, make)
            for m in mechs:
                m.load_state(st)
            resumed[k] = _world_steps(mechs, range(3, steps), c)[0]
        ok = mode == 0o600 and all(torch.equal(resumed[k][i][n], ref[3 + i][n])
                                   for k in resumed for i in range(steps - 3) for n in shapes)
        why = (f"saved by 2 ranks (gathered, mode {oct(mode)}), resumed by 1 and by 3: steps 3–{steps - 1} equal the "
               "uninterrupted noise" if ok else
               f"mode {oct(mode)}; the resumed noise differs from the uninterrupted run (the banded stream restarted, "
               "or buffers of other shards lost)")
    except (RuntimeError, ValueError, KeyError) as exc:  # a state that cannot be re-sliced: not gathered
        ok, why = False, f"the saved state does not round-trip to another world: {type(exc).__name__}: {exc}"
    return Check("fsdp make_private banded: the secret state round-trips across worlds (2 → 1, 2 → 3)", ok, why)


def fsdp_checks(planted: Optional[str] = None) -> list[Check]:
    """The FSDP step's white-box checks (module docstring and the blocks after it); ``planted``: one of
    :data:`PLANTED` (the checks must then fail)."""
    with planted_bug(planted):
        return _step_checks(planted) + [_api_banded_check()]
