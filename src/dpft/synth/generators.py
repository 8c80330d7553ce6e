"""Candidate pool generators for DP-SelFT (Section 4.2 Eq. 4; Appendix B "Configuration of
generation"; Appendix C prompt templates). No privacy cost: nothing here sees private data.

A backend answers ``complete(instruction, text) -> str``; :func:`build_candidate_pool` does
the variation-based expansion shared by every backend: ``n_seeds`` snippets from the task's
generation prompt, then μ paraphrases of each (paraphrase prompt + the seed), so
``L = μ + 1`` candidates per seed (paper: μ = 3).

Backends:
- :class:`HFCausalLMBackend` — a local Hugging Face causal LM (offline; the default);
- :class:`OpenAIChatBackend` — an OpenAI-compatible ``/chat/completions`` endpoint, base URL and
  key from the environment (``DPFT_LLM_BASE_URL`` / ``OPENAI_BASE_URL``, ``DPFT_LLM_API_KEY`` /
  ``OPENAI_API_KEY``);
- :func:`load_candidate_file` — a user file of candidates (txt one per line, csv/tsv/jsonl/parquet).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

#: Appendix C, Figures 3–10: (generation prompt, paraphrase prompt) per task.
TEMPLATES: dict[str, tuple[str, str]] = {
    "sst2": (
        "Generate a short movie review snippet in the style of the SST-2 dataset.\n"
        "Snippets are concise opinionated fragments (5-25 words) taken from real movie reviews.\n"
        "The sentiment should be either positive or negative, and clearly expressed through natural language.",
        "Paraphrase the movie review snippet while strictly preserving the original sentiment.\n"
        "Output ONLY the paraphrased snippet -- no quotes, no labels, no explanations.",
    ),
    "sst5": (
        "Generate a short movie review snippet in the style of the SST-5 dataset.\n"
        "Snippets are concise opinionated fragments (5-25 words) taken from real movie reviews.\n"
        "The sentiment must be one of five categories: very negative, negative, neutral, positive, or very positive.",
        "Paraphrase the movie review snippet while strictly preserving both the original sentiment and its "
        "intensity.\nOutput ONLY the paraphrased snippet -- no quotes, no labels, no explanations.",
    ),
    "mnli": (
        "Generate a premise-hypothesis sentence pair for the MultiNLI task.\n"
        "entailment: the hypothesis is definitely true given the premise.\n"
        "neutral: the hypothesis may or may not be true given the premise.\n"
        "contradiction: the hypothesis is definitely false given the premise.\n"
        "Output ONLY the premise and hypothesis separated by a SINGLE TAB CHARACTER.",
        "Paraphrase the tab-separated premise-hypothesis pair while preserving the logical relationship.\n"
        "Output ONLY:\npremise\thypothesis (one tab separator, no other text or newlines).",
    ),
    "qqp": (
        "Generate a question pair for the Quora Question Pairs (QQP) task.\n"
        "duplicate: both questions ask the same thing in different words.\n"
        "not_duplicate: the questions ask clearly different things.\n"
        "Output ONLY the two questions separated by a SINGLE TAB CHARACTER.\n"
        "No labels, no newlines, no extra text.",
        "Paraphrase the tab-separated question pair while preserving whether they are duplicate or not.\n"
        "Output ONLY:\nquestion1\tquestion2 (one tab separator, no other text or newlines).",
    ),
}
#: Maximum generation length per task (Appendix B; tokens): 10 for SST-2/5, 30 MNLI, 25 QQP.
MAX_NEW_TOKENS = {"sst2": 10, "sst5": 10, "mnli": 30, "qqp": 25}


class GeneratorError(RuntimeError):
    """A backend that cannot be reached or configured; the message names the fix."""


class Backend(Protocol):
    def complete(self, instruction: str, text: Optional[str] = None) -> str:
        """One completion for ``instruction`` (and the snippet to paraphrase, if any)."""


def _clean(s: str) -> str:
    """First non-empty line, stripped of quotes: the candidate text."""
    for line in s.strip().splitlines():
        line = line.strip().strip('"').strip("'").strip()
        if line:
            return line
    return ""


def templates_for(task: str) -> tuple[str, str]:
    if task not in TEMPLATES:
        raise GeneratorError(f"no Appendix C prompt template for task {task!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[task]


@dataclass
class CandidatePool:
    """``texts[k]`` with ``seed_of[k]``: index of its seed (a seed is its own seed)."""

    texts: list[str]
    seed_of: list[int]


def build_candidate_pool(backend: Backend, task: str, n_seeds: int, mu: int = 3,
                         dedupe: bool = True) -> CandidatePool:
    """Variation-based expansion (Appendix B): ``n_seeds`` generated snippets, μ paraphrases each.

    Returns up to ``n_seeds·(μ+1)`` candidates (empty completions and, with ``dedupe``, exact
    duplicates dropped).

    Raises:
        GeneratorError: unknown task, n_seeds < 1, μ < 0, or nothing usable was generated.
    """
    if n_seeds < 1 or mu < 0:
        raise GeneratorError(f"need n_seeds ≥ 1 and μ ≥ 0, got {n_seeds}, {mu}")
    gen_prompt, para_prompt = templates_for(task)
    texts, seed_of, seen = [], [], set()

    def add(t: str, s: int) -> None:
        if t and not (dedupe and t in seen):
            seen.add(t)
            texts.append(t)
            seed_of.append(s)

    for s in range(n_seeds):
        seed = _clean(backend.complete(gen_prompt))
        if not seed:
            continue
        add(seed, s)
        for _ in range(mu):
            add(_clean(backend.complete(para_prompt, seed)), s)
    if not texts:
        raise GeneratorError("the generator returned no usable text; check the model/endpoint")
    return CandidatePool(texts, seed_of)


# ---------------------------------------------------------------------------- local HF LM
class HFCausalLMBackend:
    """A local causal LM (``AutoModelForCausalLM``), sampled at ``temperature`` (paper: 1.2).

    The prompt is the instruction, then the snippet (for paraphrases), then ``"\\nSnippet:"``;
    the continuation up to ``max_new_tokens`` is the answer. ``model``/``tokenizer`` may be
    passed already loaded (tests use a tiny random GPT-2).

    Raises:
        GeneratorError: the model folder cannot be loaded.
    """

    def __init__(self, model_path: str | None = None, max_new_tokens: int = 20, temperature: float = 1.2,
                 seed: int = 0, model=None, tokenizer=None):
        import torch

        if model is None or tokenizer is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model_path)
                model = AutoModelForCausalLM.from_pretrained(model_path)
            except (OSError, ValueError) as exc:
                raise GeneratorError(f"cannot load causal LM {model_path!r}: {str(exc)[:200]}; give a "
                                     "folder with config.json, weights and tokenizer") from None
        self.model, self.tokenizer = model.eval(), tokenizer
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.gen = torch.Generator().manual_seed(seed)
        self._torch = torch

    def complete(self, instruction: str, text: Optional[str] = None) -> str:
        torch = self._torch
        prompt = instruction + (f"\n{text}" if text else "") + "\nSnippet:"
        enc = self.tokenizer(prompt, return_tensors="pt")
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen)))
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=True, temperature=self.temperature,
                                      max_new_tokens=self.max_new_tokens, top_k=0,
                                      pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------------------- OpenAI-compatible
class OpenAIChatBackend:
    """OpenAI-compatible ``POST {base_url}/chat/completions`` (stdlib HTTP, no SDK).

    Base URL from ``base_url`` or ``DPFT_LLM_BASE_URL`` / ``OPENAI_BASE_URL``; key from
    ``DPFT_LLM_API_KEY`` / ``OPENAI_API_KEY`` (sent as a Bearer token). Only the task-level
    prompt and public snippets are sent — never private data.

    Raises:
        GeneratorError: no base URL, HTTP error, or a response without ``choices[0].message``.
    """

    def __init__(self, model: str = "gpt-4o-mini", base_url: Optional[str] = None, api_key: Optional[str] = None,
                 temperature: float = 1.2, max_tokens: int = 40, timeout: float = 60.0):
        base_url = base_url or os.environ.get("DPFT_LLM_BASE_URL") or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise GeneratorError("no endpoint: set DPFT_LLM_BASE_URL (or OPENAI_BASE_URL), e.g. "
                                 "https://api.openai.com/v1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key or os.environ.get("DPFT_LLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        self.model, self.temperature, self.max_tokens, self.timeout = model, temperature, max_tokens, timeout

    def complete(self, instruction: str, text: Optional[str] = None) -> str:
        messages = [{"role": "system", "content": instruction}]
        messages.append({"role": "user", "content": text if text else "Generate one."})
        body = json.dumps({"model": self.model, "messages": messages, "temperature": self.temperature,
                           "max_tokens": self.max_tokens, "n": 1}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            raise GeneratorError(f"{self.url} answered HTTP {exc.code}: {exc.read()[:200]!r}; check the key "
                                 "and model name") from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise GeneratorError(f"cannot reach {self.url} ({exc}); check DPFT_LLM_BASE_URL") from None
        try:
            return str(data["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise GeneratorError(f"unexpected response from {self.url}: {str(data)[:200]}") from None


# ---------------------------------------------------------------------------- file
def load_candidate_file(path: str | Path, column: str = "text", min_words: int = 0,
                        max_words: Optional[int] = None) -> list[str]:
    """Candidates from a file: ``.txt`` one per line, or csv/tsv/jsonl/parquet with ``column``.

    Raises:
        GeneratorError: missing file/column or no candidates left after the length filter.
    """
    p = Path(path)
    if not p.is_file():
        raise GeneratorError(f"candidate file not found: {p}")
    if p.suffix == ".txt":
        texts = [ln.strip() for ln in p.read_text().splitlines()]
    else:
        from dpft.data.tasks import _load_file

        ds = _load_file(p)
        if column not in ds.column_names:
            raise GeneratorError(f"{p}: no column {column!r}; columns are {ds.column_names}")
        texts = [str(t).strip() for t in ds[column] if t is not None]
    texts = [t for t in texts if t and len(t.split()) >= min_words and (max_words is None or len(t.split()) <= max_words)]
    if not texts:
        raise GeneratorError(f"{p}: no candidates (after the {min_words}–{max_words} word filter)")
    return list(dict.fromkeys(texts))  # dedupe, keep order
