"""Audit checks that walk :class:`~dpft.integrations.trl.trainer.DPSFTTrainer`'s step (issue 26, item 2).

Each check builds a tiny random Llama and a word-level tokenizer with a ChatML template
in-process, runs one logical step of ``DPSFTTrainer`` with ``σ = 0``, ``q = 1`` (every row
sampled) and plain SGD at learning rate 1 (TRL's dataset preparation, collator and default
gradient checkpointing included), and reads the released clipped sum back from the parameters:
``S = −Δθ · qN``. Then (add/remove-one conversation, Abadi et al. 2016, Alg. 1):

* **leave-one-out** — ``max_i ‖S(D) − S(D∖i)‖ ≤ C(1 + tol)`` over prompt/completion rows with
  completion-only loss (a long completion, a one-token one);
* **LoRA via peft_config** — one row: ``‖S‖ ≤ C`` over every parameter that moved, and only
  adapter parameters moved (a frozen base weight with a raw gradient, or an adapter outside the
  engine, fails it);
* **packing** — ``SFTConfig(packing=True)``: refused, or one clipped example per sampled
  conversation (a packed row clips several conversations as one, and removing one reshuffles
  the packs).

* **DP-DPO leave-one-pair-out** — ``DPDPOTrainer``: ``max_i ‖S(D) − S(D∖i)‖ ≤ C`` over
  preference pairs (the chosen and the rejected row of a pair clipped as one group).

Planted bugs (undone afterwards): ``sft_packing_accepted`` switches the packing guards off
(``check_sft_config``, ``DPSFTTrainer._check_prepared`` and ``DPTrainer``'s per-batch
``check_unpacked_batch``): the packing check fails; ``dpo_pair_split`` gives each row of a pair
its own clipping group (a pair then contributes up to 2C) and switches off the engine's layout
probe (which refuses a loss shared across groups, and so catches this bug on its own): the
leave-one-pair-out check fails.

Importing this module needs ``trl`` (the suite skips it, with a note, when trl is absent).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import tempfile
import textwrap
import time
import warnings
from typing import Iterator, Optional

import torch

import trl  # noqa: F401 - this module's checks need TRL; an ImportError skips them in the suite

from dpft.audit.checks_api import C, TOL, _loo_and_noise, _no_dropout, _released_sum
from dpft.audit.whitebox import Check
from dpft.api import PackedBatchError
from dpft.audit.planted import planting
from dpft.grads import bookkeeping
from dpft.grads.groups import GROUP_KEY

PLANTED = ("sft_packing_accepted", "dpo_pair_split")

_WORDS = ("my router phone is slow will not turn on restart it charge the and then try again thanks what if "
          "that does help bring to a shop you are support sorry hear").split()
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a long completion (a large gradient), a one-token one, a plain one
_PAIRS = [("my phone will not turn on", " charge it then try again and then try again and then bring it to a shop"),
          ("thanks", " sorry"), ("what if that does not help", " bring it to a shop")]


@contextlib.contextmanager
def planted_bug(name: Optional[str]) -> Iterator[None]:
    """Switch the packing guards off for the duration (``None``: nothing planted).

    Raises:
        ValueError: an unknown name."""
    with planting(name, PLANTED) as p:
        from dpft.integrations.hf import data as hf_data
        from dpft.integrations.trl import trainer as dtrl

        noop = lambda *a, **k: None  # noqa: E731
        if name == "sft_packing_accepted":
            p.set(dtrl, "check_sft_config", noop)
            p.set(dtrl.DPSFTTrainer, "_check_prepared", noop)
            p.set(hf_data, "check_unpacked_batch", noop)
        elif name == "dpo_pair_split":
            # each of a pair's two rows its own clipping group: a pair contributes up to 2C

            orig = dtrl.pair_rows

            def split(batch):
                out = orig(batch)
                out[GROUP_KEY] = torch.arange(out[GROUP_KEY].shape[0])
                return out

            p.set(dtrl, "pair_rows", split)
            p.set(dtrl.DPDPOTrainer, "_micro_batches", _unchecked_micro_batches)
            # and the engine's layout probe, which refuses a loss shared across clipping groups

            p.set(bookkeeping, "check_example_support", noop)
        yield


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """``Trainer.train`` ends with accelerate's ``gc.collect()``, which scans the whole heap (most
    of a tiny step's time); objects frozen here are skipped. Speed only; a caller's freeze is left
    as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _unchecked_micro_batches(self, idx):
    """DPDPOTrainer._micro_batches without its two-rows-one-group check (the planted bug)."""
    from dpft.integrations.trl import trainer as dtrl

    if not len(idx):
        return
    rows = self._rows(idx)
    for k in range(0, len(rows), self.physical_batch_size):
        yield self._prepare_inputs(dtrl.pair_rows(self._dp_collator(rows[k:k + self.physical_batch_size])))


def tiny_tokenizer():
    """A word-level fast tokenizer with <pad>/<unk>/<s>/</s>, ChatML markers and template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(special + sorted(set(_WORDS)) + ["user", "assistant", "system"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = _CHATML
    return tok


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                        pad_token_id=0, bos_token_id=2, eos_token_id=3))


def _rows(n: int = len(_PAIRS)):
    import datasets

    return datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in _PAIRS[:n]])


def _sft_step(model, rows, tokenizer, *, c: float = C, sigma: float = 0.0, config: Optional[dict] = None,
              dp_kwargs: Optional[dict] = None, trainer_kwargs: Optional[dict] = None):
    """One logical step of DPSFTTrainer on a copy of ``model`` (dropout off) over every row of
    ``rows`` (q = 1, SGD lr 1, noise multiplier ``sigma``); ``(S, trainer)``, ``S`` over the
    parameters trainable after the step (the adapters with ``peft_config``)."""
    from trl import SFTConfig

    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPSFTTrainer

    model = copy.deepcopy(model)
    _no_dropout(model)
    n = len(rows)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = SFTConfig(**{"bf16": False, "max_length": 64, **(config or {}), "output_dir": out, "max_steps": 1,
                            "learning_rate": 1.0, "lr_scheduler_type": "constant", "optim": "sgd",
                            "weight_decay": 0.0, "per_device_train_batch_size": n, "report_to": [],
                            "use_cpu": not torch.cuda.is_available(), "save_strategy": "no",
                            "logging_strategy": "no", "disable_tqdm": True})
        dp = DPArguments(**{"target_delta": 1.0 / (10 * n), "expected_batch_size": n, **(dp_kwargs or {}),
                            "noise_multiplier": sigma, "max_grad_norm": c, "reproducible_seed": 0})
        trainer = DPSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, dp_args=dp,
                               **(trainer_kwargs or {}))
        before = {nm: p.detach().clone() for nm, p in trainer.model.named_parameters()}
        trainer.sampler.indices = lambda step: torch.arange(trainer.n)  # q = 1 exactly
        with _gc_frozen():
            trainer.train()
    # the step divides the noisy sum by the expected batch size qN
    return _released_sum(trainer.model, before, dp.expected_batch_size), trainer


def _dpo_step(model, rows, tokenizer, *, c: float = C):
    """One logical step of DPDPOTrainer (q = 1 over the pairs, σ = 0, SGD lr 1); ``S``."""
    from trl import DPOConfig

    from dpft.integrations.hf.trainer import DPArguments
    from dpft.integrations.trl.trainer import DPDPOTrainer

    model = copy.deepcopy(model)
    _no_dropout(model)
    n = len(rows)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(output_dir=out, bf16=False, max_steps=1, learning_rate=1.0, lr_scheduler_type="constant",
                         optim="sgd", weight_decay=0.0, per_device_train_batch_size=n, report_to=[],
                         use_cpu=not torch.cuda.is_available(), save_strategy="no", logging_strategy="no",
                         disable_tqdm=True, beta=0.5)
        dp = DPArguments(target_delta=1.0 / (10 * n), expected_batch_size=n, noise_multiplier=0.0, max_grad_norm=c,
                         reproducible_seed=0)
        trainer = DPDPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, dp_args=dp)
        before = {nm: p.detach().clone() for nm, p in trainer.model.named_parameters()}
        trainer.sampler.indices = lambda step: torch.arange(trainer.n)
        with _gc_frozen():
            trainer.train()
    return _released_sum(trainer.model, before, n)


def dpo_checks() -> list[Check]:
    """DPDPOTrainer leave-one-pair-out ≤ C (a pair's chosen and rejected rows clipped as one)."""
    import datasets

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    rows = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": " sorry"} for p, c in _PAIRS])
    t0 = time.perf_counter()
    full = _dpo_step(model, rows, tok)
    worst = 0.0
    for i in range(len(rows)):
        worst = max(worst, float((full - _dpo_step(model, rows.select([j for j in range(len(rows)) if j != i]),
                                                   tok)).norm()))
    ok = worst <= C * (1 + TOL)
    return [Check("trl: DPDPOTrainer leave-one-pair-out", ok,
                  f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {len(rows)} preference pairs, q = 1, σ = 0)"
                  + ("" if ok else " — one pair moves the release by more than C"),
                  {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)})]


def _refused(name: str, exc: Exception, t0: float) -> Check:
    return Check(name, True, f"refused ({type(exc).__name__}): {textwrap.shorten(str(exc), 200, placeholder='…')}",
                 {"refused": True, "seconds": round(time.perf_counter() - t0, 2)})


def sft_checks() -> list[Check]:
    """Leave-one-out (prompt/completion, completion-only loss), LoRA via ``peft_config``, packing."""
    from peft import LoraConfig

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    rows = _rows()
    out = []
    t0 = time.perf_counter()
    full, tr = _sft_step(model, rows, tok)
    worst = 0.0
    for i in range(len(rows)):
        worst = max(worst, float((full - _sft_step(model, rows.select([j for j in range(len(rows)) if j != i]),
                                                   tok)[0]).norm()))
    ok = worst <= C * (1 + TOL) and tr.completion_only_loss
    out.append(Check("trl: DPSFTTrainer leave-one-out (prompt/completion, completion-only loss)", ok,
                     f"max_i ‖S(D) − S(D∖i)‖ = {worst:.4g} vs C = {C:g} (N = {len(rows)} conversations, q = 1, σ = 0)"
                     + ("" if ok else " — one conversation moves the release by more than C"),
                     {"loo_over_C": worst / C, "seconds": round(time.perf_counter() - t0, 2)}))

    t0 = time.perf_counter()
    name = "trl: DPSFTTrainer LoRA via peft_config (one conversation)"
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    s, tr = _sft_step(model, rows.select([0]), tok, trainer_kwargs={"peft_config": lora})
    moved = [nm for nm, p in tr.model.named_parameters() if p.requires_grad]
    norm = float(s.norm())
    ok = norm <= C * (1 + TOL) and bool(moved) and all("lora_" in nm for nm in moved) \
        and set(tr.engine.params) == set(moved)
    out.append(Check(name, ok, f"‖S‖ = {norm:.4g} vs C = {C:g} over {len(moved)} trainable tensors (adapters: "
                     f"{all('lora_' in nm for nm in moved)}; all in the engine: {set(tr.engine.params) == set(moved)})"
                     + ("" if ok else " — an adapter or base weight got an unclipped gradient"),
                     {"norm_over_C": norm / C, "seconds": round(time.perf_counter() - t0, 2)}))

    out.append(packing_check(model, tok))
    return out


def packing_check(model=None, tok=None) -> Check:
    """``SFTConfig(packing=True)``: refused, or one clipped example per sampled conversation."""
    if tok is None:
        tok = tiny_tokenizer()
    if model is None:
        model = tiny_llama(len(tok))
    rows = _rows()
    t0 = time.perf_counter()
    name = "trl: DPSFTTrainer packing=True"
    try:
        # expected batch 1: a packed dataset has fewer rows than conversations
        _, tr = _sft_step(model, rows, tok, config={"packing": True}, dp_kwargs={"expected_batch_size": 1})
    except (PackedBatchError, ValueError) as exc:
        return _refused(name, exc, t0)
    clipped = int(tr.last_private_stats.get("batch_size", -1))
    ok = tr.n == len(rows) and clipped == len(rows)
    return Check(name, ok, f"N = {tr.n} rows and {clipped} clipped example(s) for {len(rows)} conversations"
                 + ("" if ok else " — several conversations clipped as one"),
                 {"refused": False, "clipped": clipped, "rows": tr.n, "conversations": len(rows),
                  "seconds": round(time.perf_counter() - t0, 2)})


def trl_checks(planted: Optional[str] = None) -> list[Check]:
    """Every DPSFTTrainer check, with ``planted`` (one of :data:`PLANTED`) re-opened.

    Returns:
        Four :class:`Check` rows; with nothing planted all pass, with a planted bug one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    with planted_bug(planted):
        return sft_checks() + dpo_checks()


def audit_dp_sft_trainer(model=None, train_dataset=None, processing_class=None, *, rows: int = 4,
                         max_grad_norm: float = 1.0, sft_config: Optional[dict] = None,
                         dp_kwargs: Optional[dict] = None, planted: Optional[str] = None,
                         **trainer_kwargs) -> list[Check]:
    """Audit ``DPSFTTrainer`` — on the tiny built-in model (no arguments: :func:`sft_checks`), or on
    **your own** model, rows (a ``datasets.Dataset`` in any TRL format) and tokenizer.

    With ``model``: one logical step on a copy of your model (dropout off), ``q = 1`` over the first
    ``rows`` rows, SGD at learning rate 1, your ``sft_config`` (``SFTConfig`` keywords, e.g.
    ``completion_only_loss``, ``assistant_only_loss``, ``max_length``) and ``trainer_kwargs``
    (``peft_config``, ``formatting_func``...). Checks leave-one-out ``≤ C`` and the noise std σC at
    σ = 1 (``checks_api._loo_and_noise``). Cost: ``rows + 2`` steps of your model.
    """
    with planted_bug(planted):
        if model is None:
            return sft_checks()
        if train_dataset is None or processing_class is None:
            raise ValueError("audit_dp_sft_trainer(model, train_dataset, processing_class): give your rows and "
                             "tokenizer too")
        n = min(rows, len(train_dataset))
        return _loo_and_noise("DPSFTTrainer", lambda idx, sigma: _sft_step(
            model, train_dataset.select(list(idx)), processing_class, c=max_grad_norm, sigma=sigma,
            config=sft_config, dp_kwargs=dp_kwargs, trainer_kwargs=trainer_kwargs)[0], n, max_grad_norm)


__all__ = ["trl_checks", "sft_checks", "dpo_checks", "packing_check", "audit_dp_sft_trainer", "planted_bug", "PLANTED"]
