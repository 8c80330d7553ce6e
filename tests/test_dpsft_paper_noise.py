"""Issue 18, DP-SFT: ``subspace.paper_noise_placement`` (σC after averaging = σB on the sum),
certified as an upper bound because the extra noise is independent post-processing."""

import pytest
import torch

from dpft.accounting.calibrate import epsilon_for_sigma


def _recipe(model_dir, files, **extra):
    from dpft.config.recipe import load_recipe

    ov = {
        "model.name": str(model_dir), "model.max_length": 16,
        "task.name": "files", "task.train_file": str(files["csv"]),
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 8,
        "schedule.steps": 2, "eval.every_steps": 2, "checkpoint_every": 2,
        "privacy.target_epsilon": 2.0, "privacy.delta": 1e-3,
        "trainable.mode": "last_k", "trainable.last_k": 1, "optimizer.lr": 1e-2,
        "subspace.paper_noise_placement": True,
    }
    ov.update(extra)
    return load_recipe(None, ov)


def test_paper_placement_is_sigma_b_on_the_sum_and_accounted_at_sigma(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    tr = Trainer(_recipe(tiny_model_dir, sst_like_files), tmp_path / "r", progress=False)
    mech = tr.dp_step.spec.mechanism
    c = tr.recipe.privacy.clipping.max_norm
    assert mech.std == pytest.approx(tr.sigma * 8 * c)  # σC after averaging over B = 8
    assert mech.accounted_sigma == pytest.approx(tr.sigma)
    # the noise actually drawn on a zero sum has that std
    noisy = mech.add_noise({"w": torch.zeros(20000)}, step=0)["w"]
    assert noisy.std().item() == pytest.approx(tr.sigma * 8 * c, rel=0.03)
    rep = tr.run()
    assert rep["privacy"]["guarantee"] == "certified" and rep["privacy"]["epsilon"] <= 2.0 + 1e-9
    assert "upper bound" in rep["subspace"]["paper_noise_placement"]
    assert rep["subspace"]["effective_noise_multiplier"] == pytest.approx(8 * tr.sigma)
    # why the ledger's ε bounds the run: ε is decreasing in σ (more independent noise = post-processing)
    assert epsilon_for_sigma(8 * tr.sigma, tr.q, 2, 1e-3) < epsilon_for_sigma(tr.sigma, tr.q, 2, 1e-3)


def test_without_the_flag_the_noise_is_sigma_c(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer

    tr = Trainer(_recipe(tiny_model_dir, sst_like_files, **{"subspace.paper_noise_placement": False}),
                 tmp_path / "r", progress=False)
    assert tr.dp_step.spec.mechanism.std == pytest.approx(tr.sigma * tr.recipe.privacy.clipping.max_norm)
