"""Methods through the Python ways in: ``make_private(methods=[…])`` and
``DPArguments(methods=[…])`` build the same plug-ins as ``dpft train`` and hand their ``build``
to the one plan builder (step/plan.py) as hooks. A method whose maths or phases need the
driver refuses with its reason (:meth:`Method.python_refusal`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel

from dpft.errors import PlanError
from dpft.methods.base import Method, Run, get_method, method_name

__all__ = ["python_methods", "python_hooks"]


def python_methods(methods: Optional[Sequence[Any]], where: str) -> list[Method]:
    """Validate ``methods``: each ``{"name": <registered method>, **its config keys}`` or a method
    config model instance.

    Raises:
        PlanError: an unknown method, a config error, a method switched off by its own config, or
            one that cannot run outside ``dpft train`` — each naming the fix.
    """
    out = []
    for i, item in enumerate(methods or []):
        try:
            if isinstance(item, BaseModel):
                name, cfg = method_name(item), item
                cls = get_method(name)
            else:
                if not isinstance(item, dict) or "name" not in item:
                    raise PlanError(f"methods[{i}]: expected {{'name': <method>, ...}}, got {type(item).__name__}")
                body = dict(item)
                name = body.pop("name")
                cls = get_method(name)
                cfg = cls.config.model_validate(body)
        except (KeyError, ValueError) as exc:
            raise PlanError(f"{where}: methods[{i}]: {exc}") from None
        if not cls.enabled(cfg):
            raise PlanError(f"{where}: method {name!r} is switched off by its own config; set the key that enables "
                            "it (e.g. {'name': 'rmt', 'method': 'rmt'})")
        why = cls.python_refusal(cfg)
        if why:
            raise PlanError(f"{where}: method {name!r} cannot run here: {why}")
        out.append(cls(cfg, None))
    return sorted(out, key=lambda m: m.order)


def python_hooks(methods: Sequence[Method], *, model, n: int, ledger, rng, where: str) -> list[Callable]:
    """The methods' ``build`` as the plan's hooks, over a :class:`~dpft.methods.base.Run` that
    holds what a Python way in knows (the model, N, the ledger, the secret randomness; no
    recipe, data or run folder)."""
    if not methods:
        return []
    ctx = Run(recipe=None, run_dir=Path("."), resume=False, progress=False, private=True, rng=rng, ledger=ledger,
              live_ledger_path=Path("."), task=None, tokenizer=None, model=model, loss_fn=None, train_tok=None,
              dev_tok=None, n=n, q=0.0, sampler=None, total_steps=0, evaluate=_no_eval, make_optimizer=_no_optimizer)
    return [lambda spec, m=m: m.build(spec, ctx) for m in methods]


def _no_eval():
    raise PlanError("a method asked the Python way in for a dev evaluation, which it does not hold")


def _no_optimizer(params):
    raise PlanError("a method asked the Python way in to build an optimizer; pass your own")
