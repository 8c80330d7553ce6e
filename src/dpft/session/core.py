"""The private session every way in asks for what it needs: world and secret key, privacy unit and
sampler, the methods' preparation, the privacy plan, the step for this world, and the secret state
beyond the key (DESIGN.md "Layout": session; issue 46 item 1).

A way in (``dpft train``, ``make_private``, ``DPTrainer``) translates its own arguments into one
:class:`SessionSettings` and hands the session what only it knows: the rows, the clip and engine
(``parts(sampler) -> (clip, engine)``), the optimizer, and a factory of its prepared methods (the
session sits below ``methods/`` and never imports them). Everything else is built here, once, the
same way for every way in::

    session = PrivateSession.open(seed, ledger=ledger, where="make_private")  # world + key (session/world.py)
    plan = session.plan(settings, rows=rows, n_rows=N, rng=session.rng.child("loop"), parts=parts,
                        optimizer=optimizer, users=(user ids, column) or None, methods=factory)
    step = session.step(plan, sharded=False, on_release=...)              # session/step.py
    state = session.secret_state(step)                                    # versioned; restore_secret_state

A way in that readies its model between the methods' preparation and the plan (``dpft train``,
run/plan.py: rank 0's weights, FSDP2 shards, frozen features) calls :meth:`PrivateSession.prepare`
first; :meth:`PrivateSession.plan` then continues from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

from dpft.accounting.ledger import PrivacyLedger
from dpft.config.refusals import refuse, way_of
from dpft.placement import world as ddp
from dpft.privacy.randomness import Randomness
from dpft.session.step import step_for
from dpft.session.world import session_world
from dpft.step.correlated import check_secret_state, secret_state
from dpft.step.mechanisms import Mechanism
from dpft.step.plan import PlanSettings, PrivacyPlan, PrivacySettings, build_privacy_plan, planned_steps
from dpft.step.unit import PrivacyUnit, build_user_unit

__all__ = ["SessionSettings", "PrivateSession"]


@dataclass(frozen=True, kw_only=True)
class SessionSettings(PrivacySettings):
    """The privacy settings of one private loop, as a way in translated its arguments: the
    :class:`~dpft.step.plan.PrivacySettings` (B, σ or (ε, target_delta), phase, private, hardened;
    declared once, shared with the plan's :class:`~dpft.step.plan.PlanSettings`) and what only the
    session reads. N and T are not known yet: :meth:`plan_settings` is the plan's value once they are.

    Attributes:
        max_grad_norm: C > 0 (L2 bound of one unit's clipped gradient).
        mechanism: the mechanism part (step/mechanisms.py ``mechanism_of``).
        steps / epochs: the planned length (step/plan.py ``planned_steps``; None: neither, σ given).
        clipping: the clip style's name (compared across ranks; the clip itself is the way in's).
        max_rows_per_user, user_clipping: user level (``users`` given to :meth:`PrivateSession.plan`).
    """

    max_grad_norm: float
    mechanism: Mechanism
    steps: Optional[int] = None
    epochs: Optional[float] = None
    clipping: str = "flat"
    max_rows_per_user: int = 4
    user_clipping: str = "group"

    def planned(self, n: int) -> Optional[int]:
        """The planned logical steps over ``n`` units: ``steps``, else ⌈epochs · N / B⌉ (step/plan.py
        ``planned_steps``, the one rule of every way in); None when neither is set."""
        if self.steps is None and self.epochs is None:
            return None
        return planned_steps(n, self.expected_batch_size, self.steps, self.epochs)

    def plan_settings(self, n: int, steps: int, sampler: Any = None) -> PlanSettings:
        """The plan's settings value over ``n`` units for ``steps`` steps (``sampler``: the unit's own),
        what :meth:`PrivateSession.plan` has the plan built from (its ``calibrated.settings``)."""
        return PlanSettings.of(self.mechanism, n=n, steps=steps, sampler=sampler, **self.privacy_settings())

    def same_on_every_rank(self) -> tuple:
        """What every rank of a world must agree on: every setting (the mechanism by its name and settings)."""
        m = self.mechanism
        return (m.name, tuple(sorted((k, v) for k, v in vars(m).items() if k != "names")),
                *((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "mechanism"))


@dataclass
class PrivateSession:
    """One private session: this process's world and the run's secret key, one ledger, and what
    :meth:`prepare`, :meth:`plan` and :meth:`step` build for it (see the module docstring).

    Construct with :meth:`open`. Attributes set by :meth:`prepare` (which :meth:`plan` calls):
    ``unit`` (the way in's unit, or the user-level :class:`~dpft.step.unit.PrivacyUnit` built from
    ``users``; None at example level), ``user_level``, ``n`` (N units), ``planned`` (logical steps,
    or None: neither steps nor epochs), ``methods`` (what the way in's factory returned, prepared).
    """

    world: ddp.World
    rng: Randomness
    ledger: PrivacyLedger
    where: str = "dpft"
    unit: Optional[PrivacyUnit] = None
    user_level: bool = False
    n: Optional[int] = None
    planned: Optional[int] = None
    methods: Any = None
    #: The unit's sampler (the way in's, or the user-level one); None: the plan builds the mechanism's own. The plan
    #: value records the same for the mechanism's own sampler handed in (step/mechanisms.py ``Mechanism.owns``).
    unit_sampler: Any = None
    #: The settings :meth:`prepare` ran for, until the next :meth:`plan` (which prepares itself otherwise).
    prepared: Optional[SessionSettings] = field(default=None, repr=False)

    @classmethod
    def open(cls, seed: Optional[int] = None, *, rng: Optional[Randomness] = None,
             ledger: Optional[PrivacyLedger] = None, made_for: Optional[ddp.World] = None,
             same: Optional[Any] = None, where: str = "dpft") -> "PrivateSession":
        """Join the world and take the run's secret key (:func:`~dpft.session.world.session_world`:
        rank 0 draws it and broadcasts it, or it derives from ``seed``; ``rng``: the key the caller's
        earlier session holds, made in ``made_for``; ``same``: a JSON-able recipe every rank must
        hold, checked before the key is drawn).

        Raises:
            DistributedError: as ``session_world``."""
        world, key = session_world(seed, rng, same=same, made_for=made_for, where=where)
        return cls(world, key, ledger if ledger is not None else PrivacyLedger(), where)

    # ------------------------------------------------------------------ the unit
    def user_unit(self, s: SessionSettings, users: Optional[tuple[Sequence, str]], rng) -> Optional[PrivacyUnit]:
        """The user-level privacy unit over ``users = (one id per row, how they are named)``, or
        None (example level).

        Raises:
            ValueError: what ``build_user_unit`` refuses, prefixed with the way in and the column."""
        if users is None:
            return None
        values, column = users
        try:
            return build_user_unit(values, s.expected_batch_size, s.max_rows_per_user, rng, s.user_clipping, column)
        except ValueError as exc:
            raise ValueError(f"{self.where} (user level, user_ids={column!r}): {exc}") from None

    def check_same(self, what: Any) -> None:
        """Under torch.distributed every rank must describe the same loop over the same data.

        Raises:
            DistributedError: a rank's ``what`` (N rows, N units, the settings) differs from rank 0's."""
        w = self.world
        if w.distributed and ddp.any_rank(w, what != ddp.broadcast_object(w, what)):
            raise ddp.DistributedError(
                f"{self.where}: the ranks passed different datasets or privacy arguments (N rows, N users, batch "
                f"size, steps/epochs, σ or target, C, clipping, mechanism); call {self.where} with the same data "
                "and arguments on every rank")

    # ------------------------------------------------------------------ the methods' preparation
    def prepare(self, s: SessionSettings, *, n_rows: int, rng: Randomness, unit: Optional[PrivacyUnit] = None,
                users: Optional[tuple[Sequence, str]] = None,
                methods: Optional[Callable[[int, Randomness, bool], Any]] = None,
                method_list: Sequence = (), method_registry: Optional[dict] = None, same: Any = None) -> None:
        """Everything before the plan, in order: the privacy unit and N units; the same settings on
        every rank (``same`` added to them); the planned steps :attr:`planned` (``s.planned(N)``: the
        one count of every way in, before the methods see it); the methods run across ranks; the
        methods prepared.

        Args:
            n_rows: N rows; rng: this loop's randomness (a child of :attr:`rng`).
            unit: the way in's own privacy unit (``dpft train``'s run/unit.py: example level, user
                level or a batch schedule: its sampler and N); or ``users``: user level over
                ``(one id per row, column)`` (step/unit.py ``build_user_unit``); none: example level
                over the rows.
            methods: ``methods(n, rng, user_level)`` returns the way in's plug-ins, offering
                ``prepare``, ``hooks`` and ``on_sigma``; their earlier releases enter the ledger here,
                before σ is calibrated after them.
            method_list: checked to run across ranks (``method_registry``: name → class, for the
                message; placement/world.py ``check_methods``).

        Raises:
            ValueError, PlanError, DistributedError: naming the fix."""
        self.unit = unit if unit is not None else self.user_unit(s, users, rng)
        if unit is not None:
            self.unit_sampler, n, self.user_level = unit.sampler, unit.n, unit.user_level
        else:
            self.unit_sampler = self.unit.sampler if self.unit is not None else None
            n = self.unit.n if self.unit is not None else n_rows
            self.user_level = self.unit_sampler is not None
        self.check_same((n_rows, n, *s.same_on_every_rank(), same))
        self.n, self.planned = n, s.planned(n)
        ddp.check_methods(self.world, list(method_list), registry=method_registry)
        self.methods = methods(n, rng, self.user_level) if methods is not None else None
        if self.methods is not None:
            self.methods.prepare()
        self.prepared = s

    # ------------------------------------------------------------------ the plan
    def plan(self, s: SessionSettings, *, rows: Any, n_rows: int, rng: Randomness,
             parts: Callable[[Any], tuple[Any, Any]], optimizer: Any = None,
             optimizer_factory: Optional[Callable[[dict], Any]] = None, users: Optional[tuple[Sequence, str]] = None,
             unit: Optional[PrivacyUnit] = None,
             total_steps: Optional[int] = None, methods: Optional[Callable[[int, Randomness, bool], Any]] = None,
             method_list: Sequence = (), same: Any = None, transforms: Sequence = (), head_mask=None,
             padded: bool = False) -> PrivacyPlan:
        """The privacy plan of one loop (step/plan.py ``build_privacy_plan``, the one plan builder).

        In order: :meth:`prepare` (unless it ran for ``s``: then its unit and methods stand, and
        ``users``, ``unit``, ``methods``, ``method_list`` and ``same``
        are its, not read here); the planned steps (:attr:`planned`, counted by :meth:`prepare`;
        ``total_steps``: the length the way in's methods set in their ``prepare``, ``dpft train``'s); σ
        calibrated by rank 0 on the events this loop records after those the ledger holds (the
        methods' ``on_sigma`` told); the methods' ``build`` hooks; the mechanism's install. The spec's
        clip is then the engine's (a method may swap it); user-level group clipping on an engine that
        cannot clip groups is refused (:meth:`check_groups`, the same words for every way in); raw
        per-example norms (``keep_norms``) are refused across ranks.

        Args:
            rows: the training rows the sampler indexes (a stateful mechanism fingerprints them);
                n_rows: N rows; padded: the rows are padded to fixed shapes (truncated Poisson masks
                the padding).
            rng: this loop's randomness (a child of :attr:`rng`).
            parts: ``sampler -> (clip, engine)``; optimizer: the step's optimizer (or a stand-in), or
                ``optimizer_factory``: ``engine.params -> optimizer``.

        Raises:
            ValueError, PlanError, CalibrationError, DistributedError: naming the fix."""
        if self.prepared is not s:
            self.prepare(s, n_rows=n_rows, rng=rng, unit=unit, users=users, methods=methods,
                         method_list=method_list, same=same)
        self.prepared = None  # one preparation per plan: a later plan prepares anew
        if total_steps is not None:
            self.planned = total_steps
        w, m = self.world, self.methods
        plan = build_privacy_plan(
            n=self.n, steps=self.planned or 0, mechanism=s.mechanism, **s.privacy_settings(), rng=rng, parts=parts,
            optimizer=optimizer, optimizer_factory=optimizer_factory, prior=self.ledger.events(),
            calibrate=lambda f: ddp.on_rank0(w, f), sampler=self.unit_sampler, rows=rows, padded=padded,
            transforms=list(transforms), head_mask=head_mask, hooks=m.hooks if m is not None else (),
            on_sigma=m.on_sigma if m is not None else None)
        plan.spec.engine.clip = plan.spec.clip  # the spec's clip is in force (a method may swap it; as DPStep.run)
        self.check_groups(s, plan.spec.engine)
        ddp.check_methods(w, [], keep_norms=plan.spec.keep_norms)  # no raw per-example norms across ranks
        return plan

    @property
    def way(self) -> str:
        """This session's way in as the refusal registry names it (config/refusals.py ``way_of``)."""
        return way_of(self.where)

    def check_groups(self, s: SessionSettings, engine: Any) -> None:
        """At user level with ``user_clipping='group'`` the engine must clip a user's rows as one group
        (``supports_groups``); checked on the plan's engine, after the methods' ``build`` (which may swap it).

        Raises:
            PlanError: registry refusal ``task.user_clipping:group_engine``, worded for this way in."""
        if self.user_level and s.user_clipping == "group" and not getattr(engine, "supports_groups", False):
            named = getattr(engine, "inner", engine)  # truncated Poisson's MaskedEngine: the engine it wraps
            raise refuse("task.user_clipping:group_engine", self.way, got=type(named).__name__)

    # ------------------------------------------------------------------ the step
    def step(self, plan: PrivacyPlan, *, sharded: bool = False, on_release: Optional[Callable[[], None]] = None,
             dummy_batch: Optional[Callable[[], Any]] = None):
        """The DP step of ``plan`` for this world (session/step.py ``step_for``): ``DPStep`` in one
        process and under DDP, ``FSDPStep`` over an FSDP2 model (the plain sharded step for a plan
        that is not private); it is the only writer of :attr:`ledger`. ``dummy_batch``: the sharded
        step's placeholder micro-batch (``dpft train``; None: a loop the user drives)."""
        return step_for(plan, self.world, self.ledger, plan.n, sharded=sharded, private=plan.private,
                        on_release=on_release, dummy_batch=dummy_batch)

    # ------------------------------------------------------------------ secret state beyond the key
    @staticmethod
    def secret_state(step, at: Optional[int] = None) -> dict:
        """The secret state of ``step``'s mechanism in the one versioned format every way in writes
        (``dpft-secret-state`` v1, step/correlated.py ``secret_state``; a collective under FSDP2: each
        rank's buffer slices are gathered): nothing beyond the format for a mechanism that is not
        ``stateful`` (the key alone, never written). **Secret**: never in a release set.

        Args:
            at: the step of the checkpoint the state goes with: a stateful mechanism must be at it
                (checked on every rank before the FSDP2 gather, so a mismatch raises everywhere).

        Raises:
            ValueError: the mechanism's state is at another step than ``at``."""
        return secret_state(step.spec.mechanism, at)  # the one step check (step/correlated.py check_state_step)

    @staticmethod
    def restore_secret_state(step, state: Optional[dict], where: str = "resume", *, at: Optional[int] = None,
                             replayed: int = 0, fresh: str = "run") -> None:
        """Restore what :meth:`secret_state` gave into ``step``'s mechanism (before its first step),
        or a state written before the format (step/correlated.py ``check_secret_state``: once per load, a
        state a reader already checked, a ``SecretState``, is not checked again). The
        refusals of every way in's resume (``where``: its resume option; ``fresh``: what to start
        anew, e.g. ``--output-dir``):

        Args:
            at: the checkpoint's step: a stateful state must be at it (the file holds the newest
                checkpoint's state: resume from the last checkpoint).
            replayed: releases made after the checkpoint (a crash between checkpoints): refused for
                a stateful mechanism — releasing those steps again would reuse earlier batches under
                fresh correlated noise, which its accounting does not cover.

        Raises:
            ValueError: another format or version; a stateful state for a stateless mechanism (or
                the other way round, or missing); releases after the checkpoint; a state of another
                step; what the mechanism's ``load_state`` refuses (other coefficients, rows or
                partition) — each prefixed with ``where`` and naming the fix."""
        mech = step.spec.mechanism
        stateful = mech is not None and mech.stateful
        if stateful and replayed > 0:
            raise ValueError(f"{where}: {replayed} release(s) of the stateful {type(mech).__name__} were made after "
                             f"the checkpoint at step {at}; replaying them is not covered by its accounting (banded_mf: "
                             f"correlated noise). Start a new {fresh} (the ledger of this directory keeps what was "
                             "spent)")
        if state is None and stateful:
            raise ValueError(f"{where}: no secret state for the stateful {type(mech).__name__}; start a new {fresh}")
        if state is None:
            return
        check_secret_state(state, where)
        if bool(state.get("stateful", "buffers" in state)) != stateful:
            raise ValueError(f"{where}: the secret state is {'' if not stateful else 'not '}of a stateful mechanism "
                             f"and this step's ({type(mech).__name__}) is {'' if stateful else 'not '}stateful; "
                             "resume with the settings that saved it")
        if not stateful:
            return
        if at is not None and int(state["next_step"]) != int(at):
            raise ValueError(f"{where}: the secret noise state is at step {state['next_step']}, the checkpoint at step "
                             f"{at}; start a new {fresh}")
        try:
            mech.load_state(state, dict(step.params))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
