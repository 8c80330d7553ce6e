"""The plan's mechanisms and methods through the Python ways in, one check per property over the
ways in's adapters (issues 28 and 34; issue 46 item 4).

``audit/checks_mechanisms.py`` checks the mechanisms' classes and the CLI; here each Python way in
(``make_private``, ``DPTrainer``: :data:`LOOPS`) runs a short loop of a tiny model with reproducible
randomness (so the auditor recomputes the noise from the streams) and hands back what it released,
recorded and wrote (:class:`Loop`). The same properties are then read off every way in:

* **banded noise is C⁻¹Z** (``mechanism="banded_mf"``) — the noise each step released (released sum −
  clipped sum, read at the mechanism) satisfies C·Y = σC_clip·Z exactly, Z drawn independently from the
  way in's streams and C built from ``banded_coefficients(n, b)`` (‖C[:, i]‖ ≤ 1: sensitivity C_clip per
  participation), over more steps than bands (across the buffers);
* **b-min-separation, events and calibration** — the examples each step trained on participate ≥ b steps
  apart; the ledger holds PoissonSampled(p, Gaussian(σ)) at t ≡ 0 (mod b) and NoOp otherwise, the
  composition σ is calibrated on (``banded_phase_event``) (planted ``api_banded_every_partition``: the
  cyclic sampler ignores the partitions);
* **secret state stays secret** — the optimizer's ``state_dict()`` holds no noise buffer and the secret file
  is owner-only (0600); make_private: a fresh engine's ``load_noise_state`` restores buffers, partition and
  ledger; DPTrainer: ``noise_state.secret.pt`` sits in ``output_dir``, nothing of it in ``checkpoint-*``
  (planted ``api_noise_state_in_optimizer``: the buffers in the DP optimizer's state dict, which users save
  and share with their checkpoints);
* **truncation** (``max_batch_size=B_max``) — every logical batch ≤ B_max and every step records
  ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` (planted ``trainer_truncation_not_recorded``: the
  truncated mechanism not installed, so the plain Poisson event is recorded, under-accounting the
  replace-one branch).

The methods (issue 34 item 4), each on the way in whose loop shows it:

* **DP-Adam-AC's adaptive clipping: noise σ_Δ·C_t and the count at σ_b** (make_private) — a linear model at
  zero weights with squared-error targets 0 has every per-example gradient exactly 0, and a learning rate
  of 0 keeps it there, so each step's noisy gradient (read from ``p.grad`` in the optimizer's ``step``) is
  pure noise: ``p.grad · qN / C_t ~ N(0, σ_Δ²)`` with σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al. 2021,
  Thm. 1). Every example is unclipped, so the released fraction is b̃_t = 1 + z_t/(qN) and
  ``C_{t+1} = C_t·exp(−η(b̃_t − (1 − ρ*)))`` gives back the count noise z_t ~ N(0, σ_b²); the ledger holds
  one PoissonSampled(q, Gaussian(σ)) per step. Planted ``api_adaptive_noise_unadjusted``: the gradient
  noised at σ instead of σ_Δ while the count is still released.
* **adaptive clipping: fresh count noise per training loop** (DPTrainer) — two ``train()`` calls of one
  trainer draw their count noise from different secret streams. Planted ``trainer_count_stream_reused``:
  the methods' draws not renewed with the loop's stream.
* **DP-SFT: leave-one-out in R^k ≤ C** (make_private with a given subspace; audit/ways_in.py's
  :func:`~dpft.audit.ways_in.leave_one_out` on the coordinates ``s = −Pᵀ Δθ · qN``). Planted
  ``api_subspace_unclipped``: the live projection's clip skipped.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import dp_accounting as dpa
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.api.optimizer import DPOptimizer
from dpft.audit.planted import bug_planter
from dpft.audit.ways_in import WayIn, leave_one_out
from dpft.audit.whitebox import Check, tiny_classifier
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf import trainer as hf
from dpft.methods import dp_adam_ac
from dpft.methods.dpsft import method as dpsft
from dpft.privacy.randomness import Randomness
from dpft.step import clip as clipmod
from dpft.step import mechanisms
from dpft.step.correlated import CyclicPoissonSampler, banded_coefficients, banded_phase_event, strategy_matrix
from dpft.step.mechanisms import TruncatedPoisson
from dpft.step.truncated import truncated_event
from dpft.transforms.subspace import SubspaceBasis

__all__ = ["PLANTED", "MECHANISMS_PLANTED", "METHODS_PLANTED", "mechanisms_api_checks", "methods_api_checks",
           "banded_checks", "truncated_check", "planted_bug", "LOOPS"]

MECHANISMS_PLANTED = ("api_banded_every_partition", "api_noise_state_in_optimizer", "trainer_truncation_not_recorded")
METHODS_PLANTED = ("api_adaptive_noise_unadjusted", "trainer_count_stream_reused", "api_subspace_unclipped")
PLANTED = MECHANISMS_PLANTED + METHODS_PLANTED
SEED = 5
N = 40
_SIGMA, _SIGMA_B, _ETA, _RHO = 1.0, 0.6, 0.2, 0.2


class _EveryPartition(CyclicPoissonSampler):
    """Planted: every example may be drawn at every step (the banded partition ignored)."""

    def indices(self, step):
        draw = self.rng.stream("sample", int(step)).bernoulli((self.n,), self.partition_rate)
        return torch.nonzero(draw).flatten()


def _state_dict_with_noise(self):
    """Planted: the optimizer's state_dict (a checkpoint file) carries the secret noise state."""
    return {**self.original_optimizer.state_dict(), "dp_noise_state": self.dp_step.spec.mechanism.state()}


def _unclipped_reduce(orig):
    def reduce(self, *args, **kwargs):
        max_norm = self.sub.clip.max_norm
        self.sub.clip.max_norm = float("inf")
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.sub.clip.max_norm = max_norm

    return reduce


planted_bug = bug_planter(PLANTED, {
    "api_banded_every_partition": lambda p: p.set(mechanisms, "CyclicPoissonSampler", _EveryPartition),
    "api_noise_state_in_optimizer": lambda p: p.set(DPOptimizer, "state_dict", _state_dict_with_noise),
    "trainer_truncation_not_recorded": lambda p: p.set(TruncatedPoisson, "install", lambda self, spec, **kw: spec),
    "api_adaptive_noise_unadjusted": lambda p: p.set(dp_adam_ac, "effective_noise_multiplier",
                                                     lambda sigma, count_noise: float(sigma)),
    "trainer_count_stream_reused": lambda p: p.set(hf.DPTrainer, "get_train_dataloader",
                                                   hf_data.PoissonData.get_train_dataloader),
    "api_subspace_unclipped": lambda p: p.set(dpsft.LiveSubspace, "reduce",
                                              _unclipped_reduce(dpsft.LiveSubspace.reduce)),
})


# ----------------------------------------------------------------------------- what a loop hands back


@dataclass
class Loop:
    """What one way in's loop hands the checks: each step's released noise and trained-on examples, the
    ledger, the sampling (or partition) rate, the loop's secret stream root, the mechanism, and the
    secret-state findings ``(ok, what)`` (for a stateful mechanism)."""

    noises: list
    batches: dict
    ledger: Any
    p: float
    rng: Randomness
    mech: Any
    secret: list = field(default_factory=list)


def _record_noise(mech) -> list[dict[str, torch.Tensor]]:
    """Wrap the mechanism instance's ``add_noise``: each step's released − clipped sum."""
    out: list[dict[str, torch.Tensor]] = []
    orig = mech.add_noise

    def add_noise(grad_sum, step):
        noisy = orig(grad_sum, step)
        out.append({k: (noisy[k].double() - grad_sum[k].double()).detach().cpu() for k in grad_sum})
        return noisy

    mech.add_noise = add_noise
    return out


def _holds_any(obj, tensors) -> bool:
    """Whether ``obj`` (nested dicts/lists) holds a tensor equal to one of ``tensors``."""
    if isinstance(obj, torch.Tensor):
        return any(obj.shape == t.shape and torch.equal(obj.detach().cpu(), t.detach().cpu()) for t in tensors)
    if isinstance(obj, dict):
        return any(_holds_any(v, tensors) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_any(v, tensors) for v in obj)
    return False


def _buffers(mech) -> list:
    return [v for b in (mech.buffers if mech.stateful else []) for v in b.values()]


def _mode(path: Path) -> Optional[int]:
    return os.stat(path).st_mode & 0o777 if path.is_file() else None


def _make_private(steps: int, sigma: float, c: float, batch: int, d: str, **mech_kwargs) -> Loop:
    """make_private's loop: a 2-layer net on N rows (their index the third column, to record batches)."""

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        eng = PrivacyEngine(reproducible_seed=SEED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (eng, *eng.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
                dataset=data, expected_batch_size=batch, max_grad_norm=c, noise_multiplier=sigma, steps=steps,
                max_physical_batch_size=3, **mech_kwargs))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 5, generator=g) * 3, torch.randint(0, 2, (N,), generator=g), torch.arange(N))
    eng, module, opt, crit, loader = engine()
    mech = opt.dp_step.spec.mechanism
    noises, batches = _record_noise(mech), {}
    while opt.logical_steps < steps:
        for x, y, idx in loader:
            batches.setdefault(opt.current_step, []).extend(idx.tolist())
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    out = Loop(noises, batches, eng.ledger, getattr(opt.dp_step.spec.sampler, "partition_rate", batch / N),
               Randomness(SEED).child("make_private:1"), mech)
    if mech.stateful:  # the optimizer's state dict, the 0600 file, a fresh engine's restore
        path = Path(d) / "noise.secret.pt"
        eng.save_noise_state(path)
        eng2, _, opt2, _, _ = engine()
        eng2.load_noise_state(path)
        m2 = opt2.dp_step.spec.mechanism
        restored = (m2.next_step == steps and eng2.ledger.steps == steps
                    and torch.equal(m2.sampler.partition, mech.sampler.partition)
                    and all(torch.equal(a[k], b[k]) for a, b in zip(m2.buffers, mech.buffers) for k in a))
        leaked = _holds_any(opt.state_dict(), _buffers(mech))
        out.secret = [(not leaked, f"optimizer.state_dict() {'HOLDS' if leaked else 'holds no'} noise buffer"),
                      (_mode(path) == 0o600, f"save_noise_state mode {oct(_mode(path) or 0)} (0o600)"),
                      (restored, f"a fresh engine restored buffers, partition and ledger: {restored}")]
        eng2.detach()
    eng.detach()
    return out


def _rows(n: int, t: int = 6):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (n, t), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def _dp_trainer(steps: int, sigma: float, c: float, batch: int, d: str, **mech_kwargs) -> Loop:
    """DPTrainer's loop: a tiny BERT on N rows, a checkpoint every 2 steps for a stateful mechanism."""
    from transformers import PrinterCallback, TrainingArguments, default_data_collator

    save = mech_kwargs.get("mechanism") == "banded_mf"
    dp = hf.DPArguments(noise_multiplier=sigma, target_delta=1e-3, expected_batch_size=batch, max_grad_norm=c,
                        reproducible_seed=SEED, **mech_kwargs)
    args = TrainingArguments(output_dir=d, learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=steps,
                             save_strategy="steps" if save else "no", save_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = hf.DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=_rows(N),
                          data_collator=default_data_collator, dp_args=dp)
        tr.remove_callback(PrinterCallback)  # the audit's output is its checks, not Trainer's logs
        noises, batches, orig = _record_noise(tr.mechanism), {}, tr.dp_step.indices

        def indices(step):
            idx = orig(step)
            batches[int(step)] = idx.tolist()
            return idx

        tr.dp_step.indices = indices
        tr.train()
    out = Loop(noises, batches, tr.ledger, getattr(tr.sampler, "partition_rate", tr.q),
               Randomness(SEED).child("hf-train-loop-1"), tr.mechanism)
    if tr.mechanism.stateful:  # the 0600 file in output_dir; nothing of it in checkpoint-* or the optimizer
        bufs, in_ckpt = _buffers(tr.mechanism), []
        for ck in Path(d).glob("checkpoint-*"):
            for f in ck.iterdir():
                if "noise" in f.name or (f.suffix in (".pt", ".bin") and f.name != "training_args.bin"
                                         and _holds_any(torch.load(f, weights_only=False, map_location="cpu"), bufs)):
                    in_ckpt.append(f"{ck.name}/{f.name}")
        leaked = _holds_any(tr.optimizer.state_dict(), bufs)
        mode = _mode(Path(d) / "noise_state.secret.pt")
        out.secret = [(not leaked, f"optimizer.state_dict() {'HOLDS' if leaked else 'holds no'} noise buffer"),
                      (mode == 0o600, f"output_dir/noise_state.secret.pt mode {oct(mode) if mode else 'MISSING'}"),
                      (not in_ckpt, f"noise state in checkpoint-*: {in_ckpt or 'none'}")]
    return out


#: The ways in's loops: ``(name, loop(steps, sigma, c, batch, tmp_dir, **mechanism keywords) -> Loop)``.
LOOPS: tuple[tuple[str, Callable[..., Loop]], ...] = (("make_private", _make_private), ("DPTrainer", _dp_trainer))


# ----------------------------------------------------------------------------- the properties, once


def _min_gap(batches: dict[int, list[int]]) -> int:
    last, gap = {}, 10**9
    for t in sorted(batches):
        for i in batches[t]:
            if i in last:
                gap = min(gap, t - last[i])
            last[i] = t
    return gap


def _flat_events(ledger) -> list:
    return [e.event for e in ledger.entries for _ in range(e.count)]


def banded_checks(name: str, loop: Callable[..., Loop], bands: int = 3, steps: int = 6, sigma: float = 0.9,
                  c: float = 0.5, batch: int = 4) -> list[Check]:
    """``mechanism="banded_mf"`` through one way in's loop: noise C⁻¹Z, separation + events + calibration,
    the secret state."""
    with tempfile.TemporaryDirectory() as d:
        run = loop(steps, sigma, c, batch, d, mechanism="banded_mf", bands=bands)
    cm = torch.from_numpy(strategy_matrix(banded_coefficients(steps, bands), len(run.noises)))
    worst, scale = 0.0, sigma * c
    for key, t in (run.noises[0].items() if run.noises else ()):
        y = torch.stack([s[key].flatten() for s in run.noises])
        z = torch.stack([run.rng.stream("noise", k, key).normal(t.shape).double().flatten()
                         for k in range(len(run.noises))])
        worst = max(worst, float((cm @ y - scale * z).abs().max()))
    ok_noise = len(run.noises) == steps and worst < 1e-5 * max(scale, 1.0) and type(run.mech).__name__ == "BandedMFMechanism"
    gap = _min_gap(run.batches)
    want = [dpa.PoissonSampledDpEvent(run.p, dpa.GaussianDpEvent(sigma)) if t % bands == 0 else dpa.NoOpDpEvent()
            for t in range(steps)]
    ok_ev = _flat_events(run.ledger) == want
    # σ is calibrated on banded_phase_event = ⌈n/b⌉ × the recorded PoissonSampled event (same composition)
    cal = banded_phase_event(sigma, run.p, steps, bands)
    recorded = [e for e in _flat_events(run.ledger) if not isinstance(e, dpa.NoOpDpEvent)]
    ok_cal = recorded == [cal.event] * cal.count
    return [Check(f"{name} banded_mf: noise is C⁻¹Z", ok_noise,
                  f"{len(run.noises)} steps, b = {bands}: max |C·Y − σC·Z| = {worst:.2e} (σC = {scale:.3g}; C from "
                  f"banded_coefficients, ‖c‖ = 1; {type(run.mech).__name__})", {"max_err": worst}),
            Check(f"{name} banded_mf: b-min-separation, events, calibration", gap >= bands and ok_ev and ok_cal,
                  f"smallest gap between two participations {gap} steps (≥ {bands}); ledger "
                  f"{'= PoissonSampled(p, σ) at t ≡ 0 mod b, NoOp else' if ok_ev else 'NOT the banded events'}; "
                  f"{len(recorded)} subsampled-Gaussian events {'=' if ok_cal else '≠'} the {cal.count} σ is "
                  "calibrated on", {"min_gap": gap}),
            Check(f"{name} banded_mf: secret noise state", bool(run.secret) and all(ok for ok, _ in run.secret),
                  "; ".join(what for _, what in run.secret) or "no secret state found", {})]


def truncated_check(name: str, loop: Callable[..., Loop], steps: int = 3, sigma: float = 1.0, batch: int = 16,
                    b_max: int = 11) -> Check:
    """``max_batch_size=B_max`` through one way in's loop: every logical batch ≤ B_max; the truncated event."""
    with tempfile.TemporaryDirectory() as d:
        run = loop(steps, sigma, 1.0, batch, d, max_batch_size=b_max)
    want = truncated_event(N, batch / N, b_max, sigma)
    got = _flat_events(run.ledger)
    biggest = max(len(v) for v in run.batches.values())
    ok = biggest <= b_max and got == [want] * steps
    return Check(f"{name} max_batch_size: bound and truncated events", ok,
                 f"{steps} steps at q·N = {batch}, B_max = {b_max}: largest logical batch {biggest}; ledger "
                 f"{'= ' if got == [want] * steps else 'is NOT '}{steps} × TruncatedSubsampledGaussian",
                 {"max_batch": biggest})


def mechanisms_api_checks(planted: Optional[str] = None) -> list[Check]:
    """Banded MF and truncated Poisson through every way in of :data:`LOOPS`.

    Args:
        planted: None (the real code) or one of :data:`MECHANISMS_PLANTED` (at least one check must fail).

    Raises:
        ValueError: an unknown planted bug."""
    if planted is not None and planted not in MECHANISMS_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(MECHANISMS_PLANTED)}")
    with planted_bug(planted):
        return [c for name, loop in LOOPS for c in [*banded_checks(name, loop), truncated_check(name, loop)]]


# ----------------------------------------------------------------------------- the methods


class _Recording(torch.optim.SGD):
    """SGD that keeps each step's noisy gradient (the DP step sets ``p.grad`` before ``step``)."""

    def step(self, closure=None):
        self.seen.append(torch.cat([p.grad.detach().flatten().clone() for g in self.param_groups
                                    for p in g["params"]]))
        return super().step(closure)


def _adaptive_noise(steps: int = 40, n: int = 16) -> Check:
    model = nn.Linear(40, 25)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    data = TensorDataset(torch.randn(n, 40, generator=torch.Generator().manual_seed(0)), torch.zeros(n, 25))
    opt = _Recording(model.parameters(), lr=0.0)
    opt.seen = []
    eng = PrivacyEngine(reproducible_seed=3)
    cfg = {"name": "dp_adam_ac", "adaptive_clip": True, "count_noise": _SIGMA_B, "clip_lr": _ETA,
           "target_clip_rate": _RHO}
    cs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, dp_opt, crit, loader = eng.make_private(
            module=model, optimizer=opt, criterion=nn.MSELoss(reduction="sum"), dataset=data, expected_batch_size=n,
            max_grad_norm=1.0, steps=steps, noise_multiplier=_SIGMA, methods=[cfg])
        while dp_opt.logical_steps < steps:
            for x, y in loader:
                crit(module(x), y).backward()
                if dp_opt.step():
                    cs.append(dp_opt.method_stats["clip_norm"])
                dp_opt.zero_grad()
                if dp_opt.logical_steps >= steps:
                    break
    cs.append(dp_opt.max_grad_norm)
    qn = float(n)  # q = 1
    grad_std = float(torch.cat([g * qn / c for g, c in zip(opt.seen, cs)]).std())
    b = [(1 - _RHO) - math.log(cs[t + 1] / cs[t]) / _ETA for t in range(steps)]
    count_std = float(torch.tensor([(bt - 1.0) * qn for bt in b]).std())
    want = (_SIGMA ** -2 - (2 * _SIGMA_B) ** -2) ** -0.5
    entries = [(e.phase, repr(e.event), e.count) for e in eng.ledger.entries]
    ledger_ok = entries == [("train", repr(dpa.PoissonSampledDpEvent(1.0, dpa.GaussianDpEvent(_SIGMA))), steps)]
    # std of z over 40·1025 draws: ±1% (3 se ≈ 1.5%); of 40 counts: ±11% (3 se ≈ 34%)
    ok = abs(grad_std / want - 1) < 0.05 and abs(count_std / _SIGMA_B - 1) < 0.4 and ledger_ok
    return Check("methods/make_private: adaptive clip noise σ_Δ·C_t, count noise σ_b, one event per step", ok,
                 f"gradient noise / C_t: std {grad_std:.3f} (σ_Δ = {want:.3f}, σ = {_SIGMA}); count noise std "
                 f"{count_std:.3f} (σ_b = {_SIGMA_B}); ledger {'= ' if ledger_ok else '≠ '}{steps} × "
                 f"PoissonSampled(q, Gaussian(σ))", {"grad_noise_std": grad_std, "sigma_delta": want,
                                                     "count_noise_std": count_std})


def _trainer_count_streams() -> Check:
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments, default_data_collator

    drawn: list[list[float]] = []
    orig = clipmod.AdaptiveQuantileClip.noisy_unclipped_fraction

    def recording(self, unclipped, batch_size, expected_batch, step):
        drawn[-1].append(float(self.rng.stream("count", step).normal((), dtype=torch.float64)))
        return orig(self, unclipped, batch_size, expected_batch, step)

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16,
                                                     max_position_embeddings=16))
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(3, 40, (16, 4), generator=g).tolist(),
                                     "attention_mask": [[1] * 4] * 16,
                                     "labels": torch.randint(0, 2, (16,), generator=g).tolist()})
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=d, max_steps=2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=100)
        tr = hf.DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                          dp_args=hf.DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=4,
                                                 reproducible_seed=2, methods=[{"name": "dp_adam_ac",
                                                                                "adaptive_clip": True,
                                                                                "count_noise": 1.0}]))
        clipmod.AdaptiveQuantileClip.noisy_unclipped_fraction = recording
        try:
            for _ in range(2):
                drawn.append([])
                tr.train()
        finally:
            clipmod.AdaptiveQuantileClip.noisy_unclipped_fraction = orig
    fresh = len(drawn[0]) == len(drawn[1]) == 2 and all(a != b for a, b in zip(drawn[0], drawn[1]))
    return Check("methods/DPTrainer: each train() loop draws fresh count noise (adaptive clip)", fresh,
                 f"count noise of loop 1 {[round(x, 4) for x in drawn[0]]}, loop 2 {[round(x, 4) for x in drawn[1]]}",
                 {"fresh": fresh})


def _subspace_way(d: str, c: float = 0.05, n: int = 5, k: int = 4) -> WayIn:
    """make_private with DP-SFT on a given (random orthonormal) basis; ``S`` = the released coordinates."""
    def model_():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    params = dict(model_().named_parameters())
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), k,
                                          generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    blocks, o = {}, 0
    for name, p in params.items():
        blocks[name] = flat[o:o + p.numel()].T.reshape(k, *p.shape).float().contiguous()
        o += p.numel()
    path = SubspaceBasis(blocks=blocks, singular_values=torch.ones(k, dtype=torch.float64),
                         meta={"source": "public"}).save(f"{d}/basis.safetensors")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[0] *= 50.0  # a large gradient

    def step(keep: list[int], sigma: float, cc: float):
        model = model_()
        before = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, opt, crit, loader = PrivacyEngine(reproducible_seed=0).make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
                dataset=TensorDataset(x[keep], y[keep]), expected_batch_size=len(keep), max_grad_norm=cc, steps=1,
                noise_multiplier=sigma,
                methods=[{"name": "dpsft", "source": "file", "file": str(path), "k": k, "start": "initial"}])
            for xb, yb in loader:
                crit(module(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                break
        after = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        return -(flat.T @ (after - before)) * len(keep), opt  # coordinates of the released clipped sum

    return WayIn("DP-SFT (live projection, coordinates in R^k)", list(range(n)), step, c=c, what=f"k = {k}")


def _subspace_leave_one_out() -> Check:
    with tempfile.TemporaryDirectory() as d:
        return leave_one_out(_subspace_way(d), "methods/make_private")


def methods_api_checks(planted: Optional[str] = None) -> list[Check]:
    """The three method checks; ``planted`` one of :data:`METHODS_PLANTED` (or None)."""
    if planted is not None and planted not in METHODS_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(METHODS_PLANTED)}")
    with planted_bug(planted):
        return [_adaptive_noise(), _trainer_count_streams(), _subspace_leave_one_out()]
