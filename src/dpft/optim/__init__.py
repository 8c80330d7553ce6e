"""Optimizers: DP-Adam variants (dp_adam.py) and the recipe's optimizer and learning-rate
schedule as plan parts (run/plan.py)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["build_optimizer", "lr_lambda", "build_scheduler"]


def build_optimizer(opt_cfg, params: dict) -> torch.optim.Optimizer:
    """The recipe's optimizer (``sgd`` · ``adam`` · ``adamw``) over ``params`` (name → tensor); with
    ``head_lr`` set, the head's parameters form a second group at that learning rate
    (models/load.py ``head_param_groups``)."""
    from dpft.models.load import head_param_groups

    o = opt_cfg
    groups: Any = head_param_groups(params, o.head_lr)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "adam":
        return torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def lr_lambda(warmup: int, total: int, decay: str) -> Callable[[int], float]:
    """Learning-rate factor of step t: linear warm-up over ``warmup`` steps, then constant or
    linear decay to 0 at ``total``."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup))

    return f


def build_scheduler(optimizer: torch.optim.Optimizer, schedule_cfg, total_steps: int):
    """``LambdaLR`` of :func:`lr_lambda` for the recipe's ``schedule``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(schedule_cfg.warmup_steps, total_steps, schedule_cfg.decay))
