"""The recipe schema's base and its run-level sections: :class:`PluginConfig` (the public base
class of every config model, method plug-ins' included: unknown keys are refused, assignments
validated) and the ``perf:``, ``eval:``, ``log:`` and ``output:`` sections (config.py composes
them into :class:`~dpft.config.recipe.Recipe`)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["PluginConfig", "PerfCfg", "EvalCfg", "LogCfg", "OutputCfg"]


class PluginConfig(BaseModel):
    """Base class of a recipe section and of a method plug-in's config (``Method.config``):
    unknown keys are refused (a misspelt key is an error, not a silent default) and assignments
    are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_Strict = PluginConfig


class PerfCfg(_Strict):
    """Where and in which number format the DP step runs (dpft/placement/device.py)."""

    #: ``auto`` (CUDA when torch sees a GPU, else CPU) · ``cpu`` · ``cuda`` · ``cuda:N``.
    device: str = "auto"
    #: Autocast dtype of forward and backward: ``fp32`` (none) · ``bf16`` · ``fp16`` (with a
    #: static loss scale). Weights, optimizer state, per-example norms, clip factors, the
    #: clipped sum and the noise stay fp32.
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: Static loss scale S for fp16 (default 1024); refused with fp32/bf16. Static because a
    #: dynamic scaler's scale follows which private examples overflowed (dpft/placement/device.py).
    loss_scale: Optional[float] = Field(None, gt=0)
    #: Hugging Face activation (gradient) checkpointing of the transformer blocks (book-keeping
    #: engine only): less activation memory for one more forward per step.
    activation_checkpointing: bool = False
    #: ``torch.compile`` the model; allowed for non-private (--no-dp) runs only: it cannot work
    #: with the per-example engines' hooks (dpft/placement/device.py ``COMPILE_REFUSAL``).
    compile: bool = False
    #: Multi-process training under torchrun: ``ddp`` (default: every rank holds the whole model;
    #: one process runs as always) · ``fsdp`` (FSDP2 ``fully_shard``: parameters, clipped sums, noise
    #: and optimizer state sharded over the ranks; book-keeping engine; dpft/placement/fsdp.py, docs/fsdp.md)
    #: · ``none`` (refuse more than one process).
    sharding: Literal["none", "ddp", "fsdp"] = "ddp"
    #: Frozen features computed once (run/features.py, issue 45): when the trainable scope
    #: leaves a frozen prefix (``trainable.mode: head``, ``last_k``, ``units`` above block i),
    #: its output is computed once per training and dev row (eval mode) and every step runs
    #: only the rest. ``auto``: where the model and recipe allow it (one process, no method, a
    #: classification task, no truncated Poisson); ``on``: the same, or an error saying why
    #: not; ``off``: never. Exact: the same gradients and released values as ``off``.
    feature_cache: Literal["auto", "on", "off"] = "auto"
    #: Cached features above this size (MiB) go to a numpy memmap in a private temp folder
    #: (mode 0700) instead of RAM.
    feature_cache_memory_mb: int = Field(2048, ge=0)
    #: Keep the cache (private data at rest, never in the run folder) in
    #: ``feature_cache_dir``/<key> after the run, for a later run with the same frozen weights,
    #: tokenised rows and settings; default false: removed when the run ends.
    keep_feature_cache: bool = False
    #: Where a kept cache lives (default ``$XDG_CACHE_HOME/dpft/features`` or
    #: ``~/.cache/dpft/features``); refused inside the run's output folder.
    feature_cache_dir: Optional[str] = None

    @field_validator("device")
    @classmethod
    def _device_spelling(cls, v: str) -> str:
        import re

        s = str(v).strip().lower()
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", s):
            raise ValueError(f"perf.device must be auto, cpu, cuda or cuda:N (got {v!r})")
        return s

    @model_validator(mode="after")
    def _loss_scale_fp16_only(self):
        import math

        if self.loss_scale is not None:
            if self.dtype != "fp16":
                raise ValueError(f"perf.loss_scale applies to dtype fp16 only ({self.dtype} needs no loss "
                                 "scaling); remove it or set perf.dtype: fp16")
            if not math.isfinite(self.loss_scale):
                raise ValueError("perf.loss_scale must be finite")
        return self


class EvalCfg(_Strict):
    every_steps: int = Field(50, ge=1)
    batch_size: int = Field(128, ge=1)
    #: ``text`` task: prompts whose sampled continuations go in the report.
    prompts: list[str] = []
    max_new_tokens: int = Field(40, ge=1)
    #: Write the final dev predictions, one JSON line per dev example (``index`` in the dev
    #: split, ``prediction``, ``correct``), to ``<run>/dev_predictions.jsonl`` for paired tests
    #: between runs (``dpft.eval.paired``). Classification only; not with DDP. A function of the
    #: dev data: not in the release set (like the dev metrics, covered only if the dev split is).
    save_predictions: bool = False
    # ---- ``instruct`` task (issue 17; eval/generate.py): after training, decode the dev prompts
    # (dev rows grouped by prompt: multi-reference) and score BLEU, ROUGE-L and exact match.
    generate: bool = True
    #: 1 = greedy decoding; > 1 = beam search with this many beams.
    num_beams: int = Field(1, ge=1)
    #: Decode at most this many distinct dev prompts (the first in file order); None = all.
    max_generate_prompts: Optional[int] = Field(None, ge=1)
    #: Generations shown in the report.
    num_samples: int = Field(3, ge=0)


class LogCfg(_Strict):
    """What a run logs beyond its release set (outputs/release.py)."""

    #: Write per-step private statistics (un-noised train loss, batch size, clip fraction, step
    #: times) to private_diagnostics.jsonl (mode 0600). NOT covered by ε: for the data holder only.
    private_diagnostics: bool = False
    #: Experiment trackers to send the run's *released* quantities to (ε, dev metrics, learning
    #: rate; never the training loss or batch sizes): ``tensorboard`` · ``wandb`` · ``mlflow``
    #: (optional extras: ``pip install dpft[tracking]``).
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = []


class OutputCfg(_Strict):
    """What ``model/`` holds beyond the model (models/export.py)."""

    #: LoRA runs: also write the merged model (adapter folded into the weights) to
    #: ``model_merged/``, loadable without peft. ``model/`` always holds the adapter.
    merge_lora: bool = False
    #: Write a Hugging Face model card (``README.md``) stating the guarantee into ``model/``.
    model_card: bool = True
