"""User-level (group) clipping: the summed gradient of a privacy unit's rows clipped as one.

At user level (``task.user_column``) the privacy unit is a user, who contributes up to k rows
to a logical batch. Its contribution is the sum of its rows' gradients, ``g_u = Σ_{i∈u} g_i``,
and the DP step needs ``‖c_u g_u‖ ≤ C`` for every user (add/remove-one *user*; Chua et al.
2024, "Mind the Privacy Unit!", Alg. 1 "user-level DP-SGD"; Charles et al. 2024, "Fine-tuning
large language models with user-level differential privacy", ULS). Two ways:

* **group** (exact): the group norm ``‖g_u‖`` from the book-keeping engine's per-example
  quantities without instantiating ``g_u``: a factored per-example gradient ``U_i^T V_i`` of
  a 2-D weight summed over the user's rows is ``[U_i; U_j; …]^T [V_i; V_j; …]``, i.e. the
  same factored form over the *concatenated* token rows of the group, so its ghost norm
  ``<U_u U_u^T, V_u V_u^T>`` (Li et al. 2022) includes every cross term ``<g_i, g_j>`` of the
  group exactly; instantiated per-example gradients (biases, norms, fallback modules) are
  summed per group. The group factor ``c_u`` from the clip policy is then used as every row's
  weight in the usual one-matmul clipped sum ``Σ_i c_{u(i)} g_i`` (no second backward).
* **per_example_over_k** (conservative): each row clipped to C/k and summed; a user has at
  most k rows in a step (the sampler's guarantee), so ``‖Σ_{i∈u} c_i g_i‖ ≤ k · C/k = C``
  (triangle inequality). Simpler and cheaper, but it clips a user's rows harder.

A micro-batch announces its groups with the ``(B,)`` int64 tensor ``batch[GROUP_KEY]`` (local
ids 0..G-1; all of a user's rows of the step in one micro-batch); engines that support group
clipping (book-keeping, reference) pop it before the forward.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from dpft.grads.contrib import Contribution, Outer, PerExample
from dpft.grads.clip import ClipPolicy

#: Batch key of the ``(B,)`` int64 local group (user) id of each row.
GROUP_KEY = "privacy_unit"

__all__ = ["GROUP_KEY", "split_groups", "group_contributions", "group_sum", "PerExampleOverK", "n_groups"]


def split_groups(batch: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], Optional[torch.Tensor]]:
    """``(batch without GROUP_KEY, groups or None)``.

    Raises:
        ValueError: groups not a ``(B,)`` integer tensor of ids 0..G-1 with every id used.
    """
    if GROUP_KEY not in batch:
        return batch, None
    rest = {k: v for k, v in batch.items() if k != GROUP_KEY}
    g = batch[GROUP_KEY]
    b = next((v.shape[0] for v in rest.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if g.dim() != 1 or g.is_floating_point() or (b is not None and g.shape[0] != b):
        raise ValueError(f"batch[{GROUP_KEY!r}] must be a (B,) int64 tensor of group ids, got {tuple(g.shape)} "
                         f"{g.dtype}")
    g = g.long()
    if g.numel() and (int(g.min()) < 0 or bool((torch.bincount(g) == 0).any())):
        raise ValueError(f"batch[{GROUP_KEY!r}]: group ids must be 0..G-1 with every id used "
                         "(torch.unique(..., return_inverse=True) gives them)")
    return rest, g


def n_groups(groups: torch.Tensor) -> int:
    return int(groups.max()) + 1 if groups.numel() else 0


def _slots(groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's position within its group (0..size-1) and the largest group size."""
    g = groups.long()
    order = torch.argsort(g, stable=True)
    sg = g[order]
    start = torch.ones_like(sg, dtype=torch.bool)
    start[1:] = sg[1:] != sg[:-1]
    pos = torch.arange(len(sg), device=g.device)
    first = torch.cummax(torch.where(start, pos, torch.zeros_like(pos)), 0).values
    slot = torch.empty_like(g)
    slot[order] = pos - first
    return slot, int(slot.max()) + 1 if slot.numel() else 0


def group_sum(x: torch.Tensor, groups: torch.Tensor, n: int) -> torch.Tensor:
    """``(G, *rest)`` per-group sums of ``x: (B, *rest)`` (fp32)."""
    out = torch.zeros((n, *x.shape[1:]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, groups.to(x.device), x.float())


def _concat_side(t: torch.Tensor, groups: torch.Tensor, slot: torch.Tensor, n: int, kmax: int) -> torch.Tensor:
    """``(B, T, …)`` → ``(G, kmax·T, …)``: each group's rows laid end to end along T, padded
    with zeros (an index side pads with index 0; its dense partner pads with zeros, so a pad
    contributes nothing to any norm or inner product)."""
    rest = tuple(t.shape[1:])
    out = torch.zeros((n, kmax) + rest, dtype=t.dtype, device=t.device)
    out[groups.to(t.device), slot.to(t.device)] = t
    return out.reshape((n, kmax * rest[0]) + rest[1:])


def group_contributions(merged: Mapping[str, list[Contribution]], groups: torch.Tensor
                        ) -> dict[str, list[Contribution]]:
    """Per-group contributions whose per-"example" gradient is the group's summed gradient.

    Args:
        merged: parameter name → merged per-row contributions (``_hooks.merge``), batch B.
        groups: ``(B,)`` int64 group ids 0..G-1.

    Returns:
        name → contributions with batch dimension G: ``PerExample`` summed per group,
        ``Outer`` factors concatenated per group along T (exact: ``Σ_{i∈u} U_i^T V_i`` is the
        product of the stacked factors), for ``_hooks.sq_norm`` to take the group norms with
        all cross terms.
    """
    n = n_groups(groups)
    slot, kmax = _slots(groups)
    out: dict[str, list[Contribution]] = {}
    done: dict[tuple, torch.Tensor] = {}  # a side shared by layers (q/k/v's input) is concatenated once

    def side(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in done:
            done[key] = _concat_side(t, groups, slot, n, kmax)
        return done[key]

    for name, items in merged.items():
        new: list[Contribution] = []
        for it in items:
            if isinstance(it, PerExample):
                new.append(PerExample(group_sum(it.g, groups, n)))
            else:
                assert isinstance(it, Outer)
                new.append(Outer(side(it.left), side(it.right), it.shape))
        out[name] = new
    return out


class PerExampleOverK(ClipPolicy):
    """Conservative user-level clipping: each row clipped to C/k by ``inner`` (a policy built
    with C/k), so a user's at most k rows sum to norm ≤ C; sensitivity (per user) is
    ``k · inner.sensitivity = C``.

    Args:
        inner: the clip policy at C/k (flat, per-layer, automatic, head/body).
        k: most rows per user per step (the sampler enforces it).
    """

    def __init__(self, inner: ClipPolicy, k: int):
        if int(k) < 1:
            raise ValueError(f"k must be ≥ 1, got {k}")
        self.inner = inner
        self.k = int(k)
        self.max_norm = float(inner.max_norm) * self.k

    def scales(self, sq_norms: torch.Tensor) -> torch.Tensor:
        return self.inner.scales(sq_norms)

    @property
    def sensitivity(self) -> float:
        return self.k * float(self.inner.sensitivity)

    def set_head_mask(self, mask) -> None:
        if hasattr(self.inner, "set_head_mask"):
            self.inner.set_head_mask(mask)
