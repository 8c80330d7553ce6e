#!/usr/bin/env python
"""What a private 1B / 8B / 70B fine-tuning run needs per GPU, and what batch the accountant needs
(issue 38 item 5). Writes ``benchmarks/results/memory_plan.md``.

Part 1, memory per GPU, from the model configs written below (Llama-3.2-1B, Llama-3.1-8B,
Llama-3.1-70B: the ``config.json`` fields that set the shape), for LoRA (r = 16 on the 7 Linear of
every block), QLoRA (the same adapters over an NF4 base) and full fine-tuning, on 1, 8 and 64 GPUs,
one sequence of 4096 tokens per GPU per micro-batch, bf16 autocast, activation checkpointing (what
the recipes in recipes/chat-sft-llama-*.yaml set). Columns, in GB (10^9 bytes) per GPU:

- parameters: the frozen base (bf16, 2 B/param; NF4 under QLoRA: 0.5 B + the double-quantized
  absmax, 1/64 + 4/(64·256) B per param, with the embeddings and LM head that bitsandbytes does not
  quantize kept in fp32 by ``peft.prepare_model_for_kbit_training``) and the trainable parameters
  in fp32 (full fine-tuning: every parameter fp32). With G > 1 GPUs the world runs FSDP2
  (``perf.sharding: fsdp``): every parameter is sharded 1/G; the root unit (embeddings, final norm,
  LM head) stays gathered for the whole step (dpft/placement/fsdp.py: ``reshard_after_forward=False``) and one
  block is gathered at a time (both added).
- optimizer: per trainable parameter, the clipped sum (fp32, 4 B) and AdamW's two moments (8 B),
  sharded 1/G under FSDP2.
- activations at 4k tokens: per GPU for its one sequence; not sharded (data parallel). The peak of
  the step is the larger of (a) the start of the backward: every block's checkpointed input
  (L·T·h) plus the logits (T·V in bf16, their fp32 copy for the loss, the saved log-softmax and its
  gradient, 4 B each) and (b) the end of the backward: the book-keeping factors below plus one
  block's recomputed activations, T·(12h + 4·kv + 4i) elements.
- book-keeping buffers: what the book-keeping engine keeps per example until the clip factors are
  known (grads/bookkeeping.py; Bu et al. 2023): each hooked layer's input A (shared by q/k/v and by
  gate/up: 3h + i per block) and output gradient G (3h + 2·kv + 2i per block; LoRA: the same, the
  adapters' G being the full-width output gradient and their A the block's inputs), T of each, in
  bf16; full fine-tuning adds the LM head's G (T·V) and the embedding's. The per-example squared
  norms themselves are a (B,) vector per layer (bytes); the per-example gradients instantiated
  for the norms run in bounded chunks (grads/contrib.py) and are not counted.

These are estimates of the allocator's live tensors (no fragmentation, no CUDA context ~0.5 GB, no
NCCL buffers). They are checked against measured CPU runs of the same architecture with few layers
at reduced width (``--check``; the measured step peak from ``torch.profiler``'s memory events, the
resident model from its tensors, fp32 on the CPU): the table states the tolerance they met.

Part 2, the batch the accountant needs: for ε = 1, 3, 8 at δ = 10⁻⁶ (below 1/N for N ≤ 10⁶), N = 10⁵ and 10⁶ users, S = 1000 steps, the smallest expected batch B (users per
step, Poisson rate q = B/N) whose calibrated σ (dpft.accounting.calibrate.calibrate_sigma: the PLD
accountant of dp-accounting) gives a noise on the averaged gradient σ/B ≤ 10⁻³ (the regime of the
private LLM fine-tuning results of Li et al. 2022, e.g. B = 1024, σ ≈ 1), and the steps per hour that
B makes on 1, 8 and 64 H100s at a stated throughput (model FLOPs per token: LoRA/QLoRA 6P — forward,
activation-only backward, checkpoint recompute, each 2P; full 8P, the weight gradients' 2P more;
at 40 % of an H100's 989 dense bf16 TFLOP/s; one 4096-token sequence per user per step).

Usage::

    python benchmarks/memory_plan.py                 # table + accountant, writes results/memory_plan.md
    python benchmarks/memory_plan.py --check         # and the measured CPU check (about a minute)
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

#: The shape fields of the published config.json files (Hugging Face meta-llama/*).
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
LABELS = {"llama-3.2-1b": "1B (Llama-3.2-1B)", "llama-3.1-8b": "8B (Llama-3.1-8B)", "llama-3.1-70b": "70B (Llama-3.1-70B)"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_R = 16
MODES = ("lora", "qlora", "full")
GPUS = (1, 8, 64)
TOKENS = 4096
GPU_GB = 80
#: NF4 bytes per quantized parameter: 4-bit codes + double-quantized absmax (8-bit per 64-block,
#: fp32 per 256 such blocks) (Dettmers et al. 2023, QLoRA, Section 3 "Double Quantization").
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
H100_TFLOPS = 989.0
MFU = 0.40


def block_linears(s: dict) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of the Linear layers of one Llama block."""
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    return [("q_proj", h, h), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", h, h),
            ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def counts(s: dict, r: int = LORA_R) -> dict:
    """Parameter counts: ``linear`` (block Linear weights), ``embed``, ``head`` (0 when tied),
    ``norms``, ``total``, ``lora`` (r on every block Linear), ``root`` (embed + head + final norm),
    ``block`` (one block's parameters)."""
    h, L, V = s["hidden_size"], s["num_hidden_layers"], s["vocab_size"]
    lin = sum(a * b for _, a, b in block_linears(s))
    block = lin + 2 * h
    embed = V * h
    head = 0 if s.get("tie_word_embeddings") else V * h
    lora = L * sum(r * (a + b) for _, a, b in block_linears(s))
    return {"linear": L * lin, "embed": embed, "head": head, "norms": L * 2 * h + h, "lora": lora,
            "total": L * block + embed + head + h, "root": embed + head + h, "block": block}


@dataclass
class Plan:
    params: float
    optimizer: float
    activations: float
    bookkeeping: float

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.activations + self.bookkeeping


def activation_terms(s: dict, mode: str, tokens: int = TOKENS, act_bytes: float = 2.0, r: int = LORA_R) -> dict:
    """Bytes of one sequence's activations and book-keeping factors (see the module docstring):

    ``ckpt`` the checkpointed block inputs; ``logits`` the loss's tensors (logits in the autocast
    dtype, their fp32 copy — none when they are fp32 already —, its contiguous transpose and
    log-softmax, 4 B each); ``block`` one recomputed block; ``A`` the inputs the engine keeps from
    the forward for every hooked layer (q/k/v share one, gate/up one; full fine-tuning adds the LM
    head's); ``G`` the output gradients it keeps from the backward (full: and the LM head's T·V and
    the embedding's); ``transient`` the norm step's largest temporary (an instantiated per-example
    gradient and its square, fp32, or the two T x T Gram matrices of a ghost norm)."""
    h, i, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    T = tokens
    A = L * T * (3 * h + i) * act_bytes
    G = L * T * (3 * h + 2 * kv + 2 * i) * act_bytes
    weights = [(b, a) for _, a, b in block_linears(s)]
    if mode == "full":
        A += T * h * act_bytes
        G += T * (V + h) * act_bytes
        weights.append((V, h))
    else:  # LoRA: lora_A (r x in) and lora_B (out x r); their r-wide factors
        A += L * 7 * T * r * act_bytes
        G += L * 7 * T * r * act_bytes
        weights = [w for a, b in weights for w in ((r, b), (a, r))]
    transient = max((2 * rr * cc * 4.0) if T * (rr + cc) > rr * cc else 2 * T * T * 4.0 for rr, cc in weights)
    return {"ckpt": L * T * h * act_bytes, "logits": T * V * (12 + (act_bytes if act_bytes < 4 else 0)),
            "block": T * (12 * h + 4 * kv + 4 * i) * act_bytes, "A": A, "G": G, "transient": transient, "L": L}


def step_peaks(a: dict) -> tuple[float, float]:
    """(non-private, private) activation peaks of one micro-batch from :func:`activation_terms`:
    the loss in the forward; a recomputed block (private: the first block's, at the end of the
    backward, beside the kept factors); the norms at the backward's end."""
    nonprivate = max(a["ckpt"] + a["logits"], a["ckpt"] + a["block"])
    f = (a["L"] - 1) / a["L"]  # the first block's backward: every later block's G is kept already
    private = max(a["ckpt"] + a["A"] + a["logits"], a["ckpt"] / a["L"] + a["A"] + f * a["G"] + a["block"],
                  a["A"] + a["G"] + a["transient"])
    return nonprivate, private


def plan(shape: str | dict, mode: str, gpus: int, tokens: int = TOKENS, act_bytes: float = 2.0,
         base_bytes: float = 2.0) -> Plan:
    """Bytes per GPU (see the module docstring). ``base_bytes``: the frozen base's bytes per
    parameter under LoRA (2: bf16)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    c = counts(s)
    if mode == "full":
        trainable, frozen = c["total"], 0.0
    elif mode == "lora":
        trainable, frozen = c["lora"], c["total"] * base_bytes
    elif mode == "qlora":
        trainable = c["lora"]
        frozen = c["linear"] * NF4_BYTES + (c["embed"] + c["head"] + c["norms"]) * 4.0
    else:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    params = frozen + trainable * 4.0
    optimizer = trainable * 12.0
    if gpus > 1:  # FSDP2: all sharded; the root stays gathered, one block gathered at a time
        root_b = (c["embed"] + c["head"]) * (4.0 if mode in ("full", "qlora") else base_bytes)
        block_b = c["block"] * (4.0 if mode == "full" else NF4_BYTES if mode == "qlora" else base_bytes)
        params = params / gpus + root_b * (1 - 1 / gpus) + block_b
        optimizer /= gpus
    nonprivate, private = step_peaks(activation_terms(s, mode, tokens, act_bytes))
    return Plan(params=params, optimizer=optimizer, activations=nonprivate, bookkeeping=max(0.0, private - nonprivate))


def recipe_estimate(shape: str, mode: str, gpus: int, tokens: int, rows: int) -> float:
    """Bytes per GPU of a recipe's step: parameters and optimizer state once, activations and
    book-keeping buffers for each of ``rows`` sequences of ``tokens`` tokens in a micro-batch (they
    scale with the rows; the loss's and the block's temporaries are counted per row too: an upper
    bound)."""
    p = plan(shape, mode, gpus, tokens)
    return p.params + p.optimizer + rows * (p.activations + p.bookkeeping)


def gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def max_tokens(shape: str, mode: str, gpus: int, budget: float = GPU_GB * 1e9 * 0.95) -> int:
    """The longest micro-batch sequence (a multiple of 512 tokens, up to 32k) whose step fits ``budget``
    bytes per GPU; 0 when not even 512 tokens do."""
    best = 0
    for t in range(512, 32768 + 1, 512):
        if plan(shape, mode, gpus, t).total <= budget:
            best = t
    return best


def memory_table(tokens: int = TOKENS) -> list[str]:
    lines = ["| model | mode | GPUs | trainable params | parameters | optimizer | activations (4k tokens) | "
             "book-keeping buffers | total per GPU | fits 80 GB | longest sequence that fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        c = counts(SHAPES[shape])
        for mode in MODES:
            tr = c["total"] if mode == "full" else c["lora"]
            for g in GPUS:
                p = plan(shape, mode, g, tokens)
                fits = "yes" if p.total <= GPU_GB * 1e9 * 0.95 else "no"
                t = max_tokens(shape, mode, g)
                lines.append(f"| {LABELS[shape]} | {mode} | {g} | {tr / 1e6:,.1f}M | {gb(p.params)} | "
                             f"{gb(p.optimizer)} | {gb(p.activations)} | {gb(p.bookkeeping)} | {gb(p.total)} | {fits} | "
                             f"{f'{t:,}' if t else 'none'} |")
    return lines


NOTES = """## What these tables say, and what they do not

- "fits 80 GB" leaves 5 % for the allocator; "longest sequence that fits" is the micro-batch of one
  sequence per GPU (in 512-token steps). Time per step grows with the tokens, not the memory.
- The book-keeping buffers are the private step's cost over the non-private one: the engine keeps every
  hooked layer's input A (from the forward, so activation checkpointing does not free them) and output
  gradient G until the clip factors are known. They are per GPU and not sharded by FSDP2 (each rank
  keeps its own examples' factors, full width), so more GPUs do not shrink them: at 4k tokens they are
  1.9 / 10.5 / 78.5 GB for 1B / 8B / 70B. 70B therefore needs shorter micro-batch sequences (last
  column) whatever the GPU count. For LoRA this is avoidable: an adapter's per-example gradient is
  r x (in + out) numbers, so reducing lora_A / lora_B's factors to per-example gradients when the hook
  fires (as the engine's instantiation path does later, in the norm step) would keep kilobytes
  instead of T x (3h + i) + T x (3h + 2kv + 2i) values per block — an engine change (grads/), not made here.
- Parameters under FSDP2 include the root unit (embeddings, LM head) kept gathered for the whole step
  and one gathered block; two gathered blocks (prefetch), NCCL buffers, the CUDA context (~0.5 GB) and
  fragmentation are not counted. QLoRA under FSDP2 shards the NF4 blocks (quant_storage = the compute
  dtype; tests/test_qlora_cli_fsdp.py: each of 2 ranks holds 0.50 of the parameter bytes).
- The check below is on the CPU in fp32 at reduced width; the GPU rows assume bf16 activations (half
  the bytes) and were not measured on a GPU here (benchmarks/gpu_suite.sh stage 4 measures the
  recipes' peak memory on one). The formulas' terms were identified from where the profiler put the
  peaks on the first three check shapes (the loss in the forward; the first block's backward beside
  the kept factors; the norms at the end); the fourth shape was held out and meets them within 3 %.
- Steps per hour rest on an assumed 40 % of an H100's dense bf16 peak and model FLOPs only (the
  book-keeping engine's extra work — norms and the clipped-sum products — is not in it); they are a
  plan, not a measurement. The 70B QLoRA column assumes a configuration that fits (e.g. 2k-token
  micro-batches, last column).
"""


# -- the accountant --------------------------------------------------------------------------------
def batch_for(epsilon: float, n: int, delta: float, steps: int, noise_target: float) -> tuple[int, float]:
    """Smallest expected batch B (q = B/N) whose PLD-calibrated σ meets σ/B ≤ ``noise_target``;
    returns (B, σ). σ/B falls as B grows at fixed S (for these ε), so a bisection on B."""
    from dpft.accounting.calibrate import calibrate_sigma

    def ratio(b: int) -> tuple[float, float]:
        sig = calibrate_sigma(epsilon, delta, b / n, steps)
        return sig / b, sig

    lo, hi = 1, n
    r_hi, s_hi = ratio(hi)
    if r_hi > noise_target:
        return -1, s_hi
    best = (hi, s_hi)
    for _ in range(40):
        if hi - lo <= max(1, hi // 100):  # 1 % resolution on B
            break
        mid = int(math.sqrt(lo * hi)) if hi > 2 * lo else (lo + hi) // 2
        r, sg = ratio(mid)
        if r <= noise_target:
            hi, best = mid, (mid, sg)
        else:
            lo = mid
    return best


def flops_per_token(shape: str, mode: str) -> float:
    p = counts(SHAPES[shape])["total"]
    return (8.0 if mode == "full" else 6.0) * p


def accountant_table(epsilons=(1.0, 3.0, 8.0), ns=(10 ** 5, 10 ** 6), delta: float = 1e-6, steps: int = 1000,
                     noise_target: float = 1e-3) -> list[str]:
    lines = [f"S = {steps} steps, δ = {delta:g}, target σ/B ≤ {noise_target:g}; σ from dpft's PLD calibration "
             "(dp-accounting). Steps per hour at one 4096-token sequence per user per step and "
             f"{MFU:.0%} of an H100's {H100_TFLOPS:g} dense bf16 TFLOP/s (LoRA/QLoRA 6P, full 8P FLOPs per token).", "",
             "| N users | ε | B (users/step) | q | σ | σ/B | epochs in S steps | 8B LoRA steps/h on 1 / 8 / 64 GPUs | "
             "70B QLoRA steps/h on 1 / 8 / 64 GPUs |", "|---|---|---|---|---|---|---|---|---|"]
    for n in ns:
        for eps in epsilons:
            b, sig = batch_for(eps, n, delta, steps, noise_target)
            if b < 0:
                lines.append(f"| {n:,} | {eps:g} | none: even B = N (q = 1) needs σ = {sig:.3g}, σ/B = {sig / n:.2g} "
                             f"> {noise_target:g} (more users, fewer steps or a larger ε) | | | | | | |")
                continue

            def sph(shape, mode):
                tok_s = MFU * H100_TFLOPS * 1e12 / flops_per_token(shape, mode)
                return " / ".join(f"{3600 * g * tok_s / (b * TOKENS):.2g}" for g in GPUS)

            lines.append(f"| {n:,} | {eps:g} | {b:,} | {b / n:.4g} | {sig:.3f} | {sig / b:.2e} | {steps * b / n:.2f} | "
                         f"{sph('llama-3.1-8b', 'lora')} | {sph('llama-3.1-70b', 'qlora')} |")
    return lines


# -- the check against measured CPU runs ----------------------------------------------------------
#: Reduced shapes for the CPU check, with the tokens per sequence: Llama blocks at 1/16 of
#: Llama-3.1-8B's width (the 8B's h : i : kv ratios). The first two at the 8B's V/h, where the loss's
#: logits set the peak; the third with a short vocabulary and longer sequences, where the book-keeping
#: factors at the end of the backward set it.
_W16 = dict(hidden_size=256, intermediate_size=896, num_attention_heads=8, num_key_value_heads=2,
            tie_word_embeddings=False)
CHECK_SHAPES = {
    "8B/16 width, 2 blocks, V 8016, T 256": (dict(_W16, num_hidden_layers=2, vocab_size=8016), 256),
    "8B/16 width, 4 blocks, V 8016, T 256": (dict(_W16, num_hidden_layers=4, vocab_size=8016), 256),
    "8B/16 width, 4 blocks, V 1024, T 512": (dict(_W16, num_hidden_layers=4, vocab_size=1024), 512),
    # held out (added after the formulas were settled on the three above): 1B-shaped, tied embeddings
    "1B/8 width, tied, 3 blocks, V 4000, T 384": (dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                                       num_key_value_heads=1, tie_word_embeddings=True,
                                                       num_hidden_layers=3, vocab_size=4000), 384),
}
TOLERANCE = 0.10


def _build(shape: dict, mode: str, tmp: Path, tokens: int):
    import torch
    import transformers

    from dpft.config.recipe import TrainableCfg
    from dpft.models.load import select_trainable
    from dpft.placement.device import enable_activation_checkpointing

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=tokens, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    lora = TrainableCfg(mode="lora", lora={"r": LORA_R, "alpha": 32, "target_modules": list(LORA_TARGETS)})
    if mode == "qlora":
        from dpft.models.quant import bnb_config

        d = tmp / "base"
        model.save_pretrained(d)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, quantization_config=bnb_config("nf4"),
                                                                  device_map={"": "cpu"}, dtype=torch.float32)
        import peft

        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = select_trainable(model, lora if mode != "full" else TrainableCfg(mode="full"))
    model.train()
    enable_activation_checkpointing(model)
    return model


def measure(shape: dict, mode: str, tmp: Path, tokens: int) -> dict:
    """Resident bytes and the book-keeping step's peak (torch.profiler memory events) on the CPU,
    fp32, one sequence of ``tokens`` tokens."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_speed import resident_bytes, step_peak_bytes

    from dpft.grads.bookkeeping import BookKeepingEngine
    from dpft.models.losses import causal_lm_loss
    from dpft.step.clip import make_clip_policy

    model = _build(shape, mode, tmp, tokens)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, shape["vocab_size"], (1, tokens), generator=g),
             "attention_mask": torch.ones(1, tokens, dtype=torch.long), "position_ids": torch.arange(tokens)[None]}
    eng = BookKeepingEngine(model, causal_lm_loss, make_clip_policy("flat", 1.0))
    eng.clipped_sum(batch)  # the one-time usage probe, outside the measured step
    peak = step_peak_bytes(lambda: eng.clipped_sum(batch), lambda: None, torch.device("cpu"))
    return {"resident": resident_bytes(model, batch), "peak": peak}


def predicted_cpu(shape: dict, mode: str, tokens: int) -> dict:
    """The same formulas as :func:`plan` for the measured setting: fp32 activations and base (LoRA),
    one CPU process, one ``clipped_sum`` call, whose peak is the private activation peak or, at its
    end, the clipped sums it returns (4 B per trainable parameter; no optimizer state)."""
    c = counts(shape)
    p = plan(shape, mode, 1, tokens, act_bytes=4.0, base_bytes=4.0)
    _, private = step_peaks(activation_terms(shape, mode, tokens, act_bytes=4.0))
    trainable = c["total"] if mode == "full" else c["lora"]
    return {"resident": p.params, "peak": max(private, trainable * 4.0)}


def check_table(tmp: Path) -> tuple[list[str], float]:
    rows = ["| shape | mode | resident: predicted / measured (MB) | step peak: predicted / measured (MB) | "
            "worst relative error |", "|---|---|---|---|---|"]
    worst = 0.0
    for k, (name, (shape, tokens)) in enumerate(CHECK_SHAPES.items()):
        for mode in MODES:
            try:
                m = measure(shape, mode, tmp / f"{k}-{mode}", tokens)
            except ImportError as exc:  # QLoRA without bitsandbytes
                rows.append(f"| {name} | {mode} | skipped: {exc} | | |")
                continue
            p = predicted_cpu(shape, mode, tokens)
            err = max(abs(p[k] - m[k]) / m[k] for k in ("resident", "peak"))
            worst = max(worst, err)
            rows.append(f"| {name} | {mode} | {p['resident'] / 1e6:.1f} / {m['resident'] / 1e6:.1f} | "
                        f"{p['peak'] / 1e6:.1f} / {m['peak'] / 1e6:.1f} | {err:.0%} |")
    return rows, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="measure the reduced shapes on the CPU")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "memory_plan.md"))
    args = ap.parse_args(argv)
    out = ["# Memory and batch plan for private fine-tuning of 1B / 8B / 70B Llama shapes", "",
           "Made by `python benchmarks/memory_plan.py" + (" --check" if args.check else "") + "` "
           "(formulas and assumptions: the script's docstring). GB = 10^9 bytes, per GPU; "
           "G > 1 GPUs = FSDP2 (perf.sharding: fsdp).", "", "## Memory per GPU", "", *memory_table()]
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            rows, worst = check_table(Path(d))
        out += ["", "## Check against measured CPU runs", "",
                f"The same formulas against the book-keeping step measured on the CPU (fp32, one sequence of T "
                f"tokens, LoRA r = {LORA_R} on the 7 Linear of each block, activation checkpointing; resident = parameters + buffers + batch; step "
                f"peak = torch.profiler's allocator peak during `BookKeepingEngine.clipped_sum`, above what existed "
                f"before). Tolerance: {TOLERANCE:.0%}; worst here: {worst:.0%}"
                f" ({'within' if worst <= TOLERANCE else 'OUTSIDE'} it).", "", *rows]
    out += ["", NOTES.rstrip(), "", "## Batch the accountant needs", "", *accountant_table()]
    text = "\n".join(out) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
