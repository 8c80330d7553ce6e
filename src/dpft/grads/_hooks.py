"""Shared machinery of the book-keeping engine: per-example gradient *contributions* and the
forward/backward capture that produces them.

Book-keeping (Bu, Wang, Zha, Karypis, ICML 2023, "Differentially private optimization on large
model at small cost", the book-keeping algorithm) needs, for every trainable layer, the input activations ``A``
kept by a forward hook and the output gradients ``B`` seen by a backward hook. Each layer file
(``linear.py``, ``embedding.py``, ...) turns ``(A, B)`` into one :class:`Contribution` per
parameter; this module owns the algebra every layer kind shares:

* :class:`PerExample` -- an instantiated per-example gradient ``(B, *param.shape)``; used where it
  is as small as the activations (biases, LayerNorm/RMSNorm weights, fallback modules).
* :class:`Outer` -- a per-example gradient of a 2-D parameter ``(R, C)`` kept in factored form
  ``g_i = sum_t u_{i,t} v_{i,t}^T`` with ``U: (B, T, R)`` and ``V: (B, T, C)``. Either side may be
  an *index* side ``(B, T)`` int64 standing for one-hot rows (embedding tables). Its squared norm
  is the ghost norm (Li, Tramer, Liang, Hashimoto, ICLR 2022, "Large language models can be
  strong differentially private learners", ghost clipping; as used by Bu et al. 2023)::

      ||g_i||_F^2 = <U_i U_i^T, V_i V_i^T>_F          cost B T^2 (R + C)

  or, when cheaper, the instantiated ``||U_i^T V_i||_F^2`` (cost ``B T R C``, computed in
  example chunks so at most ~``_CHUNK_ELEMS`` floats exist at once). The clipped sum
  ``sum_i c_i U_i^T V_i`` is ONE matrix product ``(c*U)^T V`` over the ``B*T`` rows (or one
  ``index_add_`` for an index side), so no second backward pass is needed.

Several contributions to the same parameter (tied weights such as an embedding shared with the
LM head, or a module called twice) are summed *before* taking the norm, with exact cross terms
``2 <g_a, g_b>`` (see :func:`cross`).

The capture (:class:`Capture`) registers forward hooks on the trainable modules only for the
duration of one forward pass. During the main pass the engine switches the trainable
parameters to ``requires_grad=False``: autograd then never computes a weight gradient (no
``.grad`` is ever written) and the only backward work is activation-gradient propagation. Module
outputs that thereby lose ``requires_grad`` are re-marked as graph leaves, and the engine asks
``torch.autograd.grad`` for those leaves only; all other output gradients arrive in tensor
hooks, where each layer immediately reduces them to its contributions.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

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


# --------------------------------------------------------------------------- layer kinds


class LayerKind:
    """A module kind the engine knows. Subclasses live in one file per kind and register
    themselves with ``@register_layer(nn.Module subclass)`` (``grads/registry.py``), as user
    rules for custom modules do.

    ``save`` runs in the forward hook and keeps what the backward needs (detached);
    ``contributions`` runs when the output gradients arrive and returns one
    :class:`Contribution` per parameter role (attribute path inside the module).
    """

    name = "layer"
    #: Module classes this rule was registered for (set by ``grads.registry.register_layer``).
    registered_for: tuple = ()

    def matches(self, module: nn.Module) -> bool:
        """Whether this rule applies to ``module``. Default: it is an instance of a class the
        rule was registered for (``@register_layer(cls)``); override to refuse variants."""
        if self.registered_for:
            return isinstance(module, self.registered_for)
        raise NotImplementedError(f"{type(self).__name__}.matches is not defined and the rule is not registered")

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        """Parameter attribute paths this kind can account for."""
        raise NotImplementedError

    def save(self, module: nn.Module, args: tuple, kwargs: dict, output: Any,
             batch: int) -> tuple[Any, Any, list[torch.Tensor]]:
        """Return ``(state, replacement_output_or_None, tensors_whose_version_to_check)``."""
        raise NotImplementedError

    def contributions(self, module: nn.Module, state: Any, grads: list[Optional[torch.Tensor]],
                      roles: tuple[str, ...]) -> dict[str, Contribution]:
        raise NotImplementedError


def first_input(args: tuple, kwargs: dict, name: str = "input") -> torch.Tensor:
    if args:
        return args[0]
    if name in kwargs:
        return kwargs[name]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def check_batch(t: torch.Tensor, batch: int, label: str) -> None:
    if t.dim() == 0 or t.shape[0] != batch:
        raise BatchLayoutError(_layout_msg(t, batch, label))


def _layout_msg(t: torch.Tensor, batch: int, label: str) -> str:
    return (f"{label}: the book-keeping engine needs the example dimension first (or a token-major "
            f"flattening (B*n, ...) of it), but this module received a tensor of shape "
            f"{tuple(t.shape)} for a micro-batch of {batch} examples (a parameter used on a "
            "batch-independent tensor); freeze this module's parameters or train it with LoRA, or "
            "use ReferenceEngine (exact, one backward per example)")


@dataclass
class LayoutError:
    """State of a module call whose input is not batch-first. Harmless while no gradient reaches
    the call's outputs (peft DoRA's ``lora_B(lora_A(eye))``, detached); :class:`Capture` raises
    :class:`BatchLayoutError` with ``msg`` if one does."""

    msg: str


def batch_first(t: torch.Tensor, batch: int, label: str) -> torch.Tensor:
    """``t`` with the example dimension first: ``(B, ...)`` as is, or a flattened token-major
    ``(B*n, ...)`` (row ``r`` belongs to example ``r // n``: ``x.reshape(-1, d)`` of a
    ``(B, n, d)`` tensor, as OPT's decoder layers and mixture-of-experts blocks do) reshaped
    to ``(B, n, ...)``. The row-to-example map is checked on the first micro-batch
    (:func:`check_example_support`).

    Raises:
        BatchLayoutError: the leading dimension is neither ``B`` nor a multiple of it.
    """
    if t.dim() > 0 and t.shape[0] == batch:
        return t
    if t.dim() > 0 and batch > 0 and t.shape[0] > batch and t.shape[0] % batch == 0:
        return t.reshape(batch, t.shape[0] // batch, *t.shape[1:])
    raise BatchLayoutError(_layout_msg(t, batch, label))


def save_input(args: tuple, kwargs: dict, batch: int, label: str):
    """``LayerKind.save`` for kinds whose state is their detached first input ``x``:
    returns ``(x, None, [x])`` with ``x`` batch-first (:func:`batch_first`; a flattened
    ``(B*n, d)`` input becomes ``(B, n, d)``, and the output gradients the rule receives are
    reshaped the same way). An input that is not batch-first gives a :class:`LayoutError` state:
    an error if a gradient reaches that call."""
    x = first_input(args, kwargs).detach()
    try:
        return batch_first(x, batch, label), None, [x]
    except BatchLayoutError as e:
        return LayoutError(str(e)), None, []


#: While set (thread-local), Capture's gradient hooks ignore what they see (the engine's own
#: extra backward passes of :func:`check_example_support`).
_SUSPEND = threading.local()


def check_example_support(losses: torch.Tensor, outputs: list[tuple[torch.Tensor, str]]) -> None:
    """Check that each recorded module output's rows belong to the example the engine assigns
    them to: row block ``i`` of ``out.reshape(B, -1)`` may influence ``losses[i]`` only.

    Two extra backward passes (first micro-batch only): ``G1 = d(sum_i l_i)/d out`` and
    ``Gw = d(sum_i w_i l_i)/d out`` with ``w_i = 2^(i mod 16)``. If block ``i`` of ``out``
    influences only ``l_i`` then ``Gw_i = w_i G1_i`` exactly; any influence on another example
    ``j`` adds ``(w_j - w_i) dl_j/d out_i``.

    Raises:
        BatchLayoutError: naming the module whose output mixes examples.
    """
    b = losses.shape[0]
    outs = [(t, lab) for t, lab in outputs if t.requires_grad and t.numel() % b == 0]
    if b < 2 or not outs or not losses.requires_grad:
        return
    # Powers of two: scaling a gradient by 2^k is exact in floating point, so Gw_i = w_i G1_i
    # holds bit for bit (fp32 or bf16/fp16 autocast alike) unless examples mix. (Examples i and
    # i + 16 get the same weight; a layout error mixes every example, neighbours included.)
    w = torch.tensor([2.0 ** (i % 16) for i in range(b)], device=losses.device, dtype=losses.dtype)
    tens = [t for t, _ in outs]
    _SUSPEND.on = True
    try:
        g1 = torch.autograd.grad(losses.sum(), tens, retain_graph=True, allow_unused=True)
        gw = torch.autograd.grad((losses * w).sum(), tens, retain_graph=True, allow_unused=True)
    except RuntimeError as e:
        if "reentrant" not in str(e):
            raise
        # Reentrant activation checkpointing refuses autograd.grad: batch-first outputs are
        # taken as before; a flattened one cannot be verified, so it is refused.
        flat = [lab for t, lab in outs if t.shape[0] != b]
        if flat:
            raise BatchLayoutError(
                f"{flat[0]}: a flattened (B*n, ...) output cannot be checked under reentrant "
                "activation checkpointing; use gradient_checkpointing_kwargs="
                "{'use_reentrant': False}") from None
        return
    finally:
        _SUSPEND.on = False
    for (t, lab), a, c in zip(outs, g1, gw):
        if a is None or c is None:
            continue
        a = a.float().reshape(b, -1) * w.float()[:, None]
        c = c.float().reshape(b, -1)
        scale = float(torch.maximum(a.abs().max(), c.abs().max()))
        if scale > 0 and float((c - a).abs().max()) > 1e-5 * scale:
            raise BatchLayoutError(
                f"{lab}: its output of shape {tuple(t.shape)} is not laid out example by example "
                f"(rows the engine assigns to one of the {b} examples influence the loss of "
                "another): a parameter used on a batch-independent or example-mixing tensor. Freeze "
                "this module's parameters or train it with LoRA, or use ReferenceEngine (exact, one "
                "backward per example)")


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """``(B, ..., d) -> (B, T, d)`` with ``T`` the product of the middle dims (1 for 2-D)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


# --------------------------------------------------------------------------- capture


@dataclass(eq=False)
class Unit:
    """One module with trainable parameters and the kind that accounts for them."""

    module: nn.Module
    kind: LayerKind
    roles: dict[str, str]  # role (attribute path in module) -> engine parameter name
    label: str  # qualified module name
    clone_input: bool = False
    #: Outputs recorded on a checking pass, for :func:`check_example_support` (then cleared).
    check_outputs: list = field(default_factory=list)


@dataclass(eq=False)
class _Record:
    unit: Unit
    state: Any
    grads: list = field(default_factory=list)
    pending: int = 0
    done: bool = False
    #: Per output slot: ``n`` when that output is a flattened ``(B*n, ...)`` (its gradient is
    #: reshaped to ``(B, n, ...)`` before the rule sees it), else 0.
    flat: list = field(default_factory=list)


class Capture:
    """Hooks the units' forward calls for one pass.

    ``mode="main"``: records activations, makes outputs differentiable leaves where needed,
    and collects contributions (``self.contribs``: parameter name -> list) as gradients
    arrive. ``mode="probe"``: only counts calls and watches in-place modifications.

    Activation checkpointing (``torch.utils.checkpoint``, Hugging Face
    ``gradient_checkpointing_enable``) re-runs forwards inside the backward, and the unit hooks
    fire again there. :meth:`backward` keeps them registered for that, and every call is
    counted exactly once:

    * **non-reentrant** checkpointing (``use_reentrant=False``, PyTorch's default) runs the
      original forward with grad enabled and builds the real graph; the call is recorded then.
      The recomputation only refills saved tensors; there the hook only *replays* what it did
      to the graph (marking an output a leaf) so the recomputed graph has the same saved
      tensors, and records nothing.
    * **reentrant** checkpointing runs the original forward under ``no_grad`` (no graph, so
      nothing can be recorded) and the recomputation inside the backward builds the graph the
      gradients flow through; the call is recorded there, once. A unit call under ``no_grad``
      is counted as pending, and only a pending call is recorded when it is re-run.

    A record whose outputs never receive a gradient contributes nothing, so even a
    misclassified re-run cannot add an activation twice.
    """

    def __init__(self, units: list[Unit], batch: int, mode: str = "main",
                 clone_all: bool = False, keep_fallback_inputs: bool = False,
                 check_outputs: Optional[bool] = None):
        self.units = units
        #: Keep every recorded output on its unit for :func:`check_example_support` (the
        #: checking pass: the probe, or the first micro-batch of a user-driven loop).
        self.check_outputs = (mode == "probe" or clone_all) if check_outputs is None else check_outputs
        self.batch = batch
        self.mode = mode
        #: Copy every saved input while still watching the originals for in-place changes (the
        #: first micro-batch of a user-driven loop, before the in-place check has run).
        self.clone_all = clone_all
        #: Main mode: also keep fallback modules' saved inputs in ``probe_inputs`` (usage check).
        self.keep_fallback_inputs = keep_fallback_inputs
        self.active = False
        #: ``forward`` inside ``with capture``; ``backward`` while re-run forwards are expected.
        self.phase = "forward"
        self.handles: list = []
        self.leaves: list[tuple[torch.Tensor, _Record, int]] = []
        self.records: list[_Record] = []
        self.contribs: dict[str, list[Contribution]] = {}
        self.versions: list[tuple[torch.Tensor, int, Unit]] = []
        self.calls: dict[int, int] = {}  # id(unit) -> number of calls
        self.probe_inputs: dict[int, list] = {}  # id(unit) -> saved states (probe mode)
        #: id(unit) -> calls made under no_grad in the forward, not yet re-run (reentrant
        #: checkpointing re-runs them in the backward, where they are recorded).
        self.pending: dict[int, int] = {}
        #: A forward was re-run inside the backward (activation checkpointing in use).
        self.recomputed = False

    def _register(self) -> None:
        if not self.handles:
            for u in self.units:
                self.handles.append(
                    u.module.register_forward_hook(self._make_hook(u), with_kwargs=True)
                )

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> "Capture":
        self.phase = "forward"
        self._register()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._remove()

    def open_backward(self) -> None:
        """Keep the hooks on while the backward runs (forwards re-run by checkpointing)."""
        self.phase = "backward"
        self.active = True
        self._register()

    def close(self) -> None:
        """Remove the hooks."""
        self.active = False
        self._remove()

    def _make_hook(self, unit: Unit) -> Callable:
        def hook(module, args, kwargs, output):
            if not self.active:
                return None
            if self.phase == "backward":
                if not in_backward():  # a forward of a submodule after the pass: not ours
                    return None
                return self._on_recompute(unit, args, kwargs, output)
            return self._on_forward(unit, args, kwargs, output)

        return hook

    def _save(self, unit: Unit, args, kwargs, output):
        state, new_out, watched = unit.kind.save(unit.module, args, kwargs, output, self.batch)
        if unit.clone_input or self.clone_all:  # the model modifies this input in place later
            state = torch.utils._pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state
            )
            if unit.clone_input:
                watched = []
        return state, new_out, watched

    def _on_forward(self, unit: Unit, args, kwargs, output):
        self.calls[id(unit)] = self.calls.get(id(unit), 0) + 1
        if self.mode != "probe" and not torch.is_grad_enabled():
            # No graph is built (a reentrant checkpoint's first pass, or a no_grad region):
            # this call's output cannot receive a gradient here. Reentrant checkpointing
            # re-runs it inside the backward, where it is recorded.
            self.pending[id(unit)] = self.pending.get(id(unit), 0) + 1
            return None
        state, new_out, watched = self._save(unit, args, kwargs, output)
        for t in watched:
            self.versions.append((t, t._version, unit))
        if self.mode == "probe":
            self.probe_inputs.setdefault(id(unit), []).append(state)
            if self.check_outputs:
                self._keep_outputs(unit, new_out if new_out is not None else output)
            return new_out
        if self.keep_fallback_inputs and getattr(unit.kind, "is_fallback", False):
            self.probe_inputs.setdefault(id(unit), []).append(state)
        return self._record(unit, state, new_out, output, leaves=True)

    def _keep_outputs(self, unit: Unit, out) -> None:
        b = self.batch
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
                    and t.shape[0] % b == 0):
                unit.check_outputs.append((t, unit.label))

    def _record(self, unit: Unit, state, new_out, output, leaves: bool):
        out = new_out if new_out is not None else output
        flat, spec = torch.utils._pytree.tree_flatten(out)
        rec = _Record(unit, state)
        slots = [k for k, t in enumerate(flat)
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
        rec.grads = [None] * len(slots)
        rec.pending = len(slots)
        b = self.batch
        rec.flat = [flat[k].shape[0] // b if (flat[k].dim() > 0 and flat[k].shape[0] != b
                                              and flat[k].shape[0] % b == 0) else 0 for k in slots]
        self.records.append(rec)
        if len(slots) > 1 and any(flat[k].requires_grad for k in slots):
            # Several outputs, one maybe computed from another inside the module (a router's
            # scores from its logits): a hook on the upstream one would also receive the
            # gradient flowing back from the other through the module. Each output is handed
            # on as a fresh alias whose gradient comes from the uses after the module only.
            for k in slots:
                if flat[k].requires_grad:
                    flat[k] = flat[k].view_as(flat[k])
            new_out = torch.utils._pytree.tree_unflatten(flat, spec)
        for slot, k in enumerate(slots):
            t = flat[k]
            if t.requires_grad:
                t.register_hook(self._grad_hook(rec, slot))
            else:
                # No trainable input upstream and the weights are switched off: make the output
                # a graph leaf so its gradient (the layer's "B") is computed.
                t.requires_grad_(True)
                if leaves:
                    self.leaves.append((t, rec, slot))
                else:
                    t.register_hook(self._grad_hook(rec, slot))
        if self.check_outputs and leaves:
            self._keep_outputs(unit, out)
        return new_out

    def _on_recompute(self, unit: Unit, args, kwargs, output):
        """A unit's forward re-run inside the backward by activation checkpointing."""
        self.recomputed = True
        if self.mode == "probe":
            return None
        if self.pending.get(id(unit), 0) > 0:
            # Reentrant: the original call ran without a graph; this one's graph is the one
            # the gradients flow through.
            self.pending[id(unit)] -= 1
            state, new_out, _ = self._save(unit, args, kwargs, output)
            return self._record(unit, state, new_out, output, leaves=False)
        # Non-reentrant: already recorded in the forward. Replay the graph change only (the
        # recomputed graph must save the same tensors as the original one).
        _, new_out, _ = unit.kind.save(unit.module, args, kwargs, output, self.batch)
        out = new_out if new_out is not None else output
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
                t.requires_grad_(True)
        return new_out

    def _grad_hook(self, rec: _Record, slot: int) -> Callable:
        def h(g):
            if getattr(_SUSPEND, "on", False):
                return None
            self._deliver(rec, slot, g)
            return None

        return h

    def _deliver(self, rec: _Record, slot: int, g: Optional[torch.Tensor]) -> None:
        if rec.done:
            return
        rec.grads[slot] = g
        rec.pending -= 1
        if rec.pending == 0:
            self._finish(rec)

    def _finish(self, rec: _Record) -> None:
        rec.done = True
        if all(g is None for g in rec.grads):
            rec.state = None
            return
        u = rec.unit
        if isinstance(rec.state, LayoutError):
            raise BatchLayoutError(f"{u.label}: {rec.state.msg}")
        b = self.batch
        grads = [g.reshape(b, n, *g.shape[1:]) if (g is not None and n) else g
                 for g, n in zip(rec.grads, rec.flat or [0] * len(rec.grads))]
        # A fallback rule re-runs its module here (inside the backward): that is no
        # checkpoint recomputation, so the unit hooks stay quiet meanwhile.
        active, self.active = self.active, False
        try:
            with full_precision():
                out = u.kind.contributions(u.module, rec.state, grads, tuple(u.roles))
        finally:
            self.active = active
        rec.state = None
        rec.grads = []
        for role, c in out.items():
            if c is not None:
                self.contribs.setdefault(u.roles[role], []).append(c)

    def changed_inputs(self) -> list[Unit]:
        """Units whose saved tensors were modified in place after the module ran."""
        return [u for t, v, u in self.versions if t._version != v]

    def backward(self, loss: torch.Tensor) -> None:
        """Propagate activation gradients only; deliver the leaves' gradients; flush.

        ``loss.backward()`` with tensor hooks on the leaves (not ``torch.autograd.grad`` on
        them: reentrant checkpointing refuses ``autograd.grad``, and an output made to
        require grad by someone else, e.g. Hugging Face's ``enable_input_require_grads``, is a
        leaf this capture did not create). The leaves are this pass's own temporaries; no
        parameter requires grad during the pass, so no ``p.grad`` is written.
        """
        if loss.requires_grad:
            for t, rec, slot in self.leaves:
                t.register_hook(self._grad_hook(rec, slot))
            self.open_backward()
            try:
                loss.backward()
            finally:
                self.close()
        for rec in self.records:  # outputs that never received a gradient count as zero
            if not rec.done:
                self._finish(rec)
        self.leaves.clear()
        self.records.clear()
        self.versions.clear()
