"""Performance settings: device, precision, activation checkpointing, compile.

None of these can change the privacy guarantee (DESIGN.md, "Performance settings are not
privacy settings"): the sampling rate, σ, C and the ledger are set by ``privacy:`` alone. They
change where and in which number format the same computation runs:

* **device** (:func:`resolve_device`): ``auto`` (CUDA when torch sees one, else CPU), ``cpu``,
  ``cuda`` or ``cuda:N``. The model, the collated batches, per-example norms, clipped sums,
  the noise and the optimizer state live there; the noise is drawn there from the run's secret
  generator (``step/noise.py``: a ``torch.Generator`` of that device seeded from the secret
  key; no host round trip).
* **precision** (:class:`Precision`, grads/precision.py: the per-example engine applies it): ``fp32``, ``bf16`` or ``fp16`` autocast around the
  *forward* only (PyTorch's recommendation; the backward runs each op in the dtype autocast
  chose for it). Parameters, and so the optimizer state, stay fp32 (master weights). What
  decides privacy is computed in fp32 whatever the autocast dtype: per-example norms, clip
  factors, the clipped sum ``Σᵢ cᵢgᵢ`` (``grads/contrib.py``: factors are upcast before the
  scaling and the product), the noise and the update.
* **activation checkpointing** (:func:`enable_activation_checkpointing`): Hugging Face's
  ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``) on the model; the
  book-keeping hooks tell recomputed forwards from the original ones (``grads/capture.py``
  ``Capture``), so no activation is counted twice.
* **compile**: ``torch.compile`` of the model's forward, for the non-private engine only (see
  :data:`COMPILE_REFUSAL`).

fp16 and privacy (Micikevicius et al. 2018, "Mixed precision training", loss scaling): fp16
gradients underflow unless the loss is multiplied by a scale S before the backward and the
gradients are divided by S after. The usual *dynamic* scaler (``torch.amp.GradScaler``) lowers
S after an overflow and skips that step; its S is then a function of which private examples
overflowed in earlier steps, a quantity no mechanism has privatised, and the skipped step is a
data-dependent release decision. dpft therefore uses a *static* scale from the recipe
(``perf.loss_scale``, public). An example whose gradient overflows (a non-finite loss,
per-example norm or factor) contributes **zero** to the clipped sum: its contribution is either
``cᵢgᵢ`` with ``‖cᵢgᵢ‖ ≤ C`` or 0, so the sensitivity stays C under add/remove-one, and whether
it overflowed depends on that example and the current (already released) weights only. The step
is never skipped (the noise is added and the ledger records it as always). How many examples
overflowed is counted as a *private* statistic (``overflowed`` in the opt-in diagnostics file),
like the clip count; it is not released. bf16 has fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from dpft.errors import TrainingError
from dpft.grads.capture import uses_activation_checkpointing  # noqa: F401 (public here)
from dpft.grads.precision import DTYPES, FP32, Precision  # noqa: F401 (public here)

__all__ = ["DeviceError", "Precision", "FP32", "DTYPES", "DEFAULT_FP16_LOSS_SCALE", "resolve_device",
           "check_dtype_on", "enable_activation_checkpointing", "uses_activation_checkpointing", "COMPILE_REFUSAL",
           "Placement", "build_placement", "place_model"]

#: ``perf.loss_scale`` when fp16 is asked for without one: 2^10. Per-example losses are summed over
#: tokens, so the output gradients start at |softmax - onehot| ≤ 1 per token; S = 1024 lifts
#: gradients of ~1e-7 above fp16's subnormal range and keeps ~1 well below its 65504 maximum.
DEFAULT_FP16_LOSS_SCALE = 1024.0


#: Why ``perf.compile`` is refused with a private engine (measured on torch 2.13, tiny BERT,
#: ``backend="aot_eager"``: 30–44 graphs, a graph break at every hooked layer, and the
#: recompile limit hit on the per-step hook state and on the ``requires_grad`` flags the
#: engine switches, after which dynamo runs those frames eagerly).
COMPILE_REFUSAL = (
    "perf.compile: torch.compile cannot work with the per-example engine's book-keeping hooks: every "
    "trainable layer gets a forward hook that keeps its input and marks outputs requires_grad, and the "
    "engine switches the parameters' requires_grad around each forward, so dynamo breaks the graph at "
    "every hooked layer and recompiles on every step until its recompile limit (then it runs eagerly); "
    "the reference engine's torch.func.vmap does not trace compiled forwards either. Leave perf.compile "
    "off for private runs (it is allowed with --no-dp)")


class DeviceError(ValueError):
    """A device that is not there (``--device cuda`` without CUDA, ``cuda:N`` beyond the count)."""


def resolve_device(spec: Union[str, torch.device, None] = "auto", local_rank: Optional[int] = None) -> torch.device:
    """The ``torch.device`` a ``perf.device`` setting names, checked against this machine.

    Args:
        spec: ``auto`` (or None): CUDA when ``torch.cuda.is_available()``, else CPU; ``cpu``;
            ``cuda`` (the current CUDA device, or ``cuda:local_rank``); ``cuda:N``.
        local_rank: under ``torchrun`` the process's ``LOCAL_RANK``; ``auto`` and ``cuda`` then
            mean ``cuda:local_rank`` (one GPU per process).

    Raises:
        DeviceError: an unknown spelling; CUDA asked for on a machine (or torch build) without
            it; ``cuda:N`` with N ≥ the number of visible devices; each with the fix.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    s = "auto" if spec is None else str(spec).strip().lower()
    if s == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        s = "cuda"
    if s == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", s)
    if m is None:
        raise DeviceError(f"perf.device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = (f"this torch {torch.__version__} is a CPU-only build" if not build
               else f"torch {torch.__version__} (CUDA {build}) sees no CUDA device (driver missing, or "
                    "CUDA_VISIBLE_DEVICES hides them)")
        raise DeviceError(f"perf.device = {s} (--device {s}): no CUDA device: {why}. Use --device cpu (or auto, "
                          "which picks CUDA only when there is one), or run on a machine with an NVIDIA GPU and a CUDA "
                          "build of "
                          f"torch=={torch.__version__.split('+')[0]}")
    n = torch.cuda.device_count()
    if m.group(1) is not None:
        idx = int(m.group(1))
    elif local_rank is not None:
        idx = int(local_rank)
    else:
        idx = torch.cuda.current_device()
    if idx >= n:
        raise DeviceError(f"perf.device = cuda:{idx} (--device cuda:{idx}): only {n} CUDA device(s) are visible "
                          f"(cuda:0 … cuda:{n - 1}); pick one of those, or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", idx)


def check_dtype_on(dtype: str, device: torch.device) -> None:
    """Refuse an autocast dtype the device cannot run.

    Raises:
        DeviceError: bf16 on a CUDA GPU without bf16 support (before Ampere).
    """
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"perf.dtype bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use "
                          "--dtype fp16 (with perf.loss_scale) or fp32")


def _hf_model(model: nn.Module) -> Optional[nn.Module]:
    """The outermost Hugging Face ``PreTrainedModel`` in ``model`` (itself, or inside a peft
    wrapper), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    return None


def enable_activation_checkpointing(model: nn.Module, use_reentrant: bool = False) -> None:
    """Turn on Hugging Face activation (gradient) checkpointing of ``model``'s layers.

    Each transformer block's forward is re-run inside the backward instead of keeping its
    intermediate activations (Chen et al. 2016, "Training deep nets with sublinear memory
    cost"). The book-keeping engine keeps the inputs of trainable layers anyway (they are its
    ``A`` factors), so the saving is the rest: attention scores and probabilities, MLP
    intermediates, dropout masks, normalisation statistics.

    Args:
        model: a Hugging Face model (or a peft model around one).
        use_reentrant: ``torch.utils.checkpoint``'s variant; False (non-reentrant) is PyTorch's
            recommendation and the default here; both are exact with the book-keeping engine.

    Raises:
        ValueError: no Hugging Face model inside, or one that does not support checkpointing.
    """
    hf = _hf_model(model)
    if hf is None or not getattr(hf, "supports_gradient_checkpointing", False):
        name = type(hf if hf is not None else model).__name__
        raise ValueError(f"perf.activation_checkpointing: {name} does not support Hugging Face activation "
                         "checkpointing; turn it off (or wrap your blocks in torch.utils.checkpoint yourself)")
    kwargs = {"use_reentrant": bool(use_reentrant)}
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # pragma: no cover - older transformers
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    cfg = getattr(hf, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False):
        cfg.use_cache = False  # a KV cache is of no use in training and is refused under checkpointing


@dataclass(frozen=True)
class Placement:
    """Where a run's step runs (a plan part, run/plan.py): the device of the model, batches,
    clipped sums and noise, and the precision of the per-example engine."""

    device: torch.device
    precision: Precision


def build_placement(recipe, local_rank: Optional[int], progress: bool, not_device_aware: list[str]) -> Placement:
    """Resolve ``recipe.perf`` into a :class:`Placement`, refusing what the run cannot honour —
    before any data or model is loaded.

    ``perf.device: auto`` falls back to the CPU (with a message) when a method of the recipe is
    not device-aware (``not_device_aware``: their names); an explicit device is refused instead.

    Raises:
        TrainingError: compile for a private run; activation checkpointing with the reference
            engine; an explicit device a method cannot run on.
        DeviceError, ValueError: an unknown device or a dtype the device lacks.
    """
    import sys

    p = recipe.perf
    device = resolve_device(p.device, local_rank=local_rank)
    check_dtype_on(p.dtype, device)
    scale = p.loss_scale or (DEFAULT_FP16_LOSS_SCALE if p.dtype == "fp16" else 1.0)
    if p.compile and recipe.privacy.enabled:
        raise TrainingError(COMPILE_REFUSAL)
    if p.activation_checkpointing and recipe.privacy.enabled and recipe.privacy.engine == "reference":
        raise TrainingError("perf.activation_checkpointing needs privacy.engine: bookkeeping (or auto): the "
                            "reference engine's torch.func transforms cannot run Hugging Face's checkpointing "
                            "hooks (they call requires_grad_ inside the transform)")
    if device.type != "cpu":
        # A method that runs its own forwards (scoring, split forward noise, stage-1 sub-runs) must say
        # it moves its tensors to the model's device; the driver names no method.
        bad = list(not_device_aware)
        if bad and p.device == "auto":  # auto: the best device this run supports
            device = torch.device("cpu")
            if progress:
                print(f"perf.device auto: CPU, because methods {bad} are not device-aware yet", file=sys.stderr)
        elif bad:
            raise TrainingError(f"methods {bad} have not been made device-aware; run them with "
                                "--device cpu (perf.device: cpu)")
    return Placement(device, Precision(p.dtype, float(scale), device.type))


def place_model(model: nn.Module, perf, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device``; activation checkpointing and compile (no-dp only) as
    ``perf`` asks. Returns the model.

    Raises:
        TrainingError: the model cannot be checkpointed."""
    model.to(device)
    if perf.activation_checkpointing:
        try:
            enable_activation_checkpointing(model)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
    if perf.compile:
        model.compile()
    return model
