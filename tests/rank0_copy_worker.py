"""One rank of tests/test_rank0_copy.py's 2-process check (gloo, spawned): a tiny random GPT-2 with tied
embeddings sharded by ``dpft.placement.fsdp.shard_model``; what each rank holds after ``materialise(keep=rank 0)``
and ``full_on_rank0``, and the ``fsdp=`` resume (``load_full_checkpoint``) from a safetensors checkpoint
and from a ``pytorch_model.bin`` one (no safetensors: rank 0's plain copy), and a LoRA adapter's. Writes
``rank{r}.json`` with the facts the test asserts; rank 0 saves the plain copy with ``save_pretrained``."""

from __future__ import annotations

import json
import os


def _model(seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                                                n_positions=16))


def _lora(seed: int):
    """The seed-0 GPT-2 with a LoRA adapter drawn from ``seed`` (both factors random: not the zero update)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = _model(0)
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], init_lora_weights=False))


def entry(rank: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    from dpft.placement import fsdp
    from dpft.placement.world import World
    from dpft.integrations.hf.fsdp import load_full_checkpoint
    from dpft.placement.shards import full_on_rank0

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    log: dict = {"rank": rank}
    try:
        model = fsdp.shard_model(_model(0), World(rank=rank, world_size=2))
        log["sharded_before"] = all(fsdp.is_sharded(p) for p in model.parameters())
        plain = fsdp.materialise(model, keep=rank == 0)
        log["returned_is_model"] = plain is model
        log["full_params"] = sorted(n for n, p in plain.named_parameters() if not fsdp.is_sharded(p))
        if rank == 0:
            log["tied"] = plain.lm_head.weight is plain.transformer.wte.weight
            plain.save_pretrained(os.path.join(out, "saved"))
        gathered = full_on_rank0(dict(model.named_parameters()))
        log["gathered"] = None if gathered is None else sorted(gathered)
        if rank == 0:
            ref = dict(model.named_parameters())
            log["gathered_shapes_ok"] = all(gathered[n].shape == ref[n].shape for n in gathered)
        # fsdp= resume: checkpoints of other weights (seed 1), loaded into the shards of the seed-0 model
        for fmt in ("safetensors", "bin"):
            ckpt = os.path.join(out, f"ckpt_{fmt}")
            if rank == 0:
                if fmt == "safetensors":
                    _model(1).save_pretrained(ckpt)
                else:  # what an older transformers wrote (5.x writes safetensors only)
                    os.makedirs(ckpt, exist_ok=True)
                    torch.save(_model(1).state_dict(), os.path.join(ckpt, "pytorch_model.bin"))
            dist.barrier()
            used = []

            def load(path, plain_model, used=used):  # Trainer's loader, for a checkpoint without safetensors
                used.append(dist.get_rank())
                sd = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
                plain_model.load_state_dict(sd, strict=False)

            target = fsdp.shard_model(_model(0), World(rank=rank, world_size=2))
            load_full_checkpoint(target, ckpt, load)
            log[f"{fmt}_loader_ranks"] = used
            log[f"{fmt}_still_sharded"] = all(fsdp.is_sharded(p) for p in target.parameters())
            want = _model(1).state_dict()
            ok = True
            for n, p in target.named_parameters():  # a collective: every rank gathers, each compares
                ok = ok and torch.equal(p.full_tensor(), want[n])
            log[f"{fmt}_equal"] = ok
        # the same for a PEFT model DPTrainer sharded: the adapter's file, renamed by PEFT, broadcast by rank 0
        ckpt = os.path.join(out, "ckpt_lora")
        if rank == 0:
            _lora(1).save_pretrained(ckpt)
        dist.barrier()
        target = fsdp.shard_model(_lora(2), World(rank=rank, world_size=2))
        load_full_checkpoint(target, ckpt, lambda *a: used.append("loader"))
        want = _lora(1).state_dict()
        ok, n_lora = True, 0
        for n, p in target.named_parameters():
            ok = ok and torch.equal(p.full_tensor(), want[n])
            n_lora += "lora_" in n
        log["lora_equal"], log["lora_params"] = ok, n_lora
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
        dist.destroy_process_group()
