"""Perturbation-aware unit scoring of DP-SelFT (Sha et al., Section 4.3 Eq. 17–23; Algorithm 1
lines 6–14; Appendix B: each unit scored alone, top-k kept).

For each unit Λ, from θ⁽⁰⁾ with the shared head warmed up on the synthetic train split
(no ξ): one SGD step on Λ only, θ′_Λ = θ_Λ − η(g_Λ + ξ*) (Eq. 21), g_Λ the mean per-example
clipped gradient, ξ* the worst-case perturbation of the downstream noise scale on Λ only;
score = accuracy on the synthetic validation split (Eq. 22). ``ScoreSettings.update = "adamw"``
keeps the pre-issue-18 scorer (many AdamW steps on Λ and the fresh head, ξ on both). Runs on
public (DP synthetic) data only, so it costs no privacy budget.

Worst-case perturbation (Eq. 20, first order). The update is ``θ' = θ − η(g + ξ)`` and
``ξ* = argmax_{‖ξ‖≤ρ} L(θ − η(g + ξ))``. Expanding around ``θ̃ = θ − ηg``:
``L(θ̃ − ηξ) ≈ L(θ̃) − η ξ·∇L(θ̃)``, maximised by

    ξ* = −ρ_Λ · ∇_Λ L(θ̃) / ‖∇_Λ L(θ̃)‖₂.

(The sign is minus: ξ enters the update with −η. Written with a plus sign, ξ would be the
best-case, loss-*decreasing* direction; the test checks that ξ* increases the loss.)

Scale. Downstream DP fine-tuning adds ``N(0, σ²C² I)`` to the clipped sum and divides by the
expected batch ``B``, so on the ``d_Λ`` coordinates of Λ the noise of the averaged gradient has
expected norm ≈ ``ρ_Λ = σ C √d_Λ / B`` — the norm budget of ξ.

Shapes: ``g``, ``ξ`` are ``{name: tensor shaped like the parameter}`` over the trainable set.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from dpft.data.tokenize import collate
from dpft.models.load import head_param_groups, is_head_param
from dpft.models.losses import classification_loss, model_inputs
from dpft.models.units import resolve_units, unit_map
from dpft.step.clip import make_clip_policy
from dpft.accounting.io import atomic_write_text
from dpft.grads.base import NonPrivateEngine

Grads = dict[str, torch.Tensor]
PERTURBATIONS = ("worst", "random", "none")


def noise_scale(sigma: float, clip_norm: float, dim: int, expected_batch: int) -> float:
    """ρ_Λ = σ·C·√d_Λ / B: expected L2 norm of the downstream noise of the averaged gradient
    on ``dim`` coordinates (σ noise multiplier, C clipping norm, B expected batch size)."""
    if expected_batch < 1 or dim < 0 or sigma < 0 or clip_norm <= 0:
        raise ValueError("noise_scale needs σ ≥ 0, C > 0, d ≥ 0, B ≥ 1")
    return sigma * clip_norm * math.sqrt(dim) / expected_batch


def _device(model: nn.Module) -> torch.device:
    """Where ``model`` runs: every batch and draw of the scorer goes there."""
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _norm(t: Grads) -> torch.Tensor:
    return torch.sqrt(sum(v.double().pow(2).sum() for v in t.values()))


def mean_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean classification loss (nats) of a batch, scalar with graph."""
    return classification_loss(lambda **kw: model(**kw), batch).mean()


def worst_case_perturbation(model: nn.Module, params: Mapping[str, nn.Parameter],
                            batch: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
                            g: Grads, lr: float, rho: float) -> Grads:
    """ξ* = −ρ·∇L(θ − ηg)/‖∇L(θ − ηg)‖ restricted to ``params`` (Eq. 20, first order).

    The parameters are moved to θ − ηg for one forward/backward of the mean loss of ``batch``
    (one batch, or a list of batches: the example-weighted mean over all) and restored
    exactly. A zero gradient gives ξ = 0.

    Returns:
        ``{name: tensor}`` with ``‖ξ‖₂ = ρ`` (all of ``params`` together).
    """
    saved = {n: p.detach().clone() for n, p in params.items()}
    try:
        with torch.no_grad():
            for n, p in params.items():
                p.sub_(lr * g[n].to(p.dtype))
        batches = [batch] if isinstance(batch, Mapping) else list(batch)
        total = sum(len(b["labels"]) for b in batches)
        grads = None
        with torch.enable_grad():
            for b in batches:
                w = len(b["labels"]) / total
                part = torch.autograd.grad(w * mean_loss(model, b), list(params.values()), allow_unused=True)
                grads = part if grads is None else [
                    x if y is None else (y if x is None else x + y) for x, y in zip(grads, part)]
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
    v = {n: (gr if gr is not None else torch.zeros_like(p)).detach() for (n, p), gr in zip(params.items(), grads)}
    nv = float(_norm(v))
    if nv == 0.0:
        return {n: torch.zeros_like(x) for n, x in v.items()}
    return {n: (-rho / nv) * x for n, x in v.items()}


def random_perturbation(params: Mapping[str, nn.Parameter], std: float, gen: torch.Generator) -> Grads:
    """Gaussian ξ ~ N(0, std² I) (the "performance-based with random noise" baseline)."""
    # Public synthetic data only (no release): a seeded CPU draw, moved to each parameter's device.
    return {n: (std * torch.randn(p.shape, generator=gen, dtype=torch.float32)).to(p.device, p.dtype)
            for n, p in params.items()}


@dataclass
class ScoreSettings:
    """What a unit score depends on besides model and data (part of the cache key)."""

    perturbation: str = "worst"  # worst · random · none
    #: ``eq21`` (the paper, Eq. 21): the shared head is first warmed up on the synthetic train
    #: split without ξ (``head_warmup_steps``), then ONE SGD step θ′_Λ = θ_Λ − η(g_Λ + ξ*_Λ) on the
    #: unit Λ only, g_Λ the mean clipped gradient over the whole synthetic train split.
    #: ``adamw``: the pre-issue-18 scorer (``steps`` AdamW steps on Λ and the fresh head, ξ on
    #: both) — kept for comparison only: with ρ_Λ ≫ ‖g‖ Adam turns it into sign ascent.
    update: str = "eq21"
    head_warmup_steps: int = 50
    steps: int = 30
    batch_size: int = 32
    lr: float = 5e-4
    clip_norm: float = 1.0
    #: downstream noise multiplier σ and expected batch size B (set ρ_Λ = σC√d_Λ/B)
    sigma: float = 1.0
    downstream_batch: int = 64
    with_head: bool = True
    clip: bool = True
    max_length: int = 64
    seed: int = 0
    #: clipping style and head learning rate of the downstream recipe (privacy.clipping.style,
    #: head_fraction, optimizer.head_lr), so a unit is scored under the training it will get.
    clip_style: str = "flat"
    head_fraction: float = 0.5
    head_lr: Optional[float] = None

    def __post_init__(self):
        if self.perturbation not in PERTURBATIONS:
            raise ValueError(f"perturbation must be one of {PERTURBATIONS}, got {self.perturbation!r}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("scoring needs steps ≥ 1 and batch_size ≥ 1")
        if self.update not in ("eq21", "adamw"):
            raise ValueError(f"update must be 'eq21' (the paper) or 'adamw' (old scorer), got {self.update!r}")
        if self.head_warmup_steps < 0:
            raise ValueError("head_warmup_steps must be ≥ 0")


@dataclass
class UnitScore:
    unit: str
    accuracy: float  # Eq. 22 on the synthetic validation split
    val_loss: float
    dim: int
    rho: float
    grad_norm: float  # mean norm of Λ's averaged clipped gradient over the steps (gradient baseline)


def _engine(model, clip_norm: float, clip: bool, style: str = "flat", head_fraction: float = 0.5):
    if not clip:
        return NonPrivateEngine(model, classification_loss, make_clip_policy("flat", clip_norm))
    policy = make_clip_policy(style, clip_norm, head_fraction=head_fraction)
    try:
        from dpft.grads.bookkeeping import BookKeepingEngine

        engine = BookKeepingEngine(model, classification_loss, policy)
    except ImportError:  # pragma: no cover
        from dpft.grads.reference import ReferenceEngine

        engine = ReferenceEngine(model, classification_loss, policy)
    if hasattr(policy, "set_head_mask"):  # head_body: as the trainer marks it
        policy.set_head_mask([is_head_param(n) for n in engine.params])
    return engine


@torch.no_grad()
def evaluate(model: nn.Module, rows: Sequence[dict], pad_id: int, with_token_types: bool,
             batch_size: int = 128) -> tuple[float, float]:
    """(accuracy, mean loss in nats) of tokenised ``rows``; model left in eval mode."""
    model.eval()
    correct, loss = 0, 0.0
    for k in range(0, len(rows), batch_size):
        b = collate(rows[k:k + batch_size], pad_id, with_token_types, device=_device(model))
        logits = model(**model_inputs(b)).logits.float()
        loss += float(torch.nn.functional.cross_entropy(logits, b["labels"], reduction="sum"))
        correct += int((logits.argmax(-1) == b["labels"]).sum())
    return correct / len(rows), loss / len(rows)


def warm_up_head(model: nn.Module, train_rows: Sequence[dict], s: ScoreSettings, pad_id: int = 0,
                 with_token_types: bool = True) -> dict[str, torch.Tensor]:
    """The shared head trained alone on the synthetic train split, without ξ (clean AdamW,
    ``s.head_warmup_steps`` mini-batches of ``s.batch_size`` at ``s.head_lr`` or ``s.lr``), so
    Eq. 21's one step on Λ is read against a head that already fits θ⁽⁰⁾. Returns the warmed
    head's ``{name: tensor}``; ``model`` is left unchanged (head and flags restored)."""
    head = {n: p for n, p in model.named_parameters() if is_head_param(n)}
    saved = {n: p.detach().clone() for n, p in head.items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(s.seed + 1)
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in head)
        opt = torch.optim.AdamW(list(head.values()), lr=s.head_lr or s.lr, weight_decay=0.0)
        model.eval()
        for _ in range(s.head_warmup_steps):
            idx = torch.randint(0, len(train_rows), (min(s.batch_size, len(train_rows)),), generator=gen)
            batch = collate([train_rows[int(i)] for i in idx], pad_id, with_token_types, device=_device(model))
            with torch.enable_grad():
                loss = mean_loss(model, batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
        return {n: p.detach().clone() for n, p in head.items()}
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
                p.requires_grad_(flags[n])
                p.grad = None


def _restore(model: nn.Module, theta0: dict, flags: dict) -> None:
    """Put back a scored model: the unit's weights θ₀, every parameter's requires_grad, no grads."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in theta0:
                p.copy_(theta0[n])
            p.requires_grad_(flags[n])
            p.grad = None


def _score_unit_eq21(model: nn.Module, unit: str, train_rows: Sequence[dict], val_rows: Sequence[dict],
                     s: ScoreSettings, pad_id: int, with_token_types: bool, on_step,
                     head_state: Optional[Mapping[str, torch.Tensor]]) -> UnitScore:
    own = list(resolve_units(model, [unit], with_head=False))
    if s.with_head and head_state is None and s.head_warmup_steps > 0:
        head_state = warm_up_head(model, train_rows, s, pad_id, with_token_types)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    touched = set(own) | set(head_state or {})
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters() if n in touched}
    try:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if head_state and n in head_state:
                    p.copy_(head_state[n])
                p.requires_grad_(n in own)
        engine = _engine(model, s.clip_norm, s.clip, s.clip_style, s.head_fraction)
        params = engine.params
        dim = sum(p.numel() for p in params.values())
        rho = noise_scale(s.sigma, s.clip_norm, dim, s.downstream_batch)
        model.eval()
        batches = [collate(list(train_rows[k:k + s.batch_size]), pad_id, with_token_types, device=_device(model))
                   for k in range(0, len(train_rows), s.batch_size)]
        g = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
        for b in batches:  # g_Λ: mean clipped per-example gradient over the synthetic train split
            res = engine.clipped_sum(b)
            for n, t in res.grad_sum.items():
                g[n] += t.float()
        g = {n: t / len(train_rows) for n, t in g.items()}
        if s.perturbation == "worst":
            xi = worst_case_perturbation(model, params, batches, g, s.lr, rho)
        elif s.perturbation == "random":
            xi = random_perturbation(params, s.sigma * s.clip_norm / s.downstream_batch,
                                     torch.Generator().manual_seed(s.seed))
        else:
            xi = {n: torch.zeros_like(t) for n, t in g.items()}
        if on_step is not None:
            on_step(0, g, xi)
        with torch.no_grad():  # Eq. 21: θ′ = θ − η(g_Λ + ξ*), one SGD step on Λ only
            for n, p in params.items():
                p.sub_((s.lr * (g[n] + xi[n])).to(p.dtype))
        acc, loss = evaluate(model, list(val_rows), pad_id, with_token_types)
    finally:
        _restore(model, theta0, flags)
    return UnitScore(unit, acc, loss, dim, rho, float(_norm(g)))


def score_unit(model: nn.Module, unit: str, train_rows: Sequence[dict], val_rows: Sequence[dict],
               s: ScoreSettings, pad_id: int = 0, with_token_types: bool = True,
               on_step: Optional[Callable[[int, Grads, Grads], None]] = None,
               head_state: Optional[Mapping[str, torch.Tensor]] = None) -> UnitScore:
    """Score one unit (Algorithm 1 lines 8–12), then synthetic-validation accuracy.

    ``s.update == "eq21"`` (default, the paper's Eq. 21): head warmed up without ξ
    (:func:`warm_up_head`, or ``head_state`` when given, e.g. shared by :func:`score_units`),
    then one SGD step ``θ′_Λ = θ_Λ − η(g_Λ + ξ*_Λ)`` with ``‖ξ*_Λ‖ = ρ_Λ = σC√d_Λ/B`` on Λ only
    (η = ``s.lr``: use the downstream learning rate). ``"adamw"``: the old scorer (``s.steps``
    AdamW steps on Λ and the head, ξ on both). ``model`` is restored to θ⁽⁰⁾ and its
    ``requires_grad`` flags to what they were before returning.

    Args:
        train_rows, val_rows: tokenised rows (``input_ids`` [, ``token_type_ids``], ``label``).
        on_step: test hook ``fn(step, g, ξ)`` (once, step 0, with ``eq21``).

    Raises:
        ValueError: empty splits; dpft.models.load.ModelError: unknown unit.
    """
    if not train_rows or not val_rows:
        raise ValueError("scoring needs non-empty synthetic train and validation splits")
    if s.update == "eq21":
        return _score_unit_eq21(model, unit, train_rows, val_rows, s, pad_id, with_token_types, on_step, head_state)
    names = set(resolve_units(model, [unit], with_head=s.with_head))
    own = set(resolve_units(model, [unit], with_head=False))  # Λ itself, for the gradient baseline
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        engine = _engine(model, s.clip_norm, s.clip, s.clip_style, s.head_fraction)
        params = engine.params
        dim = sum(p.numel() for p in params.values())
        rho = noise_scale(s.sigma, s.clip_norm, dim, s.downstream_batch)
        opt = torch.optim.AdamW(head_param_groups(params, s.head_lr), lr=s.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(s.seed)
        gnorms = []
        model.eval()  # no dropout: the score should reflect Λ and ξ, not dropout draws
        for step in range(s.steps):
            idx = torch.randint(0, len(train_rows), (min(s.batch_size, len(train_rows)),), generator=gen)
            batch = collate([train_rows[int(i)] for i in idx], pad_id, with_token_types, device=_device(model))
            res = engine.clipped_sum(batch)
            g = {n: t / len(idx) for n, t in res.grad_sum.items()}
            gnorms.append(float(_norm({n: t for n, t in g.items() if n in own})))
            if s.perturbation == "worst":
                xi = worst_case_perturbation(model, params, batch, g, s.lr, rho)
            elif s.perturbation == "random":
                xi = random_perturbation(params, s.sigma * s.clip_norm / s.downstream_batch, gen)
            else:
                xi = {n: torch.zeros_like(t) for n, t in g.items()}
            if on_step is not None:
                on_step(step, g, xi)
            for n, p in params.items():
                p.grad = (g[n] + xi[n]).to(p.dtype)
            opt.step()
            opt.zero_grad(set_to_none=True)
        acc, loss = evaluate(model, list(val_rows), pad_id, with_token_types)
    finally:
        _restore(model, theta0, flags)
    return UnitScore(unit, acc, loss, dim, rho, sum(gnorms) / len(gnorms))


class ScoreCache:
    """Per-unit scores on disk, one JSON file per (model, synthetic data, settings) key, so a
    rerun or a k sweep rescoring nothing. ``directory=None`` disables caching."""

    def __init__(self, directory: Optional[str | Path]):
        self.dir = Path(directory) if directory else None

    @staticmethod
    def key(model_name: str, data_digest: str, settings: ScoreSettings, granularity: str) -> str:
        blob = json.dumps({"model": model_name, "data": data_digest, "settings": asdict(settings),
                           "granularity": granularity}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _path(self, key: str) -> Optional[Path]:
        return self.dir / f"scores-{key}.json" if self.dir else None

    def load(self, key: str) -> dict[str, dict]:
        p = self._path(key)
        return json.loads(p.read_text()) if p and p.is_file() else {}

    def save(self, key: str, scores: dict[str, dict]) -> None:
        p = self._path(key)
        if p is None:
            return

        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps(scores, indent=1))


def score_units(model: nn.Module, train_rows: Sequence[dict], val_rows: Sequence[dict], s: ScoreSettings,
                granularity: str = "block", units: Optional[Sequence[str]] = None,
                cache: Optional[ScoreCache] = None, model_name: str = "", data_digest: str = "",
                pad_id: int = 0, with_token_types: bool = True,
                log: Callable[[str], None] = lambda m: None) -> dict[str, UnitScore]:
    """Score every unit (default: all of ``unit_map(model, granularity)``); cached per unit."""
    units = list(units) if units is not None else list(unit_map(model, granularity))
    key = ScoreCache.key(model_name, data_digest, s, granularity) if cache else ""
    done = cache.load(key) if cache else {}
    out: dict[str, UnitScore] = {}
    head_state = None
    for u in units:
        if u in done:
            out[u] = UnitScore(**done[u])
            log(f"{u}: cached acc {out[u].accuracy:.3f}")
            continue
        if s.update == "eq21" and s.with_head and s.head_warmup_steps > 0 and head_state is None:
            head_state = warm_up_head(model, train_rows, s, pad_id, with_token_types)  # once, shared
        out[u] = score_unit(model, u, train_rows, val_rows, s, pad_id, with_token_types, head_state=head_state)
        log(f"{u}: acc {out[u].accuracy:.3f} loss {out[u].val_loss:.3f} d={out[u].dim} ρ={out[u].rho:.3g}")
        if cache:
            done[u] = asdict(out[u])
            cache.save(key, done)
    return out


def rank_units(scores: Mapping[str, UnitScore], k: int, criterion: str = "accuracy",
               exclude: Sequence[str] = ()) -> list[str]:
    """Top-k unit names (Eq. 23 generalised to top-k, Appendix B). Criteria: ``accuracy``
    (DP-SelFT and the performance-based baselines; ties → lower val loss), ``loss``
    (loss-based baseline: lowest val loss), ``gradient`` (gradient-based: largest mean
    clipped-gradient norm per √d). Order in the returned list: best first.

    Raises:
        ValueError: k < 1 or unknown criterion.
    """
    if k < 1:
        raise ValueError(f"top-k needs k ≥ 1, got {k}")
    items = [v for u, v in scores.items() if u not in exclude]
    if criterion == "accuracy":
        key = lambda v: (-v.accuracy, v.val_loss)  # noqa: E731
    elif criterion == "loss":
        key = lambda v: v.val_loss  # noqa: E731
    elif criterion == "gradient":
        key = lambda v: -v.grad_norm / math.sqrt(max(v.dim, 1))  # noqa: E731
    else:
        raise ValueError(f"unknown ranking criterion {criterion!r}")
    return [v.unit for v in sorted(items, key=key)[:k]]

