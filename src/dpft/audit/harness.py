"""The audited step: the library's own parts (clip policy, engine, Gaussian mechanism, Poisson
sampler, :class:`~dpft.step.DPStep`) assembled the way ``run/loop.py`` assembles them, with an
SGD optimizer of learning rate 1 so that the released noisy sum can be read back from the
parameter update (``noisy = −Δθ · qN``) and the parameters restored.

The canary model (:class:`SlotModel`) has K+1 *slots*: G linear groups of shape (K+1, d). An
example ``(x, slot)`` has loss ``−⟨x, W[slot]⟩``, so its gradient lives in row ``slot`` of each
group only: canaries in different slots have disjoint supports and, with isotropic noise, each
slot is an independent instance of the mechanism for its canary (the vectorisation of the
"gradient canary" of Nasr et al. 2021, Sec. 4; Steinke et al. 2023, Sec. 5 use the same
"Dirac canaries"). Slot K holds the non-canary (filler) examples.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from dpft.accounting.ledger import PrivacyLedger
from dpft.privacy.randomness import Randomness
from dpft.step import DPStep, StepSpec
from dpft.step.clip import AdaptiveQuantileClip, ClipPolicy, make_clip_policy
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler
from dpft.grads.bookkeeping import BookKeepingEngine
from dpft.grads.reference import ReferenceEngine


class SlotModel(nn.Module):
    """G groups ``nn.Linear(d, K+1, bias=False)``; ``forward(x: (B, G, d)) -> (B, K+1)``."""

    def __init__(self, slots: int, groups: int = 4, dim: int = 2):
        super().__init__()
        self.slots, self.groups_n, self.dim = slots, groups, dim
        self.groups = nn.ModuleList(nn.Linear(dim, slots + 1, bias=False) for _ in range(groups))
        for lin in self.groups:
            nn.init.zeros_(lin.weight)

    def forward(self, x=None, **_):
        return sum(lin(x[:, g]) for g, lin in enumerate(self.groups))


def slot_loss(forward: Callable[..., object], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-example loss ``−⟨x_i, W[slot_i]⟩`` (gradient ``−x_i`` in row ``slot_i``)."""
    out = forward(x=batch["x"])
    return -out.gather(1, batch["slot"][:, None]).squeeze(1)


def make_clip(style: str, c: float, head_fraction: float = 0.5, gamma: float = 0.01) -> ClipPolicy:
    """A clip policy by recipe style; ``adaptive`` = :class:`AdaptiveQuantileClip` at C₀ = C."""
    if style == "adaptive":
        return AdaptiveQuantileClip(c, count_noise=10.0)
    return make_clip_policy(style, c, gamma=gamma, head_fraction=head_fraction)


def make_audit_engine(kind: str, model: nn.Module, loss_fn, clip: ClipPolicy):
    """``bookkeeping[:auto|ghost|instantiate]`` or ``reference`` (the trainer's engines)."""
    if kind.startswith("bookkeeping"):
        mode = kind.split(":", 1)[1] if ":" in kind else "auto"
        return BookKeepingEngine(model, loss_fn, clip, norm_mode=mode)
    if kind == "reference":
        return ReferenceEngine(model, loss_fn, clip)
    raise ValueError(f"unknown engine {kind!r}; use bookkeeping[:auto|ghost|instantiate] or reference")


def build_step(model: nn.Module, loss_fn, clip: ClipPolicy, engine: str, sigma: float, n: int,
               expected_batch: int, rng: Randomness, hardened: bool = True,
               head_mask: Optional[list[bool]] = None) -> DPStep:
    """A :class:`DPStep` over the library's parts (SGD, lr 1, no momentum: the update is the
    released gradient)."""
    eng = make_audit_engine(engine, model, loss_fn, clip)
    if hasattr(clip, "set_head_mask"):
        if head_mask is None:
            from dpft.models.load import is_head_param

            head_mask = [is_head_param(nm) for nm in eng.params]
        clip.set_head_mask(head_mask)
    mech = GaussianMechanism(sigma, clip.sensitivity, rng, hardened=hardened)
    sampler = PoissonSampler(n, expected_batch, rng)
    opt = torch.optim.SGD(list(eng.params.values()), lr=1.0)
    return DPStep(StepSpec(engine=eng, clip=clip, mechanism=mech, sampler=sampler, optimizer=opt),
                  PrivacyLedger(), n)


def released_sum(step: DPStep, t: int, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Run logical step ``t`` through ``step.run`` and return the released (noisy) clipped sum,
    read from the parameter update; the parameters are restored afterwards."""
    params = step.params
    before = {k: p.detach().clone() for k, p in params.items()}
    step.run(t, micro_batches)
    denom = step.q_at(t) * step.n
    out = {k: (before[k] - p.detach()).double() * denom for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(before[k])
    return out


def canary_inputs(slots: int, groups: int, dim: int, c: float, style: str, head_fraction: float,
                  gen: torch.Generator, scale: float = 10.0) -> torch.Tensor:
    """Canary inputs ``(K, G, d)`` of norm ``scale·C`` (so they are clipped), shaped so that the
    clipped contribution is exactly ``C·u_k`` for each style: equal group norms, except
    ``head_body`` (group 0 = head, norms ∝ √f : √(1−f))."""
    x = torch.randn(slots, groups, dim, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=2, keepdim=True)
    if style == "head_body":
        w = torch.full((groups,), math.sqrt((1 - head_fraction) / max(groups - 1, 1)), dtype=torch.float64)
        w[0] = math.sqrt(head_fraction)
    else:
        w = torch.full((groups,), 1 / math.sqrt(groups), dtype=torch.float64)
    return (x * w[None, :, None] * scale * c).float()
