"""Methods through the Python ways in: ``make_private(methods=[…])`` and
``DPArguments(methods=[…])`` build the same plug-ins as ``dpft train`` and hand them to the one
plan builder (step/plan.py) — ``prepare`` before the plan (an earlier release, e.g. a privately
built subspace basis from a file, goes in the ledger before σ is calibrated), σ through the
plan's ``on_sigma``, ``build`` as the plan's hooks — and call ``after_update`` once per noisy
update (make_private: ``DPOptimizer``; DPTrainer: after ``Trainer``'s optimizer step). A method
whose maths or phases need the driver refuses with its reason (:meth:`Method.python_refusal`).

What a Python way in knows of a "recipe" is small — C, the clipping style, the expected batch,
hardened noise and the methods' own configs — and :class:`PythonRecipe` holds exactly that, in
the shape the built-in methods read (``recipe.privacy.clipping.max_norm`` …); a method that reads
anything else is refused by name, never handed a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel

from dpft.errors import PlanError
from dpft.methods.base import LEGACY_SECTIONS, Method, Run, get_method, method_name

__all__ = ["python_methods", "PythonMethods", "PythonRecipe", "PythonRun"]


def python_methods(methods: Optional[Sequence[Any]], where: str) -> list[Method]:
    """Validate ``methods``: each ``{"name": <registered method>, **its config keys}`` or a method
    config model instance.

    Raises:
        PlanError: an unknown method, a config error, a method switched off by its own config, or
            one that cannot run outside ``dpft train`` — each naming the fix.
    """
    out = []
    for i, item in enumerate(methods or []):
        try:
            if isinstance(item, BaseModel):
                name, cfg = method_name(item), item
                cls = get_method(name)
            else:
                if not isinstance(item, dict) or "name" not in item:
                    raise PlanError(f"methods[{i}]: expected {{'name': <method>, ...}}, got {type(item).__name__}")
                body = dict(item)
                name = body.pop("name")
                cls = get_method(name)
                cfg = cls.config.model_validate(body)
        except (KeyError, ValueError) as exc:
            raise PlanError(f"{where}: methods[{i}]: {exc}") from None
        if not cls.enabled(cfg):
            raise PlanError(f"{where}: method {name!r} is switched off by its own config; set the key that enables "
                            "it (e.g. {'name': 'rmt', 'method': 'rmt'})")
        why = cls.python_refusal(cfg)
        if why:
            raise PlanError(f"{where}: method {name!r} cannot run here: {why}")
        out.append(cls(cfg, None))
    return sorted(out, key=lambda m: m.order)


@dataclass(frozen=True)
class _Clipping:
    style: str
    max_norm: float


@dataclass(frozen=True)
class _Privacy:
    clipping: _Clipping
    hardened_noise: bool


@dataclass(frozen=True)
class _Batch:
    expected_batch_size: int


class PythonRecipe:
    """What a Python way in knows, in the recipe's shape the built-in methods read:
    ``privacy.clipping.max_norm`` (C) and ``.style``, ``privacy.hardened_noise``,
    ``batch.expected_batch_size`` (B = qN), ``method_config(name)`` and the methods' historical
    sections (``recipe.adam_ac`` …).

    Raises (on reading any other field):
        PlanError: naming the field; a method that needs it runs with ``dpft train``.
    """

    def __init__(self, *, max_grad_norm: float, clipping: str, expected_batch_size: int, hardened_noise: bool,
                 methods: Sequence[Method] = ()):
        self.privacy = _Privacy(_Clipping(str(clipping), float(max_grad_norm)), bool(hardened_noise))
        self.batch = _Batch(int(expected_batch_size))
        self._configs = [m.cfg for m in methods]

    def method_config(self, name: str) -> BaseModel:
        """The config of method ``name`` among this way in's methods, or its defaults."""
        cls = get_method(name).config
        for c in self._configs:
            if type(c) is cls:
                return c
        return cls()

    def __getattr__(self, item: str) -> Any:
        if item.startswith("_"):
            raise AttributeError(item)
        if item in LEGACY_SECTIONS:
            return self.method_config(LEGACY_SECTIONS[item])
        raise PlanError(f"a method read recipe.{item}, which a Python way in (make_private, DPTrainer) does not "
                        "have; run that method with `dpft train`")


class PythonRun(Run):
    """The :class:`~dpft.methods.base.Run` of a Python way in: no run folder, task, tokenizer,
    dev evaluation or optimizer factory (``evaluate``/``make_optimizer`` are None: a method keeps
    the user's optimizer), and ``record`` appends to the way in's ledger only (the way in writes
    its own files: DPTrainer's ``ledger.json`` at its next release, make_private's live record).

    ``per_example_loss``: the way in's per-example loss ``(forward, batch) -> (B,)`` when its
    engine computes the forward (DPTrainer), else None (make_private: the user's loop does)."""

    per_example_loss: Optional[Callable] = None

    def record(self, phase: str, event, count: int = 1) -> None:
        self.ledger.record(phase, event, count)


class PythonMethods:
    """The methods of one Python way in, over one :class:`PythonRun`.

    Use: :meth:`prepare` before the plan (its ``prior`` must be read after it), ``on_sigma`` and
    ``hooks`` into :func:`~dpft.step.plan.build_privacy_plan`, :meth:`after_update` after every
    noisy update is applied, :meth:`report` for the methods' sections.

    Args:
        methods: from :func:`python_methods`.
        model: the module the way in trains; n: N privacy units; ledger, rng: the way in's ledger
            and secret randomness (the plan's); where: the way in's name for messages.
        recipe: :class:`PythonRecipe`; loss_fn: see :attr:`PythonRun.per_example_loss`.
        user_level: the privacy unit is a user.

    Raises:
        PlanError: a method that counts rows at user level (``example_level_only``).
    """

    def __init__(self, methods: Sequence[Method], *, model, n: int, ledger, rng, where: str, recipe: PythonRecipe,
                 loss_fn: Optional[Callable] = None, user_level: bool = False):
        self.methods = list(methods)
        self.where = where
        if user_level:
            bad = [m.name for m in self.methods if getattr(m, "example_level_only", False)]
            if bad:
                raise PlanError(f"{where}: methods {bad} assume example-level privacy (their statistics and "
                                "coordinates count rows); run them without user-level units")
        self.ctx = PythonRun(recipe=recipe, run_dir=None, resume=False, progress=False, private=True, rng=rng,
                             ledger=ledger, live_ledger_path=None, task=None, tokenizer=None, model=model,
                             loss_fn=None, train_tok=None, dev_tok=None, n=int(n), q=0.0, sampler=None,
                             total_steps=0, evaluate=None, make_optimizer=None)
        self.ctx.per_example_loss = loss_fn

    def __bool__(self) -> bool:
        return bool(self.methods)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.methods]

    def prepare(self) -> None:
        """The methods' ``prepare`` (earlier releases recorded; checks), before σ is calibrated.

        Raises:
            PlanError: a method's own refusal, prefixed with the way in's name."""
        for m in self.methods:
            try:
                m.prepare(self.ctx)
            except ValueError as exc:
                raise PlanError(f"{self.where}: method {m.name!r}: {exc}") from None

    def on_sigma(self, sigma: Optional[float]) -> None:
        """The plan's ``on_sigma``: σ is resolved, before the hooks (a method's ``build`` reads it)."""
        self.ctx.sigma = float(sigma) if sigma is not None else 0.0

    @property
    def hooks(self) -> list[Callable]:
        """The methods' ``build`` as the plan's hooks (each returns a changed copy of the spec).

        Raises (when the plan runs them): PlanError with the way in's name."""
        def hook(spec, m):
            try:
                return m.build(spec, self.ctx)
            except PlanError:
                raise
            except ValueError as exc:
                raise PlanError(f"{self.where}: method {m.name!r}: {exc}") from None

        return [lambda spec, m=m: hook(spec, m) for m in self.methods]

    def after_update(self, out) -> dict[str, Any]:
        """Every method's ``after_update`` on one step's :class:`~dpft.step.StepOutput`, after the
        noisy update is applied; returns what they release (privatised statistics only)."""
        res: dict[str, Any] = {}
        for m in self.methods:
            res.update(m.after_update(out, self.ctx))
        return res

    def report(self) -> dict[str, Any]:
        """The methods' report sections (key: ``report_key`` or ``name``)."""
        return {(m.report_key or m.name): m.report(self.ctx) for m in self.methods}

    @property
    def stateful(self) -> list[str]:
        """Methods whose ``after_update`` carries state from step to step that a checkpoint does not
        hold (DP-Adam-AC's C): a resumed loop would restart it."""
        return [m.name for m in self.methods if type(m).after_update is not Method.after_update]

