"""The DP-Adam family on the privatised gradient: DP-Adam, DP-AdamW, DP-AdamBC, Adam-AC's γ and EMA.

All of it is post-processing of the noisy gradient (or of the privatised clip rate), so none
of it costs privacy or touches the ledger.

- ``DPAdam``: Adam (Kingma & Ba 2015) with optional decoupled weight decay (AdamW, Loshchilov
  & Hutter 2019) and optional DP-AdamBC correction (Tang et al. 2023, "DP-AdamBC: Your DP-Adam
  Is Actually DP-SGD (Unless You Apply Bias Correction)", Alg. 1): the second moment of a
  noisy gradient g̃ = g + z, z ~ N(0, Φ I), is E[g̃²] = g² + Φ, so the step uses
  ``m̂ / sqrt(max(v̂ − Φ̂, γ′))`` where Φ = (σ C / (q N))² is the per-coordinate variance of
  the noise in the averaged gradient and γ′ a floor.
- ``GammaNudger``: DP-Adam-AC's learning-rate multiplier (Yang, Alg. 1 lines 23–27), driven
  by the *privatised* clip rate.
- ``WeightEMA``: θ̂ ← d θ̂ + (1 − d) θ (Yang, Alg. 1 line 18).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable

import torch


class DPAdam(torch.optim.Optimizer):
    """Adam / AdamW / AdamBC for privatised gradients.

    Args:
        params: parameters (or groups).
        lr, betas, eps: as ``torch.optim.Adam``; ``eps`` is added to sqrt(v̂) (plain Adam) and
            unused with bias correction (γ′ plays its role, as in Tang et al.).
        weight_decay: decoupled (AdamW) decay, θ ← θ − lr·wd·θ; 0 = DP-Adam.
        bias_correction: DP-AdamBC; needs :meth:`set_noise_variance` before every step.
        bc_floor: γ′ > 0, the floor of the corrected second moment (units of gradient²).

    The noise variance Φ_t may change per step (adaptive C): Φ̂ is the bias-corrected EMA of
    the Φ_t with the same β₂ as v, which is exactly E[noise part of v̂_t] for varying Φ_t and
    equals Φ when Φ is constant.

    Raises:
        ValueError: bad hyper-parameters; RuntimeError: bias correction without a noise variance.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = False, bc_floor: float = 1e-8):
        if lr <= 0 or eps < 0 or weight_decay < 0 or bc_floor <= 0:
            raise ValueError("DPAdam: lr > 0, eps ≥ 0, weight_decay ≥ 0 and bc_floor > 0 are required")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"DPAdam: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.bias_correction = bias_correction
        self.bc_floor = float(bc_floor)
        self._noise_var = None
        #: Adam-AC's γ: the step uses lr·γ (the scheduler's lr stays the base lr_base(t)).
        self.lr_scale = 1.0
        self.state["_phi"] = {"step": 0, "ema": 0.0}

    def set_noise_variance(self, var: float) -> None:
        """Φ_t: per-coordinate variance of the noise in this step's averaged gradient."""
        if not (var >= 0 and math.isfinite(var)):
            raise ValueError(f"noise variance must be finite and ≥ 0, got {var}")
        self._noise_var = float(var)

    @torch.no_grad()
    def step(self, closure=None):
        if self.bias_correction and self._noise_var is None:
            raise RuntimeError("DP-AdamBC needs set_noise_variance(Φ) before each step (the loop's transform does it)")
        phi = self.state["_phi"]
        phi["step"] += 1
        b2 = self.param_groups[0]["betas"][1]
        if self.bias_correction:
            phi["ema"] = b2 * phi["ema"] + (1 - b2) * self._noise_var
        t = phi["step"]
        phi_hat = phi["ema"] / (1 - b2 ** t) if self.bias_correction else 0.0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"] * self.lr_scale, group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                m, v = st["m"], st["v"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** t)
                v_hat = v / (1 - beta2 ** t)
                if self.bias_correction:
                    denom = (v_hat - phi_hat).clamp_min(self.bc_floor).sqrt()
                else:
                    denom = v_hat.sqrt().add_(eps)
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(m_hat, denom, value=-lr)
        self._noise_var = None
        return None


class GammaNudger:
    """DP-Adam-AC's learning-rate multiplier γ (Yang, Alg. 1 lines 23–27).

    γ ← min(γ_max, γ·up) if ρ̃ < ρ_low; max(γ_min, γ·down) if ρ̃ > ρ_high; else unchanged,
    where ρ̃ is the clip rate. In dpft ρ̃ must be the *privatised* clip rate (from the noisy
    count of step/clip.py); the raw rate leaks and is used only under the paper's
    reproduction flag.
    """

    def __init__(self, rho_low: float = 0.1, rho_high: float = 0.3, up: float = 1.01, down: float = 0.995,
                 gamma_min: float = 0.1, gamma_max: float = 2.0):
        if not rho_low <= rho_high:
            raise ValueError(f"γ nudging needs rho_low ≤ rho_high, got {rho_low} > {rho_high}")
        if not 0 < gamma_min <= 1 <= gamma_max:
            raise ValueError(f"γ bounds must satisfy 0 < gamma_min ≤ 1 ≤ gamma_max, got [{gamma_min}, {gamma_max}]")
        self.rho_low, self.rho_high, self.up, self.down = rho_low, rho_high, up, down
        self.gamma_min, self.gamma_max = gamma_min, gamma_max
        self.gamma = 1.0

    def update(self, clip_rate: float) -> float:
        """Nudge γ from this step's clip rate; returns the new γ."""
        if clip_rate < self.rho_low:
            self.gamma = min(self.gamma_max, self.gamma * self.up)
        elif clip_rate > self.rho_high:
            self.gamma = max(self.gamma_min, self.gamma * self.down)
        return self.gamma


class WeightEMA:
    """EMA of the trainable weights, θ̂ ← d θ̂ + (1 − d) θ (Yang, Alg. 1 line 18), d ∈ (0, 1).

    ``swap()`` is a context manager that puts θ̂ into the model (evaluation, saving) and
    restores θ afterwards.
    """

    def __init__(self, params: dict[str, torch.Tensor], decay: float = 0.999):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay d must be in (0, 1), got {decay}")
        self.decay = float(decay)
        self.params = params
        self.shadow = {n: p.detach().clone() for n, p in params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params.items():
            self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def swap(self):
        """Context manager: θ̂ in the model for the block, θ restored after."""
        return swap_values(self.params, self.shadow)


@contextmanager
def swap_values(params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]):
    """``values`` (name → tensor shaped as ``params[name]``) copied into ``params`` for the block; the old
    values restored after (the EMA's ``swap``; after FSDP2, the gathered EMA into rank 0's plain copy)."""
    saved = {n: params[n].detach().clone() for n in values}
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, v in saved.items():
                params[n].copy_(v)
