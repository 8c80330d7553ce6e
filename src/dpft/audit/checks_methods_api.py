"""Audit checks of the methods through the Python ways in (issue 34 item 4): DP-Adam-AC's private
adaptive clipping and DP-SFT with a given subspace, run through ``make_private(methods=…)`` and
``DPArguments(methods=…)`` themselves, measured from what they release.

* **adaptive clipping: noise σ_Δ·C_t and the count at σ_b** (make_private) — a linear model at
  zero weights with squared-error targets 0 has every per-example gradient exactly 0, and a
  learning rate of 0 keeps it there, so each step's noisy gradient (read from ``p.grad`` in the
  optimizer's ``step``) is pure noise: ``p.grad · qN / C_t ~ N(0, σ_Δ²)`` with
  σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al. 2021, Thm. 1), C_t the clip norm in force at step
  t. Every example is unclipped, so the released fraction is b̃_t = 1 + z_t/(qN) and
  ``C_{t+1} = C_t·exp(−η(b̃_t − (1 − ρ*)))`` gives back the count noise z_t ~ N(0, σ_b²). The
  ledger must hold one PoissonSampled(q, Gaussian(σ)) per step (the two releases are one
  Gaussian mechanism of multiplier σ). Planted ``api_adaptive_noise_unadjusted``: the gradient
  noised at σ instead of σ_Δ while the count is still released (the count's privacy uncovered).
* **adaptive clipping: fresh count noise per training loop** (DPTrainer) — two ``train()`` calls
  of one trainer draw their count noise from different secret streams, as their gradient noise
  and batches do. Planted ``trainer_count_stream_reused``: the methods' draws not renewed with
  the loop's stream (the second loop's counts reuse the first loop's noise).
* **DP-SFT: leave-one-out in R^k ≤ C** (make_private, user's own forward/backward, σ = 0,
  q = 1, SGD at lr 1) — ``s = −Pᵀ Δθ · qN`` is the released clipped sum of coordinates, and
  ``max_i ‖s(D) − s(D∖i)‖ ≤ C`` on an adversarial set (a large input). Planted
  ``api_subspace_unclipped``: the live projection's clip skipped.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from typing import Optional

import dp_accounting as dpa
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft.api import PrivacyEngine
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.integrations.hf import trainer as hf
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.methods import dp_adam_ac
from dpft.methods.dpsft import method as dpsft
from dpft.step import clip as clipmod
from dpft.transforms.subspace import SubspaceBasis

__all__ = ["PLANTED", "methods_api_checks", "planted_bug"]

PLANTED = ("api_adaptive_noise_unadjusted", "trainer_count_stream_reused", "api_subspace_unclipped")
_SIGMA, _SIGMA_B, _ETA, _RHO = 1.0, 0.6, 0.2, 0.2


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
    "api_adaptive_noise_unadjusted": lambda p: p.set(dp_adam_ac, "effective_noise_multiplier",
                                                     lambda sigma, count_noise: float(sigma)),
    "trainer_count_stream_reused": lambda p: p.set(hf.DPTrainer, "get_train_dataloader",
                                                   hf_data.PoissonData.get_train_dataloader),
    "api_subspace_unclipped": lambda p: p.set(dpsft.LiveSubspace, "reduce",
                                              _unclipped_reduce(dpsft.LiveSubspace.reduce)),
})


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
    z = torch.cat([g * qn / c for g, c in zip(opt.seen, cs)])
    grad_std = float(z.std())
    b = [(1 - _RHO) - math.log(cs[t + 1] / cs[t]) / _ETA for t in range(steps)]
    counts = torch.tensor([(bt - 1.0) * qn for bt in b])
    count_std = float(counts.std())
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
        tr = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                       dp_args=DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=4,
                                           reproducible_seed=2,
                                           methods=[{"name": "dp_adam_ac", "adaptive_clip": True,
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


def _subspace_leave_one_out(c: float = 0.05, n: int = 5) -> Check:
    def model_():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    params = dict(model_().named_parameters())
    k = 4
    flat, _ = torch.linalg.qr(torch.randn(sum(p.numel() for p in params.values()), k,
                                          generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    blocks, o = {}, 0
    for name, p in params.items():
        blocks[name] = flat[o:o + p.numel()].T.reshape(k, *p.shape).float().contiguous()
        o += p.numel()
    basis = SubspaceBasis(blocks=blocks, singular_values=torch.ones(k, dtype=torch.float64),
                          meta={"source": "public"})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[0] *= 50.0  # a large gradient

    def released(keep: list[int], path) -> torch.Tensor:
        model = model_()
        before = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, opt, crit, loader = PrivacyEngine(reproducible_seed=0).make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
                dataset=TensorDataset(x[keep], y[keep]), expected_batch_size=len(keep), max_grad_norm=c, steps=1,
                noise_multiplier=0.0,
                methods=[{"name": "dpsft", "source": "file", "file": str(path), "k": k, "start": "initial"}])
            for xb, yb in loader:
                crit(module(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                break
        after = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        return -(flat.T @ (after - before)) * len(keep)  # coordinates of the released clipped sum

    with tempfile.TemporaryDirectory() as d:
        path = basis.save(f"{d}/basis.safetensors")
        full = released(list(range(n)), path)
        worst = max(float((full - released([j for j in range(n) if j != i], path)).norm()) for i in range(n))
    ok = worst <= c * (1 + 1e-3)
    return Check("methods/make_private: DP-SFT leave-one-out in R^k ≤ C (live projection)", ok,
                 f"max_i ‖s(D) − s(D∖i)‖ = {worst:.4g}, C = {c}", {"max_sensitivity": worst, "C": c})


def methods_api_checks(planted: Optional[str] = None) -> list[Check]:
    """The three checks; ``planted`` one of :data:`PLANTED` (or None)."""
    with planted_bug(planted):
        return [_adaptive_noise(), _trainer_count_streams(), _subspace_leave_one_out()]
