"""Dev-set evaluation of a run's model (a plan part, run/plan.py): accuracy and mean loss for a
classifier, loss per token and perplexity for a causal LM; sharded across DDP ranks."""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["DevEvaluator"]


class DevEvaluator:
    """Evaluates a model on the run's dev rows; no gradients, eval mode, then back to train mode.

    Args:
        data: the run's :class:`~dpft.data.prepare.TrainData`.
        placement: its :class:`~dpft.perf.Placement` (device, autocast).
        world: the DDP world: each rank evaluates every K-th dev row and the sums are all-reduced.
        eval_cfg: the recipe's ``eval`` section (batch size, ``save_predictions``).

    Attributes:
        dev_predictions: the latest classifier evaluation's ``[{"index", "prediction", "correct"}]``
            when ``eval.save_predictions`` (one process only), else None.
    """

    def __init__(self, data, placement, world, eval_cfg):
        self.data, self.placement, self.world, self.cfg = data, placement, world, eval_cfg
        self.dev_predictions: Optional[list[dict]] = None

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        """``{"dev_accuracy", "dev_loss"}`` (nats) or ``{"dev_loss", "dev_perplexity", "dev_tokens"}``."""
        if self.data.causal:
            return self._lm(model)
        return self._classifier(model)

    def _lm(self, model) -> dict[str, float]:
        from dpft.eval.lm import lm_eval
        from dpft.run import distributed as ddp

        w = self.world
        out = lm_eval(model, list(self.data.dev_tok)[w.rank::w.world_size], self.data.pad_id, self.cfg.batch_size)
        if w.distributed:
            total, count = ddp.all_sum(w, [out["dev_loss"] * out["dev_tokens"], out["dev_tokens"]])
            loss = total / max(count, 1)
            out = {"dev_loss": loss, "dev_perplexity": math.exp(min(loss, 50.0)), "dev_tokens": int(count)}
        return out

    def _classifier(self, model) -> dict[str, float]:
        from dpft.data.tokenize import collate
        from dpft.models.losses import model_inputs
        from dpft.run import distributed as ddp
        from dpft.run.errors import TrainingError

        d, w = self.data, self.world
        model.eval()
        bs = self.cfg.batch_size
        order = sorted(range(len(d.dev_tok)), key=lambda i: len(d.dev_tok[i]["input_ids"]))
        order = order[w.rank::w.world_size]  # DDP: this rank's share of the dev set
        correct, loss, n = 0, 0.0, 0
        keep = self.cfg.save_predictions
        if keep and w.distributed:
            raise TrainingError("eval.save_predictions is not supported with DDP yet; run on one process")
        preds: dict[int, tuple[int, bool]] = {}
        for k in range(0, len(order), bs):
            rows = d.dev_tok.select(order[k:k + bs])
            batch = collate(list(rows), d.pad_id, d.with_token_types, device=self.placement.device)
            with self.placement.precision.autocast():
                logits = model(**model_inputs(batch)).logits.float()
            loss += float(torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"))
            hit = logits.argmax(-1) == batch["labels"]
            correct += int(hit.sum())
            n += len(rows)
            if keep:
                for i, p, h in zip(order[k:k + bs], logits.argmax(-1).tolist(), hit.tolist()):
                    preds[int(i)] = (int(p), bool(h))
        if keep:  # the latest evaluation's (a method evaluating twice runs its headline last)
            self.dev_predictions = [{"index": i, "prediction": p, "correct": h} for i, (p, h) in sorted(preds.items())]
        if w.distributed:  # DDP: the world's sums, the same on every rank
            c, loss, m = ddp.all_sum(w, [correct, loss, n])
            correct, n = int(c), int(m)
        model.train()
        return {"dev_accuracy": correct / n, "dev_loss": loss / n}
