"""Smoke tests of ``benchmarks/step_speed.py`` (issue 16, item 5): the causal-LM case builder and
one interleaved measurement on toy widths (preset ``tiny``), seconds in all. The speed goals
themselves live in ``benchmarks/results/*.md``, not here. The Opacus columns are exercised only
when opacus is installed (``pip install -e '.[bench]'``; CI installs ``.[test]``)."""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_speed", ROOT / "benchmarks" / "step_speed.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["step_speed"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("step_speed", None)


def _has_opacus() -> bool:
    return importlib.util.find_spec("opacus") is not None


def test_presets_scale_shapes(bench):
    assert bench.PRESETS["gpu"].shape(8, 512) == (8, 512)
    assert bench.PRESETS["gpu"].dtype == "bf16"
    assert bench.PRESETS["cpu"].shape(8, 512) == (1, 64)
    assert bench.PRESETS["cpu"].shape(32, 128) == (4, 16)
    # every LM architecture in both modes it is listed with, at both shapes
    assert len(bench.LM_CASES) == len(bench.LM_MODELS) * len(bench.LM_SHAPES)
    assert "llama-3.2-1b-lora-8x512" in bench.LM_CASES and "gpt2-medium-full-32x128" in bench.LM_CASES


@pytest.mark.parametrize("arch", ["gpt2", "qwen2-0.5b", "llama-3.2-1b"])
@pytest.mark.parametrize("lora", [False, True])
def test_lm_case_builder(bench, arch, lora):
    if lora and arch == "gpt2":
        pytest.skip("GPT-2 cases are full fine-tuning only (LoRA targets are the q/k/v/o projections)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, loss_fn, vocab, kind = bench.build_model(f"lm:{arch}", lora, preset=bench.PRESETS["tiny"])
    assert kind == "lm" and vocab == 256 and model.training
    inner = model.get_base_model() if lora else model
    assert inner.get_output_embeddings().weight is not inner.get_input_embeddings().weight  # untied
    if arch != "gpt2":
        norms = [m for m in inner.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if lora:
        assert names and all("lora_" in n for n in names)
        assert sum(1 for n in names if "lora_A" in n) == len(bench.LORA_TARGETS)  # one block
    batch = bench.make_batch(2, 8, vocab, kind, torch.device("cpu"))
    losses = loss_fn(lambda **kw: model(**kw), batch)
    assert losses.shape == (2,) and bool(torch.isfinite(losses).all())


def test_paired_ratio_is_the_median_of_per_round_ratios(bench):
    assert bench.paired_ratio([2.0, 3.0, 100.0], [1.0, 1.0, 1.0]) == 3.0
    assert bench.paired_ratio([2.0, 4.0, 9.0], [1.0, 4.0, 3.0]) == 2.0


def test_one_measurement_writes_the_table(bench, tmp_path):
    methods = ["nonprivate", "dpft-bk"] + (["opacus-hooks", "opacus-ghost"] if _has_opacus() else [])
    out = tmp_path / "speed.md"
    results = bench.main(["--preset", "tiny", "--device", "cpu", "--cases", "llama-3.2-1b-lora-32x128",
                          "--methods", *methods, "--repeats", "2", "--out", str(out)])
    (r,) = results
    assert set(r["times"]) == set(methods), r["notes"]
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in r["times"].values())
    assert all(r["peaks"][m] >= 0 for m in methods)
    assert math.isfinite(r["x_np_time"]) and r["x_np_time"] > 0
    assert math.isfinite(r["x_np_mem"]) and r["x_np_mem"] > 0
    if _has_opacus():
        assert r["vs_ghost"] > 0 and r["vs_hooks"] > 0
    text = out.read_text()
    assert "## Summary (dpft-bk)" in text and "| llama-3.2-1b-lora-32x128 | 1×8 | fp32 |" in text
    assert "preset `tiny`" in text and "untied" in text


# ----------------------------------------------------------------------------- GPU suite (issue 26)


def test_step_speed_time_budget_lists_the_cases_not_run(bench, tmp_path):
    out = tmp_path / "s.md"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--cases", "gpt2-full-8x512", "--time-budget", "-1",
                       "--out", str(out)]) == []
    assert "not run (time budget -1 s spent): gpt2-full-8x512" in out.read_text()


def test_gpu_suite_dry_run_prints_every_stage():
    """``bash benchmarks/gpu_suite.sh --dry-run`` runs nothing and prints the plan: step speed
    against Opacus ghost clipping, both instruct runs, DDP and (guarded) FSDP2 under torchrun."""
    import subprocess

    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run"], capture_output=True,
                       text=True, timeout=60, env={**env, "RUNS": "/nonexistent/runs"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "step_speed.py --preset gpu" in out and "--methods nonprivate dpft-bk opacus-ghost" in out
    assert "--out benchmarks/results/step_speed_cuda.md" in out
    assert "e2e-instruct-stories260k.yaml --device cuda --dtype bf16" in out
    assert "gpu_make_model.py" in out and "model.name=/nonexistent/runs/qwen2-0.5b-random" in out
    assert out.count("torch.distributed.run --standalone") == 3 and "perf.sharding=fsdp" in out
    assert "dry run: nothing was run" in out and not (ROOT / "nonexistent").exists()


def test_gpu_suite_report_table_and_ledger_check(tmp_path):
    """The suite's summary reads report.json / ledger.json / gpu_rank*.json of each run."""
    import json
    import subprocess

    def run_dir(name, world, eps, ledger):
        d = tmp_path / name
        d.mkdir()
        (d / "report.json").write_text(json.dumps({
            "privacy": {"epsilon": eps, "delta": 1e-5}, "metrics": {"dev_bleu": 12.345, "dev_rouge_l": 30.0},
            "dp": {"steps": 4}, "time_seconds": 2.0, "model": {"total_parameters": 494e6}}))
        (d / "ledger.json").write_text(json.dumps({"entries": ledger}))
        for r in range(world):
            (d / f"gpu_rank{r}.json").write_text(json.dumps({"world_size": world, "peak_memory_bytes": 2**30 * (r + 1),
                                                             "exit_code": 0}))
        return d

    ev = [{"phase": "train", "count": 4, "event": {"sigma": 1.0}}]
    one, two = run_dir("one", 1, 3.0, ev), run_dir("two", 2, 3.0, ev)
    bad = run_dir("bad", 2, 3.0, [{"phase": "train", "count": 3, "event": {"sigma": 1.0}}])
    (tmp_path / "crashed").mkdir()
    out = tmp_path / "s.md"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "report", "--ledgers", "T", str(out),
                        f"a={one}", f"b={two}", f"c={bad}", f"d={tmp_path / 'crashed'}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| a | 1 | 494.0M | 4 | 0.500 | 3.000 (δ=1e-05) | 12.35 | 30.00 | 1.00 |" in text
    assert "| b | 2 |" in text and "1.00/2.00 |" in text
    assert "| d | did not finish (exit no run" in text
    assert "a, b identical; DIFFERENT: c." in text
