"""Methods are plug-ins: a :class:`Method` gets hooks, never the trainer's internals.

A method is one file in ``methods/`` (or in the user's own code) holding its recipe config
model and a :class:`Method` subclass registered with :func:`register_method`. The driver
(``run/loop.py``) composes the recipe's methods in ``order`` and holds no method name:

- ``prepare(run)``: earlier private phases (a private subspace, DP synthetic data) that append
  to the run's ledger through :meth:`Run.record`, and model/loss/data wrapping (forward LDP
  wraps ``run.model`` and ``run.loss_fn``, label RR replaces ``run.train_tok``);
- ``build(spec, run) -> spec``: a changed copy of the DP step's parts (engine, clip policy,
  mechanism, transforms, optimizer) — see :class:`dpft.step.StepSpec`;
- ``before_step(step, run)`` and ``after_update(out, run) -> dict``: per-step hooks; what
  ``after_update`` returns is released (privatised statistics only);
- ``evaluate(run, evaluate) -> dict | None``: replace or extend evaluation (e.g. an EMA);
- ``report(run) -> dict``: the method's section of ``report.json`` (key ``name``);
  ``markdown(rep) -> list[str]`` its lines in ``report.md``; ``privacy_section(run)`` may
  replace the run's privacy section (forward LDP has its own guarantees);
- ``finish(run)``: after training (e.g. save extra weights).

Multi-phase methods: a method whose earlier phase is a training run of its own (DP-SFT's
stage 1) runs it in ``prepare`` through ``run.train_phase(recipe, run_dir, *, phase, ledger,
rng, live_ledger_path, on_step, progress)``, the driver's phase runner injected into
:class:`Run` (a :class:`TrainPhase` back: ``sigma``, ``params``, ``ledger``, ``run()``); a
private phase passes the run's ledger and phase name, so every phase appends to the one
ledger. ``on_step(done, params)`` is called after each completed step (e.g. to snapshot Θ_t).
A pipeline outside a run (DP-SelFT's selection, then fine-tuning) receives the same runner from
its caller, or :func:`phase_runner` (the driver registered with :func:`register_phase_runner`).
Methods never import the driver (``run/``), nor load it by name.

A method declares what the driver checks: ``supports_ddp`` (runs under torchrun as it does
alone), ``supports_fsdp`` / ``sharded_refusal`` (runs on FSDP2 shards), ``supports_device``
(runs on an accelerator); ``card_mechanism``/``card_usage`` give
the model card's lines where the method changes them (the driver names no method).

A recipe names its methods in ``methods:`` (a list of ``{name: ..., <config keys>}``; the
``name`` picks the registered config model: a discriminated union over an open registry). The
built-ins also keep their historical top-level sections (``subspace:``, ``ldp:``, ``adam_ac:``,
``denoise:``), which the recipe loader moves into ``methods:``. The recipe schema asks this registry
through :func:`recipe_schema`, handed to it by the package ``dpft.methods``; the built-ins register
through the loader that package hands (:func:`set_builtin_loader`): the registry imports no method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Protocol

import dp_accounting as dpa
from pydantic import BaseModel

from dpft.config.methods_hook import MethodsSchema

if TYPE_CHECKING:
    from dpft.accounting.ledger import PrivacyLedger
    from dpft.privacy.randomness import Randomness
    from dpft.step import StepOutput, StepSpec

#: name → Method subclass.
_REGISTRY: dict[str, type["Method"]] = {}
#: legacy top-level recipe section → method name.
LEGACY_SECTIONS: dict[str, str] = {}


class MethodError(ValueError):
    """A method configuration that cannot run; the message names the fix."""


class Method:
    """Base class of a plug-in. Subclasses set ``name`` and ``config`` (a pydantic model) and
    override the hooks they need; every hook's default does nothing.

    Args:
        cfg: the validated config (an instance of ``config``).
        recipe: the whole recipe (read-only).
    """

    name: ClassVar[str] = ""
    config: ClassVar[type[BaseModel]]
    #: Composition order: lower first (DP-SFT's engine before DP-Adam-AC's optimizer).
    order: ClassVar[int] = 50
    #: Historical top-level recipe section of a built-in (``subspace``…), if any.
    legacy_section: ClassVar[Optional[str]] = None
    #: Key of the method's section in report.json (default: ``name``).
    report_key: ClassVar[Optional[str]] = None
    #: The method runs under DDP (torchrun) as it does in one process: it draws per-example
    #: randomness per rank and reads only all-reduced statistics (distributed.py
    #: ``check_methods`` refuses the others across processes).
    #: The method changes neither the model's frozen part nor the training rows (it may set trainable
    #: weights in ``prepare``): the driver may compute the frozen part once per row (run/features.py).
    keeps_frozen_part: ClassVar[bool] = False
    supports_ddp: ClassVar[bool] = False
    #: Why the method cannot run across processes, in terms of its mechanism (shown in the
    #: refusal of ``distributed.check_methods``); None = no reason given.
    ddp_refusal: ClassVar[Optional[str]] = None
    #: The method runs on FSDP2-sharded parameters (``perf.sharding: fsdp``, ``make_private`` on a
    #: ``fully_shard``-ed model, DPTrainer with ``fsdp``) as it does in one process: its transforms
    #: see this rank's row shard of the noisy gradient (or declare ``whole_tensors`` to get the
    #: gathered tensors: dpft/placement/fsdp_methods.py), its optimizer and statistics work on shards or on the
    #: world's all-reduced counts. Checked by :meth:`sharded_refusal`.
    supports_fsdp: ClassVar[bool] = False
    #: Why the method cannot run on sharded parameters, in terms of its maths (shown in the FSDP
    #: refusal of every way in); None = "not verified".
    fsdp_refusal: ClassVar[Optional[str]] = None
    #: Every tensor the method creates follows the model's device (buffers, bases, noise drawn
    #: with ``Randomness.stream(..., device=...)``), so it runs on an accelerator; a method that
    #: does not declare it is run on the CPU (``perf.device: auto``) or refused (perf.py).
    supports_device: ClassVar[bool] = False
    #: The method leaves the run's ledger events unchanged (no earlier private phase, the same
    #: per-step event: e.g. post-processing, or a count folded into the step's one Gaussian), so a
    #: private search (``dpft tune``, run/tune.py) may vary its settings and switch it on or off
    #: freely; a method that does not declare it is refused inside a search.
    search_events_unchanged: ClassVar[bool] = False
    #: Config fields that make a run NOT CERTIFIED (refused inside a search).
    uncertified_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def python_refusal(cls, cfg: BaseModel) -> Optional[str]:
        """Why this method cannot run through ``make_private(methods=…)`` / ``DPArguments(methods=…)``
        (None: it can). Default: it needs ``dpft train``'s driver (its earlier phases, the recipe's
        optimizer or its run folder); a method that only changes the step's parts overrides this."""
        return ("it needs dpft train's driver (its earlier private phases, the recipe's optimizer or data, or the "
                "run folder); run it with `dpft train`")

    @classmethod
    def sharded_refusal(cls, cfg: BaseModel) -> Optional[str]:
        """Why this method (with this config) cannot run on FSDP2-sharded parameters, or None.
        Default: :attr:`fsdp_refusal` unless :attr:`supports_fsdp`; a method whose config decides
        (e.g. a NOT CERTIFIED diagnostic that reads the clean sum) overrides this."""
        if cls.supports_fsdp:
            return None
        return cls.fsdp_refusal or ("not verified on FSDP2-sharded parameters (a plug-in declares supports_fsdp = True "
                                    "once its transforms, optimizer and statistics work on row shards: "
                                    "dpft/placement/fsdp_methods.py)")

    def __init__(self, cfg: BaseModel, recipe: Any):
        self.cfg = cfg
        self.recipe = recipe

    @classmethod
    def enabled(cls, cfg: BaseModel) -> bool:
        """Whether this config asks for the method at all (e.g. ``ldp.enabled``)."""
        return True

    def prepare(self, run: "Run") -> None:
        """Earlier phases and model/loss/data wrapping, before σ is calibrated."""

    def build(self, spec: "StepSpec", run: "Run") -> "StepSpec":
        """Return a changed copy of the step's parts (``spec.replace(...)``)."""
        return spec

    def before_step(self, step: int, run: "Run") -> None:
        """Called before logical step ``step`` is sampled."""

    def after_update(self, out: "StepOutput", run: "Run") -> dict[str, Any]:
        """Called after the optimizer step; returns released fields for metrics.jsonl."""
        return {}

    def evaluate(self, run: "Run", evaluate: Callable[[], dict[str, float]]) -> Optional[dict[str, float]]:
        """Replace the dev evaluation (None = the driver's own)."""
        return None

    def epsilon(self, run: "Run") -> Optional[float]:
        """ε shown during training when the method defines its own guarantee (None = ledger's)."""
        return None

    def privacy_section(self, run: "Run") -> Optional[dict[str, Any]]:
        """Replace the report's privacy section (None = the ledger's DP-SGD section)."""
        return None

    def report(self, run: "Run") -> dict[str, Any]:
        """The method's section of report.json (under key ``name``)."""
        return {}

    @classmethod
    def markdown(cls, rep: dict[str, Any]) -> list[str]:
        """Lines for report.md, from report.json alone (``dpft report`` re-renders it)."""
        return []

    @classmethod
    def card_mechanism(cls, rep: dict[str, Any]) -> Optional[str]:
        """The model card's mechanism row for a non-private run whose guarantee is the
        method's own (e.g. a forward-pass noise layer); None = the driver's row."""
        return None

    @classmethod
    def card_usage(cls, rep: dict[str, Any]) -> Optional[list[str]]:
        """The model card's "Use" lines when the saved model needs more than a ``pipeline``
        (e.g. a split deployment); None = the driver's."""
        return None

    def weights(self):
        """Context manager giving the method's weights of record (e.g. an EMA) for generation."""
        import contextlib

        return contextlib.nullcontext()

    def finish(self, run: "Run") -> None:
        """After training, before the report (e.g. save EMA weights)."""


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` available to recipes as ``methods: [{name: cls.name, …}]``.

    Raises:
        MethodError: no name or config, or the name is taken by another class.
    """
    if not cls.name or not isinstance(getattr(cls, "config", None), type):
        raise MethodError(f"{cls.__name__}: a Method needs a class attribute name and a pydantic config model")
    old = _REGISTRY.get(cls.name)
    if old is not None and old.__qualname__ != cls.__qualname__:
        raise MethodError(f"method name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    _REGISTRY[cls.name] = cls
    if cls.legacy_section:
        LEGACY_SECTIONS[cls.legacy_section] = cls.name
    return cls


def registered() -> dict[str, type[Method]]:
    """Name → class of every registered method (built-ins are imported first)."""
    _load_builtins()
    return dict(_REGISTRY)


def get_method(name: str) -> type[Method]:
    """Raises MethodError naming the registered methods when ``name`` is unknown."""
    reg = registered()
    if name not in reg:
        import difflib

        hint = difflib.get_close_matches(name, list(reg), n=1)
        raise MethodError(f"unknown method {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                          + f" (registered: {', '.join(sorted(reg))}; a plug-in registers with "
                          "dpft.register_method before the recipe is loaded)")
    return reg[name]


#: ``() -> None``: registers the built-in methods (each file registers its class on import), handed
#: by the package ``dpft.methods`` (:func:`set_builtin_loader`); the registry imports no method file.
_BUILTIN_LOADER: Optional[Callable[[], None]] = None


def set_builtin_loader(load: Callable[[], None]) -> None:
    """Hand the registry the loader of the built-in methods, run once when the registry is first read
    (the built-ins register like any plug-in; loading them when first needed keeps ``dpft --help``
    free of the model libraries they import)."""
    global _BUILTIN_LOADER
    _BUILTIN_LOADER = load


def _load_builtins() -> None:
    global _BUILTIN_LOADER
    load, _BUILTIN_LOADER = _BUILTIN_LOADER, None
    if load is not None:
        load()


class TrainPhase(Protocol):
    """A training phase built by the driver's phase runner (``Run.train_phase``), resolved
    before its first step.

    Attributes:
        sigma: the phase's noise multiplier (calibrated on the ledger's earlier events; 0 for a
            non-private phase).
        params: name → trainable parameter the phase updates (its Θ_0 until ``run()``).
        ledger: the ledger the phase appends to (the caller's, when it passed one).
    """

    sigma: float
    params: dict
    ledger: "PrivacyLedger"

    def run(self) -> dict[str, Any]:
        """Train the phase to its last step; returns its report (also ``<run_dir>/report.json``)."""
        ...


#: ``(recipe, run_dir, *, phase="train", ledger=None, rng=None, live_ledger_path=None,
#: on_step=None, progress=True) -> TrainPhase``: the driver's phase runner.
PhaseRunner = Callable[..., TrainPhase]

_PHASE_RUNNER: Optional[PhaseRunner] = None


def register_phase_runner(runner: PhaseRunner) -> None:
    """Make ``runner`` the phase runner of :func:`phase_runner` (the driver calls this)."""
    global _PHASE_RUNNER
    _PHASE_RUNNER = runner


def phase_runner() -> PhaseRunner:
    """The driver's phase runner, for a pipeline that is not inside a run (inside one, use
    ``run.train_phase``): the one the driver registered (``dpft.run.loop`` does on import). No
    method file imports the driver, and none is loaded by name: the caller hands it.

    Raises:
        MethodError: no driver registered one (the message names the fix).
    """
    if _PHASE_RUNNER is None:
        raise MethodError("no phase runner registered: pass train_phase=dpft.run.loop.train_phase (the driver's "
                          "phase runner; importing dpft.run.loop also registers it)")
    return _PHASE_RUNNER


@dataclass
class Run:
    """What a method may see and change of a run (the trainer's internals stay private).

    Settable in ``prepare``: ``model``, ``loss_fn``, ``train_tok``, ``total_steps``.
    Read-only by convention: the rest. Ledger appends go through :meth:`record`.
    """

    recipe: Any
    run_dir: Path
    resume: bool
    progress: bool
    private: bool
    rng: "Randomness"
    ledger: "PrivacyLedger"
    live_ledger_path: Path
    task: Any
    tokenizer: Any
    model: Any
    loss_fn: Any
    train_tok: Any
    dev_tok: Any
    n: int
    q: float
    sampler: Any
    total_steps: int
    evaluate: Callable[[], dict[str, float]]
    make_optimizer: Callable[[dict], Any]
    #: σ of the training phase (set by the driver after calibration; 0 for non-private runs).
    sigma: float = 0.0
    #: Notes a method adds to the report's notes list.
    notes: list[str] = field(default_factory=list)
    #: The driver's phase runner (:data:`PhaseRunner`): an earlier training phase of a method
    #: runs through it and appends to this run's ledger (None: the caller gave none).
    train_phase: Optional[PhaseRunner] = None
    #: This process writes the run's files (rank 0 under DDP; always in one process).
    is_main: bool = True
    #: This process's rank and the number of processes (DDP; 0 and 1 alone): a method that
    #: draws per-example randomness draws it from streams that name the rank.
    rank: int = 0
    world_size: int = 1

    def record(self, phase: str, event: dpa.DpEvent, count: int = 1) -> None:
        """Append a release to the run's ledger and save the live ``ledger.json`` at once
        (every rank keeps the same ledger; rank 0 alone writes it)."""
        self.ledger.record(phase, event, count)
        if not self.is_main:
            return
        self.live_ledger_path.parent.mkdir(parents=True, exist_ok=True)
        self.ledger.save(self.live_ledger_path)

    @property
    def device(self):
        """The device of the model's parameters (CPU for a model without parameters)."""
        import torch

        p = next(iter(self.model.parameters()), None) if self.model is not None else None
        return p.device if p is not None else torch.device("cpu")


def active_methods(recipe: Any) -> list[Method]:
    """The recipe's enabled methods, instantiated, in composition order."""
    out = []
    for cfg in recipe.methods:
        cls = get_method(method_name(cfg))
        if cls.enabled(cfg):
            out.append(cls(cfg, recipe))
    return sorted(out, key=lambda m: m.order)


def method_name(cfg: BaseModel) -> str:
    """The registered name of a validated method config."""
    for name, cls in registered().items():
        if type(cfg) is cls.config:
            return name
    raise MethodError(f"{type(cfg).__name__} is not the config of a registered method")


def _legacy_sections() -> dict[str, str]:
    registered()  # the built-ins declare their legacy sections when registered
    return dict(LEGACY_SECTIONS)


def recipe_schema() -> MethodsSchema:
    """This registry's side of the recipe schema, which the registry's callers hand to the schema
    (``dpft.config.recipe.set_methods_schema``; the package ``dpft.methods`` does on import): it
    validates ``methods:`` through this registry without importing it."""
    return MethodsSchema(legacy_sections=_legacy_sections, config_model=lambda name: get_method(name).config,
                         name_of=method_name)
