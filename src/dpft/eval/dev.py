"""Dev-set evaluation of a run's model (a plan part, run/plan.py): accuracy and mean loss for a
classifier, loss per token and perplexity for a causal LM; sharded across DDP ranks."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from dpft.data.tokenize import collate
from dpft.errors import TrainingError
from dpft.eval.lm import lm_eval, seq2seq_eval
from dpft.models.losses import model_inputs

if TYPE_CHECKING:
    import datasets

__all__ = ["DevEvaluator", "classify"]


class DevEvaluator:
    """Evaluates a model on the run's dev rows; no gradients, eval mode, then back to train mode.

    Args:
        data: the run's :class:`~dpft.data.prepare.TrainData`.
        placement: its :class:`~dpft.placement.device.Placement` (device, autocast).
        world: the DDP world (``rank``, ``world_size``, ``distributed``): each rank evaluates every
            K-th dev row.
        eval_cfg: the recipe's ``eval`` section (batch size, ``save_predictions``).
        all_sum: ``values -> values``, the element-wise sum of a list of floats over the world's
            ranks (``functools.partial(dpft.placement.world.all_sum, world)``; the caller's
            capability, so that evaluation imports no placement); called under DDP only.

    Attributes:
        dev_predictions: the latest classifier evaluation's ``[{"index", "prediction", "correct"}]``
            when ``eval.save_predictions`` (one process only), else None.
    """

    def __init__(self, data, placement, world, eval_cfg, all_sum: Callable[[list[float]], list[float]]):
        self.data, self.placement, self.world, self.cfg = data, placement, world, eval_cfg
        self.all_sum = all_sum
        self.dev_predictions: Optional[list[dict]] = None

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        """``{"dev_accuracy", "dev_loss"}`` (nats) or ``{"dev_loss", "dev_perplexity", "dev_tokens"}``."""
        if self.data.causal:
            return self._lm(model)
        return self._classifier(model)

    def _lm(self, model) -> dict[str, float]:
        w = self.world
        if getattr(self.data, "seq2seq", False):  # encoder-decoder: target tokens (data/seq2seq.py)
            out = seq2seq_eval(model, list(self.data.dev_tok)[w.rank::w.world_size], self.data.pad_id,
                               self.cfg.batch_size)
        else:
            out = lm_eval(model, list(self.data.dev_tok)[w.rank::w.world_size], self.data.pad_id, self.cfg.batch_size)
        if w.distributed:
            total, count = self.all_sum([out["dev_loss"] * out["dev_tokens"], out["dev_tokens"]])
            loss = total / max(count, 1)
            out = {"dev_loss": loss, "dev_perplexity": math.exp(min(loss, 50.0)), "dev_tokens": int(count)}
        return out

    def _classifier(self, model) -> dict[str, float]:
        d, w = self.data, self.world
        keep = self.cfg.save_predictions
        if keep and w.distributed:
            raise TrainingError("eval.save_predictions is not supported with DDP yet; run on one process")
        order = sorted(range(len(d.dev_tok)), key=lambda i: len(d.dev_tok[i]["input_ids"]))
        order = order[w.rank::w.world_size]  # DDP: this rank's share of the dev set
        rows = d.dev_tok.select(order)
        logits = classify(model, rows, d.pad_id, d.with_token_types, self.cfg.batch_size, self.placement.device,
                          self.placement.precision.autocast)["logits"]
        y = torch.tensor(rows["label"], dtype=torch.long)
        pred = logits.argmax(-1) if len(order) else y
        hit = pred == y
        correct, n = int(hit.sum()), len(order)
        loss = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")) if n else 0.0
        if keep:  # the latest evaluation's (a method evaluating twice runs its headline last)
            self.dev_predictions = [{"index": int(i), "prediction": int(p), "correct": bool(h)}
                                    for i, p, h in sorted(zip(order, pred.tolist(), hit.tolist()))]
        if w.distributed:  # DDP: the world's sums, the same on every rank
            c, loss, m = self.all_sum([correct, loss, n])
            correct, n = int(c), int(m)
        return {"dev_accuracy": correct / n, "dev_loss": loss / n}


@torch.no_grad()
def classify(model, rows: datasets.Dataset, pad_id: int, with_token_types: bool, batch_size: int,
             device: torch.device | str = "cpu", autocast: Optional[Callable] = None,
             progress: bool = False, desc: str = "predict") -> dict[str, Any]:
    """Logits of a classifier for tokenised ``rows`` (``input_ids`` [, ``token_type_ids``,
    ``label``]), in batches sorted by length (less padding), returned in row order.

    Returns:
        ``{"logits": (n, K) float tensor, "accuracy": float?, "loss": float? (mean nats)}``
        (accuracy and loss only when the rows carry labels).
    """
    import contextlib

    from tqdm.auto import tqdm

    was = model.training
    model.eval()
    n = len(rows)
    order = sorted(range(n), key=lambda i: len(rows[i]["input_ids"]))
    out: list[Optional[torch.Tensor]] = [None] * n
    bar = tqdm(total=n, desc=desc, disable=not progress, file=sys.stderr, unit="row")
    try:
        for k in range(0, n, batch_size):
            idx = order[k:k + batch_size]
            batch = collate(list(rows.select(idx)), pad_id, with_token_types, device=device)
            with (autocast() if autocast else contextlib.nullcontext()):
                logits = model(**model_inputs(batch)).logits.float().cpu()
            for i, row in zip(idx, logits):
                out[i] = row
            bar.update(len(idx))
    finally:
        bar.close()
        model.train(was)
    logits = torch.stack(out) if n else torch.empty(0, 0)
    res: dict[str, Any] = {"logits": logits}
    if n and "label" in rows.column_names:
        y = torch.tensor(rows["label"], dtype=torch.long)
        res["accuracy"] = float((logits.argmax(-1) == y).float().mean())
        res["loss"] = float(torch.nn.functional.cross_entropy(logits, y))
    return res
