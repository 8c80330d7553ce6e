"""DPTrainer under torchrun (2 CPU processes, gloo) and at user level (issue 26, items 1 and 4).

One ``torchrun --nproc_per_node=2`` launch (dpft.audit.ddp_jobs.launch: the launcher the
audit uses) runs, one after the other in the same two processes: a reproducible example-level
run (4 steps, checkpoints), a reproducible user-level run, a resume of a 1-process checkpoint
(refused), and the audit's one-step jobs honest and with each planted DDP bug. The same runs in
one process (in pytest) are the reference:

- 2 processes = 1 process in reproducible mode: the same ledger and ε, the same logical batches
  (the ranks' shares disjoint and covering each), the same final weights within float tolerance
  and bit-identical on the two ranks (rank 1 started from other weights: rank 0's were
  broadcast), no DistributedDataParallel wrapper; rank 0 alone writes (rank 1 runs in a working
  directory of its own, which stays empty);
- user level: the same, with whole users per rank; leave-one-user-out ≤ C;
- TRL: ``DPSFTTrainer`` (prompt/completion, completion-only loss) and ``DPDPOTrainer`` (a
  preference pair per unit) in the same launch: 2 processes = 1 process as above;
- a checkpoint is resumed only by as many processes as wrote it (both directions);
- the audit's DDP checks catch each planted bug.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from dpft.placement import world as ddp  # noqa: E402
from dpft.accounting.ledger import PrivacyLedger  # noqa: E402
from dpft.audit import ways_in_ddp as hd  # noqa: E402

try:
    import trl  # noqa: F401
    TRL = True
except ImportError:  # pragma: no cover - an optional extra
    TRL = False

#: A reproducible example-level run: 40 rows, q = 8/40, 4 steps, physical batches of 3.
EX = {"name": "ex-train", "rows": 40, "eb": 8, "steps": 4, "sigma": 3.0, "lr": 0.5, "C": 1.0, "physical": 3,
      "seed": 7, "save_steps": 2, "perturb_rank1": True, "eval": True}
#: User level: 10 users of 1 to 4 rows (k = 2), q = 4/10 over users, 3 steps.
USERS = [u for u, m in enumerate([1, 2, 3, 4, 1, 2, 3, 4, 2, 2]) for _ in range(m)]
USER = {"name": "user-train", "rows": len(USERS), "users": USERS, "k": 2, "eb": 4, "steps": 3, "sigma": 3.0,
        "lr": 0.5, "C": 1.0, "physical": 3, "seed": 11, "save_steps": 0, "perturb_rank1": True}
#: TRL (DPSFTTrainer: prompt/completion rows, completion-only loss; DPDPOTrainer: preference
#: pairs), reproducible, rank 1 starting from other weights.
SFT = {"name": "sft-train", "trainer": "sft", "rows": 12, "eb": 4, "steps": 3, "sigma": 3.0, "lr": 0.5, "C": 1.0,
       "physical": 2, "seed": 13, "save_steps": 0, "perturb_rank1": True, "delta": 1e-2}
DPO = {**SFT, "name": "dpo-train", "trainer": "dpo", "steps": 2, "seed": 17}


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) if d.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfddp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = {j["name"]: hd.run_job({**j, "perturb_rank1": False, "out": str(root / "one" / j["name"])})
               for j in (EX, USER) + ((SFT, DPO) if TRL else ())}
        one["ex"] = hd._one_process(hd.audit_jobs()[0])
    assert not any("error" in r for r in one.values()), one
    ck1 = root / "one" / "ex-train" / "checkpoint-2"
    jobs = [{**EX, "out": "run-ex"}, {**USER, "out": "run-user"},
            {**EX, "name": "resume-1proc", "out": "run-resume", "resume": str(ck1)}]
    audit = hd.audit_jobs()[0]  # "ex": one step, q = 1, σ = 0
    jobs += [{**audit, "name": "ex"}] + [{**audit, "name": f"ex/{p}", "planted": p}
                                        for p in ("hf_ddp_wrapped", "hf_ddp_unsharded")]
    jobs.append({**audit, "name": "ex/accelerate_wraps", "accelerate_wraps": True})
    if TRL:  # the same launch: each torchrun start costs ~40 s on 2 cores
        jobs += [{**SFT, "out": "run-sft"}, {**DPO, "out": "run-dpo"}]
    cwds = [str(root / "rank0"), str(root / "rank1")]
    ranks = hd.launch(jobs, cwds=cwds, log=str(root / "torchrun.log"))
    two = [{r["name"]: r for r in rs} for rs in ranks]
    return {"root": root, "one": one, "two": two, "ck1": ck1}


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
def test_two_processes_equal_one_in_reproducible_mode(runs):
    one, (r0, r1) = runs["one"]["ex-train"], [t["ex-train"] for t in runs["two"]]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["world_size"] == r1["world_size"] == 2 and one["world_size"] == 1
    # The same ledger (every event, q, σ, count) and ε; the ledger counts 4 steps, not 8.
    assert r0["ledger"] == r1["ledger"] == one["ledger"]
    assert PrivacyLedger.from_json(r0["ledger"]).steps == 4
    assert r0["epsilon"] == one["epsilon"] and r0["q"] == one["q"] == 8 / 40
    live = runs["root"] / "rank0" / "run-ex" / "ledger.json"
    assert json.loads(live.read_text()) == json.loads((runs["root"] / "one" / "ex-train" / "ledger.json").read_text())
    # The same logical batch on both ranks and in one process, in the same (length) order;
    # the shares are disjoint and cover it.
    assert set(one["batches"]) == {"0", "1", "2", "3"}
    for t, full in one["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
    assert any(len(b) > 3 for b in one["batches"].values())  # several micro-batches at times
    # Weights: within float tolerance of one process; bit-identical on the ranks (rank 1
    # started from other weights and got rank 0's).
    torch.testing.assert_close(torch.tensor(r0["delta"]), torch.tensor(one["delta"]), rtol=1e-5, atol=1e-6)
    assert r0["digest"] == r1["digest"] and r0["delta"] == r1["delta"]
    from safetensors.torch import load_file

    a = load_file(str(runs["root"] / "one" / "ex-train" / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(runs["root"] / "rank0" / "run-ex" / "checkpoint-4" / "model.safetensors"))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-5, atol=1e-6)
    # Evaluation (sharded by accelerate, gathered): the metrics of one process on every rank.
    for k in ("eval_loss", "eval_top_class_share"):
        assert r0["eval"][k] == pytest.approx(one["eval"][k], rel=1e-5) and r1["eval"][k] == r0["eval"][k]
    # No DistributedDataParallel wrapper around the model (accelerate would add one).
    assert not r0["ddp"] and not r1["ddp"] and r0["wrapped"] == "BertForSequenceClassification"
    st = json.loads((runs["root"] / "rank0" / "run-ex" / "checkpoint-2" / "dp_state.json").read_text())
    assert st["world_size"] == 2 and st["unit"] == "example"


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
@pytest.mark.skipif(not TRL, reason="trl is not installed")
@pytest.mark.parametrize("job", [SFT, DPO], ids=["DPSFTTrainer", "DPDPOTrainer"])
def test_trl_trainers_two_processes_equal_one(runs, job):
    name = job["name"]
    one, (r0, r1) = runs["one"][name], [t[name] for t in runs["two"]]
    assert "error" not in one and "error" not in r0 and "error" not in r1, (one.get("error"), r0.get("error"),
                                                                              r1.get("error"))
    assert r0["world_size"] == r1["world_size"] == 2 and one["world_size"] == 1
    # The same ledger (one event per logical step, not per rank) and ε.
    assert r0["ledger"] == r1["ledger"] == one["ledger"]
    assert PrivacyLedger.from_json(one["ledger"]).steps == job["steps"]
    assert r0["epsilon"] == r1["epsilon"] == one["epsilon"] and r0["q"] == one["q"] == job["eb"] / job["rows"]
    # The same logical batches; disjoint shares covering each (rows, or preference pairs).
    assert len(one["batches"]) == job["steps"]
    for t, full in one["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert not set(s0) & set(s1) and sorted(s0 + s1) == sorted(full)
    assert any(r0["shares"][t] and r1["shares"][t] for t in one["batches"])  # both ranks clipped rows
    # Final trainable weights: within float tolerance of one process, bit-identical on the ranks
    # (rank 1 started from other weights and got rank 0's; for DPO also the reference log-probs).
    d1, d2 = torch.tensor(one["delta"]), torch.tensor(r0["delta"])
    assert float(d1.abs().max()) > 0.1  # the run moved the weights
    torch.testing.assert_close(d2, d1, rtol=1e-5, atol=1e-6)
    assert r0["digest"] == r1["digest"] and r0["delta"] == r1["delta"]
    assert not r0["ddp"] and not r1["ddp"]
    # rank 0 alone writes (rank 1's directory stays empty: test_rank0_alone_writes)
    live = runs["root"] / "rank0" / f"run-{name.split('-')[0]}" / "ledger.json"
    assert json.loads(live.read_text()) == json.loads((runs["root"] / "one" / name / "ledger.json").read_text())


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
def test_rank0_alone_writes(runs):
    root = runs["root"]
    assert files_under(root / "rank1") == []
    written = set(files_under(root / "rank0" / "run-ex"))
    assert {"ledger.json", "checkpoint-2/ledger.json", "checkpoint-2/dp_state.json", "checkpoint-2/model.safetensors",
            "checkpoint-4/trainer_state.json", "checkpoint-4/optimizer.pt", "checkpoint-4/rng_state_0.pth"} <= written
    assert not any("rng_state_1" in f for f in written)


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
def test_user_level_two_processes_equal_one(runs):
    one, (r0, r1) = runs["one"]["user-train"], [t["user-train"] for t in runs["two"]]
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    # The ledger counts users: q = 4/10, N = U = 10.
    assert one["n"] == 10 and one["q"] == pytest.approx(0.4)
    assert r0["ledger"] == r1["ledger"] == one["ledger"] and PrivacyLedger.from_json(one["ledger"]).steps == 3
    users = torch.tensor(USERS)
    for t, full in one["batches"].items():
        assert r0["batches"][t] == r1["batches"][t] == full
        s0, s1 = r0["shares"][t], r1["shares"][t]
        assert sorted(s0 + s1) == sorted(full)
        # whole users per rank; at most k = 2 rows per sampled user
        assert not set(users[s0].tolist()) & set(users[s1].tolist()) if s0 and s1 else True
        assert int(torch.bincount(users[full]).max()) <= 2
    assert any(r0["shares"][t] and r1["shares"][t] for t in one["batches"])  # both ranks had users
    torch.testing.assert_close(torch.tensor(r0["delta"]), torch.tensor(one["delta"]), rtol=1e-5, atol=1e-6)
    assert r0["digest"] == r1["digest"]


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
def test_resume_needs_the_same_world_size(runs, tmp_path):
    # A 1-process checkpoint resumed by 2 processes: refused on both ranks, naming the fix.
    for t in runs["two"]:
        err = t["resume-1proc"].get("error", "")
        assert "written by 1 process(es) but this run has 2" in err and "in one process" in err, err
    assert files_under(runs["root"] / "rank0" / "run-resume") == []
    # A 2-process checkpoint resumed by 1 process.
    ck2 = runs["root"] / "rank0" / "run-ex" / "checkpoint-2"
    res = hd.run_job({**EX, "perturb_rank1": False, "out": str(tmp_path / "out"), "resume": str(ck2)})
    assert "written by 2 process(es) but this run has 1" in res["error"]
    assert "torchrun --nproc_per_node=2" in res["error"] and "accelerate launch --num_processes 2" in res["error"]


@pytest.mark.slow  # the module's one torchrun launch (2 ranks import torch + transformers)
def test_audit_ddp_checks_pass_and_catch_planted_bugs(runs):
    one = {"ex": runs["one"]["ex"]}

    def checks(job):
        return {c.name: c for c in hd.ddp_checks(one, [[{**t[job], "name": "ex"}] for t in runs["two"]])}

    honest = checks("ex")
    assert len(honest) == 2 and all(c.passed for c in honest.values()), [c.row() for c in honest.values()]
    wrapped = checks("ex/hf_ddp_wrapped")
    assert not wrapped["hf-ddp: DPTrainer no DistributedDataParallel wrapper"].passed
    assert "DistributedDataParallel found" in wrapped["hf-ddp: DPTrainer no DistributedDataParallel wrapper"].message
    # accelerate's DDP wrapper let through, the per-step guard on: refused before any release.
    for t in runs["two"]:
        err = t["ex/accelerate_wraps"].get("error", "")
        assert "UnclippedParameterError" in err and "DistributedDataParallel" in err, err
        assert "ledger" not in t["ex/accelerate_wraps"]
    unsharded = checks("ex/hf_ddp_unsharded")
    eq = unsharded["hf-ddp: DPTrainer 2 processes = 1 process"]
    assert not eq.passed and eq.stats["diff_over_C"] > 0.5  # every example counted on both ranks


def test_user_level_leave_one_user_out_and_its_planted_bug():
    honest = hd.user_loo_check()
    assert honest.passed and honest.stats["loo_over_C"] > 0.5, honest.row()  # a user at the clip norm
    bug = hd.user_loo_check("hf_user_rows_clipped_alone")
    assert not bug.passed and bug.stats["loo_over_C"] > 1.5, bug.row()  # a 3-row user moves S by up to 3C


# -- in-process units ------------------------------------------------------------------------
def test_shard_units_keeps_users_whole():
    idx = torch.tensor([5, 2, 9, 4, 14, 7, 1])
    units = torch.tensor([0, 0, 3, 1, 1, 2, 2])  # units in order 0, 3, 1, 2: rank 0 gets 0 and 1
    shares = [ddp.shard_units(idx, units, ddp.World(r, 2)) for r in range(2)]
    assert shares[0].tolist() == [5, 2, 4, 14] and shares[1].tolist() == [9, 7, 1]
    assert ddp.shard_units(idx, units, ddp.World()) is idx
    with pytest.raises(ValueError, match="contiguous"):
        ddp.shard_units(idx, torch.tensor([0, 1, 0, 1, 1, 2, 2]), ddp.World(0, 2))


def test_user_level_settings_are_checked(tmp_path):
    from transformers import TrainingArguments

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    with pytest.raises(ValueError, match="user_clipping"):
        DPArguments(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0, user_column="u",
                    user_clipping="per_row")
    with pytest.raises(ValueError, match="max_rows_per_user"):
        DPArguments(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0, user_column="u", max_rows_per_user=0)
    rows = hd.make_rows(6, [0, 0, 1, 1, 2, 2])
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, label_names=["labels"])

    def build(**dp):
        kw = dict(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0, user_column=hd.USER_COLUMN)
        return DPTrainer(model=hd.tiny_model(), args=args, train_dataset=rows, data_collator=hd.pad_collate,
                         dp_args=DPArguments(**{**kw, **dp}))

    with pytest.raises(ValueError, match="'user' is not a column.*user_id"):
        build(user_column="user")
    with pytest.raises(ValueError, match="exceeds the number of users U = 3"):
        build(expected_batch_size=4)
    with pytest.raises(Exception, match="1/N|δ|delta"):
        build(target_delta=0.5)  # δ must be below 1/U (not 1/rows)
    tr = build(user_clipping="per_example_over_k", max_rows_per_user=2)
    assert tr.n == 3 and tr.q == pytest.approx(2 / 3) and tr.clip.sensitivity == pytest.approx(1.0)
    assert tr.dp_state()["unit"] == "user" and tr.dp_state()["world_size"] == 1
    assert getattr(tr.accelerator.prepare_model, "_dpft_no_ddp", False)  # accelerate never wraps in DDP
