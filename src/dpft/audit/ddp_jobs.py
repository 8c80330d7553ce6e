"""One run of a Python way in from a JSON job description (:func:`run_job`: ``make_private``, ``DPTrainer``,
``DPSFTTrainer``, ``DPDPOTrainer`` on tiny in-process models), in a process of a ``torchrun`` world, and its
launcher (:func:`launch`; issue 26, issue 46 item 4).

The audit's 2-process checks (audit/ways_in_ddp.py) and the distributed tests (tests/test_hf_ddp.py, the FSDP
workers) describe runs as jobs; ``python -m dpft.audit.ddp_jobs CONFIG.json OUT_DIR`` runs a list of them on
every rank of a ``torchrun --standalone`` world (gloo on CPU) and writes each rank's results. A job's
``planted`` names a bug of :data:`PLANTED` (audit/ways_in_ddp.py's module docstring) applied for that run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import PrinterCallback, Trainer, TrainingArguments

from dpft import PrivacyEngine
from dpft.audit.planted import bug_planter
from dpft.audit.ways_in import TinyNet, mp_data
from dpft.audit.whitebox import tiny_classifier
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import trainer as hf
from dpft.placement import world as ddp
from dpft.step import plan as step_plan

#: The planted bugs a job applies (audit/ways_in_ddp.py's module docstring says what each breaks).
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


def _rank_noise(real=step_plan.build_step_spec):
    def build(**kw):  # ddp_noise_per_rank: each rank its own noise stream (the one plan builder's: every way in)
        spec = real(**kw)
        if spec.mechanism is not None:
            spec.mechanism.rng = kw["rng"].child(f"rank{os.environ.get('RANK', '0')}")
        return spec

    return build


def _groups_dropped(real):
    def micro_batches(self, idx):  # hf_user_rows_clipped_alone: the group ids never reach the engine
        for batch in real(self, idx):
            batch.pop(GROUP_KEY, None)
            yield batch

    return micro_batches


#: Re-open one hole for the duration (``None``: nothing planted; ValueError: an unknown name).
planted_bug = bug_planter(PLANTED, {
    "hf_ddp_wrapped": lambda p: (p.set(hf.DPTrainer, "create_accelerator_and_postprocess",
                                       Trainer.create_accelerator_and_postprocess),
                                 p.set(hf.DPTrainer, "_check_not_ddp", lambda self, model: None)),
    "hf_ddp_unsharded": lambda p: p.set(hf.DPTrainer, "_share", lambda self, idx: idx),
    "ddp_batch_on_every_rank": lambda p: p.set(ddp, "shard", lambda idx, world: idx),
    "ddp_user_rows_split": lambda p: p.set(ddp, "shard_units", lambda idx, units, world, real=ddp.shard: real(idx, world)),
    "ddp_noise_per_rank": lambda p: (p.set(step_plan, "build_step_spec", _rank_noise()),
                                     p.set(ddp, "check_step_digest", lambda *a, **k: None)),
    "hf_user_rows_clipped_alone": lambda p: p.set(hf.DPTrainer, "_micro_batches",
                                                  _groups_dropped(hf.DPTrainer._micro_batches)),
})


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
    DPArguments, DPTrainer = hf.DPArguments, hf.DPTrainer

    out: dict[str, Any] = {"name": job["name"], "batches": {}, "shares": {}}
    if job.get("trainer") == "make_private":
        return _make_private_job(job, out)
    users = job.get("users")
    with planted_bug(job.get("planted")) as patches:
        if job.get("accelerate_wraps"):
            patches.set(DPTrainer, "create_accelerator_and_postprocess", Trainer.create_accelerator_and_postprocess)
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
               "-m", "dpft.audit.ddp_jobs", str(cfg), tmp]
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


__all__ = ["run_job", "launch", "released_sum", "record_shares", "make_rows", "trl_rows", "pad_collate", "tiny_model",
           "planted_bug", "PLANTED", "HF_PLANTED", "API_PLANTED", "C", "TOL", "EQ_TOL", "USER_COLUMN"]

if __name__ == "__main__":
    main()
