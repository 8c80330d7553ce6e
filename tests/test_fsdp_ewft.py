"""EW-FT / DP-Forward (forward-pass local DP, ``ldp:``) under FSDP2 in ``dpft train`` (issue 38).

What EW-FT trains: with a frozen pre(·) (the default) the recipe is ``privacy.enabled: false`` — the
only mechanism is the noise layer on the forward pass (each example's clipped code + N(0, σ²(2C)²I)),
and post(·), the decoder and the head get *plain* gradients (post-processing of the released codes),
so under FSDP2 the step is the non-private FSDP step (dpft/placement/fsdp_plain.py) on the split model, and the
ledger gets one ``PoissonSampled(q, Gaussian(σ_e))`` event per step from the method (as in one process).
``ldp.train_pre`` (DP-SGD on pre(·) through the noise, one joint event per step) runs its own sharded step
(methods/ewft/fsdp.py): the one-process engine on a plain copy of the model all-gathered once per step, the
clipped sums reduce-scattered, and each rank's slice of the one-process (= DDP) draw of pre(·)'s gradient
noise; one ``PoissonSampled(q, Gaussian(σ_eff))`` event per step.

Which equality is honest. Each rank releases its own share of the logical batch with noise from its
own stream (``ldp``, step, rank): FSDP2 shards the parameters, not the examples, so K FSDP2 ranks draw
exactly what K DDP ranks draw, and K ≠ 1 draw for draw (one process names its stream without a rank).
Hence the slow test checks:

* **FSDP2 on 2 processes = DDP on 2 processes, draw for draw**: the same logical batches and per-rank
  shares, the same ledger (JSON equal) and ε, and the saved model (post(·), decoder, head; frozen
  pre(·) and encoder) within float tolerance (the only difference: FSDP2's reduce-scatter of the
  gradient vs DDP's all-reduce of the summed one, and pre(·) recomputed instead of cached); for
  ``train_pre`` exactly equal (both run the same engine on full tensors, a two-rank sum is the same
  a + b in either collective, and the gradient noise is the same draw: measured 0.0 on every tensor);
* **= 1 process in its ledger** (the distributional claim: one event per step, the same q and σ's,
  the same ε), not in its weights (other noise draws).

A third slow test: ``train_pre`` under FSDP2 × 2 interrupted and resumed from its per-rank checkpoint = the
uninterrupted run, bit for bit.

Fast tests: no ``ldp:`` config refused (frozen and trained pre(·) accepted), ``train_pre`` under
``perf.sharding: fsdp`` in one process = the unsharded run exactly, the sharded step picked from the engine,
the pre(·) cache rule, the test-file evaluation of the materialised copy, and the audit's white-box
checks with their planted bugs (audit/checks_fsdp_ewft.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dpft.config.recipe import load_recipe
from dpft.placement.fsdp import check_recipe
from dpft.methods.base import active_methods
from dpft.methods.ewft.method import ForwardLDP
from dpft.methods.ewft.parts import fsdp_world, pre_cache_allowed, rank_parts
from dpft.run.loop import Trainer

from test_ddp import launch_worker  # noqa: E402 (tests/ helpers)


def ldp_overrides(model_dir, files, **extra) -> dict:
    """A small EW-FT recipe (tiny BERT, 60 rows, B = 20: 3 steps per epoch, 2 epochs, micro-batches of 5 so
    the ranks' micro-batch counts differ and FSDP's placeholders run), a fixed σ (no calibration per rank)."""
    ov = {
        "model.name": str(model_dir), "model.max_length": 16,
        "task.name": "files", "task.train_file": str(files["csv"]),
        "batch.expected_batch_size": 20, "batch.max_physical_batch_size": 5,
        "schedule.epochs": 2, "eval.every_steps": 100, "checkpoint_every": 100,
        "privacy.enabled": False, "optimizer.lr": 0.05, "seed": 3,
        "ldp.enabled": True, "ldp.position": "encoder:1", "ldp.target_epsilon": None, "ldp.noise_multiplier": 0.7,
        "ldp.delta": 1e-3, "ldp.autoencoder.sizes": [16, 4], "ldp.autoencoder.pretrain_epochs": 0,
        "privacy.reproducible": True,  # the run's secret key from the seed: two launches draw alike
    }
    ov.update(extra)
    return ov


def _model_files(run) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "model").glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


#: The slow cases: the certified frozen pre(·) (with a test file: rank 0 evaluates the materialised copy under
#: FSDP2), and the NOT CERTIFIED ablation of DP-Forward's flaw (i) (pre(·) trained through the noise by plain
#: autograd: FSDP2's own reduce-scatter of pre(·)'s gradients too).
#: ``train_pre``: pre(·) trained by DP-SGD through the noise (methods/ewft/fsdp.py: the engine on a plain copy
#: gathered each step, clipped sums reduce-scattered, DDP's gradient noise sliced per shard).
CASES = {"frozen": {}, "repro_flaw_i": {"ldp.reproduce_flaws": ["i"]},
         "train_pre": {"ldp.train_pre.enabled": True, "ldp.train_pre.max_grad_norm": 0.5}}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_two_processes_equal_ddp_two_processes(tiny_model_dir, sst_like_files, tmp_path, case):
    """FSDP2 × 2 = DDP × 2 draw for draw (batches, shares, micro-batch counts, ledger, report's privacy section,
    test-file metrics, saved weights within float tolerance); ``frozen``: the ledger and ε also equal one
    process's (module docstring: why not the weights)."""
    base = ldp_overrides(tiny_model_dir, sst_like_files, **{"task.test_file": str(sst_like_files["csv"]),
                                                             **CASES[case]})
    runs, logs = {}, {}
    for sharding in ("ddp", "fsdp"):
        failure, logs[sharding] = launch_worker(tmp_path / sharding, {**base, "perf.sharding": sharding})
        assert failure is None, (failure, logs[sharding])
        runs[sharding] = tmp_path / sharding / "rank0" / "run"
    if case in ("frozen", "train_pre"):
        runs["one"] = tmp_path / "one"
        Trainer(load_recipe(None, base), runs["one"], progress=False).run()

    ledgers = {k: json.loads((d / "ledger.json").read_text()) for k, d in runs.items()}
    assert all(v == ledgers["ddp"] for v in ledgers.values())
    entries = ledgers["fsdp"]["entries"]
    phase = "ldp-forward+dp-sgd" if case == "train_pre" else "ldp-forward"  # train_pre: one joint event per step
    assert entries and all(e["phase"] == phase for e in entries) and sum(e["count"] for e in entries) == 6
    reps = {k: json.loads((d / "report.json").read_text()) for k, d in runs.items()}
    assert all(r["privacy"] == reps["ddp"]["privacy"] for r in reps.values())  # ε, local, linked-rows sections
    assert (reps["fsdp"]["privacy"]["epsilon"] is None) is (case == "repro_flaw_i")  # the ablation: NOT CERTIFIED
    for r in range(2):  # the same logical batches, the same share and micro-batches on each rank
        for key in ("batches", "shares", "micro"):
            assert logs["fsdp"][r][key] == logs["ddp"][r][key], key
    micro = [logs["fsdp"][r]["micro"] for r in range(2)]
    assert any(len(micro[0][t]) != len(micro[1][t]) for t in micro[0]), \
        "no step had uneven micro-batch counts: FSDP's placeholder path (train_pre: one gather per step) untested"
    # rank 0 evaluated the test file on the live split (DDP) and on the materialised copy (FSDP2): the same
    # noise streams (ldp_eval), the trained σ, inference noise on and off
    td, tf = reps["ddp"]["test"], reps["fsdp"]["test"]
    assert {"test_loss_clean_inference", "test_loss_noisy_inference"} <= set(tf)
    for k in ("test_loss_clean_inference", "test_loss_noisy_inference", "test_loss"):
        assert tf[k] == pytest.approx(td[k], rel=1e-4), k

    wd, wf = _model_files(runs["ddp"]), _model_files(runs["fsdp"])
    assert wd.keys() == wf.keys() and any(k.startswith("autoencoder") for k in wd)
    for k in wd:
        # An attention key bias has gradient exactly 0 (softmax is invariant to the shift q·b_k it adds to
        # every score of a query): what it holds after training is float round-off alone (measured: |b_k| ≤
        # 2.4e-4 in every run, 1-process included), which the two summation orders make differently. Every
        # other tensor: measured ≤ 1.1e-6 apart.
        atol = 1e-3 if k.endswith("attention.self.key.bias") else 1e-5
        if case == "train_pre":  # the same engine on full tensors, a + b, the same noise draw: bit for bit
            atol = 0.0
        torch.testing.assert_close(wf[k], wd[k], rtol=0.0 if case == "train_pre" else 1e-5, atol=atol, msg=k)
    init = load_file(next(tiny_model_dir.glob("*.safetensors")))
    trained = "classifier.weight" if case == "frozen" else "bert.encoder.layer.0.output.dense.weight"
    assert not torch.allclose(wf[f"model.safetensors:{trained}"], init[trained])  # it trained (pre(·) too: flaw i)
    if case in ("frozen", "train_pre"):
        # other draws than one process: the weights differ (the claim against 1 process is the ledger's)
        w1 = _model_files(runs["one"])
        assert any(not torch.allclose(wf[k], w1[k], atol=1e-6) for k in wf if "classifier" in k)
    if case == "frozen":
        pre = "bert.encoder.layer.0.output.dense.weight"  # frozen pre(·): untouched
        assert torch.equal(wf[f"model.safetensors:{pre}"], init[pre])


@pytest.mark.slow
def test_fsdp_train_pre_resumes_from_its_sharded_checkpoint(tiny_model_dir, sst_like_files, tmp_path):
    """``ldp.train_pre`` under FSDP2 × 2: a SIGINT reaching rank 1 during step index 2 stops the world with the
    per-rank checkpoint at step 3; ``--resume`` on 2 processes runs steps 3–5 and ends where the uninterrupted
    FSDP2 × 2 run ends (ledger equal, weights bit for bit: the step's noise streams are named by step, the
    plain copy is gathered again from the restored shards)."""
    import shutil

    ov = {**ldp_overrides(tiny_model_dir, sst_like_files, **CASES["train_pre"]), "perf.sharding": "fsdp"}
    failure, _ = launch_worker(tmp_path / "full", ov)
    assert failure is None, failure
    two = tmp_path / "two"
    failure, (r0, r1) = launch_worker(two, ov, interrupt={"rank": 1, "step": 2})
    assert failure is None, failure
    assert r0["interrupted"] == r1["interrupted"] == "interrupted (SIGINT) at step 3 of 6; checkpoint at step 3"
    run, rank1 = two / "rank0" / "run", two / "rank1" / "run"
    for sub in [d.name for d in rank1.iterdir() if d.is_dir()]:  # the ranks' files as a shared file system shows them
        shutil.copytree(rank1 / sub, run / sub, dirs_exist_ok=True)
        shutil.copytree(run / sub, rank1 / sub, dirs_exist_ok=True)
    failure, (r0, _) = launch_worker(two, ov, resume=True)
    assert failure is None, failure
    assert sorted(r0["batches"]) == ["3", "4", "5"]
    full = tmp_path / "full" / "rank0" / "run"
    assert json.loads((run / "ledger.json").read_text()) == json.loads((full / "ledger.json").read_text())
    wa, wb = _model_files(full), _model_files(run)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=0, msg=k)


# -- fast: every ldp: config runs sharded --------------------------------------------------------------------
def test_frozen_and_trained_pre_are_accepted(tiny_model_dir, sst_like_files):
    """No ldp: config is refused under FSDP2 any more: a frozen pre(·) and ``ldp.train_pre`` both pass the
    recipe check (train_pre runs its own sharded step, methods/ewft/fsdp.py)."""
    for extra in ({}, {"ldp.schedule": "uniform"}, {"ldp.autoencoder.sizes": []}, {"ldp.label_epsilon": 2.0},
                  {"ldp.reproduce_flaws": ["ii"]}, {"ldp.train_pre.enabled": True, "ldp.schedule": "uniform"},
                  {"ldp.train_pre.enabled": True, "ldp.train_pre.engine": "reference"}):
        r = load_recipe(None, ldp_overrides(tiny_model_dir, sst_like_files, **{"perf.sharding": "fsdp", **extra}))
        methods = active_methods(r)
        assert [m.name for m in methods] == ["ewft"]
        check_recipe(r, 2, methods, False, False)  # no refusal
        assert ForwardLDP.sharded_refusal(r.ldp) is None


def test_pre_cache_rule_and_stream_names():
    """The pre(·) cache is off exactly when pre(·)'s blocks are FSDP2 units on K > 1 ranks; the release
    stream names the rank whenever K > 1 (DDP and FSDP2 alike), never in one process."""
    def run(sharding, k, r=0):
        return SimpleNamespace(recipe=SimpleNamespace(perf=SimpleNamespace(sharding=sharding)), world_size=k, rank=r)

    assert [pre_cache_allowed(run(s, k)) for s, k in (("none", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3))] \
        == [True, True, True, False, False]
    assert fsdp_world(run("fsdp", 2)) and not fsdp_world(run("ddp", 2))
    assert rank_parts(run("fsdp", 2, 1)) == rank_parts(run("ddp", 2, 1)) == ("rank", 1)
    assert rank_parts(run("fsdp", 1)) == ()


def test_test_file_evaluation_uses_the_trained_sigma_on_the_materialised_copy():
    """Under FSDP2 the driver evaluates the test file on a plain copy of the model (fsdp.materialise), whose
    noise layer is a copy taken at sharding time: the method must evaluate with the training layer's σ."""
    import copy

    from dpft.audit.checks_fsdp_ewft import ldp_run

    ldp, trainer = ldp_run(rank=0, world_size=2)
    m = ForwardLDP(trainer.recipe.ldp, trainer.recipe)
    m.ldp = ldp
    copied = copy.deepcopy(ldp.split)  # what materialise's template holds
    ldp.layer.set_sigma(0.123)  # the last epoch's σ, set on the live layer by before_step
    seen = {}

    def evaluate():
        seen.setdefault("sigma", []).append(copied.noise.sigma)
        seen.setdefault("noisy", []).append(copied.noise.eval_noise)
        return {"dev_accuracy": 0.5, "dev_loss": 1.0}

    out = m.evaluate(SimpleNamespace(model=copied, rng=trainer.rng, device=torch.device("cpu"), world_size=2, rank=0),
                     evaluate)
    assert seen["sigma"] == [0.123, 0.123] and sorted(seen["noisy"]) == [False, True]
    assert {"dev_accuracy_noisy_inference", "dev_accuracy_clean_inference"} <= set(out)


def test_fsdp_ewft_audit_checks_pass_and_catch_the_planted_bugs():
    """audit/checks_fsdp_ewft.py (registered in the suite and planted.ALL): honest checks pass, each planted
    bug fails at least one check."""
    from dpft.audit import planted, suite
    from dpft.audit.checks_fsdp_ewft import PLANTED, fsdp_ewft_checks

    assert ("dpft.audit.checks_fsdp_ewft", "fsdp_ewft_checks", PLANTED) in suite.OPTIONAL_CHECKS
    assert set(PLANTED) <= set(planted.ALL)
    honest = fsdp_ewft_checks()
    assert len(honest) >= 2 and all(c.passed for c in honest), [c.row() for c in honest if not c.passed]
    for name in PLANTED:
        assert any(not c.passed for c in fsdp_ewft_checks(name)), name


def test_fsdp_train_pre_one_process_equals_unsharded(tiny_model_dir, sst_like_files, tmp_path):
    """``ldp.train_pre`` with ``perf.sharding: fsdp`` in one process runs methods/ewft/fsdp.py's step (picked by
    dpft/session/step.py ``step_for`` from the engine's ``fsdp_step``); nothing is sharded, so it is the
    one-process run draw for draw: the same ledger and weights as ``perf.sharding: none``, and pre(·) trained."""
    from dpft.methods.ewft.fsdp import TrainPreFSDPStep

    base = ldp_overrides(tiny_model_dir, sst_like_files, **{"ldp.train_pre.enabled": True, "schedule.epochs": 1,
                                                             "ldp.train_pre.max_grad_norm": 0.5})
    runs = {}
    for sharding in ("none", "fsdp"):
        tr = Trainer(load_recipe(None, {**base, "perf.sharding": sharding}), tmp_path / sharding, progress=False)
        assert isinstance(tr.dp_step, TrainPreFSDPStep) is (sharding == "fsdp")
        tr.run()
        runs[sharding] = tmp_path / sharding
    ledgers = [json.loads((d / "ledger.json").read_text()) for d in runs.values()]
    assert ledgers[0] == ledgers[1] and {e["phase"] for e in ledgers[0]["entries"]} == {"ldp-forward+dp-sgd"}
    wn, wf = _model_files(runs["none"]), _model_files(runs["fsdp"])
    assert wn.keys() == wf.keys()
    for k in wn:
        torch.testing.assert_close(wf[k], wn[k], rtol=0, atol=0, msg=k)
    init = load_file(next(tiny_model_dir.glob("*.safetensors")))
    pre = "bert.encoder.layer.0.output.dense.weight"
    assert not torch.allclose(wf[f"model.safetensors:{pre}"], init[pre])


def test_step_for_picks_the_engines_own_sharded_step():
    """dpft/session/step.py ``step_for``: the engine's ``fsdp_step`` when set (whatever ``private``); a
    non-private plan with a mechanism and no such step is refused (naming the fix), never run without noise."""
    from dpft.placement.fsdp import FSDPError
    from dpft.session import step_for

    seen = []
    eng = SimpleNamespace(fsdp_step=lambda spec, ledger, n, world, on_release: seen.append((spec, n)) or "own")
    plan = SimpleNamespace(spec=SimpleNamespace(engine=eng, mechanism=object()))
    assert step_for(plan, None, None, 7, sharded=True, private=False) == "own" and seen == [(plan.spec, 7)]
    plan.spec.engine = SimpleNamespace()
    with pytest.raises(FSDPError, match="has no sharded step.*perf.sharding: ddp"):
        step_for(plan, None, None, 7, sharded=True, private=False)
