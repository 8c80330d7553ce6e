"""The DP step, one file per stage (DESIGN.md "The DP step, as data flows"):

``sample`` (Poisson sampler) → per-example engine (``dpft.grads``) → ``clip`` (clip policies)
→ ``aggregate`` (Σ cᵢgᵢ over micro-batches, all-reduced under DDP) → ``noise`` (Gaussian
mechanism, returns its ``DpEvent``) → ledger → ``postprocess`` (divide by qN, RMT, unproject)
→ optimizer. :class:`~dpft.step.pipeline.DPStep` runs them in that order and is the one place a
private step happens, for the CLI trainer, ``PrivacyEngine.make_private`` and the Hugging Face
``DPTrainer`` alike.
"""

from dpft.step.pipeline import DPStep, StepOutput, StepSpec

__all__ = ["DPStep", "StepOutput", "StepSpec"]
