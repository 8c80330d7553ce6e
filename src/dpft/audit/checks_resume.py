"""Audit checks of the one secret-state save and restore (issue 34; issue 46 item 4): every way in saves and
restores through the private session (session/core.py ``PrivateSession.secret_state`` /
``restore_secret_state``), so one check runs over the ways in of :data:`WAYS`, each on a banded-MF run:

* **secret state stays secret** — the optimizer's ``state_dict()`` holds no noise buffer and the secret file
  is owner-only (0600); make_private: a fresh engine's ``load_noise_state`` restores buffers, partition and
  ledger; DPTrainer: ``noise_state.secret.pt`` sits in ``output_dir``, nothing of it in ``checkpoint-*``
  (planted ``api_noise_state_in_optimizer``: the buffers in the DP optimizer's state dict, which users save
  and share with their checkpoints). The FSDP2 world's round trip (2 ranks' gathered state resumed by 1 and
  by 3) is audit/checks_fsdp.py's, on the sharded mechanism.

* **rows by content** — a banded-MF run resumed with the same training rows in another order
  (a dataset shuffled without a seed, a re-exported file) would put examples into other secret
  partitions, so they could participate fewer than b steps apart and the recorded
  participations would no longer bound ε. The saved state carries a keyed fingerprint of the
  rows' content (step/fingerprint.py); every way in (``make_private`` + ``load_noise_state``,
  ``DPTrainer`` from its checkpoint) must refuse, and resume the same rows in order (planted ``resume_rows_by_index``: the
  fingerprint check skipped, so only N is compared — the reviewed behaviour).
* **no stale state** — ``make_private`` saved at step 2, released steps 2–3, then a fresh engine
  loads the step-2 state: it must refuse (the live release record holds 4 releases, the state 2);
  otherwise it would replay two steps under fresh noise with a 2-step ledger (planted
  ``api_stale_state_accepted``: the live-record comparison skipped).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft import PrivacyEngine
from dpft.api import state
from dpft.api.optimizer import DPOptimizer
from dpft.audit.planted import bug_planter
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.step import correlated

__all__ = ["PLANTED", "resume_checks", "planted_bug"]

PLANTED = ("resume_rows_by_index", "api_stale_state_accepted", "api_noise_state_in_optimizer")
_N, _B, _BANDS, _STEPS, _SEED = 36, 3, 3, 6, 5


planted_bug = bug_planter(PLANTED, {
    "resume_rows_by_index": lambda p: p.set(correlated, "check_rows", lambda saved, rows, where, fix: None),
    "api_stale_state_accepted": lambda p: p.set(state, "check_fresh", lambda made, saved, record, fix: None),
    "api_noise_state_in_optimizer": lambda p: p.set(DPOptimizer, "state_dict", lambda self: {
        **self.original_optimizer.state_dict(), "dp_noise_state": self.dp_step.spec.mechanism.state()}),
})


def _holds_any(obj, tensors) -> bool:
    """Whether ``obj`` (nested dicts/lists) holds a tensor equal to one of ``tensors``."""
    if isinstance(obj, torch.Tensor):
        return any(obj.shape == t.shape and torch.equal(obj.detach().cpu(), t.detach().cpu()) for t in tensors)
    if isinstance(obj, dict):
        return any(_holds_any(v, tensors) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_any(v, tensors) for v in obj)
    return False


def _secret(mech, optimizer, path: Path) -> list[tuple[bool, str]]:
    """The optimizer's state dict holds none of ``mech``'s buffers; ``path`` is owner-only."""
    leaked = _holds_any(optimizer.state_dict(), [v for b in mech.buffers for v in b.values()])
    mode = os.stat(path).st_mode & 0o777 if path.is_file() else None
    return [(not leaked, f"optimizer.state_dict() {'HOLDS' if leaked else 'holds no'} noise buffer"),
            (mode == 0o600, f"{path.name} mode {oct(mode) if mode else 'MISSING'} (0o600)")]


def _snapshot(eng, opt) -> tuple:
    m = opt.dp_step.spec.mechanism
    return m.next_step, eng.ledger.steps, m.sampler.partition.clone(), [{k: v.clone() for k, v in b.items()}
                                                                         for b in m.buffers]


def _same(a: tuple, b: tuple) -> bool:
    return a[:2] == b[:2] and torch.equal(a[2], b[2]) and len(a[3]) == len(b[3]) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[3], b[3]))


def _data(order=None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(_N, 4, generator=g), torch.randint(0, 2, (_N,), generator=g)
    return TensorDataset(x[order], y[order]) if order is not None else TensorDataset(x, y)


def _loop(data, upto: int, save=None, load=None, seen: Optional[dict] = None):
    """make_private's banded-MF loop to step ``upto``: ``save=(step, path)`` saves the noise state at that step,
    ``load`` loads one first; ``seen`` gets the secret findings at the save and the state just loaded."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    eng, seen = PrivacyEngine(reproducible_seed=_SEED), {} if seen is None else seen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=_B, max_grad_norm=1.0, steps=_STEPS, noise_multiplier=1.0,
            mechanism="banded_mf", bands=_BANDS)
        if load is not None:
            eng.load_noise_state(load)
            seen["loaded"] = _snapshot(eng, opt)
        while opt.logical_steps < upto:
            for x, y in loader:
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
                if save is not None and opt.logical_steps == save[0]:
                    eng.save_noise_state(save[1])
                    seen.update(saved=_snapshot(eng, opt), secret=_secret(opt.dp_step.spec.mechanism, opt, save[1]))
                if opt.logical_steps >= upto:
                    break
    eng.detach()
    return eng


def _refused(fn) -> tuple[bool, str]:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return True, str(exc).split(";")[0][:160]
    return False, "accepted"


def _make_private_resume(d: Path) -> tuple:
    """make_private: 3 steps saved, then fresh engines load the state over the rows reordered and in order."""
    path, seen = d / "noise.secret.pt", {}
    _loop(_data(), 3, save=(3, path), seen=seen)
    order = torch.randperm(_N, generator=torch.Generator().manual_seed(1))
    reordered = _refused(lambda: _loop(_data(order), _STEPS, load=path))
    same = _refused(lambda: _loop(_data(), _STEPS, load=path, seen=seen))
    ok = "loaded" in seen and _same(seen["saved"], seen["loaded"])
    return reordered, same, seen["secret"] + [(ok, f"a fresh engine restored buffers, partition and ledger: {ok}")]


def _trainer_resume(d: Path) -> tuple:
    """DPTrainer: 2 steps with a checkpoint, then resumed from it over the rows shuffled and in order."""
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    ds, out = tiny_rows(24, 5), d / "hf"

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 2

    def trainer(data, callbacks=None):
        args = TrainingArguments(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=3,
                                 save_strategy="steps", save_steps=2)
        dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=6, mechanism="banded_mf",
                         bands=2, reproducible_seed=_SEED)
        return DPTrainer(model=tiny_classifier("bert", max_len=16).train(), args=args, train_dataset=data,
                         data_collator=default_data_collator, dp_args=dp, callbacks=callbacks)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = trainer(ds, [StopAt()])
        tr.train()
        secret = _secret(tr.mechanism, tr.optimizer, out / "noise_state.secret.pt")
        bufs = [v for b in tr.mechanism.buffers for v in b.values()]
        in_ckpt = [f"{ck.name}/{f.name}" for ck in out.glob("checkpoint-*") for f in ck.iterdir()
                   if "noise" in f.name or (f.suffix in (".pt", ".bin") and f.name != "training_args.bin"
                                            and _holds_any(torch.load(f, weights_only=False, map_location="cpu"), bufs))]
        ckpt = str(out / "checkpoint-2")
        reordered = _refused(lambda: trainer(ds.shuffle(seed=3)).train(resume_from_checkpoint=ckpt))
        same = _refused(lambda: trainer(ds).train(resume_from_checkpoint=ckpt))
    return reordered, same, secret + [(not in_ckpt, f"noise state in checkpoint-*: {in_ckpt or 'none'}")]


#: The ways in of the secret-state check: ``(name, resume(tmp_dir) -> ((refused, why) of the rows reordered,
#: (refused, why) of the rows in order, [(ok, what)] of the saved secret state))``.
WAYS = (("make_private", _make_private_resume), ("DPTrainer", _trainer_resume))


def resume_checks(planted: Optional[str] = None) -> list[Check]:
    """Every way in of :data:`WAYS` keeps its saved state secret, refuses the same rows reordered and resumes
    them in order (banded_mf); make_private refuses a stale state. ``planted``: one of :data:`PLANTED` (or None)."""
    out = []
    with planted_bug(planted), tempfile.TemporaryDirectory() as d:
        for name, resume in WAYS:
            (ref, why), (same, why_same), secret = resume(Path(d) / name)
            out.append(Check(f"secret state: {name} keeps the saved noise state secret (banded_mf)",
                             all(ok for ok, _ in secret), "; ".join(what for _, what in secret), {}))
            out.append(Check(f"resume: {name} refuses the same rows reordered (banded_mf)", ref and not same,
                             f"reordered: {why}; same order: {'refused: ' + why_same if same else 'resumed'}",
                             {"refused": ref}))
        stale = Path(d) / "stale.secret.pt"
        _loop(_data(), 4, save=(2, stale))
        ref_stale, why_stale = _refused(lambda: _loop(_data(), _STEPS, load=stale))
    out.append(Check("resume: make_private refuses a noise state older than its last release", ref_stale,
                     f"saved at step 2, 4 released: {why_stale}", {"refused": ref_stale}))
    return out
