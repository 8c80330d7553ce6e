#!/usr/bin/env python
"""Write a random-initialised Qwen2-0.5B-shaped causal LM as a Hugging Face folder (for
``benchmarks/gpu_suite.sh``: the end-to-end instruct run of a model of a size people fine-tune,
on a machine without internet).

Shape: Qwen2-0.5B's published ``config.json`` (hidden 896, MLP 4864, 24 blocks, 14 heads / 2 KV
heads, vocabulary 151,936, tied embeddings, RMSNorm eps 1e-6, RoPE θ 1e6): 494M parameters. The
tokenizer is copied from ``--tokenizer`` (stories260K's 512-token Llama tokenizer: no download),
so only the first 512 embedding rows are ever read; the shape, and so the time and memory of a
step, is Qwen2-0.5B's. The weights are random (seed 0): BLEU measures the plumbing, not quality.

``--tiny``: the same architecture at toy widths (2 blocks, hidden 64, vocabulary 512), for the
CPU smoke run of the suite.

Usage::

    python benchmarks/gpu_make_model.py --tokenizer ../shared/data/models/stories260K --out runs/qwen2-0.5b-random
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

#: Qwen2-0.5B's config.json (Hugging Face Qwen/Qwen2-0.5B), the fields that set the shape.
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                 max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=512, tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def make(tokenizer: Path, out: Path, tiny: bool = False, seed: int = 0) -> int:
    """Write the folder; returns the number of parameters."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    shape = TINY if tiny else QWEN2_05B
    cfg = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    if len(tok) > cfg.vocab_size:
        raise SystemExit(f"tokenizer has {len(tok)} tokens > vocab {cfg.vocab_size}")
    torch.manual_seed(seed)  # public, random initial weights (no mechanism)
    model = Qwen2ForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        if (tokenizer / f).is_file() and f != "generation_config.json":
            shutil.copy(tokenizer / f, out / f)
    (out / "README.md").write_text(
        f"Random-initialised {'toy Qwen2' if tiny else 'Qwen2-0.5B-shaped'} causal LM (seed {seed}) with the "
        f"tokenizer of {tokenizer.name}; written by benchmarks/gpu_make_model.py. Not a trained model.\n")
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with a tokenizer (e.g. stories260K)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke run)")
    a = ap.parse_args(argv)
    n = make(a.tokenizer, a.out, a.tiny)
    print(f"wrote {a.out}: {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
