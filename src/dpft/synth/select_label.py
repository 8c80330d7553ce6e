"""DP select-and-label (DP-SelFT, Sha et al., Section 4.2, Eq. 5–10; Algorithm 1 line 3).

Given a public candidate pool ``C = {x̃_j}`` (no privacy cost: generated from task-level
prompts only) and the private set ``D = {(x_i, y_i)}``:

1. embed both with a public encoder φ (default the embedded MiniLM, mean-pooled, L2-normalised);
2. each private example votes for its nearest candidate ``j*(i)`` (Eq. 5, cosine distance);
3. release the vote histogram ``h_j`` (Eq. 6) with Gaussian noise ``N(0, σ_sel²)`` (Eq. 7) and
   keep the candidates with the largest noisy counts;
4. release the per-class vote counts ``h_{j,c}`` (Eq. 8) with ``N(0, σ_lab²)`` (Eq. 9) and label
   each kept candidate by the noisy majority (Eq. 10).

Sensitivity (add/remove-one neighbouring datasets, dpft's relation throughout): adding or
removing one private example changes exactly one bin of ``h`` by 1 and exactly one cell of
``h_{·,·}`` by 1, so both histograms have L2 sensitivity 1 (replace-one would make it √2).
``j*(i)`` depends only on ``x_i`` and the public pool, never on other private examples.
Each release is a Gaussian mechanism with noise multiplier σ (std σ·1) and is recorded as one
``GaussianDpEvent(σ)`` in the ledger (phases ``synthetic_select`` and ``synthetic_label``);
both σ's are calibrated together (PLD) so that their composition meets ``ε_syn`` at ``δ``.
Releasing ``h_{j,c}`` for all j and keeping only the selected rows is post-processing.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import dp_accounting as dpa
import torch

from dpft.accounting.ledger import PrivacyLedger, epsilon_of
from dpft.privacy.randomness import Randomness

#: Ledger phase names of the two releases.
PHASE_SELECT = "synthetic_select"
PHASE_LABEL = "synthetic_label"


class SelectLabelError(ValueError):
    """Bad input to select-and-label (empty pool, k too large, infeasible ε_syn…)."""


# ---------------------------------------------------------------------------- embeddings
@torch.no_grad()
def embed_texts(texts: Sequence[str], encoder: str = "minilm", batch_size: int = 64,
                max_length: int = 64, model=None, tokenizer=None, device=None) -> torch.Tensor:
    """φ(x): mean-pooled last hidden states over non-padding tokens, L2-normalised.

    Args:
        texts: n strings.
        encoder: model name for :func:`dpft.models.load.resolve_model_path` (``minilm`` =
            embedded all-MiniLM-L6-v2, a public encoder: no privacy cost).
        model, tokenizer: an already loaded encoder (tests pass a tiny random one).
        device: where the encoder runs (None: where ``model`` is; the CPU for one loaded here).

    Returns:
        ``(n, d)`` float32 tensor with unit-norm rows, on the CPU (the vote histograms are small).

    Raises:
        SelectLabelError: no texts, or a non-string entry.
    """
    if len(texts) == 0:
        raise SelectLabelError("no texts to embed")
    if any(not isinstance(t, str) for t in texts):
        raise SelectLabelError("every text to embed must be a string; drop empty rows")
    key = None
    if model is None or tokenizer is None:
        # Same public texts, same encoder → same φ: memoised per process (a method sweep reuses it).
        key = (encoder, batch_size, max_length, hashlib.sha256("\x00".join(texts).encode()).hexdigest())
        if key in _EMB_CACHE:
            return _EMB_CACHE[key].clone()
        from transformers import AutoModel, AutoTokenizer

        from dpft.models.load import resolve_model_path

        path = resolve_model_path(encoder)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path)
    if device is not None:
        model.to(device)
    dev = next(model.parameters()).device
    model.eval()
    out = []
    # Length-sorted batches waste little padding; the order is restored at the end.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        enc = {k: v.to(dev) for k, v in enc.items()}
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # (b, T, d)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
    emb = torch.cat(out)
    res = torch.empty_like(emb)
    res[torch.tensor(order)] = emb
    if key is not None:
        _EMB_CACHE[key] = res.clone()
    return res


_EMB_CACHE: dict[tuple, torch.Tensor] = {}


def nearest_candidate(private_emb: torch.Tensor, cand_emb: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Eq. 5: ``j*(i) = argmin_j d(φ(x_i), φ(x̃_j))`` with cosine distance (rows unit-norm).

    Args:
        private_emb: ``(n, d)``; cand_emb: ``(m, d)``.

    Returns:
        ``(n,)`` long tensor of candidate indices in ``[0, m)``.
    """
    if private_emb.shape[1] != cand_emb.shape[1]:
        raise SelectLabelError(f"embedding widths differ: {private_emb.shape[1]} vs {cand_emb.shape[1]}")
    p = torch.nn.functional.normalize(private_emb.float(), dim=-1)
    c = torch.nn.functional.normalize(cand_emb.float(), dim=-1)
    return torch.cat([(p[k:k + chunk] @ c.T).argmax(1) for k in range(0, len(p), chunk)])


def vote_histogram(nn_idx: torch.Tensor, m: int) -> torch.Tensor:
    """Eq. 6: ``h_j = Σ_i 1{j*(i) = j}``, shape ``(m,)`` float. One example → one bin (+1):
    L2 sensitivity 1 under add/remove-one."""
    return torch.bincount(nn_idx, minlength=m).to(torch.float64)


def class_vote_histogram(nn_idx: torch.Tensor, labels: torch.Tensor, m: int, num_labels: int) -> torch.Tensor:
    """Eq. 8: ``h_{j,c} = Σ_i 1{j*(i) = j, y_i = c}``, shape ``(m, K)`` float. One example →
    one cell (+1): L2 sensitivity 1 under add/remove-one."""
    labels = labels.long()
    if len(labels) != len(nn_idx):
        raise SelectLabelError(f"{len(labels)} labels for {len(nn_idx)} votes")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_labels):
        raise SelectLabelError(f"labels must be in [0, {num_labels})")
    flat = torch.bincount(nn_idx * num_labels + labels, minlength=m * num_labels)
    return flat.view(m, num_labels).to(torch.float64)


# ---------------------------------------------------------------------------- accounting
def select_label_events(sigma_select: float, sigma_label: float) -> list[dpa.DpEvent]:
    """The two releases as dp_accounting events (sensitivity 1 → noise multiplier = std)."""
    return [dpa.GaussianDpEvent(sigma_select), dpa.GaussianDpEvent(sigma_label)]


def calibrate_select_label(epsilon_syn: float, delta: float, label_ratio: float = 1.0) -> tuple[float, float]:
    """σ_sel and σ_lab = ``label_ratio``·σ_sel, smallest such that the composition of the two
    Gaussian releases has ε(δ) ≤ ``epsilon_syn`` (PLD, dp-accounting).

    Raises:
        SelectLabelError: ε_syn ≤ 0, δ not in (0,1), ratio ≤ 0.
    """
    if not epsilon_syn > 0:
        raise SelectLabelError(f"ε_syn must be > 0, got {epsilon_syn}")
    if not 0 < delta < 1:
        raise SelectLabelError(f"δ must be in (0, 1), got {delta}")
    if not label_ratio > 0:
        raise SelectLabelError(f"label_ratio must be > 0, got {label_ratio}")

    # The two releases compose to one Gaussian mechanism of σ_eff = (σ_sel⁻² + σ_lab⁻²)^(-1/2)
    # (their privacy losses are independent Gaussians). σ_eff is found on dp-accounting's exact
    # Gaussian privacy loss (bisection on δ(ε)), then split by the ratio; the PLD accountant
    # that reports ε checks the pair and σ only ever moves up.
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    def delta_at(sig: float) -> float:
        return GaussianPrivacyLoss(sig, sensitivity=1.0).get_delta_for_epsilon(epsilon_syn)

    lo, hi = 1e-3, 1e4
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if delta_at(mid) <= delta else (mid, hi)
    sigma = hi * math.sqrt(1.0 + label_ratio ** -2)
    for _ in range(500):
        if epsilon_of(select_label_events(sigma, label_ratio * sigma), delta).epsilon <= epsilon_syn:
            return sigma, label_ratio * sigma
        sigma *= 1.001
    raise SelectLabelError("σ calibration for select-and-label did not converge")  # pragma: no cover


# ---------------------------------------------------------------------------- the mechanism
@dataclass
class SyntheticData:
    """Output of :func:`dp_select_and_label`: public (post-DP) synthetic data.

    ``train``/``val`` are lists of ``(text, label)``; ``selected`` are candidate indices;
    ``noisy_votes``: the released histogram ``(m,)``.
    """

    train: list[tuple[str, int]]
    val: list[tuple[str, int]]
    selected: list[int]
    noisy_votes: list[float]
    sigma_select: float
    sigma_label: float
    events: list = field(default_factory=list)

    def digest(self) -> str:
        """sha256 of the synthetic train/val data (cache key for layer scores)."""
        return hashlib.sha256(json.dumps([self.train, self.val]).encode()).hexdigest()[:16]


def _stream(rng):
    """The histograms' noise: the run's secret randomness, stream ``synth`` (a fresh secret
    source when the caller passes none); two draws, one per histogram."""
    return (rng if rng is not None else Randomness()).stream("synth")


def dp_select_and_label(
    private_texts: Sequence[str],
    private_labels: Sequence[int],
    candidates: Sequence[str],
    num_labels: int,
    epsilon_syn: float,
    delta: float,
    n_select: int,
    ledger: Optional[PrivacyLedger] = None,
    label_ratio: float = 1.0,
    val_fraction: float = 0.3,
    seed: int = 0,
    rng=None,
    private_emb: Optional[torch.Tensor] = None,
    cand_emb: Optional[torch.Tensor] = None,
    encoder: str = "minilm",
    device=None,
) -> SyntheticData:
    """Algorithm 1 lines 3–4: DP select-and-label, then a seeded 7:3 train/validation split.

    Args:
        private_texts, private_labels: the private set (n examples, labels in ``[0, K)``).
        candidates: the public pool (m texts).
        epsilon_syn, delta: budget of the two releases together (PLD composition).
        n_select: candidates kept (top noisy vote counts), 1 ≤ n_select ≤ m.
        ledger: the two events are recorded here (phases ``synthetic_select``,
            ``synthetic_label``) — pass the run's ledger so fine-tuning composes after them.
        label_ratio: σ_lab / σ_sel.
        val_fraction: share of the kept candidates in the validation split (paper: 0.3).
        seed: public seed of the train/validation split (post-processing).
        rng: the run's secret randomness (privacy/randomness.py) for the two noisy histograms;
            None = a fresh secret source.
        private_emb, cand_emb: precomputed φ embeddings (else computed with ``encoder``).
        device: where the encoder runs (the run's ``perf.device``; None = the CPU).

    Raises:
        SelectLabelError: empty pool or private set, n_select out of range, bad labels.
    """
    m, n = len(candidates), len(private_texts)
    if m == 0:
        raise SelectLabelError("the candidate pool is empty; generate or load candidates first")
    if n == 0:
        raise SelectLabelError("the private set is empty")
    if not 1 <= n_select <= m:
        raise SelectLabelError(f"n_select = {n_select} must be in [1, m = {m}]; lower it or enlarge the pool")
    if not 0 < val_fraction < 1:
        raise SelectLabelError(f"val_fraction must be in (0, 1), got {val_fraction}")
    sigma_sel, sigma_lab = calibrate_select_label(epsilon_syn, delta, label_ratio)
    if private_emb is None:
        private_emb = embed_texts(private_texts, encoder, device=device)
    if cand_emb is None:
        cand_emb = embed_texts(candidates, encoder, device=device)
    nn_idx = nearest_candidate(private_emb, cand_emb)
    labels = torch.as_tensor(list(private_labels), dtype=torch.long)

    g = _stream(rng)
    # Release 1 (Eq. 7): sensitivity 1 (add/remove one example moves one vote) → std σ_sel·1.
    noisy = vote_histogram(nn_idx, m) + sigma_sel * g.normal((m,), dtype=torch.float64)
    # Release 2 (Eq. 9): sensitivity 1 (one example is one cell) → std σ_lab·1. Drawn for all
    # m rows so the release does not depend on which rows were selected.
    noisy_cls = class_vote_histogram(nn_idx, labels, m, num_labels) + \
        sigma_lab * g.normal((m, num_labels), dtype=torch.float64)
    events = select_label_events(sigma_sel, sigma_lab)
    if ledger is not None:
        ledger.record(PHASE_SELECT, events[0])
        ledger.record(PHASE_LABEL, events[1])

    # Post-processing of the releases from here on (free).
    selected = torch.argsort(noisy, descending=True, stable=True)[:n_select]
    syn_labels = noisy_cls[selected].argmax(1)  # Eq. 10
    rows = [(candidates[int(j)], int(y)) for j, y in zip(selected, syn_labels)]
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    n_val = max(1, round(val_fraction * len(rows))) if len(rows) > 1 else 0
    val = [rows[i] for i in perm[:n_val]]
    train = [rows[i] for i in perm[n_val:]]
    return SyntheticData(train, val, [int(j) for j in selected], noisy.tolist(), sigma_sel, sigma_lab, events)
