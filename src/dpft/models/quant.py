"""QLoRA from a recipe (issue 38 item 2): ``model.quantization: nf4 | int8`` loads a causal LM's
frozen base through transformers' ``BitsAndBytesConfig`` and trains peft LoRA adapters on it
(``trainable.mode: lora``, applied by ``models/load.py select_trainable`` as for any model).

- ``nf4``: 4-bit NormalFloat weights with double quantization (Dettmers et al. 2023, "QLoRA",
  arXiv 2305.14314, Section 3), computed in ``perf.dtype`` (``bnb_4bit_compute_dtype``). The packed
  weights are stored as ``bnb_4bit_quant_storage`` = the compute dtype, so that FSDP2 can shard
  them like any other parameter of that dtype (the FSDP-QLoRA layout of Answer.AI / Hugging Face).
- ``int8``: LLM.int8 weights with ``llm_int8_threshold = 0``: no outlier decomposition. With a
  threshold above 0, bitsandbytes picks its fp16 outlier columns over every row of the
  micro-batch, so one example's activations change another's output; the book-keeping engine
  refuses such a layer (``grads/lora.py check_adapter_layers``, the one place that check lives),
  and a recipe cannot ask for it (there is no threshold key).

Checked before anything is loaded (:func:`check_recipe`): bitsandbytes installed (else the
extra to install is named), ``trainable.mode: lora`` (a quantized weight cannot be trained and no
per-example rule covers it), a causal-LM task, no bottleneck adapters.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any, Optional

import torch

from dpft.models.arch import ModelError

__all__ = ["QUANTIZATIONS", "QuantizationError", "check_recipe", "bnb_config", "compute_dtype", "quant_device",
           "load_quantized_causal_lm", "unquantizable_layers", "is_quantized"]

#: ``model.quantization`` values.
QUANTIZATIONS = ("nf4", "int8")
#: The extra that installs bitsandbytes (pyproject.toml ``[project.optional-dependencies] quant``).
EXTRA = "pip install 'dpft[quant]'"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CAUSAL_TASKS = ("text", "instruct")


class QuantizationError(ModelError):
    """A recipe's ``model.quantization`` cannot run; the message names the fix."""


def check_recipe(recipe: Any) -> None:
    """Refuse, before any data or model is loaded, a quantized recipe that cannot run.

    Raises:
        QuantizationError: bitsandbytes missing (naming ``dpft[quant]``); ``trainable.mode`` other
            than ``lora`` (the quantized base is frozen: only adapters train); a task other than
            ``text`` / ``instruct`` (QLoRA is verified on causal LMs only); ``model.adapter`` set;
            ``int8`` with ``perf.sharding: fsdp`` (the gathered weight loses bitsandbytes' row statistics);
            ``output.merge_lora`` (merging re-quantizes: not the trained model).
    """
    q = getattr(recipe.model, "quantization", None)
    if q is None:
        return
    why = []
    if recipe.trainable.mode != "lora":
        why.append(f"trainable.mode {recipe.trainable.mode!r}: a {q} base's weights are frozen integer codes that "
                   "cannot be trained (and no per-example rule covers them); only LoRA adapters over them train "
                   "(set trainable.mode: lora)")
    if recipe.task.name not in _CAUSAL_TASKS:
        why.append(f"task {recipe.task.name!r}: QLoRA is verified on causal LMs only (task text or instruct); "
                   "drop model.quantization")
    if q == "int8" and getattr(recipe.perf, "sharding", "ddp") == "fsdp":
        # FSDP2 all-gathers a plain tensor: bitsandbytes' Int8Params keeps its row statistics (CB, SCB)
        # as attributes of the parameter object, so Linear8bitLt's forward fails on the gathered weight
        # ("'Parameter' object has no attribute 'CB'", bitsandbytes 0.50.2). NF4 keeps its quant state
        # on the module and rebuilds the parameter (bitsandbytes fix_4bit_weight_quant_state_from_module).
        why.append("int8 with perf.sharding fsdp: LLM.int8 weights lose their row statistics in FSDP2's "
                   "all-gather; use model.quantization: nf4 (its packed weights shard), or perf.sharding: ddp")
    if getattr(getattr(recipe, "output", None), "merge_lora", False):
        # peft merges into a bitsandbytes layer by dequantizing, adding B·A and quantizing again: the
        # merged weights are not the trained model (rounding), and they would be released as if they were
        why.append("output.merge_lora: merging into a quantized base re-quantizes the sum (not the trained model); "
                   "keep the adapter (saved by default) and merge it onto the full-precision base yourself")
    if getattr(recipe.model, "adapter", None) is not None:
        why.append("model.adapter: bottleneck adapters are not verified over a quantized base; drop one of them")
    if why:
        raise QuantizationError(f"model.quantization {q} cannot run this recipe: " + "; ".join(why))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationError(f"model.quantization {q} needs bitsandbytes, which is not installed: {EXTRA} "
                                "(or drop model.quantization to train LoRA over the full-precision base)")


def compute_dtype(perf_dtype: str) -> torch.dtype:
    """The dtype the quantized layers compute in: ``perf.dtype`` (fp32 · bf16 · fp16)."""
    return _DTYPES[perf_dtype]


def bnb_config(quantization: str, dtype: torch.dtype = torch.float32, skip: Optional[list[str]] = None):
    """transformers' ``BitsAndBytesConfig`` for ``quantization`` (:data:`QUANTIZATIONS`).

    ``nf4``: NF4, double quantization, compute and storage dtype ``dtype`` (storage = compute so
    that FSDP2 shards the packed weights with the rest). ``int8``: ``llm_int8_threshold = 0`` (see
    the module docstring), ``lm_head`` kept in full precision (transformers' default). ``skip``:
    ``llm_int8_skip_modules`` (used for 4-bit too), the layers left in full precision
    (:func:`unquantizable_layers`; None: transformers' default, the output head).
    """
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype,
                                  llm_int8_skip_modules=skip)
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0, llm_int8_skip_modules=skip)
    raise QuantizationError(f"model.quantization must be one of {', '.join(QUANTIZATIONS)} (got {quantization!r})")


def quant_device(perf_device: str = "auto") -> torch.device:
    """Where bitsandbytes quantizes the weights while loading: the run's device (``perf.device``;
    under torchrun ``auto``/``cuda`` mean ``cuda:LOCAL_RANK``). Quantizing on the CPU and moving the
    codes later would keep the CPU backend's packed layout on a GPU."""
    s = (perf_device or "auto").strip().lower()
    if s == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if s in ("auto", "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
    return torch.device(s)


#: bitsandbytes' 4-bit CPU kernel (``_convert_weight_packed_for_cpu``, taken in eval mode without
#: gradients: dev evaluation, generation) packs the weight in blocks of 32 output rows and reads the
#: absmax of each 64-wide block of a row: out_features % 32 and in_features % 64 must be 0, else it
#: fails with "N must be divisible by block_n" (bitsandbytes 0.49) or a reshape error.
CPU_NF4_BLOCK_N, CPU_NF4_BLOCK_K = 32, 64


def unquantizable_layers(path: str, quantization: str, device: torch.device) -> tuple[list[str], list[str]]:
    """``(skip, unfit)``: the ``llm_int8_skip_modules`` that load ``path`` with every layer the
    kernel of ``device`` can take (transformers' default skips, the output head, plus ``unfit``),
    and ``unfit``, the Linear layers (full names) whose shapes the kernel cannot take: on the
    CPU, for ``nf4``, out_features not a multiple of :data:`CPU_NF4_BLOCK_N` or in_features not a
    multiple of :data:`CPU_NF4_BLOCK_K` (stories260K's MLP: 64 → 172 → 64). They stay in full
    precision and frozen, as transformers leaves ``lm_head`` (no weight is read: the model is built
    on the meta device from config.json). On CUDA, and for int8, nothing is unfit.

    Returns ``([], [])`` when nothing is unfit (transformers' own default then applies)."""
    if quantization != "nf4" or device.type != "cpu":
        return [], []
    import re

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    default = list(get_keys_to_not_convert(meta))
    unfit = [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)
             and (m.out_features % CPU_NF4_BLOCK_N or m.in_features % CPU_NF4_BLOCK_K)
             and not any(n == k or n.endswith("." + k) or n.startswith(k + ".") for k in default)]
    if not unfit:
        return [], []
    return default + [re.escape(n) for n in unfit], unfit


def load_quantized_causal_lm(name: str, quantization: str, *, seed: int = 0, dtype: str = "fp32",
                             device: Optional[torch.device] = None):
    """Tokenizer and a quantized ``AutoModelForCausalLM`` prepared for adapter training.

    The base is loaded with :func:`bnb_config` on ``device`` (default :func:`quant_device`), then
    ``peft.prepare_model_for_kbit_training`` (no gradient checkpointing here: ``perf`` applies it)
    freezes every base parameter and keeps the non-quantized ones (norms, embeddings) in fp32.

    Raises:
        ModelError: not loadable as a causal LM (the message says what to give instead).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpft.models.causal import _named_tokenizer, pad_for_loss
    from dpft.models.load import import_peft, model_load_message, resolve_model_path

    dev = device if device is not None else quant_device()
    cdt = compute_dtype(dtype)
    path = resolve_model_path(name)
    torch.manual_seed(seed)
    try:
        tok = _named_tokenizer(AutoTokenizer.from_pretrained(path), path)
        skip, unfit = unquantizable_layers(path, quantization, dev)
        with warnings.catch_warnings():  # bitsandbytes' CPU-backend notices; errors still raise
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                path, quantization_config=bnb_config(quantization, cdt, skip=skip or None),
                device_map={"": dev}, dtype=cdt)
    except (OSError, ValueError) as exc:
        raise ModelError(model_load_message(name, exc, f"a {quantization} causal language model",
                                            "model.quantization needs a decoder (Llama, Qwen2 …) folder with "
                                            "config.json and weights")) from None
    pad_for_loss(tok, model)
    peft = import_peft()
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.dpft_unquantized = list(unfit)  # for the run's note (models/build.py)
    if unfit:
        import sys

        print(f"model.quantization {quantization}: {len(unfit)} layer(s) whose shapes bitsandbytes' {dev.type} 4-bit "
              f"kernel cannot take (out_features a multiple of {CPU_NF4_BLOCK_N}, in_features of {CPU_NF4_BLOCK_K}) "
              f"are left in full precision and frozen, as lm_head is: {_short(unfit)}", file=sys.stderr)
    return tok, model


def _short(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f", … ({len(names)} in all)" if len(names) > shown else "")


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a bitsandbytes quantized layer (matched by module name: dpft does not
    import bitsandbytes to ask)."""
    return any(type(m).__module__.startswith("bitsandbytes.") for m in model.modules())
