"""Audit checks that run the Python ways in themselves: ``PrivacyEngine.make_private`` loops and
``DPTrainer`` (issue 23, findings 2–4).

Each check builds a tiny model in-process, runs one logical step through the real API with
``σ = 0``, ``q = 1`` (every row sampled) and plain SGD at learning rate 1, and reads the
released clipped sum back from the parameters: ``S = −Δθ · qN`` (the step divides by the
expected batch size qN). Then (add/remove-one, Abadi et al. 2016, Alg. 1):

* **leave-one-out** — ``max_i ‖S(D) − S(D∖i)‖ ≤ C(1 + tol)`` on an adversarial set (a large
  input, a mislabelled row, a padding-heavy row);
* **two passes per micro-batch** (make_private) — a loop that runs forward+backward twice on
  one micro-batch before ``optimizer.step()``: refused (:class:`~dpft.api.DoubleCaptureError`),
  or its single example's ``‖S‖ ≤ C``;
* **parameter unfrozen after the engine was built** (make_private and DPTrainer, optimizer over
  all parameters) — refused (:class:`~dpft.api.UnclippedParameterError`), or ``‖S‖ ≤ C`` over
  every parameter that moved;
* **packing collator** (DPTrainer with ``transformers.DataCollatorWithFlattening``) — refused
  (:class:`~dpft.api.PackedBatchError`), or one clipped example per sampled row.

``planted`` re-opens one hole by switching its guard off (a monkeypatch undone afterwards), so
that the audit shows it would catch the bug: ``"double_capture"``, ``"unfrozen_param"``,
``"packing_collator"``.

:func:`api_checks` returns the :class:`~dpft.audit.whitebox.Check` list;
:func:`audit_make_private` and :func:`audit_dp_trainer` are the same checks, per route.
"""

from __future__ import annotations

import contextlib
import math
import copy
import tempfile
import textwrap
import time
import warnings
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from dpft.audit.whitebox import Check, tiny_classifier
from dpft import PrivacyEngine, api
from dpft.api import DoubleCaptureError, PackedBatchError, UnclippedParameterError
from dpft.audit.planted import planting
from dpft.grads import live

PLANTED = ("double_capture", "unfrozen_param", "packing_collator")
#: Relative slack on ``‖S‖ ≤ C`` (fp32 sums and the 1e-6 in the clip factor's denominator).
TOL = 1e-3
C = 0.05


@contextlib.contextmanager
def planted_bug(name: Optional[str]) -> Iterator[None]:
    """Switch one guard off for the duration (``None``: nothing planted).

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    with planting(name, PLANTED) as p:
        from dpft.integrations.hf import trainer as hf
        from dpft.integrations.hf import data as hf_data

        noop = lambda *a, **k: None  # noqa: E731
        if name == "double_capture":
            p.set(live.LiveBookKeeping, "_check_one_capture", noop)
        elif name == "unfrozen_param":
            p.set(api.DPOptimizer, "check_unclipped_grads", noop)
            p.set(hf.DPTrainer, "_check_params", noop)
            p.set(hf.DPTrainer, "_check_unclipped_grads", noop)
        elif name == "packing_collator":
            p.set(hf_data, "check_unpacked_batch", noop)
            p.set(api, "check_unpacked_batch", noop)
        yield


# --------------------------------------------------------------------------- make_private


class _Net(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.fc(x))))


def _mp_data(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    x[0] *= 50.0  # a large input: a large gradient
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _no_dropout(model: nn.Module) -> None:
    """Dropout off (p = 0) in an audit copy: leave-one-out compares the same computation."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def _released_sum(model: nn.Module, before: dict, eb: int) -> torch.Tensor:
    """``S = −Δθ · qN`` over the parameters trainable after the step (one unfrozen mid-run counts;
    those frozen throughout are left out, so they do not dilute the noise check)."""
    return torch.cat([-(p.detach() - before[n]).flatten().float().cpu() * eb
                      for n, p in model.named_parameters() if p.requires_grad])


def _default_step(module, optimizer, criterion, batch) -> None:
    """One micro-batch of the usual loop: ``(x, y)`` pairs, or a dict with ``labels`` (HF)."""
    optimizer.zero_grad()
    if isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = module(**inputs)
        criterion(getattr(out, "logits", out), batch["labels"]).backward()
    else:
        x, y = batch
        criterion(module(x), y).backward()
    optimizer.step()


def _two_passes(module, optimizer, criterion, batch) -> None:
    optimizer.zero_grad()
    x, y = batch
    criterion(module(x), y).backward()
    criterion(module(x), y).backward()  # a second forward+backward (two losses, an augmentation, ...)
    optimizer.step()


def _mp_step(model: nn.Module, dataset, criterion: nn.Module, train_step: Callable = _default_step, *,
             c: float = C, sigma: float = 0.0, freeze: Optional[str] = None, collate_fn: Optional[Callable] = None,
             **make_private_kwargs) -> torch.Tensor:
    """One logical step of make_private on a copy of ``model`` (dropout off) over all of
    ``dataset`` (q = 1, SGD lr 1, noise multiplier ``sigma``); the released sum ``S``.
    ``freeze``: a parameter frozen when make_private is called and unfrozen right after."""
    model = copy.deepcopy(model)
    _no_dropout(model)
    params = dict(model.named_parameters())
    if freeze:
        params[freeze].requires_grad_(False)
    before = {n: p.detach().clone() for n, p in params.items()}
    engine = PrivacyEngine(reproducible_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=criterion,
            data_loader=DataLoader(dataset, batch_size=len(dataset), collate_fn=collate_fn),
            noise_multiplier=sigma, max_grad_norm=c, steps=1, **make_private_kwargs)
        if freeze:
            params[freeze].requires_grad_(True)  # unfrozen after make_private
        try:
            for batch in loader:
                train_step(module, opt, crit, batch)
        finally:
            engine.detach()
    return _released_sum(model, before, len(dataset))


def _norm_check(name: str, run: Callable[[], torch.Tensor], refused: tuple, what: str) -> Check:
    t0 = time.perf_counter()
    try:
        s = run()
    except refused as exc:
        return Check(name, True, f"refused ({type(exc).__name__}): {textwrap.shorten(str(exc), 200, placeholder='…')}",
                     {"refused": True, "seconds": round(time.perf_counter() - t0, 2)})
    norm = float(s.norm())
    ok = norm <= C * (1 + TOL)
    return Check(name, ok, f"{what}: ‖S‖ = {norm:.4g} vs C = {C:g}" + ("" if ok else " — one example counted more than C"),
                 {"refused": False, "norm_over_C": norm / C, "seconds": round(time.perf_counter() - t0, 2)})


def make_private_checks() -> list[Check]:
    """The make_private checks (leave-one-out, two passes, unfrozen parameter)."""
    torch.manual_seed(0)
    model = _Net()
    x, y = _mp_data()
    out = []
    t0 = time.perf_counter()
    ce = nn.CrossEntropyLoss()
    full = _mp_step(model, TensorDataset(x, y), ce)
    worst = 0.0
    for i in range(len(x)):
        keep = [j for j in range(len(x)) if j != i]
        worst = max(worst, float((full - _mp_step(model, TensorDataset(x[keep], y[keep]), ce)).norm()))
    ok = worst <= C * (1 + TOL)
    out.append(Check("api: make_private leave-one-out", ok,
                     f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {len(x)}, q = 1, σ = 0)",
                     {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)}))
    out.append(_norm_check("api: make_private two passes per micro-batch",
                           lambda: _mp_step(model, TensorDataset(x[:1], y[:1]), ce, _two_passes), (DoubleCaptureError,),
                           "N = 1, two forward+backward before step()"))
    out.append(_norm_check("api: make_private parameter unfrozen after make_private",
                           lambda: _mp_step(model, TensorDataset(x[1:2], y[1:2]), ce, freeze="head.weight"),
                           (UnclippedParameterError,), "N = 1, head.weight frozen at make_private, then unfrozen"))
    return out


# --------------------------------------------------------------------------- DPTrainer


def _tiny_bert():
    return tiny_classifier("bert", vocab=64, max_len=16)


def _bert_rows(model, n: int = 4):
    import datasets

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (n, 8), generator=g)
    mask = torch.ones(n, 8, dtype=torch.long)
    ids[0] = 7
    with torch.no_grad():
        labels = model(input_ids=ids, attention_mask=mask).logits.argmin(-1)  # mislabelled: large gradients
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                                       "labels": labels.tolist()})


def _trainer_step(model, rows, *, c: float = C, sigma: float = 0.0, collator=None, optimizer_all: bool = False,
                  freeze: Optional[str] = None, physical: Optional[int] = None, dp_kwargs: Optional[dict] = None,
                  training_args: Optional[dict] = None, trainer_kwargs: Optional[dict] = None):
    """One logical step of DPTrainer on a copy of ``model`` (dropout off) over all of ``rows``
    (q = 1, SGD lr 1, noise multiplier ``sigma``); ``(S, trainer)``. ``freeze``: a parameter
    frozen when DPTrainer is built and unfrozen right after; ``optimizer_all``: the user's own
    optimizer over every parameter."""
    from transformers import TrainingArguments, default_data_collator

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    model = copy.deepcopy(model)
    _no_dropout(model)
    params = dict(model.named_parameters())
    if freeze:
        params[freeze].requires_grad_(False)
    before = {n: p.detach().clone() for n, p in params.items()}
    n = len(rows)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # label_names keeps a `labels` column that a model's forward does not take (e.g. dpft's
        # mean-pooling classifier): the Trainer would drop it as an unused column otherwise.
        args = TrainingArguments(**{"label_names": ["labels"], **(training_args or {}), "output_dir": out,
                                    "max_steps": 1, "learning_rate": 1.0, "lr_scheduler_type": "constant",
                                    "optim": "sgd", "weight_decay": 0.0, "per_device_train_batch_size": physical or n,
                                    "report_to": [], "use_cpu": not torch.cuda.is_available(),
                                    "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True})
        dp = DPArguments(**{"target_delta": 1.0 / (10 * n), **(dp_kwargs or {}), "noise_multiplier": sigma,
                            "max_grad_norm": c, "expected_batch_size": n, "reproducible_seed": 0})
        kw = {"data_collator": collator or default_data_collator, **(trainer_kwargs or {})}
        if optimizer_all:
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            kw["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0))
        trainer = DPTrainer(model=model, args=args, train_dataset=rows, dp_args=dp, **kw)
        if freeze:
            params[freeze].requires_grad_(True)  # unfrozen after DPTrainer was built
        trainer.train()
    return _released_sum(model, before, n), trainer


def dp_trainer_checks(packing: bool = True) -> list[Check]:
    """The DPTrainer checks (leave-one-out, unfrozen parameter, packing collator)."""
    model = _tiny_bert()
    rows = _bert_rows(model)
    out = []
    t0 = time.perf_counter()
    full, _ = _trainer_step(model, rows)
    worst = 0.0
    for i in range(len(rows)):
        worst = max(worst, float((full - _trainer_step(model, rows.select([j for j in range(len(rows)) if j != i]))[0]).norm()))
    ok = worst <= C * (1 + TOL)
    out.append(Check("api: DPTrainer leave-one-out", ok,
                     f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {len(rows)}, q = 1, σ = 0)",
                     {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)}))
    out.append(_norm_check(
        "api: DPTrainer parameter unfrozen after DPTrainer (optimizer over all parameters)",
        lambda: _trainer_step(model, rows.select([1]), optimizer_all=True, freeze="classifier.weight")[0],
        (UnclippedParameterError,), "N = 1, classifier.weight frozen at construction, then unfrozen"))
    if packing:
        out.append(_packing_check(PackedBatchError))
    return out


def _packing_check(refused: type) -> Check:
    """DPTrainer + DataCollatorWithFlattening on a tiny causal LM: one clipped example per row."""
    import datasets
    from transformers import DataCollatorWithFlattening, GPT2Config, GPT2LMHeadModel

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(2)
    rows = datasets.Dataset.from_dict({"input_ids": [torch.randint(3, 64, (k,), generator=g).tolist() for k in (5, 6, 7, 8)]})
    name = "api: DPTrainer packing collator (DataCollatorWithFlattening)"
    try:
        _, trainer = _trainer_step(model, rows, collator=DataCollatorWithFlattening(), physical=len(rows))
    except refused as exc:
        return Check(name, True, f"refused ({type(exc).__name__}): {textwrap.shorten(str(exc), 200, placeholder='…')}",
                     {"refused": True, "seconds": round(time.perf_counter() - t0, 2)})
    clipped = int(trainer.last_private_stats.get("batch_size", -1))
    ok = clipped == len(rows)
    return Check(name, ok, f"{clipped} clipped example(s) for {len(rows)} sampled rows"
                 + ("" if ok else " — several rows clipped as one"),
                 {"refused": False, "clipped": clipped, "rows": len(rows), "seconds": round(time.perf_counter() - t0, 2)})


# --------------------------------------------------------------------------- entry points


def api_checks(planted: Optional[str] = None) -> list[Check]:
    """Every check of both Python routes, with ``planted`` (one of :data:`PLANTED`) re-opened.

    Returns:
        Six :class:`Check` rows; with no planted bug all pass, with one planted at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    with planted_bug(planted):
        return make_private_checks() + dp_trainer_checks()


def _loo_and_noise(name: str, run: Callable[[list, float], torch.Tensor], n_rows: int, c: float) -> list[Check]:
    """Leave-one-out ≤ C over ``n_rows`` rows, and noise std σC (σ = 1) on the full set."""
    t0 = time.perf_counter()
    full = run(list(range(n_rows)), 0.0)
    worst = 0.0
    for i in range(n_rows):
        worst = max(worst, float((full - run([j for j in range(n_rows) if j != i], 0.0)).norm()))
    ok = worst <= c * (1 + TOL)
    out = [Check(f"yours: {name} leave-one-out", ok,
                 f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {c:g} (your model and rows, N = {n_rows}, q = 1, σ = 0)"
                 + ("" if ok else " — one row moves the release by more than C"),
                 {"loo_over_C": worst / c, "seconds": round(time.perf_counter() - t0, 2)})]
    t0 = time.perf_counter()
    z = (run(list(range(n_rows)), 1.0) - full).double()
    d = z.numel()
    std = float(z.std())
    # The sample std of d normals has relative sd ≈ 1/√(2d): 5 of them is the tolerance.
    rel = abs(std / c - 1.0)
    ok = rel <= 5.0 / math.sqrt(2 * d) + 1e-3
    out.append(Check(f"yours: {name} noise std σC", ok,
                     f"std {std:.5g} vs σC = {c:g} over {d} coordinates (σ = 1)" + ("" if ok else " — wrong noise scale"),
                     {"std_over_sigma_c": std / c, "coordinates": d, "seconds": round(time.perf_counter() - t0, 2)}))
    return out


def audit_make_private(model: Optional[nn.Module] = None, dataset=None, criterion: Optional[nn.Module] = None, *,
                       train_step: Optional[Callable] = None, rows: int = 4, max_grad_norm: float = 1.0,
                       collate_fn: Optional[Callable] = None, planted: Optional[str] = None,
                       **make_private_kwargs) -> list[Check]:
    """Audit ``make_private`` — on a tiny built-in model (no arguments: leave-one-out, two passes,
    unfrozen parameter), or on **your own** model, rows and loop body.

    With ``model``: one logical step of ``make_private`` on a copy of your model (dropout off),
    ``q = 1`` over the first ``rows`` rows of ``dataset``, plain SGD at learning rate 1 over its
    parameters (those frozen stay frozen), your ``train_step(module, optimizer, criterion, batch)`` (default: the
    usual ``zero_grad``/loss/``backward``/``step`` on ``(x, y)`` or a dict with ``labels``) and
    ``make_private_kwargs`` (e.g. ``clipping="head_body"``, ``max_physical_batch_size``). Checks:
    ``max_i ‖S(D) − S(D∖i)‖ ≤ C`` (add/remove-one sensitivity of the released sum ``S = −Δθ·qN``)
    and the noise std σC at σ = 1. Cost: ``rows + 2`` steps of your model.

    Returns:
        :class:`~dpft.audit.whitebox.Check` s (``.passed``, ``.message``); a failed one names the hole.
    """
    with planted_bug(planted):
        if model is None:
            return make_private_checks()
        if dataset is None or criterion is None:
            raise ValueError("audit_make_private(model, dataset, criterion): give your dataset and criterion too")
        n = min(rows, len(dataset))
        return _loo_and_noise("make_private", lambda idx, sigma: _mp_step(
            model, Subset(dataset, idx), criterion, train_step or _default_step, c=max_grad_norm, sigma=sigma,
            collate_fn=collate_fn, **make_private_kwargs), n, max_grad_norm)


def audit_dp_trainer(model=None, train_dataset=None, *, rows: int = 4, max_grad_norm: float = 1.0,
                     dp_kwargs: Optional[dict] = None, training_args: Optional[dict] = None,
                     planted: Optional[str] = None, **trainer_kwargs) -> list[Check]:
    """Audit ``DPTrainer`` — on tiny built-in models (no arguments: leave-one-out, unfrozen
    parameter, packing collator), or on **your own** model and rows.

    With ``model``: one logical step of ``DPTrainer`` on a copy of your model (dropout off), ``q = 1``
    over the first ``rows`` rows of ``train_dataset`` (a ``datasets.Dataset``), SGD at learning
    rate 1, your ``trainer_kwargs`` (``data_collator``, ``loss_fn``, ``processing_class``…) and
    ``dp_kwargs`` for :class:`~dpft.integrations.hf.trainer.DPArguments` (e.g. ``clipping``) and
    ``training_args`` for ``TrainingArguments`` (``label_names`` defaults to ``["labels"]``; the
    step's own settings — one step, SGD at learning rate 1 — are the audit's). Checks
    leave-one-out ``≤ C`` and the noise std σC at σ = 1, as :func:`audit_make_private`.
    """
    with planted_bug(planted):
        if model is None:
            return dp_trainer_checks()
        if train_dataset is None:
            raise ValueError("audit_dp_trainer(model, train_dataset): give your training rows too")
        n = min(rows, len(train_dataset))
        return _loo_and_noise("DPTrainer", lambda idx, sigma: _trainer_step(
            model, train_dataset.select(list(idx)), c=max_grad_norm,
            sigma=sigma, dp_kwargs=dp_kwargs, training_args=training_args, trainer_kwargs=trainer_kwargs)[0], n,
            max_grad_norm)


__all__ = ["api_checks", "audit_make_private", "audit_dp_trainer", "planted_bug", "PLANTED"]
