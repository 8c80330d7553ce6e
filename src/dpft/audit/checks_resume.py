"""Audit checks of the one state/resume path (issue 34): the independent review's two
reproductions must be refused in every way in (one check over :data:`WAYS`, issue 46 item 4).

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

import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpft.audit.whitebox import Check
from dpft import PrivacyEngine
from dpft.api import state
from dpft.audit.planted import bug_planter
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.step import correlated

__all__ = ["PLANTED", "resume_checks", "planted_bug"]

PLANTED = ("resume_rows_by_index", "api_stale_state_accepted")
_N, _B, _BANDS, _STEPS, _SEED = 36, 3, 3, 6, 5


planted_bug = bug_planter(PLANTED, {
    "resume_rows_by_index": lambda p: p.set(correlated, "check_rows", lambda saved, rows, where, fix: None),
    "api_stale_state_accepted": lambda p: p.set(state, "check_fresh", lambda made, saved, record, fix: None),
})


def _data(order=None) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(_N, 4, generator=g), torch.randint(0, 2, (_N,), generator=g)
    return TensorDataset(x[order], y[order]) if order is not None else TensorDataset(x, y)


def _loop(data, upto: int, save=None, load=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    eng = PrivacyEngine(reproducible_seed=_SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            dataset=data, expected_batch_size=_B, max_grad_norm=1.0, steps=_STEPS, noise_multiplier=1.0,
            mechanism="banded_mf", bands=_BANDS)
        if load is not None:
            eng.load_noise_state(load)
        while opt.logical_steps < upto:
            for x, y in loader:
                crit(module(x), y).backward()
                opt.step()
                opt.zero_grad()
                if save is not None and opt.logical_steps == save[0]:
                    eng.save_noise_state(save[1])
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


def _make_private_resume(d: Path, reordered: bool) -> tuple[bool, str]:
    """make_private: 3 steps saved, then a fresh engine loads the state over the rows (reordered or not)."""
    path = d / "noise.secret.pt"
    if not path.is_file():
        _loop(_data(), 3, save=(3, path))
    order = torch.randperm(_N, generator=torch.Generator().manual_seed(1)) if reordered else None
    return _refused(lambda: _loop(_data(order), _STEPS, load=path))


def _trainer_resume(d: Path, reordered: bool) -> tuple[bool, str]:
    """DPTrainer: 2 steps with a checkpoint, then resumed from it over the rows (shuffled or not)."""
    import datasets
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments, \
        default_data_collator

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (24, 5), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones(24, 5).long().tolist(),
                                     "labels": torch.randint(0, 2, (24,), generator=g).tolist()})
    out = d / ("hf-reordered" if reordered else "hf-same")

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 2

    def trainer(data, callbacks=None):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16, max_position_embeddings=16)
        args = TrainingArguments(output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=8, report_to=[],
                                 use_cpu=True, logging_steps=100, disable_tqdm=True, max_steps=3,
                                 save_strategy="steps", save_steps=2)
        dp = DPArguments(noise_multiplier=1.0, target_delta=1e-3, expected_batch_size=6, mechanism="banded_mf",
                         bands=2, reproducible_seed=_SEED)
        return DPTrainer(model=BertForSequenceClassification(cfg).train(), args=args, train_dataset=data,
                         data_collator=default_data_collator, dp_args=dp, callbacks=callbacks)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(ds, [StopAt()]).train()
        rows = ds.shuffle(seed=3) if reordered else ds
        return _refused(lambda: trainer(rows).train(resume_from_checkpoint=str(out / "checkpoint-2")))


#: The ways in of the resume check: ``(name, resume(tmp_dir, reordered) -> (refused, why))``.
WAYS = (("make_private", _make_private_resume), ("DPTrainer", _trainer_resume))


def resume_checks(planted: Optional[str] = None) -> list[Check]:
    """Every way in of :data:`WAYS` refuses the same rows reordered and resumes them in order (banded_mf);
    make_private refuses a stale state. ``planted``: one of :data:`PLANTED` (or None)."""
    out = []
    with planted_bug(planted), tempfile.TemporaryDirectory() as d:
        for name, resume in WAYS:
            ref, why = resume(Path(d), True)
            same, why_same = resume(Path(d), False)
            out.append(Check(f"resume: {name} refuses the same rows reordered (banded_mf)", ref and not same,
                             f"reordered: {why}; same order: {'refused: ' + why_same if same else 'resumed'}",
                             {"refused": ref}))
        stale = Path(d) / "stale.secret.pt"
        _loop(_data(), 4, save=(2, stale))
        ref_stale, why_stale = _refused(lambda: _loop(_data(), _STEPS, load=stale))
    out.append(Check("resume: make_private refuses a noise state older than its last release", ref_stale,
                     f"saved at step 2, 4 released: {why_stale}", {"refused": ref_stale}))
    return out
