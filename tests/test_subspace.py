"""DP-SFT: basis construction, per-example subspace coordinates, clipping in R^k, noise in
span(P), ledger composition of a private stage 1."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_batch, tiny_classifier
from dpft.accounting.calibrate import dp_sgd_event
from dpft.accounting.ledger import epsilon_of
from dpft.grads.reference import ReferenceEngine
from dpft.grads.subspace import COORDS, SubspaceEngine
from dpft.models.losses import classification_loss
from dpft.step.clip import FlatClip
from dpft.transforms.subspace import (SubspaceBasis, SubspaceError, basis_from_snapshots,
                                      snapshot_schedule)


def _snapshots(m=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(m, 5, 4, generator=g), "b.bias": torch.randn(m, 3, generator=g)}


def _flat(blocks_or_snaps, k):
    return torch.cat([v.reshape(k, -1) for v in blocks_or_snaps.values()], dim=1)


# ------------------------------------------------------------------ basis


def test_basis_orthonormal_and_spans_snapshots():
    snaps = _snapshots(m=6)
    basis = basis_from_snapshots(snaps, k=6)
    torch.testing.assert_close(basis.gram(), torch.eye(6, dtype=torch.float64), atol=1e-6, rtol=0)
    a = _flat(snaps, 6).double()  # (m, d)
    p = _flat(basis.blocks, 6).double().T  # (d, k)
    resid = a.T - p @ (p.T @ a.T)  # every snapshot lies in span(P)
    assert resid.norm() < 1e-4 * a.norm()


def test_basis_top_k_matches_truncated_svd():
    snaps = _snapshots(m=7, seed=1)
    basis = basis_from_snapshots(snaps, k=3)
    a = _flat(snaps, 7).double()
    _, s, vh = torch.linalg.svd(a, full_matrices=False)  # tiny d: the textbook answer
    p = _flat(basis.blocks, 3).double().T
    torch.testing.assert_close(p @ p.T, vh[:3].T @ vh[:3], atol=1e-5, rtol=0)  # same projector
    torch.testing.assert_close(basis.singular_values, s[:3], atol=1e-6, rtol=1e-6)


def test_basis_errors_name_the_fix():
    snaps = _snapshots(m=4)
    with pytest.raises(SubspaceError, match="record at least k snapshots"):
        basis_from_snapshots(snaps, k=5)
    twice = {n: torch.cat([v[:2], v[:2]]) for n, v in snaps.items()}  # rank 2
    with pytest.raises(SubspaceError, match="rank"):
        basis_from_snapshots(twice, k=3)
    with pytest.raises(SubspaceError, match="never moved"):
        basis_from_snapshots({n: torch.zeros_like(v) for n, v in snaps.items()}, k=2)


def test_save_load_roundtrip_and_bf16_size(tmp_path):
    basis = basis_from_snapshots(_snapshots(), k=4)
    basis.start = {"a.weight": torch.ones(5, 4), "b.bias": torch.zeros(3)}
    basis.meta["source"] = "public"
    f = basis.save(tmp_path / "b.safetensors")
    back = SubspaceBasis.load(f)
    for n in basis.blocks:
        torch.testing.assert_close(back.blocks[n], basis.blocks[n], rtol=0, atol=0)
        torch.testing.assert_close(back.start[n], basis.start[n], rtol=0, atol=0)
    assert back.meta["source"] == "public" and back.k == 4 and back.dim == 23
    half = basis.to("bfloat16")
    assert half.nbytes * 2 == basis.nbytes == 4 * 23 * 4
    torch.testing.assert_close(half.gram(), torch.eye(4, dtype=torch.float64), atol=3e-2, rtol=0)
    with pytest.raises(SubspaceError, match="not found"):
        SubspaceBasis.load(tmp_path / "missing.safetensors")


def test_snapshot_schedule_rounds_t1_to_multiple_of_m():
    t1, after = snapshot_schedule(10, 4)
    assert t1 == 12 and after == [3, 6, 9, 12]


# ------------------------------------------------------------------ stage-2 engine


def _random_basis(model, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    snaps = {n: torch.randn(k + 2, *p.shape, generator=g) for n, p in model.named_parameters() if p.requires_grad}
    return basis_from_snapshots(snaps, k)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_coordinates_equal_projected_reference_gradients(kind):
    """s_i = Pᵀ flat(g_i), with embeddings (index side), Linear/Conv1D, LayerNorm, biases."""
    model = tiny_classifier(kind)
    batch = random_batch(b=5, t=7)
    if kind == "gpt2":
        batch.pop("position_ids")
    basis = _random_basis(model, k=6)
    eng = SubspaceEngine(model, classification_loss, FlatClip(1.0), basis)
    coords, _ = eng.coordinates(batch)
    ref, _ = ReferenceEngine(model, classification_loss, FlatClip(1.0)).per_example_grads(batch)
    expected = torch.stack([basis.project({n: ref[n][i] for n in ref}) for i in range(5)])
    torch.testing.assert_close(coords, expected, rtol=1e-4, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_clipping_holds_in_rk():
    model = tiny_classifier("bert")
    batch = random_batch(b=6, t=7)
    basis = _random_basis(model, k=5)
    c = 0.022
    eng = SubspaceEngine(model, classification_loss, FlatClip(c), basis)
    coords, _ = eng.coordinates(batch)
    res = eng.clipped_sum(batch)
    assert res.sq_norms.shape == (6, 1) and res.scales.shape == (6, 1)
    norms = coords.norm(dim=1)
    assert (norms > c).any(), "the test needs some examples above C"
    clipped = coords * res.scales
    assert (clipped.norm(dim=1) <= c * (1 + 1e-5)).all()
    torch.testing.assert_close(res.grad_sum[COORDS], clipped.sum(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.sq_norms[:, 0], norms.pow(2), rtol=1e-5, atol=1e-8)


def test_basis_must_span_the_trainable_parameters():
    model = tiny_classifier("bert")
    basis = _random_basis(model, k=3)
    model.classifier.weight.requires_grad_(False)
    with pytest.raises(SubspaceError, match="exactly the trainable parameters"):
        SubspaceEngine(model, classification_loss, FlatClip(1.0), basis)


# ------------------------------------------------------------------ through the loop


def _recipe(model_dir, files, **extra):
    from dpft.config.recipe import load_recipe

    ov = {
        "model.name": str(model_dir), "model.max_length": 16,
        "task.name": "files", "task.train_file": str(files["csv"]),
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 4,
        "schedule.steps": 3, "eval.every_steps": 3, "checkpoint_every": 3,
        "privacy.target_epsilon": 6.0, "privacy.delta": 1e-3,
        "trainable.mode": "last_k", "trainable.last_k": 1,
        "optimizer.lr": 1e-2,
        "subspace.k": 4, "subspace.steps": 4,
    }
    ov.update(extra)
    return load_recipe(None, ov)


def test_private_stage1_is_composed_in_the_ledger(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    # ε = 2 keeps σ ≳ 0.9, where the PLD calibration is quick.
    rec = _recipe(tiny_model_dir, sst_like_files, **{"subspace.source": "private", "subspace.budget_share": 0.4,
                                                     "privacy.target_epsilon": 2.0})
    tr = Trainer(rec, tmp_path / "run", progress=False)
    phases = [e.phase for e in tr.ledger.entries]
    assert phases == ["subspace"]  # stage 1 recorded before stage 2 was calibrated
    rep = tr.run()
    ents = tr.ledger.entries
    assert [e.phase for e in ents] == ["subspace", "train"]
    q = tr.q  # 8 / N, N = 54 after the dev split
    s1 = json.loads((tmp_path / "run" / "subspace" / "stage1" / "report.json").read_text())
    sigma1 = s1["dp"]["noise_multiplier"]
    assert ents[0].count == 4 and ents[1].count == 3
    # The reported ε is the PLD composition of exactly these two phases...
    events = [dp_sgd_event(sigma1, q, 4), dp_sgd_event(tr.sigma, q, 3)]
    eps = epsilon_of(events, 1e-3).epsilon
    assert rep["privacy"]["epsilon"] == pytest.approx(eps, rel=1e-9)
    # ...which meets the target, while stage 1 alone met p1·ε and stage 2 alone gets more than p2·ε.
    assert eps <= 2.0 + 1e-9
    assert s1["privacy"]["epsilon"] <= 0.4 * 2.0 + 1e-9
    assert epsilon_of(events[1:], 1e-3).epsilon > 0.6 * 2.0
    assert rep["subspace"]["source"] == "private" and rep["dp"]["engine"] == "SubspaceEngine"


@pytest.mark.parametrize("space", ["full", "coords"])
def test_update_and_noise_live_in_span_of_p(tiny_model_dir, sst_like_files, tmp_path, space):
    """SGD on a public basis: Θ_T − Θ* ∈ span(P) (noise included: it is drawn in R^k)."""
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, **{
        "subspace.source": "public", "subspace.public_task": {"name": "files", "train_file": str(sst_like_files["tsv"])},
        "subspace.optimizer_space": space, "optimizer.name": "sgd", "optimizer.lr": 0.5,
        "privacy.target_epsilon": 0.5})
    tr = Trainer(rec, tmp_path / space, progress=False)
    assert tr.ledger.entries == []  # a public basis costs nothing
    names = tr.method("dpsft").basis.names
    start = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n in names}
    for n in names:
        torch.testing.assert_close(start[n], tr.method("dpsft").basis.start[n])  # stage 2 starts from Θ*
    rep = tr.run()
    delta = torch.cat([(dict(tr.model.named_parameters())[n].detach() - start[n]).reshape(-1) for n in names])
    p = torch.cat([tr.method("dpsft").basis.blocks[n].reshape(tr.method("dpsft").basis.k, -1) for n in names], 1).T  # (d, k)
    assert delta.norm() > 1e-3
    resid = delta - p @ (p.T @ delta)
    assert resid.norm() < 1e-4 * delta.norm()
    assert rep["subspace"]["public_source"].startswith("non-private fine-tuning on public task 'files'")
    assert [e.phase for e in tr.ledger.entries] == ["train"]


def test_file_source_reuses_a_saved_basis_and_its_events(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    fixed = {"privacy.noise_multiplier": 1.0}  # no calibration: this test is about the file
    a = Trainer(_recipe(tiny_model_dir, sst_like_files, **{"subspace.source": "private", **fixed}), tmp_path / "a",
                progress=False)
    f = tmp_path / "a" / "subspace" / "basis.safetensors"
    assert f.is_file()
    b = Trainer(_recipe(tiny_model_dir, sst_like_files, **{"subspace.source": "file", "subspace.file": str(f),
                                                           **fixed}), tmp_path / "b", progress=False)
    assert [e.phase for e in b.ledger.entries] == ["subspace"]  # a private basis brings its cost along
    assert b.ledger.entries[0].event == a.ledger.entries[0].event and b.ledger.entries[0].count == 4
    for n in a.method("dpsft").basis.blocks:
        torch.testing.assert_close(a.method("dpsft").basis.blocks[n], b.method("dpsft").basis.blocks[n], rtol=0, atol=0)


def test_non_private_subspace_run_is_refused(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, **{
        "privacy.enabled": False, "subspace.source": "public",
        "subspace.public_task": {"name": "files", "train_file": str(sst_like_files["tsv"])}})
    with pytest.raises(SubspaceError, match="privacy.enabled"):
        Trainer(rec, tmp_path / "np", progress=False)


def test_resume_reuses_the_basis_and_equals_an_uninterrupted_run(tiny_model_dir, sst_like_files, tmp_path,
                                                                  monkeypatch):
    """Coordinates mode (Adam on the k coordinates): crash after the step-3 checkpoint, resume."""
    from dpft.run.loop import Trainer

    rec = _recipe(tiny_model_dir, sst_like_files, **{
        "subspace.source": "private", "subspace.optimizer_space": "coords", "schedule.steps": 4,
        "checkpoint_every": 2, "eval.every_steps": 4, "privacy.noise_multiplier": 1.0,
        "privacy.reproducible": True})
    a = Trainer(rec, tmp_path / "a", progress=False)
    rep_a = a.run()
    real_step = Trainer.step

    def crashing(self, step):
        if step == 3:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    b = Trainer(rec, tmp_path / "b", progress=False)
    monkeypatch.setattr(Trainer, "step", crashing)
    with pytest.raises(KeyboardInterrupt):
        b.run()
    monkeypatch.setattr(Trainer, "step", real_step)
    c = Trainer(rec, tmp_path / "b", resume=True, progress=False, allow_overspend=True)  # all 4 steps (issue 36)
    rep_c = c.run()
    for n, p in a.model.named_parameters():
        torch.testing.assert_close(p, dict(c.model.named_parameters())[n], rtol=0, atol=0)
    # the live ledger is continued: step 3 ran before the crash and again after it
    assert [(e.phase, e.count) for e in c.ledger.entries] == [("subspace", 4), ("train", 5)]
    assert rep_c["privacy"]["epsilon"] >= rep_a["privacy"]["epsilon"]
