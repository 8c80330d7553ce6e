"""EW-FT / DP-Forward's parts: the ``ldp:`` config models, the report's statements, σ of the
official code (for reproduction) and the helpers of the run (label RR, release counts, report
sections, the method's block of report.md). methods/ewft/method.py wires them into the Trainer."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field

from dpft.config.base import PluginConfig

from dpft.privacy.label_rr import (example_epsilon_with_label, label_epsilon, randomized_response, rr_keep_probability)
from dpft.privacy.ldp import (LDPError, local_epsilon_composed)
from dpft.accounting.calibrate import calibrate_sigma


PHASE = "ldp-forward"


class LdpAutoencoderCfg(PluginConfig):
    """Stacked autoencoder around the forward noise (EW-FT Section 5.3), pre-trained on public text."""

    #: Widths, hidden size first: [384, 64] (MiniLM; the paper's 768×64), [384, 256, 64] …;
    #: empty = no autoencoder (DP-Forward: the whole T × h matrix is clipped and perturbed).
    sizes: list[int] = []
    #: Public text for reconstruction pre-training (a registered task; its *train* texts, not
    #: the private training set).
    public_task: str = "imdb"
    public_examples: int = Field(2000, ge=1)
    pretrain_epochs: int = Field(3, ge=0)
    pretrain_lr: float = Field(1e-3, gt=0)
    pretrain_batch_size: int = Field(32, ge=1)


class LdpTrainPreCfg(PluginConfig):
    """``ldp.train_pre``: pre(·) trained by DP-SGD through the noise layer (methods/ewft/train_pre.py).

    Each step releases the noisy codes (σ_rep, sensitivity 2C) and the noisy clipped sum of
    pre(·)'s per-example gradients (σ_grad, sensitivity ``max_grad_norm``) on the same sampled
    batch: one ledger event ``PoissonSampled(q, Gaussian(σ_eff))``, σ_eff⁻² = σ_rep⁻² + σ_grad⁻²."""

    enabled: bool = False
    #: C_g: per-example L2 clipping norm of pre(·)'s gradient (flat).
    max_grad_norm: float = Field(1.0, gt=0)
    #: ρ = σ_grad / σ_rep; the pair is calibrated jointly to ``ldp.target_epsilon``.
    noise_ratio: float = Field(1.0, gt=0)
    #: Train only the last ``blocks`` blocks of pre(·) (None = all of them); earlier blocks stay frozen.
    blocks: Optional[int] = Field(None, ge=1)
    #: Also train the embedding layer (needs ``blocks`` unset).
    embeddings: bool = False
    #: Per-example engine of pre(·)'s gradients (grads/).
    engine: Literal["bookkeeping", "reference"] = "bookkeeping"


class LdpCfg(PluginConfig):
    """Forward-pass local DP (EW-FT / DP-Forward; privacy/ldp.py, accounting/ewpba.py).

    The noise is on the forward pass (clip the hidden matrix to C, add N(0, σ_e²(2C)²)); the
    optimizer step on post(·) is then non-private post-processing, so ``privacy.enabled``
    must be false (no per-example gradient clipping)."""

    enabled: bool = False
    #: ``embeddings`` · ``encoder:l`` (after block l, 1-based) · ``output`` (before the head).
    position: str = "encoder:5"
    #: Frobenius clipping norm C of one example's (T × h) matrix or autoencoder code.
    max_norm: float = Field(1.0, gt=0)
    #: Scale every example to norm exactly C instead of clipping (Eq. 11, first option).
    normalize: bool = False
    #: ``ewpba`` (EW-FT Algorithm 1: decreasing σ per epoch) or ``uniform`` (DP-Forward).
    schedule: Literal["ewpba", "uniform"] = "ewpba"
    #: EWPBA step distance S.
    step_distance: float = Field(2.0, gt=0)
    #: ε of the training stream (example level, the paper's accounting) at ``delta``.
    target_epsilon: Optional[float] = Field(8.0, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    #: Fixed σ for every epoch instead of a schedule.
    noise_multiplier: Optional[float] = Field(None, ge=0)
    #: Keep the noise on at evaluation (inference-time privacy, as DP-Forward); the last
    #: epoch's σ is used.
    eval_noise: bool = True
    autoencoder: LdpAutoencoderCfg = LdpAutoencoderCfg()
    #: Label privacy ε₂ (DP-Forward): K-ary randomized response on every training label, drawn
    #: once before training (privacy/label_rr.py); pure ε₂-DP per example, replace-one.
    #: None = labels are used in the clear (not covered by any guarantee).
    label_epsilon: Optional[float] = Field(None, gt=0)
    #: With ``label_epsilon``: train on the forward-corrected loss −log (softmax·T)[ỹ] with the
    #: known RR transition matrix T (Patrini et al. 2017) instead of cross-entropy on ỹ.
    label_loss_correction: bool = True
    #: Give post(·) the attention mask of the padded input (after the noise). The mask is not
    #: noised: it releases each example's token count in the clear, so the ε then covers the
    #: text of inputs of equal token count (the report's scope says so). False = post(·)
    #: attends to every position and the token count is protected too (the split deployment
    #: never sends a mask).
    mask_after_noise: bool = True
    #: REPRODUCTION ONLY, NOT CERTIFIED: ``dp_forward_code`` does what DP-Forward's official
    #: code does (REPRO_FLAWS (i)–(vii)); the run reports NOT CERTIFIED with each flaw.
    reproduce: Optional[Literal["dp_forward_code"]] = None
    #: ABLATION ONLY, NOT CERTIFIED: a subset of REPRO_FLAWS' ids (e.g. ``["i"]``) applied to
    #: the certified mechanism, to find which of DP-Forward's choices carries its accuracy;
    #: ``reproduce: dp_forward_code`` is all of them.
    reproduce_flaws: Optional[list[Literal["i", "ii", "iii", "iv", "v", "vi", "vii"]]] = None
    #: Certified adaptation of pre(·) by DP-SGD (the certified counterpart of flaw (i)).
    train_pre: LdpTrainPreCfg = LdpTrainPreCfg()



STREAM_STATEMENT = (
    "Example level, training stream (the paper's accounting): PLD composition of one "
    "PoissonSampled(q, Gaussian(σ_e)) event per step, σ_e relative to the replace-one sensitivity "
    "2C (add/remove neighbouring, as DP-SGD). It assumes what subsampling amplification assumes: "
    "the observer does not learn which examples a step used nor which row is whose. A server that "
    "knows which user sent which row gets no amplification; against it only the local guarantee holds.")
LOCAL_STATEMENT = (
    "Local, per release: one noisy matrix is (ε_loc, δ)-DP for any two inputs of one user "
    "(analytic Gaussian mechanism, Balle & Wang 2018, σ_e relative to sensitivity 2C). "
    "'per example, all releases' composes the largest number of releases any training example "
    "made in each epoch (PLD, replace-one). It covers the text; labels: see the label guarantee.")
LINKED_STATEMENT = (
    "Example level when the server links rows to users (split deployment: the server knows which "
    "client sent which row): subsampling amplification does not apply, so the example-level "
    "guarantee is the composition of the releases the example actually made — at most the largest "
    "number of releases any example made in each epoch, at that epoch's σ_e (PLD replace-one through "
    "dp_accounting; the same number as 'local ε per example, all releases'). 'with label' adds the "
    "example's one randomized-response label to the same composition.")
LABEL_STATEMENT = (
    "Labels (DP-Forward's ε₂): every training label was replaced once, before training, by K-ary "
    "randomized response (kept with probability e^ε₂/(e^ε₂+K−1), else a uniformly random other "
    "label); every epoch reuses the same noisy label, so all training is post-processing of one "
    "release. Pure ε₂-DP per example (δ = 0) under replace-one (that example's label changed to any "
    "other), ε from dp_accounting's RandomizedResponseDpEvent; not in the add/remove ledger above. "
    "It covers the labels only.")
LABEL_CLEAR_STATEMENT = "Labels are used in the clear (ldp.label_epsilon unset): no guarantee covers them."
COMBINED_STATEMENT = (
    "Text and label together, CONSERVATIVE UPPER BOUND: basic composition ε_stream + ε₂ at δ_stream "
    "of the training-stream guarantee (text, under its assumptions) and the label guarantee, for a "
    "neighbour that changes one example's text and label. Not tight, and not a ledger entry (the two "
    "guarantees use different neighbouring relations: add/remove and replace-one).")


#: What ``ldp.reproduce: dp_forward_code`` does as DP-Forward's official code does
#: (github xiangyue9607/DP-Forward), each a reason the run is NOT CERTIFIED or not comparable.
REPRO_FLAWS = {
    "i": "the layers before the noise (pre(·), and the projection) are trained through the noise, non-privately "
         "(add_noise does not detach; freeze_pre_noise_layers never runs): gradients of clean inputs reach "
         "the user-side weights",
    "ii": "noise std σ·C instead of σ·2C (sensitivity hard-coded to 1, but the replace-one sensitivity of a "
          "matrix clipped to C is 2C)",
    "iii": "σ calibrated with sampling rate q = 1/N over N·E compositions although training uses batches of "
           "B > 1 (q = B/N): the claimed ε does not describe the releases made",
    "iv": "at `output` the pooled [CLS] vector (after the pooler) is noised",
    "v": "the attention mask is passed to the layers after the noise (token count released in the clear)",
    "vi": "the projection (autoencoder) is trained from random initialisation end to end, with no public "
          "pre-training",
    "vii": "no noise at inference (dev inputs unprotected)",
}
REPRO_REASON = ("ldp.reproduce: dp_forward_code reproduces DP-Forward's official code: "
                + "; ".join(f"({k}) {v}" for k, v in REPRO_FLAWS.items()))


def dp_forward_code_sigma(target_epsilon: float, delta: float, n: int, epochs: int) -> float:
    """σ as DP-Forward's code calibrates it (flaw iii): ``PoissonSampled(1/N, Gaussian(σ))``
    composed N·E times to ``target_epsilon`` at ``delta`` (PLD, dp_accounting), σ relative to a
    sensitivity of 1 (noise std σ·C, flaw ii). SST-2 (N = 67,349, E = 3, δ = 1e-5):
    σ = 0.4216 / 0.3745 / 0.3195 at ε = 2 / 4 / 8. NOT a certified calibration."""
    return calibrate_sigma(target_epsilon, delta, 1.0 / n, n * epochs)


TRAIN_PRE_STATEMENT = (
    "ldp.train_pre: pre(·) is trained by DP-SGD. Each step releases, on one Poisson-sampled batch, the noisy codes "
    "(σ_rep, sensitivity 2C) and the noisy sum of pre(·)'s per-example gradients clipped to C_g (σ_grad); the "
    "ledger records them as ONE event PoissonSampled(q, Gaussian(σ_eff)), σ_eff⁻² = σ_rep⁻² + σ_grad⁻² (two "
    "Gaussians on the same data; sampled once, so amplification is applied once). Inference: the LDP layer "
    "protects each input (local guarantee of one release at σ_rep). Training: the example-level ε covers both "
    "releases; the party that trains pre(·) runs it on clean inputs and adds the gradient noise (trusted, as "
    "in DP-SGD), so the split deployment (a server that never sees a clean input) cannot run this mode. "
    "'linked_rows_epsilon_with_gradients' composes, without amplification, an example's code and gradient "
    "releases (PLD, replace-one).")
#: Headline qualifier of a forward-LDP run without label privacy (issue 13).
LABELS_NOT_PROTECTED = "ε covers the inputs only; labels are not protected (set ldp.label_epsilon)"
#: Qualifier of ``ldp.mask_after_noise`` (issue 18): the mask is an un-noised function of the length.
LENGTH_NOT_PROTECTED = ("token counts are not protected: the attention mask given to post(·) is not noised, "
                        "so ε covers the text of inputs of equal token count (set ldp.mask_after_noise: false "
                        "to protect the count too)")
#: Which dev accuracy the inference-time guarantee covers.
INFERENCE_STATEMENT = (
    "dev_accuracy_noisy_inference: every dev input is clipped and noised at the last epoch's σ before post(·) "
    "sees it, so each dev prediction is a post-processing of one (ε_loc, δ)-LDP release of that input (local "
    "guarantee, 'epsilon_per_release_by_epoch'[-1]; with ldp.mask_after_noise its token count is in the clear). "
    "dev_accuracy_clean_inference: the same model on un-noised inputs — no inference-time protection of the "
    "dev input (the model itself still carries the training guarantee). dev_accuracy is the one ldp.eval_noise "
    "selects.")


def ldp_stream(run, step: int):
    """The secret stream of step ``step``'s forward-LDP releases on this process: ``ldp``, step
    (and the rank under DDP or FSDP2, :func:`rank_parts`), drawn on the model's device."""
    return run.rng.stream("ldp", int(step), *rank_parts(run), device=run.device)


def rank_parts(run) -> tuple:
    """Extra parts of a per-example noise stream's name across processes: ``("rank", r)`` with K > 1
    processes (each rank noises other examples: the same draw on two ranks would let anyone who
    sees both releases subtract the noise), none in one process (its streams stay as they were).

    The same under DDP and FSDP2 (``perf.sharding: fsdp``): FSDP2 shards the *parameters*, not the
    examples — each rank still runs its own share of the logical batch (``distributed.shard``) and
    releases those examples' codes, so the release noise is per example, hence per rank. (Unlike the
    gradient noise of the DP step, one tensor cut into shards, drawn from a block layout that is the
    same for any K: dpft/placement/fsdp.py ``shard_noise``; ``ldp.train_pre``'s, the one-process draw sliced:
    methods/ewft/fsdp.py.) K ranks therefore equal K DDP ranks draw for draw,
    and one process in law (each example's codes get an independent N(0, σ²(2C)²I) draw)."""
    k = int(getattr(run, "world_size", 1) or 1)
    return ("rank", int(getattr(run, "rank", 0))) if k > 1 else ()


def fsdp_world(run) -> bool:
    """True when the run's parameters are FSDP2 shards over K > 1 processes (``perf.sharding: fsdp``
    under torchrun); one process with ``fsdp`` shards nothing (dpft/placement/fsdp.py ``shard_model``)."""
    perf = getattr(getattr(run, "recipe", None), "perf", None)
    return getattr(perf, "sharding", "none") == "fsdp" and int(getattr(run, "world_size", 1) or 1) > 1


def pre_cache_allowed(run) -> bool:
    """Whether the frozen pre(·)'s per-example cache (privacy/ldp.py ``SplitClassifier.pre_cache``,
    a speed-up only) may be on: not when pre(·)'s blocks are FSDP2 units on K > 1 ranks.

    Why: under FSDP2 each transformer block (and the embeddings) all-gathers its parameter shards
    when its forward starts — a collective that every rank must enter in the same order. With the
    cache, a rank whose rows were all seen before skips pre(·)'s forwards (and their all-gathers)
    while another rank, with one unseen row, enters them: the ranks' collectives then pair different
    blocks — a hang, or, for blocks of equal shapes, silently exchanged shards (the audit plants it:
    audit/checks_fsdp_ewft.py ``ewft_fsdp_pre_cache_kept``). Without the cache every micro-batch runs
    pre(·) on every rank (placeholders included): the same collectives everywhere; the released codes
    are the same function of the rows (pre(·) is frozen and deterministic), only slower."""
    return not fsdp_world(run)


def privatize_labels(ds, eps: float, num_labels: int, generator):
    """Replace the ``label`` column of a tokenised split by K-ary randomized response, drawn once.

    Returns ``(dataset with the noisy labels, (N,) int64 noisy labels)``. The same noisy label is
    then used at every step and epoch: post-processing, so the label guarantee is ε₂ however
    long training runs. ``generator`` is the run's secret stream ``rng.stream("label_rr")``
    (a :class:`~dpft.privacy.randomness.SecretStream`): with its secret and the data one could
    tell which labels were kept.
    """
    if "label" not in ds.column_names:
        raise LDPError("ldp.label_epsilon needs a labelled classification task (no 'label' column)")
    y = torch.tensor([int(v) for v in ds["label"]], dtype=torch.long)
    noisy = randomized_response(y, eps, num_labels, generator)
    return ds.remove_columns("label").add_column("label", noisy.tolist()), noisy


def max_releases_per_epoch(sampler, n: int, epochs: int, steps_per_epoch: int, upto: int) -> list[int]:
    """Largest number of releases of one example in each epoch, over steps ``< upto`` (from the
    seeded sampler: data-independent, so this statistic is public)."""
    out = []
    for e in range(epochs):
        counts = torch.zeros(n, dtype=torch.long)
        for step in range(e * steps_per_epoch, min((e + 1) * steps_per_epoch, upto)):
            counts[sampler.indices(step)] += 1
        out.append(int(counts.max()) if n else 0)
    return out


def linked_section(release_sigmas: list[float], delta: float, eps_label: float | None,
                   num_labels: int) -> dict[str, Any]:
    """Example-level guarantee without amplification (server links rows to users): PLD
    replace-one composition (dp_accounting) of the σ's of one example's releases, without and
    with its RR label."""
    return {
        "statement": LINKED_STATEMENT,
        "delta": delta,
        "releases": len(release_sigmas),
        "epsilon": local_epsilon_composed(release_sigmas, delta),
        "epsilon_with_label": (example_epsilon_with_label(release_sigmas, delta, eps_label, num_labels)
                               if eps_label is not None else None),
    }


def label_section(eps_label: float | None, num_labels: int, correction: bool, stream_epsilon: float,
                  stream_delta: float) -> dict[str, Any]:
    """The label guarantee (ε₂, δ = 0, via dp_accounting) and the conservative combined bound."""
    if eps_label is None:
        return {"privacy": "none", "statement": LABEL_CLEAR_STATEMENT}
    e2 = label_epsilon(eps_label, num_labels)
    return {
        "privacy": "randomized response", "statement": LABEL_STATEMENT,
        "epsilon": e2, "delta": 0.0, "label_epsilon_configured": eps_label, "num_labels": num_labels,
        "keep_probability": rr_keep_probability(eps_label, num_labels),
        "loss": "forward-corrected (Patrini et al. 2017)" if correction else "cross-entropy on the noisy labels",
        "combined_upper_bound": {"epsilon": stream_epsilon + e2, "delta": stream_delta,
                                 "method": "basic composition (sum of ε's): an upper bound",
                                 "statement": COMBINED_STATEMENT},
    }


# ---------------------------------------------------------------------------- report.md
def ldp_markdown(rep: dict[str, Any]) -> list[str]:
    """Forward-LDP block of the Markdown report: schedule and both guarantees."""
    x, p = rep["ldp"], rep["privacy"]
    loc = p["local"]
    fmt = lambda v: ", ".join(f"{a:.4g}" for a in v)  # noqa: E731
    return [
        "## Forward-pass local DP (EW-FT / DP-Forward)", "",
        "| item | value |", "|---|---|",
        f"| noise position | {x['position']}; release per example: {x['release_shape'][0]} × {x['release_shape'][1]} |",
        f"| autoencoder | {x['autoencoder'] or 'none'} |",
        f"| clipping | Frobenius, C = {x['max_norm']:g}; replace-one sensitivity 2C = {x['sensitivity']:g} |",
        f"| σ schedule | {x['method']}: σ_e = {fmt(x['sigmas'])} (noise std σ_e·2C = {fmt(x['noise_std_by_epoch'])}) |",
        f"| sampling | Poisson, q = {x['q']:.5f}, {x['steps_per_epoch']} steps per epoch |",
        f"| example-level ε (stream) | {p['epsilon']:.4g} at δ = {p['delta']:g} (PLD; RDP {p['epsilon_rdp']:.4g}) |",
        f"| local ε per release, by epoch | {fmt(loc['epsilon_per_release_by_epoch'])} at δ = {loc['delta']:g} |",
        f"| local ε per example, all releases | {loc['epsilon_per_example_all_releases']:.4g} "
        f"(max releases per epoch {loc['max_releases_per_example_by_epoch']}) |",
        *ldp_label_rows(p),
        "",
        f"- {p['statement']}",
        f"- {loc['statement']}",
        *[f"- {p[k]['statement']}" for k in ("linked_rows", "label") if p.get(k)],
        *([f"- {p['label']['combined_upper_bound']['statement']}"] if p.get("label", {}).get("combined_upper_bound") else []),
        f"- Evaluation {'with' if x['eval_noise'] else 'without'} the noise layer's noise (last epoch's σ).",
        "",
    ]


def ldp_label_rows(p: dict[str, Any]) -> list[str]:
    """Table rows of the linked-rows (no amplification) and label guarantees, when present."""
    rows = []
    if p.get("linked_rows"):
        k = p["linked_rows"]
        w = f"; with its label {k['epsilon_with_label']:.4g}" if k.get("epsilon_with_label") is not None else ""
        rows.append(f"| example-level ε, server links rows to users (no amplification) | {k['epsilon']:.4g}{w} "
                    f"at δ = {k['delta']:g} (PLD replace-one, {k['releases']} releases) |")
    lab = p.get("label")
    if lab and lab.get("privacy") == "randomized response":
        c = lab["combined_upper_bound"]
        rows += [f"| label ε₂ (randomized response, K = {lab['num_labels']}) | {lab['epsilon']:.4g} at δ = 0 "
                 f"(keep probability {lab['keep_probability']:.3f}; loss: {lab['loss']}) |",
                 f"| text + label, upper bound (basic composition) | ε ≤ {c['epsilon']:.4g} at δ = {c['delta']:g} |"]
    elif lab:
        rows.append("| labels | in the clear (not covered) |")
    return rows
