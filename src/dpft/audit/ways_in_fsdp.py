"""The ways in asked for FSDP (``TrainingArguments.fsdp`` / accelerate's FSDP2 plugin) reach dpft's
FSDPStep unchanged: one check per property over the ways in's adapters (issue 38; issue 46 item 4).

White-box, in one process (no process group: the trainer runs the sharded step on the plain model;
integrations/hf/fsdp.py, integrations/trl/fsdp.py). Each :class:`FSDPWay` builds its trainer for two
logical steps; :func:`fsdp_way_checks` records what ``Trainer`` hands accelerate as it builds its
accelerator, the step class, its runs and ledger events, and every gradient autograd accumulates on a
trainable parameter, and checks, for every way in:

* **accelerate is never handed FSDP** — ``Trainer`` builds its accelerator with ``fsdp`` cleared,
  ``ACCELERATE_USE_FSDP`` off and no FSDP plugin in its state (accelerate's ``fsdp2_prepare_model``
  would shard the model with hooks that reduce-scatter unclipped gradients; TRL's ``DPOTrainer`` would
  prepare its reference and policy with them);
* **dpft's FSDPStep runs every step** — two runs, one ledger event each;
* **no unclipped gradient reaches a parameter** — autograd accumulates none (the engine's pass switches
  ``requires_grad`` off: only the noisy release writes ``.grad``);

and what a way in adds of its own: QLoRA (a 4-bit NF4 tiny Llama with LoRA, when bitsandbytes is
installed) trains the adapters alone; DPDPOTrainer (a LoRA policy, when trl is installed) clips whole pairs in every
micro-batch (the placeholder's usage probe included) and keeps TRL's reference adapter frozen and equal
to the initial policy.

Planted bugs (:data:`PLANTED`, each run on the way in it names; its "accelerate is never handed FSDP"
check must fail): ``hf_fsdp_args_kept`` / ``dpo_fsdp_args_kept`` (DPTrainer clears ``fsdp`` but hands
``Trainer`` accelerate's plugin arguments, ``fsdp_plugin_args``: accelerate builds its FSDP plugin) and
``hf_fsdp_env_kept`` / ``qlora_fsdp_env_kept`` (accelerate's FSDP environment left on while ``Trainer``
builds its accelerator).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional
from unittest import mock

import torch

from dpft.audit.ways_in_ddp import make_rows, pad_collate, tiny_model, trl_rows
from dpft.audit.planted import bug_planter, patched
from dpft.audit.whitebox import Check, Checks
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import trainer as hf
from dpft.models.quant import bnb_config
from dpft.placement import fsdp

__all__ = ["PLANTED", "FSDPWay", "WAYS", "fsdp_way_checks", "hf_fsdp_checks", "watch_trainer", "planted_bug",
           "COMMON", "DP"]

PLANTED = ("hf_fsdp_args_kept", "hf_fsdp_env_kept", "qlora_fsdp_env_kept", "dpo_fsdp_args_kept")
#: Trainer and DP settings of every way in's two logical steps.
COMMON = dict(max_steps=2, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
              per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no",
              logging_strategy="no", disable_tqdm=True)
DP = dict(target_delta=1e-3, noise_multiplier=1.0, max_grad_norm=0.5, expected_batch_size=4,
          max_physical_batch_size=2, reproducible_seed=5)
_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


def _plugin_args_kept(real):
    def keep_args(model, args, *a, **k):
        model, cleared, asked = real(model, args, *a, **k)
        # fsdp cleared, but accelerate's plugin arguments handed on: Trainer builds an FSDP plugin
        cleared.fsdp_plugin_args = getattr(args, "fsdp_plugin_args", None)
        return model, cleared, asked

    return keep_args


def _args_kept(p) -> None:
    p.set(hf, "shard_requested", _plugin_args_kept(hf.shard_requested))


def _env_kept(p) -> None:
    p.set(hf, "accelerate_fsdp_off", lambda requested: contextlib.nullcontext())


planted_bug = bug_planter(PLANTED, {"hf_fsdp_args_kept": _args_kept, "dpo_fsdp_args_kept": _args_kept,
                                    "hf_fsdp_env_kept": _env_kept, "qlora_fsdp_env_kept": _env_kept})


@contextlib.contextmanager
def watch_trainer(seen: dict, env: Optional[dict] = None):
    """Record what ``Trainer`` hands accelerate as it builds its accelerator, count FSDPStep runs; set
    ``env`` meanwhile. Everything restored afterwards (accelerate's global state reset)."""
    import transformers
    from accelerate.state import AcceleratorState

    def create(self, real=transformers.Trainer.create_accelerator_and_postprocess):
        seen["fsdp_args"] = bool(getattr(self.args, "fsdp", None)) or self.args.fsdp_plugin_args is not None
        seen["fsdp_env"] = str(os.environ.get("ACCELERATE_USE_FSDP", "")).lower() == "true"
        real(self)
        seen["fsdp_plugin"] = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    def run(self, *a, real=fsdp.FSDPStep.run, **k):
        seen["runs"] = seen.get("runs", 0) + 1
        return real(self, *a, **k)

    try:
        with patched((transformers.Trainer, "create_accelerator_and_postprocess", create), (fsdp.FSDPStep, "run", run)), \
                mock.patch.dict(os.environ, env or {}):
            yield seen
    finally:
        AcceleratorState._reset_state(True)


@dataclass(frozen=True)
class FSDPWay:
    """A way in asked for FSDP: ``build(tmp, seen)`` returns its trainer (recording in ``seen`` what its
    own checks read), built under ``env``; ``extra(seen, err)`` its own checks of the record; ``planted``
    the planted bugs that break it."""

    name: str
    build: Callable[[str, dict], Any]
    env: Optional[dict] = None
    extra: Optional[Callable[[dict, str], list[Check]]] = None
    planted: tuple = ()
    #: a package the way in needs (skipped, with no check, when it is not installed; refused when planted)
    needs: Optional[str] = None


def _train(tr, seen: dict) -> None:
    """Two logical steps of ``tr``, counting raw gradient accumulations and recording each clipped
    micro-batch's groups (the placeholder's usage probe included)."""
    from transformers import PrinterCallback

    tr.remove_callback(PrinterCallback)
    seen["raw_grads"], seen["groups"] = 0, []
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


def fsdp_way_checks(way: FSDPWay, tmp: str) -> list[Check]:
    """The three checks every way in asked for FSDP passes, and the way in's own."""
    seen: dict = {"error": None, "runs": 0}
    with warnings.catch_warnings(), watch_trainer(seen, way.env):
        warnings.simplefilter("ignore")
        try:
            _train(way.build(tmp, seen), seen)
        except Exception as exc:  # noqa: BLE001 - a planted bug may break Trainer; the record decides
            seen["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    s, err = seen, f"; {seen['error']}" if seen["error"] else ""
    built = "fsdp_args" in s
    handed = not built or s["fsdp_args"] or s["fsdp_env"] or s.get("fsdp_plugin", True)
    ok = s["error"] is None and s.get("step") == "FSDPStep" and s["runs"] == 2 == s.get("events")
    clean = s["error"] is None and s.get("raw_grads") == 0
    return [Check(f"fsdp {way.name}: accelerate is never handed FSDP", not handed,
                  "Trainer built its accelerator with fsdp cleared, ACCELERATE_USE_FSDP off, no FSDP plugin"
                  if not handed else f"stopped before Trainer built its accelerator{err}" if not built else
                  f"accelerate got FSDP (arguments: {s.get('fsdp_args')}, environment: {s.get('fsdp_env')}, plugin: "
                  f"{s.get('fsdp_plugin')}): its fsdp2_prepare_model would shard the model with hooks that "
                  f"reduce-scatter unclipped gradients{err}"),
            Check(f"fsdp {way.name}: dpft's FSDPStep runs every step", ok,
                  f"{s.get('step')}: {s['runs']} runs, {s.get('events')} ledger events{err}"),
            Check(f"fsdp {way.name}: no unclipped gradient reaches a parameter", clean,
                  "autograd accumulated no gradient on a trainable parameter (only the noisy release writes .grad)"
                  if clean else f"{s.get('raw_grads')} raw gradient accumulation(s){err}"),
            *(way.extra(s, err) if way.extra else [])]


def run_ways(ways: tuple, planted: Optional[str] = None) -> Checks:
    """:func:`fsdp_way_checks` of every way in of ``ways`` (with ``planted``, only the ways it breaks).

    Raises:
        ValueError: an unknown planted bug, or one whose way in needs a package this install lacks."""
    if planted is not None:
        ways = tuple(w for w in ways if planted in w.planted)
        if not ways:
            raise ValueError(f"unknown planted bug {planted!r}")
    out = Checks()
    with planted_bug(planted), tempfile.TemporaryDirectory() as tmp:
        for i, way in enumerate(ways):
            if way.needs and importlib.util.find_spec(way.needs) is None:
                if planted is not None:
                    raise ValueError(f"planted bug {planted!r} needs {way.needs}, which this install lacks")
                out.notes.append(f"fsdp: {way.name} needs {way.needs}, which is not in this install: its checks did "
                                 "not run (skipped, not passed)")
                continue
            out += fsdp_way_checks(way, f"{tmp}/{i}")
    return out


# --------------------------------------------------------------------------- the ways in


def _dp_trainer(fsdp_kw: dict):
    def build(tmp: str, seen: dict):
        from transformers import TrainingArguments

        return hf.DPTrainer(model=tiny_model(), args=TrainingArguments(output_dir=tmp, label_names=["labels"],
                                                                       **COMMON, **fsdp_kw),
                            train_dataset=make_rows(20), data_collator=pad_collate, dp_args=hf.DPArguments(**DP))

    return build


def _qlora(tmp: str, seen: dict):
    import datasets
    import peft
    import transformers

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

    base = transformers.AutoModelForCausalLM.from_pretrained(
        f"{tmp}/llama", quantization_config=bnb_config("nf4", torch.float32), device_map="cpu", dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                      init_lora_weights=False, target_modules=["q_proj", "v_proj"]))
    tr = hf.DPTrainer(model=model, args=transformers.TrainingArguments(output_dir=f"{tmp}/out", label_names=["labels"],
                                                                       **COMMON),
                      train_dataset=datasets.Dataset.from_list(rows), data_collator=collate, dp_args=hf.DPArguments(**DP))
    seen["engine_params"] = list(tr.engine.params)
    return tr


def _adapters_alone(s: dict, err: str) -> list[Check]:
    names = s.get("engine_params") or []
    ok = s["error"] is None and bool(names) and all("lora_" in n for n in names)
    return [Check("fsdp QLoRA DPTrainer (accelerate's FSDP2 plugin): the engine trains the adapters alone", ok,
                  f"{len(names)} engine parameters (all LoRA: {all('lora_' in n for n in names)}){err}")]


def _dpo(tmp: str, seen: dict):
    """DPDPOTrainer on a tiny Llama with a LoRA policy (TRL's reference adapter made before sharding)."""
    from peft import LoraConfig, get_peft_model
    from trl import DPOConfig

    from dpft.audit.ways_in_trl import tiny_llama, tiny_tokenizer  # deferred: needs trl
    from dpft.integrations.trl import trainer as dtrl  # deferred: needs trl

    tok = tiny_tokenizer()
    model = get_peft_model(tiny_llama(len(tok)), LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, lora_dropout=0.0,
                                                            init_lora_weights=False, target_modules=["q_proj", "v_proj"]))
    seen["policy"] = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    args = DPOConfig(output_dir=tmp, bf16=False, beta=0.5, max_length=64, dataset_num_proc=None, fsdp=True,
                     fsdp_config={"fsdp_version": 2}, **COMMON)
    tr = dtrl.DPDPOTrainer(model=model, args=args, train_dataset=trl_rows({"trainer": "dpo", "rows": 8}),
                           processing_class=tok, dp_args=hf.DPArguments(**DP))
    seen["engine_ref"], seen["model"] = [n for n in tr.engine.params if ".ref." in n], tr.model
    return tr


def _pairs_and_reference(s: dict, err: str) -> list[Check]:
    groups = s.get("groups") or []
    paired = s["error"] is None and bool(groups) and all(
        g is not None and g == [i // 2 for i in range(len(g))] for g in groups)
    named = dict(s["model"].named_parameters()) if "model" in s else {}
    ref = {n: p.detach() for n, p in named.items() if ".ref." in n}
    frozen = bool(ref) and not any(p.requires_grad for p in ref.values())
    initial = bool(ref) and all(torch.equal(ref[n.replace(".default.", ".ref.")], w) for n, w in s["policy"].items())
    ok = s["error"] is None and not s.get("engine_ref") and frozen and initial
    return [Check("fsdp DPDPOTrainer: each clipping group is one pair (placeholder included)", paired,
                  f"{len(groups)} clipped micro-batches, every one pairs its rows [0, 0, 1, 1, ...]" if paired else
                  f"groups seen: {groups[:4]}{err}"),
            Check("fsdp DPDPOTrainer: the reference adapter is frozen and is the initial policy", ok,
                  "the 'ref' adapter is outside the engine, frozen and equal to the policy's adapter before training"
                  if ok else f"reference adapter in the engine: {s.get('engine_ref', [])[:2]}, frozen: {frozen}, "
                  f"= initial policy: {initial}{err}")]


#: The ways in asked for FSDP: DPTrainer through its arguments and through accelerate's plugin, QLoRA, DPO.
WAYS = (FSDPWay("DPTrainer (TrainingArguments.fsdp)", _dp_trainer({"fsdp": True, "fsdp_config": {
                    "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}}), planted=("hf_fsdp_args_kept",)),
        FSDPWay("DPTrainer (accelerate's FSDP2 plugin)", _dp_trainer({}),
                env={**_ENV, "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer"}, planted=("hf_fsdp_env_kept",)),
        FSDPWay("QLoRA DPTrainer (accelerate's FSDP2 plugin)", _qlora,
                env={**_ENV, "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}, extra=_adapters_alone,
                planted=("qlora_fsdp_env_kept",), needs="bitsandbytes"),
        FSDPWay("DPDPOTrainer", _dpo, extra=_pairs_and_reference, planted=("dpo_fsdp_args_kept",), needs="trl"))


def hf_fsdp_checks(planted: Optional[str] = None) -> Checks:
    """Every way in of :data:`WAYS` under FSDP (``audit/suite.py`` ``OPTIONAL_CHECKS``; a way in whose package
    is not installed is left out, with a note); ``planted``: one of :data:`PLANTED` (only the way in it breaks runs; its
    checks must then fail)."""
    return run_ways(WAYS, planted)
