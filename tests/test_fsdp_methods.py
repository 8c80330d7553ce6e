"""Method plug-ins under FSDP2 (issue 38; dpft/placement/fsdp_methods.py): RMT denoising (the noisy gradient's
row shards gathered per matrix, denoised identically on every rank, this rank's rows kept) and
DP-Adam-AC (adaptive clipping from the world's all-reduced counts, its σ_Δ mechanism sharded,
DPAdam with AdamBC and γ over the shards, the EMA gathered for rank 0's save) through ``dpft
train``: 2 CPU processes (gloo) equal 1 process (ledger equal, trainable weights within float
tolerance, the same released statistics). Fast: each way in's refusal names the method and its
reason; the whole-tensor wrapper on simulated ranks equals the transform on the whole tensor."""

from __future__ import annotations

import json

import pytest
import torch

from dpft.config.recipe import load_recipe
from dpft.placement.fsdp import FSDPError, check_recipe
from dpft.placement.fsdp_methods import WholeTensors, method_refusals, refusal_message
from dpft.methods.base import active_methods
from dpft.run.loop import Trainer

from test_ddp import launch_worker  # noqa: E402 (tests/ helpers)
from test_fsdp import fsdp_recipe, lm_dirs  # noqa: F401 (module fixture)
from dpft.placement.fsdp_checkpoint import read_trainable

RMT = {"denoise.method": "rmt", "denoise.kappa": 1.0, "denoise.min_dim": 1}
ADAM_AC = {"adam_ac.adaptive_clip": True, "adam_ac.bias_correction": True, "adam_ac.gamma_nudge": True,
           "adam_ac.ema_decay": 0.5, "adam_ac.count_noise": 4.0, "optimizer.name": "adamw", "optimizer.lr": 0.01,
           "privacy.clipping.max_norm": 0.05}
#: DP-SFT's Full-DP baseline (no subspace; the paper's noise placement: a σB Gaussian on the whole gradient).
DPSFT_NONE = {"subspace.source": "none", "subspace.paper_noise_placement": True}
CASES = {"rmt": RMT, "dp_adam_ac": ADAM_AC, "dpsft_none": DPSFT_NONE}
#: Weight tolerance per case. DP-AdamBC divides by (v̂ − Φ̂)^½ floored at bc_floor, which amplifies the float
#: rounding of the reduce-scatter's other summation order (measured: 1 element of 1,024 off by 2.8e-5 after 3
#: AdamW steps of lr 0.01, i.e. 0.3 % of one step; the rest within 1e-6).
ATOL = {"rmt": 1e-6, "dp_adam_ac": 1e-4, "dpsft_none": 1e-6}


def _weights_close(a, b, atol: float) -> None:
    rank1 = b.parent.parent / "rank1" / "run"  # a 2-process run: rank 1's shards under its own folder
    pa, pb = read_trainable(a), read_trainable(b, *([rank1] if rank1.is_dir() else []))
    assert pa.keys() == pb.keys() and pa
    for n in pa:
        torch.testing.assert_close(pb[n], pa[n], rtol=1e-5, atol=atol)


def _metrics(run) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k.startswith(("rmt/", "clip_norm", "clip_rate_private", "gamma", "dev_loss"))}
            for r in rows if "step" in r]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_method_two_processes_equal_one(lm_dirs, tmp_path, case):  # noqa: F811
    """``dpft train`` with the method, ``perf.sharding: fsdp``: 2 processes = 1 process (ledger, weights,
    the method's released statistics; DP-Adam-AC's EMA saved by rank 0 = the 1-process EMA)."""
    ov = fsdp_recipe(lm_dirs, "gpt2", **CASES[case])
    one = tmp_path / "one"
    Trainer(load_recipe(None, ov), one, progress=False).run()
    failure, _ = launch_worker(tmp_path / "two", ov)
    assert failure is None, failure
    two = tmp_path / "two" / "rank0" / "run"
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    _weights_close(one, two, ATOL[case])
    ma, mb = _metrics(one), _metrics(two)
    assert ma and len(ma) == len(mb)
    for a, b in zip(ma, mb):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    if case == "rmt":
        assert sum(r.get("rmt/touched", 0) for r in ma) > 0  # the denoiser changed some matrix
    elif case == "dp_adam_ac":
        assert {"clip_norm", "gamma", "dev_loss", "dev_loss_raw"} <= set(ma[-1])  # dev: the EMA and the raw weights
        from safetensors.torch import load_file

        ea, eb = (load_file(next((d / "model_ema").glob("*.safetensors"))) for d in (one, two))
        assert ea.keys() == eb.keys() and ea
        for k in ea:
            torch.testing.assert_close(eb[k], ea[k], rtol=1e-5, atol=ATOL[case])
        ra = load_file(next((one / "model").glob("*.safetensors")))
        assert any(not torch.equal(ra[k], ea[k]) for k in ea)  # the EMA is not the raw model


# -- refusals: each way in names the method and its reason ------------------------------------------
def _recipe(lm_dirs, **extra):  # noqa: F811
    return load_recipe(None, fsdp_recipe(lm_dirs, "gpt2", **extra))


REFUSED = {
    "rmt": ({**RMT, "denoise.diagnostics": True}, "clean .un-noised. clipped sum"),
    "dp_adam_ac": ({"adam_ac.reproduce_paper": True}, "raw per-example norms"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_dpft_train_fsdp_refuses_with_the_methods_reason(lm_dirs, name):  # noqa: F811
    extra, why = REFUSED[name]
    r = _recipe(lm_dirs, **extra)
    methods = active_methods(r)
    assert [m.name for m in methods] == [name]
    with pytest.raises(FSDPError, match=f"method '{name}': .*{why}"):
        check_recipe(r, 2, methods, True, False)


@pytest.mark.parametrize("extra", [RMT, ADAM_AC, DPSFT_NONE, {"subspace.source": "private"}],
                         ids=["rmt", "dp_adam_ac", "dpsft_none", "dpsft_stage1"])  # DP-SFT stage 1: issue 38
def test_dpft_train_fsdp_accepts_rmt_and_adam_ac(lm_dirs, extra):  # noqa: F811
    r = _recipe(lm_dirs, **extra)
    methods = active_methods(r)
    assert methods and not method_refusals(methods)
    check_recipe(r, 2, methods, True, False)  # no refusal


def test_python_ways_in_refuse_with_the_methods_reason():
    """DPTrainer's refusal (specs validated first) accepts RMT, adaptive clipping and DP-SFT on a given basis;
    the Python ways in refuse RMT's diagnostics and the paper's rule earlier (python_refusal)."""
    from dpft.errors import PlanError
    from dpft.integrations.hf.fsdp import refuse_sharded_methods
    from dpft.methods.python import python_methods

    refuse_sharded_methods("DPTrainer", [{"name": "rmt", "method": "rmt"}])  # runs sharded
    refuse_sharded_methods("DPTrainer", python_methods([{"name": "dp_adam_ac", "adaptive_clip": True}], "DPTrainer"))
    dpsft = {"name": "dpsft", "source": "file", "file": "/nonexistent/basis.safetensors", "k": 4}
    refuse_sharded_methods("DPTrainer", [{"name": "dpsft", "source": "none", "paper_noise_placement": True}])  # runs
    refuse_sharded_methods("DPTrainer", [{"name": "rmt", "method": "rmt"}, dpsft])  # runs: tests/test_fsdp_dpsft.py
    assert refusal_message("make_private", python_methods([dpsft], "make_private")) is None
    with pytest.raises(PlanError, match="diagnostics"):
        refuse_sharded_methods("DPTrainer", [{"name": "rmt", "method": "rmt", "diagnostics": True}])


# -- the whole-tensor wrapper on simulated ranks ------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
def test_whole_tensors_on_simulated_ranks_equal_the_whole_transform(k):
    """RMT's transform (randomized top-2 SVD: the seeded sketch) on K simulated ranks' row shards,
    gathered by the wrapper, equals the transform on the whole gradient; the planted bug (each rank
    denoising its own rows) does not."""
    from types import SimpleNamespace

    from dpft.placement.world import World
    from dpft.step.postprocess import rmt_transform

    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(25, 1, generator=g), torch.randn(1, 20, generator=g)  # min dim 20 > rank + oversample
    grads = {"w": 3 * u @ v / 10 + 0.1 * torch.randn(25, 20, generator=g), "b": torch.randn(5, generator=g)}
    cfg = SimpleNamespace(kappa=1.0, rank=2, min_dim=1)
    model = torch.nn.Linear(20, 25)
    model.weight.data = grads["w"].clone()
    names = {"weight": "w"}

    def make():
        tf = rmt_transform(model, ["weight"], cfg)
        return lambda gr, ctx: {names.get(n, n): t for n, t in tf({"weight" if n == "w" else n: t
                                                                   for n, t in gr.items()}, ctx).items()}

    ctx = {"noise_std": 0.1, "step": 0, "q": 0.1}
    whole = make()(dict(grads), ctx)
    assert not torch.equal(whole["w"], grads["w"])  # denoised
    rows = list(torch.tensor_split(grads["w"], [min(r * -(-25 // k), 25) for r in range(1, k)]))
    for local_only in (False, True):  # True: the planted bug, each rank denoising its own rows
        parts = []
        for r in range(k):
            tf = make()
            tf.whole_tensors = ["w"]
            w = tf if local_only else WholeTensors(tf, {"w": grads["w"], "b": grads["b"]}, World(r, k),
                                                   gather=lambda n, x: torch.cat(rows), check_agree=False)
            out = w({"w": rows[r], "b": grads["b"]}, ctx)
            torch.testing.assert_close(out["b"], grads["b"])
            parts.append(out["w"])
        same = torch.allclose(torch.cat(parts), whole["w"], rtol=1e-5, atol=1e-6)
        assert same is (not local_only)


def test_fsdp_methods_audit_checks_pass_and_catch_the_planted_bug():
    """audit/checks_fsdp_methods.py (registered in the suite): the sharded RMT update equals the
    1-process one, and so does the sharded DP-SFT step (tests/test_fsdp_dpsft.py); each planted bug
    (``fsdp_rmt_local_rows``: each rank denoising its own rows; DP-SFT's) is caught."""
    from dpft.audit import planted, suite
    from dpft.audit.checks_fsdp_methods import PLANTED, fsdp_methods_checks

    assert ("dpft.audit.checks_fsdp_methods", "fsdp_methods_checks", PLANTED) in suite.OPTIONAL_CHECKS
    assert set(PLANTED) <= set(planted.ALL)
    honest = fsdp_methods_checks()
    assert len(honest) == 9 and all(c.passed for c in honest), [c.row() for c in honest if not c.passed]  # RMT 2, DP-SFT 2 + coords 3 + stage 1 2
    for name in PLANTED:
        assert not all(c.passed for c in fsdp_methods_checks(name)), name
    assert all(not c.passed for c in fsdp_methods_checks("fsdp_rmt_local_rows")[:2])


def test_a_plugin_that_declares_nothing_is_refused_with_the_fix():
    from pydantic import BaseModel

    from dpft.methods.base import Method

    class Cfg(BaseModel):
        pass

    class Mine(Method):
        name = "mine"
        config = Cfg

    msg = refusal_message("make_private", [Mine(Cfg(), None)])
    assert msg.startswith("make_private: with an FSDP2-sharded model, method 'mine': not verified")
    assert "supports_fsdp = True" in msg
    Mine.supports_fsdp = True
    assert refusal_message("make_private", [Mine(Cfg(), None)]) is None
