"""Architecture facts shared by model loading and unit naming: the task head's parameter
names, the list of transformer blocks, and the error both raise."""

from __future__ import annotations

import re

from torch import nn


class ModelError(ValueError):
    """Unknown model, or a trainable selection that does not fit the model."""


HEAD_PATTERNS = ("classifier", "score", "pooler", "lm_head")


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The longest ModuleList of transformer blocks (``encoder.layer``, ``h``, ``layers``)."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and re.search(r"(^|\.)(layer|layers|h|blocks)$", name):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ModelError("could not find the transformer blocks of this model for trainable.mode=last_k")
    return best
