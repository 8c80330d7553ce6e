"""Audit checks of EW-FT / DP-Forward (forward-pass local DP, ``ldp:``) under FSDP2 (issue 38).

Under ``perf.sharding: fsdp`` a frozen-pre(·) EW-FT run is the non-private FSDP step (dpft/placement/fsdp_plain.py)
on the split model (privacy/ldp.py ``SplitClassifier``): each rank releases its share of the logical
batch through the noise layer, post(·) trains on the noisy codes with plain gradients, and the method
records one event per step (methods/ewft/method.py). White-box, in one process (no process group), on the real
:class:`~dpft.methods.ewft.method.LDPRun` of simulated ranks (K = 2) of a tiny random BERT:

* **every rank runs the same FSDP2 units per micro-batch, whatever it ran before** — every transformer
  block and the embeddings are FSDP2 units (dpft/placement/fsdp.py ``block_classes``), whose forwards all-gather
  their shards: collectives every rank must enter alike. Rank 0 releases rows it has released before,
  rank 1 new rows; the sequence of units each rank's forward enters must be the same on both (pre(·)'s
  per-example cache must be off: methods/ewft/parts.py ``pre_cache_allowed``). Planted
  ``ewft_fsdp_pre_cache_kept``: the cache stays on under FSDP2 — rank 0 skips pre(·)'s units, so its
  all-gathers pair with other blocks' on rank 1 (a hang, or silently exchanged shards of equal shape).
* **each rank's release noise is its own stream, as DDP's rank** — one check under DDP and FSDP2:
  audit/checks_device.py ``rank_stream_check`` (planted ``ewft_fsdp_shared_stream`` there);
* **the test-file evaluation of the materialised copy uses the trained σ** — the driver evaluates the
  test file on a plain copy of the sharded model (dpft/placement/fsdp.py ``materialise``, made from a template
  taken at sharding time); the method must switch the copy's layer (the last epoch's σ, inference noise
  on and off), not the live one. Planted ``ewft_fsdp_eval_live_layer``: the live layer is switched, so the
  copy evaluates at the σ it was copied with and the "clean" accuracy is a noisy one.
* **``ldp.train_pre``: the world's gradient noise is DDP's one draw, sliced** — under FSDP2 the step's
  mechanism (methods/ewft/fsdp.py ``ShardedTrainPreMechanism``) gives each rank its flat range of the
  one-process draw of every pre(·) tensor (stream ``noise``, (t, name)). On simulated ranks (K = 2, 3,
  FSDP's dim-0 chunks) the ranks' slices put together must be exactly the DDP / one-process noise, post(·)'s
  sums unnoised, and every rank's event the one-process event. Planted ``ewft_fsdp_train_pre_noise_offset``:
  each rank takes the *first* elements of the draw (its offset ignored) — every shard gets the same noise,
  so the world's noise is not one N(0, σ²C²I) draw (correlated across shards, the tail rows' noise never used).
* **``ldp.train_pre``: the plain copy releases with the live layer's σ and the rank's stream** — the FSDP2
  step runs the engine on a plain copy of the model made from the template taken at sharding time
  (before any step); before each step :func:`~dpft.methods.ewft.fsdp.sync_layer` gives the copy's noise
  layer the live layer's σ and secret stream (``ldp``, t, ``rank``, r). Planted
  ``ewft_fsdp_train_pre_layer_unsynced``: the copy keeps its own layer — its σ is the one copied at sharding
  time and it draws from a fresh stream of its own, not the rank's (the release the ledger accounts at σ is
  not the one made).

:func:`fsdp_ewft_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Optional

import torch

from dpft.accounting.ledger import PrivacyLedger
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.config.recipe import load_recipe
from dpft.placement.fsdp import block_classes
from dpft.placement.fsdp import chunk_range
from dpft.methods.ewft import method as ewft
from dpft.methods.ewft import fsdp as ldp_fsdp
from dpft.methods.ewft.method import ForwardLDP, LDPRun
from dpft.methods.ewft.train_pre import TrainPreEngine, TrainPreMechanism
from dpft.privacy.randomness import Randomness
from dpft.placement.shards import chunk_rows
from dpft.step.clip import make_clip_policy

__all__ = ["PLANTED", "fsdp_ewft_checks", "ldp_run"]

#: Planted bugs :func:`fsdp_ewft_checks` must catch.
PLANTED = ("ewft_fsdp_pre_cache_kept", "ewft_fsdp_eval_live_layer",
           "ewft_fsdp_train_pre_noise_offset", "ewft_fsdp_train_pre_layer_unsynced")
#: ``ldp.train_pre`` on (a uniform σ: its calibration is joint).
TRAIN_PRE = {"ldp.train_pre.enabled": True, "ldp.train_pre.max_grad_norm": 0.5, "ldp.schedule": "uniform"}

_T, _VOCAB, _N = 8, 64, 40


_planted = bug_planter(PLANTED, {
    "ewft_fsdp_pre_cache_kept": lambda p: p.set(ewft, "pre_cache_allowed", lambda run: True),
    "ewft_fsdp_eval_live_layer": lambda p: p.set(ForwardLDP, "_eval_layer", lambda self, run: self.ldp.layer),
    "ewft_fsdp_train_pre_noise_offset": lambda p: p.set(ldp_fsdp, "shard_slice", lambda full, layout, shape: (
        full.reshape(-1)[:layout[2]].reshape(shape))),
    "ewft_fsdp_train_pre_layer_unsynced": lambda p: p.set(ldp_fsdp, "sync_layer",
                                                          lambda plain, live: plain.train(live.training)),
})


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=_VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def ldp_run(rank: int = 0, world_size: int = 2, sharding: str = "fsdp", **extra):
    """A real :class:`~dpft.methods.ewft.method.LDPRun` (noise after block 1, a [16, 4] autoencoder, EWPBA over 2
    epochs at ε = 4) on a tiny random BERT, for simulated rank ``rank`` of ``world_size`` processes under
    ``perf.sharding: sharding``; the trainer is a namespace with what the method reads (a reproducible
    key: the audit compares draws). Returns ``(ldp_run, trainer)``."""
    ov = {"model.name": "minilm", "model.max_length": _T, "task.name": "sst2", "privacy.enabled": False,
          "batch.expected_batch_size": 8, "schedule.epochs": 2, "perf.sharding": sharding, "seed": 5,
          "ldp.enabled": True, "ldp.position": "encoder:1", "ldp.noise_multiplier": 0.8, "ldp.target_epsilon": None,
          "ldp.delta": 1e-3, "ldp.autoencoder.sizes": [16, 4], "ldp.autoencoder.pretrain_epochs": 0, **extra}
    recipe = load_recipe(None, ov)
    ledger = PrivacyLedger()
    tr = SimpleNamespace(recipe=recipe, n=_N, q=8 / _N, model=_tiny_bert(), device=torch.device("cpu"), ledger=ledger,
                         rng=Randomness(11), task=SimpleNamespace(num_labels=2), total_steps=0, rank=rank,
                         world_size=world_size, loss_fn=None, train_tok=None,
                         record=lambda phase, ev, count=1: ledger.record(phase, ev, count))
    return LDPRun(tr), tr


def _rows(seed: int, b: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, _VOCAB, (b, _T - 2), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _units_check() -> Check:
    """Rank 0 releases rows it released before, rank 1 new rows: both enter the same FSDP2 units."""
    seqs: list[list[list[str]]] = []
    cached = []
    for rank, plan in ((0, (1, 1, 1)), (1, (2, 3, 4))):  # rank 0: the same rows each step; rank 1: new ones
        ldp, _ = ldp_run(rank)
        split = ldp.split
        cached.append(split.pre_cache is not None)
        units = block_classes(split)
        calls: list[str] = []
        hooks = [m.register_forward_pre_hook(lambda mod, a, name=name: calls.append(name))
                 for name, m in split.named_modules() if type(m).__name__ in units]
        per = []
        try:
            split.train()
            for t, seed in enumerate(plan):
                ldp.before_step(t)
                calls.clear()
                with torch.no_grad():
                    split(**_rows(seed))
                per.append(list(calls))
        finally:
            for h in hooks:
                h.remove()
        seqs.append(per)
    ok = seqs[0] == seqs[1] and all(len(s) > 0 for s in seqs[0])
    why = ("same units on both ranks at every step (pre(·)'s cache off: "
           f"{sum(cached)} of 2 ranks cached; {len(seqs[0][0])} units per forward)")
    if not ok:
        bad = next(t for t in range(len(seqs[0])) if seqs[0][t] != seqs[1][t])
        why = (f"step {bad}: rank 0 entered {len(seqs[0][bad])} FSDP2 units, rank 1 {len(seqs[1][bad])} — their "
               f"all-gathers pair different blocks (pre(·)'s cache on under FSDP2: {cached})")
    return Check("ewft fsdp: every rank's forward enters the same FSDP2 units, whatever it released before", ok, why)


def _eval_copy_check() -> Check:
    """ForwardLDP.evaluate on a copy of the split (materialise's template) uses the trained σ, both switches."""
    ldp, tr = ldp_run(0)
    m = ForwardLDP(tr.recipe.ldp, tr.recipe)
    m.ldp = ldp
    copied = copy.deepcopy(ldp.split)  # taken at sharding time: σ of epoch 0
    last = ldp.schedule.sigmas[-1] * 0.5 + 0.01  # a σ the copy does not hold
    ldp.layer.set_sigma(last)
    seen: list[tuple[float, bool]] = []

    def evaluate():
        seen.append((copied.noise.sigma, bool(copied.noise.eval_noise)))
        return {"dev_accuracy": 0.0, "dev_loss": 0.0}

    m.evaluate(SimpleNamespace(model=copied, rng=tr.rng, device=torch.device("cpu"), rank=0, world_size=2), evaluate)
    ok = [s for s, _ in seen] == [last, last] and sorted(n for _, n in seen) == [False, True]
    return Check("ewft fsdp: the test file's materialised copy is evaluated at the trained σ, with and without noise",
                 ok, f"copy's (σ, inference noise) per pass: {seen}; trained σ {last:.4g}")


def _ce_loss(forward, batch):
    return torch.nn.functional.cross_entropy(forward(**batch).logits, batch["labels"], reduction="none")


def train_pre_parts(rank: int = 0):
    """``(ldp_run, trainer, engine, mechanism)`` of an ``ldp.train_pre`` run on the tiny BERT (simulated rank
    ``rank`` of 2, FSDP2): the real :class:`TrainPreEngine` and :class:`TrainPreMechanism` the method builds."""
    ldp, tr = ldp_run(rank, **TRAIN_PRE)
    clip = make_clip_policy("flat", 0.5)
    eng = TrainPreEngine(ldp.split, _ce_loss, clip, ldp.first_block)
    mech = TrainPreMechanism(ldp.schedule.sigmas[0], ldp.sigma_grad, clip.sensitivity, tr.rng, eng.pre_names)
    return ldp, tr, eng, mech


def _train_pre_noise_check() -> Check:
    """Simulated ranks' slices of the sharded train_pre mechanism = the one-process draw; post(·) unnoised."""
    _, tr, eng, base = train_pre_parts()
    t, q = 4, tr.q
    shapes = {n: tuple(p.shape) for n, p in eng.params.items()}
    want, ev = base.release({n: torch.zeros(s) for n, s in shapes.items()}, 0.5, q, t)
    ok = bool(base.pre_names) and set(base.pre_names) != set(shapes)
    why = "" if ok else f"pre(·) names {sorted(base.pre_names)[:3]}: none, or every tensor (post(·) would be noised)"
    for k in (2, 3):
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
        for r in range(k):
            layout = {n: (math.prod(s), *chunk_range(s, r, k)) for n, s in shapes.items()}
            local = {}
            for n, s in shapes.items():
                a, b = chunk_rows(s[0] if s else 1, r, k)
                local[n] = torch.zeros((b - a, *s[1:]) if s else ())
            got, ev_r = ldp_fsdp.ShardedTrainPreMechanism(base, layout, shapes).release(local, 0.5, q, t)
            if ev_r != ev:
                ok, why = False, f"K={k} rank {r}: event {ev_r} is not the one-process {ev}"
            for n in shapes:
                parts[n].append(got[n].reshape(-1))
        for n in shapes:
            if not torch.equal(torch.cat(parts[n]), want[n].reshape(-1)):
                ok, why = False, (f"K={k}: the ranks' noise of {n} put together is not the one-process draw "
                                  f"({'pre' if n in base.pre_names else 'post'}(·))")
                break
    post = [n for n in shapes if n not in base.pre_names]
    if ok and any(bool(want[n].abs().sum()) for n in post):
        ok, why = False, "post(·)'s sums were noised"
    std = float(torch.cat([want[n].reshape(-1) for n in base.pre_names]).std())
    return Check("ewft fsdp: ldp.train_pre's sharded gradient noise is the one-process (DDP) draw, sliced, one event",
                 ok, why or f"K = 2, 3: slices = the one draw over {len(base.pre_names)} pre(·) tensors "
                            f"(std {std:.3f}, "
                            f"σ_grad·C_g = {base.std:.3f}); {len(post)} post(·) tensors unnoised; events equal")


def _train_pre_copy_check() -> Check:
    """The plain copy (taken before any step) draws, after sync_layer, the live layer's σ and rank stream."""
    rank, t = 1, 3
    ldp, tr, _, _ = train_pre_parts(rank)
    plain = copy.deepcopy(ldp.split)  # the template is taken at sharding time, before the first step
    plain.eval()
    ldp.before_step(t)
    ldp.layer.set_sigma(ldp.layer.sigma * 0.5 + 0.01)  # a σ the copy does not hold
    ldp.split.train()
    ldp_fsdp.sync_layer(plain, ldp.split)
    shape = (2, _T, 4)
    got = plain.noise.noise_like(torch.zeros(shape))
    want = tr.rng.stream("ldp", t, "rank", rank).normal(shape, dtype=torch.float32)
    want = want * ldp.layer.sigma * ldp.layer.sensitivity  # std σ·2C
    ok = torch.equal(got, want) and plain.training
    why = ("the copy's release noise = the stream (ldp, t, rank, 1) at the live σ; train mode copied" if ok else
           f"the copy's noise is not the live layer's (σ copy {plain.noise.sigma:.4g} vs live {ldp.layer.sigma:.4g}; "
           f"stream shared: {plain.noise.generator is ldp.layer.generator}; train mode {plain.training})")
    return Check("ewft fsdp: ldp.train_pre's plain copy releases with the live layer's σ and the rank's stream",
                 ok, why)


def fsdp_ewft_checks(planted: Optional[str] = None) -> list[Check]:
    """The white-box checks of EW-FT under FSDP2 (module docstring); ``planted``: one of :data:`PLANTED`
    (a check must then fail)."""
    with _planted(planted):
        return [_units_check(), _eval_copy_check(), _train_pre_noise_check(), _train_pre_copy_check()]
