#!/usr/bin/env python
"""Helpers of ``benchmarks/gpu_suite.sh`` (not run alone):

``run RUN_DIR -- <dpft CLI arguments>``
    runs ``dpft <arguments>`` in this process (``torchrun ... benchmarks/gpu_suite.py run``
    under DDP/FSDP) and then writes ``RUN_DIR/gpu_rank<r>.json``: the peak CUDA memory
    allocated by this process (``torch.cuda.max_memory_allocated``; 0 on CPU), its wall time,
    the CLI's exit status, world size and device name.

``report [--ledgers] TITLE OUT.md LABEL=RUN_DIR ...``
    appends to OUT.md one Markdown table of the runs from their ``report.json`` (ε and δ from
    the run's ledger, BLEU / ROUGE-L of the dev generations, steps, seconds per step) and the
    ``gpu_rank*.json`` files (peak memory per rank); a run that did not finish is a row that
    says so. ``--ledgers``: a line comparing the runs' ``ledger.json`` (events and counts), which
    must be identical across 1 process, DDP and FSDP for the same recipe.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _run(argv: list[str]) -> int:
    run_dir = Path(argv[0])
    args = argv[argv.index("--") + 1:] if "--" in argv else argv[1:]
    import torch

    from dpft.cli import commands as cli

    t0 = time.time()
    code = 0
    sys.argv = ["dpft", *args]
    try:
        cli.main()
    except SystemExit as exc:  # typer exits; keep the status
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    info = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "exit_code": code,
            "wall_seconds": round(time.time() - t0, 1),
            "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else 0,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"gpu_rank{rank}.json").write_text(json.dumps(info))
    return code


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _row(label: str, d: Path) -> str:
    info = [json.loads(p.read_text()) for p in sorted(d.glob("gpu_rank*.json"))]
    rep_path = d / "report.json"
    if not rep_path.is_file():
        code = ",".join(str(i.get("exit_code")) for i in info) or "no run"
        return f"| {label} | did not finish (exit {code}; see its log) | | | | | | | |"
    rep = json.loads(rep_path.read_text())
    p, m, dp = rep.get("privacy", {}), rep.get("metrics", {}), rep.get("dp", {})
    eps = p.get("epsilon")
    eps_s = "NOT CERTIFIED" if eps is None else f"{eps:.3f} (δ={p.get('delta')})"
    steps = dp.get("steps") or 0
    sps = f"{rep.get('time_seconds', 0) / steps:.3f}" if steps else "n/a"
    mem = "/".join(_gib(i["peak_memory_bytes"]) for i in info) or "n/a"
    world = max((i.get("world_size", 1) for i in info), default=1)
    params = rep.get("model", {}).get("total_parameters")
    par = f"{params / 1e6:.1f}M" if params else "n/a"

    def fmt(k):
        return f"{m[k]:.2f}" if isinstance(m.get(k), (int, float)) else "n/a"

    return f"| {label} | {world} | {par} | {steps} | {sps} | {eps_s} | {fmt('dev_bleu')} | {fmt('dev_rouge_l')} | {mem} |"


def _ledger(d: Path):
    f = d / "ledger.json"
    if not f.is_file():
        return None
    led = json.loads(f.read_text())
    return [(e.get("phase"), e.get("count"), json.dumps(e.get("event"), sort_keys=True)) for e in led.get("entries", [])]


def _report(argv: list[str]) -> int:
    compare = "--ledgers" in argv
    argv = [a for a in argv if a != "--ledgers"]
    title, out, pairs = argv[0], Path(argv[1]), argv[2:]
    lines = [f"## {title}", "",
             "| run | processes | parameters | steps | s/step | ε | BLEU | ROUGE-L | peak GPU memory per rank (GiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    ledgers = {}
    for pair in pairs:
        label, _, d = pair.partition("=")
        lines.append(_row(label, Path(d)))
        led = _ledger(Path(d))
        if led is not None:
            ledgers[label] = led
    if compare and len(ledgers) > 1:
        ref_label, ref = next(iter(ledgers.items()))
        same = [k for k, v in ledgers.items() if v == ref]
        diff = [k for k in ledgers if k not in same]
        lines += ["", f"Ledger equality (events and counts, ledger.json): {', '.join(same)} identical"
                  + (f"; DIFFERENT: {', '.join(diff)}" if diff else "") + "."]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write("\n" + text)
    print(text)
    return 0


def main() -> None:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "run":
        sys.exit(_run(rest))
    if cmd == "report":
        sys.exit(_report(rest))
    raise SystemExit(f"unknown command {cmd!r}: run | report")


if __name__ == "__main__":
    main()
