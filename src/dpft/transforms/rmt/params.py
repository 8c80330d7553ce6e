"""Which parameters of a model are weight matrices the RMT denoiser may touch (Linear,
transformers Conv1D, LoRA A/B, embeddings), and how they are stored."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from torch import Tensor, nn

# --------------------------------------------------------------------------------------------
# Which parameters are matrices
# --------------------------------------------------------------------------------------------


class MatrixParam(NamedTuple):
    """What :func:`matrix_param_names` knows about one 2-D weight.

    ``kind`` is ``"linear"``, ``"conv1d"``, ``"lora_A"``, ``"lora_B"`` or ``"embedding"``;
    ``transposed`` is True when stored ``(in, out)`` (transformers ``Conv1D``) rather than
    ``(out, in)``. The denoiser does not need ``transposed`` (it is transpose-equivariant);
    it is there for other consumers (e.g. per-example engines).
    """

    kind: str
    transposed: bool


def _is_conv1d(mod: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers missing or broken: fall back to duck typing
        Conv1D = None
    if Conv1D is not None and isinstance(mod, Conv1D):
        return True
    w = getattr(mod, "weight", None)
    return (
        type(mod).__name__ == "Conv1D"
        and isinstance(w, Tensor)
        and w.ndim == 2
        and w.shape[1] == getattr(mod, "nf", -1)
    )


def matrix_param_names(
    model: nn.Module,
    trainable_names: Collection[str] | None = None,
    *,
    include_embeddings: bool = False,
) -> dict[str, MatrixParam]:
    """Find the 2-D weight matrices of ``model`` by module type.

    Selected: ``nn.Linear`` weights (``(out, in)``; this covers peft LoRA ``lora_A`` /
    ``lora_B`` adapters, which are ``nn.Linear`` of shapes ``(r, in)`` / ``(out, r)``, and peft
    ``modules_to_save`` copies of heads) and transformers ``Conv1D`` weights (``(in, out)``).
    ``nn.Embedding`` weights (also a weight tied to one, e.g. GPT-2's ``lm_head``) only with
    ``include_embeddings=True``. Not selected: biases, norms, raw ``nn.Parameter`` matrices
    (e.g. ``nn.MultiheadAttention.in_proj_weight``), peft ``lora_embedding_A/B``.

    Args:
        model: any module (plain, transformers, or peft-wrapped).
        trainable_names: names (as in ``model.named_parameters()``) to consider; default:
            those with ``requires_grad``. Names of frozen base weights are thus skipped.
        include_embeddings: also return embedding matrices (explicit opt-in).

    Returns:
        ``{parameter name: MatrixParam}`` in module order; names are the canonical (first,
        de-duplicated) names of ``model.named_parameters()``.
    """
    canonical: dict[int, str] = {}
    requires_grad: set[str] = set()
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
        if p.requires_grad:
            requires_grad.add(name)
    allowed = set(trainable_names) if trainable_names is not None else requires_grad
    embedding_ids = {
        id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)
    }

    out: dict[str, MatrixParam] = {}
    for mod_name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, Tensor) or w.ndim != 2:
            continue
        if isinstance(mod, nn.Linear):
            path = f".{mod_name}."
            kind = "lora_A" if ".lora_A." in path else "lora_B" if ".lora_B." in path else "linear"
            info = MatrixParam(kind, False)
        elif _is_conv1d(mod):
            info = MatrixParam("conv1d", True)
        elif isinstance(mod, nn.Embedding):
            info = MatrixParam("embedding", False)
        else:
            continue
        if id(w) in embedding_ids and not include_embeddings:
            continue
        if id(w) in embedding_ids:
            info = MatrixParam("embedding", False)
        name = canonical.get(id(w))
        if name is None or name not in allowed or name in out:
            continue
        out[name] = info
    return out
