"""Issue 46 item 2: the plan as a value (step/plan.py) — ``PlanSettings`` in simple types →
``calibrate`` (σ, pure) → ``make`` (the live plan); ``build_privacy_plan`` is exactly that chain."""

from __future__ import annotations

import dataclasses
import json

import dp_accounting as dpa
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft.api.clipping import api_clip_and_engine
from dpft.errors import PlanError
from dpft.privacy.randomness import Randomness
from dpft.step import sample
from dpft.step.build import build_step_spec, resolve_sigma
from dpft.step.correlated import CyclicPoissonSampler, banded_phase_event
from dpft.step.mechanisms import RECIPE_NAMES, mechanism_of
from dpft.step.noise import GaussianMechanism
from dpft.step.plan import CalibratedPlan, PlanSettings, build_privacy_plan
from dpft.step.sample import UserPoissonSampler
from dpft.step.truncated import TruncatedPoissonSampler, truncated_event

N, B, STEPS, SEED = 60, 8, 6, 11
MECHS = [{}, {"max_batch_size": 11}, {"mechanism": "banded_mf", "bands": 3}]
PRIOR = [dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(2.0))]


def _mech(m: dict):
    return mechanism_of(m.get("mechanism", "gaussian"), m.get("bands"), m.get("max_batch_size"))


def _today_sigma(m: dict, prior, **target) -> float:
    """σ as build_privacy_plan computed it before the plan was a value: sampler first, its rates,
    the mechanism's phase event spelled out here."""
    mech = _mech(m)
    smp = mech.sampler(N, B, Randomness(SEED))
    q = float(smp.q)
    if isinstance(smp, CyclicPoissonSampler):
        event = lambda s: banded_phase_event(s, smp.partition_rate, STEPS, smp.bands)  # noqa: E731
    elif isinstance(smp, TruncatedPoissonSampler):
        event = lambda s: dpa.SelfComposedDpEvent(truncated_event(N, q, smp.max_batch_size, s), STEPS)  # noqa: E731
    else:
        event = None
    return resolve_sigma(q=q, steps=STEPS, n=N, prior=prior, phase_event=event, **target)


def _settings(m: dict, steps: int = STEPS, **kw) -> PlanSettings:
    return PlanSettings.of(_mech(m), n=N, expected_batch_size=B, steps=steps, **kw)


@pytest.mark.parametrize("m", MECHS, ids=["poisson", "truncated", "banded"])
def test_calibrate_is_pure_and_gives_todays_sigma(m, monkeypatch):
    s = _settings(m, target_epsilon=4.0, target_delta=1e-3)
    want = _today_sigma(m, PRIOR, noise_multiplier=None, target_epsilon=4.0, delta=1e-3)

    def nothing_live(*a, **k):
        raise AssertionError("calibrate built a sampler or drew randomness")

    monkeypatch.setattr(sample.PoissonSampler, "__init__", nothing_live)
    monkeypatch.setattr(Randomness, "stream", nothing_live)
    cal = s.calibrate(PRIOR)
    assert isinstance(cal, CalibratedPlan) and cal.settings is s and cal.sigma == want  # bit-equal
    assert s.calibrate(PRIOR) == cal  # a value: the same settings give the same σ
    assert s.calibrate(PRIOR, calibrate=lambda run: 0.125).sigma == 0.125  # DDP: rank 0 runs it, all get σ
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.steps = 1  # type: ignore[misc]
    # an explicit σ wins over the target; δ is still checked against N
    assert dataclasses.replace(s, noise_multiplier=0.7).calibrate(PRIOR).sigma == 0.7
    with pytest.raises(ValueError, match="1/N"):
        dataclasses.replace(s, noise_multiplier=0.7, target_delta=0.5).calibrate()
    assert dataclasses.replace(s, private=False).calibrate().sigma is None


def test_settings_round_trip_through_json():
    mech = mechanism_of("banded_mf", 3, names=RECIPE_NAMES)
    for s in (_settings({}, noise_multiplier=1.1, phase="pre"),
              _settings(MECHS[1], target_epsilon=2.0, target_delta=1e-4),
              PlanSettings.of(mech, n=N, expected_batch_size=B, steps=STEPS, target_epsilon=3, target_delta=1e-3)):
        text = json.dumps(s.to_dict())
        back = PlanSettings.from_dict(json.loads(text))
        assert back == s and back.mechanism_part().settings() == s.mechanism_part().settings()
        assert json.loads(json.dumps(CalibratedPlan(s, 0.77).to_dict())) == {**s.to_dict(), "sigma": 0.77}
    d = _settings(MECHS[2], noise_multiplier=1.0).to_dict()
    assert (d["mechanism"], d["bands"], d["max_batch_size"], d["n"], d["q"]) == ("banded_mf", 3, None, N, None)
    # the live settings word refusals in the way in's spelling; the value leaves the spelling out (every way in
    # writes the same value for the same settings)
    spelled = PlanSettings.of(mech, n=N, expected_batch_size=B, steps=2)
    assert spelled.mechanism_part().names == RECIPE_NAMES and "names" not in spelled.to_dict()
    assert PlanSettings.from_dict(spelled.to_dict()) == spelled


def _parts(model, opt):
    return lambda sampler: api_clip_and_engine(model, opt, "flat", 1.0, 0.5, None, "auto", None)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


@pytest.mark.parametrize("m", MECHS, ids=["poisson", "truncated", "banded"])
def test_build_privacy_plan_is_settings_calibrate_make_and_unchanged(m):
    model, opt = _model()
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    rng = Randomness(SEED).child("plan")
    seen = []
    kw = dict(n=N, expected_batch_size=B, steps=STEPS, rng=rng, parts=_parts(model, opt), optimizer=opt,
              target_epsilon=4.0, target_delta=1e-3, prior=PRIOR, rows=data)
    plan = build_privacy_plan(mechanism=_mech(m), on_sigma=seen.append, **kw)
    # today's chain, by hand: the mechanism's sampler, σ on its events, the spec, the install
    mech = _mech(m)
    smp = mech.sampler(N, B, rng)
    sigma = _today_sigma(m, PRIOR, noise_multiplier=None, target_epsilon=4.0, delta=1e-3)
    clip, eng = _parts(model, opt)(smp)
    spec = mech.install(build_step_spec(engine=eng, clip=clip, sigma=sigma, rng=rng, sampler=smp, optimizer=opt),
                        n=N, sampler=smp, rng=rng, sigma=sigma, steps=STEPS, rows=data)
    assert seen == [plan.sigma] and plan.sigma == sigma and (plan.n, plan.q, plan.steps) == (N, smp.q, STEPS)
    assert type(plan.release) is type(spec.mechanism) and plan.release.sigma == spec.mechanism.sigma

    def events(release):  # the ledger events of every step (banded MF's depend on the step)
        return [release.event_at(t) if m.get("mechanism") else release.event(smp.q) for t in range(STEPS)]

    assert events(plan.release) == events(spec.mechanism) and plan.info() == mech.info(smp, STEPS)
    assert plan.phase_event is None or plan.phase_event(0.9) == mech.phase_event(smp, N, smp.q, STEPS)(0.9)
    for t in range(STEPS):  # the same secret draws: batches and noise
        assert torch.equal(plan.sampler.indices(t), smp.indices(t))
        z = {k: torch.zeros_like(v) for k, v in plan.params.items()}
        a, b = plan.release.add_noise(z, t), spec.mechanism.add_noise(z, t)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the value it was made from travels with the plan, and makes the same plan again
    assert plan.calibrated == CalibratedPlan(_settings(m, target_epsilon=4.0, target_delta=1e-3), sigma)
    again = plan.calibrated.make(rng=rng, parts=_parts(model, opt), optimizer=opt, rows=data)
    assert again.sigma == plan.sigma and type(again.mechanism) is type(plan.mechanism)
    assert torch.equal(again.sampler.indices(2), plan.sampler.indices(2))


def test_truncation_is_the_samplers_and_refusals_come_before_calibration():
    smp = TruncatedPoissonSampler(N, B, Randomness(SEED), 11)
    assert smp.truncation == (N, 11)
    model, opt = _model()
    plan = _settings(MECHS[1], noise_multiplier=1.0).calibrate().make(rng=Randomness(SEED), parts=_parts(model, opt),
                                                                      optimizer=opt)
    assert plan.sampler.truncation == (N, 11) and not hasattr(plan.release, "truncation")
    # the release records the sampler's event, read from the sampler (nothing copied onto it)
    assert plan.release.step_event == plan.sampler.step_event
    assert plan.release.event(plan.q) == plan.sampler.step_event(plan.q, plan.sigma) == truncated_event(
        N, plan.q, 11, plan.sigma)
    with pytest.raises(PlanError, match="needs its own sampler"):
        _settings(MECHS[1], noise_multiplier=1.0).calibrate().make(
            rng=Randomness(SEED), parts=_parts(model, opt), optimizer=opt, mechanism=_mech(MECHS[1]),
            sampler=sample.PoissonSampler(N, B, Randomness(SEED)))
    # a release that is not the plain Gaussian mechanism (a method's own) is refused, not dropped
    own = type("OwnRelease", (GaussianMechanism,), {})(1.0, 1.0, Randomness(SEED))
    with pytest.raises(PlanError, match="records its event on the plain Gaussian mechanism, got OwnRelease"):
        _mech(MECHS[1]).install(plan.spec.replace(mechanism=own), n=N, sampler=plan.sampler, rng=Randomness(SEED),
                                sigma=1.0, steps=STEPS)
    # what the sampler refuses is refused first, as when the sampler was built before σ
    banded = PlanSettings.of(mechanism_of("banded_mf", 8), n=N, expected_batch_size=B, steps=STEPS, target_epsilon=1.0,
                             target_delta=0.5)
    with pytest.raises(PlanError, match="p = b·B/N = 1.07 > 1; lower bands"):
        banded.calibrate()
    with pytest.raises(ValueError, match="between 1 and N = 60"):
        PlanSettings(n=N, expected_batch_size=61, steps=2, noise_multiplier=1.0).calibrate()


def test_the_units_own_sampler_enters_as_its_rate():
    users = torch.arange(N) % 20
    own = UserPoissonSampler(users, 5, 2, Randomness(SEED))
    s = PlanSettings.of(mechanism_of(), n=own.n, expected_batch_size=5, steps=STEPS, sampler=own,
                        target_epsilon=4.0, target_delta=1e-3)
    assert s.q == own.q == 0.25 and json.loads(json.dumps(s.to_dict()))["q"] == 0.25
    cal = s.calibrate()
    assert cal.sigma == resolve_sigma(noise_multiplier=None, target_epsilon=4.0, delta=1e-3, q=0.25, steps=STEPS,
                                      n=20, phase_event=None)
    model, opt = _model()
    with pytest.raises(ValueError, match="pass it as sampler"):
        cal.make(rng=Randomness(SEED), parts=_parts(model, opt), optimizer=opt)
    with pytest.raises(ValueError, match="not the q = 0.25 σ was calibrated on"):
        cal.make(rng=Randomness(SEED), parts=_parts(model, opt), optimizer=opt,
                 sampler=UserPoissonSampler(users, 4, 2, Randomness(SEED)))
    plan = cal.make(rng=Randomness(SEED), parts=_parts(model, opt), optimizer=opt, sampler=own)
    assert plan.sampler is own and plan.q == 0.25 and plan.sigma == cal.sigma


@pytest.mark.parametrize("m", MECHS, ids=["poisson", "truncated", "banded"])
def test_one_rule_for_the_rates_the_value_records(m):
    """The mechanism's own sampler handed in (dpft train's example-level unit) gives the value of none handed in
    (make_private's, DPTrainer's): q, p None; any other sampler (user level, a schedule, other parameters) enters
    as its rates (step/mechanisms.py ``Mechanism.owns``, the one rule)."""
    mech, rng = _mech(m), Randomness(SEED)
    priv = dict(expected_batch_size=B, target_epsilon=4.0, target_delta=1e-3)
    plain = PlanSettings.of(mech, n=N, steps=STEPS, **priv)
    assert PlanSettings.of(mech, n=N, steps=STEPS, sampler=mech.sampler(N, B, rng), **priv) == plain
    assert plain.q is None and plain.partition_rate is None
    others = [sample.ScheduledPoissonSampler(N, [(0, B)], rng), UserPoissonSampler(torch.arange(N), B, 2, rng),
              mechanism_of("banded_mf", 2).sampler(N, B, rng), mechanism_of("gaussian", None, 12).sampler(N, B, rng),
              mech.sampler(N, B + 1, rng)]
    for other in others:
        assert not mech.owns(other, N, B), type(other).__name__
        if hasattr(other, "partition_rate") or mech.name != "banded_mf":  # banded MF draws with a cyclic sampler
            assert PlanSettings.of(mech, n=N, steps=STEPS, sampler=other, **priv).q == other.q


def test_make_private_saved_state_carries_the_plan_value(tmp_path):
    """make_private's one written state (``save_noise_state``, banded MF) carries the plan value every way in
    writes (outputs/report.py ``plan_section``), and it round-trips to the σ the loop runs with."""
    from dpft import PrivacyEngine

    model, opt = _model()
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    eng = PrivacyEngine(reproducible_seed=SEED)
    module, opt, crit, loader = eng.make_private(
        module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=B,
        max_grad_norm=1.0, steps=STEPS, target_epsilon=4.0, target_delta=1e-3, mechanism="banded_mf", bands=3)
    assert eng.save_noise_state(tmp_path / "noise.pt")
    saved = torch.load(tmp_path / "noise.pt", weights_only=True)["plan"]
    want = _settings(MECHS[2], target_epsilon=4.0, target_delta=1e-3)
    assert CalibratedPlan.from_dict(saved) == CalibratedPlan(want, eng.noise_multiplier)
    assert saved["sigma"] == eng.noise_multiplier and (saved["n"], saved["steps"], saved["bands"]) == (N, STEPS, 3)
    eng.detach()


@pytest.mark.parametrize("m", MECHS, ids=["poisson", "truncated", "banded"])
def test_the_phase_event_is_built_once(m, monkeypatch):
    """calibrate builds the phase's ``σ -> DpEvent``; make hands the plan that same one (not a rebuilt one)."""
    mech = _mech(m)
    calls = []
    real = type(mech).event_of
    monkeypatch.setattr(type(mech), "event_of", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    model, opt = _model()
    plan = build_privacy_plan(n=N, expected_batch_size=B, steps=STEPS, mechanism=mech, rng=Randomness(SEED),
                              parts=_parts(model, opt), optimizer=opt, target_epsilon=4.0, target_delta=1e-3,
                              prior=PRIOR)
    assert len(calls) == 1 and plan.phase_event is plan.calibrated.settings.phase_event()
    assert plan.calibrated.make(rng=Randomness(SEED), parts=_parts(model, opt), optimizer=opt).phase_event \
        is plan.phase_event and len(calls) == 1


def test_the_privacy_fields_are_declared_once():
    """SessionSettings (a way in's, before N and T) and PlanSettings (the plan's) share one declaration of
    the privacy fields (PrivacySettings); the session's plan is built from ``plan_settings(N, T, sampler)``."""
    from dpft.session import PrivateSession, SessionSettings
    from dpft.step.plan import PrivacySettings

    shared = {f.name for f in dataclasses.fields(PrivacySettings)}
    own = lambda cls: {f.name for f in dataclasses.fields(cls)} - shared  # noqa: E731
    assert issubclass(SessionSettings, PrivacySettings) and issubclass(PlanSettings, PrivacySettings)
    # besides them only the mechanism (a live part; its name and settings) and T (or None; an int) meet
    assert own(SessionSettings) & own(PlanSettings) == {"mechanism", "steps"}
    s = SessionSettings(max_grad_norm=1.0, expected_batch_size=B, mechanism=_mech(MECHS[2]), epochs=1.1,
                        target_epsilon=4, target_delta=1e-3, phase="train")
    assert s.target_epsilon == 4.0 and type(s.target_epsilon) is float  # simple types, coerced once
    assert s.privacy_settings() == {"expected_batch_size": B, "noise_multiplier": None, "target_epsilon": 4.0,
                                    "target_delta": 1e-3, "phase": "train", "private": True, "hardened": True}
    model, opt = _model()
    data = TensorDataset(torch.randn(N, 6), torch.randint(0, 3, (N,)))
    sess = PrivateSession.open(SEED)
    plan = sess.plan(s, rows=data, n_rows=N, rng=sess.rng.child("loop"), parts=_parts(model, opt), optimizer=opt)
    assert sess.planned == 9  # ⌈1.1 · 60 / 8⌉
    assert plan.calibrated.settings == s.plan_settings(N, 9) == _settings(MECHS[2], target_epsilon=4.0,
                                                                          target_delta=1e-3, steps=9)
