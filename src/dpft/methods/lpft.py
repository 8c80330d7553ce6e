"""LP-FT as a plug-in: a DP linear probe, then DP fine-tuning from that head — two phases, one ledger.

Linear probing then fine-tuning (Kumar et al., ICLR 2022, "Fine-tuning can distort pretrained features
and underperform out-of-distribution") keeps the features the pre-trained model already has: the fresh
head is first fitted on frozen features, so the fine-tuning phase does not spend its first (noisy)
steps pushing a random head's gradients into the blocks. Under DP, Ke, Hou, Fanti & Oh (2024, "On the
convergence of differentially-private fine-tuning: to linearly probe or to fully fine-tune?") show
that a probe phase first converges faster, and that the budget split between the phases matters.

Recipe::

    methods:
      - name: lpft
        share: 0.3          # the probe phase alone spends ε₁ = share · target ε (PLD, at the run's δ)
        epochs: 25          # probe phase: passes over the N rows
        sampling_rate: 0.25 # probe phase: q (expected batch = q · N)
        lr: 0.02            # probe phase: AdamW on the head only

Phase 1 (``prepare``) is an ordinary DP run of the recipe with ``trainable.mode: head`` and flat
clipping at the recipe's C, through the driver's phase runner (``Run.train_phase``) in
``<run>/lpft/probe``: its frozen encoder runs once per row (the feature cache), its σ₁ is calibrated for
ε₁ alone, and its releases go to the run's ledger under phase ``probe``. The trained head is copied into
the run's model and saved in ``<run>/lpft/head.safetensors`` (a DP release: the ledger covers it). Phase 2
is the recipe as written (``last_k``, ``lora``, ``units``…) from that head; the driver calibrates its σ₂
on the ledger that already holds phase 1's events, so the composition of both ends at the target ε — the
budget split is exact under the PLD accountant, never a sum of ε's.

On ``--resume`` a saved head is loaded and phase 1 is not run again (its releases are in the live
ledger); a run interrupted inside phase 1 is refused with the fix (its probe folder has a checkpoint
but no head).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pydantic import Field
from safetensors.torch import load_file, save_file

from dpft.config.base import PluginConfig
from dpft.config.recipe import load_recipe
from dpft.methods.base import Method, MethodError, register_method
from dpft.models.load import is_head_param

#: The ledger phase of the probe's releases.
PHASE = "probe"
HEAD_FILE = "head.safetensors"


class LPFTCfg(PluginConfig):
    """LP-FT: a DP linear probe (phase 1, its own share of the budget), then the recipe's fine-tuning
    (phase 2) from that head."""

    enabled: bool = True
    #: Share of the target ε that the probe phase alone spends (ε₁ = share · ε at the run's δ); phase 2's σ
    #: is calibrated on the ledger that holds phase 1, so the whole run ends at the target ε.
    share: float = Field(0.3, gt=0.0, lt=1.0)
    #: Probe phase: passes over the N training rows (T₁ = ⌈epochs · N / B₁⌉).
    epochs: float = Field(25.0, gt=0.0)
    #: Probe phase: Poisson sampling rate q₁ (expected batch B₁ = q₁ · N): large batches and many epochs
    #: are what the accountant prefers for a d × L linear model at small N.
    sampling_rate: float = Field(0.25, gt=0.0, le=1.0)
    #: Probe phase: AdamW learning rate of the head.
    lr: float = Field(0.02, gt=0.0)


def probe_recipe(r, cfg: LPFTCfg, n: int):
    """The probe phase's recipe: ``r`` with the head alone trainable on cached features, flat clipping at
    C, AdamW(lr), B₁ = q₁·N, ``epochs`` passes, target ε₁ = share · ε, no method, no test file, no tracker,
    no card.

    Raises:
        MethodError: a run without a target ε (σ given, or non-private) — the split needs a target."""
    if not r.privacy.enabled or r.privacy.target_epsilon is None or r.privacy.noise_multiplier is not None:
        raise MethodError("lpft splits the run's target ε between its phases: set privacy.target_epsilon "
                          "(and no privacy.noise_multiplier)")
    b = max(1, round(cfg.sampling_rate * n))
    d = r.model_dump(mode="json")
    d["methods"] = []
    d["trainable"] = {**d["trainable"], "mode": "head"}
    d["privacy"] = {**d["privacy"], "target_epsilon": cfg.share * r.privacy.target_epsilon,
                    "clipping": {**d["privacy"]["clipping"], "style": "flat"}}
    d["optimizer"] = {**d["optimizer"], "name": "adamw", "lr": cfg.lr, "head_lr": None, "weight_decay": 0.0}
    d["schedule"] = {**d["schedule"], "epochs": cfg.epochs, "steps": None, "time_budget": None,
                     "compute_budget": None, "warmup_steps": 0}
    d["batch"] = {**d["batch"], "expected_batch_size": b, "max_physical_batch_size": max(b, 1)}
    d["model"] = {**d["model"], "head_dropout": 0.0}
    d["task"] = {**d["task"], "test_file": None}
    d["log"] = {**d.get("log", {}), "report_to": []}
    d["output"] = {**d.get("output", {}), "model_card": False}
    d["eval"] = {**d["eval"], "every_steps": 10 ** 9}
    d["checkpoint_every"] = 10 ** 9
    return load_recipe(None, d)


@register_method
class LPFT(Method):
    """Phase 1: a DP linear probe in ``prepare``; phase 2: the recipe's training from its head."""

    name = "lpft"
    config = LPFTCfg
    report_key = "lpft"
    order = 5  # before any method that wraps the model: the probe sets the head first
    keeps_frozen_part = True  # it sets the head only: phase 2 keeps the feature cache of its frozen blocks
    supports_device = True  # the probe phase runs on the run's placement; its head is copied to the model's device

    @classmethod
    def enabled(cls, cfg: LPFTCfg) -> bool:
        return cfg.enabled

    @classmethod
    def python_refusal(cls, cfg: LPFTCfg) -> Optional[str]:
        return ("lpft is a two-phase run the driver composes (a probe phase, then the fine-tuning phase): use "
                "dpft train / dpft.train; from your own loop, train the head first with make_private on cached "
                "features, then the rest, in one ledger")

    @classmethod
    def sharded_refusal(cls, cfg: LPFTCfg) -> Optional[str]:
        return "lpft under perf.sharding: fsdp is not built (the probe phase's feature cache is one process)"

    def __init__(self, cfg: LPFTCfg, recipe: Any):
        super().__init__(cfg, recipe)
        self.info: dict[str, Any] = {}

    def prepare(self, run) -> None:
        if run.recipe.trainable.mode == "head":
            raise MethodError("lpft with trainable.mode: head is a probe alone: drop the method (or choose the "
                              "fine-tuning scope of phase 2: last_k, lora, units)")
        d = run.run_dir / "lpft"
        head_path = d / HEAD_FILE
        params = dict(run.model.named_parameters())
        if run.resume and head_path.is_file():
            for k, v in load_file(str(head_path)).items():
                params[k].data.copy_(v.to(params[k].device, params[k].dtype))
            self.info = {"resumed": True, **self.info}
            return
        if (d / "probe" / "checkpoint").exists():
            raise MethodError(f"the probe phase in {d / 'probe'} was interrupted before its head was saved; remove "
                              f"{d} and run again (its releases stay in the ledger and count)")
        if getattr(run, "train_phase", None) is None:
            raise MethodError("lpft's probe is a training phase the driver runs: build the run with dpft train")
        rec = probe_recipe(run.recipe, self.cfg, run.n)
        t0 = time.time()
        n_before = run.ledger.steps
        st = run.train_phase(rec, d / "probe", progress=run.progress, rng=run.rng.child("lpft-probe"),
                             ledger=run.ledger, phase=PHASE, live_ledger_path=run.live_ledger_path)
        rep = st.run()
        head = {k: p.detach() for k, p in st.params.items() if is_head_param(k)}
        if not head:
            raise MethodError("the probe phase trained no head parameter (is this a classification model?)")
        for k, v in head.items():
            if k not in params or params[k].shape != v.shape:
                raise MethodError(f"the probe's head parameter {k} has no match in the run's model")
            params[k].data.copy_(v.to(params[k].device, params[k].dtype))
        if getattr(run, "is_main", True):
            d.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous().cpu() for k, v in head.items()}, str(head_path))
        probe_eps = self.cfg.share * run.recipe.privacy.target_epsilon
        self.info = {"share": self.cfg.share, "probe_target_epsilon": probe_eps,
                     "probe_noise_multiplier": st.sigma, "probe_steps": run.ledger.steps - n_before,
                     "probe_expected_batch_size": rec.batch.expected_batch_size,
                     "probe_epochs": self.cfg.epochs, "probe_lr": self.cfg.lr,
                     "probe_dev_metrics": rep.get("metrics", {}), "probe_seconds": round(time.time() - t0, 1)}
        run.notes.append(f"LP-FT: a DP linear probe (ε₁ = {probe_eps:.3g} alone, σ₁ = {st.sigma:.3g}, "
                         f"{self.info['probe_steps']} steps of B₁ = {rec.batch.expected_batch_size}) trained the head "
                         "first; the fine-tuning phase started from it, its σ calibrated on the ledger that holds "
                         "the probe's releases")

    def report(self, run) -> dict[str, Any]:
        return dict(self.info)

    @classmethod
    def markdown(cls, rep: dict[str, Any]) -> list[str]:
        rep = rep.get(cls.report_key) or {}  # the whole report.json: this method's section
        if not rep or rep.get("resumed"):
            return []
        m = rep.get("probe_dev_metrics", {})
        acc = next((f"{v:.4f}" for k, v in m.items() if "acc" in k), "—")
        return ["## LP-FT", "",
                f"Phase 1, a DP linear probe: ε₁ = {rep['probe_target_epsilon']:.3g} alone (share "
                f"{rep['share']:.2g} of the target), σ₁ = {rep['probe_noise_multiplier']:.3g}, "
                f"{rep['probe_steps']} steps of expected batch {rep['probe_expected_batch_size']}, lr "
                f"{rep['probe_lr']:g}; dev accuracy after the probe {acc}. Phase 2 fine-tuned from that head; "
                "both phases are in the one ledger.", ""]
