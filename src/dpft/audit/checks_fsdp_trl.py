"""Audit checks of the FSDP2 ways in added by issue 38 items 1–3: ``DPDPOTrainer`` and QLoRA through
``DPTrainer`` under ``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin (integrations/hf/fsdp.py,
integrations/trl/fsdp.py), and the non-private FSDP step of ``dpft train --no-dp`` (dpft/placement/fsdp_plain.py).

White-box, in one process (no process group: DPTrainer runs the sharded step on the plain model), in the
style of ``audit/checks_fsdp.py`` ``hf_fsdp_checks``:

* **DPO under fsdp** — a tiny Llama with a LoRA policy, ``DPOConfig(fsdp=True, fsdp_config={"fsdp_version":
  2})``, two logical steps: dpft's :class:`~dpft.placement.fsdp.FSDPStep` runs every step with one ledger event, no
  unclipped gradient reaches a parameter (autograd accumulates none; only the noisy release writes
  ``.grad``), every micro-batch the engine clips — the placeholder's usage probe included — holds whole
  pairs as its clipping groups (``[0, 0, 1, 1, …]``: the pair is the privacy unit), and TRL's reference
  adapter (made before sharding, :func:`~dpft.integrations.trl.fsdp.add_reference_adapter`) is frozen:
  outside the engine's parameters and unchanged by training, equal to the policy's adapter before
  training (PEFT re-freezes every inactive adapter whenever TRL switches adapters, so this holds by
  construction; checked all the same). Planted ``dpo_fsdp_args_kept``: DPTrainer clears ``fsdp`` but hands
  accelerate's plugin arguments (``fsdp_plugin_args``) on: ``Trainer`` builds an FSDP plugin, and TRL's
  ``DPOTrainer`` (``is_fsdp_enabled``) would then prepare its reference and policy with accelerate's FSDP
  hooks, which reduce-scatter unclipped gradients.
* **QLoRA under accelerate's FSDP2 plugin** (when bitsandbytes is installed) — a 4-bit NF4 tiny Llama
  with LoRA, ``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``: accelerate is never handed FSDP (its
  ``fsdp2_prepare_model`` would wrap the quantized model with hooks that reduce-scatter unclipped
  gradients), FSDPStep runs every step with one ledger event, the engine's parameters are the adapters
  alone and no raw gradient reaches any parameter. Planted ``qlora_fsdp_env_kept``: accelerate's FSDP
  environment left on while ``Trainer`` builds its accelerator.
* **the non-private FSDP step adds nothing for a placeholder** — :class:`~dpft.placement.fsdp_plain.PlainFSDPStep`
  on a short rank (one real micro-batch, the world's count two: a placeholder runs) updates the weights
  exactly as the unsharded ``--no-dp`` step (``DPStep`` with ``NonPrivateEngine``) on the real one, and
  records no ledger event. Planted ``fsdp_plain_dummy_counted``: the placeholder's loss is not zeroed
  (row 0 counted again on that rank).

:func:`fsdp_trl_checks` is the entry point (``audit/suite.py`` ``OPTIONAL_CHECKS``). Importing this
module needs ``trl`` (the suite skips it, with a note, when trl is absent).
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
import warnings
from typing import Optional

import torch

import trl  # noqa: F401 - the DPO check needs TRL; an ImportError skips this module in the suite

from dpft.placement import fsdp_plain
from dpft.accounting.ledger import PrivacyLedger
from dpft.models.quant import bnb_config
from dpft.audit.checks_fsdp import watch_trainer
from dpft.audit.checks_hf_ddp import trl_rows
from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer
from dpft.audit.planted import bug_planter
from dpft.audit.whitebox import Check
from dpft.placement.world import World
from dpft.grads.base import NonPrivateEngine
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import trainer as hf
from dpft.integrations.trl import trainer as dtrl
from dpft.integrations.hf.trainer import DPArguments
from dpft.step import DPStep
from dpft.step.build import build_step_spec
from dpft.step.clip import make_clip_policy

__all__ = ["PLANTED", "fsdp_trl_checks"]

#: Planted bugs :func:`fsdp_trl_checks` must catch (audit/planted.py lists them too).
PLANTED = ("dpo_fsdp_args_kept", "qlora_fsdp_env_kept", "fsdp_plain_dummy_counted")


def _plugin_args_kept(real):
    def keep_args(model, args, *a, **k):
        model, cleared, asked = real(model, args, *a, **k)
        # fsdp cleared, but accelerate's plugin arguments handed on: Trainer (and TRL's DPOTrainer, which
        # then prepares its reference with prepare_fsdp) build an FSDP plugin
        cleared.fsdp_plugin_args = getattr(args, "fsdp_plugin_args", None)
        return model, cleared, asked

    return keep_args


planted_bug = bug_planter(PLANTED, {
    "dpo_fsdp_args_kept": lambda p: p.set(hf, "shard_requested", _plugin_args_kept(hf.shard_requested)),
    "qlora_fsdp_env_kept": lambda p: p.set(hf, "accelerate_fsdp_off", lambda requested: contextlib.nullcontext()),
    "fsdp_plain_dummy_counted": lambda p: p.set(fsdp_plain.PlainFSDPStep, "DUMMY_WEIGHT", 1.0),
})


_COMMON = dict(max_steps=2, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
               per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no",
               logging_strategy="no", disable_tqdm=True)
_DP = dict(target_delta=1e-3, noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=4,
           max_physical_batch_size=2, reproducible_seed=5)


def _train(tr, seen: dict) -> None:
    """Two logical steps of ``tr``, counting raw gradient accumulations and recording each clipped
    micro-batch's groups and rows (the placeholder's usage probe included)."""
    from transformers import PrinterCallback

    tr.remove_callback(PrinterCallback)
    seen.setdefault("raw_grads", 0)
    seen["groups"] = []
    eng = tr.engine
    real_sum, real_probe = eng.clipped_sum, getattr(eng, "check_usage", None)

    def record(batch):
        g = batch.get(GROUP_KEY)
        seen["groups"].append(None if g is None else [int(x) for x in g])
        return batch

    eng.clipped_sum = lambda batch: real_sum(record(batch))
    if real_probe is not None:  # the placeholder's probe gets (batch without groups, groups)

        def probe(batch, groups=None):
            seen["groups"].append(None if groups is None else [int(x) for x in groups])
            return real_probe(batch, groups)

        eng.check_usage = probe

    def raw(_p):
        seen["raw_grads"] += 1

    hooks = [p.register_post_accumulate_grad_hook(raw) for p in tr.model.parameters() if p.requires_grad]
    seen["step"] = type(tr.dp_step).__name__
    try:
        tr.train()
    finally:
        for h in hooks:
            h.remove()
    seen["events"] = sum(e["count"] for e in tr.ledger.to_json()["entries"])


def _dpo_run(tmp: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from trl import DPOConfig

    seen: dict = {"error": None}
    with watch_trainer(seen):
        try:
            tok = tiny_tokenizer()
            model = get_peft_model(tiny_llama(len(tok)), LoraConfig(
                task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
                target_modules=["q_proj", "v_proj"]))
            before = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
            args = DPOConfig(output_dir=tmp, bf16=False, beta=0.5, max_length=64, dataset_num_proc=None,
                             fsdp=True, fsdp_config={"fsdp_version": 2}, **_COMMON)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = dtrl.DPDPOTrainer(model=model, args=args, train_dataset=trl_rows({"trainer": "dpo", "rows": 8}),
                                       processing_class=tok, dp_args=DPArguments(**_DP))
                seen["engine_ref"] = [n for n in tr.engine.params if ".ref." in n]
                _train(tr, seen)
            ref = {n: p.detach() for n, p in tr.model.named_parameters() if ".ref." in n}
            seen["ref_frozen"] = bool(ref) and not any(p.requires_grad for n, p in tr.model.named_parameters()
                                                       if ".ref." in n)
            seen["ref_is_initial"] = bool(ref) and all(
                torch.equal(ref[n.replace(".default.", ".ref.")], w) for n, w in before.items())
        except Exception as exc:  # noqa: BLE001 - a planted bug may break the trainer; the record decides
            seen["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return seen


def _dpo_checks(tmp: str) -> list[Check]:
    s = _dpo_run(tmp)
    err = f"; {s['error']}" if s["error"] else ""
    ok = s["error"] is None and s.get("step") == "FSDPStep" and s.get("runs") == 2 == s.get("events")
    out = [Check("fsdp DPDPOTrainer: dpft's FSDPStep runs every step", ok,
                 f"{s.get('step')}: {s.get('runs', 0)} runs, {s.get('events')} ledger events{err}")]
    handed = s.get("fsdp_args", True) or s.get("fsdp_env", True) or s.get("fsdp_plugin", True)
    clean = s["error"] is None and s.get("raw_grads") == 0 and not handed
    out.append(Check("fsdp DPDPOTrainer: no unclipped gradient, accelerate never handed FSDP", clean,
                     "no raw gradient accumulated; Trainer built its accelerator without FSDP" if clean else
                     f"{s.get('raw_grads')} raw gradient accumulation(s); accelerate handed FSDP: {handed}{err}"))
    groups = s.get("groups") or []
    paired = s["error"] is None and bool(groups) and all(
        g is not None and g == [i // 2 for i in range(len(g))] for g in groups)
    out.append(Check("fsdp DPDPOTrainer: each clipping group is one pair (placeholder included)", paired,
                     f"{len(groups)} clipped micro-batches, every one pairs its rows [0, 0, 1, 1, ...]" if paired else
                     f"groups seen: {groups[:4]}{err}"))
    frozen = s["error"] is None and not s.get("engine_ref") and s.get("ref_frozen") and s.get("ref_is_initial")
    out.append(Check("fsdp DPDPOTrainer: the reference adapter is frozen and is the initial policy", bool(frozen),
                     "the 'ref' adapter is outside the engine, frozen and equal to the policy's adapter before "
                     "training" if frozen else
                     f"reference adapter in the engine: {s.get('engine_ref', [])[:2]}, frozen: {s.get('ref_frozen')}, "
                     f"= initial policy: {s.get('ref_is_initial')}{err}"))
    return out


def _qlora_run(tmp: str) -> dict:
    import peft
    import transformers


    seen: dict = {"error": None}
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
           "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(  # hidden 64: bitsandbytes' CPU 4-bit kernels
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)).save_pretrained(f"{tmp}/llama")
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(3, 64, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(12)]

    def collate(batch):
        t = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    with warnings.catch_warnings(), watch_trainer(seen, env):
        warnings.simplefilter("ignore")
        try:
            import datasets
            from transformers import TrainingArguments

            base = transformers.AutoModelForCausalLM.from_pretrained(
                f"{tmp}/llama", quantization_config=bnb_config("nf4", torch.float32), device_map="cpu",
                dtype=torch.float32)
            base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
            model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                              init_lora_weights=False, target_modules=["q_proj", "v_proj"]))
            tr = hf.DPTrainer(model=model, args=TrainingArguments(output_dir=f"{tmp}/out", label_names=["labels"],
                                                                  **_COMMON),
                              train_dataset=datasets.Dataset.from_list(rows), data_collator=collate,
                              dp_args=DPArguments(**_DP))
            seen["engine_params"] = list(tr.engine.params)
            _train(tr, seen)
        except Exception as exc:  # noqa: BLE001 - a planted bug may break the trainer; the record decides
            seen["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return seen


def _qlora_checks(tmp: str) -> list[Check]:
    s = _qlora_run(tmp)
    err = f"; {s['error']}" if s["error"] else ""
    built = "fsdp_args" in s
    handed = not built or s["fsdp_args"] or s["fsdp_env"] or s.get("fsdp_plugin", True)
    out = [Check("fsdp QLoRA DPTrainer (accelerate's FSDP2 plugin): accelerate is never handed FSDP", not handed,
                 "Trainer built its accelerator with fsdp cleared, ACCELERATE_USE_FSDP off, no FSDP plugin"
                 if not handed else f"accelerate got FSDP (arguments: {s.get('fsdp_args')}, environment: "
                 f"{s.get('fsdp_env')}, plugin: {s.get('fsdp_plugin')}): fsdp2_prepare_model would wrap the quantized "
                 f"model with hooks that reduce-scatter unclipped gradients{err}")]
    names = s.get("engine_params") or []
    ok = (s["error"] is None and s.get("step") == "FSDPStep" and s.get("runs") == 2 == s.get("events")
          and s.get("raw_grads") == 0 and bool(names) and all("lora_" in n for n in names))
    out.append(Check("fsdp QLoRA DPTrainer: FSDPStep trains the adapters alone, no raw gradient", ok,
                     f"{s.get('step')}: {s.get('runs', 0)} runs, {s.get('events')} ledger events, "
                     f"{len(names)} engine parameters (all LoRA: {all('lora_' in n for n in names)}), "
                     f"{s.get('raw_grads')} raw gradient accumulation(s){err}"))
    return out


def _plain_check() -> Check:
    """PlainFSDPStep with a placeholder (a short rank) = the unsharded --no-dp step on the real batch."""
    def run(step_cls, force_placeholder: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        loss = lambda fwd, b: ((fwd(input=b["x"]) - b["y"]) ** 2).sum(dim=1)  # noqa: E731
        eng = NonPrivateEngine(model, loss, make_clip_policy("flat", 1.0))
        spec = build_step_spec(engine=eng, clip=eng.clip, sigma=None, rng=None, sampler=None,
                               optimizer=torch.optim.SGD(list(eng.params.values()), lr=0.5))
        spec.sampler = type("Q", (), {"q": 0.5})()
        g = torch.Generator().manual_seed(1)
        real = {"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, 3, generator=g)}
        dummy = {"x": torch.randn(1, 4, generator=g) * 5, "y": torch.zeros(1, 3)}

        ledger = PrivacyLedger()
        if step_cls is DPStep:
            step = DPStep(spec, ledger, 8)
        else:
            step = step_cls(spec, ledger, 8, World(0, 1), lambda: dummy)
            if force_placeholder:
                step._count = lambda n: n + 1  # the world's most micro-batches: one more than this rank's
        step.run(0, [real])
        return torch.cat([p.detach().flatten() for p in model.parameters()]), len(ledger.entries)

    ref, _ = run(DPStep, False)
    got, events = run(fsdp_plain.PlainFSDPStep, True)
    diff = float((got - ref).abs().max())
    ok = diff <= 1e-6 and events == 0
    return Check("fsdp --no-dp step: a placeholder micro-batch adds nothing", ok,
                 f"max |Δw| against the unsharded --no-dp step {diff:.2e}, {events} ledger events"
                 + ("" if ok else ": the placeholder's gradient entered the update"), {"max_diff": diff})


def fsdp_trl_checks(planted: Optional[str] = None) -> list[Check]:
    """The checks of the module docstring; ``planted``: one of :data:`PLANTED` (only the check it targets
    runs; it must then fail)."""
    runs = {"dpo": planted in (None, "dpo_fsdp_args_kept"),
            "qlora": planted in (None, "qlora_fsdp_env_kept"),
            "plain": planted in (None, "fsdp_plain_dummy_counted")}
    out: list[Check] = []
    with planted_bug(planted), tempfile.TemporaryDirectory() as tmp:
        if runs["dpo"]:
            out += _dpo_checks(f"{tmp}/dpo")
        if runs["qlora"]:
            if importlib.util.find_spec("bitsandbytes") is None:
                if planted is not None:
                    raise ValueError(f"planted bug {planted!r} needs bitsandbytes, which this install lacks")
            else:
                out += _qlora_checks(tmp)
        if runs["plain"]:
            out.append(_plain_check())
    return out
