"""One clip builder for every way in (issue 46 item 3): step/clip.py ``build_clip_policy`` from
``ClipSettings``. ``dpft train`` (step/build.py ``build_clip``, the recipe's keys), ``make_private``
(api/clipping.py ``api_clip_and_engine``, its keywords) and ``DPTrainer`` (``DPArguments.clip_settings``)
translate their own arguments into it and get the same policy: same class, C, sensitivity and clip
factors on the same per-example norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpft.methods  # noqa: F401  (hands the recipe schema the method registry)
from dpft.api.arguments import PrivacyArguments
from dpft.api.clipping import api_clip_and_engine
from dpft.config import load_recipe
from dpft.grads.groups import PerExampleOverK
from dpft.integrations.hf import DPArguments
from dpft.step.build import build_clip
from dpft.step.clip import ClipSettings, GroupClip, HeadBodyClip, build_clip_policy, make_clip_policy


class HeadNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.classifier = nn.Linear(4, 2)  # a head by name (models/load.py is_head_param)

    def forward(self, x):
        return self.classifier(self.body(x))


def _sq_norms(g: int = 4, b: int = 6) -> torch.Tensor:
    return torch.rand(b, g, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 9


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.max_norm == pytest.approx(b.max_norm) and a.sensitivity == pytest.approx(b.sensitivity)
    sq = _sq_norms()
    assert torch.equal(a.scales(sq), b.scales(sq))


@pytest.mark.parametrize("style", ["flat", "per_layer", "automatic", "head_body"])
@pytest.mark.parametrize("k", [None, 3])
def test_the_three_ways_in_get_one_policy(style, k):
    c, f, mask = 2.0, 0.3, [False, False, True, True]  # HeadNet: body.weight, body.bias | classifier.*
    recipe = load_recipe(None, {"privacy.clipping.style": style, "privacy.clipping.max_norm": c,
                                "privacy.clipping.head_fraction": f})
    cli = build_clip(recipe.privacy, "per_example_over_k" if k else None, k or 1)
    dp = DPArguments(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0, max_grad_norm=c, clipping=style,
                     head_fraction=f, user_column="who" if k else None, max_rows_per_user=k or 4,
                     user_clipping="per_example_over_k")
    trainer = build_clip_policy(dp.clip_settings())
    for clip in (cli, trainer):  # the head mask reaches them through the step spec (step/build.py)
        if hasattr(clip, "set_head_mask"):
            clip.set_head_mask(mask)
    model = HeadNet()
    p = PrivacyArguments(max_grad_norm=c, clipping=style, head_fraction=f, user_ids=[0, 1] if k else None,
                         max_rows_per_user=k or 4, user_clipping="per_example_over_k")
    api, engine = api_clip_and_engine(model, torch.optim.SGD(model.parameters(), lr=0.1), p.clipping,
                                      p.max_grad_norm, p.head_fraction, None, "auto", p.over_k)
    assert engine.clip is api
    _same(cli, trainer)
    _same(cli, api)
    if k:  # each row clipped to C/k: a user's k rows sum to ≤ C
        assert isinstance(api, PerExampleOverK) and api.inner.max_norm == pytest.approx(c / k)
        assert api.sensitivity == pytest.approx(c)
    if style == "head_body":
        inner = api.inner if k else api
        assert isinstance(inner, HeadBodyClip) and inner.head_mask.tolist() == mask


def test_the_builder_is_make_clip_policy_at_c_or_c_over_k():
    s = ClipSettings("automatic", 1.5, gamma=0.05)
    _same(build_clip_policy(s), make_clip_policy("automatic", 1.5, 0.05))
    over = build_clip_policy(ClipSettings("flat", 1.5, over_k=3))
    _same(over.inner, make_clip_policy("flat", 0.5))
    hb = build_clip_policy(ClipSettings("head_body", 1.0, head_fraction=0.25), head_mask=[True, False, False, False])
    assert hb.head_mask.tolist() == [True, False, False, False]


def test_per_group_needs_its_groups_and_keeps_each_unit_within_c():
    with pytest.raises(ValueError, match="per_group.*param group"):
        build_clip_policy(ClipSettings("per_group", 1.0))
    clip = build_clip_policy(ClipSettings("per_group", 2.0, over_k=2), groups=([0, 0, 1, 1], [0.25, 0.75]))
    assert isinstance(clip, PerExampleOverK) and isinstance(clip.inner, GroupClip)
    sq = _sq_norms()
    clipped = (clip.scales(sq) ** 2 * sq).sum(dim=1).sqrt()
    assert bool((clipped <= 1.0 + 1e-9).all())  # one row ≤ C/k = 1
    with pytest.raises(ValueError, match="sum to ≤ 1"):
        build_clip_policy(ClipSettings("per_group", 1.0), groups=([0, 1], [0.8, 0.8]))


def test_make_private_translates_its_param_groups_and_head():
    model = HeadNet()
    opt = torch.optim.SGD([{"params": model.body.parameters(), "clip_fraction": 0.2},
                           {"params": model.classifier.parameters()}], lr=0.1)
    clip, _ = api_clip_and_engine(model, opt, "per_group", 1.0, 0.5, None, "auto")
    assert clip.group_of.tolist() == [0, 0, 1, 1] and clip.fractions == pytest.approx([0.2, 0.8])
    clip, _ = api_clip_and_engine(model, opt, "head_body", 1.0, 0.5, [model.body.bias], "auto")
    assert clip.head_mask.tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="make_private: clipping='head_body' needs a head"):
        api_clip_and_engine(nn.Linear(2, 2), opt, "head_body", 1.0, 0.5, None, "auto")


def test_dp_arguments_clip_settings_only_at_user_level_over_k():
    base = dict(target_delta=1e-3, expected_batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0,
                max_rows_per_user=3)
    assert DPArguments(**base, user_clipping="per_example_over_k").clip_settings().over_k is None  # example level
    assert DPArguments(**base, user_column="who").clip_settings().over_k is None  # group clipping
    assert DPArguments(**base, user_column="who", user_clipping="per_example_over_k").clip_settings().over_k == 3
    assert PrivacyArguments(max_grad_norm=1.0, user_ids="who", max_rows_per_user=3,
                            user_clipping="per_example_over_k").over_k == 3
    assert PrivacyArguments(max_grad_norm=1.0).over_k is None
