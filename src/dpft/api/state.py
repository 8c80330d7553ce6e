"""Saving and restoring a ``make_private`` loop's secret state, with its live release record.

The secret state (a stateful mechanism's buffers, secret partition and a keyed fingerprint of
the training rows, step/fingerprint.py) is written by ``PrivacyEngine.save_noise_state(path)``;
from then on every release also rewrites the **live release record** ``<path>.releases.json``
(the ledger, rank 0, atomically). ``load_noise_state(path)`` refuses, naming the fix:

- a state older than the last release (the record holds more releases than the state: a crash
  between two saves) — resuming would replay those steps under fresh noise, which the
  accounting does not cover, and the old ledger would under-count them;
- other training rows, or the same rows reordered (the partition is by row position);
- a record that is missing (the state alone cannot show that nothing was released after it).

One process owns a state path (``<path>.lock``, outputs/lock.py). The engine's ledger is appended to,
never swapped: the saved releases are added after what the
engine already holds when that is a prefix of them, and refused otherwise.

**Under torch.distributed save and load are collectives: every rank calls them.** Under DDP every
rank holds the same buffers; under FSDP2 (``make_private`` on a ``fully_shard`` root, api/sharded.py)
each rank holds the banded buffers of its own parameter shards
(:class:`~dpft.placement.fsdp.ShardedBandedMFMechanism`). The state is **gathered**: ``save`` gathers every
rank's buffer slices (the one all-gather of ``ShardedBandedMFMechanism.state``) and rank 0 writes the
one file, mode 0600, that a one-process loop writes; ``load`` has rank 0 read it, broadcasts it, and
each rank keeps its slice (``ShardedBandedMFMechanism.load_state``). Why gathered rather than a file
per rank: the file is then the same whatever the number of ranks, so a loop saved on K ranks resumes
on K′ (or on one unsharded process: the buffers hold the y noises actually added, whichever streams
drew them) and the one-owner lock, the live release record, the rows' fingerprint and the freshness
check stay those of one file; a set of per-rank files would need all of them per file and a
manifest tying them to one release. The cost: (b − 1) × the trainable parameters in fp32 pass
through host memory at save and load — small for what ``make_private`` users shard and train (LoRA,
a few blocks); a full fine-tune whose buffers do not fit one host is ``dpft train``'s job, whose
checkpoints write the buffers per rank (``torch.distributed.checkpoint``, dpft/placement/fsdp_checkpoint.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpft.placement import world as ddp
from dpft.accounting.ledger import PrivacyLedger
from dpft.outputs.lock import RunLock
from dpft.outputs.report import plan_section
from dpft.session import PrivateSession
from dpft.step.correlated import check_secret_state, write_secret

__all__ = ["LoopState", "live_record_path", "write_live_record", "check_fresh"]



def live_record_path(path) -> Path:
    """The live release record beside a saved state ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".releases.json")


def write_live_record(path: Path, ledger: PrivacyLedger, world) -> None:
    """Rewrite the live release record (rank 0; the ledger never shrinks)."""
    if world is None or world.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        ledger.save(path)


def check_fresh(made: int, saved: int, record: str, fix: str) -> None:
    """Refuse a state whose ledger holds fewer releases (``saved``) than the live record (``made``).

    Raises:
        ValueError: naming how many releases the state misses and the fix."""
    if made != saved:
        raise ValueError(f"load_noise_state: {made - saved} release(s) were made after this state was saved "
                         f"({made} in the live record {record}, {saved} in the state); resuming would replay those "
                         "steps under fresh noise, which the accounting does not cover, and the state's ledger would "
                         f"under-count them. Resume from the state saved at the last release, or {fix}")


#: State-path locks this process holds (lock file → RunLock): engines of one process share them
#: (a notebook's second engine resuming the first one's state), other processes are refused.
_HELD: dict = {}


def own_state_path(engine, path) -> None:
    """One process owns a state path: the first engine of this process that saves or loads there
    takes ``<path>.lock`` (outputs/lock.py), held until the process exits; later engines of the same
    process share it.

    Raises:
        RunLockError: another live process holds it (named, with the fix)."""
    key = str(RunLock.for_file(path).path.resolve())
    if key not in _HELD:
        _HELD[key] = RunLock.for_file(path).acquire()
    engine._state_lock = _HELD[key]


def _flat(ledger: PrivacyLedger) -> list:
    return [(e.phase, e.event) for e in ledger.entries for _ in range(e.count)]


@dataclass
class LoopState:
    """The stateful parts of the last ``make_private`` loop: its plan, optimizer, batches and N."""

    plan: Any
    optimizer: Any
    batches: Any
    n: int

    @property
    def mechanism(self):
        """The mechanism that releases: the step's (under FSDP2 the sharded copy the
        :class:`~dpft.placement.fsdp.FSDPStep` made of the plan's, holding this rank's buffer slices)."""
        return self.optimizer.dp_step.spec.mechanism

    def save(self, engine, path) -> bool:
        """See ``PrivacyEngine.save_noise_state``; a collective under torch.distributed (every
        rank calls it; the FSDP2 buffers are gathered, module docstring). Returns whether this
        process wrote the file."""
        opt = self.optimizer
        if opt._agg is not None and opt._agg_step is not None and opt._agg_step > opt._released_upto:
            raise ValueError("save_noise_state: a logical batch is open (call it after optimizer.step() of its last "
                             "micro-batch)")
        world = engine.world if engine.world is not None else ddp.World()
        # the session's one versioned format; FSDP2: every rank's slices gathered (a collective)
        state = PrivateSession.secret_state(opt.dp_step)
        if not world.is_main:
            engine._live_path = live_record_path(path)
            return False
        own_state_path(engine, path)
        engine._live_path = live_record_path(path)  # every later release rewrites the record
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_secret(path, {**state, "sigma": self.plan.sigma, "n": self.n,  # the plan as a value, as every way in's
                            "ledger": engine.ledger.to_json(), **plan_section(self.plan)})
        write_live_record(engine._live_path, engine.ledger, world)
        return True

    def load(self, engine, path) -> None:
        """See ``PrivacyEngine.load_noise_state``; a collective under torch.distributed (rank 0
        reads, every rank restores; under FSDP2 each rank keeps its slice of the buffers)."""
        mech, opt, batches = self.mechanism, self.optimizer, self.batches
        if mech.next_step != 0 or opt.logical_steps != 0 or batches.next_step != 0:
            raise ValueError("load_noise_state: this loop already made steps; call it right after make_private")
        record = live_record_path(path)

        def read():
            if not Path(path).is_file():
                raise FileNotFoundError(f"load_noise_state: {path} (the secret noise state of a banded_mf loop) is "
                                        "missing; the correlated noise cannot continue without it — start a new "
                                        "loop instead (its ledger composes with the old one)")
            live = PrivacyLedger.load(record).to_json() if record.is_file() else None
            return torch.load(path, weights_only=True, map_location="cpu"), live

        world = engine.world if engine.world is not None else ddp.World()
        if world.is_main:
            own_state_path(engine, path)
        st, live = ddp.on_rank0(world, read)
        st = check_secret_state(st, "load_noise_state")  # the one format (or make_private's); restore trusts it
        if not all(k in st for k in ("n", "sigma", "ledger", "buffers")):
            raise ValueError(f"load_noise_state: {path} is not a make_private banded_mf noise state")
        sigma = self.plan.sigma
        if int(st["n"]) != self.n or not math.isclose(float(st["sigma"]), sigma, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(f"load_noise_state: the state was saved with N = {st['n']}, σ = {st['sigma']:.6g}; this "
                             f"loop has N = {self.n}, σ = {sigma:.6g}. Call make_private with the same "
                             "arguments on a fresh PrivacyEngine")
        saved = PrivacyLedger.from_json(st["ledger"])
        fix = ("start a new loop with a fresh PrivacyEngine (its releases compose with those in "
               f"{record.name}: keep that ledger)")
        if live is None:
            raise ValueError(f"load_noise_state: {record} (the live record of the releases made after this state was "
                             "saved) is missing, so a state older than the last release cannot be told apart; keep "
                             f"the record beside the state, or {fix}")
        check_fresh(PrivacyLedger.from_json(live).steps, saved.steps, record.name, fix)
        PrivateSession.restore_secret_state(opt.dp_step, st, "load_noise_state")  # the session's one restore path
        held, want = _flat(engine.ledger), _flat(saved)
        if want[:len(held)] != held:
            raise ValueError("load_noise_state: this PrivacyEngine's ledger holds releases that the saved state's "
                             "ledger does not start with; load the state into a fresh PrivacyEngine")
        for phase, event in want[len(held):]:  # appended to, never swapped
            engine.ledger.record(phase, event)
        if not saved.certified:
            engine.ledger.mark_not_certified(saved.not_certified_reason or "marked not certified")
        k = mech.next_step
        batches.next_step = k
        opt._released_upto = k - 1
        opt.logical_steps = k
        engine._live_path = record
