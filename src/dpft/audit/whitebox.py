"""White-box mechanism checks through the real :class:`~dpft.step.DPStep`, engines, clip
policies, :class:`~dpft.step.noise.GaussianMechanism` and :class:`~dpft.step.sample.PoissonSampler`.

* :func:`sensitivity_check` — leave-one-out: with σ = 0 the released clipped sum with and
  without each example of an adversarial batch differs by at most C in L2 (add/remove-one
  sensitivity, Abadi et al. 2016 Alg. 1; per-layer clipping C/√G, McMahan et al. 2018).
* :func:`noise_check` — many releases of a fixed sum: per-coordinate std σC (χ² test of the
  variance, KS test of normality), fresh across steps (correlation of consecutive steps' noise),
  and different across two secret :class:`Randomness` instances for the same step.
* :func:`sampling_check` — Poisson sampling: inclusion rate q (exact binomial test), batch-size
  mean qN and variance Nq(1−q) (z and χ² tests), membership independent across steps (χ² on
  the 2×2 table of consecutive steps).

Each returns a :class:`Check` (passed, a message, the statistics). The tests' significance
level is 1e-4 by default, so that an honest step fails a check with probability ≤ 1e-4 each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

from dpft.audit.harness import build_step, make_clip, released_sum
from dpft.privacy.randomness import Randomness
from dpft.step.noise import GaussianMechanism
from dpft.step.sample import PoissonSampler
from dpft.models.losses import classification_loss

LEVEL = 1e-4


@dataclass
class Check:
    name: str
    passed: bool
    message: str
    stats: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {"check": self.name, "verdict": "pass" if self.passed else "FAIL", "message": self.message, **self.stats}


class Checks(list):
    """A list of :class:`Check` with ``notes``: what was skipped, and why (the suite reports each note;
    a skipped check is never counted as passed)."""

    def __init__(self, checks=(), notes=()):
        super().__init__(checks)
        self.notes: list[str] = list(notes)


# --------------------------------------------------------------------------- tiny models


def tiny_classifier(family: str = "bert", vocab: int = 64, max_len: int = 32, num_labels: int = 2):
    """A tiny random sequence classifier of the recipe's architecture family (eval mode)."""
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config,
                              GPT2ForSequenceClassification, RobertaConfig,
                              RobertaForSequenceClassification)

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, num_labels=num_labels)
    if family == "gpt2":
        m = GPT2ForSequenceClassification(GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=max_len,
                                                     pad_token_id=0, **common))
    elif family == "roberta":
        m = RobertaForSequenceClassification(RobertaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                           intermediate_size=32, max_position_embeddings=max_len + 2,
                                                           pad_token_id=1, **common))
    else:
        m = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=32, max_position_embeddings=max_len, **common))
    for mod in m.modules():
        if hasattr(mod, "p") and isinstance(getattr(mod, "p"), float):
            mod.p = 0.0
    return m.eval()


def tiny_rows(n: int, t: int = 6, vocab: int = 64):
    """``n`` random token rows of length ``t`` with binary labels (a ``datasets.Dataset``, seed 0)."""
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(n, t, dtype=torch.long).tolist(),
                                       "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def adversarial_batch(model, family: str, vocab: int = 64, max_len: int = 32, seed: int = 0) -> dict:
    """Rows: a long repeated-token input, a random one, a mislabelled one (label = least likely
    class, so a large head gradient), a padding-only row, a short one."""
    g = torch.Generator().manual_seed(seed)
    b, t = 5, max_len
    pad = 1 if family == "roberta" else 0
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    ids[0] = 7  # long repeated token
    ids[3], mask[3] = pad, 0  # padding only
    if family == "gpt2":
        mask[3, 0] = 1  # GPT-2 pools the last non-pad token: keep one
    ids[4, 4:], mask[4, 4:] = pad, 0  # short
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(b, dtype=torch.long)}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    batch["labels"] = logits.argmax(-1)
    batch["labels"][2] = logits[2].argmin()  # mislabelled
    return batch


def _scale_up(model, factor: float = 30.0):
    """Scaled-up embeddings and head (huge per-example gradients)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "word_embeddings" in name or "wte" in name or "classifier" in name or "score" in name:
                p.mul_(factor)
    return model


# --------------------------------------------------------------------------- checks


def sensitivity_check(style: str, engine: str, c: float = 1.0, family: str = "bert", scaled: bool = False,
                      tol: float = 1e-4) -> Check:
    """Leave-one-out sensitivity of the released sum (σ = 0) through ``DPStep`` on an
    adversarial batch: ``max_i ‖S(B) − S(B∖i)‖ ≤ C(1 + tol)``."""
    model = tiny_classifier(family)
    if scaled:
        _scale_up(model)
    batch = adversarial_batch(model, family)
    b = batch["labels"].shape[0]
    clip = make_clip(style, c)
    step = build_step(model, classification_loss, clip, engine, 0.0, b, b, Randomness(0))
    full = released_sum(step, 0, [batch])
    worst = 0.0
    for i in range(b):
        keep = [j for j in range(b) if j != i]
        sub = {k: v[keep] for k, v in batch.items()}
        part = released_sum(step, 0, [sub])
        d = math.sqrt(sum(float((full[k] - part[k]).pow(2).sum()) for k in full))
        worst = max(worst, d)
    ok = worst <= c * (1 + tol)
    name = f"sensitivity {style}/{engine}{'/scaled' if scaled else ''}"
    return Check(name, ok, f"max leave-one-out change {worst:.6g} vs C = {c:g}", {"max_change": worst, "C": c})


def noise_check(sigma: float = 1.0, c: float = 1.0, dim: int = 64, draws: int = 200, hardened: bool = True,
                level: float = LEVEL) -> list[Check]:
    """The Gaussian mechanism's noise law, freshness across steps and across secret instances."""
    rng = Randomness()
    mech = GaussianMechanism(sigma, c, rng, hardened=hardened)
    base = {"w": torch.linspace(-1, 1, dim)}
    z = np.stack([((mech.release(base, c, 1.0, t)[0]["w"] - base["w"]).double() / (sigma * c)).numpy()
                  for t in range(draws)])
    ss, df = float((z ** 2).sum()), z.size
    p_var = 2 * min(stats.chi2.cdf(ss, df), stats.chi2.sf(ss, df))
    p_ks = float(stats.kstest(z.ravel(), "norm").pvalue)
    std = math.sqrt(ss / df) * sigma * c
    out = [Check("noise std σC", p_var > level and p_ks > level,
                 f"empirical std {std:.4g} vs σC = {sigma * c:g} (χ² p = {p_var:.3g}, KS p = {p_ks:.3g})",
                 {"std": std, "expected": sigma * c, "p_chi2": p_var, "p_ks": p_ks})]
    r = float(np.corrcoef(z[:-1].ravel(), z[1:].ravel())[0, 1])
    zr = abs(r) * math.sqrt(z[:-1].size)
    p_fresh = float(2 * stats.norm.sf(zr))
    out.append(Check("noise fresh across steps", p_fresh > level,
                     f"correlation of consecutive steps' noise {r:.3g} (p = {p_fresh:.3g})", {"corr": r, "p": p_fresh}))
    a = GaussianMechanism(sigma, c, Randomness(), hardened=hardened).add_noise(base, 0)["w"]
    b = GaussianMechanism(sigma, c, Randomness(), hardened=hardened).add_noise(base, 0)["w"]
    same = bool(torch.equal(a, b))
    out.append(Check("noise secret across instances", not same,
                     "two secret Randomness instances drew " + ("the SAME" if same else "different") + " noise for step 0"))
    return out


def sampling_check(n: int = 2000, q: float = 0.05, steps: int = 200, level: float = LEVEL) -> list[Check]:
    """Poisson sampling of :class:`PoissonSampler` (q = expected batch / N)."""
    sampler = PoissonSampler(n, max(1, round(q * n)), Randomness())
    q = sampler.q
    m = np.zeros((steps, n), dtype=bool)
    for t in range(steps):
        m[t, sampler.indices(t).numpy()] = True
    total = int(m.sum())
    p_rate = float(stats.binomtest(total, n * steps, q).pvalue)
    sizes = m.sum(1).astype(float)
    mu, var = n * q, n * q * (1 - q)
    p_mean = float(2 * stats.norm.sf(abs(sizes.mean() - mu) / math.sqrt(var / steps)))
    sv = float(sizes.var(ddof=1))
    chi = (steps - 1) * sv / var
    p_var = float(2 * min(stats.chi2.cdf(chi, steps - 1), stats.chi2.sf(chi, steps - 1)))
    a, b = m[:-1].ravel(), m[1:].ravel()
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])
    if (table.sum(0) == 0).any() or (table.sum(1) == 0).any():
        p_ind = 0.0 if q < 1 else 1.0
    else:
        p_ind = float(stats.chi2_contingency(table, correction=False)[1])
    return [
        Check("sampling rate q", p_rate > level, f"inclusion rate {total / (n * steps):.4g} vs q = {q:.4g} "
              f"(binomial p = {p_rate:.3g})", {"rate": total / (n * steps), "q": q, "p": p_rate}),
        Check("batch size mean/variance", p_mean > level and p_var > level,
              f"mean {sizes.mean():.4g} vs Nq = {mu:.4g} (p = {p_mean:.3g}); variance {sv:.4g} vs Nq(1−q) = "
              f"{var:.4g} (p = {p_var:.3g})", {"mean": float(sizes.mean()), "var": sv, "p_mean": p_mean, "p_var": p_var}),
        Check("membership independent across steps", p_ind > level,
              f"χ² test on consecutive steps' membership p = {p_ind:.3g}", {"p": p_ind}),
    ]


STYLES = ("flat", "per_layer", "head_body", "automatic", "adaptive")
ENGINES = ("bookkeeping:auto", "bookkeeping:ghost", "bookkeeping:instantiate", "reference")


def all_sensitivity_checks(c: float = 1.0, family: str = "bert", styles=STYLES, engines=ENGINES,
                           progress=None) -> list[Check]:
    """Every clip style × engine on the plain and the scaled-up adversarial model."""
    out = []
    for style in styles:
        for engine in engines:
            for scaled in (False, True):
                out.append(sensitivity_check(style, engine, c, family, scaled))
                if progress is not None:
                    progress.update(1)
    return out
