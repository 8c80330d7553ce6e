"""The TRL ways in (``DPSFTTrainer``, ``DPDPOTrainer``, row and user level) as adapters of the checks
every way in passes (audit/ways_in.py; issue 26 item 2, issue 38, issue 46 item 4).

Each adapter builds a tiny random Llama and a word-level tokenizer with a ChatML template in-process
and runs one logical step (``q = 1``, SGD at learning rate 1; TRL's dataset preparation, collator and
default gradient checkpointing included). The properties are audit/ways_in.py's, over TRL's units:

* **DPSFTTrainer reaches the session unchanged** (audit/ways_in_session.py ``session_check``: one session plan with
  the given settings, step/plan.py's N, q, T, σ for them, as every way in's);
* **DPSFTTrainer leave-one-conversation-out** (prompt/completion rows, completion-only loss on: a long
  completion, a one-token one);
* **DPSFTTrainer LoRA via peft_config** — one row: ``‖S‖ ≤ C`` over every parameter that moved, only
  adapter parameters moved, and all of them are the engine's;
* **DPSFTTrainer packing** — ``SFTConfig(packing=True)``: refused, or one clipped example per sampled
  conversation;
* **DPDPOTrainer leave-one-pair-out** (the chosen and the rejected row of a pair clipped as one group);
* **DPDPOTrainer at user level** (``DPArguments(user_column=...)``, integrations/trl/user.py; a user's
  pairs one unit, Chua et al. 2024): leave-one-user-out, and for the user with two pairs whose summed
  gradient exceeds C, ``S(D) − S(D∖u) = C·g_u/‖g_u‖``; and **the ledger counts users** (N = U users,
  ``q`` = expected users / U, one ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` per step).

Planted bugs (undone afterwards): ``sft_packing_accepted`` (the packing guards off: ``check_sft_config``,
``DPSFTTrainer._check_prepared``, the per-batch ``check_unpacked_batch``); ``dpo_pair_split`` (each row of
a pair its own clipping group, and the engine's layout probe off: a pair contributes up to 2C);
``dpo_user_pair_groups`` (the user sampler's clipping groups are the pairs); ``dpo_user_ledger_counts_pairs``
(the plan built over the pairs: ``N`` = pairs, ``q`` = expected users / pairs, an ε too small).

Importing this module needs ``trl`` (the suite skips it, with a note, when trl is absent).
"""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from typing import Optional

import datasets
import dp_accounting as dpa
import torch
from trl import DPOConfig, SFTConfig  # these checks need TRL; an ImportError skips them in the suite

from dpft.api import PackedBatchError
from dpft.audit.planted import bug_planter
from dpft.audit.ways_in import (C, WayIn, gc_frozen, hf_one_step, leave_one_out, one_clipped_per_row,
                                one_step_args, one_unit_bounded, yours)
from dpft.audit.ways_in_session import SESSION_SETTINGS, session_check
from dpft.audit.whitebox import Check
from dpft.grads import bookkeeping
from dpft.grads.groups import GROUP_KEY
from dpft.integrations.hf import data as hf_data
from dpft.integrations.hf.trainer import DPArguments
from dpft.integrations.trl import trainer as dtrl
from dpft.session import core as session_core
from dpft.step.sample import UserPoissonSampler

TRL_PLANTED = ("sft_packing_accepted", "dpo_pair_split")
DPO_USER_PLANTED = ("dpo_user_pair_groups", "dpo_user_ledger_counts_pairs")
PLANTED = TRL_PLANTED + DPO_USER_PLANTED

WORDS = ("my router phone is slow will not turn on restart it charge the and then try again thanks what if "
         "that does help bring to a shop you are support sorry hear").split()
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a long completion (a large gradient), a one-token one, a plain one
_PAIRS = [("my phone will not turn on", " charge it then try again and then try again and then bring it to a shop"),
          ("thanks", " sorry"), ("what if that does not help", " bring it to a shop")]
# (prompt, chosen, user): rows grouped by user; "b" has two pairs (the user the checks look at)
_USER_PAIRS = [("my phone will not turn on", " charge it then try again", "a"),
               ("thanks", " you are support", "a"),
               ("what if that does not help", " bring it to a shop", "b"),
               ("my router is slow", " restart it and then try again", "b"),
               ("you are slow", " sorry to hear that", "c")]
_TWO_PAIRS = "b"


def _unchecked_micro_batches(self, idx):
    """DPDPOTrainer._micro_batches without its two-rows-one-group check (the planted bug)."""
    if not len(idx):
        return
    rows = self._rows(idx)
    for k in range(0, len(rows), self.physical_batch_size):
        yield self._prepare_inputs(dtrl.pair_rows(self._dp_collator(rows[k:k + self.physical_batch_size])))


def _split_pairs(orig):
    def split(batch):
        out = orig(batch)
        out[GROUP_KEY] = torch.arange(out[GROUP_KEY].shape[0])
        return out

    return split


def _counts_pairs(real):
    def plan_over_pairs(**kw):
        # the bug: N and q over the rows (pairs) while the sampler takes whole users
        rows = len(kw["rows"])
        if kw.get("sampler") is not None:
            kw["sampler"].q = kw["expected_batch_size"] / rows
        return real(**{**kw, "n": rows})

    return plan_over_pairs


_noop = lambda *a, **k: None  # noqa: E731
planted_bug = bug_planter(PLANTED, {
    "sft_packing_accepted": lambda p: (p.set(dtrl, "check_sft_config", _noop),
                                       p.set(dtrl.DPSFTTrainer, "_check_prepared", _noop),
                                       p.set(hf_data, "check_unpacked_batch", _noop)),
    # each of a pair's two rows its own clipping group (a pair contributes up to 2C), and the engine's layout
    # probe off (it refuses a loss shared across clipping groups, and so catches this bug on its own)
    "dpo_pair_split": lambda p: (p.set(dtrl, "pair_rows", _split_pairs(dtrl.pair_rows)),
                                 p.set(dtrl.DPDPOTrainer, "_micro_batches", _unchecked_micro_batches),
                                 p.set(bookkeeping, "check_example_support", _noop)),
    "dpo_user_pair_groups": lambda p: p.set(UserPoissonSampler, "groups",
                                            lambda self, micro: torch.arange(len(micro))),
    # the session builds every way in's plan (dpft/session/core.py): the bug planted there reaches DPDPOTrainer
    "dpo_user_ledger_counts_pairs": lambda p: p.set(session_core, "build_privacy_plan",
                                                    _counts_pairs(session_core.build_privacy_plan)),
})


# --------------------------------------------------------------------------- tiny parts


def tiny_tokenizer():
    """A word-level fast tokenizer with <pad>/<unk>/<s>/</s>, ChatML markers and template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(special + sorted(set(WORDS)) + ["user", "assistant", "system"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = _CHATML
    return tok


def tiny_llama(vocab: int):
    """A tiny random Llama (1 layer, hidden 16) for ``vocab`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                        pad_token_id=0, bos_token_id=2, eos_token_id=3))


def _sft_rows(n: int = len(_PAIRS)):
    return datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in _PAIRS[:n]])


# --------------------------------------------------------------------------- the adapters


def sft_step(model, rows, tokenizer, *, c: float = C, sigma: float = 0.0, config: Optional[dict] = None,
             dp_kwargs: Optional[dict] = None, trainer_kwargs: Optional[dict] = None):
    """One logical step of DPSFTTrainer on a copy of ``model`` (dropout off) over every row of
    ``rows`` (q = 1, SGD lr 1, noise multiplier ``sigma``); ``(S, trainer)``, ``S`` over the
    parameters trainable after the step (the adapters with ``peft_config``)."""
    n = len(rows)
    dp = DPArguments(**{"target_delta": 1.0 / (10 * n), "expected_batch_size": n, **(dp_kwargs or {}),
                        "noise_multiplier": sigma, "max_grad_norm": c, "reproducible_seed": 0})
    # the step divides the noisy sum by the expected batch size qN
    return hf_one_step(lambda m, out: dtrl.DPSFTTrainer(
        model=m, args=SFTConfig(**{"bf16": False, "max_length": 64, **(config or {}), **one_step_args(out, n)}),
        train_dataset=rows, processing_class=tokenizer, dp_args=dp, **(trainer_kwargs or {})),
        model, dp.expected_batch_size, every_row=True)


def dpo_step(model, rows, tokenizer, *, c: float = C, sigma: float = 0.0, user_column: Optional[str] = None):
    """One logical step of DPDPOTrainer on a copy of ``model`` (q = 1 over the pairs, or with
    ``user_column`` over the users with all their ≤ 2 pairs, group clipping; SGD lr 1); ``(S, trainer)``."""
    units = len(set(rows[user_column])) if user_column else len(rows)
    user = {"user_column": user_column, "max_rows_per_user": 2, "user_clipping": "group"} if user_column else {}
    dp = DPArguments(target_delta=1.0 / (10 * len(rows)), expected_batch_size=units, noise_multiplier=sigma,
                     max_grad_norm=c, reproducible_seed=0, **user)
    return hf_one_step(lambda m, out: dtrl.DPDPOTrainer(
        model=m, args=DPOConfig(**one_step_args(out, len(rows)), bf16=False, beta=0.5,
                                **({"gradient_checkpointing": False} if user_column else {})),
        train_dataset=rows, processing_class=tokenizer, dp_args=dp), model, units, every_row=not user_column)


def _completion_only(tr) -> Optional[str]:
    return None if tr.completion_only_loss else "completion-only loss is off"


def sft_way(model, tok, rows=None, *, c: float = C, **sft_kwargs) -> WayIn:
    """DPSFTTrainer as a :class:`WayIn` (the built-in prompt/completion rows, or your own)."""
    own = rows is not None
    rows = _sft_rows() if rows is None else rows
    return WayIn("DPSFTTrainer", list(range(len(rows))), lambda keep, sigma, cc: sft_step(
        model, rows.select(list(keep)), tok, c=cc, sigma=sigma, **sft_kwargs), unit="example" if own else "conversation",
        c=c, what="your model and rows" if own else "prompt/completion, completion-only loss",
        check_run=None if own else _completion_only)


def dpo_way(model, tok) -> WayIn:
    """DPDPOTrainer at row level: a preference pair is one unit."""
    rows = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": " sorry"} for p, c in _PAIRS])
    return WayIn("DPDPOTrainer", list(range(len(rows))),
                 lambda keep, sigma, cc: dpo_step(model, rows.select(list(keep)), tok, c=cc, sigma=sigma),
                 unit="pair", what="preference pairs")


def _user_rows(keep=None):
    return datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": " sorry", "user": u}
                                       for p, c, u in _USER_PAIRS if keep is None or u in keep])


def dpo_user_way(model, tok) -> WayIn:
    """DPDPOTrainer at user level: a user's pairs are one unit."""
    users = sorted({u for *_, u in _USER_PAIRS})
    return WayIn("DPDPOTrainer", users, lambda keep, sigma, cc: dpo_step(
        model, _user_rows(set(keep)), tok, c=cc, sigma=sigma, user_column="user"), unit="user",
        what=f"{len(_USER_PAIRS)} pairs")


# --------------------------------------------------------------------------- the checks


def packing_check(model=None, tok=None) -> Check:
    """``SFTConfig(packing=True)``: refused, or one clipped example per sampled conversation."""
    tok = tok or tiny_tokenizer()
    model = model if model is not None else tiny_llama(len(tok))
    rows = _sft_rows()
    # expected batch 1: a packed dataset has fewer rows than conversations
    return one_clipped_per_row("trl: DPSFTTrainer packing=True", lambda: sft_step(
        model, rows, tok, config={"packing": True}, dp_kwargs={"expected_batch_size": 1}), len(rows), "conversation",
        (PackedBatchError, ValueError))


def _adapters_alone(tr) -> Optional[str]:
    moved = [nm for nm, p in tr.model.named_parameters() if p.requires_grad]
    if moved and all("lora_" in nm for nm in moved) and set(tr.engine.params) == set(moved):
        return None
    return (f"{len(moved)} trainable tensors (adapters: {all('lora_' in nm for nm in moved)}; all in the engine: "
            f"{set(tr.engine.params) == set(moved)}) — an adapter or base weight got an unclipped gradient")


def sft_checks() -> list[Check]:
    """Leave-one-conversation-out, LoRA via ``peft_config``, packing."""
    from peft import LoraConfig

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    return [leave_one_out(sft_way(model, tok), "trl"),
            one_unit_bounded("trl: DPSFTTrainer LoRA via peft_config (one conversation)", lambda: sft_step(
                model, _sft_rows(1), tok, trainer_kwargs={"peft_config": lora}), (), "N = 1, LoRA adapters",
                check_run=_adapters_alone),
            packing_check(model, tok)]


def dpo_checks() -> list[Check]:
    """DPDPOTrainer leave-one-pair-out ≤ C (a pair's chosen and rejected rows clipped as one)."""
    tok = tiny_tokenizer()
    return [leave_one_out(dpo_way(tiny_llama(len(tok)), tok), "trl")]


def _session_sft():
    """DPSFTTrainer built with :data:`~dpft.audit.ways_in_session.SESSION_SETTINGS` (its DP step)."""
    st = SESSION_SETTINGS
    tok = tiny_tokenizer()
    rows = datasets.Dataset.from_list([{"prompt": _PAIRS[i % 3][0], "completion": _PAIRS[i % 3][1]}
                                       for i in range(st["n"])])
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = SFTConfig(**{**one_step_args(out, 8), "max_steps": -1, "num_train_epochs": st["epochs"]}, bf16=False,
                         max_length=64)
        dp = DPArguments(target_epsilon=st["epsilon"], target_delta=st["delta"], expected_batch_size=st["batch"],
                         max_grad_norm=st["c"])
        return dtrl.DPSFTTrainer(model=tiny_llama(len(tok)), args=args, train_dataset=rows, processing_class=tok,
                                 dp_args=dp).dp_step


def trl_checks(planted: Optional[str] = None) -> list[Check]:
    """Every DPSFTTrainer / DPDPOTrainer (row level) check, with ``planted`` (one of :data:`TRL_PLANTED`):
    DPSFTTrainer reaches the session unchanged (its plan step/plan.py's, as every way in's), then the four
    checks of the module docstring.

    Returns:
        Five :class:`Check` rows; with nothing planted all pass, with a planted bug one fails.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in TRL_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(TRL_PLANTED)}")
    with planted_bug(planted):
        return session_check((("DPSFTTrainer", _session_sft),)) + sft_checks() + dpo_checks()


def ledger_check(model=None, tok=None) -> Check:
    """User-level DPDPOTrainer: N = U users, q = expected users / U, one PoissonSampledDpEvent(q, Gaussian(σ))."""
    t0 = time.perf_counter()
    tok = tok or tiny_tokenizer()
    model = model if model is not None else tiny_llama(len(tok))
    rows = _user_rows()
    u, eb = len(set(rows["user"])), 2
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(), gc_frozen():
        warnings.simplefilter("ignore")
        dp = DPArguments(target_delta=1.0 / (10 * len(rows)), expected_batch_size=eb, noise_multiplier=1.0,
                         max_grad_norm=C, reproducible_seed=0, user_column="user", max_rows_per_user=2,
                         user_clipping="group")
        tr = dtrl.DPDPOTrainer(model=copy.deepcopy(model), args=DPOConfig(
            **one_step_args(out, len(rows)), bf16=False, beta=0.5, gradient_checkpointing=False), train_dataset=rows,
            processing_class=tok, dp_args=dp)
        tr.train()
    want = [("train", 1, dpa.PoissonSampledDpEvent(eb / u, dpa.GaussianDpEvent(tr.sigma)))]
    got = [(e.phase, e.count, e.event) for e in tr.ledger.entries]
    shown = [(p, n, type(e).__name__, getattr(e, "sampling_probability", None)) for p, n, e in got]
    ok = tr.n == u and tr.plan.n == u and abs(tr.q - eb / u) <= 1e-12 and got == want
    return Check("trl user level: DPDPOTrainer's ledger counts users", ok,
                 f"N = {tr.n} (plan {tr.plan.n}) for U = {u} users in {len(rows)} pairs, q = {tr.q:.4g} vs "
                 f"{eb}/{u}; ledger {shown}" + ("" if ok else " — the ledger does not count users"),
                 {"n": tr.n, "q": tr.q, "seconds": round(time.perf_counter() - t0, 2)})


def dpo_user_checks(planted: Optional[str] = None) -> list[Check]:
    """DPDPOTrainer at user level: leave-one-user-out (the two-pair user clipped as one group) and the
    ledger counting users; with ``planted`` (one of :data:`DPO_USER_PLANTED`) only its target check runs.

    Returns:
        Two :class:`Check` rows with nothing planted (both pass), one with a planted bug.

    Raises:
        ValueError: an unknown planted bug.
    """
    if planted is not None and planted not in DPO_USER_PLANTED:
        raise ValueError(f"unknown planted bug {planted!r}; known: {', '.join(DPO_USER_PLANTED)}")
    with planted_bug(planted):
        tok = tiny_tokenizer()
        model = tiny_llama(len(tok))
        out = []
        if planted in (None, "dpo_user_pair_groups"):
            out.append(leave_one_out(dpo_user_way(model, tok), "trl user level", exact=_TWO_PAIRS))
        if planted in (None, "dpo_user_ledger_counts_pairs"):
            out.append(ledger_check(model, tok))
        return out


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
    σ = 1 (audit/ways_in.py). Cost: ``rows + 2`` steps of your model.
    """
    with planted_bug(planted):
        if model is None:
            return sft_checks()
        if train_dataset is None or processing_class is None:
            raise ValueError("audit_dp_sft_trainer(model, train_dataset, processing_class): give your rows and "
                             "tokenizer too")
        return yours(sft_way(model, processing_class, train_dataset.select(range(min(rows, len(train_dataset)))),
                             c=max_grad_norm, config=sft_config, dp_kwargs=dp_kwargs, trainer_kwargs=trainer_kwargs))


__all__ = ["trl_checks", "dpo_user_checks", "sft_checks", "dpo_checks", "packing_check", "ledger_check",
           "audit_dp_sft_trainer", "sft_way", "dpo_way", "dpo_user_way", "sft_step", "dpo_step", "tiny_llama",
           "tiny_tokenizer", "WORDS", "planted_bug", "PLANTED", "TRL_PLANTED", "DPO_USER_PLANTED"]
