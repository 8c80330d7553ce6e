"""Audit checks of ``DPTrainer`` across processes and at user level (issue 26, items 1 and 4).

Each check runs tiny ``DPTrainer`` jobs (a random BERT, rows of several lengths, one
mislabelled: large gradients) for one logical step with ``σ = 0``, ``q = 1`` (every unit
sampled) and SGD at learning rate 1, and reads the released clipped sum back from the weights:
``S = −Δθ · qN`` (add/remove-one; Abadi et al. 2016, Alg. 1). The 2-process jobs run under
``torchrun --nproc_per_node=2`` (gloo, CPU; :func:`launch`) from a subprocess:

* **2 processes = 1 process** — ``‖S₂ − S₁‖ ≤ 1e-4·C`` (only the order of float sums differs):
  one Poisson batch for the world, disjoint shares, one all-reduce of clipped sums;
* **leave-one-out under 2 processes** — ``max_i ‖S₂(D) − S₂(D∖i)‖ ≤ C(1 + tol)``: an example
  clipped on two ranks (a share that is not disjoint) would move ``S`` by up to 2C;
* **no DistributedDataParallel** — under 2 processes neither ``trainer.model_wrapped`` nor the
  model holds a ``DistributedDataParallel`` wrapper (accelerate adds one unless told not to;
  its buckets all-reduce the unclipped gradient of every backward);
* **user level, 2 processes = 1 process** — the same with ``DPArguments(user_column=...)``;
* **leave-one-user-out (1 process)** — ``max_u ‖S(D) − S(D∖u)‖ ≤ C(1 + tol)`` with users of
  3 and 2 rows (k = 3): a user's rows clipped one by one would move ``S`` by up to 3C.

Planted bugs (:data:`PLANTED`): ``hf_ddp_wrapped`` (the DDP guard off: accelerate wraps the
model), ``hf_ddp_unsharded`` (each rank clips the whole logical batch instead of its share),
``hf_user_rows_clipped_alone`` (a user's rows clipped one by one: the group ids never reach
the engine). Each makes at least one check fail.

:func:`run_job` is one ``DPTrainer`` run from a JSON description (tests/test_hf_ddp.py drives
it too, with longer runs); ``python -m dpft.audit.checks_hf_ddp CONFIG.json OUT_DIR`` runs a
list of jobs on every rank of a ``torchrun`` world.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from dpft.audit.whitebox import Check, tiny_classifier
from dpft.audit.planted import planting
from dpft.grads.groups import GROUP_KEY

PLANTED = ("hf_ddp_wrapped", "hf_ddp_unsharded", "hf_user_rows_clipped_alone")
#: The clip norm of the checks (small: every row of the tiny model is clipped).
C = 0.05
#: Relative slack on ``≤ C`` (fp32 sums and the 1e-6 in the clip factor's denominator).
TOL = 1e-3
#: ``‖S₂ − S₁‖ / C`` allowed between 2 processes and 1 (float sums in another order).
EQ_TOL = 1e-4
USER_COLUMN = "user_id"


@contextlib.contextmanager
def planted_bug(name: Optional[str]) -> Iterator[None]:
    """Re-open one hole for the duration (``None``: nothing planted).

    Raises:
        ValueError: an unknown name."""
    with planting(name, PLANTED) as p:
        from transformers import Trainer

        from dpft.integrations.hf import trainer as hf

        if name == "hf_ddp_wrapped":
            p.set(hf.DPTrainer, "create_accelerator_and_postprocess", Trainer.create_accelerator_and_postprocess)
            p.set(hf.DPTrainer, "_check_not_ddp", lambda self, model: None)
        elif name == "hf_ddp_unsharded":
            p.set(hf.DPTrainer, "_share", lambda self, idx: idx)
        elif name == "hf_user_rows_clipped_alone":
            real = hf.DPTrainer._micro_batches

            def micro_batches(self, idx):
                for batch in real(self, idx):
                    batch.pop(GROUP_KEY, None)
                    yield batch

            p.set(hf.DPTrainer, "_micro_batches", micro_batches)
        yield


# --------------------------------------------------------------------------- one job


def tiny_model():
    """The checks' tiny random BERT classifier (dropout 0; the same weights in every process)."""
    return tiny_classifier("bert", vocab=64, max_len=16)


def make_rows(n: int, users: Optional[list[int]] = None, seed: int = 1, drop: Optional[list[int]] = None):
    """``n`` rows of 3 to 8 tokens (``input_ids``, ``labels``; row 0 mislabelled by the tiny
    model, so its gradient is large), with ``user_id`` = ``users[i]`` when given; ``drop``
    removes those rows (by row index), or at user level those users (by user id)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    ids = [torch.randint(3, 64, (k,), generator=g).tolist() for k in lengths]
    labels = torch.randint(0, 2, (n,), generator=g).tolist()
    model = tiny_model()
    with torch.no_grad():
        x = torch.tensor([ids[0]])
        labels[0] = int(model(input_ids=x, attention_mask=torch.ones_like(x)).logits.argmin(-1))
    cols: dict[str, list] = {"input_ids": ids, "labels": labels}
    if users is not None:
        cols[USER_COLUMN] = [f"u{u}" for u in users]
    ds = datasets.Dataset.from_dict(cols)
    if drop:
        if users is not None:
            keep = [i for i in range(n) if users[i] not in set(drop)]
        else:
            keep = [i for i in range(n) if i not in set(drop)]
        ds = ds.select(keep)
    return ds


def trl_rows(job: dict):
    """``job["rows"]`` rows for a TRL job: prompt/completion pairs (``trainer: sft``; completions of
    1 to 9 words: gradients of several sizes) or preference pairs (``trainer: dpo``), drawn from
    the tiny tokenizer's words with a fixed generator (the same rows in every process)."""
    import datasets

    from dpft.audit.ways_in_trl import WORDS as _WORDS

    g = torch.Generator().manual_seed(int(job.get("data_seed", 5)))

    def words(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return " ".join(_WORDS[int(i)] for i in torch.randint(0, len(_WORDS), (k,), generator=g))

    n = int(job["rows"])
    if job.get("trainer") == "dpo":
        return datasets.Dataset.from_list([{"prompt": words(2, 5), "chosen": " " + words(1, 6),
                                            "rejected": " " + words(1, 6)} for _ in range(n)])
    return datasets.Dataset.from_list([{"prompt": words(2, 5), "completion": " " + words(1, 9)} for _ in range(n)])


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` and the labels of ``rows``."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([int(r["labels"]) for r in rows])}



def record_shares(tr, log: dict) -> None:
    """Log each logical step's world batch and this rank's share of a DPTrainer run: ``tr._share``
    wrapped so that ``log["batches"][t]`` / ``log["shares"][t]`` (``t`` = the trainer's global step,
    as a string) hold the example indices."""
    real_share = tr._share

    def share(idx):
        mine = real_share(idx)
        t = str(int(tr.state.global_step))
        log.setdefault("batches", {})[t] = [int(i) for i in idx]
        log.setdefault("shares", {})[t] = [int(i) for i in mine]
        return mine

    tr._share = share

def run_job(job: dict) -> dict:
    """One ``DPTrainer`` run described by ``job`` in this process (a rank of the world under
    ``torchrun``). Keys: ``name``; ``trainer`` (``hf``: ``DPTrainer`` on the tiny BERT, the
    default; ``sft``: ``DPSFTTrainer`` on a tiny Llama with prompt/completion rows; ``dpo``:
    ``DPDPOTrainer`` on preference pairs; :func:`trl_rows`); ``rows`` (N) and ``users`` (a user id per row: user level,
    ``k`` rows per user); ``drop``; ``steps``, ``eb`` (expected batch), ``physical``, ``sigma``,
    ``C``, ``lr`` (SGD, constant), ``seed`` (reproducible seed); ``out`` (output_dir),
    ``save_steps`` (0: no checkpoints); ``resume`` (a checkpoint path); ``eval`` (evaluate on 16
    other rows at the end: ``eval`` holds the metrics); ``perturb_rank1``
    (rank 1 starts from other weights: the broadcast must replace them); ``planted``;
    ``accelerate_wraps`` (accelerate's DDP wrapper let through, DPTrainer's per-step guard left
    on: the step must refuse).

    Returns: the world size and rank; per step the logical batch (in the order it is sharded)
    and this rank's share; ``delta`` (Δθ of the trainable weights, flat); ``ddp`` (whether a
    DistributedDataParallel wrapper was found); the ledger; ε; or ``error``.
    """
    from transformers import PrinterCallback, TrainingArguments

    from dpft.integrations.hf.trainer import DPArguments, DPTrainer

    out: dict[str, Any] = {"name": job["name"], "batches": {}, "shares": {}}
    users = job.get("users")
    with planted_bug(job.get("planted")), contextlib.ExitStack() as stack:
        if job.get("accelerate_wraps"):
            from transformers import Trainer

            real = DPTrainer.__dict__["create_accelerator_and_postprocess"]
            DPTrainer.create_accelerator_and_postprocess = Trainer.create_accelerator_and_postprocess
            stack.callback(setattr, DPTrainer, "create_accelerator_and_postprocess", real)
        kind = job.get("trainer", "hf")
        if kind not in ("hf", "sft", "dpo"):
            raise ValueError(f"run_job: trainer must be 'hf', 'sft' or 'dpo', got {kind!r}")
        if kind == "hf":
            model = tiny_model()
        else:
            from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer

            tok = tiny_tokenizer()
            model = tiny_llama(len(tok))
        if job.get("perturb_rank1") and int(os.environ.get("RANK", "0")) == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
        rows = make_rows(int(job["rows"]), users, drop=job.get("drop")) if kind == "hf" else trl_rows(job)
        save = int(job.get("save_steps", 0))
        common = dict(
            output_dir=job.get("out") or f"out-{job['name']}", max_steps=int(job.get("steps", 1)), learning_rate=float(job.get("lr", 1.0)),
            lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
            per_device_train_batch_size=int(job.get("physical", 4)), report_to=[], use_cpu=True,
            save_strategy="steps" if save else "no", save_steps=save or 500, logging_strategy="no", disable_tqdm=True)
        if kind == "hf":
            args = TrainingArguments(**common, label_names=["labels"])
        elif kind == "sft":
            from trl import SFTConfig

            args = SFTConfig(**common, bf16=False, max_length=64, dataset_num_proc=None)
        else:
            from trl import DPOConfig

            args = DPOConfig(**common, bf16=False, beta=0.5)
        dp = DPArguments(target_delta=float(job.get("delta", 1e-3)), noise_multiplier=float(job.get("sigma", 0.0)),
                         max_grad_norm=float(job.get("C", C)), expected_batch_size=int(job["eb"]),
                         reproducible_seed=int(job.get("seed", 0)), max_physical_batch_size=int(job.get("physical", 4)),
                         user_column=USER_COLUMN if users is not None else None,
                         max_rows_per_user=int(job.get("k", 3)))
        try:
            if kind == "hf":
                tr = DPTrainer(model=model, args=args, train_dataset=rows, data_collator=pad_collate, dp_args=dp)
            elif kind == "sft":
                from dpft.integrations.trl.trainer import DPSFTTrainer

                tr = DPSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, dp_args=dp)
            else:
                from dpft.integrations.trl.trainer import DPDPOTrainer

                tr = DPDPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, dp_args=dp)
            tr.remove_callback(PrinterCallback)  # the audit's output is its checks, not Trainer's logs
            record_shares(tr, out)
            before = {n: p.detach().clone() for n, p in tr.engine.params.items()}
            tr.train(resume_from_checkpoint=job.get("resume"))
        except Exception as exc:  # noqa: BLE001 - recorded for the caller, which decides
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
    from torch.nn.parallel import DistributedDataParallel

    out["world_size"] = tr.world.world_size
    out["rank"] = tr.world.rank
    out["delta"] = torch.cat([(p.detach() - before[n]).flatten().double()
                              for n, p in sorted(tr.engine.params.items())]).tolist()
    out["ddp"] = any(isinstance(m, DistributedDataParallel) for m in (tr.model_wrapped, tr.model)) or any(
        isinstance(m, DistributedDataParallel) for m in tr.model.modules())
    out["wrapped"] = type(tr.model_wrapped).__name__
    h = hashlib.sha256()
    for n, p in sorted(tr.engine.params.items()):
        h.update(n.encode() + p.detach().float().cpu().contiguous().numpy().tobytes())
    out["digest"] = h.hexdigest()  # the final trainable weights, bit for bit
    out["ledger"] = tr.ledger.to_json()
    out["epsilon"] = tr.get_epsilon() if tr.ledger.certified else None
    out["q"], out["n"], out["sigma"] = tr.q, tr.n, tr.sigma
    if job.get("eval"):  # Trainer's evaluation (sharded by accelerate under torchrun): 16 rows, 2 full
        out["eval"] = tr.evaluate(eval_dataset=make_rows(16, seed=3))  # batches of 8 per rank
    return out


def released_sum(res: dict, eb: int, lr: float = 1.0) -> torch.Tensor:
    """``S = −Δθ · qN / lr`` of a one-step job (SGD, ``qN`` = the expected batch ``eb``)."""
    return -torch.tensor(res["delta"], dtype=torch.float64) * eb / lr


# --------------------------------------------------------------------------- the launcher


def _env() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the dpft package
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(k, None)
    return env


def launch(jobs: list[dict], nprocs: int = 2, cwds: Optional[list[str]] = None, timeout: float = 420.0,
           log: Optional[str] = None) -> list[list[dict]]:
    """Run ``jobs`` (each a :func:`run_job` description) one after the other on every rank of a
    ``torchrun --standalone --nproc_per_node=nprocs`` world (gloo on CPU), from a subprocess.

    Args:
        cwds: one working directory per rank (relative ``out`` paths resolve there: a rank that
            writes nothing leaves its directory empty); default: a temporary directory.
        log: a file for torchrun's output (default: discarded unless the launch fails).

    Returns:
        Per rank, the list of job results (a job that raised has ``error``).

    Raises:
        RuntimeError: a rank produced no results (torchrun's output tail in the message).
    """
    with tempfile.TemporaryDirectory(prefix="dpft-hf-ddp-") as tmp:
        cfg = Path(tmp) / "config.json"
        cwds = cwds or [str(Path(tmp) / f"rank{r}") for r in range(nprocs)]
        cfg.write_text(json.dumps({"jobs": jobs, "cwds": cwds}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
               "-m", "dpft.audit.checks_hf_ddp", str(cfg), tmp]
        try:
            proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            text = f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
        if log:
            Path(log).write_text(text)
        out = []
        for r in range(nprocs):
            f = Path(tmp) / f"results{r}.json"
            if not f.is_file():
                raise RuntimeError(f"torchrun rank {r} wrote no results:\n{text[-4000:]}")
            out.append(json.loads(f.read_text()))
        return out


def main(argv: Optional[list[str]] = None) -> None:
    """Rank ``$RANK`` of a :func:`launch`: run every job, write ``OUT_DIR/results<rank>.json``."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    cwd = Path(cfg["cwds"][rank])
    cwd.mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)
    results = []
    path = Path(argv[1]) / f"results{rank}.json"
    for job in cfg["jobs"]:
        results.append(run_job(job))
        tmp = path.with_suffix(".tmp")  # written after every job: a rank that hangs later keeps them
        tmp.write_text(json.dumps(results))
        os.replace(tmp, path)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the checks

#: Rows of the example-level checks; users (one id per row) of the user-level ones.
N_ROWS = 4
USERS = [0, 0, 0, 1, 1]  # 2 users with 3 and 2 rows (k = 3)


def audit_jobs(planted: Optional[str] = None) -> list[dict]:
    """The 2-process jobs of :func:`hf_ddp_checks` (q = 1, σ = 0, one step, SGD lr 1)."""
    base = {"steps": 1, "sigma": 0.0, "lr": 1.0, "C": C, "physical": 2, "planted": planted, "perturb_rank1": True}
    jobs = [{**base, "name": "ex", "rows": N_ROWS, "eb": N_ROWS}]
    jobs += [{**base, "name": f"ex-{i}", "rows": N_ROWS, "eb": N_ROWS - 1, "drop": [i]} for i in range(N_ROWS)]
    jobs.append({**base, "name": "user", "rows": len(USERS), "users": USERS, "eb": len(set(USERS)), "k": 3})
    return jobs


def _one_process(job: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="dpft-hf-audit-") as tmp:
        res = run_job({**job, "perturb_rank1": False, "out": str(Path(tmp) / "out")})
    if "error" in res:
        raise RuntimeError(f"DPTrainer audit job {job['name']} failed in one process: {res['error']}")
    return res


def _loo(results: dict[str, dict], prefix: str, keys: list, eb_full: int, eb_drop: int) -> float:
    full = released_sum(results[prefix], eb_full)
    return max(float((full - released_sum(results[f"{prefix}-{k}"], eb_drop)).norm()) for k in keys)


def user_loo_check(planted: Optional[str] = None) -> Check:
    """Leave-one-user-out ≤ C in one process (users of 3 and 2 rows, k = 3, group clipping)."""
    t0 = time.perf_counter()
    u = sorted(set(USERS))
    base = {"steps": 1, "sigma": 0.0, "lr": 1.0, "C": C, "physical": 2, "planted": planted, "k": 3,
            "rows": len(USERS), "users": USERS}
    res = {"user": _one_process({**base, "name": "user", "eb": len(u)})}
    for v in u:
        res[f"user-{v}"] = _one_process({**base, "name": f"user-{v}", "eb": len(u) - 1, "drop": [v]})
    worst = _loo(res, "user", u, len(u), len(u) - 1)
    ok = worst <= C * (1 + TOL)
    return Check("hf-ddp: DPTrainer user-level leave-one-user-out", ok,
                 f"max_u ‖S(D) − S(D∖u)‖ = {worst:.4g} vs C = {C:g} (U = {len(u)} users of 2–3 rows, k = 3, q = 1, "
                 "σ = 0)" + ("" if ok else " — a user moves the release by more than C (rows clipped one by one?)"),
                 {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)})


def ddp_checks(one: dict[str, dict], ranks: list[list[dict]]) -> list[Check]:
    """The 2-process checks from the results of :func:`audit_jobs` on every rank (``ranks``)
    and the 1-process results ``one`` (job name → :func:`run_job` result of ``ex`` and
    ``user``). A check whose jobs were not run is left out (a planted-bug test runs only the
    jobs it needs); a job that failed on any rank fails every check."""
    by_rank = [{r["name"]: r for r in rs} for rs in ranks]
    errors = sorted({f"{name}: {res['error']}" for b in by_rank for name, res in b.items() if "error" in res})
    names = ["hf-ddp: DPTrainer 2 processes = 1 process", "hf-ddp: DPTrainer leave-one-out under 2 processes",
             "hf-ddp: DPTrainer no DistributedDataParallel wrapper", "hf-ddp: DPTrainer user level, 2 processes = 1"]
    if errors:
        msg = "a 2-process DPTrainer job failed: " + textwrap.shorten("; ".join(errors), 300, placeholder="…")
        return [Check(n, False, msg, {"errors": errors}) for n in names]
    r0 = by_rank[0]
    out = []
    for name, job, what in ((names[0], "ex", f"N = {N_ROWS} rows"), (names[3], "user", f"U = {len(set(USERS))} users")):
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
    if all(f"ex-{i}" in r0 for i in range(N_ROWS)) and "ex" in r0:
        worst = _loo(r0, "ex", list(range(N_ROWS)), N_ROWS, N_ROWS - 1)
        ok = worst <= C * (1 + TOL)
        out.append(Check(names[1], ok, f"max_i ‖S₂(D) − S₂(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {N_ROWS}, q = 1, "
                         "σ = 0)" + ("" if ok else " — one example moves the world's release by more than C "
                                                    "(clipped on two ranks?)"), {"loo_over_C": worst / C}))
    wrapped = sorted({f"rank {b[j]['rank']}: {b[j]['wrapped']}" for b in by_rank for j in b if b[j]["ddp"]})
    out.append(Check(names[2], not wrapped,
                     "no rank's model is wrapped in DistributedDataParallel" if not wrapped else
                     f"DistributedDataParallel found ({', '.join(wrapped)}): its buckets all-reduce unclipped "
                     "gradients", {"wrapped": wrapped}))
    return out


def hf_ddp_checks(planted: Optional[str] = None, nprocs: int = 2) -> list[Check]:
    """Every check of this module (one ``torchrun`` launch of :func:`audit_jobs` and the
    1-process jobs), with ``planted`` (one of :data:`PLANTED`) re-opened.

    Returns:
        Five :class:`Check` rows; with no planted bug all pass, with one at least one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(PLANTED)}")
    t0 = time.perf_counter()
    jobs = audit_jobs(planted)
    try:
        ranks = launch(jobs, nprocs=nprocs)
    except (RuntimeError, OSError) as exc:
        ranks = None
        failure = str(exc)
    one = {j["name"]: _one_process(j) for j in jobs if j["name"] in ("ex", "user")}
    if ranks is None:
        checks = [Check("hf-ddp: DPTrainer under torchrun (2 processes)", False,
                        "the 2-process launch failed: " + textwrap.shorten(failure, 400, placeholder="…"))]
    else:
        checks = ddp_checks(one, ranks)
        for c in checks:
            c.stats.setdefault("seconds", round(time.perf_counter() - t0, 2))
    return checks + [user_loo_check(planted)]


__all__ = ["hf_ddp_checks", "ddp_checks", "user_loo_check", "audit_jobs", "run_job", "launch", "released_sum",
           "record_shares", "planted_bug", "PLANTED"]

if __name__ == "__main__":
    main()
