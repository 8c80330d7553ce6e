#!/usr/bin/env python
"""The LLM jobs of recipes/ on a GPU (issue 38 item 4): helpers of ``benchmarks/gpu_suite.sh``.

``make --shape SHAPE --tokenizer DIR --out DIR [--layers N] [--tiny]``
    a random-initialised Llama of one of ``memory_plan.SHAPES`` (the published configs' shape
    fields), saved in bf16 with the given tokenizer (no hub on the device). ``--tiny``: hidden 64,
    2 blocks (the CPU smoke run).
``sft RUN_DIR -- <dpft train arguments>``
    ``dpft train`` in this process with each logical step timed (CUDA synchronised); writes
    ``RUN_DIR/job.json``: median s/step after the first step, the run's peak GPU memory, ε.
``dpo RECIPE --run-dir DIR [--model DIR] [--pairs-from CHATS.jsonl] [--steps N] [--no-dp] [--set k=v]``
    a DPO recipe (recipes/trl/*.yaml: ``model``, ``data``, ``lora`` = peft ``LoraConfig``, ``dpo`` =
    TRL ``DPOConfig``, ``dp`` = dpft ``DPArguments``) through ``dpft.integrations.trl.trainer.DPDPOTrainer``
    (``--no-dp``: TRL's own ``DPOTrainer``, the non-private step); ``--pairs-from`` makes preference
    pairs from a chat file (chosen = the conversation's assistant reply, rejected = another
    conversation's). Writes ``DIR/job.json``: steps, seconds per step, peak GPU memory, ε.
``opacus --model DIR --run-dir DIR [--batch B] [--seq T] [--steps N] [--lora]``
    Opacus 1.6's FSDP2 ghost clipping (``grad_sample_mode="ghost_fsdp"``, one process) on the same
    model and token shape, as the comparison of the SFT stages; without an Opacus that has FSDP2
    it prints why and writes ``job.json`` saying ``skipped``.
``table OUT.md TITLE LABEL=DIR ...``
    appends a Markdown table of the jobs (``job.json``, or a ``dpft train`` run's ``report.json`` and
    ``gpu_rank0.json`` from ``gpu_suite.py run``), with each private step's time and memory as a
    ratio to the row labelled ``... non-private`` of the same job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_plan import SHAPES  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=True)
SECTIONS = ("name", "model", "data", "lora", "dpo", "dp")


# -- recipes ---------------------------------------------------------------------------------------
def _parse(v: str):
    import yaml

    return yaml.safe_load(v)


def load_trl_recipe(path: str | Path, overrides: dict | None = None) -> dict:
    """A TRL recipe (recipes/trl/*.yaml) with dotted ``overrides`` (``dpo.max_steps``: 5).

    Raises:
        ValueError: an unknown top-level section or a section that is not a mapping."""
    import yaml

    rec = yaml.safe_load(Path(path).read_text())
    for k, v in (overrides or {}).items():
        node = rec
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    unknown = set(rec) - set(SECTIONS)
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}; a TRL recipe has {', '.join(SECTIONS)}")
    for s in SECTIONS[1:]:
        if not isinstance(rec.get(s, {}), dict):
            raise ValueError(f"{path}: section {s} must be a mapping")
    return rec


def dpo_parts(rec: dict, output_dir: str | Path, no_dp: bool = False):
    """``(DPOConfig, DPArguments | None, LoraConfig)`` of a DPO recipe, checked as DPDPOTrainer checks
    them (``check_dpo_config``; quantization as ``model.quantization`` of a dpft recipe).

    Raises:
        ValueError / TypeError: a setting the classes or dpft refuse (their messages)."""
    from peft import LoraConfig
    from trl import DPOConfig

    from dpft.integrations.hf.args import DPArguments
    from dpft.integrations.trl.trainer import check_dpo_config

    q = rec.get("model", {}).get("quantization")
    if q is not None and q not in ("nf4", "int8"):
        raise ValueError(f"model.quantization must be nf4, int8 or null (got {q!r})")
    import torch

    kw = dict(rec.get("dpo", {}))
    if not torch.cuda.is_available():  # a CPU check or smoke run: TrainingArguments refuses bf16 there
        kw.update(bf16=False, use_cpu=True)
    args = DPOConfig(output_dir=str(output_dir), **kw)
    check_dpo_config(args)
    lora = LoraConfig(**rec["lora"]) if rec.get("lora") else None
    dp = None if no_dp else DPArguments(**rec["dp"])
    return args, dp, lora


def pairs_from_chats(path: str | Path, n: int | None = None):
    """Preference pairs from a chat file (JSON lines with ``messages``), as plain text (any tokenizer,
    chat template or not): prompt = the turns before the first assistant reply as ``role: content``
    lines and ``assistant:``, chosen = that reply, rejected = the reply of the next conversation whose
    reply differs (a benchmark's pairs: the shapes of real pairs, not their meaning)."""
    import datasets

    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    convs = []
    for r in rows:
        msgs = r["messages"]
        k = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if k:
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in msgs[:k]) + "\nassistant:"
            convs.append((prompt, msgs[k]["content"]))
    out = []
    for j, (prompt, reply) in enumerate(convs):
        other = next((c[1] for c in convs[j + 1:] + convs[:j] if c[1] != reply), None)
        if other is not None:
            out.append({"prompt": prompt, "chosen": " " + reply, "rejected": " " + other})
    return datasets.Dataset.from_list(out[:n] if n else out)


# -- jobs ------------------------------------------------------------------------------------------
def _peak() -> int:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def _load(model_dir: str, quantization: str | None, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    kw = {"dtype": dtype}
    if quantization:
        from dpft.models.quant import bnb_config, quant_device

        kw.update(quantization_config=bnb_config(quantization, dtype), device_map={"": quant_device()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    if not quantization and torch.cuda.is_available():
        model.cuda()
    if quantization:
        from dpft.models.load import import_peft

        model = import_peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return tok, model


def run_dpo(rec: dict, run_dir: Path, model_dir: str | None = None, pairs=None, no_dp: bool = False) -> dict:
    """Train the DPO recipe; returns (and writes to ``run_dir/job.json``) its timing and ε."""
    import torch

    run_dir.mkdir(parents=True, exist_ok=True)
    args, dp, lora = dpo_parts(rec, run_dir / "out", no_dp)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tok, model = _load(model_dir or rec["model"]["name"], rec.get("model", {}).get("quantization"), dtype)
    if pairs is None:
        import datasets

        pairs = datasets.load_dataset("json", data_files=rec["data"]["train_file"], split="train")
    if no_dp:
        from trl import DPOTrainer

        tr = DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok, peft_config=lora)
    else:
        from dpft.integrations.trl.trainer import DPDPOTrainer

        tr = DPDPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok, peft_config=lora, dp_args=dp)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tr.train()
    dt = time.perf_counter() - t0
    steps = int(tr.state.global_step)
    eps = None
    if not no_dp and getattr(tr, "ledger", None) is not None:
        eps = tr.ledger.epsilon(dp.target_delta).epsilon
    out = {"job": "dpo", "private": not no_dp, "steps": steps, "seconds_per_step": dt / max(1, steps),
           "peak_memory_bytes": _peak(), "epsilon": eps, "delta": None if no_dp else dp.target_delta,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    (run_dir / "job.json").write_text(json.dumps(out, indent=1))
    return out


def run_sft(run_dir: Path, cli_args: list[str]) -> dict:
    """``dpft <cli_args>`` in this process with every logical step timed (``Trainer.step``, CUDA
    synchronised); writes ``run_dir/job.json``: the median step time after the first step (the
    first alone when there is one), the run's peak GPU memory, ε from the run's report."""
    import torch

    from dpft.cli import commands as cli
    from dpft.run import loop

    cuda = torch.cuda.is_available()
    times: list[float] = []
    orig = loop.Trainer.step

    def timed(self, t):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(self, t)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    loop.Trainer.step = timed
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    code = 0
    sys.argv = ["dpft", *cli_args]
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        loop.Trainer.step = orig
    run_dir.mkdir(parents=True, exist_ok=True)
    rep = run_dir / "report.json"
    r = json.loads(rep.read_text()) if rep.is_file() else {}
    timed_steps = sorted(times[1:]) or times
    out = {"job": "dpft train", "exit_code": code, "private": "--no-dp" not in cli_args, "steps": len(times),
           "seconds_per_step": timed_steps[len(timed_steps) // 2] if timed_steps else None,
           "peak_memory_bytes": _peak(), "epsilon": (r.get("privacy") or {}).get("epsilon"),
           "delta": (r.get("privacy") or {}).get("delta"),
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    (run_dir / "job.json").write_text(json.dumps(out, indent=1))
    return out


def make_model(shape: str, tokenizer: str, out: Path, layers: int | None = None, tiny: bool = False) -> int:
    """Write a random-initialised Llama of ``shape`` (bf16) with ``tokenizer``'s files; returns its
    parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    fields = dict(TINY if tiny else SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = LlamaConfig(**fields, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=5e5)
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def run_opacus(model_dir: str, run_dir: Path, batch: int, seq: int, steps: int, lora: bool) -> dict:
    """Opacus 1.6 FSDP2 ghost clipping on one process: ``steps`` timed steps of ``batch`` random
    sequences of ``seq`` tokens (σ = 0, C = 1, SGD); writes ``run_dir/job.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        from opacus import PrivacyEngine
        from opacus.utils.fsdp_utils import FSDP2Wrapper
    except ImportError as exc:
        out = {"job": "opacus-ghost-fsdp", "skipped": f"Opacus with FSDP2 (>= 1.6) not installed ({exc}); "
                                                       "pip install 'opacus>=1.6' (dpft[bench])"}
        print(out["skipped"])
        (run_dir / "job.json").write_text(json.dumps(out, indent=1))
        return out
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device("cuda" if cuda else "cpu")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False  # ghost clipping refuses tied parameters (as step_speed.py)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model = FSDP2Wrapper(model.to(dev))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size if hasattr(model, "config") else 512
    data = TensorDataset(torch.randint(3, min(vocab, 32000), (batch * (steps + 2), seq)))
    loader = DataLoader(data, batch_size=batch)
    model, opt, crit, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0, max_grad_norm=1.0,
        grad_sample_mode="ghost_fsdp", criterion=nn.CrossEntropyLoss(), poisson_sampling=False)
    times = []
    for k, (x,) in enumerate(loader):
        x = x.to(dev)
        if k == 2 and cuda:
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=x).logits
        loss = crit(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if k + 1 >= steps + 2:
            break
    timed = sorted(times[2:]) or times
    out = {"job": "opacus-ghost-fsdp", "steps": len(timed), "seconds_per_step": timed[len(timed) // 2],
           "peak_memory_bytes": _peak(), "batch": batch, "seq": seq, "lora": lora}
    (run_dir / "job.json").write_text(json.dumps(out, indent=1))
    return out


# -- the table -------------------------------------------------------------------------------------
def _job(d: Path) -> dict:
    if (d / "job.json").is_file():
        return json.loads((d / "job.json").read_text())
    rep, gpu = d / "report.json", d / "gpu_rank0.json"
    if not rep.is_file():
        return {"missing": True}
    r = json.loads(rep.read_text())
    steps = (r.get("dp") or {}).get("steps") or (r.get("schedule") or {}).get("steps") or 0
    g = json.loads(gpu.read_text()) if gpu.is_file() else {}
    return {"steps": steps, "seconds_per_step": r.get("time_seconds", 0) / steps if steps else None,  # whole run
            "peak_memory_bytes": g.get("peak_memory_bytes", 0), "epsilon": (r.get("privacy") or {}).get("epsilon"),
            "delta": (r.get("privacy") or {}).get("delta")}


def table(out: Path, title: str, pairs: list[str]) -> str:
    jobs = [(label, _job(Path(d))) for label, _, d in (p.partition("=") for p in pairs)]
    base = {label.rsplit(" ", 1)[0]: j for label, j in jobs if label.endswith("non-private") and j.get("steps")}
    lines = [f"## {title}", "", "| job | steps | s/step | × non-private | peak GPU memory (GiB) | × non-private | ε |",
             "|---|---|---|---|---|---|---|"]
    for label, j in jobs:
        if j.get("skipped") or j.get("missing"):
            lines.append(f"| {label} | {j.get('skipped', 'did not finish (see its log)')} | | | | | |")
            continue
        ref = next((b for k, b in base.items() if label.startswith(k) and not label.endswith("non-private")), None)
        sps, mem = j.get("seconds_per_step"), j.get("peak_memory_bytes") or 0

        def ratio(a, key):
            return f"{a / ref[key]:.2f}×" if ref and a and ref.get(key) else ""

        eps = j.get("epsilon")
        lines.append(f"| {label} | {j.get('steps')} | {sps:.3f} | {ratio(sps, 'seconds_per_step')} | {mem / 2**30:.2f} | "
                     f"{ratio(mem, 'peak_memory_bytes')} | {'' if eps is None else f'{eps:.3f}'} |")
    text = "\n".join(lines) + "\n"
    with open(out, "a") as f:
        f.write("\n" + text)
    print(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--tiny", action="store_true")
    d = sub.add_parser("dpo")
    d.add_argument("recipe")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--model", default=None)
    d.add_argument("--pairs-from", default=None)
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--no-dp", action="store_true")
    d.add_argument("--set", action="append", default=[])
    f = sub.add_parser("sft")
    f.add_argument("run_dir")
    f.add_argument("cli", nargs=argparse.REMAINDER)
    o = sub.add_parser("opacus")
    o.add_argument("--model", required=True)
    o.add_argument("--run-dir", required=True)
    o.add_argument("--batch", type=int, default=4)
    o.add_argument("--seq", type=int, default=512)
    o.add_argument("--steps", type=int, default=5)
    o.add_argument("--lora", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("out")
    t.add_argument("title")
    t.add_argument("jobs", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "make":
        print(f"{make_model(a.shape, a.tokenizer, Path(a.out), a.layers, a.tiny) / 1e6:.1f}M parameters -> {a.out}")
    elif a.cmd == "dpo":
        ov = {k: _parse(v) for k, _, v in (s.partition("=") for s in a.set)}
        if a.steps:
            ov["dpo.max_steps"] = a.steps
        rec = load_trl_recipe(a.recipe, ov)
        pairs = pairs_from_chats(a.pairs_from) if a.pairs_from else None
        print(json.dumps(run_dpo(rec, Path(a.run_dir), a.model, pairs, a.no_dp)))
    elif a.cmd == "sft":
        out = run_sft(Path(a.run_dir), [x for x in a.cli if x != "--"])
        print(json.dumps(out))
        return int(out["exit_code"] or 0)
    elif a.cmd == "opacus":
        print(json.dumps(run_opacus(a.model, Path(a.run_dir), a.batch, a.seq, a.steps, a.lora)))
    else:
        table(Path(a.out), a.title, a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
