"""Planted bugs: the auditor's self-test (``dpft audit RECIPE --plant NAME``, hidden).

Each name breaks one thing the ε depends on; the audit must then FAIL. The report of a planted
run says so in its headline: it is a test of the auditor, never an audit of the recipe.

* The mechanism's parts (issue 14; patched here for the duration of :func:`plant`):
  ``noise/4``, ``clipping off``, ``per-layer without 1/sqrt(G)``, ``clip at 2C``,
  ``same noise every step``, ``no subsampling``, ``known seed``.
* The Trainer's path (``audit/trainer_walk.py``): ``row_level_user_recipe`` (the audit's plan
  calibrated over rows for a user-level recipe), ``user_clipping_broken``.
* Randomness (``audit/checks_randomness.py``, when installed): ``seed32``, ``shared_device_noise``.
* The Python ways in (``audit/checks_api.py``, when installed): ``double_capture``,
  ``unfrozen_param``, ``packing_collator``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from dpft.audit.trainer_walk import PLANTED as TRAINER_PLANTED, USER_CLIPPING_BROKEN

KNOWN_SEED = 1234

MECHANISM_PLANTED = ("noise/4", "clipping off", "per-layer without 1/sqrt(G)", "clip at 2C",
                     "same noise every step", "no subsampling", "known seed")
RANDOMNESS_PLANTED = ("seed32", "shared_device_noise")
API_PLANTED = ("double_capture", "unfrozen_param", "packing_collator")
ALL = MECHANISM_PLANTED + TRAINER_PLANTED + RANDOMNESS_PLANTED + API_PLANTED


class _Patches:
    def __init__(self):
        self.saved: list = []

    def set(self, obj, name: str, value) -> None:
        self.saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.saved.clear()


_MISSING = object()


def _clip_2c(orig):
    def scales(self, sq):
        c = self.max_norm
        self.max_norm = 2 * c
        try:
            return orig(self, sq)
        finally:
            self.max_norm = c

    return scales


def apply(name: Optional[str], set_attr: Callable[[object, str, object], None]) -> dict:
    """Apply planted bug ``name`` (None or ``"honest"``: nothing) with ``set_attr(obj, attr,
    value)`` (e.g. pytest's ``monkeypatch.setattr``, which undoes it); returns extra
    ``run_audit`` arguments (``known seed``: the seed the auditor is given).

    Raises:
        ValueError: an unknown name (the message lists them)."""
    if name in (None, "honest"):
        return {}
    if name not in ALL:
        raise ValueError(f"unknown planted bug {name!r}; one of {list(ALL)}")
    from dpft.privacy.randomness import Randomness
    from dpft.step import clip as clipmod
    from dpft.step.noise import GaussianMechanism
    from dpft.step.sample import PoissonSampler, UserPoissonSampler

    styles = (clipmod.FlatClip, clipmod.PerLayerClip, clipmod.AutoClip, clipmod.HeadBodyClip)
    if name == "noise/4":
        set_attr(GaussianMechanism, "std", property(lambda self: self.sigma * self.sensitivity / 4))
    elif name == "clipping off":
        for cls in styles:
            set_attr(cls, "scales", lambda self, sq: torch.ones_like(sq))
    elif name == "per-layer without 1/sqrt(G)":
        set_attr(clipmod.PerLayerClip, "scales",
                 lambda self, sq: (self.max_norm / (sq.clamp_min(0).sqrt() + clipmod.EPS)).clamp(max=1.0))
    elif name == "clip at 2C":
        for cls in styles:
            set_attr(cls, "scales", _clip_2c(cls.scales))
    elif name == "same noise every step":
        orig_add = GaussianMechanism.add_noise
        set_attr(GaussianMechanism, "add_noise", lambda self, s, step: orig_add(self, s, 0))
    elif name == "no subsampling":
        orig_draw = PoissonSampler.draw
        set_attr(PoissonSampler, "draw", lambda self, step, q: orig_draw(self, step, 1.0))
    elif name == "known seed":
        orig_init = Randomness.__init__

        def init(self, seed=None, *a, **k):
            orig_init(self, KNOWN_SEED if seed is None else seed, *a, **k)
            self.reproducible = seed is not None

        set_attr(Randomness, "__init__", init)
        return {"known_seed": KNOWN_SEED}
    elif name == USER_CLIPPING_BROKEN:
        # every row its own "user": a user of k rows contributes up to kC
        set_attr(UserPoissonSampler, "groups", lambda self, micro: torch.arange(len(micro)))
    return {}


@contextlib.contextmanager
def plant(name: Optional[str]) -> Iterator[dict]:
    """:func:`apply` for the duration of the block (undone on exit)."""
    p = _Patches()
    try:
        yield apply(name, p.set)
    finally:
        p.undo()


# EW-FT ldp.train_pre (issue 29; audit/checks_ewft.py plants them): pre(·) updated from the
# un-noised clipped sum; the two releases of a step recorded as two separately sampled events.
EWFT_PLANTED = ("train_pre_without_noise", "train_pre_sampled_twice")
ALL = ALL + EWFT_PLANTED
