"""Book-keeping per-example clipping: one forward, one backward, no per-example gradient of the
whole model (issue 3).

Method: Bu, Wang, Zha, Karypis, "Differentially Private Optimization on Large Model at Small
Cost" (ICML 2023, "fastDP"), the book-keeping (BK) algorithm, with the ghost norm of Li et al. 2022
("Large Language Models Can Be Strong Differentially Private Learners", ghost clipping) and the
mixed ghost/instantiated choice per layer of Bu et al. 2022 ("Scalable and efficient training
of large convolutional neural networks with differential privacy", mixed ghost clipping).

One step on a micro-batch of ``B`` examples:

1. forward with hooks on every module that owns a trainable parameter: the layer's input
   ``A`` is kept (the trainable parameters are switched to ``requires_grad=False`` for the
   pass, so autograd never builds or computes a weight gradient and ``p.grad`` is untouched);
2. one backward of ``sum_i loss_i`` that propagates activation gradients only; each layer's
   output gradient ``G`` is caught by a tensor hook and reduced by the layer's rule (one file
   per kind: ``linear.py``, ``embedding.py``, ``layernorm.py``, ``rmsnorm.py``, ``conv1d.py``,
   ``lora.py``) to per-parameter contributions: small per-example gradients ``(B, *shape)``
   or factors ``(G, A)`` of a 2-D weight (``_hooks.py``);
3. squared norms ``(B, G)`` per trainable parameter: ghost norms ``<A_i A_i^T, G_i G_i^T>`` or
   per-layer instantiation, whichever is cheaper, with exact cross terms for tied parameters;
4. clip factors from the policy (``grads/clip.py``; flat, per-layer and automatic are
   orthogonal to all of the above);
5. clipped sum per parameter as one matrix product ``(c * G)^T A`` (or ``index_add_`` for an
   embedding) -- no second backward pass.

Rules are looked up in the registry (``grads/registry.py``): the built-in kinds register
themselves with ``@register_layer(nn.Module subclass)``, and so can a user's custom module
without forking dpft. A module that owns trainable parameters but has no rule falls back, for that module alone, to
exact per-example gradients by ``torch.func`` (``vmap(grad)`` of ``<module(x_i), G_i>``), with a
one-time warning naming its class. On the first call the engine also checks on one example
that every use of a trainable parameter in the autograd graph is accounted for by a hooked
module call (a weight used outside its module's forward, e.g. ``F.linear(h, emb.weight)``,
cannot be attributed and is refused) and which modules' inputs the model later modifies in
place (those inputs are then copied).

Activation checkpointing (Hugging Face ``gradient_checkpointing_enable``, reentrant or not, and
plain ``torch.utils.checkpoint``) is supported: forwards re-run inside the backward are told
apart from the original calls (``_hooks.Capture``), so each module call is recorded once. Mixed
precision (``engine.precision``, :class:`dpft.grads.precision.Precision`): the forward runs under autocast,
the backward outside it, and norms, clip factors and the clipped sum are computed in fp32 from
the captured (bf16/fp16) factors; under fp16 a static loss scale is divided out before the
norms and an example that overflows contributes 0.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils import _pytree as pytree

from dpft.grads.capture import Capture, Unit
from dpft.grads.contrib import (NORM_MODES, GramCache, Outer, PerExample, ScaledCache, full_precision, merge, sq_norm,
                                use_ghost, weighted_sum, zero_examples)
from dpft.grads.contrib import BatchLayoutError
from dpft.grads.kinds import LayerKind, LayoutError, check_example_support
from dpft.grads.base import ClippedBatch, PerExampleEngine, PerExampleLoss
from dpft.grads.groups import group_contributions, n_groups, split_groups
from dpft.grads.registry import KINDS as _KINDS_VIEW
from dpft.grads.lora import check_adapter_layers
from dpft.grads.registry import register_layer, rule_for, rules_for
from dpft.grads.clip import ClipPolicy, check_finite_norms


#: The layer rules: a live view of the registry (it was a closed tuple before
#: ``register_layer``; still importable, iterable and indexable).
KINDS = _KINDS_VIEW

_warned_fallback: set[str] = set()


class UnattributedUseError(NotImplementedError):
    """A trainable parameter is used outside the forward of the module(s) that own it."""


class FallbackKind(LayerKind):
    """Exact per-example gradients of one module's own parameters with ``torch.func``.

    Given the module's stored inputs ``x`` (any args/kwargs; tensors whose leading dimension is
    ``B`` are per example, others are shared) and the output gradients ``G``, it computes
    ``g_i = d/dtheta <module(x_i; theta), G_i>`` for every example with ``vmap(grad(...))``
    (a Python loop if the module cannot be vmapped). Memory ``(B, *shape)`` for this module's
    parameters only. Assumes the module is deterministic (no dropout inside it).
    """

    name = "torch.func fallback"
    is_fallback = True

    def matches(self, module: nn.Module) -> bool:  # assigned explicitly, never matched
        return False

    def roles(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(n for n, _ in module.named_parameters())

    def save(self, module, args, kwargs, output, batch):
        state = pytree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, (args, kwargs)
        )
        watched = [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
        leaves, spec = pytree.tree_flatten(output)
        outs = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        lead = {t.shape[0] if t.dim() else None for t in outs}
        new_out = None
        rows = 0  # n > 0: every output is a flattened token-major (B*n, ...) tensor
        shared = False  # the output is batch-independent: every input is shared by all examples
        if batch > 1 and lead == {1} and type(module).__module__.startswith("peft.tuners.lora.dora"):
            # A DoRA magnitude on a shared tensor (a relative-position table projected once for
            # the batch; DeBERTa-v2's is handed per example by grads/relbias.py): its lora_A/lora_B on the same tensor have no per-example rule
            # either (kinds.py LayoutError), and expanding its output to (B, ...) breaks model code
            # that keeps that tensor's batch dim of 1 (a bmm shape error). Refused like them, by
            # name, if a gradient reaches it (Capture, verify_uses).
            return LayoutError(
                f"a DoRA magnitude applied to a tensor without the example dimension (output shape "
                f"{tuple(outs[0].shape)} for {batch} examples: a table shared by every example, such as "
                "a relative-position table), so neither it nor the layer's lora_A/lora_B has an exact "
                "per-example rule (the torch.func fallback would have to expand that tensor per example). "
                "Leave this layer out of target_modules, or "
                "use ReferenceEngine (exact, one backward per example)"), None, []
        if batch > 1 and lead == {1}:
            shared = True
            # Batch-independent output used by every example (a learned position table called
            # with (1, T) positions): expanded to (B, ...) (stride-0 view, same values) so that
            # each example's output gradient arrives on its own.
            leaves = [t.expand(batch, *t.shape[1:]) if isinstance(t, torch.Tensor)
                      and t.is_floating_point() else t for t in leaves]
            new_out = pytree.tree_unflatten(leaves, spec)
            outs = [t.expand(batch, *t.shape[1:]) for t in outs]
        elif (len(lead) == 1 and None not in lead and batch not in lead
              and next(iter(lead)) % batch == 0):
            rows = next(iter(lead)) // batch
        for t in outs:
            if t.dim() == 0 or (t.shape[0] != batch and not rows):
                raise RuntimeError(
                    f"{type(module).__name__}: fallback needs outputs with the example "
                    f"dimension first (or all flattened token-major (B*n, ...)); got shape "
                    f"{tuple(t.shape)} for {batch} examples"
                )
        metas = [(t.shape, t.dtype, t.device) for t in outs]
        return (state, metas, batch, rows, shared), new_out, watched

    def contributions(self, module, state, grads, roles):
        (args, kwargs), metas, batch, rows, shared = state
        cots = [g if g is not None else torch.zeros(m[0], dtype=m[1], device=m[2])
                for g, m in zip(grads, metas)]
        cots = [c.reshape(batch, -1) for c in cots]  # example i's block of every output
        params = {r: module.get_parameter(r).detach() for r in roles}
        flat, spec = pytree.tree_flatten((args, kwargs))
        # Per-example inputs: leading dim B (each example sees a batch of one), or, when the
        # outputs are flattened (B*n, ...), inputs with that leading dim (each example sees its
        # own n rows). Every other tensor is shared by all examples.
        lead = rows * batch if rows else batch
        # A batch-independent output was computed from shared inputs only, even one whose leading
        # dim happens to equal B (BART's decoder positions (T,) with T = B): none is per example.
        bidx = [] if shared else [k for k, t in enumerate(flat)
                                  if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == lead]

        def inner(p, batched, cot):
            leaves = list(flat)
            for k, v in zip(bidx, batched):
                leaves[k] = v if rows else v.unsqueeze(0)
            a, kw = pytree.tree_unflatten(leaves, spec)
            out = functional_call(module, p, a, kw, strict=False)
            outs = [t for t in pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
            return sum((o * c.reshape(o.shape).to(o.dtype)).sum() for o, c in zip(outs, cot))

        g = grad(inner)
        batched = [flat[k].reshape(batch, rows, *flat[k].shape[1:]) if rows else flat[k]
                   for k in bidx]
        try:
            per_ex = vmap(g, in_dims=(None, 0, 0), randomness="different")(params, batched, cots)
        except Exception:  # noqa: BLE001 - not vmappable: same math, one example at a time
            outs = [g(params, [b[i] for b in batched], [c[i] for c in cots])
                    for i in range(batch)]
            per_ex = {r: torch.stack([o[r] for o in outs]) for r in params}
        return {r: PerExample(per_ex[r].detach()) for r in roles}


def _batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    if "input_ids" in batch:
        return int(batch["input_ids"].shape[0])
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ValueError("cannot infer the micro-batch size: the batch holds no tensor")


def _count_uses(roots: list[Any], wanted: set[int]) -> Counter:
    """Number of autograd edges into each wanted parameter's AccumulateGrad node."""
    counts: Counter = Counter()
    seen: set = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                if id(var) in wanted:
                    counts[id(var)] += 1
                continue
            stack.append(nxt)
    return counts


def discover_units(model: nn.Module, params: Mapping[str, nn.Parameter],
                   kinds: tuple[LayerKind, ...] | None = None) -> list[Unit]:
    """Map every module that owns a trainable parameter to the rule that accounts for it.

    Rules come from the registry (``grads/registry.py``: most specific class first, user
    registrations before built-ins); an explicit ``kinds`` tuple is tried in order instead.

    Raises:
        dpft.grads.lora.UnknownAdapterError: a trainable peft adapter layer type (or LoRA
            variant) the rules were not verified against.

    A parameter registered on several modules (tied weights) gives one unit per module, all
    naming the same engine parameter. Parameters held in a ``ParameterDict``/``ParameterList``
    are attributed to the container's parent (the module whose forward uses them).
    """
    pid = {id(p): n for n, p in params.items()}
    check_adapter_layers(model, {id(p) for p in params.values()})
    named = dict(model.named_modules())
    owners: dict[int, tuple[str, nn.Module, dict[str, str]]] = {}
    # Parameters of a child that a rule of its parent accounts for (kinds.LayerKind.claims: T5's
    # relative-attention bias table, which only the attention can hand a per-example copy).
    claimed = {} if kinds is not None else _claimed_parameters(model, set(pid))
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None or id(p) not in pid:
                continue
            if (id(m), pname) in claimed:
                owner, role, label = claimed[(id(m), pname)]
            elif isinstance(m, (nn.ParameterDict, nn.ParameterList)) and mname:
                parent, _, child = mname.rpartition(".")
                owner, role, label = named[parent], f"{child}.{pname}", parent
            else:
                owner, role, label = m, pname, mname
            owners.setdefault(id(owner), (label, owner, {}))[2][role] = pid[id(p)]
    units = []
    for label, owner, roles in owners.values():
        if kinds is None:
            kind = rule_for(owner, roles)
        else:
            kind = next(
                (k for k in kinds if k.matches(owner) and set(roles) <= set(k.roles(owner))), None
            )
        if kind is None:
            cls = type(owner).__name__
            if cls not in _warned_fallback:
                warnings.warn(
                    f"book-keeping engine: no fast rule for module class {cls} (e.g. "
                    f"{label or '<root>'}: {sorted(roles)}); its parameters get exact "
                    "per-example gradients via torch.func instead (slower, B x its size in "
                    "memory); give it a rule with @dpft.grads.registry.register_layer"
                    f"({cls})",
                    stacklevel=3,
                )
                _warned_fallback.add(cls)
            kind = FallbackKind()
        units.append(Unit(owner, kind, roles, label or "<root>"))
    if kinds is None:  # modules hooked only to hand a shared tensor per example (LayerKind.layout_only)
        trainable = set(pid)
        for mname, m in model.named_modules():
            lay = next((k for k in rules_for(m) if k.layout_only), None)
            if lay is not None and lay.needed(m, trainable, bool(claimed)):
                units.append(Unit(m, lay, {}, mname or "<root>"))
    return units


def _claimed_parameters(model: nn.Module, trainable: set[int]) -> dict[tuple[int, str], tuple]:
    """``(id(child module), parameter name) -> (parent module, role path, parent label)`` for the
    trainable parameters that a rule of an ancestor claims (``LayerKind.claims``)."""
    out: dict[tuple[int, str], tuple] = {}
    for mname, m in model.named_modules():
        for kind in rules_for(m):
            paths = [q for q in kind.claims(m) if id(m.get_parameter(q)) in trainable]
            if not paths:
                continue
            for q in paths:
                child, _, pname = q.rpartition(".")
                out[(id(m.get_submodule(child)), pname)] = (m, q, mname or "<root>")
            break
    return out


class BookKeepingEngine(PerExampleEngine):
    """Per-example clipped gradient sums at (close to) non-private cost.

    Args:
        model: the network; trainable parameters are those with ``requires_grad``. The model
            must keep the example dimension first in every hooked module's input and output
            and must not take inputs that require grad. Activation checkpointing is fine.
        loss_fn: per-example loss ``(B,)`` (nats), see :data:`dpft.grads.base.PerExampleLoss`.
        clip: clip policy; it sees only the ``(B, G)`` squared norms.
        norm_mode: ``"auto"`` (per layer, the cheaper of ghost norm and instantiation),
            ``"ghost"`` or ``"instantiate"`` (forced; for tests and benchmarks).

    ``clipped_sum`` returns the same :class:`ClippedBatch` as ``ReferenceEngine`` (``grad_sum``
    per trainable parameter in fp32, ``sq_norms``/``scales`` ``(B, G)``) and never touches
    ``p.grad``. ``engine.precision`` (set by the caller; fp32 by default) puts the forward under
    autocast and, for fp16, scales the loss by a static factor.

    Raises:
        ValueError: no trainable parameter, or unknown ``norm_mode``.
        UnattributedUseError: (first call) a trainable parameter is used outside the forward
            of the modules that own it.
        dpft.grads._hooks.BatchLayoutError: a hooked module sees a flattened/broadcast batch.
    """

    def __init__(self, model: nn.Module, loss_fn: PerExampleLoss, clip: ClipPolicy,
                 norm_mode: str = "auto"):
        super().__init__(model, loss_fn, clip)
        if norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode must be one of {NORM_MODES}, got {norm_mode!r}")
        self.norm_mode = norm_mode
        self.units = discover_units(model, self.params)
        self._checked = False
        #: A forward was seen re-run inside the backward (activation checkpointing).
        self.recomputes = False

    supports_precision = True
    #: ``(name, full clipped sum) -> tensor`` applied to each parameter's sum as soon as it is
    #: computed (FSDP: reduce-scatter, this rank's shard; dpft/placement/fsdp.py). None: kept whole.
    on_param_sum = None
    #: ``clipped_sum`` honours ``batch[GROUP_KEY]`` (user-level group clipping, grads/groups.py).
    supports_groups = True

    # ------------------------------------------------------------------ first-call check
    def _forward(self):
        return lambda **kw: self.model(**kw)

    def check_usage(self, batch: Mapping[str, torch.Tensor], groups: torch.Tensor | None = None) -> None:
        """One-example dry run: every graph use of a trainable parameter must come from a
        hooked module call; inputs modified in place later are marked to be copied.

        Raises:
            UnattributedUseError: with the offending parameter names.
        """
        # Two examples (when there are two): enough to check that every hooked output is laid
        # out example by example (check_example_support).
        nb = min(2, _batch_size(batch))
        if groups is not None and groups.numel():  # the rows of the first two groups
            nb = int((groups < min(2, int(groups.max()) + 1)).sum())
        b1 = {k: (v[:nb] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
              for k, v in batch.items()}
        cap = Capture(self.units, nb, mode="probe")
        with torch.enable_grad():
            with cap:
                losses = self.loss_fn(self._forward(), b1)
            for u in cap.changed_inputs():
                u.clone_input = True
            # The layout check's backward passes re-run checkpointed forwards: the hooks stay on
            # for them (a rule's pre_forward must hand those re-runs the same inputs).
            cap.open_backward()
            try:
                self.verify_uses(losses, cap.calls, cap.probe_inputs, None if groups is None else groups[:nb])
            finally:
                cap.close()
        self._checked = True

    def verify_uses(self, losses: torch.Tensor, calls: Mapping[int, int],
                    fallback_inputs: Mapping[int, list], groups: torch.Tensor | None = None) -> None:
        """Compare the autograd uses of every trainable parameter in ``losses``' graph (built
        with the parameters requiring grad) with the hooked module calls that account for them.

        Args:
            losses: per-example losses whose graph is inspected.
            calls: ``id(unit) -> number of calls`` seen by the capture.
            fallback_inputs: ``id(unit) -> saved FallbackKind states`` (re-run to count the
                uses inside a module without a rule).

        Raises:
            UnattributedUseError: with the offending parameter names.
        """
        wanted = {id(p) for p in self.params.values()}
        refused: list = []
        with torch.enable_grad():
            seen = _count_uses([losses.sum().grad_fn], wanted)
            expected: Counter = Counter()
            for u in self.units:
                n = calls.get(id(u), 0)
                if n == 0:
                    continue
                if isinstance(u.kind, FallbackKind):
                    for st in fallback_inputs.get(id(u), []):
                        if isinstance(st, LayoutError):  # a call without per-example rows
                            refused.append((u, st.msg))
                            continue
                        (args, kwargs), *_ = st
                        out = u.module(*args, **kwargs)
                        roots = [t.grad_fn for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor)]
                        expected.update(_count_uses(roots, wanted))
                else:
                    for role in u.roles:
                        expected[id(u.module.get_parameter(role))] += n
        outputs = [o for u in self.units for o in u.check_outputs]
        for u in self.units:
            u.check_outputs = []
        check_example_support(losses, outputs, groups)
        for u, msg in refused:  # its parameters reach the loss through a call with no example rows
            if any(seen[id(u.module.get_parameter(r))] > expected[id(u.module.get_parameter(r))] for r in u.roles):
                raise BatchLayoutError(f"{u.label}: {msg}")
        bad = [n for n, p in self.params.items() if seen[id(p)] > expected[id(p)]]
        if bad:
            raise UnattributedUseError(
                "book-keeping engine: these trainable parameters are used outside the forward "
                f"of the modules that own them, so their per-example gradients cannot be "
                f"attributed: {bad}. Use ReferenceEngine (exact, slower) for this model."
            )

    # ------------------------------------------------------------------ the step
    def clipped_sum(self, batch: Mapping[str, torch.Tensor]) -> ClippedBatch:
        """Per-example clipped sum; with ``batch[GROUP_KEY]`` (grads/groups.py) each group's
        summed gradient is clipped as one unit (user-level DP)."""
        batch, groups = split_groups(batch)
        if not self._checked:
            # The probe runs a forward (dropout draws): fork the RNG so that a resumed run, whose
            # first call comes at a later step, draws the same masks as an uninterrupted one.
            with torch.random.fork_rng(devices=_rng_devices(self.params.values())):
                self.check_usage(batch, groups)
        b = _batch_size(batch)
        params = list(self.params.values())
        flags = [p.requires_grad for p in params]
        cap = Capture(self.units, b, mode="main")
        s = float(self.precision.loss_scale)
        try:
            for p in params:
                p.requires_grad_(False)
            with torch.enable_grad():
                with cap, self.precision.autocast():
                    losses = self.loss_fn(self._forward(), batch)
                if losses.shape != (b,):
                    raise ValueError(
                        f"loss_fn must return per-example losses of shape ({b},), "
                        f"got {tuple(losses.shape)}"
                    )
                changed = cap.changed_inputs()
                if changed:
                    raise RuntimeError(
                        "inputs of " + ", ".join(sorted({u.label for u in changed}))
                        + " were modified in place after the module ran (not seen on the "
                        "first batch); the stored activations are stale"
                    )
                # Backward outside autocast (each op runs in the dtype its forward chose). A
                # static fp16 loss scale S multiplies every example's gradient by S; it is
                # divided out (grad_scale = 1/S) before norms are taken.
                cap.backward(losses.sum() * s if s != 1.0 else losses.sum())
        finally:
            cap.close()
            for p, f in zip(params, flags):
                p.requires_grad_(f)
        if cap.recomputed:
            self.recomputes = True
        return self.reduce(cap.contribs, b, float(losses.detach().sum()), losses.device,
                           grad_scale=1.0 / s, losses=losses, groups=groups)

    def reduce(self, contribs: dict[str, list], b: int, loss_sum: float, device=None,
               grad_scale: float = 1.0, losses: torch.Tensor | None = None,
               groups: torch.Tensor | None = None) -> ClippedBatch:
        """Norms, clip factors and the clipped sum from one micro-batch's captured
        contributions (``Capture.contribs``: parameter name -> list; consumed). All in fp32,
        with autocast off, whatever dtype the factors were captured in.

        Args:
            contribs: the contributions of the micro-batch's ``b`` examples.
            b: number of examples B.
            loss_sum: summed per-example loss (nats; private statistic).
            device: where empty results live.
            grad_scale: the true per-example gradient is ``grad_scale`` times the captured one
                (a loss that was a batch *mean*: ``grad_scale = B``; an fp16 loss scale S:
                ``1/S``); norms and sums are scaled before clipping so the clip sees each
                example's own gradient.
            losses: the ``(B,)`` per-example losses, if known (fp16: a non-finite one marks an
                overflowed example).
            groups: ``(B,)`` int64 group ids 0..G-1, or None. Given: the norm clipped is each
                group's summed gradient, exactly (``grads/groups.py``), and every row of a group
                gets the group's clip factor; ``sq_norms``/``scales`` are the group's, per row.

        Returns: the :class:`ClippedBatch` of ``clipped_sum``.
        """
        for u in self.units:  # outputs kept for a layout check that did not run (no criterion)
            u.check_outputs = []
        with full_precision():
            return self._reduce(contribs, b, loss_sum, device, grad_scale, losses, groups)

    def _group_norms(self, merged, groups, device, grad_scale) -> torch.Tensor:
        """``(B, G)`` squared norms of each row's *group* summed gradient (grads/groups.py)."""
        if self.precision.zero_nonfinite:
            raise ValueError("user-level (group) clipping does not support fp16 (an overflowed row would "
                             "change its user's norm); use perf.dtype: bf16 or fp32")
        gm = group_contributions(merged, groups)
        ng = n_groups(groups)
        cache = GramCache()
        for items in gm.values():
            for it in items:
                if isinstance(it, Outer) and use_ghost(it, self.norm_mode):
                    cache.expect(it.left)
                    cache.expect(it.right)
        sq = torch.stack([sq_norm(gm[n], ng, self.norm_mode, cache, device) for n in self.param_names], dim=1)
        if grad_scale != 1.0:
            sq = sq * float(grad_scale) ** 2
        check_finite_norms(sq)
        return sq[groups.to(sq.device)]

    def _reduce(self, contribs, b, loss_sum, device, grad_scale, losses, groups=None) -> ClippedBatch:
        names = self.param_names
        merged = {n: merge(contribs.pop(n, [])) for n in names}
        if groups is not None:
            # Group clipping: each row's "norm" is its group's; the clip factor of a group is then
            # the same for all its rows and Σ_i c_{u(i)} g_i = Σ_u c_u g_u (exact).
            sq = self._group_norms(merged, groups, device, grad_scale)
            return self._finish_reduce(merged, sq, None, b, loss_sum, grad_scale)
        cache = GramCache()
        for items in merged.values():
            for it in items:
                if isinstance(it, Outer) and use_ghost(it, self.norm_mode):
                    cache.expect(it.left)
                    cache.expect(it.right)
        sq = torch.stack(
            [sq_norm(merged[n], b, self.norm_mode, cache, device) for n in names], dim=1
        )
        del cache
        if grad_scale != 1.0:
            sq = sq * float(grad_scale) ** 2
        sq, bad = self.screen_overflow(sq, losses)
        overflowed = 0
        if bad is not None:  # fp16 overflow: these examples contribute 0
            merged = {n: zero_examples(items, bad) for n, items in merged.items()}
            overflowed = int(bad.sum())
            if losses is not None:
                loss_sum = float(losses.detach()[~bad].sum())
        check_finite_norms(sq)
        return self._finish_reduce(merged, sq, bad, b, loss_sum, grad_scale, overflowed)

    def _finish_reduce(self, merged, sq, bad, b, loss_sum, grad_scale=1.0, overflowed=0) -> ClippedBatch:
        """Clip factors from ``sq: (B, G)`` and the clipped sum of the merged contributions."""
        names = self.param_names
        scales = self.clip.scales(sq)
        if bad is not None:
            scales = scales.masked_fill(bad[:, None], 0.0)
        # Equal factors in every group (flat, automatic clipping): layers reading the same
        # input (q/k/v) share one scaled copy of it.
        uniform = bool((scales == scales[:, :1]).all())
        scaled = ScaledCache()
        for items in merged.values():
            for it in items:
                if isinstance(it, Outer) and not (it.left_index or it.right_index):
                    scaled.expect(it.left)
                    scaled.expect(it.right)
        weights = scales * float(grad_scale) if grad_scale != 1.0 else scales
        grad_sum = {}
        for j, n in enumerate(names):
            grad_sum[n] = weighted_sum(merged.pop(n), weights[:, j], self.params[n], scaled,
                                       0 if uniform else j).detach()
            if self.on_param_sum is not None:  # FSDP (dpft/placement/fsdp.py): reduce-scattered at once, one full sum alive
                grad_sum[n] = self.on_param_sum(n, grad_sum[n])
        return ClippedBatch(grad_sum, sq.detach(), scales.detach(), float(loss_sum), b, overflowed)


def _rng_devices(params) -> list[int]:
    """CUDA device indices the model's parameters live on (for ``fork_rng``)."""
    return sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})


__all__ = ["BookKeepingEngine", "FallbackKind", "KINDS", "UnattributedUseError",
           "discover_units", "register_layer", "PerExample", "Outer"]
