"""Audit checks of issue 44 item 2: every update of the weights is a DP release, in every Python
way in (step/guard.py, integrations/hf/checks.py ``LOOP_METHODS``).

* **custom training loop refused** — ``privatize_trainer`` of a ``Trainer`` subclass with its own
  ``_inner_training_loop`` (the review's reproduction: the DP step never ran, the ledger held 0
  releases, the card stated (0, δ)-DP) and a ``DPTrainer`` subclass with its own ``train`` are
  refused (``ValueError``).
* **DPTrainer: updates = releases** — a short honest ``DPTrainer`` run, with the audit's own
  counter on the optimizer (independent of the guard): it finishes, and its optimizer steps equal
  the ledger's training releases (> 0).
* **make_private: raw update refused** — a ``make_private`` loop whose user steps the optimizer
  they passed in on a raw gradient: refused, the weights unchanged.
* **weights moved without a release** — a ``DPTrainer`` whose training loop (patched on the
  instance, beyond any class check) writes the weights itself: ``train()`` raises at its end.

Planted bugs: ``trainer_step_skips_release`` (DPTrainer's step falls back to a stock backward after
its first step: a Trainer path that updates without the DP step), ``custom_loop_accepted`` (the
loop refusal off), ``raw_update_accepted`` (the optimizer hook off), ``weights_moved_unreleased``
(the end-of-training check off). Each makes its check fail.
"""

from __future__ import annotations

import tempfile
import textwrap
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft import PrivacyEngine
from dpft.integrations.hf import checks as hf_checks
from dpft.integrations.hf import trainer as hf
from dpft.integrations.hf.privatize import privatize_trainer
from dpft.integrations.hf.trainer import DPArguments, DPTrainer
from dpft.step.guard import ReleaseGuard
from dpft.step.guard import UpdateWithoutReleaseError

__all__ = ["PLANTED", "guard_checks", "planted_bug"]

PLANTED = ("trainer_step_skips_release", "custom_loop_accepted", "raw_update_accepted", "weights_moved_unreleased")


def _skip_release(p) -> None:
    """DPTrainer.training_step runs the DP step at step 0 only; later steps backpropagate the raw
    loss of the sampled rows (no clipping, no noise, no ledger event) — then Trainer steps."""

    orig = hf.DPTrainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        t = int(self.state.global_step)
        if t == 0:
            return orig(self, model, inputs, num_items_in_batch)
        model.train()
        for batch in self._micro_batches(self._logical_order(self.dp_step.indices(t))):
            model(**batch).loss.backward()
        return torch.zeros((), device=self.args.device)

    p.set(hf.DPTrainer, "training_step", training_step)


def _no_loop_refusal(p) -> None:

    p.set(hf_checks, "loop_overrides", lambda cls: [])


def _no_hook(p) -> None:

    def before_step(self, optimizer, args, kwargs):
        self._pending = None
        self.updates += 1

    p.set(ReleaseGuard, "_before_step", before_step)


def _no_end_check(p) -> None:

    p.set(ReleaseGuard, "check_end", lambda self, *a, **k: None)


planted_bug = bug_planter(PLANTED, {"trainer_step_skips_release": _skip_release,
                                    "custom_loop_accepted": _no_loop_refusal,
                                    "raw_update_accepted": _no_hook,
                                    "weights_moved_unreleased": _no_end_check})


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {textwrap.shorten(str(exc), 180, placeholder='…')}"


def _trainer(out: str, cls=None, steps: int = 3, optimizer: Optional[Callable] = None):
    from transformers import TrainingArguments, default_data_collator


    torch.manual_seed(0)
    model = tiny_classifier("bert", vocab=64, max_len=16)
    args = TrainingArguments(output_dir=out, max_steps=steps, learning_rate=0.1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", label_names=["labels"],
                             disable_tqdm=True, logging_strategy="no")
    dp = DPArguments(target_epsilon=4.0, target_delta=1e-3, expected_batch_size=4, max_grad_norm=1.0,
                     reproducible_seed=0)
    kw = {}
    if optimizer is not None:
        opt = optimizer(model)
        kw["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0))
    return (cls or DPTrainer)(model=model, args=args, train_dataset=tiny_rows(8, 8), dp_args=dp,
                              data_collator=default_data_collator, **kw)


def _custom_loop_check() -> Check:
    from transformers import Trainer


    class CustomLoop(Trainer):
        def _inner_training_loop(self, *a, **k):
            raise AssertionError("a custom loop ran")

    class OwnTrain(DPTrainer):
        def train(self, *a, **k):
            raise AssertionError("a custom loop ran")

    name = "guard: a Trainer subclass with its own training loop is refused"
    got = []
    try:
        privatize_trainer(CustomLoop)
        got.append("privatize_trainer accepted CustomLoop._inner_training_loop")
    except ValueError:
        pass
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _trainer(out, cls=OwnTrain)
            got.append("a DPTrainer subclass with its own train was accepted")
        except ValueError:
            pass
    return Check(name, not got, "; ".join(got) or "privatize_trainer(_inner_training_loop) and a DPTrainer subclass's "
                                               "own train: both refused (ValueError)")


def _trainer_updates_check() -> Check:
    name = "guard: DPTrainer optimizer updates = ledger training releases"
    count = {"n": 0}

    def sgd(model):  # the audit's own counter on the real optimizer (independent of the guard)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        opt.register_step_post_hook(lambda *a: count.__setitem__("n", count["n"] + 1))
        return opt

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tr = _trainer(out, optimizer=sgd)
            tr.train()
        except Exception as exc:
            return Check(name, False, f"an honest-looking run stopped: {_short(exc)}", {"updates": count["n"]})
        releases = sum(e.count for e in tr.ledger.entries if e.phase == "train")
    ok = count["n"] == releases == 3
    return Check(name, ok, f"{count['n']} optimizer update(s), {releases} training release(s) in the ledger "
                           "(3 steps planned)", {"updates": count["n"], "releases": releases})


def _raw_update_check() -> Check:
    from torch.utils.data import DataLoader, TensorDataset


    name = "guard: make_private refuses an update without a DP release (raw optimizer step)"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    eng = PrivacyEngine(reproducible_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = eng.make_private(
            module=model, optimizer=raw, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(data, batch_size=6),
            noise_multiplier=1.0, max_grad_norm=1.0, steps=2)
        x, y = next(iter(loader))
    before = [p.detach().clone() for p in model.parameters()]
    raw.zero_grad()
    crit(module(x), y).backward()
    try:
        raw.step()
    except UpdateWithoutReleaseError as exc:
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        return Check(name, not moved, f"refused ({_short(exc)})" + ("; but the weights moved" if moved else ""))
    return Check(name, False, "the raw optimizer applied an unclipped, un-noised gradient (0 releases in the ledger: "
                              f"{eng.ledger.steps})")


def _weights_moved_check() -> Check:
    from transformers.trainer_utils import TrainOutput


    name = "guard: DPTrainer whose loop writes the weights itself is stopped at the end of train()"
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer(out)

        def own_loop(*a, **k):  # on the instance, beyond any class check: no optimizer, no release
            with torch.no_grad():
                for p in tr.model.parameters():
                    p.add_(0.1)
            return TrainOutput(0, 0.0, {})

        tr._inner_training_loop = own_loop
        try:
            tr.train()
        except UpdateWithoutReleaseError as exc:
            return Check(name, True, f"refused ({_short(exc)})")
    return Check(name, False, f"train() returned with {tr.ledger.steps} release(s) for weights that moved; the card "
                              "would state ε for them")


def guard_checks(planted: Optional[str] = None) -> list[Check]:
    """The four checks; ``planted`` one of :data:`PLANTED` (or None).

    Raises:
        ValueError: an unknown planted bug."""
    with planted_bug(planted):
        return [_custom_loop_check(), _trainer_updates_check(), _raw_update_check(), _weights_moved_check()]
