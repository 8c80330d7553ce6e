"""Label privacy by K-ary randomized response, and the forward loss correction for it.

Source: DP-Forward (Du et al., CCS 2023), label privacy ε₂ by randomized response (RR);
the loss correction is Patrini et al., "Making deep neural networks robust to label noise:
a loss correction approach" (CVPR 2017), forward correction (their Theorem 2).

K-ary randomized response with parameter ε₂: keep the true label y with probability
``e^ε₂ / (e^ε₂ + K − 1)``, otherwise output one of the other K − 1 labels uniformly at random.
For any two labels y, y′ and any output ỹ, P(ỹ | y) / P(ỹ | y′) ≤ e^ε₂: one noisy label is
ε₂-DP (pure, δ = 0) under replace-one (the example's label changed to any other).

The noisy labels are drawn ONCE per training example, before training
(:func:`randomized_response`), and every epoch reuses the same ỹ: anything computed from
them afterwards (all the steps, all the epochs, the trained model) is post-processing of one
RR release per example, so the label guarantee stays ε₂ for any number of epochs. Drawing a
fresh ỹ at every use would instead compose (and average out the noise).

ε's come from dp_accounting (``RandomizedResponseDpEvent``, which its PLD accountant supports
only under replace-one); they are *not* recorded in a run's add/remove ledger.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import dp_accounting as dpa
import torch
import torch.nn.functional as F
from dp_accounting.pld import pld_privacy_accountant

from dpft.privacy.ldp import LDPError, local_epsilon_composed
from dpft.privacy.randomness import Randomness


def _check(eps: float, num_labels: int) -> None:
    if not eps > 0:
        raise LDPError(f"ldp.label_epsilon (ε₂) must be > 0, got {eps}; leave it unset for labels in the clear")
    if int(num_labels) < 2:
        raise LDPError(f"randomized response needs ≥ 2 labels, got num_labels = {num_labels}")


def rr_keep_probability(eps: float, num_labels: int) -> float:
    """P(ỹ = y) = e^ε / (e^ε + K − 1), written as 1 / (1 + (K − 1)e^−ε) (no overflow at large ε)."""
    _check(eps, num_labels)
    return 1.0 / (1.0 + (num_labels - 1) * math.exp(-eps))


def rr_noise_parameter(eps: float, num_labels: int) -> float:
    """dp_accounting's RR noise parameter p (with probability p output a uniform bucket out of
    all K): 1 − p + p/K = keep probability ⇔ p = K / (e^ε + K − 1)."""
    _check(eps, num_labels)
    return num_labels * math.exp(-eps) / (1.0 + (num_labels - 1) * math.exp(-eps))


def rr_transition_matrix(eps: float, num_labels: int) -> torch.Tensor:
    """``(K, K)`` float64 matrix T with T[i, j] = P(ỹ = j | y = i): keep probability on the
    diagonal, (1 − keep)/(K − 1) elsewhere. Rows sum to 1. Public (depends on ε₂ and K only)."""
    keep = rr_keep_probability(eps, num_labels)
    k = int(num_labels)
    t = torch.full((k, k), (1.0 - keep) / (k - 1), dtype=torch.float64)
    t.fill_diagonal_(keep)
    return t


def randomized_response(labels: torch.Tensor, eps: float, num_labels: int,
                        generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """K-ary randomized response, one independent draw per entry.

    Args:
        labels: ``(N,)`` int64 in ``[0, K)``.
        eps: ε₂ > 0.
        num_labels: K ≥ 2.
        generator: the :class:`~dpft.privacy.randomness.SecretStream` of the draws (the run's
            ``rng.stream("label_rr")``; its secret is the data holder's: whoever has it can
            recompute which labels were kept); None = a fresh secret source's stream.

    Returns:
        ``(N,)`` int64 noisy labels ỹ: y with probability e^ε/(e^ε + K − 1), else uniform over
        the K − 1 others.

    Keep is decided on 53-bit integers with probability ⌊p·2⁵³⌋/2⁵³ ≤ p (never above the
    calibrated p: a higher keep probability would exceed ε₂).

    Raises:
        LDPError: ε₂ ≤ 0, K < 2, or a label outside ``[0, K)``.
        TypeError: ``generator`` is a plain ``torch.Generator`` (32-bit CPU seed).
    """
    y = torch.as_tensor(labels, dtype=torch.long)
    k = int(num_labels)
    _check(eps, k)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= k):
        bad = int(((y < 0) | (y >= k)).sum())  # counted, not quoted: the labels are private
        raise LDPError(f"labels must lie in [0, {k}); {bad} of {y.numel()} are outside it")
    if isinstance(generator, torch.Generator):
        raise TypeError("randomized_response needs a dpft SecretStream, not a torch.Generator (a CPU generator "
                        "keeps 32 bits of its seed): pass dpft.privacy.randomness.Randomness().stream('label_rr')")
    if generator is None:
        generator = Randomness().stream("label_rr")
    keep = generator.bernoulli(tuple(y.shape), rr_keep_probability(eps, k))
    # "one of the other K − 1, uniformly": shift by 1 + U{0, …, K − 2} modulo K
    shift = 1 + generator.randint(k - 1, tuple(y.shape))
    return torch.where(keep, y, (y + shift) % k)


def forward_corrected_loss(logits: torch.Tensor, noisy_labels: torch.Tensor, transition: torch.Tensor) -> torch.Tensor:
    """Forward-corrected cross-entropy (Patrini et al. 2017, Eq. "forward"):
    ``−log (softmax(logits) · T)[ỹ]``, one value per example.

    The model's softmax estimates the clean posterior p(y | x); multiplying by the known
    transition T gives the noisy-label posterior p(ỹ | x), which the noisy labels fit. The
    minimiser over p(y | x) is the clean posterior (T invertible: ε₂ > 0), so the corrected
    loss is consistent where plain cross-entropy on ỹ learns the flattened noisy posterior.

    Args:
        logits: ``(B, K)``.
        noisy_labels: ``(B,)`` int64 RR outputs ỹ.
        transition: ``(K, K)`` T from :func:`rr_transition_matrix`.

    Returns:
        ``(B,)`` nats (float32 unless the logits are float64).
    """
    if logits.shape[-1] != transition.shape[0]:
        raise LDPError(f"logits have {logits.shape[-1]} classes but the RR transition matrix has "
                       f"{transition.shape[0]}")
    logp = F.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    log_t = transition.to(logp.dtype).log().to(logp.device)
    # log Σ_i p(y=i|x) T[i, j], in log space for stability: (B, K, 1) + (1, K, K) → (B, K)
    log_noisy = torch.logsumexp(logp.unsqueeze(-1) + log_t.unsqueeze(0), dim=1)
    return -log_noisy.gather(1, noisy_labels.long().view(-1, 1)).squeeze(1)


def _replace_one_pld() -> pld_privacy_accountant.PLDAccountant:
    return pld_privacy_accountant.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE,
                                                value_discretization_interval=1e-4)


def rr_event(eps: float, num_labels: int) -> dpa.DpEvent:
    """The dp_accounting event of one K-ary RR release at ε₂ (replace-one only)."""
    return dpa.RandomizedResponseDpEvent(rr_noise_parameter(eps, num_labels), int(num_labels))


def label_epsilon(eps: float, num_labels: int) -> float:
    """ε (at δ = 0) of the label release of one example, through dp_accounting's PLD
    (replace-one). Equals ε₂ up to the PLD's pessimistic discretisation (≤ ~1e-3 above)."""
    acc = _replace_one_pld()
    acc.compose(rr_event(eps, num_labels))
    return float(acc.get_epsilon(0.0))


def example_epsilon_with_label(sigmas: Sequence[float], delta: float, eps_label: Optional[float],
                               num_labels: int) -> float:
    """ε of everything one example releases: its noisy matrices at σ's ``sigmas`` (one
    ``GaussianDpEvent(2σ)`` each, the convention of ``privacy.ldp.local_epsilon_composed``) and
    its one RR label (none when ``eps_label`` is None), composed by dp_accounting's PLD under
    replace-one. No subsampling amplification: this is what an observer who knows which rows
    are this example's learns."""
    sig = [float(s) for s in sigmas if s is not None]
    if sig and min(sig) <= 0:
        return math.inf
    if eps_label is None:
        return local_epsilon_composed(sig, delta)
    # The Gaussian releases compose exactly into one Gaussian, σ = (Σ σ_j⁻²)^(-1/2) (GDP): one PLD.
    events: list[dpa.DpEvent] = [dpa.GaussianDpEvent(2.0 * sum(s ** -2 for s in sig) ** -0.5)] if sig else []
    if eps_label is not None:
        events.append(rr_event(eps_label, num_labels))
    if not events:
        return 0.0
    acc = _replace_one_pld()
    acc.compose(dpa.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))
