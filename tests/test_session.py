"""The private session (src/dpft/session/, issue 46 item 1): the plans it gives equal those of
make_private and DPTrainer, its step choice, its world builder and its versioned secret state."""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft import PrivacyEngine
from dpft.errors import TrainingError
from dpft.api.clipping import api_clip_and_engine
from dpft.placement import fsdp_checkpoint
from dpft.placement import world as ddp
from dpft.privacy.randomness import Randomness
from dpft.session import PrivateSession, SessionSettings, session_world, step_for
from dpft.step import DPStep, correlated
from dpft.step.mechanisms import mechanism_of

SEED = 11


def _linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g))
    return model, data


def _make_private(mech: dict, steps: int = 6):
    model, data = _linear()
    eng = PrivacyEngine(reproducible_seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    module, dp_opt, crit, loader = eng.make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=8,
        max_grad_norm=1.0, steps=steps, target_epsilon=4.0, target_delta=1e-3, **mech)
    return eng, module, dp_opt, crit, loader, data


def _session_plan(mech: dict, steps: int = 6):
    """The same loop asked of the session directly, as a new way in would."""
    model, data = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sess = PrivateSession.open(SEED, where="test")
    m = mechanism_of(mech.get("mechanism", "gaussian"), mech.get("bands"), mech.get("max_batch_size"))
    s = SessionSettings(max_grad_norm=1.0, expected_batch_size=8, mechanism=m, steps=steps, target_epsilon=4.0,
                        target_delta=1e-3)
    plan = sess.plan(s, rows=data, n_rows=len(data), rng=sess.rng.child("make_private:1"), optimizer=opt,
                     parts=lambda sampler: api_clip_and_engine(model, opt, "flat", 1.0, 0.5, None, "auto", None))
    return sess, plan


def _same_plan(a, b, steps: int) -> None:
    assert (a.n, a.q, a.steps, a.phase, a.mechanism.name) == (b.n, b.q, b.steps, b.phase, b.mechanism.name)
    assert a.sigma == b.sigma and a.sigma is not None and a.sigma > 0
    assert type(a.spec.mechanism) is type(b.spec.mechanism)
    for t in range(steps):  # the same secret draws: the same logical batches
        assert torch.equal(a.sampler.indices(t), b.sampler.indices(t)), t


MECHS = {"gaussian": {}, "truncated": {"max_batch_size": 9}, "banded_mf": {"mechanism": "banded_mf", "bands": 2}}


@pytest.mark.parametrize("name", list(MECHS))
def test_session_gives_make_privates_plan(name):
    eng = _make_private(MECHS[name])[0]
    sess, plan = _session_plan(MECHS[name])
    _same_plan(eng._loop.plan, plan, 6)
    assert sess.n == 60 and sess.planned == 6 and not sess.user_level
    assert isinstance(sess.step(plan), DPStep)  # one process: the plain DP step (session/step.py)


def test_session_gives_dptrainers_plan(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dpft.integrations.hf import DPArguments, DPTrainer
    from dpft.integrations.hf.loss import hf_per_example_loss
    from dpft.step.build import make_engine
    from dpft.step.clip import make_clip_policy

    def bert():
        torch.manual_seed(0)
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=32, num_labels=2)
        return transformers.BertForSequenceClassification(cfg).train()

    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(1, 64, (8,), generator=g).tolist(), "attention_mask": [1] * 8,
             "labels": int(i % 2)} for i in range(40)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), num_train_epochs=1.1,
                                          per_device_train_batch_size=4, report_to=[], use_cpu=True)
    dp = DPArguments(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0, expected_batch_size=8,
                     reproducible_seed=SEED, mechanism="banded_mf", bands=2)
    with pytest.warns(UserWarning, match="reproducible_seed"):
        tr = DPTrainer(model=bert(), args=args, train_dataset=rows, dp_args=dp)
    model = bert()
    sess = PrivateSession.open(SEED, where="test")
    s = SessionSettings(max_grad_norm=1.0, expected_batch_size=8, mechanism=dp.mechanism_part(), epochs=1.1,
                        target_epsilon=3.0, target_delta=1e-3)
    loss = hf_per_example_loss(False, ())

    def parts(sampler):
        clip = make_clip_policy("flat", 1.0)
        return clip, make_engine("bookkeeping", model, loss, clip)

    plan = sess.plan(s, rows=rows, n_rows=len(rows), rng=sess.rng.child("hf-train-loop-0"), optimizer=None,
                     parts=parts)
    assert tr.total_steps == sess.planned == 6  # ceil(1.1 · 40 / 8)
    _same_plan(tr.plan, plan, 6)


def test_secret_state_round_trips_banded_mf():
    eng, module, opt, crit, loader, _ = _make_private(MECHS["banded_mf"])
    while opt.logical_steps < 3:
        for x, y in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.logical_steps >= 3:
                break
    step = opt.dp_step
    state = PrivateSession.secret_state(step)
    assert state["format"] == "dpft-secret-state" and state["version"] == 1 and state["stateful"]
    assert state["next_step"] == 3 and len(state["buffers"]) == 1  # b − 1 buffers
    fresh = _make_private(MECHS["banded_mf"])[2].dp_step
    PrivateSession.restore_secret_state(fresh, state)
    mech, old = fresh.spec.mechanism, step.spec.mechanism
    assert mech.next_step == 3 and torch.equal(mech.sampler.partition, old.sampler.partition)
    for k, v in old.buffers[0].items():
        assert torch.equal(mech.buffers[0][k], v)
    with pytest.raises(ValueError, match="version"):
        PrivateSession.restore_secret_state(fresh, {**state, "version": 0})
    gauss = _make_private(MECHS["gaussian"])[2].dp_step
    with pytest.raises(ValueError, match="stateful"):  # a banded state never lands on a stateless step
        PrivateSession.restore_secret_state(gauss, state)


def test_secret_state_round_trips_gaussian():
    step = _make_private(MECHS["gaussian"])[2].dp_step
    assert not step.spec.mechanism.stateful
    state = PrivateSession.secret_state(step)
    assert state == {"format": "dpft-secret-state", "version": 1, "stateful": False}  # the key alone: nothing
    PrivateSession.restore_secret_state(step, state)
    banded = _make_private(MECHS["banded_mf"])[2].dp_step
    with pytest.raises(ValueError, match="stateful"):
        PrivateSession.restore_secret_state(banded, state)


def test_session_world_one_process_and_a_key_of_another_world():
    world, rng = session_world(5)
    assert world == ddp.World() and rng.seed_for("x") == Randomness(5).seed_for("x")
    assert session_world(None, rng)[1] is rng  # a caller's key is kept
    with pytest.raises(ddp.DistributedError, match="world of 2 process.*new PrivacyEngine"):
        session_world(None, rng, made_for=ddp.World(0, 2), where="make_private")


def test_step_for_one_process_is_the_dp_step():
    sess, plan = _session_plan({})
    step = step_for(plan, sess.world, sess.ledger, plan.n)
    assert isinstance(step, DPStep) and step.ledger is sess.ledger and step.spec is plan.spec


def _banded_after(steps: int):
    return _banded_engine_after(steps)[1]


def test_secret_state_resume_refusals_and_the_format_before_v1():
    """The one restore path's refusals (what dpft train's --resume and DPTrainer's
    resume_from_checkpoint ask of it): releases after the checkpoint, a state of another step, a
    state at another step than the checkpoint's when saved, no state at all; and a state written
    before the versioned format (dpft train / DPTrainer's bare banded state) still restores."""
    step = _banded_after(2)
    with pytest.raises(ValueError, match="checkpoint at step 3"):
        PrivateSession.secret_state(step, at=3)
    state = PrivateSession.secret_state(step, at=2)
    restored = _make_private(MECHS["banded_mf"])[2].dp_step  # each refusal leaves it untouched
    with pytest.raises(ValueError, match=r"--resume: 1 release\(s\) .* after the checkpoint at step 2.*new --output-dir"):
        PrivateSession.restore_secret_state(restored, state, "--resume", at=2, replayed=1, fresh="--output-dir")
    with pytest.raises(ValueError, match="state is at step 2, the checkpoint at step 4"):
        PrivateSession.restore_secret_state(restored, state, "--resume", at=4)
    with pytest.raises(ValueError, match="no secret state"):
        PrivateSession.restore_secret_state(restored, None, "--resume", at=2)
    assert restored.spec.mechanism.next_step == 0
    PrivateSession.restore_secret_state(_make_private(MECHS["gaussian"])[2].dp_step, None)  # stateless: nothing
    bare = {k: v for k, v in state.items() if k not in ("format", "version", "stateful")}  # before v1
    PrivateSession.restore_secret_state(restored, bare, "--resume", at=2)
    assert restored.spec.mechanism.next_step == 2
    for k, v in step.spec.mechanism.buffers[0].items():
        assert torch.equal(restored.spec.mechanism.buffers[0][k], v)


def _banded_engine_after(steps: int):
    eng, module, opt, crit, loader, _ = _make_private(MECHS["banded_mf"])
    while opt.logical_steps < steps:
        for x, y in loader:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.logical_steps >= steps:
                break
    return eng, opt.dp_step


def test_a_secret_state_is_checked_once_per_load(tmp_path, monkeypatch):
    """Issue 46 item 3: the format check (step/correlated.py ``check_secret_state``) runs once per load.
    The readers (dpft train's and DPTrainer's ``load_noise_state``; make_private's) return a ``SecretState``
    that the session's restore does not check again (it survives DDP's pickled broadcast); a plain dict
    handed to the restore is still checked there, and a file of another version is refused by the reader."""
    calls = []
    real = correlated._check_format
    monkeypatch.setattr(correlated, "_check_format", lambda st, where: calls.append(where) or real(st, where))
    eng, step = _banded_engine_after(2)
    state = PrivateSession.secret_state(step, at=2)
    # dpft train / DPTrainer: the checkpoint's file read (checked once), then restored (not again)
    correlated.write_noise_state(tmp_path, state)
    read = correlated.load_noise_state(tmp_path)
    assert isinstance(read, correlated.SecretState) and calls == ["--resume"]
    assert type(pickle.loads(pickle.dumps(read))) is correlated.SecretState  # on_rank0's broadcast keeps it
    restored = _make_private(MECHS["banded_mf"])[2].dp_step
    PrivateSession.restore_secret_state(restored, read, "--resume", at=2)
    assert calls == ["--resume"] and restored.spec.mechanism.next_step == 2
    # a state no reader checked: the restore checks it
    PrivateSession.restore_secret_state(_make_private(MECHS["banded_mf"])[2].dp_step, dict(state), "here", at=2)
    assert calls == ["--resume", "here"]
    correlated.write_noise_state(tmp_path, {**state, "version": 0})
    with pytest.raises(TrainingError, match="--resume: not a dpft-secret-state v1"):
        correlated.load_noise_state(tmp_path)
    # make_private: save_noise_state, then a fresh engine's load_noise_state checks the file once
    path = tmp_path / "mp" / "state.pt"
    assert eng.save_noise_state(path)
    calls.clear()
    fresh = _make_private(MECHS["banded_mf"])[0]
    fresh.load_noise_state(path)
    assert calls == ["load_noise_state"] and fresh._loop.mechanism.next_step == 2


def test_the_fsdp2_checkpoint_makes_the_sessions_one_step_check():
    """Issue 46 item 3: the FSDP2 checkpoint's save refuses noise buffers at another step than the
    checkpoint with the check ``PrivateSession.secret_state(at=)`` makes (step/correlated.py
    ``check_state_step``), before any collective or file."""
    step = _banded_after(2)
    with pytest.raises(ValueError) as by_session:
        PrivateSession.secret_state(step, at=3)
    trainer = SimpleNamespace(world=ddp.World(), mechanism=step.spec.mechanism)
    with pytest.raises(ValueError) as by_checkpoint:
        fsdp_checkpoint.save_checkpoint(trainer, 3, lambda *a, **k: pytest.fail("written"))
    assert str(by_checkpoint.value) == str(by_session.value) == "noise buffers at step 2, checkpoint at step 3"
    assert fsdp_checkpoint.check_state_step is correlated.check_state_step


def test_dpft_train_plans_through_the_session(tiny_model_dir, sst_like_files, tmp_path):
    """dpft train's plan comes from the private session (run/plan.py build_plan): the session's
    world, key and ledger are the run's, its N and planned steps the run's, the step is the
    session's (the only ledger writer); --no-dp is a session plan without a mechanism."""
    from conftest import files_recipe
    from dpft.run.loop import Trainer

    r = files_recipe(tiny_model_dir, sst_like_files, **{"privacy.reproducible": True, "schedule.epochs": 1.1,
                                                         "schedule.steps": None})
    tr = Trainer(r, tmp_path / "a", progress=False)
    sess = tr.plan.session
    assert isinstance(sess, PrivateSession) and sess.where == "dpft train"
    assert sess.rng is tr.rng and sess.ledger is tr.ledger and tr.dp_step.ledger is sess.ledger
    assert sess.n == tr.n and sess.planned == tr.total_steps == tr.plan.privacy.steps
    assert tr.total_steps == math.ceil(1.1 * tr.n / 8 - 1e-9)  # the one steps rule (step/plan.py)
    assert tr.dp_step.spec is tr.plan.privacy.spec and tr.plan.privacy.private and tr.sigma > 0
    off = Trainer(files_recipe(tiny_model_dir, sst_like_files, **{"privacy.enabled": False}), tmp_path / "b",
                  progress=False)
    assert not off.plan.privacy.private and off.plan.privacy.sigma is None and off.sigma == 0.0
    assert off.dp_step.spec.mechanism is None and off.plan.session.methods.methods == []
