"""Build a tiny random-initialised T5 (``T5ForConditionalGeneration``) with the tokenizer of the real
stories260K model (../shared/data/models/stories260K, sentencepiece, vocab 512 + ``<pad>``), for
``recipes/e2e-t5-lora.yaml`` when no pretrained T5 is at hand offline. A pipeline check, not a
model of any quality.

    python benchmarks/make_tiny_t5.py runs/tiny-t5 [--tokenizer ../shared/data/models/stories260K]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/models/stories260K"))
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "<pad>"})
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=len(tok), d_model=a.d_model, d_kv=a.d_model // 4, d_ff=4 * a.d_model,
                   num_layers=a.layers, num_decoder_layers=a.layers, num_heads=4, relative_attention_num_buckets=16,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   decoder_start_token_id=tok.pad_token_id)
    T5ForConditionalGeneration(cfg).save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"tiny T5 ({sum(p.numel() for p in T5ForConditionalGeneration(cfg).parameters()):,} parameters) in {a.out}")


if __name__ == "__main__":
    main()
