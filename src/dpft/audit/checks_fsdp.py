"""Audit checks of the FSDP2 DP step (``perf.sharding: fsdp``; dpft/fsdp.py; issue 26 item 3).

White-box, in one process (no process group needed), on the real classes of dpft/fsdp.py:

* **sharded noise is one draw** — the :class:`~dpft.fsdp.ShardedGaussianMechanism` of every
  simulated rank (K = 2, 3; FSDP's dim-0 chunk layout, :func:`~dpft.fsdp.chunk_range`) adds noise to
  its shard; the shards put together must equal the noise one process draws for the whole tensor
  (the streams are disjoint and cover each element once: together exactly one N(0, σ²C²I) draw,
  whatever K), with standard deviation σC, and other tensors and other steps must get other noise.
  Planted ``fsdp_same_shard_stream``: every rank numbers its noise blocks from its own shard's start
  (the same streams on each rank: the shards' noise is correlated, the sum is not one Gaussian draw).
* **a placeholder micro-batch adds nothing** — a rank with fewer micro-batches than another runs a
  dummy one to keep the collectives in step; :class:`~dpft.fsdp.ReduceScatter` must send zeros for
  it. Planted ``fsdp_dummy_counted``: the dummy's clipped sum is sent (an example counted twice:
  sensitivity 2C).
* **norms are complete on each rank** — on a tiny GPT-2 LM (tied embeddings), the book-keeping clipped
  sums of two simulated ranks' halves of a batch, summed and cut into FSDP shards, equal the shards of
  one process's clipped sum over the whole batch, and every example's contribution is ≤ C (each rank
  computes its examples' full-parameter norms from gathered weights: no per-shard norm).

:func:`fsdp_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from dpft.audit.whitebox import Check

__all__ = ["PLANTED", "fsdp_checks"]

#: Planted bugs :func:`fsdp_checks` must catch.
PLANTED = ("fsdp_same_shard_stream", "fsdp_dummy_counted")


@contextlib.contextmanager
def _planted(name: Optional[str]) -> Iterator[None]:
    from dpft import fsdp

    saved = []
    try:
        if name == "fsdp_same_shard_stream":
            real = fsdp.shard_noise

            def same_stream(mech, step, tname, numel, offset, count, device):
                # every rank starts at block 0 of its own shard: the same streams on each rank
                return real(mech, step, tname, count, 0, count, device)

            saved.append((fsdp, "shard_noise", real))
            fsdp.shard_noise = same_stream
        elif name == "fsdp_dummy_counted":
            real_start = fsdp.ReduceScatter.start
            saved.append((fsdp.ReduceScatter, "start", real_start))
            fsdp.ReduceScatter.start = lambda self, dummy: real_start(self, False)
        yield
    finally:
        for obj, attr, val in reversed(saved):
            setattr(obj, attr, val)


def _noise_check(sigma: float = 0.7, c: float = 2.0) -> list[Check]:
    from dpft import fsdp
    from dpft.privacy.randomness import Randomness
    from dpft.step.noise import GaussianMechanism

    base = GaussianMechanism(sigma, c, Randomness(7))
    shapes = {"w": (9, 5), "b": (3,), "big": (2 * fsdp.NOISE_BLOCK + 5,)}

    def world_noise(k: int, step: int = 3) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
        for r in range(k):
            layout, zeros = {}, {}
            for n, shp in shapes.items():
                off, cnt = fsdp.chunk_range(shp, r, k)
                numel = int(torch.Size(shp).numel())
                layout[n] = (numel, off, cnt)
                zeros[n] = torch.zeros(cnt)
            noisy = fsdp.ShardedGaussianMechanism(base, layout).add_noise(zeros, step)
            for n in shapes:
                parts[n].append(noisy[n].flatten())
        return {n: torch.cat(v) for n, v in parts.items()}

    one = world_noise(1)
    out = []
    for k in (2, 3):
        got = world_noise(k)
        same = all(torch.equal(got[n], one[n]) for n in shapes)
        out.append(Check(f"fsdp noise: {k} shards together are the one-process draw", same,
                         "each element's noise comes from one position of one disjoint stream, whatever the "
                         "number of ranks" if same else
                         f"the {k} ranks' shard noise differs from the single draw (streams shared or misplaced)"))
    big = one["big"]
    std = float(big.std())
    ok = abs(std / (sigma * c) - 1) < 0.03 and abs(float(big.mean())) < 0.05 * sigma * c
    out.append(Check("fsdp noise: standard deviation σC", ok, f"std {std:.4f} vs σC = {sigma * c:.4f}",
                     {"std": std, "target": sigma * c}))
    other_step = world_noise(2, step=4)
    h = fsdp.NOISE_BLOCK
    distinct = (not torch.equal(other_step["w"], one["w"]) and not torch.equal(one["big"][:h], one["big"][h:2 * h])
                and not torch.equal(one["w"][:3], one["b"]))
    out.append(Check("fsdp noise: other steps, blocks and tensors get other noise", distinct,
                     "distinct streams" if distinct else "two releases or blocks share noise"))
    return out


def _dummy_check() -> list[Check]:
    from dpft import fsdp
    from dpft.distributed import World

    p = torch.nn.Parameter(torch.ones(4, 3))
    rs = fsdp.ReduceScatter({"p": p}, ["p"], World())
    rs.start(dummy=True)
    got = rs("p", torch.full((4, 3), 5.0))
    ok = bool(torch.count_nonzero(got) == 0)
    return [Check("fsdp: a placeholder micro-batch contributes zero", ok,
                  "zeros reduce-scattered for a dummy micro-batch" if ok else
                  "a dummy micro-batch's clipped sum was sent: its example is counted twice (sensitivity 2C)")]


def _norm_check(c: float = 0.05) -> list[Check]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpft import fsdp
    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.models.losses import causal_lm_loss
    from dpft.step.clip import make_clip_policy

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


def fsdp_checks(planted: Optional[str] = None) -> list[Check]:
    """The FSDP step's white-box checks (see the module docstring); ``planted``: one of
    :data:`PLANTED` (the checks must then fail)."""
    with _planted(planted):
        return _noise_check() + _dummy_check() + _norm_check()
