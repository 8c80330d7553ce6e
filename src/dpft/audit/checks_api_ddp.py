"""Audit checks of ``make_private`` across processes and at user level (issue 26, items 1 and 4).

The checks run the real API in a world of 2 CPU processes (``torch.distributed``, gloo), forked
from a fork server with the environment ``torchrun`` sets; each step is one logical step of
``make_private`` on a tiny model with ``q = 1`` (every unit sampled), plain SGD at learning rate
1, and the released sum read back as ``S = −Δθ · qN`` (as audit/ways_in.py does in one
process):

* **2-process leave-one-out** — ``max_i ‖S(D) − S(D∖i)‖ ≤ C(1 + tol)`` over the world, on an
  adversarial set (a large input): every example is clipped on exactly one rank, and the world's
  sum is all-reduced once (an example on both ranks would move S by 2C);
* **2-process leave-one-user-out** (``user_ids=``, group clipping, k = 2) — a user whose two rows
  share one large gradient moves S by at most C: a user's rows stay on one rank and are clipped
  as one (split over two ranks they would be clipped twice: 2C);
* **noise once for the world** (σ = 1) — the two ranks hold bit-identical weights after the
  noisy update (one draw of N(0, σ²C²I) for the world, from the shared key's streams), and the
  noise std is σC;
* **DistributedDataParallel wrapper** — ``make_private`` on ``DistributedDataParallel(model)``
  is refused (its buckets reduce unclipped gradients).

Planted bugs (applied in the worker processes, undone after): ``ddp_batch_on_every_rank`` (each
rank trains on the whole logical batch: ``distributed.shard`` returns all of it),
``ddp_user_rows_split`` (user level sharded by row: a user's rows clipped separately on each
rank), ``ddp_noise_per_rank`` (each rank draws its noise from its own stream, with the per-step
digest that would stop it switched off).

:func:`api_ddp_checks` is the suite's entry (``audit/suite.py``); the results of a process are
kept for the next call with the same planted name (the workers run the code on disk, which a
planted bug of another module, patched in this process, does not reach).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Optional

import torch

from dpft.audit.whitebox import Check
from dpft import PrivacyEngine
from dpft.placement import world as ddp
from dpft.audit.ways_in import TinyNet, mp_data, released_sum
from dpft.placement.world import DistributedError
from dpft.step import plan as step_plan

PLANTED = ("ddp_batch_on_every_rank", "ddp_user_rows_split", "ddp_noise_per_rank")
TOL = 1e-3
C = 0.05
WORLD = 2
_CACHE: dict = {}


# --------------------------------------------------------------------------- in each rank


def _plant(name: Optional[str], rank: int) -> list:
    """Apply planted bug ``name`` in this worker; returns what to undo."""
    saved: list = []

    def patch(obj, attr, value):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    if name == "ddp_batch_on_every_rank":
        patch(ddp, "shard", lambda idx, world: idx)
    elif name == "ddp_user_rows_split":
        real = ddp.shard
        patch(ddp, "shard_units", lambda idx, units, world: real(idx, world))
    elif name == "ddp_noise_per_rank":
        real_build = step_plan.build_step_spec  # the one plan builder's (every way in)

        def build(**kw):
            spec = real_build(**kw)
            if spec.mechanism is not None:
                spec.mechanism.rng = kw["rng"].child(f"rank{rank}")
            return spec

        patch(step_plan, "build_step_spec", build)
        patch(ddp, "check_step_digest", lambda *a, **k: None)
    elif name is not None:
        raise ValueError(f"unknown planted bug {name!r}; known: {', '.join(PLANTED)}")
    return saved


def _world_step(rows: list[dict], *, user_level: bool, sigma: float = 0.0, c: float = C) -> torch.Tensor:
    """One logical step of make_private over all ``rows`` (q = 1) in the world; ``S`` on this rank."""
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = TinyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = len({r["u"] for r in rows}) if user_level else len(rows)
    engine = PrivacyEngine(reproducible_seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(rows, batch_size=units), noise_multiplier=sigma, max_grad_norm=c, steps=1,
            max_physical_batch_size=1, user_ids="u" if user_level else None, max_rows_per_user=2)
        try:
            for b in loader:
                opt.zero_grad()
                crit(module(b["x"]), b["y"]).backward()
                opt.step()
        finally:
            engine.detach()
    return released_sum(model, before, units)


def _same_on_every_rank(s: torch.Tensor) -> bool:
    import torch.distributed as dist

    lo, hi = s.clone(), s.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def _rows(user_level: bool) -> list[dict]:
    x, y = mp_data(6)
    if user_level:  # user 0: two rows with one large gradient; users 1-3 ordinary
        x[1], y[1] = x[0], y[0]
        users = [0, 0, 1, 2, 2, 3]
    else:
        users = list(range(6))
    return [{"x": x[i], "y": y[i], "u": users[i]} for i in range(6)]


def _loo(name: str, user_level: bool) -> Check:
    t0 = time.perf_counter()
    rows = _rows(user_level)
    full = _world_step(rows, user_level=user_level)
    agree = _same_on_every_rank(full)
    worst = 0.0
    for u in sorted({r["u"] for r in rows}):
        worst = max(worst, float((full - _world_step([r for r in rows if r["u"] != u], user_level=user_level)).norm()))
    ok = worst <= C * (1 + TOL) and agree
    unit = "user" if user_level else "example"
    return Check(name, ok, f"max over {unit}s ‖S(D) − S(D∖{unit})‖ = {worst:.4g} vs C = {C:g} ({WORLD} processes, "
                 f"q = 1, σ = 0)" + ("" if worst <= C * (1 + TOL) else f" — one {unit} counted more than C")
                 + ("" if agree else "; the ranks hold different weights"),
                 {"loo_over_C": worst / C, "ranks_agree": agree, "seconds": round(time.perf_counter() - t0, 2)})


def _noise() -> Check:
    import math

    t0 = time.perf_counter()
    rows = _rows(False)
    s0 = _world_step(rows, user_level=False)
    s1 = _world_step(rows, user_level=False, sigma=1.0)
    agree = _same_on_every_rank(s1)
    z = (s1 - s0).double()
    std = float(z.std())
    rel = abs(std / C - 1.0)
    ok_std = rel <= 5.0 / math.sqrt(2 * z.numel()) + 1e-3
    return Check("api-ddp: make_private noise once for the world", agree and ok_std,
                 f"ranks hold {'identical' if agree else 'DIFFERENT'} weights after the noisy update; noise std "
                 f"{std:.4g} vs σC = {C:g} over {z.numel()} coordinates (σ = 1)"
                 + ("" if agree else " — each rank released its own noise draw, not one for the world")
                 + ("" if ok_std else " — wrong noise scale"),
                 {"ranks_agree": agree, "std_over_sigma_c": std / C, "seconds": round(time.perf_counter() - t0, 2)})


def _ddp_wrapper() -> Check:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    x, y = mp_data(4)
    model = DistributedDataParallel(TinyNet())
    name = "api-ddp: make_private refuses a DistributedDataParallel-wrapped model"
    try:
        PrivacyEngine(reproducible_seed=0).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=0.0, max_grad_norm=C, steps=1)
    except DistributedError as exc:
        return Check(name, True, f"refused: {textwrap.shorten(str(exc), 160, placeholder='…')}", {"refused": True})
    return Check(name, False, "accepted: DDP's buckets would all-reduce unclipped gradients", {"refused": False})


def _rank_checks() -> list[Check]:
    return [_loo("api-ddp: make_private 2-process leave-one-out", False),
            _loo("api-ddp: make_private 2-process user-level leave-one-user-out", True),
            _noise(), _ddp_wrapper()]


def _entry(rank: int, plants: list, out: str, port: int) -> None:
    """Rank ``rank`` of the audit world: every planted configuration of ``plants`` in turn."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    # A rank that fails stops the other at its next collective within minutes, not hours.
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    results = {}
    try:
        for name in plants:
            saved = _plant(name, rank)
            try:
                results[str(name)] = [c.__dict__ for c in _rank_checks()]
            finally:
                for obj, attr, value in reversed(saved):
                    setattr(obj, attr, value)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        ddp.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the caller


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(plants: list) -> dict:
    """The checks of :func:`api_ddp_checks` for each planted name of ``plants`` (None: honest),
    in one launch of a 2-process world. Returns ``{str(name): [Check, ...]}``; a world that
    fails to run gives one failed check naming the error."""
    for p in plants:
        if p is not None and p not in PLANTED:
            raise ValueError(f"unknown planted bug {p!r}; known: {', '.join(PLANTED)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "checks.json"
        try:
            torch.multiprocessing.start_processes(_entry, args=(list(plants), str(out), _free_port()), nprocs=WORLD,
                                                  join=True, start_method="forkserver")
            got = json.loads(out.read_text())
        except Exception as exc:  # noqa: BLE001 - a world that did not run is a failed check, not a pass
            msg = textwrap.shorten(f"{type(exc).__name__}: {exc}", 300, placeholder="…")
            return {str(p): [Check("api-ddp: make_private in a 2-process world", False,
                                   f"the 2-process audit did not run: {msg}", {})] for p in plants}
    secs = round(time.perf_counter() - t0, 2)
    res = {}
    for k, rows in got.items():
        res[k] = [Check(r["name"], r["passed"], r["message"], r["stats"]) for r in rows]
        if res[k]:
            res[k][0].stats["world_seconds"] = secs
    return res


def api_ddp_checks(planted: Optional[str] = None) -> list[Check]:
    """The make_private checks across 2 processes and at user level, with ``planted`` (one of
    :data:`PLANTED`) applied in the workers.

    Returns:
        Four :class:`~dpft.audit.whitebox.Check` rows; all pass with no planted bug, at least one
        fails with one planted.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted in _CACHE:
        return list(_CACHE[planted])
    checks = run_world([planted])[str(planted)]
    if not any("did not run" in c.message for c in checks):
        _CACHE[planted] = checks
    return list(checks)


__all__ = ["api_ddp_checks", "run_world", "PLANTED"]
