"""Non-private runs under FSDP2 (``dpft train --no-dp`` with ``perf.sharding: fsdp``, dpft/placement/fsdp_plain.py;
issue 38 item 3): plain FSDP2 training — autograd and FSDP2's own reduce-scatter of the gradient, × K for
the world's sum, divided by the expected batch size as one process does — the baseline a DP run is
compared with at the same sharding. 2 CPU processes (gloo; tests/ddp_worker.py) against 1 process of the
same reproducible recipe: no ledger event, the same logical batches (disjoint covering shares), a rank
short of micro-batches runs a placeholder that adds zeros, the trainable weights within float tolerance.
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from safetensors.torch import load_file

from dpft.config.recipe import load_recipe
from dpft.placement.fsdp_checkpoint import read_trainable
from dpft.run.loop import Trainer

from test_ddp import launch_worker  # noqa: E402 (tests/ helpers)
from test_fsdp import fsdp_recipe, lm_dirs  # noqa: F401 (the tiny GPT-2 / Llama fixture)

multiprocessing.set_forkserver_preload(["ddp_worker", "dpft.run.loop", "dpft.outputs.report", "matplotlib.pyplot",
                                        "dpft.placement.fsdp", "peft", "transformers.models.gpt2.modeling_gpt2",
                                        "transformers.models.llama.modeling_llama"])

CASES = {"gpt2-tied-full": ("gpt2", {}),
         "llama-lora": ("llama", {"trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj"]})}


@pytest.mark.slow  # about 40 s per case on 2 shared cores
@pytest.mark.parametrize("case", list(CASES))
def test_non_private_fsdp_two_processes_equal_one(lm_dirs, tmp_path, case):  # noqa: F811
    kind, extra = CASES[case]
    ov = fsdp_recipe(lm_dirs, kind, **{"privacy.enabled": False, "optimizer.lr": 0.5, **extra})
    one = tmp_path / "one"
    trainer = Trainer(load_recipe(None, ov), one, progress=False)
    assert type(trainer.dp_step).__name__ == "PlainFSDPStep" and trainer.mechanism is None
    trainer.run()
    failure, logs = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    for run in (one, two):  # nothing released under a privacy claim: no ledger event
        ledger = run / "ledger.json"
        assert not ledger.exists() or not json.loads(ledger.read_text()).get("entries")
    r0, r1 = logs
    for t in ("0", "1", "2"):
        assert r0["batches"][t] == r1["batches"][t]
        assert not set(r0["shares"][t]) & set(r1["shares"][t])
        assert sorted(r0["shares"][t] + r1["shares"][t]) == r0["batches"][t]
    # at some step one rank ran a placeholder micro-batch (it must add zeros)
    assert any(-(-len(r0["shares"][t]) // 2) != -(-len(r1["shares"][t]) // 2) for t in ("0", "1", "2"))
    assert r0["digest"] == r1["digest"]  # the gathered weights agree on both ranks
    pa, pb = read_trainable(one), read_trainable(two, tmp_path / "two" / "rank1" / "run")
    assert pa.keys() == pb.keys() and pa
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=1e-6)
    # one process without fsdp (DPStep + NonPrivateEngine, the DDP path's --no-dp step): the same weights
    plain = tmp_path / "plain"
    Trainer(load_recipe(None, {**ov, "perf.sharding": "ddp"}), plain, progress=False).run()
    pc = read_trainable(plain)
    assert pc.keys() == pa.keys()
    for n in pa:
        torch.testing.assert_close(pc[n], pa[n], rtol=1e-5, atol=1e-6)
    base = load_file(str(lm_dirs[kind] / "model.safetensors"))  # the steps did update the weights
    assert [n for n in pa if (n in base and not torch.equal(pa[n], base[n])) or ("lora_B" in n and pa[n].any())]


def test_non_private_fsdp_is_no_longer_refused(lm_dirs):  # noqa: F811
    """check_recipe lets a non-private run through (another engine is irrelevant there: no clipping)."""
    from dpft.placement.fsdp import check_recipe

    r = load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **{"privacy.enabled": False}))
    check_recipe(r, 2, [], False, False)


def test_plain_step_refuses_a_private_spec():
    from types import SimpleNamespace

    from dpft.placement import world as ddp
    from dpft.placement.fsdp import FSDPError
    from dpft.placement.fsdp_plain import PlainFSDPStep

    with pytest.raises(FSDPError, match="non-private step"):
        PlainFSDPStep(SimpleNamespace(mechanism=object()), None, 4, ddp.World(0, 1), lambda: {})
