"""One rank of a ``dpft.train`` run under ``torchrun``, for tests/test_ddp.py (not a test file).

Usage: ``python -m torch.distributed.run --standalone --nproc_per_node=K tests/ddp_worker.py CFG.json``,
or :func:`run_rank` in processes forked with the same environment (tests/test_ddp.py).

CFG keys: ``recipe`` (dict of dotted recipe keys), ``output_dir`` (relative to the rank's
working directory), ``cwds`` (one working directory per rank: the run directory of a rank
other than 0 must stay empty, which shows that only rank 0 writes), ``log_dir`` (where each
rank writes ``rank<r>.json``: the logical batch and the rank's share of every step, a digest of
its final weights, its report's ε), ``resume`` (bool), ``kill`` (``{"rank": r, "step": t}``:
that rank SIGKILLs itself at the start of logical step t, a crash nobody can catch), ``interrupt``
(``{"rank": r, "step": t}``: that rank alone gets a SIGINT at the start of logical step t, as
Ctrl-C or a scheduler's SIGTERM reaching one process first; the rank's ``interrupted`` log is the
``TrainingInterrupted`` message), ``probe``
(after the run, check that per-rank ``Randomness()`` objects are refused and that a
weight changed on rank 1 is found and replaced by rank 0's), ``plant`` (a planted rank
mismatch the per-step digest must stop: ``"tokenise"`` — rank 1's rows have other token
lengths, so it sorts and shards the logical batch differently; ``"noise"`` — rank 1's
mechanism draws from another key).

Each rank also logs the shape of every micro-batch it runs (``micro``: step → ``[[rows, tokens,
real rows], …]``, real rows from ``example_mask`` under truncated Poisson) and, for banded_mf,
a SHA-256 of its secret noise buffers after every step (``noise``: step → hex).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path


def run_rank(cfg: dict, rank: int) -> None:
    """Rank ``rank``'s part of the run ``cfg`` describes (the torchrun environment is set)."""
    log_path = Path(cfg["log_dir"]) / f"rank{rank}.json"
    cwd = Path(cfg["cwds"][rank])
    cwd.mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)

    import dpft
    from dpft.placement import world as ddp
    from dpft.run.loop import Trainer

    log: dict = {"rank": rank, "batches": {}, "shares": {}, "micro": {}, "noise": {}}

    def flush() -> None:
        # Atomic: a rank terminated by its agent mid-write must not leave half a file.
        tmp = log_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(log))
        os.replace(tmp, log_path)

    real_shard, real_step, real_run, real_micro = ddp.shard, Trainer.step, Trainer.run, Trainer.micro_batches
    current = {"step": -1, "trainer": None}

    def shard(idx, world):
        mine = real_shard(idx, world)
        log["world_size"] = world.world_size
        log["batches"][str(current["step"])] = sorted(int(i) for i in idx)
        log["shares"][str(current["step"])] = [int(i) for i in mine]
        # Written before this step's all-reduce: a rank SIGKILLed at the next step cannot
        # race the other rank's flush (its agent terminates it at once).
        flush()
        return mine

    def step(self, t):
        kill = cfg.get("kill")
        if kill and kill["rank"] == rank and kill["step"] == t:
            flush()
            os.kill(os.getpid(), signal.SIGKILL)
        stop = cfg.get("interrupt")
        if stop and stop["rank"] == rank and stop["step"] == t:
            os.kill(os.getpid(), signal.SIGINT)  # the run's handler: finish this step, then stop
        current["step"] = t
        out = real_step(self, t)
        bufs = getattr(self.mechanism, "buffers", None)
        if bufs is not None:  # banded_mf: the secret noise state this rank holds after step t
            h = hashlib.sha256()
            for b in bufs:
                for n in sorted(b):
                    h.update(b[n].float().contiguous().numpy().tobytes())
            log["noise"][str(t)] = h.hexdigest()
        flush()
        return out

    def micro_batches(self, idx):
        rows = log["micro"].setdefault(str(current["step"]), [])
        for b in real_micro(self, idx):
            mask = b.get("example_mask")
            rows.append([*b["input_ids"].shape, int(mask.sum()) if mask is not None else int(b["input_ids"].shape[0])])
            yield b

    def run(self):
        current["trainer"] = self
        if cfg.get("plant") == "tokenise" and rank == 1:
            self.train_lengths = self.train_lengths.flip(0).clone()  # as if rank 1 tokenised differently
        elif cfg.get("plant") == "noise" and rank == 1:
            from dpft.privacy.randomness import Randomness

            self.dp_step.spec.mechanism.rng = Randomness()  # rank 1's noise from its own key
        return real_run(self)

    ddp.shard, Trainer.step, Trainer.run, Trainer.micro_batches = shard, step, run, micro_batches
    try:
        rep = dpft.train(cfg["recipe"], cfg["output_dir"], resume=cfg.get("resume", False), progress=False)
    except Exception as exc:
        log["error"] = f"{type(exc).__name__}: {exc}"
        flush()
        raise
    except KeyboardInterrupt as exc:  # TrainingInterrupted: the run checkpointed and stopped
        log["interrupted"] = str(exc)
        log["ledger_steps"] = current["trainer"].ledger.steps
        flush()
        ddp.shutdown()
        return
    t = current["trainer"]
    h = hashlib.sha256()
    from dpft.placement.fsdp import full_state  # FSDP: the gathered weights (plain tensors pass through)

    for n, v in full_state(t.params).items():
        h.update(v.float().contiguous().numpy().tobytes())
    log["digest"] = h.hexdigest()
    log["epsilon"] = rep["privacy"].get("epsilon")  # a --no-dp run reports none
    log["ledger_steps"] = t.ledger.steps
    if cfg.get("probe"):  # a Randomness made on each rank (K keys) must be refused on every rank
        from dpft.privacy.randomness import Randomness

        try:
            ddp.check_same_randomness(t.world, Randomness())
            log["own_rng"] = "accepted"
        except ddp.DistributedError as exc:
            log["own_rng"] = str(exc)
        # Weights that drifted on one rank are found at a checkpoint and replaced by rank 0's.
        import torch

        name = sorted(t.params)[0]
        before = t.params[name].detach().clone()
        if rank == 1:
            with torch.no_grad():
                t.params[name].view(-1)[0] += 1e-3
        log["in_sync"] = [ddp.check_in_sync(t.world, t.params), bool(torch.equal(t.params[name], before)),
                          ddp.check_in_sync(t.world, t.params)]
    flush()
    ddp.shutdown()


def forked_entry(i: int, cfg: dict, port: int, world_size: int = 2) -> None:
    """Entry of rank ``i`` started by ``torch.multiprocessing.start_processes``: sets what
    torchrun sets for each worker (distributed.py reads nothing else), then runs."""
    os.environ.update(RANK=str(i), LOCAL_RANK=str(i), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_rank(cfg, i)


def main() -> None:
    run_rank(json.loads(Path(sys.argv[1]).read_text()), int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    main()
