"""The Python ways in across processes and at user level, one check per property over the ways in
(``make_private``, ``DPTrainer``: :data:`WAYS`; issue 26 items 1 and 4; issue 46 item 4).

Each way in runs tiny jobs (audit/ddp_jobs.py :func:`~dpft.audit.ddp_jobs.run_job`: ``make_private`` on a small net with a large input, or
``DPTrainer`` on a random BERT with rows of several lengths, one mislabelled: large gradients) for one
logical step with ``q = 1`` (every unit sampled) and SGD at learning rate 1, and the released clipped
sum is read back from the weights: ``S = −Δθ · qN`` (add/remove-one; Abadi et al. 2016, Alg. 1). The
2-process jobs run under ``torchrun --nproc_per_node=2`` (gloo, CPU; ``ddp_jobs.launch``) from a subprocess.
For every way in (:func:`ddp_checks`):

* **2 processes = 1 process** — ``‖S₂ − S₁‖ ≤ 1e-4·C`` (only the order of float sums differs), the ranks
  bit-identical, the ledger as one process's: one Poisson batch for the world, disjoint shares, one
  all-reduce of clipped sums; and the same **at user level** (``user_ids=`` / ``user_column=``);
* **leave-one-out under 2 processes** — ``max_i ‖S₂(D) − S₂(D∖i)‖ ≤ C(1 + tol)``: an example clipped on
  two ranks (a share that is not disjoint) would move ``S`` by up to 2C; and **leave-one-user-out under 2
  processes** (a user whose rows are clipped apart, on two ranks or one by one, moves ``S`` by up to kC);
* **noise once for the world** (σ = 1) — the ranks hold bit-identical weights after the noisy update (one
  draw of N(0, σ²C²I) for the world, from the shared key's streams) and the noise std is σC;
* **no DistributedDataParallel** — ``make_private`` refuses a ``DistributedDataParallel``-wrapped model,
  and under ``DPTrainer`` neither ``trainer.model_wrapped`` nor the model holds one (accelerate adds one
  unless told not to): its buckets all-reduce the unclipped gradient of every backward;

and, in one process, **DPTrainer's leave-one-user-out** (:func:`user_loo_check`: users of 3 and 2 rows,
k = 3: a user's rows clipped one by one would move ``S`` by up to 3C).

Planted bugs (:data:`PLANTED`, applied in every job of the way in they break): ``ddp_batch_on_every_rank``
(each rank trains on the whole logical batch: ``shard`` returns all of it), ``ddp_user_rows_split`` (user
level sharded by row), ``ddp_noise_per_rank`` (each rank its own noise stream, the per-step digest that would
stop it off); ``hf_ddp_wrapped`` (DPTrainer's DDP guard off: accelerate wraps the model),
``hf_ddp_unsharded`` (each rank clips the whole logical batch), ``hf_user_rows_clipped_alone`` (a user's rows
clipped one by one: the group ids never reach the engine). Each makes at least one check fail.

The job runner and launcher (audit/ddp_jobs.py) are re-exported here for the distributed tests.
"""

from __future__ import annotations

import tempfile
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dpft.audit.ddp_jobs import (API_PLANTED, C, EQ_TOL, HF_PLANTED, PLANTED, TOL, USER_COLUMN, launch,  # noqa: F401
                                 make_rows, pad_collate, planted_bug, record_shares, released_sum, run_job, tiny_model,
                                 trl_rows)
from dpft.audit.ways_in import WayIn, leave_one_out
from dpft.audit.whitebox import Check


# --------------------------------------------------------------------------- the checks


@dataclass(frozen=True)
class DDPWay:
    """A way in as the 2-process checks drive it: its :func:`run_job` ``trainer``, the prefix of its jobs'
    and its checks' names, its rows (example level) and users (one id per row, ≤ ``k`` rows each), the
    physical batch, and the planted bugs that break it."""

    name: str
    trainer: str
    jobs: str
    label: str
    rows: int
    users: tuple
    k: int
    physical: int
    planted: tuple


#: The ways in of the 2-process checks.
WAYS = (DDPWay("DPTrainer", "hf", "", "hf-ddp", 4, (0, 0, 0, 1, 1), 3, 2, HF_PLANTED),
        DDPWay("make_private", "make_private", "mp/", "api-ddp", 6, (0, 0, 1, 2, 2, 3), 2, 1, API_PLANTED))
#: DPTrainer's rows of the example-level checks and users of the user-level ones (tests/test_hf_ddp.py).
N_ROWS, USERS = WAYS[0].rows, list(WAYS[0].users)


def audit_jobs(planted: Optional[str] = None, way: DDPWay = WAYS[0]) -> list[dict]:
    """The 2-process jobs of ``way`` (q = 1, one step, SGD lr 1; σ = 0 but ``noise``: σ = 1)."""
    base = {"trainer": way.trainer, "steps": 1, "sigma": 0.0, "lr": 1.0, "C": C, "physical": way.physical,
            "planted": planted, "perturb_rank1": way.trainer == "hf"}
    users, u = list(way.users), sorted(set(way.users))
    user = {**base, "rows": len(users), "users": users, "k": way.k}
    p = way.jobs
    jobs = [{**base, "name": f"{p}ex", "rows": way.rows, "eb": way.rows}]
    jobs += [{**base, "name": f"{p}ex-{i}", "rows": way.rows, "eb": way.rows - 1, "drop": [i]} for i in range(way.rows)]
    jobs += [{**user, "name": f"{p}user", "eb": len(u)}]
    jobs += [{**user, "name": f"{p}user-{v}", "eb": len(u) - 1, "drop": [v]} for v in u]
    jobs += [{**base, "name": f"{p}noise", "rows": way.rows, "eb": way.rows, "sigma": 1.0}]
    if way.trainer == "make_private":
        jobs.append({**base, "name": f"{p}wrap", "rows": way.rows, "eb": way.rows, "wrap_ddp": True})
    return jobs


def _one_process(job: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="dpft-hf-audit-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_job({**job, "perturb_rank1": False, "out": str(Path(tmp) / "out")})
    if "error" in res:
        raise RuntimeError(f"audit job {job['name']} failed in one process: {res['error']}")
    return res


def _loo(results: dict[str, dict], prefix: str, keys: list, eb_full: int, eb_drop: int) -> float:
    full = released_sum(results[prefix], eb_full)
    return max(float((full - released_sum(results[f"{prefix}-{k}"], eb_drop)).norm()) for k in keys)


def user_loo_check(planted: Optional[str] = None) -> Check:
    """DPTrainer's leave-one-user-out ≤ C in one process (users of 3 and 2 rows, k = 3, group clipping):
    :func:`~dpft.audit.ways_in.leave_one_out` over a user-level DPTrainer."""
    base = {"steps": 1, "sigma": 0.0, "lr": 1.0, "C": C, "physical": 2, "planted": planted, "k": 3,
            "rows": len(USERS), "users": USERS}
    u = sorted(set(USERS))

    def step(keep, sigma, c):
        drop = [v for v in u if v not in keep]
        res = _one_process({**base, "name": "user", "eb": len(keep), "drop": drop, "sigma": sigma, "C": c})
        return released_sum(res, len(keep)).float(), res

    return leave_one_out(WayIn("DPTrainer", u, step, unit="user", what="users of 2–3 rows, k = 3"),
                         "hf-ddp user level")


def ddp_checks(one: dict[str, dict], ranks: list[list[dict]], way: DDPWay = WAYS[0]) -> list[Check]:
    """The 2-process checks of ``way`` from the results of :func:`audit_jobs` on every rank (``ranks``)
    and the 1-process results ``one`` (job name → :func:`run_job` result of ``ex`` and ``user``). A check
    whose jobs were not run is left out (a planted-bug test runs only the jobs it needs); a job that failed
    on any rank fails every check (but the DDP refusal's, whose job must fail)."""
    p, w = way.jobs, f"{way.label}: {way.name}"
    by_rank = [{r["name"]: r for r in rs if r["name"].startswith(p) and (p or "/" not in r["name"])} for rs in ranks]
    wrap = f"{p}wrap"
    errors = sorted({f"{name}: {res['error']}" for b in by_rank for name, res in b.items()
                     if "error" in res and name != wrap})
    names = [f"{w} 2 processes = 1 process", f"{w} leave-one-out under 2 processes",
             f"{w} user level, 2 processes = 1", f"{w} leave-one-user-out under 2 processes",
             f"{w} noise once for the world",
             f"{w} refuses a DistributedDataParallel-wrapped model" if way.trainer == "make_private"
             else f"{w} no DistributedDataParallel wrapper"]
    if errors:
        msg = f"a 2-process {way.name} job failed: " + textwrap.shorten("; ".join(errors), 300, placeholder="…")
        return [Check(n, False, msg, {"errors": errors}) for n in names]
    r0, out = by_rank[0], []
    for name, job, what in ((names[0], f"{p}ex", f"N = {way.rows} rows"),
                            (names[2], f"{p}user", f"U = {len(set(way.users))} users")):
        if job not in r0 or job not in one:
            continue
        eb = int(round(one[job]["q"] * one[job]["n"]))
        s1 = released_sum(one[job], eb)
        s2 = [released_sum(b[job], eb) for b in by_rank]
        diff = float((s2[0] - s1).norm())
        same_ranks = all(torch.equal(s, s2[0]) for s in s2)
        same_ledger = all(b[job]["ledger"] == one[job]["ledger"] for b in by_rank)
        ok = diff <= EQ_TOL * C and same_ranks and same_ledger
        out.append(Check(name, ok, f"‖S₂ − S₁‖ = {diff:.3g} vs {EQ_TOL:g}·C ({what}, q = 1, σ = 0); ranks identical: "
                         f"{same_ranks}; ledger as one process: {same_ledger}"
                         + ("" if ok else " — the world does not release what one process releases"),
                         {"diff_over_C": diff / C, "ranks_identical": same_ranks, "same_ledger": same_ledger}))
    for name, job, keys, unit in ((names[1], f"{p}ex", list(range(way.rows)), "example"),
                                  (names[3], f"{p}user", sorted(set(way.users)), "user")):
        if job in r0 and all(f"{job}-{k}" in r0 for k in keys):
            worst = _loo(r0, job, keys, len(keys), len(keys) - 1)
            ok = worst <= C * (1 + TOL)
            out.append(Check(name, ok, f"max over {unit}s ‖S₂(D) − S₂(D∖{unit})‖ = {worst:.4g} vs C = {C:g} "
                             f"({len(keys)} {unit}s, q = 1, σ = 0)" + ("" if ok else f" — one {unit} moves the "
                                                                         "world's release by more than C (clipped "
                                                                         "on two ranks, or apart?)"),
                             {"loo_over_C": worst / C}))
    if f"{p}noise" in r0 and f"{p}ex" in r0:
        s = [released_sum(b[f"{p}noise"], way.rows) for b in by_rank]
        agree = all(torch.equal(x, s[0]) for x in s)
        z = (s[0] - released_sum(r0[f"{p}ex"], way.rows)).double()
        std = float(z.std())
        ok_std = abs(std / C - 1.0) <= 5.0 / (2 * z.numel()) ** 0.5 + 1e-3
        out.append(Check(names[4], agree and ok_std,
                         f"ranks hold {'identical' if agree else 'DIFFERENT'} weights after the noisy update; noise std "
                         f"{std:.4g} vs σC = {C:g} over {z.numel()} coordinates (σ = 1)"
                         + ("" if agree else " — each rank released its own noise draw, not one for the world")
                         + ("" if ok_std else " — wrong noise scale"), {"ranks_agree": agree, "std_over_sigma_c": std / C}))
    if way.trainer == "make_private":
        if wrap in r0:
            err = [b[wrap].get("error", "") for b in by_rank]
            ok = all(e.startswith("DistributedError") for e in err)
            out.append(Check(names[5], ok, f"refused: {textwrap.shorten(err[0], 160, placeholder='…')}" if ok else
                             f"accepted ({err}): DDP's buckets would all-reduce unclipped gradients", {"refused": ok}))
    else:
        wrapped = sorted({f"rank {b[j]['rank']}: {b[j]['wrapped']}" for b in by_rank for j in b if b[j]["ddp"]})
        out.append(Check(names[5], not wrapped,
                         "no rank's model is wrapped in DistributedDataParallel" if not wrapped else
                         f"DistributedDataParallel found ({', '.join(wrapped)}): its buckets all-reduce unclipped "
                         "gradients", {"wrapped": wrapped}))
    return out


def ddp_way_checks(planted: Optional[str] = None, ways: tuple = WAYS, nprocs: int = 2) -> list[Check]:
    """The 2-process checks of every way in of ``ways`` (one ``torchrun`` launch of their :func:`audit_jobs`,
    the 1-process references run honest), DPTrainer's 1-process leave-one-user-out, with ``planted`` (one of
    :data:`PLANTED`) applied to the jobs of the way in it breaks (only that way in runs).

    Returns:
        Six :class:`Check` rows per way in (and DPTrainer's one more); with no planted bug all pass, with one
        at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(PLANTED)}")
    ways = tuple(w for w in ways if planted is None or planted in w.planted)
    t0 = time.perf_counter()
    jobs = {w.name: audit_jobs(planted, w) for w in ways}
    try:
        ranks = launch([j for js in jobs.values() for j in js], nprocs=nprocs)
    except (RuntimeError, OSError) as exc:
        ranks, failure = None, str(exc)
    checks = []
    for w in ways:
        one = {j["name"]: _one_process({**j, "planted": None}) for j in jobs[w.name]
               if j["name"] in (f"{w.jobs}ex", f"{w.jobs}user")}
        if ranks is None:
            checks.append(Check(f"{w.label}: {w.name} under torchrun (2 processes)", False,
                                "the 2-process launch failed: " + textwrap.shorten(failure, 400, placeholder="…")))
        else:
            checks += ddp_checks(one, ranks, w)
        if w.trainer == "hf":
            checks.append(user_loo_check(planted))
    for c in checks:
        c.stats.setdefault("seconds", round(time.perf_counter() - t0, 2))
    return checks


def hf_ddp_checks(planted: Optional[str] = None, nprocs: int = 2) -> list[Check]:
    """The 2-process checks of every way in (:func:`ddp_way_checks`; the suite's entry: its planted bugs are
    :data:`PLANTED`). Results are kept for the next call with the same planted name (a launch runs the code
    on disk, which a planted bug of another module, patched in this process, does not reach)."""
    if planted not in _CACHE:
        checks = ddp_way_checks(planted, nprocs=nprocs)
        if any("did not run" in c.message or "launch failed" in c.message for c in checks):
            return checks
        _CACHE[planted] = checks
    return list(_CACHE[planted])


_CACHE: dict = {}


__all__ = ["hf_ddp_checks", "ddp_way_checks", "ddp_checks", "user_loo_check", "audit_jobs", "WAYS", "DDPWay",
           "run_job", "launch", "released_sum", "record_shares", "make_rows", "trl_rows", "pad_collate", "tiny_model",
           "planted_bug", "PLANTED", "HF_PLANTED", "API_PLANTED", "USER_COLUMN"]
