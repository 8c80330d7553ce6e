"""The plan's mechanisms, checked once on the session's plan, and the methods through the Python ways in
(issues 28 and 34; issue 46 item 4).

``audit/checks_mechanisms.py`` checks the mechanisms' classes and the CLI. Every way in gets its
mechanism and sampler from the private session's plan (session/core.py ``PrivateSession.plan``;
audit/ways_in_session.py checks that its step runs that plan's parts), so the plan's parts are checked
once, on ``make_private``'s loop of a tiny model with reproducible randomness (the auditor recomputes
the noise from the streams; :class:`Loop`: what it released and recorded):

* **banded noise is C⁻¹Z** (``mechanism="banded_mf"``) — the noise each step released (released sum −
  clipped sum, read at the mechanism) satisfies C·Y = σC_clip·Z exactly, Z drawn independently from the
  loop's streams and C built from ``banded_coefficients(n, b)`` (‖C[:, i]‖ ≤ 1: sensitivity C_clip per
  participation), over more steps than bands (across the buffers);
* **b-min-separation, events and calibration** — the examples each step trained on participate ≥ b steps
  apart; the ledger holds PoissonSampled(p, Gaussian(σ)) at t ≡ 0 (mod b) and NoOp otherwise, the
  composition σ is calibrated on (``banded_phase_event``) (planted ``api_banded_every_partition``: the
  plan builds a cyclic sampler that ignores the partitions; ``no_min_separation``: the cyclic sampler
  itself draws every example at every step);
* **truncation** (``max_batch_size=B_max``) — every logical batch ≤ B_max and every step records
  ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` (planted ``trainer_truncation_not_recorded``: the
  truncated mechanism not installed, so the plain Poisson event is recorded, under-accounting the
  replace-one branch; ``truncation_not_in_ledger``: the Gaussian release's event ignores the sampler's
  truncated event).

Then, thinly, per way in (:data:`LOOPS`: ``make_private``, ``DPTrainer``): its mechanism settings reach the
session unchanged — one session plan per loop whose mechanism part is the one asked for, a step that runs
that plan's parts, and a ledger holding the plan mechanism's events of steps 0…T−1, those σ was calibrated on
(N, q, T, b or B_max).
The secret state's save and restore through every way in is audit/checks_resume.py's.

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
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import dp_accounting as dpa
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.audit.planted import bug_planter
from dpft.audit.ways_in import WayIn, leave_one_out
from dpft.audit.ways_in_session import reaches_session, session_plans
from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf import trainer as hf
from dpft.methods import dp_adam_ac
from dpft.methods.dpsft import method as dpsft
from dpft.privacy.randomness import Randomness
from dpft.step import clip as clipmod
from dpft.step import mechanisms, noise
from dpft.step.correlated import CyclicPoissonSampler, banded_coefficients, banded_phase_event, strategy_matrix
from dpft.step.mechanisms import TruncatedPoisson
from dpft.step.truncated import truncated_event
from dpft.transforms.subspace import SubspaceBasis

__all__ = ["PLANTED", "MECHANISMS_PLANTED", "METHODS_PLANTED", "mechanisms_api_checks", "methods_api_checks",
           "plan_parts_checks", "reaches_session_check", "run_loops", "planted_bug", "LOOPS"]

MECHANISMS_PLANTED = ("api_banded_every_partition", "no_min_separation", "trainer_truncation_not_recorded",
                      "truncation_not_in_ledger")
METHODS_PLANTED = ("api_adaptive_noise_unadjusted", "trainer_count_stream_reused", "api_subspace_unclipped")
PLANTED = MECHANISMS_PLANTED + METHODS_PLANTED
SEED = 5
N = 40
_SIGMA, _SIGMA_B, _ETA, _RHO = 1.0, 0.6, 0.2, 0.2
#: The mechanism settings every loop is run with: ``kind -> (steps, σ, C, B, keywords)``.
RUNS = {"banded_mf": (6, 0.9, 0.5, 4, {"mechanism": "banded_mf", "bands": 3}),
        "max_batch_size": (3, 1.0, 1.0, 16, {"max_batch_size": 11})}


class _EveryPartition(CyclicPoissonSampler):
    """Planted: every example may be drawn at every step (the banded partition ignored)."""

    def indices(self, step):
        draw = self.rng.stream("sample", int(step)).bernoulli((self.n,), self.partition_rate)
        return torch.nonzero(draw).flatten()


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
    "no_min_separation": lambda p: p.set(CyclicPoissonSampler, "indices", _EveryPartition.indices),
    "trainer_truncation_not_recorded": lambda p: p.set(TruncatedPoisson, "install", lambda self, spec, **kw: spec),
    "truncation_not_in_ledger": lambda p: p.set(noise.GaussianMechanism, "event", lambda self, q: (
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(self.accounted_sigma)))),
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
    ledger, the sampling (or partition) rate, the loop's secret stream root, the mechanism, the step's parts
    and the ``(settings, plan)`` pairs the private session built meanwhile."""

    noises: list
    batches: dict
    ledger: Any
    p: float
    rng: Randomness
    mech: Any
    spec: Any
    plans: list


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


def _make_private(steps: int, sigma: float, c: float, batch: int, d: str, **mech_kwargs) -> Loop:
    """make_private's loop: a 2-layer net on N rows (their index the third column, to record batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 5, generator=g) * 3, torch.randint(0, 2, (N,), generator=g), torch.arange(N))
    eng = PrivacyEngine(reproducible_seed=SEED)
    with warnings.catch_warnings(), session_plans() as plans:
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=batch, max_grad_norm=c, noise_multiplier=sigma, steps=steps,
            max_physical_batch_size=3, **mech_kwargs)
    mech = opt.dp_step.spec.mechanism
    noises, batches = _record_noise(mech), {}
    while opt.logical_steps < steps:
        for x, y, idx in loader:
            batches.setdefault(opt.current_step, []).extend(idx.tolist())
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    eng.detach()
    return Loop(noises, batches, eng.ledger, getattr(opt.dp_step.spec.sampler, "partition_rate", batch / N),
                Randomness(SEED).child("make_private:1"), mech, opt.dp_step.spec, plans)


def _dp_trainer(steps: int, sigma: float, c: float, batch: int, d: str, **mech_kwargs) -> Loop:
    """DPTrainer's loop: a tiny BERT on N rows (its noise and batches not recorded: the plan's are checked once)."""
    from transformers import PrinterCallback, TrainingArguments, default_data_collator

    dp = hf.DPArguments(noise_multiplier=sigma, target_delta=1e-3, expected_batch_size=batch, max_grad_norm=c,
                        reproducible_seed=SEED, **mech_kwargs)
    args = TrainingArguments(output_dir=d, learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=steps, save_strategy="no")
    with warnings.catch_warnings(), session_plans() as plans:
        warnings.simplefilter("ignore")
        tr = hf.DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=tiny_rows(N),
                          data_collator=default_data_collator, dp_args=dp)
        tr.remove_callback(PrinterCallback)  # the audit's output is its checks, not Trainer's logs
        tr.train()
    return Loop([], {}, tr.ledger, getattr(tr.sampler, "partition_rate", tr.q), Randomness(SEED).child("hf-train-loop-1"),
                tr.mechanism, tr.dp_step.spec, plans)


#: The ways in's loops: ``(name, loop(steps, sigma, c, batch, tmp_dir, **mechanism keywords) -> Loop)``.
LOOPS: tuple[tuple[str, Callable[..., Loop]], ...] = (("make_private", _make_private), ("DPTrainer", _dp_trainer))


def run_loops(loop: Callable[..., Loop]) -> dict[str, Loop]:
    """One way in's loop under each mechanism setting of :data:`RUNS`."""
    out = {}
    for kind, (steps, sigma, c, batch, kw) in RUNS.items():
        with tempfile.TemporaryDirectory() as d:
            out[kind] = loop(steps, sigma, c, batch, d, **kw)
    return out


# ----------------------------------------------------------------------------- the plan's parts, once


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


def plan_parts_checks(runs: dict[str, Loop]) -> list[Check]:
    """The session plan's mechanisms on one loop per setting of :data:`RUNS` (``run_loops``): banded noise
    C⁻¹Z; b-min-separation, events and calibration; the truncation bound and events."""
    steps, sigma, c, batch, kw = RUNS["banded_mf"]
    bands, run = kw["bands"], runs["banded_mf"]
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
    t_steps, t_sigma, _, t_batch, t_kw = RUNS["max_batch_size"]
    b_max, tr = t_kw["max_batch_size"], runs["max_batch_size"]
    t_want, got = truncated_event(N, t_batch / N, b_max, t_sigma), _flat_events(tr.ledger)
    biggest = max(len(v) for v in tr.batches.values())
    return [Check("session plan banded_mf: noise is C⁻¹Z", ok_noise,
                  f"{len(run.noises)} steps, b = {bands}: max |C·Y − σC·Z| = {worst:.2e} (σC = {scale:.3g}; C from "
                  f"banded_coefficients, ‖c‖ = 1; {type(run.mech).__name__})", {"max_err": worst}),
            Check("session plan banded_mf: b-min-separation, events, calibration", gap >= bands and ok_ev and ok_cal,
                  f"smallest gap between two participations {gap} steps (≥ {bands}); ledger "
                  f"{'= PoissonSampled(p, σ) at t ≡ 0 mod b, NoOp else' if ok_ev else 'NOT the banded events'}; "
                  f"{len(recorded)} subsampled-Gaussian events {'=' if ok_cal else '≠'} the {cal.count} σ is "
                  "calibrated on", {"min_gap": gap}),
            Check("session plan max_batch_size: bound and truncated events",
                  biggest <= b_max and got == [t_want] * t_steps,
                  f"{t_steps} steps at q·N = {t_batch}, B_max = {b_max}: largest logical batch {biggest}; ledger "
                  f"{'= ' if got == [t_want] * t_steps else 'is NOT '}{t_steps} × TruncatedSubsampledGaussian",
                  {"max_batch": biggest})]


def reaches_session_check(name: str, runs: dict[str, Loop]) -> Check:
    """One way in's mechanism settings reach the session unchanged (audit/ways_in_session.py ``reaches_session``):
    per setting of :data:`RUNS`, one session plan whose mechanism part is the one asked for, the loop's step runs
    that plan's parts, and its ledger holds the plan's T steps and the events the plan's σ was calibrated on."""
    problems = []
    for kind, run in runs.items():
        kw = dict(RUNS[kind][4])
        asked = mechanisms.mechanism_of(kw.pop("mechanism", "gaussian"), **kw).settings()
        problems += [f"{kind}: {p}" for p in reaches_session(run.plans, run.spec, asked, ledger=run.ledger)]
    return Check(f"session: {name} reaches the session's mechanisms unchanged ({', '.join(runs)})", not problems,
                 "; ".join(problems) or "one session plan per setting, with the mechanism asked for; the step runs its "
                 "parts; the ledger holds its events of steps 0…T−1, as calibrated", {})


def mechanisms_api_checks(planted: Optional[str] = None) -> list[Check]:
    """The session plan's banded MF and truncated Poisson, once (on make_private's loops), and every way in of
    :data:`LOOPS` reaching them unchanged.

    Args:
        planted: None (the real code) or one of :data:`MECHANISMS_PLANTED` (at least one check must fail).

    Raises:
        ValueError: an unknown planted bug."""
    if planted is not None and planted not in MECHANISMS_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(MECHANISMS_PLANTED)}")
    with planted_bug(planted):
        runs = {name: run_loops(loop) for name, loop in LOOPS}
    return plan_parts_checks(runs[LOOPS[0][0]]) + [reaches_session_check(name, r) for name, r in runs.items()]


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
    from transformers import TrainingArguments, default_data_collator

    drawn: list[list[float]] = []
    orig = clipmod.AdaptiveQuantileClip.noisy_unclipped_fraction

    def recording(self, unclipped, batch_size, expected_batch, step):
        drawn[-1].append(float(self.rng.stream("count", step).normal((), dtype=torch.float64)))
        return orig(self, unclipped, batch_size, expected_batch, step)

    model, ds = tiny_classifier("bert").train(), tiny_rows(16, 4)
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
