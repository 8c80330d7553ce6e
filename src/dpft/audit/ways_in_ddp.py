"""The Python ways in across processes and at user level, one check per property over the ways in
(``make_private``, ``DPTrainer``: :data:`WAYS`; issue 26 items 1 and 4; issue 46 item 4).

Each way in runs tiny jobs (:func:`run_job`: ``make_private`` on a small net with a large input, or
``DPTrainer`` on a random BERT with rows of several lengths, one mislabelled: large gradients) for one
logical step with ``q = 1`` (every unit sampled) and SGD at learning rate 1, and the released clipped
sum is read back from the weights: ``S = −Δθ · qN`` (add/remove-one; Abadi et al. 2016, Alg. 1). The
2-process jobs run under ``torchrun --nproc_per_node=2`` (gloo, CPU; :func:`launch`) from a subprocess.
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

:func:`run_job` is one run from a JSON description (tests/test_hf_ddp.py drives it too, with longer runs);
``python -m dpft.audit.ways_in_ddp CONFIG.json OUT_DIR`` runs a list of jobs on every rank of a ``torchrun``
world.
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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from dpft import PrivacyEngine
from dpft.audit.planted import planting
from dpft.audit.ways_in import TinyNet, WayIn, leave_one_out, mp_data
from dpft.audit.whitebox import Check, tiny_classifier
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import trainer as hf
from dpft.placement import world as ddp
from dpft.step import plan as step_plan

HF_PLANTED = ("hf_ddp_wrapped", "hf_ddp_unsharded", "hf_user_rows_clipped_alone")
API_PLANTED = ("ddp_batch_on_every_rank", "ddp_user_rows_split", "ddp_noise_per_rank")
PLANTED = HF_PLANTED + API_PLANTED
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

        if name == "hf_ddp_wrapped":
            p.set(hf.DPTrainer, "create_accelerator_and_postprocess", Trainer.create_accelerator_and_postprocess)
            p.set(hf.DPTrainer, "_check_not_ddp", lambda self, model: None)
        elif name == "hf_ddp_unsharded":
            p.set(hf.DPTrainer, "_share", lambda self, idx: idx)
        elif name == "ddp_batch_on_every_rank":
            p.set(ddp, "shard", lambda idx, world: idx)
        elif name == "ddp_user_rows_split":
            p.set(ddp, "shard_units", lambda idx, units, world, real=ddp.shard: real(idx, world))
        elif name == "ddp_noise_per_rank":
            real_build = step_plan.build_step_spec  # the one plan builder's (every way in)

            def build(**kw):
                spec = real_build(**kw)
                if spec.mechanism is not None:
                    spec.mechanism.rng = kw["rng"].child(f"rank{os.environ.get('RANK', '0')}")
                return spec

            p.set(step_plan, "build_step_spec", build)
            p.set(ddp, "check_step_digest", lambda *a, **k: None)
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


def _digest(params: dict) -> str:
    """The trainable weights ``params`` (name → tensor), bit for bit."""
    h = hashlib.sha256()
    for n, p in sorted(params.items()):
        h.update(n.encode() + p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _make_private_job(job: dict, out: dict) -> dict:
    """:func:`run_job` of ``trainer: make_private``: one step of ``make_private`` on :class:`TinyNet` over
    :func:`~dpft.audit.ways_in.mp_data` rows (at user level row 1 repeats row 0: user 0's two rows share one
    large gradient), q = 1, physical batches of 1; ``wrap_ddp``: the model handed over in
    ``DistributedDataParallel`` (the way in must refuse)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    users = job.get("users")
    x, y = mp_data(int(job["rows"]))
    if users is not None:
        x[1], y[1] = x[0], y[0]
    drop = set(job.get("drop") or [])
    rows = [{"x": x[i], "y": y[i], "u": users[i] if users else i} for i in range(len(x))
            if (users[i] if users else i) not in drop]
    units = len({r["u"] for r in rows})
    torch.manual_seed(0)
    model = TinyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    world = ddp.init_from_env()
    eng = PrivacyEngine(reproducible_seed=int(job.get("seed", 0)))
    with planted_bug(job.get("planted")), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module, opt, crit, loader = eng.make_private(
                module=DistributedDataParallel(model) if job.get("wrap_ddp") else model,
                optimizer=torch.optim.SGD(model.parameters(), lr=float(job.get("lr", 1.0))),
                criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(rows, batch_size=units),
                noise_multiplier=float(job.get("sigma", 0.0)), max_grad_norm=float(job.get("C", C)), steps=1,
                max_physical_batch_size=1, user_ids="u" if users else None, max_rows_per_user=int(job.get("k", 2)))
            for b in loader:
                opt.zero_grad()
                crit(module(b["x"]), b["y"]).backward()
                opt.step()
        except Exception as exc:  # noqa: BLE001 - recorded for the caller, which decides
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        finally:
            eng.detach()
    params = dict(model.named_parameters())
    out.update(world_size=world.world_size, rank=world.rank, ddp=False, wrapped=type(model).__name__,
               delta=torch.cat([(p.detach() - before[n]).flatten().double() for n, p in sorted(params.items())]).tolist(),
               digest=_digest(params), ledger=eng.ledger.to_json(), epsilon=None, q=1.0, n=units,
               sigma=float(job.get("sigma", 0.0)))
    return out


def run_job(job: dict) -> dict:
    """One run described by ``job`` in this process (a rank of the world under ``torchrun``). Keys:
    ``name``; ``trainer`` (``hf``: ``DPTrainer`` on the tiny BERT, the default; ``make_private``:
    :func:`_make_private_job`; ``sft``: ``DPSFTTrainer`` on a tiny Llama with prompt/completion rows; ``dpo``:
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

    DPArguments, DPTrainer = hf.DPArguments, hf.DPTrainer

    out: dict[str, Any] = {"name": job["name"], "batches": {}, "shares": {}}
    if job.get("trainer") == "make_private":
        return _make_private_job(job, out)
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
    out["digest"] = _digest(tr.engine.params)  # the final trainable weights, bit for bit
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
               "-m", "dpft.audit.ways_in_ddp", str(cfg), tmp]
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


__all__ = ["hf_ddp_checks", "ddp_way_checks", "ddp_checks", "user_loo_check", "audit_jobs", "run_job", "launch",
           "released_sum", "record_shares", "planted_bug", "PLANTED", "WAYS", "DDPWay"]

if __name__ == "__main__":
    main()
