"""Audit checks of ``ldp.train_pre`` (EW-FT / DP-Forward with pre(·) trained by DP-SGD, issue 29).

On a tiny random BERT cut after block 1 (methods/ewft/train_pre.py), with the representation
noise fixed so that the step is deterministic:

* **per-example clipping of pre(·)** — the engine's clipped sum over pre(·)'s parameters equals
  the reference: for every example alone, the gradient of ℓ_i(post(clip_C(pre(x_i)) + n_i)) in
  θ_pre (through the noise layer), clipped to C_g, summed; each clipped term ≤ C_g; post(·)'s
  sum is the plain (unclipped) one;
* **gradient noise** — the mechanism adds N(0, (σ_grad·C_g)²) to pre(·)'s entries (empirical std
  within 5 %) and nothing to post(·)'s (their noise is the released codes' own);
* **one event per step, sampled once** — the mechanism's event is PoissonSampled(q, Gaussian(σ_eff)),
  and dp_accounting's RDP of PoissonSampled(q, Composed([Gaussian(σ_rep), Gaussian(σ_grad)])) equals
  that of PoissonSampled(q, Gaussian(σ_eff)).

``planted``: ``"train_pre_without_noise"`` (pre(·) updated from the un-noised clipped sum: the
DP-Forward code's training of the layers before the noise without DP), ``"train_pre_sampled_twice"``
(the two releases recorded as two separately sampled events: amplification applied twice).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import dp_accounting as dpa
import torch

from dpft.audit.whitebox import Check, tiny_classifier
from dpft.audit.planted import planting
from dpft.methods.ewft import train_pre as tp
from dpft.methods.ewft.train_pre import (
    TrainPreEngine, TrainPreMechanism, combined_event, effective_sigma, pre_parameters
)
from dpft.models.losses import classification_loss
from dpft.privacy.ldp import GaussianLDP, SplitClassifier, StackedAutoencoder, clip_frobenius
from dpft.privacy.randomness import Randomness
from dpft.step.clip import make_clip_policy

PLANTED = ("train_pre_without_noise", "train_pre_sampled_twice")
TOL = 1e-4


@contextlib.contextmanager
def planted_bug(name: Optional[str]) -> Iterator[None]:
    """Plant one bug for the duration (None: nothing). Raises ValueError for an unknown name."""
    with planting(name, PLANTED) as p:
        cls = tp.TrainPreMechanism
        if name == "train_pre_without_noise":
            p.set(cls, "release", lambda self, s, sens, q, step: (dict(s), self.event(q)))
        elif name == "train_pre_sampled_twice":
            p.set(cls, "event", lambda self, q: dpa.ComposedDpEvent([
                dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(self.sigma_rep)),
                dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(self.sigma_grad))]))
        yield


def tiny_split(position: str = "encoder:1", max_norm: float = 0.5, autoencoder: bool = True, t: int = 8):
    """A tiny random BERT (hidden 16, 2 blocks) cut at ``position`` with pre(·)'s blocks and the
    encoder trainable (as ``ldp.train_pre`` leaves them); eval mode for post(·) (no dropout)."""
    m = tiny_classifier("bert")
    torch.manual_seed(1)
    ae = StackedAutoencoder([16, 4]) if autoencoder else None
    split = SplitClassifier(m, position, GaussianLDP(max_norm, 0.0, ae), max_length=t, pass_mask=True,
                            release_cls=position == "output")
    for p in pre_parameters(split, 0, False):
        p.requires_grad_(True)
    return split.eval()


def reference_step(split, batch, noise: torch.Tensor, c_g: float, loss_fn) -> tuple[dict, dict, list[float]]:
    """Per example alone: (Σ_i clip_{C_g}(∇_pre ℓ_i), Σ_i ∇_post ℓ_i, [‖∇_pre ℓ_i‖]) with the
    representation noise ``noise[i]`` (autograd through the noise layer, one example at a time)."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    names = {id(p): n for n, p in split.named_parameters() if p.requires_grad}
    pre_ids = {id(p) for p in pre_parameters(split, 0, False)}
    pre = {names[i]: torch.zeros_like(p) for p in split.parameters() if (i := id(p)) in pre_ids}
    post = {n: torch.zeros_like(p) for n, p in split.named_parameters() if p.requires_grad and n not in pre}
    norms = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        split.zero_grad(set_to_none=True)
        ids, am, tt = split._pad(one["input_ids"], one["attention_mask"], None)
        with torch.enable_grad():  # _pre runs pre(·) in eval mode and keeps the graph to θ_pre
            h = split._pre(ids, am, tt)
        ae = split.noise.autoencoder
        z = clip_frobenius(ae.encode(h) if ae is not None else h, split.noise.max_norm) + noise[i:i + 1]
        mask = split.padded_mask(one["input_ids"], one["attention_mask"])
        loss = loss_fn(lambda z=z, mask=mask, **_: SequenceClassifierOutput(logits=split.post(z, mask)), one).sum()
        loss.backward()
        g = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in split.named_parameters() if p.requires_grad}
        nrm = math.sqrt(sum(float(g[n].pow(2).sum()) for n in pre))
        norms.append(nrm)
        f = min(1.0, c_g / (nrm + 1e-6))
        for n in pre:
            pre[n] += f * g[n]
        for n in post:
            post[n] += g[n]
    split.zero_grad(set_to_none=True)
    return pre, post, norms


def _batch(b: int = 5, t: int = 8):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 5:] = 0
    ids[0, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (b,), generator=g)}


def check_clipping() -> Check:
    """The engine's pre(·) sum = the per-example reference, clipped to C_g; post(·) plain.
    C_g is the median per-example norm, so some examples are clipped and some are not."""
    split = tiny_split()
    batch = _batch()
    b = batch["input_ids"].shape[0]
    noise = torch.randn(b, 8, 4, generator=torch.Generator().manual_seed(5)) * 0.3
    split.noise.noise_like = lambda z: noise.to(z.dtype)  # the step's draw, fixed for the comparison
    try:
        c_g = sorted(reference_step(split, batch, noise, math.inf, classification_loss)[2])[b // 2]
        eng = TrainPreEngine(split, classification_loss, make_clip_policy("flat", c_g), first_block=0,
                             engine="bookkeeping")
        res = eng.clipped_sum(batch)
        pre_ref, post_ref, norms = reference_step(split, batch, noise, c_g, classification_loss)
    finally:
        del split.noise.noise_like
    err_pre = max(float((res.grad_sum[n] - pre_ref[n]).abs().max()) for n in pre_ref)
    scale_pre = max(float(pre_ref[n].abs().max()) for n in pre_ref)
    err_post = max(float((res.grad_sum[n] - post_ref[n]).abs().max()) for n in post_ref)
    scale_post = max(float(post_ref[n].abs().max()) for n in post_ref)
    clipped = sum(nrm > c_g for nrm in norms)
    total = math.sqrt(sum(float(pre_ref[n].pow(2).sum()) for n in pre_ref))
    ok = err_pre <= TOL * max(scale_pre, 1e-6) + 1e-7 and err_post <= TOL * max(scale_post, 1e-6) + 1e-7 \
        and total <= b * c_g * (1 + TOL) and clipped >= 1
    return Check("ewft train_pre: per-example clipping of pre(·) through the noise layer", ok,
                 f"engine vs per-example reference: max |Δ| pre {err_pre:.2e} (scale {scale_pre:.2e}), post "
                 f"{err_post:.2e} (scale {scale_post:.2e}); {clipped}/{b} examples above C_g = {c_g:.3g}",
                 {"max_norm_before_clip": max(norms)})


def check_noise(sigma_rep: float = 0.7, sigma_grad: float = 1.3, c_g: float = 0.5) -> Check:
    """pre(·)'s entries get N(0, (σ_grad C_g)²); post(·)'s get none."""
    sums = {"pre.w": torch.zeros(20000), "post.w": torch.zeros(1000)}
    mech = TrainPreMechanism(sigma_rep, sigma_grad, c_g, Randomness(), ["pre.w"])
    noisy, _ = mech.release(sums, c_g, 0.1, step=0)
    std = float(noisy["pre.w"].std())
    want = sigma_grad * c_g
    post_max = float(noisy["post.w"].abs().max())
    ok = abs(std / want - 1) < 0.05 and post_max == 0.0
    return Check("ewft train_pre: Gaussian noise on pre(·)'s clipped sum", ok,
                 f"pre(·) noise std {std:.4g} (want σ_grad·C_g = {want:.4g}); post(·) max |noise| {post_max:g}")


def check_event(sigma_rep: float = 0.9, sigma_grad: float = 1.4, q: float = 0.02, steps: int = 300,
                delta: float = 1e-5) -> Check:
    """The step's recorded event is ``PoissonSampled(q, Gaussian(σ_eff))`` (sampled once), and
    dp_accounting's RDP of ``PoissonSampled(q, Composed([Gaussian(σ_rep), Gaussian(σ_grad)]))``
    over ``steps`` steps equals that of the recorded event (RDP: cheap; the ledger's PLD takes the
    same event)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    mech = TrainPreMechanism(sigma_rep, sigma_grad, 1.0, Randomness(), [])
    recorded = mech.event(q)
    want = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(effective_sigma(sigma_rep, sigma_grad)))

    def rdp_eps(ev):
        a = rdp.RdpAccountant()
        a.compose(dpa.SelfComposedDpEvent(ev, steps))
        return float(a.get_epsilon(delta))

    got, r_comb, r_eff = rdp_eps(recorded), rdp_eps(combined_event(q, sigma_rep, sigma_grad)), rdp_eps(want)
    ok = recorded == want and abs(r_comb - r_eff) <= 1e-9 * max(r_eff, 1)
    return Check("ewft train_pre: one sampled event per step for both releases", ok,
                 f"recorded {recorded!r}; RDP ε over {steps} steps: recorded {got:.4f}, two releases sampled "
                 f"once {r_comb:.4f}, σ_eff {r_eff:.4f}")


def ewft_checks(planted: Optional[str] = None) -> list[Check]:
    """The ``ldp.train_pre`` checks (``planted``: one of :data:`PLANTED`, the audit must FAIL)."""
    with planted_bug(planted):
        return [check_clipping(), check_noise(), check_event()]


__all__ = ["PLANTED", "ewft_checks", "tiny_split", "reference_step"]
