"""Audit checks of the mechanisms beyond independent-Gaussian DP-SGD in the two Python ways in
(issue 28): ``PrivacyEngine.make_private(mechanism="banded_mf" | max_batch_size=...)`` and
``DPTrainer`` with ``DPArguments(mechanism="banded_mf" | max_batch_size=...)``.

``audit/checks_mechanisms.py`` checks the mechanisms' classes and the CLI; these checks drive the
real ways in end to end on tiny models (reproducible randomness, so the auditor can recompute the
noise from the streams) and look at what they release, record and write:

* **banded noise is C⁻¹Z** — the noise each step released (released sum − clipped sum, read at the
  mechanism) satisfies C·Y = σC_clip·Z exactly, Z drawn independently from the way in's streams and
  C built from ``banded_coefficients(n, b)`` (so ‖C[:, i]‖ ≤ 1: sensitivity C_clip per
  participation); over ≥ 3 steps, i.e. across the buffers (planted: none here — the CLI's
  ``banded_buffers_reset`` / ``banded_unnormalised`` break the same class);
* **b-min-separation and events** — the examples each step trained on (read from the way in's
  loader / sampler) participate ≥ b steps apart; the ledger holds PoissonSampled(p, Gaussian(σ))
  at t ≡ 0 (mod b) and NoOp otherwise, the composition σ is calibrated on (``banded_phase_event``)
  (planted ``api_banded_every_partition``: make_private's sampler ignores the partitions);
* **secret state stays secret** — ``optimizer.state_dict()`` holds no noise buffer;
  ``save_noise_state`` writes mode 0600 and a fresh engine restores buffers, partition and ledger;
  DPTrainer writes ``noise_state.secret.pt`` (0600) in ``output_dir`` and nothing of it in
  ``checkpoint-*`` (planted ``api_noise_state_in_optimizer``: the buffers in the optimizer's
  state dict, which users save and share with their checkpoints);
* **truncation** — every logical batch ≤ B_max, and every step records
  ``TruncatedSubsampledGaussianDpEvent(N, q, B_max, σ)`` (planted
  ``trainer_truncation_not_recorded``: DPTrainer records the plain Poisson event, which
  under-accounts the replace-one branch).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import dp_accounting as dpa
import torch

from dpft.audit.whitebox import Check, tiny_classifier
from dpft import PrivacyEngine
from dpft.api.optimizer import DPOptimizer
from dpft.audit.planted import bug_planter
from dpft.privacy.randomness import Randomness
from dpft.step import mechanisms
from dpft.step.correlated import CyclicPoissonSampler, banded_coefficients, banded_phase_event, strategy_matrix
from dpft.step.mechanisms import TruncatedPoisson
from dpft.step.truncated import truncated_event
from dpft.integrations.hf.trainer import DPArguments
from dpft.integrations.hf.trainer import DPTrainer

__all__ = ["PLANTED", "mechanisms_api_checks", "planted_bug", "make_private_banded", "make_private_truncated",
           "trainer_banded", "trainer_truncated"]

#: Planted bugs :func:`mechanisms_api_checks` must catch (audit/planted.py's registry lists them).
PLANTED = ("api_banded_every_partition", "api_noise_state_in_optimizer", "trainer_truncation_not_recorded")

SEED = 5


class _EveryPartition(CyclicPoissonSampler):
    """Planted: every example may be drawn at every step (the banded partition ignored)."""

    def indices(self, step):
        draw = self.rng.stream("sample", int(step)).bernoulli((self.n,), self.partition_rate)
        return torch.nonzero(draw).flatten()


def _state_dict_with_noise(self):
    """Planted: the optimizer's state_dict (a checkpoint file) carries the secret noise state."""
    return {**self.original_optimizer.state_dict(), "dp_noise_state": self.dp_step.spec.mechanism.state()}


planted_bug = bug_planter(PLANTED, {
    "api_banded_every_partition": lambda p: p.set(mechanisms, "CyclicPoissonSampler", _EveryPartition),
    "api_noise_state_in_optimizer": lambda p: p.set(DPOptimizer, "state_dict", _state_dict_with_noise),
    "trainer_truncation_not_recorded": lambda p: p.set(TruncatedPoisson, "install", lambda self, spec, **kw: spec),
})


# ----------------------------------------------------------------------------- helpers
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


def _noise_is_c_inv_z(noises, rng, sigma_std: float, steps: int, bands: int) -> tuple[float, float]:
    """max |C·Y − σC·Z| over tensors (C from banded_coefficients(steps, b); Z from ``rng``'s streams)
    and the scale σC, for the recorded noises of steps 0..len−1."""
    n = len(noises)
    cm = torch.from_numpy(strategy_matrix(banded_coefficients(steps, bands), n))
    worst = 0.0
    for name, t in noises[0].items():
        y = torch.stack([s[name].flatten() for s in noises])
        z = torch.stack([rng.stream("noise", k, name).normal(t.shape).double().flatten() for k in range(n)])
        worst = max(worst, float((cm @ y - sigma_std * z).abs().max()))
    return worst, sigma_std


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


def _banded_events_ok(ledger, p: float, sigma: float, steps: int, bands: int) -> bool:
    want = [dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(sigma)) if t % bands == 0 else dpa.NoOpDpEvent()
            for t in range(steps)]
    got = [e.event for e in ledger.entries for _ in range(e.count)]
    return got == want


# ----------------------------------------------------------------------------- make_private
def make_private_banded() -> list[Check]:
    """make_private(mechanism="banded_mf"): noise, separation + events + ε, secret state."""
    from torch import nn
    from torch.utils.data import TensorDataset

    n, batch, bands, steps, sigma, c_clip = 48, 4, 3, 7, 0.9, 0.5
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    data = TensorDataset(torch.randn(n, 5) * 3, torch.randint(0, 2, (n,)), torch.arange(n))
    eng = PrivacyEngine(reproducible_seed=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=batch, max_grad_norm=c_clip, noise_multiplier=sigma, steps=steps,
            mechanism="banded_mf", bands=bands, max_physical_batch_size=3)
        mech = opt.dp_step.spec.mechanism
        noises = _record_noise(mech)
        batches: dict[int, list[int]] = {}
        while opt.logical_steps < steps:
            for x, y, idx in loader:
                batches.setdefault(opt.current_step, []).extend(idx.tolist())
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
    worst, scale = _noise_is_c_inv_z(noises, Randomness(SEED).child("make_private:1"), sigma * c_clip, steps, bands)
    ok_noise = len(noises) == steps and worst < 1e-5 * max(scale, 1.0) and type(mech).__name__ == "BandedMFMechanism"
    c1 = Check("make_private banded_mf: noise is C⁻¹Z", ok_noise,
               f"{len(noises)} steps, b = {bands}: max |C·Y − σC·Z| = {worst:.2e} (σC = {scale:.3g}; C from "
               "banded_coefficients, ‖c‖ = 1)", {"max_err": worst})
    gap = _min_gap(batches)
    p = opt.dp_step.spec.sampler.partition_rate
    ok_ev = _banded_events_ok(eng.ledger, p, sigma, steps, bands)
    # σ is calibrated on banded_phase_event = ⌈n/b⌉ × the recorded PoissonSampled event (same composition)
    cal = banded_phase_event(sigma, p, steps, bands)
    recorded = [e for e in _flat_events(eng.ledger) if not isinstance(e, dpa.NoOpDpEvent)]
    ok_cal = recorded == [cal.event] * cal.count
    ok_sep = gap >= bands and ok_ev and ok_cal
    c2 = Check("make_private banded_mf: b-min-separation, events, calibration", ok_sep,
               f"smallest gap between two participations {gap} steps (≥ {bands}); ledger "
               f"{'= PoissonSampled(p, σ) at t ≡ 0 mod b, NoOp else' if ok_ev else 'NOT the banded events'}; "
               f"{len(recorded)} subsampled-Gaussian events {'=' if ok_cal else '≠'} the {cal.count} σ is calibrated on",
               {"min_gap": gap})
    # secret state: never in the optimizer's state dict; the file owner-only; a fresh engine restores it
    sd = opt.state_dict()
    bufs = [v for b in (mech.buffers if mech.stateful else []) for v in b.values()]
    leaked = _holds_any(sd, bufs)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "noise.secret.pt"
        eng.save_noise_state(path)
        mode = os.stat(path).st_mode & 0o777
        eng2 = PrivacyEngine(reproducible_seed=SEED)
        torch.manual_seed(0)
        model2 = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, opt2, _, _ = eng2.make_private(
                module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1),
                criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=batch, max_grad_norm=c_clip,
                noise_multiplier=sigma, steps=steps, mechanism="banded_mf", bands=bands)
        eng2.load_noise_state(path)
        m2 = opt2.dp_step.spec.mechanism
        restored = (m2.next_step == steps and eng2.ledger.steps == steps
                    and torch.equal(m2.sampler.partition, mech.sampler.partition)
                    and all(torch.equal(a[k], b[k]) for a, b in zip(m2.buffers, mech.buffers) for k in a))
    ok_sec = not leaked and mode == 0o600 and restored
    c3 = Check("make_private banded_mf: secret noise state", ok_sec,
               f"optimizer.state_dict() {'HOLDS the noise buffers' if leaked else 'holds no noise buffer'}; "
               f"save_noise_state mode {oct(mode)} (0o600); a fresh engine restored buffers, partition and ledger: "
               f"{restored}", {"leaked": leaked})
    eng.detach()
    eng2.detach()
    return [c1, c2, c3]


def _holds_any(obj, tensors) -> bool:
    """Whether ``obj`` (nested dicts/lists) holds a tensor equal to one of ``tensors``."""
    if isinstance(obj, torch.Tensor):
        return any(obj.shape == t.shape and torch.equal(obj.detach().cpu(), t.detach().cpu()) for t in tensors)
    if isinstance(obj, dict):
        return any(_holds_any(v, tensors) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_any(v, tensors) for v in obj)
    return False


def make_private_truncated() -> Check:
    """make_private(max_batch_size=B_max): every logical batch ≤ B_max; the truncated event."""
    from torch import nn
    from torch.utils.data import TensorDataset

    n, batch, b_max, steps, sigma = 40, 16, 12, 6, 1.0
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    eng = PrivacyEngine(reproducible_seed=SEED)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
        dataset=data, expected_batch_size=batch, max_grad_norm=1.0, noise_multiplier=sigma, steps=steps,
        max_batch_size=b_max, max_physical_batch_size=5)
    sizes: dict[int, int] = {}
    while opt.logical_steps < steps:
        for x, y in loader:
            sizes[opt.current_step] = sizes.get(opt.current_step, 0) + len(x)
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    want = truncated_event(n, batch / n, b_max, sigma)
    got = [e.event for e in eng.ledger.entries for _ in range(e.count)]
    ok = max(sizes.values()) <= b_max and got == [want] * steps
    eng.detach()
    return Check("make_private max_batch_size: bound and truncated events", ok,
                 f"{steps} steps at q·N = {batch}, B_max = {b_max}: largest logical batch {max(sizes.values())}; "
                 f"ledger {'= ' if got == [want] * steps else 'is NOT '}{steps} × TruncatedSubsampledGaussian",
                 {"max_batch": max(sizes.values())})


# ----------------------------------------------------------------------------- DPTrainer
def _rows(n: int, t: int = 6):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (n, t), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def _trainer(out: str, dp, max_steps: int, save_steps: Optional[int] = None):
    from transformers import TrainingArguments, default_data_collator


    args = TrainingArguments(output_dir=out, learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=max_steps,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    return DPTrainer(model=tiny_classifier("bert").train(), args=args, train_dataset=_rows(40),
                     data_collator=default_data_collator, dp_args=dp)


def _record_batches(tr) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    orig = tr.dp_step.indices

    def indices(step):
        idx = orig(step)
        out[int(step)] = idx.tolist()
        return idx

    tr.dp_step.indices = indices
    return out


def trainer_banded() -> list[Check]:
    """DPTrainer(mechanism="banded_mf"): noise, separation + events, the secret file."""

    bands, steps, sigma, c_clip = 2, 3, 0.9, 1.0
    dp = DPArguments(noise_multiplier=sigma, target_delta=1e-3, expected_batch_size=8, max_grad_norm=c_clip,
                     mechanism="banded_mf", bands=bands, reproducible_seed=SEED)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(d, dp, steps, save_steps=2)
        noises = _record_noise(tr.mechanism)
        batches = _record_batches(tr)
        tr.train()
        worst, scale = _noise_is_c_inv_z(noises, Randomness(SEED).child("hf-train-loop-1"), sigma * c_clip,
                                         steps, bands)
        secret = Path(d) / "noise_state.secret.pt"
        mode = os.stat(secret).st_mode & 0o777 if secret.is_file() else None
        bufs = [v for b in (tr.mechanism.buffers if tr.mechanism.stateful else []) for v in b.values()]
        in_ckpt = []
        for ck in Path(d).glob("checkpoint-*"):
            for f in ck.iterdir():
                if "noise" in f.name or (f.suffix in (".pt", ".bin") and f.name != "training_args.bin"
                                         and _holds_any(torch.load(f, weights_only=False, map_location="cpu"), bufs)):
                    in_ckpt.append(f"{ck.name}/{f.name}")
        leaked = _holds_any(tr.optimizer.state_dict(), bufs)
        p = getattr(tr.sampler, "partition_rate", tr.q)
        ok_ev = _banded_events_ok(tr.ledger, p, sigma, steps, bands)
    gap = _min_gap(batches)
    c1 = Check("DPTrainer banded_mf: noise is C⁻¹Z", len(noises) == steps and worst < 1e-5 * max(scale, 1.0),
               f"{len(noises)} steps, b = {bands}: max |C·Y − σC·Z| = {worst:.2e} (σC = {scale:.3g})",
               {"max_err": worst})
    c2 = Check("DPTrainer banded_mf: b-min-separation and events", gap >= bands and ok_ev,
               f"smallest gap between two participations {gap} steps (≥ {bands}); ledger "
               f"{'= PoissonSampled(p, σ) at t ≡ 0 mod b, NoOp else' if ok_ev else 'NOT the banded events'}",
               {"min_gap": gap})
    ok_sec = mode == 0o600 and not in_ckpt and not leaked
    c3 = Check("DPTrainer banded_mf: secret noise state outside the checkpoints", ok_sec,
               f"output_dir/noise_state.secret.pt mode {oct(mode) if mode is not None else 'MISSING'}; noise state in "
               f"checkpoint-*: {in_ckpt or 'none'}; in the optimizer state dict: {leaked}", {})
    return [c1, c2, c3]


def trainer_truncated() -> Check:
    """DPTrainer(max_batch_size=B_max): every logical batch ≤ B_max; the truncated event."""

    steps, sigma, b_max, batch = 2, 1.0, 11, 16
    dp = DPArguments(noise_multiplier=sigma, target_delta=1e-3, expected_batch_size=batch, max_batch_size=b_max,
                     reproducible_seed=SEED)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(d, dp, steps)
        batches = _record_batches(tr)
        tr.train()
    want = truncated_event(40, batch / 40, b_max, sigma)
    got = [e.event for e in tr.ledger.entries for _ in range(e.count)]
    biggest = max(len(v) for v in batches.values())
    ok = biggest <= b_max and got == [want] * steps
    return Check("DPTrainer max_batch_size: bound and truncated events", ok,
                 f"{steps} steps at q·N = {batch}, B_max = {b_max}: largest logical batch {biggest}; ledger "
                 f"{'= ' if got == [want] * steps else 'is NOT '}{steps} × TruncatedSubsampledGaussian",
                 {"max_batch": biggest})


def mechanisms_api_checks(planted: Optional[str] = None) -> list[Check]:
    """Run the checks (tiny models; a few seconds per way in).

    Args:
        planted: None (the real code) or one of :data:`PLANTED` (at least one check must fail).

    Raises:
        ValueError: an unknown planted bug."""
    with planted_bug(planted):
        return [*make_private_banded(), make_private_truncated(), *trainer_banded(), trainer_truncated()]
