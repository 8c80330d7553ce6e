"""The checks every way in must pass, written once over a table of way-in adapters (issue 46 item 4).

Every way in (``make_private``, ``DPTrainer``, the TRL trainers: audit/ways_in_trl.py) plans through
the one privacy plan and, for ``make_private`` and ``DPTrainer``, through the one private session; a
check of a property of that plan and step is therefore one check, and each way in only has to show
that it reaches the session unchanged. A :class:`WayIn` is the small adapter that does so: it runs one
logical step of its way in on a copy of a tiny model with ``q = 1`` (every unit sampled), plain SGD at
learning rate 1 and noise multiplier σ, over the units it is told to keep, and hands back the released
clipped sum read from the weights, ``S = −Δθ · qN`` (the step divides by the expected batch qN), and
the run (the optimizer or trainer, for what a check reads beyond ``S``). The properties
(add/remove-one, Abadi et al. 2016, Alg. 1), each written once:

* **leave-one-unit-out** (:func:`leave_one_out`) — ``max_u ‖S(D) − S(D∖u)‖ ≤ C(1 + tol)`` on an
  adversarial set (a large input, a mislabelled row, a long completion); optionally, for one unit
  whose own gradient ``g_u`` exceeds C, ``S(D) − S(D∖u) = C·g_u/‖g_u‖`` (the unit clipped as one
  group: a user's pairs together);
* **noise std σC** (:func:`noise_std`, your own model: ``audit_make_private``/``audit_dp_trainer``);
* **one unit's release ≤ C under a variant of the loop** (:func:`one_unit_bounded`) — two passes per
  micro-batch (make_private), a parameter unfrozen after the way in was built (make_private and
  DPTrainer, optimizer over all parameters), LoRA through ``peft_config`` (DPSFTTrainer): refused, or
  ``‖S‖ ≤ C`` over every parameter that moved;
* **one clipped example per row** (:func:`one_clipped_per_row`) — a packing collator (DPTrainer with
  ``DataCollatorWithFlattening``; DPSFTTrainer ``packing=True``): refused, or as many clipped examples
  as rows.

Planted bugs (a monkeypatch each, undone afterwards; the audit must then FAIL): ``double_capture``,
``unfrozen_param``, ``packing_collator`` (:func:`api_checks`; the TRL ways in plant theirs in
audit/ways_in_trl.py).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import tempfile
import textwrap
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from dpft import PrivacyEngine, api
from dpft.api import DoubleCaptureError, PackedBatchError, UnclippedParameterError
from dpft.audit.planted import bug_planter
from dpft.audit.ways_in_session import SESSION_SETTINGS, STEPS_RULE, plant_steps_rule, session_check
from dpft.audit.whitebox import Check, tiny_classifier, tiny_rows
from dpft.grads import live
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf import trainer as hf

PLANTED = ("double_capture", "unfrozen_param", "packing_collator", STEPS_RULE)
#: The clip norm of the built-in checks (small: every row of the tiny models is clipped).
C = 0.05
#: Relative slack on ``‖S‖ ≤ C`` (fp32 sums and the 1e-6 in the clip factor's denominator).
TOL = 1e-3
#: A clip norm no summed gradient of the tiny models reaches (the step then releases the raw sum).
NO_CLIP = 1e6

_noop = lambda *a, **k: None  # noqa: E731
planted_bug = bug_planter(PLANTED, {
    "double_capture": lambda p: p.set(live.LiveBookKeeping, "_check_one_capture", _noop),
    "unfrozen_param": lambda p: (p.set(api.DPOptimizer, "check_unclipped_grads", _noop),
                                 p.set(hf.DPTrainer, "_check_params", _noop),
                                 p.set(hf.DPTrainer, "_check_unclipped_grads", _noop)),
    "packing_collator": lambda p: (p.set(hf_data, "check_unpacked_batch", _noop),
                                   p.set(api, "check_unpacked_batch", _noop)),
    STEPS_RULE: plant_steps_rule,  # the session counts steps by a rule of its own (audit/ways_in_session.py)
})


# --------------------------------------------------------------------------- the adapter


@dataclass
class WayIn:
    """One way in as the checks drive it.

    ``step(keep, sigma, c)`` runs one logical step over the units ``keep`` (a sub-list of ``units``) at
    noise multiplier ``sigma`` and clip norm ``c`` and returns ``(S, run)``: the released sum (a flat
    float tensor over the parameters trainable after the step) and the optimizer or trainer.
    ``check_run(run)`` returns why the run breaks the way in's own promise (or None)."""

    name: str
    units: list
    step: Callable[[list, float, float], tuple[torch.Tensor, Any]]
    unit: str = "example"
    c: float = C
    #: the report's label of the way in's rows ("your model and rows", "prompt/completion, completion-only loss")
    what: str = ""
    check_run: Optional[Callable[[Any], Optional[str]]] = None


def no_dropout(model: nn.Module) -> None:
    """Dropout off (p = 0) in an audit copy: leave-one-out compares the same computation."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def released_sum(model: nn.Module, before: dict, eb: int) -> torch.Tensor:
    """``S = −Δθ · qN`` over the parameters trainable after the step (one unfrozen mid-run counts;
    those frozen throughout are left out, so they do not dilute the noise check)."""
    return torch.cat([-(p.detach() - before[n]).flatten().float().cpu() * eb
                      for n, p in model.named_parameters() if p.requires_grad])


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """``Trainer.train`` ends with accelerate's ``gc.collect()``, which scans the whole heap (most
    of a tiny step's time); objects frozen here are skipped. Speed only; a caller's freeze is left
    as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _seconds(t0: float) -> float:
    return round(time.perf_counter() - t0, 2)


def _refused(name: str, exc: Exception, t0: float) -> Check:
    return Check(name, True, f"refused ({type(exc).__name__}): {textwrap.shorten(str(exc), 200, placeholder='…')}",
                 {"refused": True, "seconds": _seconds(t0)})


# --------------------------------------------------------------------------- the properties, once


def leave_one_out(way: WayIn, prefix: str, exact: Any = None) -> Check:
    """``max_u ‖S(D) − S(D∖u)‖ ≤ C(1 + tol)`` over ``way.units`` (σ = 0); with ``exact`` (a unit whose
    own summed gradient exceeds C) also ``S(D) − S(D∖exact) = C·g/‖g‖`` (relative tolerance 1e-2), ``g``
    read from the same step at :data:`NO_CLIP`."""
    t0, c, u = time.perf_counter(), way.c, way.unit
    full, run = way.step(way.units, 0.0, c)
    diffs = {v: full - way.step([w for w in way.units if w != v], 0.0, c)[0] for v in way.units}
    worst = max(float(d.norm()) for d in diffs.values())
    ok = worst <= c * (1 + TOL)
    msg = (f"max over {u}s ‖S(D) − S(D∖{u})‖ = {worst:.4g} vs C = {c:g} ({way.what + ', ' if way.what else ''}"
           f"{len(way.units)} {u}s, q = 1, σ = 0)" + ("" if ok else f" — one {u} moves the release by more than C"))
    stats = {"loo_over_C": worst / c}
    if exact is not None:
        g = way.step(way.units, 0.0, NO_CLIP)[0] - way.step([w for w in way.units if w != exact], 0.0, NO_CLIP)[0]
        gn = float(g.norm())
        want = g * min(1.0, c / gn)
        off = float((diffs[exact] - want).norm()) / max(float(want.norm()), 1e-12)
        good = gn > c and off <= 1e-2
        ok = ok and good
        msg += (f"; {u} {exact!r} (‖g‖ = {gn:.4g}): ‖S(D) − S(D∖{u})‖ = {float(diffs[exact].norm()):.4g}, relative "
                f"distance to clip_C(g) {off:.2e}" + ("" if good else f" — the {u} is not clipped as one group"))
        stats.update(user_grad_over_C=gn / c, rel_off=off)
    problem = way.check_run(run) if way.check_run else None
    if problem:
        ok, msg = False, f"{msg}; {problem}"
    name = f"{prefix}: {way.name} leave-one-{'' if u == 'example' else u + '-'}out"
    return Check(name, ok, msg, {**stats, "seconds": _seconds(t0)})


def noise_std(way: WayIn, prefix: str) -> Check:
    """The noise of one step at σ = 1 over every unit has std σC (to 5 standard errors)."""
    t0, c = time.perf_counter(), way.c
    z = (way.step(way.units, 1.0, c)[0] - way.step(way.units, 0.0, c)[0]).double()
    d, std = z.numel(), float(z.std())
    # The sample std of d normals has relative sd ≈ 1/√(2d): 5 of them is the tolerance.
    ok = abs(std / c - 1.0) <= 5.0 / math.sqrt(2 * d) + 1e-3
    return Check(f"{prefix}: {way.name} noise std σC", ok,
                 f"std {std:.5g} vs σC = {c:g} over {d} coordinates (σ = 1)" + ("" if ok else " — wrong noise scale"),
                 {"std_over_sigma_c": std / c, "coordinates": d, "seconds": _seconds(t0)})


def one_unit_bounded(name: str, run: Callable[[], tuple[torch.Tensor, Any]], refused: tuple, what: str,
                     c: float = C, check_run: Optional[Callable[[Any], Optional[str]]] = None) -> Check:
    """One unit under a variant of the loop (``run``): refused (one of ``refused``), or ``‖S‖ ≤ C`` over
    every parameter that moved (and ``check_run(run)`` names no problem)."""
    t0 = time.perf_counter()
    try:
        s, r = run()
    except refused as exc:
        return _refused(name, exc, t0)
    norm = float(s.norm())
    ok = norm <= c * (1 + TOL)
    msg = f"{what}: ‖S‖ = {norm:.4g} vs C = {c:g}" + ("" if ok else " — one example counted more than C")
    problem = check_run(r) if check_run else None
    if problem:
        ok, msg = False, f"{msg}; {problem}"
    return Check(name, ok, msg, {"refused": False, "norm_over_C": norm / c, "seconds": _seconds(t0)})


def one_clipped_per_row(name: str, run: Callable[[], tuple[torch.Tensor, Any]], rows: int, unit: str,
                        refused: tuple) -> Check:
    """A packing loop (``run``): refused, or the trainer's plan counts ``rows`` units and its last step
    clipped ``rows`` examples (several rows packed into one would be clipped as one)."""
    t0 = time.perf_counter()
    try:
        _, tr = run()
    except refused as exc:
        return _refused(name, exc, t0)
    clipped = int(tr.last_private_stats.get("batch_size", -1))
    ok = tr.n == rows and clipped == rows
    return Check(name, ok, f"N = {tr.n} rows and {clipped} clipped example(s) for {rows} {unit}s"
                 + ("" if ok else f" — several {unit}s clipped as one"),
                 {"refused": False, "clipped": clipped, "rows": tr.n, unit + "s": rows, "seconds": _seconds(t0)})


# --------------------------------------------------------------------------- make_private


class TinyNet(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.fc(x))))


def mp_data(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows for :class:`TinyNet` (row 0 a large input: a large gradient) and their labels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    x[0] *= 50.0
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def _default_step(module, optimizer, criterion, batch) -> None:
    """One micro-batch of the usual loop: ``(x, y)`` pairs, or a dict with ``labels`` (HF)."""
    optimizer.zero_grad()
    if isinstance(batch, dict):
        out = module(**{k: v for k, v in batch.items() if k != "labels"})
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


def _fresh_copy(model: nn.Module, freeze: Optional[str]) -> tuple[nn.Module, dict, dict]:
    """A copy of ``model`` with dropout off, ``freeze`` (a parameter name, or None) frozen, and its
    parameters and their values before the step: ``(copy, name → parameter, name → value)``."""
    model = copy.deepcopy(model)
    no_dropout(model)
    params = dict(model.named_parameters())
    if freeze:
        params[freeze].requires_grad_(False)
    return model, params, {n: p.detach().clone() for n, p in params.items()}


def make_private_step(model: nn.Module, dataset, criterion: nn.Module, train_step: Callable = _default_step, *,
                      c: float = C, sigma: float = 0.0, freeze: Optional[str] = None,
                      collate_fn: Optional[Callable] = None, **make_private_kwargs) -> tuple[torch.Tensor, Any]:
    """One logical step of make_private on a copy of ``model`` (dropout off) over all of ``dataset``
    (q = 1, SGD lr 1, noise multiplier ``sigma``); ``(S, optimizer)``. ``freeze``: a parameter frozen
    when make_private is called and unfrozen right after."""
    model, params, before = _fresh_copy(model, freeze)
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
    return released_sum(model, before, len(dataset)), opt


def make_private_way(model: Optional[nn.Module] = None, dataset=None, criterion: Optional[nn.Module] = None, *,
                     rows: Optional[int] = None, c: float = C, train_step: Optional[Callable] = None,
                     **make_private_kwargs) -> WayIn:
    """make_private as a :class:`WayIn`: the built-in tiny net and adversarial rows, or your own."""
    if model is None:
        torch.manual_seed(0)
        model, (x, y), what = TinyNet(), mp_data(), ""
        dataset, criterion = TensorDataset(x, y), nn.CrossEntropyLoss()
    else:
        what = "your model and rows"
    n = len(dataset) if rows is None else min(rows, len(dataset))
    return WayIn("make_private", list(range(n)), lambda keep, sigma, cc: make_private_step(
        model, Subset(dataset, list(keep)), criterion, train_step or _default_step, c=cc, sigma=sigma,
        **make_private_kwargs), c=c, what=what)


# --------------------------------------------------------------------------- DPTrainer


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


def one_step_args(out: str, n: int) -> dict:
    """``TrainingArguments`` keywords of one logical step in physical batches of ``n`` rows: SGD at learning rate
    1, constant, no weight decay, nothing saved or logged (every Trainer-based way in's adapter)."""
    return dict(output_dir=out, max_steps=1, learning_rate=1.0, lr_scheduler_type="constant", optim="sgd",
                weight_decay=0.0, per_device_train_batch_size=n, report_to=[], use_cpu=not torch.cuda.is_available(),
                save_strategy="no", logging_strategy="no", disable_tqdm=True)


def hf_one_step(build: Callable[[nn.Module, str], Any], model: nn.Module, eb: int, *, freeze: Optional[str] = None,
                every_row: bool = False) -> tuple[torch.Tensor, Any]:
    """One logical step of a Trainer-based way in on a copy of ``model`` (dropout off): ``build(copy,
    output_dir)`` returns the trainer (q = 1: ``eb`` its expected batch, or ``every_row`` draws every row);
    ``(S, trainer)``, ``S = −Δθ · eb`` over the parameters of ``trainer.model`` trainable after the step
    (adapters a trainer adds included). ``freeze``: a parameter frozen while the trainer is built and
    unfrozen right after."""
    model, params, _ = _fresh_copy(model, freeze)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build(model, out)
        if freeze:
            params[freeze].requires_grad_(True)  # unfrozen after the trainer was built
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if every_row:
            trainer.sampler.indices = lambda step: torch.arange(trainer.n)  # q = 1 exactly
        with gc_frozen():
            trainer.train()
    return released_sum(trainer.model, before, eb), trainer


def trainer_step(model, rows, *, c: float = C, sigma: float = 0.0, collator=None, optimizer_all: bool = False,
                 freeze: Optional[str] = None, physical: Optional[int] = None, dp_kwargs: Optional[dict] = None,
                 training_args: Optional[dict] = None, trainer_kwargs: Optional[dict] = None):
    """One logical step of DPTrainer on a copy of ``model`` (dropout off) over all of ``rows``
    (q = 1, SGD lr 1, noise multiplier ``sigma``); ``(S, trainer)``. ``freeze``: a parameter
    frozen when DPTrainer is built and unfrozen right after; ``optimizer_all``: the user's own
    optimizer over every parameter."""
    from transformers import TrainingArguments, default_data_collator

    n = len(rows)

    def build(model, out):
        # label_names keeps a `labels` column that a model's forward does not take (e.g. dpft's
        # mean-pooling classifier): the Trainer would drop it as an unused column otherwise.
        args = TrainingArguments(**{"label_names": ["labels"], **(training_args or {}),
                                    **one_step_args(out, physical or n)})
        dp = hf.DPArguments(**{"target_delta": 1.0 / (10 * n), **(dp_kwargs or {}), "noise_multiplier": sigma,
                               "max_grad_norm": c, "expected_batch_size": n, "reproducible_seed": 0})
        kw = {"data_collator": collator or default_data_collator, **(trainer_kwargs or {})}
        if optimizer_all:
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            kw["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0))
        return hf.DPTrainer(model=model, args=args, train_dataset=rows, dp_args=dp, **kw)

    return hf_one_step(build, model, n, freeze=freeze)


def dp_trainer_way(model=None, train_dataset=None, *, rows: Optional[int] = None, c: float = C,
                   **trainer_step_kwargs) -> WayIn:
    """DPTrainer as a :class:`WayIn`: the built-in tiny BERT and rows (one mislabelled), or your own."""
    what = "your model and rows"
    if model is None:
        model, what = tiny_classifier("bert", vocab=64, max_len=16), ""
        train_dataset = _bert_rows(model)
    n = len(train_dataset) if rows is None else min(rows, len(train_dataset))
    return WayIn("DPTrainer", list(range(n)), lambda keep, sigma, cc: trainer_step(
        model, train_dataset.select(list(keep)), c=cc, sigma=sigma, **trainer_step_kwargs), c=c, what=what)


def _packing_run() -> tuple[Callable, int]:
    """DPTrainer + DataCollatorWithFlattening on a tiny causal LM (4 rows of 5–8 tokens)."""
    import datasets
    from transformers import DataCollatorWithFlattening, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(2)
    rows = datasets.Dataset.from_dict({"input_ids": [torch.randint(3, 64, (k,), generator=g).tolist()
                                                     for k in (5, 6, 7, 8)]})
    return lambda: trainer_step(model, rows, collator=DataCollatorWithFlattening(), physical=len(rows)), len(rows)


# --------------------------------------------------------------------------- the session check's ways in


def _session_make_private() -> Any:
    st = SESSION_SETTINGS
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(st["n"], 4, generator=g), torch.randint(0, 2, (st["n"],), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = PrivacyEngine()
        _, opt, _, _ = eng.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        criterion=nn.CrossEntropyLoss(), dataset=data, expected_batch_size=st["batch"],
                                        max_grad_norm=st["c"], epochs=st["epochs"], target_epsilon=st["epsilon"],
                                        target_delta=st["delta"])
    eng.detach()
    return opt.dp_step


def _session_dp_trainer() -> Any:
    from transformers import TrainingArguments, default_data_collator

    st = SESSION_SETTINGS
    rows = tiny_rows(st["n"], 4)
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = hf.DPTrainer(model=tiny_classifier("bert", vocab=64, max_len=16), train_dataset=rows,
                          args=TrainingArguments(output_dir=d, num_train_epochs=st["epochs"], report_to=[],
                                                 use_cpu=True, label_names=["labels"]),
                          data_collator=default_data_collator,
                          dp_args=hf.DPArguments(target_epsilon=st["epsilon"], target_delta=st["delta"],
                                                 expected_batch_size=st["batch"], max_grad_norm=st["c"]))
    return tr.dp_step


#: The ways in as the session check builds them: ``(name, build() -> the way in's DP step)``.
SESSION_WAYS: tuple = (("make_private", _session_make_private), ("DPTrainer", _session_dp_trainer))



# --------------------------------------------------------------------------- entry points


def make_private_checks() -> list[Check]:
    """make_private: leave-one-out, two passes per micro-batch, a parameter unfrozen after make_private."""
    way = make_private_way()
    ds = TensorDataset(*mp_data())
    torch.manual_seed(0)
    net, ce = TinyNet(), nn.CrossEntropyLoss()
    return [leave_one_out(way, "api"),
            one_unit_bounded("api: make_private two passes per micro-batch",
                             lambda: make_private_step(net, Subset(ds, [0]), ce, _two_passes), (DoubleCaptureError,),
                             "N = 1, two forward+backward before step()"),
            one_unit_bounded("api: make_private parameter unfrozen after make_private",
                             lambda: make_private_step(net, Subset(ds, [1]), ce, freeze="head.weight"),
                             (UnclippedParameterError,), "N = 1, head.weight frozen at make_private, then unfrozen")]


def dp_trainer_checks() -> list[Check]:
    """DPTrainer: leave-one-out, a parameter unfrozen after DPTrainer, a packing collator."""
    model = tiny_classifier("bert", vocab=64, max_len=16)
    rows = _bert_rows(model)
    packing, n = _packing_run()
    return [leave_one_out(dp_trainer_way(), "api"),
            one_unit_bounded("api: DPTrainer parameter unfrozen after DPTrainer (optimizer over all parameters)",
                             lambda: trainer_step(model, rows.select([1]), optimizer_all=True,
                                                  freeze="classifier.weight"),
                             (UnclippedParameterError,), "N = 1, classifier.weight frozen at construction, then unfrozen"),
            one_clipped_per_row("api: DPTrainer packing collator (DataCollatorWithFlattening)", packing, n, "row",
                                (PackedBatchError,))]


def api_checks(planted: Optional[str] = None) -> list[Check]:
    """Every check of make_private and DPTrainer, with ``planted`` (one of :data:`PLANTED`) re-opened.

    Returns:
        Eight :class:`Check` rows (the session's two first); with no planted bug all pass, with one planted
        at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    with planted_bug(planted):
        return session_check(SESSION_WAYS) + make_private_checks() + dp_trainer_checks()


def yours(way: WayIn) -> list[Check]:
    """Your way in (your model, rows, loop): leave-one-out ≤ C and the noise std σC at σ = 1."""
    return [leave_one_out(way, "yours"), noise_std(way, "yours")]


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
        return yours(make_private_way(model, dataset, criterion, rows=rows, c=max_grad_norm, train_step=train_step,
                                      collate_fn=collate_fn, **make_private_kwargs))


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
        return yours(dp_trainer_way(model, train_dataset, rows=rows, c=max_grad_norm, dp_kwargs=dp_kwargs,
                                    training_args=training_args, trainer_kwargs=trainer_kwargs))


__all__ = ["WayIn", "leave_one_out", "noise_std", "one_unit_bounded", "one_clipped_per_row", "make_private_way",
           "dp_trainer_way", "make_private_step", "trainer_step", "hf_one_step", "one_step_args", "api_checks",
           "audit_make_private", "audit_dp_trainer", "planted_bug", "PLANTED", "C", "TOL"]
