"""The private session every way in asks for what it needs: world and secret key, privacy unit and
sampler, the methods' preparation, the privacy plan, the step for this world, and the secret state
beyond the key (DESIGN.md "Layout": session; issue 46 item 1).

A way in (``make_private``, ``DPTrainer``) translates its own arguments into one
:class:`SessionSettings` and hands the session what only it knows: the rows, the clip and engine
(``parts(sampler) -> (clip, engine)``), the optimizer, and a factory of its prepared methods (the
session sits below ``methods/`` and never imports them). Everything else is built here, once, the
same way for every way in::

    session = PrivateSession.open(seed, ledger=ledger, where="make_private")  # world + key (session/world.py)
    plan = session.plan(settings, rows=rows, n_rows=N, rng=session.rng.child("loop"), parts=parts,
                        optimizer=optimizer, users=(user ids, column) or None, methods=factory)
    step = session.step(plan, sharded=False, on_release=...)              # session/step.py
    state = session.secret_state(step)                                    # versioned; restore_secret_state
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dpft.accounting.ledger import PrivacyLedger
from dpft.placement import world as ddp
from dpft.privacy.randomness import Randomness
from dpft.session.step import step_for
from dpft.session.world import session_world
from dpft.step.correlated import check_secret_state, secret_state
from dpft.step.mechanisms import Mechanism
from dpft.step.plan import PrivacyPlan, build_privacy_plan, planned_steps
from dpft.step.unit import PrivacyUnit, build_user_unit

__all__ = ["SessionSettings", "PrivateSession"]


@dataclass(frozen=True)
class SessionSettings:
    """The privacy settings of one private loop, as a way in translated its arguments.

    Attributes:
        max_grad_norm: C > 0 (L2 bound of one unit's clipped gradient).
        expected_batch_size: B, the expected logical batch in units (rows, or users).
        mechanism: the mechanism part (step/mechanisms.py ``mechanism_of``).
        steps / epochs: the planned length (step/plan.py ``planned_steps``; None: neither, σ given).
        noise_multiplier: σ, or target_epsilon + target_delta: the (ε, δ) σ is calibrated to.
        clipping: the clip style's name (compared across ranks; the clip itself is the way in's).
        hardened: hardened noise draws (privacy/randomness.py).
        max_rows_per_user, user_clipping: user level (``users`` given to :meth:`PrivateSession.plan`).
        phase: the ledger phase of the loop's releases.
    """

    max_grad_norm: float
    expected_batch_size: int
    mechanism: Mechanism
    steps: Optional[int] = None
    epochs: Optional[float] = None
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    clipping: str = "flat"
    hardened: bool = True
    max_rows_per_user: int = 4
    user_clipping: str = "group"
    phase: str = "train"

    def same_on_every_rank(self) -> tuple:
        """What every rank of a world must agree on (the mechanism by its name and settings)."""
        m = self.mechanism
        return (self.max_grad_norm, self.expected_batch_size, m.name,
                tuple(sorted((k, v) for k, v in vars(m).items() if k != "names")), self.steps, self.epochs,
                self.noise_multiplier,
                self.target_epsilon, self.target_delta, self.clipping, self.max_rows_per_user, self.user_clipping,
                self.phase)


@dataclass
class PrivateSession:
    """One private session: this process's world and the run's secret key, one ledger, and what
    :meth:`plan` and :meth:`step` build for it (see the module docstring).

    Construct with :meth:`open`. Attributes set by :meth:`plan`: ``unit`` (user level:
    :class:`~dpft.step.unit.PrivacyUnit` built from ``users``; None at example level), ``user_level``,
    ``n`` (N units), ``planned``
    (logical steps, or None), ``methods`` (what the way in's factory returned, prepared).
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

    @classmethod
    def open(cls, seed: Optional[int] = None, *, rng: Optional[Randomness] = None,
             ledger: Optional[PrivacyLedger] = None, made_for: Optional[ddp.World] = None,
             where: str = "dpft") -> "PrivateSession":
        """Join the world and take the run's secret key (:func:`~dpft.session.world.session_world`:
        rank 0 draws it and broadcasts it, or it derives from ``seed``; ``rng``: the key the caller's
        earlier session holds, made in ``made_for``).

        Raises:
            DistributedError: as ``session_world``."""
        world, key = session_world(seed, rng, made_for=made_for, where=where)
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

    # ------------------------------------------------------------------ the plan
    def plan(self, s: SessionSettings, *, rows: Any, n_rows: int, rng: Randomness,
             parts: Callable[[Any], tuple[Any, Any]], optimizer: Any, users: Optional[tuple[Sequence, str]] = None,
             user_sampler: Any = None, n_units: Optional[int] = None, total_steps: Optional[int] = None,
             methods: Optional[Callable[[int, Randomness, bool], Any]] = None, method_list: Sequence = (),
             same: Any = None, transforms: Sequence = (), head_mask=None) -> PrivacyPlan:
        """The privacy plan of one loop (step/plan.py ``build_privacy_plan``, the one plan builder).

        In order: the privacy unit (``users``: user level; or ``user_sampler``, a user-level sampler
        the way in built, with ``n_units``) and N units; the same settings on every rank (``same``
        added to them); the planned steps (``total_steps``, else from ``steps``/``epochs``); the
        methods (``methods(n, rng, user_level)`` returns the way in's plug-ins, offering ``prepare``,
        ``hooks`` and ``on_sigma``; their earlier releases enter the ledger before σ is calibrated
        after them; ``method_list`` is checked to run across ranks); σ calibrated by rank 0 on the
        events this loop records after those the ledger holds; the methods' ``build`` hooks; the
        mechanism's install. The spec's clip is then the engine's (a method may swap it).

        Args:
            rows: the training rows the sampler indexes (a stateful mechanism fingerprints them);
                n_rows: N rows.
            rng: this loop's randomness (a child of :attr:`rng`).
            parts: ``sampler -> (clip, engine)``; optimizer: the step's optimizer (or a stand-in).

        Raises:
            ValueError, PlanError, CalibrationError, DistributedError: naming the fix."""
        self.unit = self.user_unit(s, users, rng)
        sampler = user_sampler if user_sampler is not None else (self.unit.sampler if self.unit is not None else None)
        n = n_units if n_units is not None else (self.unit.n if self.unit is not None else n_rows)
        user_level = self.user_level = sampler is not None
        self.check_same((n_rows, n, *s.same_on_every_rank(), same))
        self.n = n
        self.planned = total_steps if total_steps is not None else (
            None if s.steps is None and s.epochs is None else planned_steps(n, s.expected_batch_size, s.steps,
                                                                            s.epochs))
        ddp.check_methods(self.world, list(method_list))
        self.methods = methods(n, rng, user_level) if methods is not None else None
        if self.methods is not None:
            self.methods.prepare()
        w = self.world
        plan = build_privacy_plan(
            n=n, expected_batch_size=s.expected_batch_size, steps=self.planned or 0, mechanism=s.mechanism, rng=rng,
            parts=parts, optimizer=optimizer,
            noise_multiplier=None if s.target_epsilon is not None else s.noise_multiplier,
            target_epsilon=s.target_epsilon, delta=s.target_delta, prior=self.ledger.events(),
            calibrate=lambda f: ddp.on_rank0(w, f), sampler=sampler,
            hardened=s.hardened, rows=rows, transforms=list(transforms), head_mask=head_mask, phase=s.phase,
            hooks=self.methods.hooks if self.methods is not None else (),
            on_sigma=self.methods.on_sigma if self.methods is not None else None)
        plan.spec.engine.clip = plan.spec.clip  # the spec's clip is in force (a method may swap it; as DPStep.run)
        return plan

    # ------------------------------------------------------------------ the step
    def step(self, plan: PrivacyPlan, *, sharded: bool = False, on_release: Optional[Callable[[], None]] = None,
             dummy_batch: Optional[Callable[[], Any]] = None):
        """The DP step of ``plan`` for this world (session/step.py ``step_for``): ``DPStep`` in one
        process and under DDP, ``FSDPStep`` over an FSDP2 model; it is the only writer of :attr:`ledger`."""
        return step_for(plan, self.world, self.ledger, plan.n, sharded=sharded, on_release=on_release,
                        dummy_batch=dummy_batch)

    # ------------------------------------------------------------------ secret state beyond the key
    @staticmethod
    def secret_state(step) -> dict:
        """The secret state of ``step``'s mechanism in the one versioned format every way in writes
        (step/correlated.py ``secret_state``; a collective under FSDP2: each rank's buffer slices are
        gathered): nothing beyond the format for a mechanism that is not ``stateful`` (the key alone,
        never written). **Secret**: never in a release set."""
        return secret_state(step.spec.mechanism)

    @staticmethod
    def restore_secret_state(step, state: dict, where: str = "resume") -> None:
        """Restore what :meth:`secret_state` gave into ``step``'s mechanism (before its first step).

        Raises:
            ValueError: another format or version, a stateful state for a stateless mechanism (or
                the other way round), or what the mechanism's ``load_state`` refuses (other
                coefficients, rows or partition), naming the fix."""
        check_secret_state(state, where)
        mech = step.spec.mechanism
        stateful = mech is not None and mech.stateful
        if bool(state.get("stateful", "buffers" in state)) != stateful:
            raise ValueError(f"{where}: the secret state is {'' if not stateful else 'not '}of a stateful mechanism "
                             f"and this step's ({type(mech).__name__}) is {'' if stateful else 'not '}stateful; "
                             "resume with the settings that saved it")
        if stateful:
            mech.load_state(state, dict(step.params))
