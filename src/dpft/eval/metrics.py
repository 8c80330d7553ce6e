"""Generation metrics against one or several references per prompt: BLEU (``sacrebleu``),
ROUGE-L (``rouge-score``) and exact match, each on a 0–100 scale.

Multi-reference scoring as in Li et al. 2022 ("Large language models can be strong
differentially private learners", E2E/DART) and Yu et al. 2022: a prompt with k references is
one hypothesis scored against all k. BLEU is sacrebleu's corpus BLEU (default 13a
tokenisation, n-gram counts clipped by the maximum count over the references, brevity penalty
from the closest reference length); prompts with fewer references than the largest group fill
the missing streams with ``None``, which sacrebleu skips. ROUGE-L is the F-measure of the best
reference per prompt (``RougeScorer.score_multi``, Porter stemming), averaged over prompts.
Exact match: the hypothesis equals one of the references after stripping and collapsing
whitespace (case-sensitive).

Note: the official E2E scripts (e2e-metrics, NIST mteval BLEU; ROUGE-L with its own
multi-reference rule) give somewhat different numbers; these are the libraries' values.
"""

from __future__ import annotations

from typing import Sequence


def _check(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} reference lists; give one list per hypothesis")
    if not hyps:
        raise ValueError("no hypotheses to score")
    empty = [i for i, r in enumerate(refs) if not r]
    if empty:
        raise ValueError(f"hypotheses {empty[:5]} have no reference")


def corpus_bleu(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0–100) of ``hyps[i]`` against the references ``refs[i]`` (sacrebleu).

    Raises:
        ValueError: lengths differ, nothing to score, or a hypothesis without a reference.
    """
    import sacrebleu

    _check(hyps, refs)
    k = max(len(r) for r in refs)
    streams = [[r[j] if j < len(r) else None for r in refs] for j in range(k)]
    return float(sacrebleu.corpus_bleu(list(hyps), streams).score)


def rouge_l(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over prompts of the best-reference ROUGE-L F-measure (0–100; rouge-score).

    Raises:
        ValueError: as :func:`corpus_bleu`.
    """
    from rouge_score import rouge_scorer

    _check(hyps, refs)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return 100.0 * sum(scorer.score_multi(list(r), h)["rougeL"].fmeasure for h, r in zip(hyps, refs)) / len(hyps)


def _norm(s: str) -> str:
    return " ".join(s.split())


def exact_match(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Percentage of hypotheses equal to one of their references (whitespace-normalised)."""
    _check(hyps, refs)
    return 100.0 * sum(_norm(h) in {_norm(x) for x in r} for h, r in zip(hyps, refs)) / len(hyps)


def score_generations(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> dict[str, float]:
    """``{"dev_bleu", "dev_rouge_l", "dev_exact_match"}`` (0–100 each)."""
    return {"dev_bleu": corpus_bleu(hyps, refs), "dev_rouge_l": rouge_l(hyps, refs),
            "dev_exact_match": exact_match(hyps, refs)}
