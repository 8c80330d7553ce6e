"""benchmarks/memory_plan.py (issue 38 item 5): parameter counts from the written configs equal the
models transformers builds from them; the memory formulas meet their stated tolerance against a
measured CPU step of a reduced shape; the accountant's batch is the smallest meeting σ/B; the
committed table is what the script computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_plan as mp  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("shape", list(mp.SHAPES))
def test_parameter_counts_equal_the_models_built_from_the_configs(shape):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**mp.SHAPES[shape]))
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    c = mp.counts(mp.SHAPES[shape])
    assert c["total"] == n
    published = {"llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9}[shape]
    assert abs(n - published) / published < 0.005


def test_lora_count_equals_peft():
    from dpft.config.recipe import TrainableCfg
    from dpft.models.load import count_parameters, select_trainable

    shape, _ = mp.CHECK_SHAPES["8B/16 width, 2 blocks, V 8016, T 256"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model = select_trainable(model, TrainableCfg(mode="lora", lora={"r": mp.LORA_R, "target_modules": list(mp.LORA_TARGETS)}))
    assert count_parameters(model)[0] == mp.counts(shape)["lora"]


@pytest.mark.slow  # 15-30 s each on 2 shared cores (profiled CPU step)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_formulas_meet_the_stated_tolerance_on_a_measured_cpu_step(tmp_path, mode):
    name = "8B/16 width, 4 blocks, V 1024, T 512"  # the factors at the backward's end set the peak
    shape, tokens = mp.CHECK_SHAPES[name]
    measured = mp.measure(shape, mode, tmp_path, tokens)
    predicted = mp.predicted_cpu(shape, mode, tokens)
    for k in ("resident", "peak"):
        assert abs(predicted[k] - measured[k]) / measured[k] <= mp.TOLERANCE, (k, predicted, measured)


def test_plan_shards_over_gpus_and_books_the_engines_buffers():
    one, eight = mp.plan("llama-3.1-8b", "full", 1), mp.plan("llama-3.1-8b", "full", 8)
    assert eight.optimizer == pytest.approx(one.optimizer / 8) and eight.params < one.params / 2
    assert eight.activations == one.activations and eight.bookkeeping == one.bookkeeping  # data parallel
    assert mp.plan("llama-3.1-8b", "qlora", 1).params < mp.plan("llama-3.1-8b", "lora", 1).params / 1.9
    assert one.bookkeeping > 0


@pytest.mark.slow  # ~50 s on 2 shared cores: about 15 PLD calibrations
def test_batch_for_is_the_smallest_meeting_the_noise_target():
    from dpft.accounting.calibrate import calibrate_sigma

    n, eps, delta, steps, target = 10_000, 3.0, 1e-5, 50, 5e-3
    b, sigma = mp.batch_for(eps, n, delta, steps, target)
    assert b > 0 and sigma / b <= target
    assert sigma == pytest.approx(calibrate_sigma(eps, delta, b / n, steps))
    smaller = int(b * 0.97)
    assert calibrate_sigma(eps, delta, smaller / n, steps) / smaller > target


def test_committed_table_is_what_the_script_computes():
    text = (ROOT / "benchmarks/results/memory_plan.md").read_text()
    for row in mp.memory_table():
        assert row in text, row
    assert "## Check against measured CPU runs" in text and "within it" in text
