"""Per-example gradient *contributions* and their algebra, shared by every layer rule of the
book-keeping engine: :class:`PerExample` (instantiated), :class:`Outer` (factored, ghost norm),
exact cross terms of several contributions to one parameter, squared norms and the clipped sum
(one matrix product per layer). See :mod:`dpft.grads._hooks` for the method and its sources.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

#: Instantiated per-example gradients are built in example chunks of at most this many floats.
_CHUNK_ELEMS = 1 << 22

#: How a dense-by-dense :class:`Outer` norm is computed: "auto" (cheaper of the two), "ghost",
#: or "instantiate". Tests set it to exercise both routes.
NORM_MODES = ("auto", "ghost", "instantiate")


class BatchLayoutError(RuntimeError):
    """A hooked module saw a tensor whose leading dimension is not the example dimension."""


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Autocast off (CPU and CUDA) for the engine's own arithmetic.

    Norms, clip factors and the clipped sum decide the sensitivity, so they are computed in
    fp32 even when the caller's backward (or a user's ``loss.backward()`` inside
    ``torch.autocast``) runs under autocast, which would otherwise turn the fp32 ``bmm``/``mm``
    below into bf16/fp16 products.
    """
    with contextlib.ExitStack() as stack:
        if torch.is_autocast_enabled("cpu"):
            stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available() and torch.is_autocast_enabled("cuda"):
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def in_backward() -> bool:
    """Whether the calling thread is running an autograd backward (a forward hook that fires
    now belongs to a forward re-run by activation checkpointing)."""
    f = getattr(torch._C, "_current_graph_task_id", None)
    return True if f is None else f() != -1


# --------------------------------------------------------------------------- contributions


class Contribution:
    """One module call's share of one parameter's per-example gradient (base class)."""

    shape: torch.Size


@dataclass
class PerExample(Contribution):
    """Instantiated per-example gradient ``g: (B, *shape)``."""

    g: torch.Tensor

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self.g.shape[1:]


@dataclass
class Outer(Contribution):
    """Factored per-example gradient of a 2-D parameter of shape ``(R, C)``.

    ``g_i = sum_t u_{i,t} v_{i,t}^T``. ``left`` is ``(B, T, R)`` floating or ``(B, T)`` int64
    (one-hot rows ``e_{left[i,t]}`` of length ``R``); likewise ``right`` with ``C``. At most
    one side is an index side.
    """

    left: torch.Tensor
    right: torch.Tensor
    shape: torch.Size

    @property
    def left_index(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def right_index(self) -> bool:
        return not self.right.is_floating_point()

    @property
    def signature(self) -> tuple[bool, bool]:
        return (self.left_index, self.right_index)


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _UseCountedCache:
    """Per-step cache of values derived from activations, keyed by tensor storage. Only tensors
    announced more than once with :meth:`expect` are kept, and each entry is dropped after its
    last announced use."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}
        self._uses: dict[tuple, int] = {}

    def expect(self, x: torch.Tensor) -> None:
        k = _key(x)
        self._uses[k] = self._uses.get(k, 0) + 1

    def _take(self, k: tuple, ck: object, compute) -> torch.Tensor:
        """The cached value under ``ck`` (or ``compute()``); counts one use of tensor key ``k``."""
        out = self._cache.get(ck)
        if out is None:
            out = compute()
        left = self._uses.get(k, 1) - 1
        if left > 0:
            self._cache[ck] = out
            self._uses[k] = left
        else:
            self._cache.pop(ck, None)
            self._uses.pop(k, None)
        return out


class GramCache(_UseCountedCache):
    """Per-step cache of per-example Gram matrices ``X_i X_i^T`` keyed by tensor storage.

    Query, key and value projections read the same activation, so its ``(B, T, T)`` Gram is
    computed once per step instead of three times.
    """

    def gram(self, x: torch.Tensor) -> torch.Tensor:
        def compute():
            xf = x.float()
            return torch.bmm(xf, xf.transpose(1, 2))

        k = _key(x)
        return self._take(k, k, compute)


def _index_sq_norm(idx: torch.Tensor, dense: torch.Tensor, rows: int) -> torch.Tensor:
    """``||sum_t e_{idx_t} d_t^T||_F^2`` per example, exactly and in ``O(B T C)``.

    Rows hit by the same index within one example are summed first (repeated tokens), via
    ``unique`` over the keys ``i * rows + idx[i, t]``.

    Args:
        idx: ``(B, T)`` int64 row indices in ``[0, rows)``.
        dense: ``(B, T, C)`` values.
        rows: number of rows of the one-hot side.
    Returns: ``(B,)`` float32.
    """
    b, t = idx.shape
    c = dense.shape[-1]
    keys = (idx + torch.arange(b, device=idx.device)[:, None] * rows).reshape(-1)
    uniq, inv = torch.unique(keys, return_inverse=True)
    sums = torch.zeros(uniq.numel(), c, device=dense.device, dtype=torch.float32)
    sums.index_add_(0, inv, dense.reshape(-1, c).float())
    out = torch.zeros(b, device=dense.device, dtype=torch.float32)
    out.index_add_(0, torch.div(uniq, rows, rounding_mode="floor"), sums.pow(2).sum(1))
    return out


def _side_gram(a: torch.Tensor, b: torch.Tensor, cache: GramCache | None) -> torch.Tensor:
    """``(B, Ta, Tb)`` inner products between the per-position vectors of two sides."""
    a_idx, b_idx = not a.is_floating_point(), not b.is_floating_point()
    if not a_idx and not b_idx:
        return torch.bmm(a.float(), b.float().transpose(1, 2))
    if a_idx and b_idx:
        return (a[:, :, None] == b[:, None, :]).float()
    if a_idx:  # <e_{a_t}, b_s> = b[s, a_t]
        ta = a.shape[1]
        g = torch.gather(b.float(), 2, a[:, None, :].expand(b.shape[0], b.shape[1], ta))
        return g.transpose(1, 2)  # (B, Ta, Tb)
    return _side_gram(b, a, cache).transpose(1, 2)


def use_ghost(o: Outer, mode: str = "auto") -> bool:
    """Whether a dense-by-dense factor's norm is taken as a ghost norm.

    ``auto`` compares multiply-adds: ghost ``T^2 (R + C)`` against instantiation ``T R C`` per
    example, i.e. ghost iff ``T (R + C) <= R C``. (Bu et al.'s memory rule ``2 T^2 < R C`` is
    not needed: instantiation runs in bounded example chunks.)
    """
    if o.left_index or o.right_index:
        return False
    if mode != "auto":
        return mode == "ghost"
    t, r, c = o.left.shape[1], o.shape[0], o.shape[1]
    return t * (r + c) <= r * c


def outer_sq_norm(o: Outer, mode: str = "auto", cache: GramCache | None = None) -> torch.Tensor:
    """``(B,)`` float32 squared Frobenius norm of each example's ``U_i^T V_i``."""
    if o.left_index:
        return _index_sq_norm(o.left, o.right, o.shape[0])
    if o.right_index:
        return _index_sq_norm(o.right, o.left, o.shape[1])
    bsz, t, r = o.left.shape
    c = o.right.shape[-1]
    if use_ghost(o, mode):
        cache = cache or GramCache()
        return (cache.gram(o.left) * cache.gram(o.right)).sum(dim=(1, 2))
    step = max(1, _CHUNK_ELEMS // max(1, r * c))
    out = []
    for s in range(0, bsz, step):
        u = o.left[s : s + step].float()
        v = o.right[s : s + step].float()
        out.append(torch.bmm(u.transpose(1, 2), v).pow(2).sum(dim=(1, 2)))
    return torch.cat(out)


def cross(a: Contribution, b: Contribution, cache: GramCache | None = None) -> torch.Tensor:
    """``(B,)`` float32 per-example inner product ``<g_a,i, g_b,i>`` of two contributions to one
    parameter (the cross term of a tied parameter's norm)."""
    if isinstance(a, PerExample) and isinstance(b, PerExample):
        n = a.g.shape[0]
        return (a.g.reshape(n, -1).float() * b.g.reshape(n, -1).float()).sum(1)
    if isinstance(a, Outer) and isinstance(b, PerExample):
        a, b = b, a
    if isinstance(a, PerExample) and isinstance(b, Outer):
        g = a.g.float()
        if b.left_index:  # sum_t <g[x_t, :], v_t>
            c = g.shape[2]
            rows = torch.gather(g, 1, b.left[:, :, None].expand(-1, -1, c))
            return (rows * b.right.float()).sum(dim=(1, 2))
        if b.right_index:  # sum_t <u_t, g[:, x_t]>
            r = g.shape[1]
            cols = torch.gather(g.transpose(1, 2), 1, b.right[:, :, None].expand(-1, -1, r))
            return (cols * b.left.float()).sum(dim=(1, 2))
        gv = torch.bmm(b.right.float(), g.transpose(1, 2))  # (B, T, R)
        return (gv * b.left.float()).sum(dim=(1, 2))
    assert isinstance(a, Outer) and isinstance(b, Outer)
    return (_side_gram(a.left, b.left, cache) * _side_gram(a.right, b.right, cache)).sum((1, 2))


def merge(contribs: list[Contribution]) -> list[Contribution]:
    """Combine contributions of one parameter: per-example ones are added, factored ones with
    the same side kinds are concatenated along ``T`` (exact: ``sum_t`` runs over both)."""
    out: list[Contribution] = []
    pe = [c for c in contribs if isinstance(c, PerExample)]
    if pe:
        g = pe[0].g
        for c in pe[1:]:
            g = g + c.g
        out.append(PerExample(g))
    groups: dict[tuple[bool, bool], list[Outer]] = {}
    for c in contribs:
        if isinstance(c, Outer):
            groups.setdefault(c.signature, []).append(c)
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
        else:
            out.append(
                Outer(
                    torch.cat([g.left for g in group], 1),
                    torch.cat([g.right for g in group], 1),
                    group[0].shape,
                )
            )
    return out


def sq_norm(items: list[Contribution], batch: int, mode: str = "auto",
            cache: GramCache | None = None, device=None) -> torch.Tensor:
    """``(B,)`` float32 squared norm of the sum of merged contributions, with cross terms.

    Every factor is upcast to fp32 before any product (and autocast is switched off), so a
    bf16/fp16 capture still gets fp32 norms."""
    total: Optional[torch.Tensor] = None
    with full_precision():
        for k, a in enumerate(items):
            if isinstance(a, PerExample):
                s = a.g.reshape(a.g.shape[0], -1).float().pow(2).sum(1)
            else:
                s = outer_sq_norm(a, mode, cache)  # type: ignore[arg-type]
            for b in items[k + 1 :]:
                s = s + 2.0 * cross(a, b, cache)
            total = s if total is None else total + s
    if total is None:
        return torch.zeros(batch, device=device)
    return total


class ScaledCache(_UseCountedCache):
    """Per-step cache of scaled factors ``c_i * X_i`` (fp32) read by several layers.

    Query, key and value read the same input ``A``; when their clip factors are equal (flat
    or automatic clipping) the scaled input is built once for the three clipped sums.
    """

    def shared(self, x: torch.Tensor) -> bool:
        return self._uses.get(_key(x), 0) > 1

    def scaled(self, x: torch.Tensor, c: torch.Tensor, ckey: object) -> torch.Tensor:
        k = _key(x)
        return self._take(k, (k, ckey), lambda: _scale(x, c))


def _scale(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``c_i * x_i`` in fp32 for ``x: (B, ...)``, ``c: (B,)``."""
    return x.float() * c.float().reshape(-1, *([1] * (x.dim() - 1)))


def weighted_sum(items: list[Contribution], c: torch.Tensor, like: torch.Tensor,
                 cache: ScaledCache | None = None, ckey: object = None) -> torch.Tensor:
    """``sum_i c_i g_i`` shaped like the parameter ``like``, in fp32 (zeros if no contribution).

    For a factored contribution this is one ``(R, B*T) @ (B*T, C)`` product with the factor
    scaled by ``c`` (a factor shared with other layers if ``cache`` knows one, else the
    smaller side), or one ``index_add_`` for an embedding (index) side. ``ckey`` names the
    clip factors for the cache: equal keys promise equal ``c``.

    Precision: whatever dtype the factors were captured in (bf16/fp16 under autocast, often
    mixed: a bf16 output gradient against an fp32 LayerNorm output), both sides are upcast to
    fp32 and the scaling and the product are done in fp32. The per-example norm is taken of
    the same captured factors in fp32 (:func:`sq_norm`), so each example's summed contribution
    ``c_i U_i^T V_i`` has norm ``c_i ||U_i^T V_i|| <= C`` up to fp32 rounding; rounding the
    scaled factor to bf16 would break that bound by up to ~2^-8 relative per element.
    """
    out: Optional[torch.Tensor] = None
    # Dense terms first, so that index (embedding) terms are added in place into their sum.
    order = sorted(items, key=lambda it: isinstance(it, Outer) and (it.left_index or it.right_index))
    with full_precision():
        for it in order:
            if isinstance(it, PerExample):
                s = torch.tensordot(c.float(), it.g.float(), dims=1)
            else:
                assert isinstance(it, Outer)
                r, cc = it.shape
                if it.left_index or it.right_index:
                    if it.left_index:
                        idx, dense, rows, cols = it.left, it.right, r, cc
                    else:
                        idx, dense, rows, cols = it.right, it.left, cc, r
                    v = _scale(dense, c).reshape(-1, cols)
                    if out is None:
                        out = torch.zeros(r, cc, dtype=torch.float32, device=v.device)
                    target = out if it.left_index else out.t()  # (rows, cols) view of the sum
                    target.index_add_(0, idx.reshape(-1), v)
                    continue
                u, v = it.left, it.right
                if cache is not None and cache.shared(v):
                    v = cache.scaled(v, c, ckey)
                elif cache is not None and cache.shared(u):
                    u = cache.scaled(u, c, ckey)
                elif r <= cc:
                    u = _scale(u, c)
                else:
                    v = _scale(v, c)
                s = torch.mm(u.reshape(-1, r).float().t(), v.reshape(-1, cc).float())
            out = s if out is None else out.add_(s)
    if out is None:
        return torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    return out.reshape(like.shape)


def zero_examples(items: list[Contribution], bad: torch.Tensor) -> list[Contribution]:
    """The contributions with the rows of the examples flagged in ``bad: (B,) bool`` set to 0
    (an fp16 overflow: that example contributes nothing; index sides are kept, their dense
    side is zeroed)."""
    out: list[Contribution] = []

    def z(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        m = bad.reshape(-1, *([1] * (t.dim() - 1)))
        return torch.where(m, torch.zeros((), dtype=t.dtype, device=t.device), t)

    for it in items:
        if isinstance(it, PerExample):
            out.append(PerExample(z(it.g)))
        else:
            assert isinstance(it, Outer)
            out.append(Outer(z(it.left), z(it.right), it.shape))
    return out
