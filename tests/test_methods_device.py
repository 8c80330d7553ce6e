"""The methods on the device (issue 26, item 5), tested without a GPU.

- every built-in method declares ``supports_device``, so ``perf.device: cuda`` (CUDA faked) is
  neither refused nor turned into the CPU by ``build_placement``;
- the tensors each method creates follow the model's device: the pure tensor pieces are run on
  ``meta`` (a second device type on a CPU-only machine: anything made on the default device
  would come out on the CPU instead);
- each method runs end to end with ``perf.device: cpu`` given explicitly (the code path CUDA
  takes: nothing branches on the device type), every noise stream asked for on the model's device;
- refusals across processes say why in terms of the mechanism; EW-FT runs on 2 processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpft.config.recipe import load_recipe


def _ov(model_dir, files, **extra) -> dict:
    ov = {"model.name": str(model_dir), "model.max_length": 16, "task.name": "files",
          "task.train_file": str(files["csv"]), "batch.expected_batch_size": 8,
          "batch.max_physical_batch_size": 8, "schedule.steps": 2, "schedule.warmup_steps": 0,
          "eval.every_steps": 2, "checkpoint_every": 2, "privacy.noise_multiplier": 1.0,
          "privacy.delta": 1e-3, "privacy.engine": "bookkeeping", "privacy.reproducible": True,
          "optimizer.lr": 1e-2, "perf.device": "cpu"}
    if extra.get("subspace.source") == "public":  # stage 1 on another (public) file
        ov["subspace.public_task"] = {"name": "files", "train_file": str(files["tsv"])}
    ov.update(extra)
    return ov


PUBLIC = {"subspace.source": "public", "subspace.k": 2, "subspace.steps": 2,
          "trainable.mode": "last_k", "trainable.last_k": 1}
# σ_e = 4 and one evaluation keep the PLD of the report quick; B = 16: 4 steps of 60 rows.
LDP = {"eval.every_steps": 100, "batch.expected_batch_size": 16, "batch.max_physical_batch_size": 16,
       "privacy.enabled": False, "privacy.noise_multiplier": None, "schedule.steps": None, "schedule.epochs": 1,
       "ldp.enabled": True, "ldp.position": "encoder:1", "ldp.noise_multiplier": 4.0, "ldp.target_epsilon": None,
       "ldp.autoencoder.sizes": [16, 4], "ldp.autoencoder.pretrain_epochs": 0}
ADAM_AC = {"optimizer.name": "adamw", "adam_ac.adaptive_clip": True, "adam_ac.count_noise": 1.0, "adam_ac.gamma_nudge": True,
           "adam_ac.ema_decay": 0.9, "adam_ac.bias_correction": True}
RMT = {"denoise.method": "rmt", "denoise.kappa": 1.0, "denoise.min_dim": 2}


def test_builtin_methods_are_placed_on_cuda(tiny_model_dir, sst_like_files, monkeypatch):
    """With CUDA (faked), ``perf.device: cuda`` and ``auto`` both give cuda:0 for every
    built-in method: none is refused and none falls back to the CPU."""
    from dpft.methods.base import active_methods, registered
    from dpft.placement.device import build_placement

    assert all(c.supports_device for c in registered().values() if c.__module__.startswith("dpft."))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for extra in (PUBLIC, LDP, ADAM_AC, RMT):
        for dev in ("cuda", "auto"):
            r = load_recipe(None, _ov(tiny_model_dir, sst_like_files, **extra, **{"perf.device": dev}))
            methods = active_methods(r)
            assert methods
            p = build_placement(r, None, False, [m.name for m in methods if not m.supports_device])
            assert p.device == torch.device("cuda", 0) and p.precision.device_type == "cuda"


class _Stream:
    """A stand-in secret stream that records the device each draw is asked for."""

    def __init__(self, seen):
        self.seen = seen

    def normal(self, shape, dtype=torch.float32, device=None):
        self.seen.append(torch.device(device) if device is not None else None)
        return torch.zeros(shape, dtype=dtype, device=device)


def test_tensors_follow_the_model_device_on_meta():
    """``meta`` plays the accelerator: each piece's outputs and state are on the device of the
    model / inputs it is given, never on the default (CPU) device."""
    from dpft.grads.contrib import Outer
    from dpft.grads.subspace import COORDS, SubspaceEngine, project_contribution
    from dpft.methods.dpsft.method import Snapshots
    from dpft.optim.dp_adam import DPAdam, WeightEMA
    from dpft.privacy.ldp import GaussianLDP, StackedAutoencoder
    from dpft.selection.scoring import random_perturbation
    from dpft.step.clip import make_clip_policy
    from dpft.transforms.subspace import SubspaceBasis

    meta = torch.device("meta")
    lin = nn.Linear(3, 2)
    basis = SubspaceBasis({"weight": torch.randn(4, 2, 3), "bias": torch.randn(4, 2)}, torch.ones(4))
    on = basis.to("float32", device=meta)  # DP-SFT stage 2 puts P beside the model
    assert on.device == meta and all(b.device == meta for b in on.blocks.values())
    assert on.project({"weight": torch.zeros(2, 3, device=meta), "bias": torch.zeros(2, device=meta)}).device == meta
    assert on.gram().device == meta
    assert all(t.device == meta for t in on.unproject(torch.zeros(4, device=meta)).values())
    # the engine puts P beside the model: the summed coordinates (where the noise is drawn) too
    eng = SubspaceEngine(nn.Linear(3, 2).to(meta), lambda f, b: f(**b).sum(-1), make_clip_policy("flat", 1.0), basis)
    assert eng.basis.device == meta and eng.params[COORDS].device == meta
    c = Outer(torch.zeros(5, 1, 2, device=meta), torch.zeros(5, 1, 3, device=meta), torch.Size((2, 3)))
    assert project_contribution(c, on.blocks["weight"], 5).device == meta
    # stage-1 snapshots on the parameters' device
    params = {n: nn.Parameter(p.detach().to(meta)) for n, p in lin.named_parameters()}
    snaps = Snapshots([1])
    snaps.start(params)
    assert all(t.device == meta for t in list(snaps.snapshots.values()) + list(snaps.theta0.values()))
    # DP-Adam(-AC): moments and EMA beside the parameters
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt = DPAdam(list(params.values()), lr=0.1, bias_correction=True)
    opt.set_noise_variance(0.1)
    opt.step()
    assert all(opt.state[p]["m"].device == meta and opt.state[p]["v"].device == meta for p in params.values())
    assert all(t.device == meta for t in WeightEMA(params, 0.9).shadow.values())
    # DP-SelFT's random-perturbation baseline (public synthetic data) on the unit's device
    assert all(t.device == meta for t in random_perturbation(params, 0.1, torch.Generator().manual_seed(0)).values())
    # forward LDP: the noise of a release is asked for on the codes' device
    seen: list = []
    layer = GaussianLDP(1.0, 1.0, StackedAutoencoder([3, 2]).to(meta), generator=_Stream(seen))
    z = layer.release(torch.zeros(2, 4, 3, device=meta))
    assert z.device == meta and seen == [meta]


@pytest.mark.parametrize("name,extra", [
    # DP-Adam-AC's optimizer, EMA and private clip count on DP-SFT's k coordinates
    # (no γ nudging: the public stage 1 keeps the recipe's other methods and has no private clip rate)
    ("dpsft+dp_adam_ac", {**PUBLIC, **ADAM_AC, "adam_ac.gamma_nudge": False, "subspace.optimizer_space": "coords"}),
    ("ewft", LDP),
])
def test_methods_run_with_an_explicit_device(name, extra, tiny_model_dir, sst_like_files, tmp_path, monkeypatch):
    """``perf.device: cpu`` given explicitly, through the path CUDA takes: every noise stream
    (gradient, count, forward LDP) is asked for on the model's device and the method's tensors
    are there."""
    from dpft.privacy.randomness import Randomness
    from dpft.run.loop import Trainer

    seen: list = []
    real = Randomness.stream

    def spy(self, stream, *parts, device=None):
        seen.append((stream, device))
        return real(self, stream, *parts, device=device)

    monkeypatch.setattr(Randomness, "stream", spy)
    t = Trainer(load_recipe(None, _ov(tiny_model_dir, sst_like_files, **extra)), tmp_path / "r", progress=False)
    dev = t.device
    assert dev == torch.device("cpu") and all(p.device == dev for p in t.model.parameters())
    t.run()
    drawn = [(s, d) for s, d in seen if s in ("noise", "ldp", "ldp_eval")]
    assert drawn and all(d is not None and torch.device(d) == dev for _, d in drawn), drawn
    m = {x.name: x for x in t.methods}
    if name == "ewft":
        layer = m["ewft"].ldp.layer
        assert all(p.device == dev for p in layer.autoencoder.parameters())
    else:
        b = m["dpsft"].basis
        assert b.device == dev and t.dp_step.spec.engine.params["subspace.coords"].device == dev
        assert all(p.device == dev for p in t.params.values())
        assert all(s.device == dev for s in m["dp_adam_ac"].ema.shadow.values())
        assert all(v.device == dev for st in t.optimizer.state.values() if isinstance(st, dict)
                   for v in st.values() if isinstance(v, torch.Tensor))
        assert any(s == "count" for s, _ in seen)  # the private clip-count release


def test_refusals_across_processes_name_the_mechanism(tiny_model_dir, sst_like_files, monkeypatch):
    from dpft.placement import world as ddp
    from dpft.methods.base import active_methods
    from dpft.methods.selft import DDP_REFUSAL, SelFTCfg, run_selft

    two = ddp.World(0, 2)
    pub = active_methods(load_recipe(None, _ov(tiny_model_dir, sst_like_files, **PUBLIC)))
    ddp.check_methods(two, pub)  # DP-SFT's stage 1 runs as a world (issue 38: tests/test_dpsft_stage1_world.py)
    f = {**PUBLIC, "subspace.source": "file", "subspace.file": "basis.safetensors"}
    ddp.check_methods(two, active_methods(load_recipe(None, _ov(tiny_model_dir, sst_like_files, **f))))
    ddp.check_methods(two, active_methods(load_recipe(None, _ov(tiny_model_dir, sst_like_files, **LDP))))
    ddp.check_methods(two, active_methods(load_recipe(None, _ov(tiny_model_dir, sst_like_files, **ADAM_AC, **RMT))))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="histograms over ALL N private examples") as e:
        run_selft(load_recipe(None, _ov(tiny_model_dir, sst_like_files)), SelFTCfg(), "unused", candidates=["a"])
    assert str(e.value) == DDP_REFUSAL


def test_ldp_noise_streams_name_the_rank_only_across_processes():
    from dpft.methods.ewft.method import rank_parts

    class R:
        rank, world_size = 1, 2

    class One:
        rank, world_size = 0, 1

    assert rank_parts(R()) == ("rank", 1) and rank_parts(One()) == ()


@pytest.mark.slow
def test_ewft_on_two_processes(tiny_model_dir, tmp_path):
    """EW-FT under DDP (gloo, 2 forked ranks): one ledger event per logical step, written by
    rank 0 alone; the ranks end with the same weights (the same noisy-batch gradients reduced)."""
    import test_ddp

    import pandas as pd

    csv = tmp_path / "d.csv"
    words = ["good", "bad", "great", "awful"]
    pd.DataFrame([{"text": f"a {words[i % 4]} film {i}", "label": i % 2} for i in range(32)]).to_csv(csv, index=False)
    ov = {**_ov(tiny_model_dir, {"csv": csv}, **LDP), "batch.expected_batch_size": 8,
          "batch.max_physical_batch_size": 4, "model.dropout": 0.0}
    failure, logs = test_ddp.launch_worker(tmp_path / "two", ov)
    assert failure is None, (failure, logs)
    steps = 4  # E = 1, ⌈32 / 8⌉
    assert [lg["ledger_steps"] for lg in logs] == [steps, steps]
    assert logs[0]["digest"] == logs[1]["digest"]
    assert not test_ddp.files_under(tmp_path / "two" / "rank1")  # rank 0 alone writes
    assert (tmp_path / "two" / "rank0" / "run" / "ledger.json").is_file()


def test_audit_device_checks_pass_and_catch_the_planted_bug():
    from dpft.audit import planted, suite
    from dpft.audit.checks_device import device_checks

    assert all(c.passed for c in device_checks()), [c.row() for c in device_checks()]
    bad = device_checks("shared_rank_ldp_noise")
    assert [c.passed for c in bad] == [False, True] and "SAME noise" in bad[0].message
    assert "shared_rank_ldp_noise" in planted.ALL
    assert ("dpft.audit.checks_device", "device_checks", ("shared_rank_ldp_noise", "ewft_fsdp_shared_stream")) in \
        suite.OPTIONAL_CHECKS
