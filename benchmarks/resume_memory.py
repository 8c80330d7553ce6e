"""Peak host memory per rank while a caller-sharded resume loads a checkpoint's weights
(``dpft.integrations.hf.fsdp.load_full_into_shards``: the model the caller sharded with ``fully_shard``,
``DPTrainer(...).train(resume_from_checkpoint=...)``), on 2 CPU processes (gloo).

A random-initialised Llama from a config (hidden 512, 4 decoder layers, vocabulary 32,000, untied head:
45 M parameters, 180 MB in fp32; the largest tensor, the embedding or the head, 65.5 MB) is written to
``model.safetensors``; each rank builds the same model with other weights, shards it (decoder layers,
then the root) and loads the checkpoint. Measured per rank: the resident set (``VmRSS``) just before the
load and its peak during the load (``VmHWM``, reset through ``/proc/self/clear_refs`` just before), so the
peak increment is what the load itself holds; and that increment split into private memory (``RssAnon``:
buffers the load allocates) and file-backed pages (``RssFile``: safetensors 0.8 maps the file and copies
nothing, so a rank's checkpoint tensors take resident memory only where it reads them; the page cache is
shared by the ranks of one machine), each sampled every millisecond. Then the same for the optimizer
(``load_full_optimizer``: AdamW's full state, two tensors per parameter, 346 MB, in ``optimizer.pt`` as
DPTrainer writes it). The loaded weights are checked against the file.

``--case save``: the plain copy ``dpft train`` builds after FSDP2 training for rank 0's save, generation
and test file (``dpft.placement.fsdp.materialise`` of a model ``dpft.placement.fsdp.shard_model`` sharded): the same per-rank
peak increment while it is built, and rank 0's copy checked against the weights (a checkout whose
``materialise`` has no ``keep``: the copy on every rank, as before). Measured, MiB as printed (2 gloo
processes, the 45 M Llama above, 173 MiB): before, each rank +354 (the gathered tensors and their
copies); after, rank 0 +245 (the copy and one tensor in flight), rank 1 +143 and no full tensor kept
(the 62.5 MiB embedding and head pass through its gathers). 8 layers (222 MiB): before +454 on each
rank; after rank 0 +294, rank 1 +147.

Run from the repository root (``before``: the code of another checkout, e.g. ``PYTHONPATH=/work/main/src``)::

    PYTHONPATH=src python benchmarks/resume_memory.py [--case resume|save] [--layers 4] [--hidden 512] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import tempfile


def _status(field: str) -> float:
    """``field`` of /proc/self/status in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


class _Peaks:
    """Peak private (``RssAnon``) and file-backed (``RssFile``: the checkpoint's mmap'd pages, safetensors 0.8
    loads zero-copy; shared page cache, one physical copy per machine) resident memory, MB, sampled by a
    thread every millisecond while the block runs."""

    def __enter__(self):
        import threading

        self.anon = self.file = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.anon, self.file = max(self.anon, _status("RssAnon")), max(self.file, _status("RssFile"))
            self._stop.wait(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def _same(a, b) -> bool:
    """Whether two (nested) state dicts hold equal values."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _model(args, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False))


def _rank(rank: int, args, port: int, ckpt: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dpft.integrations.hf.fsdp import full_optimizer_state, load_full_into_shards, load_full_optimizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = _model(args, seed=1)
        mesh = init_device_mesh("cpu", (2,))
        for m in model.model.layers:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dist.barrier()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = {k: _status(k) for k in ("VmRSS", "RssAnon", "RssFile")}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        with _Peaks() as peaks:
            load_full_into_shards(model, ckpt)
        peak = _status("VmHWM")
        ok = True
        with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as fh:
            for name, p in model.named_parameters():  # every rank gathers (a collective); rank 0 compares
                full = p.full_tensor()
                ok = ok and (rank != 0 or torch.equal(full, fh.get_tensor(name)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for q in model.parameters():  # AdamW's state (two tensors per parameter), non-zero
            q.grad = q.detach() * 0.5
        opt.step()
        full_opt = full_optimizer_state(model, opt)  # what DPTrainer writes at a checkpoint (rank 0; {} elsewhere)
        if rank == 0:
            torch.save(full_opt, os.path.join(ckpt, "optimizer.pt"))
        del full_opt
        dist.barrier()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        opt_before = {k: _status(k) for k in ("VmRSS", "RssAnon", "RssFile")}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with _Peaks() as opt_peaks:
            load_full_optimizer(model, opt, ckpt)
        opt_peak = _status("VmHWM")
        again = full_optimizer_state(model, opt)  # gathered after the load (a collective); rank 0 compares
        opt_ok = rank != 0 or _same(again, torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "rss_before_mb": before["VmRSS"], "peak_mb": peak,
                       "load_increment_mb": peak - before["VmRSS"],
                       "anon_increment_mb": max(peaks.anon, before["RssAnon"]) - before["RssAnon"],
                       "file_increment_mb": max(peaks.file, before["RssFile"]) - before["RssFile"],
                       "weights_equal_file": ok, "optimizer_load_increment_mb": opt_peak - opt_before["VmRSS"],
                       "optimizer_equal_file": opt_ok, "optimizer_anon_increment_mb": max(opt_peaks.anon, opt_before["RssAnon"])
                       - opt_before["RssAnon"]}, f)
    finally:
        dist.destroy_process_group()


def _save_rank(rank: int, args, port: int, ckpt: str, out: str) -> None:
    """``--case save`` on rank ``rank``: the peak increment while ``materialise`` builds rank 0's plain copy."""
    import inspect

    import torch
    import torch.distributed as dist

    from dpft.placement import fsdp
    from dpft.placement.world import World

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = fsdp.shard_model(_model(args, seed=0), World(rank=rank, world_size=2))
        dist.barrier()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = {k: _status(k) for k in ("VmRSS", "RssAnon")}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        kw = {"keep": rank == 0} if "keep" in inspect.signature(fsdp.materialise).parameters else {}
        with _Peaks() as peaks:
            plain = fsdp.materialise(model, **kw)
        peak = _status("VmHWM")
        full = [p for p in plain.parameters() if not fsdp.is_sharded(p)]
        ok = rank != 0 or _same({k: v for k, v in plain.state_dict().items()}, _model(args, seed=0).state_dict())
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "rss_before_mb": before["VmRSS"], "peak_mb": peak,
                       "copy_increment_mb": peak - before["VmRSS"],
                       "anon_increment_mb": max(peaks.anon, before["RssAnon"]) - before["RssAnon"],
                       "full_tensors_held_mb": sum(p.numel() * p.element_size() for p in full) / 2**20,
                       "copy_equals_weights": ok}, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=["resume", "save"], default="resume")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sd = {k: v.contiguous() for k, v in _model(args, seed=0).state_dict().items()}
        save_file(sd, os.path.join(tmp, "model.safetensors"))
        size = sum(v.numel() * v.element_size() for v in sd.values()) / 2**20
        largest = max(v.numel() * v.element_size() for v in sd.values()) / 2**20
        del sd
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.start_processes(_rank if args.case == "resume" else _save_rank, args=(args, port, tmp, tmp), nprocs=2, join=True,
                                              start_method="spawn")
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
    print(json.dumps({"checkpoint_mb": round(size, 1), "largest_tensor_mb": round(largest, 1),
                      "ranks": [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in ranks]},
                     indent=1))


if __name__ == "__main__":
    main()
