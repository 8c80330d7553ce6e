"""DP-SFT: differentially private subspace fine-tuning (wiring only; the math lives in
``transforms/subspace.py`` and ``grads/subspace.py``).

Source: Zheng et al., "Differentially Private Subspace Fine-Tuning for Large Language Models"
(AAAI 2026), Algorithms 1-3. Differences from the paper, on purpose (see DESIGN.md):

* the noise ``N(0, σ²C² I_k)`` is added to the *sum* of clipped coordinates and the result is
  divided by the expected batch size (the paper adds σC after averaging, an effective noise
  multiplier σB: B times more noise than its stated σ needs — its weak Full-DP baselines may
  come from there);
* a subspace built on the private data is DP-SGD: its events go in the ledger (phase
  ``subspace``) and the two stages are composed by the PLD accountant, not as ``p1ε + p2ε``.
  σ1 is calibrated so that stage 1 alone meets ``p1·ε``; σ2 then so that the composition of
  both stages meets ``ε`` (``calibrate_sigma(prior=...)``), so stage 2 gets what the
  composition leaves, which is more than ``p2·ε``;
* sampling is Poisson (the rate q = B/N is what is accounted).

Stage-1 sources (``subspace.source``): ``public`` (non-private fine-tuning on another task,
free; the report names it), ``private`` (DP-SGD on the private data, accounted), ``file`` (a
saved basis; a privately built one brings its recorded events along).

The plug-in :class:`DPSFT` (``methods: [{name: dpsft, ...}]`` or the ``subspace:`` section)
runs stage 1 in ``prepare`` (before σ is calibrated) and swaps in the subspace engine in
``build``. Every source runs in one process, under DDP and under FSDP2: stage 1 is a world run of the
driver, its basis built once on rank 0 from the full snapshots and broadcast (methods/dpsft/stage1.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from dpft.accounting.ledger import PrivacyLedger
from dpft.config.recipe import TaskCfg
from dpft.config.base import PluginConfig
from dpft.errors import TrainingError
from dpft.placement.fsdp import reshard_all
from dpft.placement.fsdp_methods import held, local_rows
from dpft.grads.subspace import COORDS, LiveSubspace, SubspaceEngine
from dpft.placement.world import World, any_rank, broadcast_object
from dpft.methods.base import Method, MethodError, register_method
from dpft.methods.dpsft.stage1 import Snapshots, share_basis, world_basis
from dpft.models.losses import classification_loss
from dpft.step.clip import FlatClip
from dpft.step.noise import GaussianMechanism
from dpft.step.plan import planned_steps
from dpft.transforms.subspace import SubspaceBasis, SubspaceError, format_bytes, snapshot_schedule

#: Ledger phase of a private stage 1.
PHASE = "subspace"

#: Why ``subspace.paper_noise_placement`` stays certified (decided for issue 18). The paper's
#: mechanism is the certified one followed by independent extra noise: N(0, σ²C²B²) on the sum
#: is N(0, σ²C²) plus a fresh, secret N(0, σ²C²(B² − 1)) that depends on no data, so the paper's
#: release is post-processing of the certified release and the ledger's ε at σ bounds it (the
#: ledger records GaussianDpEvent(σ), not σB: an upper bound, never in our favour). This holds
#: only because the extra noise is independent of the data and of the first draw and is secret;
#: it is a reproduction of the paper's *utility* (its weak Full-DP baseline), not of a claimed ε.
PAPER_NOISE_NOTE = (
    "subspace.paper_noise_placement: noise σC added after averaging (the paper's placement), i.e. std σ·C·B on "
    "the clipped sum, B = expected batch: B times the certified noise. The ε shown is the ledger's at σ, an upper "
    "bound (the extra noise is independent, secret and data-free: post-processing of the certified release); "
    "the run reproduces the paper's utility, its true ε is smaller.")


class SubspaceCfg(PluginConfig):
    """DP-SFT (Zheng et al., AAAI 2026): stage 1 builds a k-dimensional basis P from a
    fine-tuning trajectory, stage 2 privatises per-example coordinates Pᵀg_i in R^k
    (methods/dpsft/method.py). The basis spans exactly the trainable parameters (``trainable``)."""

    #: none · public (non-private run on ``public_task``, free) · private (DP-SGD on the private
    #: data, recorded in the ledger) · file (a saved basis, ``file``).
    source: Literal["none", "public", "private", "file"] = "none"
    #: Subspace dimension k.
    k: int = Field(32, ge=1)
    #: Snapshots m recorded in stage 1 (default k, as in Algorithm 1).
    snapshots: Optional[int] = Field(None, ge=1)
    #: Stage-1 length: epochs E1 (T1 = ceil(E1·N/(B1·m))·m) or steps (rounded up to a multiple of m).
    epochs: float = Field(1.0, gt=0)
    steps: Optional[int] = Field(None, ge=1)
    #: Stage-1 expected batch size B1, learning rate η1, clipping norm C1 (default: stage 2's).
    expected_batch_size: Optional[int] = Field(None, ge=1)
    lr: Optional[float] = Field(None, gt=0)
    max_norm: Optional[float] = Field(None, gt=0)
    #: private: share p1 of the target ε given to stage 1 (σ1 meets p1·ε alone; σ2 is then
    #: calibrated so that the PLD composition of both stages meets ε).
    budget_share: float = Field(0.3, gt=0, lt=1)
    #: public: the public task stage 1 trains on (e.g. imdb for sst2).
    public_task: Optional[TaskCfg] = None
    #: file: a basis written by an earlier run (<run>/subspace/basis.safetensors).
    file: Optional[str] = None
    #: Stage 2 starts from stage 1's final parameters Θ* (Algorithm 3) or from Θ_0.
    start: Literal["stage1", "initial"] = "stage1"
    #: full = unproject P·s̃ and step the optimizer on the d parameters (paper); coords = run the
    #: optimizer on the k coordinates (the update stays in span(P)).
    optimizer_space: Literal["full", "coords"] = "full"
    #: Storage of P: float32 or bfloat16 (half the memory).
    dtype: Literal["float32", "bfloat16"] = "float32"
    #: REPRODUCTION of the paper's noise placement (issue 18): σC is added *after* averaging
    #: over the batch, i.e. noise σ·C·B on the clipped sum — an effective multiplier σB, B times
    #: more noise than the certified σ. Works with any ``source`` (``none`` = the paper's
    #: Full-DP baseline). Still certified: see :data:`PAPER_NOISE_NOTE`.
    paper_noise_placement: bool = False

    @model_validator(mode="after")
    def _source_args(self):
        if self.source == "public" and self.public_task is None:
            raise ValueError("subspace.source=public needs subspace.public_task (e.g. {name: imdb})")
        if self.source == "file" and not self.file:
            raise ValueError("subspace.source=file needs subspace.file (a basis.safetensors)")
        return self




def stage1_recipe(r: Any, n_train: int) -> tuple[Any, list[int]]:
    """The stage-1 recipe (a plain fine-tuning run) and the steps after which to snapshot.

    T1 = ceil(E1·N/(B1·m))·m (Algorithm 3 line 1, with m snapshots instead of k), or
    ``subspace.steps`` rounded up to a multiple of m.
    """
    cfg = r.subspace
    m = cfg.snapshots or cfg.k
    b1 = cfg.expected_batch_size or r.batch.expected_batch_size
    raw = planned_steps(n_train, b1, cfg.steps, cfg.epochs)  # the one steps rule (step/plan.py)
    t1, after = snapshot_schedule(raw, m)
    d = r.model_dump(mode="json")
    d["name"] = f"{r.name}-stage1"
    # stage 1 is a plain fine-tuning run: no subspace, no denoiser (other methods stay)
    d["methods"] = [m for m in d.get("methods", []) if m["name"] not in ("dpsft", "rmt")]
    d["output_dir"] = None
    d["batch"]["expected_batch_size"] = b1
    d["schedule"] = {"steps": t1, "warmup_steps": min(r.schedule.warmup_steps, t1 - 1), "decay": "constant"}
    d["eval"]["every_steps"] = t1
    d["checkpoint_every"] = t1
    if cfg.lr is not None:
        d["optimizer"]["lr"] = cfg.lr
    if cfg.max_norm is not None:
        d["privacy"]["clipping"]["max_norm"] = cfg.max_norm
    if cfg.source == "public":
        d["task"] = cfg.public_task.model_dump(mode="json")
        d["privacy"]["enabled"] = False
    else:  # private: stage 1 alone meets p1·ε (or uses the fixed σ of the recipe)
        if r.privacy.noise_multiplier is None:
            d["privacy"]["target_epsilon"] = cfg.budget_share * r.privacy.target_epsilon
    return type(r).model_validate(d), after  # the recipe's own model (methods hold no Recipe import)


def _record_events(run, ledger_json: dict) -> None:
    for e in PrivacyLedger.from_json(ledger_json).entries:
        run.record(PHASE, e.event, e.count)


def _stage1_only(ledger: PrivacyLedger, n_before: int) -> dict:
    """The entries recorded after the first ``n_before`` releases (stage 1's own)."""
    out, seen = PrivacyLedger(), 0
    for e in ledger.entries:
        take = max(0, min(e.count, seen + e.count - n_before))
        if take:
            out.record(e.phase, e.event, take)
        seen += e.count
    return out.to_json()


def _task_files(t) -> set[Path]:
    """The resolved files a task config reads its training rows from (a registered task's
    files only when it is read from DPFT_DATA_DIR)."""
    from dpft.data.tasks import REGISTRY, data_dir

    if t.train_file:
        return {Path(t.train_file).expanduser().resolve()}
    spec, root = REGISTRY.get(t.name), data_dir()
    if spec is None or root is None:
        return set()
    return {(root / f).resolve() for f in (spec.train_file or spec.dev_file,) if f}


def check_public_source(r: Any) -> None:
    """Refuse a "public" stage-1 task that is the private task itself.

    Raises:
        SubspaceError: ``subspace.public_task`` names the private task (same registered name)
            or reads the same training file (resolved path).
    """
    pub, priv = r.subspace.public_task, r.task
    if r.subspace.source != "public" or pub is None:
        return
    same_name = not pub.train_file and not priv.train_file and pub.name == priv.name
    shared = _task_files(pub) & _task_files(priv)
    if same_name or shared:
        what = f"task {pub.name!r}" if same_name else f"file {sorted(map(str, shared))[0]}"
        raise SubspaceError(f"subspace.public_task is the private {what}: the public subspace would be built on "
                            "the private data for free; use source: private (accounted) or a different public task")


def run_stage1(trainer) -> tuple[SubspaceBasis, dict]:
    """Run stage 1 in ``<run>/subspace/stage1`` through the driver's phase runner
    (``trainer.train_phase``, a :class:`~dpft.methods.base.Run`) and build the basis (Algorithm 1).

    Raises:
        SubspaceError: a private source without privacy, or missing snapshots.
        TrainingError: an interrupted stage 1 left its directory behind.
        MethodError: the run has no phase runner.
    """
    r = trainer.recipe
    cfg = r.subspace
    if cfg.source == "private" and not trainer.private:
        raise SubspaceError("subspace.source=private is DP-SGD on the private data; it needs privacy.enabled")
    check_public_source(r)
    rec, after = stage1_recipe(r, trainer.n)
    d = trainer.run_dir / "subspace" / "stage1"
    stale = (d / "checkpoint").exists() or (d / "checkpoint_shards").exists()  # one process/DDP, or FSDP2
    if any_rank(World(getattr(trainer, "rank", 0), getattr(trainer, "world_size", 1)), stale):  # every rank stops
        raise TrainingError(f"stage 1 in {d} was interrupted before its basis was written; remove {d} "
                            "and run again (its snapshots were in memory only)")
    if getattr(trainer, "train_phase", None) is None:
        raise MethodError("DP-SFT stage 1 is a training phase the driver runs: this run has no phase runner "
                          "(Run.train_phase); build the run with dpft.train / the Trainer")
    t0 = time.time()
    # Stage 1 appends to the parent's ledger (phase "subspace") and saves it to the parent's live
    # ledger.json after every release, so a crash in stage 1 loses no record; its randomness is
    # an independent child of the run's secret source.
    private = cfg.source == "private"
    snaps = Snapshots(after)
    # Under DDP/FSDP2 the phase is a world run like any other (the same plan: one Poisson batch for the world,
    # one noise draw, one ledger event per step on every rank's copy of the parent's ledger, rank 0 writing).
    st = trainer.train_phase(rec, d, progress=trainer.progress, rng=trainer.rng.child("dpsft-stage1"),
                             on_step=snaps, **({"ledger": trainer.ledger, "phase": PHASE,
                                                "live_ledger_path": trainer.live_ledger_path} if private else {}))
    world = getattr(st, "world", None)
    snaps.start(st.params, world)  # full parameters, kept on rank 0 (dpsft_stage1.py)
    n_before = trainer.ledger.steps
    rep = st.run()
    if snaps.recorded != len(after):
        raise SubspaceError(f"stage 1 recorded {snaps.recorded} of {len(after)} snapshots")
    info = {"source": cfg.source, "stage1_steps": rec.schedule.steps, "snapshots": len(after),
            "stage1_expected_batch_size": rec.batch.expected_batch_size,
            "stage1_examples_expected": rec.schedule.steps * rec.batch.expected_batch_size,
            "stage1_task": rec.task.name, "stage1_metrics": rep["metrics"],
            "stage1_seconds": round(time.time() - t0, 1)}
    if cfg.source == "private":
        info["stage1_noise_multiplier"] = st.sigma
        # Provenance of a saved basis: the stage-1 releases alone (for source: file elsewhere).
        info["ledger"] = _stage1_only(st.ledger, n_before)
        info["stage1_epsilon_alone"] = PrivacyLedger.from_json(info["ledger"]).epsilon(r.privacy.delta).epsilon
    # P and Θ* built once (rank 0) from the full snapshots and broadcast: every rank holds the same basis
    return world_basis(snaps, st.params, world, cfg.k, info), info


def build_subspace(trainer) -> tuple[SubspaceBasis, dict]:
    """Stage 1 for a run (``trainer``: the :class:`~dpft.methods.base.Run` of the plug-in),
    before σ is calibrated. Returns ``(basis, subspace_info)``.

    A private stage 1 (or a file built privately) records its events in ``trainer.ledger``
    under phase ``subspace``. The basis is saved in ``<run>/subspace/basis.safetensors`` and
    reused on ``--resume`` (the run's live ledger, continued on resume, already holds its
    releases).

    Raises:
        SubspaceError: bad source arguments, a file without provenance, rank(A) < k.
    """
    r = trainer.recipe
    cfg = r.subspace
    # A Python way in (make_private, DPTrainer) has no run folder: nothing is cached or written.
    cached = trainer.run_dir / "subspace" / "basis.safetensors" if trainer.run_dir is not None else None
    reuse = bool(trainer.resume and cached is not None and cached.is_file())
    world = World(getattr(trainer, "rank", 0), getattr(trainer, "world_size", 1))
    if world.distributed and cfg.source in ("public", "private"):  # rank 0's folder decides; its basis is shared
        reuse = broadcast_object(world, reuse)
    if reuse:
        basis = share_basis(world if cfg.source in ("public", "private") else None,
                            lambda: SubspaceBasis.load(cached), trainer.device)
        fresh = False
    elif cfg.source == "file":
        basis = SubspaceBasis.load(cfg.file)
        if basis.meta.get("source") not in ("public", "private"):
            raise SubspaceError(f"{cfg.file} does not say how it was built (meta.source public/private); "
                                "a basis of unknown provenance cannot be certified")
        fresh = False
    else:
        basis, _ = run_stage1(trainer)  # a private stage 1 recorded its releases in trainer.ledger
        fresh = True
    if basis.k != cfg.k:
        raise SubspaceError(f"the basis has k = {basis.k}, the recipe asks for subspace.k = {cfg.k}")
    if basis.meta.get("source") == "private" and not fresh and not trainer.resume:
        # A private basis from a file (another run on the same data): its releases compose here.
        # (On --resume the live ledger, loaded after this, already holds them.)
        _record_events(trainer, basis.meta["ledger"])
    if cached is not None and not reuse and getattr(trainer, "is_main", True):
        basis.save(cached)  # rank 0 alone writes (DDP)
    basis = basis.to(cfg.dtype)
    info = {
        "source": basis.meta.get("source"), "from_file": cfg.file if cfg.source == "file" else None,
        "k": basis.k, "d": basis.dim, "basis_bytes": basis.nbytes, "basis_memory": format_bytes(basis.nbytes),
        "dtype": cfg.dtype, "optimizer_space": cfg.optimizer_space, "start": cfg.start,
        **{k: v for k, v in basis.meta.items() if k not in ("ledger",)},
    }
    if basis.meta.get("source") == "public":
        info["public_source"] = (
            f"non-private fine-tuning on public task {basis.meta.get('stage1_task')!r} (costs no privacy "
            "of the training data)")
    return basis, info


def unproject_held(basis: SubspaceBasis, params: dict[str, torch.Tensor], key: str = COORDS):
    """Post-processing transform (no privacy cost): ``{key: s̃ (k,)}`` -> ``{name: P_n s̃}`` over what this
    process holds of each spanned parameter: the whole tensor, or under FSDP2 its dim-0 rows
    ``[a, b)`` (:func:`~dpft.placement.fsdp_methods.local_rows`), computed as ``P_n[:, a:b] s̃`` — the rank's
    column block of ``P`` — from the ``s̃`` every rank holds alike, so the ranks' rows together are the
    one-process update ``P s̃`` (Zheng et al., AAAI 2026, Algorithm 2 lines 12-13).

    Raises (from a call): SubspaceError: no coordinates under ``key``."""

    def apply(grads, ctx):
        if key not in grads:
            raise SubspaceError(f"unproject: expected the noisy coordinates under {key!r}")
        c = grads[key].float()
        if c.shape != (basis.k,):
            raise SubspaceError(f"unproject: coordinates must have shape ({basis.k},), got {tuple(c.shape)}")
        out = {}
        for n, b in basis.blocks.items():
            rows = local_rows(params[n])
            out[n] = torch.tensordot(c, (b if rows is None else b[:, rows[0]:rows[1]]).float(), dims=1)
        return out

    apply.basis = basis  # type: ignore[attr-defined]
    return apply


class CoordsSync:
    """``optimizer_space=coords``: keeps ``Θ = Θ_start + P z`` (Zheng et al., AAAI 2026, Algorithm 2
    line 13 with the update in span(P)) by writing the parameters after every optimizer step on the
    coordinates ``z`` (:meth:`attach`: the optimizer's step post-hook) and after a load (:meth:`refresh`,
    from the method's ``before_step``/``evaluate``: when ``z`` changed since the last write). One path for
    every world: each process writes the rows it holds (whole tensors in one process and under DDP; under
    FSDP2 its dim-0 rows ``[a, b)`` of each sharded parameter, ``Θ_start[a:b] + P_n[:, a:b] z`` through
    :func:`unproject_held`), with no collective; the FSDP2 units are resharded first, so that no gathered
    copy of the old values survives (the next forward, or evaluation's ``gathered()``, gathers the new rows).

    Args:
        model: the network (its FSDP2 units are resharded before a write).
        z: the ``(k,)`` coordinates the optimizer steps (the same values on every rank).
        params: the spanned parameters (``DTensor`` shards under FSDP2).
        basis: ``P``."""

    def __init__(self, model: nn.Module, z: torch.Tensor, params: dict[str, torch.Tensor], basis: SubspaceBasis):
        self.model, self.z, self.params = model, z, params
        self.unproject = unproject_held(basis, params, COORDS)
        #: this process's rows of Θ_start (the parameters when the coordinates are zero)
        self.start = {n: held(p).clone() for n, p in params.items()}
        self.seen: Optional[torch.Tensor] = None  # z at the last write (None: never written)

    def attach(self, optimizer) -> "CoordsSync":
        """Write after every step of ``optimizer`` (a ``torch.optim.Optimizer``)."""
        optimizer.register_step_post_hook(lambda *a: self.write())
        return self

    def refresh(self) -> None:
        """Write when the coordinates differ from those of the last write (a resume's load; compared by
        value: a load need not bump the tensor's version), or were never written."""
        if self.seen is None or not torch.equal(self.seen, self.z.detach()):
            self.write()

    @torch.no_grad()
    def write(self) -> None:
        """``Θ = Θ_start + P z`` on the rows this process holds (no collective)."""
        reshard_all(self.model)  # FSDP2: drop the gathered copies (the root keeps its own); else nothing
        delta = self.unproject({COORDS: self.z.detach()}, {})
        for n, p in self.params.items():
            dst = held(p)
            dst.copy_(self.start[n] + delta[n].to(dst.dtype))
        self.seen = self.z.detach().clone()


@register_method
class DPSFT(Method):
    """DP-SFT as a plug-in: stage 1 (``prepare``) and the subspace engine of stage 2 (``build``).

    Raises (from ``build``):
        SubspaceError: a non-private run, or a denoiser combined with DP-SFT.
    """

    name = "dpsft"
    config = SubspaceCfg
    legacy_section = "subspace"
    report_key = "subspace"
    order = 10
    #: Stage 1 runs through the driver on the recipe's device; its snapshots, the basis P, the
    #: coordinates and their noise (drawn on the coordinates' device) follow the model's device.
    supports_device = True
    #: Every source runs across processes (issue 38): stage 1 (``public``/``private``) is a world run of the
    #: driver like any other, its basis built once on rank 0 from the full snapshots and broadcast
    #: (methods/dpsft/stage1.py); stage 2 is a DP-SGD step on the k coordinates (clipped sums all-reduced,
    #: noised once for the world).
    supports_ddp = True
    #: The coordinates are per row: refused with user-level units (methods/python.py).
    example_level_only = True

    @classmethod
    def sharded_refusal(cls, cfg: SubspaceCfg) -> Optional[str]:
        """What runs on FSDP2 shards (dpft/placement/fsdp.py): ``source: none`` (the paper's noise placement alone:
        a σB Gaussian on the whole gradient, sharded like any Gaussian) and stage 2 on a given basis
        (``source: file``, ``optimizer_space`` full or coords). Stage 2 sharded: P is replicated on every rank
        (``k × d_trainable`` floats per rank, ``subspace.dtype``: 4 or 2 bytes each; a per-layer
        all-gather of a row-sharded P would cut that to 1/K and is not built); FSDP all-gathers each
        layer for the rank's own examples, so ``s_i = Σ_l P_lᵀ g_{i,l}`` is complete on its rank, clipped
        in R^k there; the (k,) clipped sums are all-reduced once per step (fsdp_methods.ReplicatedSum),
        noised once for the world (the same draw on every rank), and each rank writes its own rows of
        ``P z`` (:func:`unproject_held`); with ``coords`` every rank steps the same ``z`` and writes its rows
        of ``Θ_start + P z`` after each step (:class:`CoordsSync`). Stage 1 (``public``/``private``) runs
        too: a sharded world run of the driver whose snapshots are the gathered full parameters (rank 0 keeps
        them), the basis built once on rank 0 and broadcast (methods/dpsft/stage1.py). Nothing is refused."""
        return None

    @classmethod
    def python_refusal(cls, cfg: SubspaceCfg) -> Optional[str]:
        """A given subspace (``source: file``, or ``none`` with the paper's noise placement) runs in
        every way in: stage 2 is a DP-SGD step on the k coordinates. A subspace estimated in this
        run (``public``/``private``) is a training phase of its own that the driver runs."""
        why = []
        if cfg.source in ("public", "private"):
            why.append(f"subspace source {cfg.source!r} estimates the subspace in a stage-1 training phase of its "
                       "own (snapshots of a trajectory; a private stage 1 is DP-SGD recorded in the ledger), which "
                       "only the driver runs; build the basis with `dpft train` (it writes "
                       "<run>/subspace/basis.safetensors with its ledger) and pass {'name': 'dpsft', 'source': "
                       "'file', 'file': <that path>, 'k': ...} here (its recorded releases compose into this "
                       "ledger), or run the whole method with `dpft train`")
        if cfg.optimizer_space == "coords":
            why.append("optimizer_space 'coords' builds an optimizer over the k coordinates; use "
                       "optimizer_space 'full' (your optimizer steps the unprojected gradient)")
        return "; ".join(why) or None

    @classmethod
    def enabled(cls, cfg: SubspaceCfg) -> bool:
        return cfg.source != "none" or cfg.paper_noise_placement

    def prepare(self, run) -> None:
        if self.cfg.source == "none":  # paper_noise_placement alone: the paper's Full-DP baseline
            self.basis, self.info = None, {"source": "none"}
        else:
            self.basis, self.info = build_subspace(run)
        if self.cfg.paper_noise_placement:
            self.info["paper_noise_placement"] = PAPER_NOISE_NOTE

    def _paper_mechanism(self, spec, run):
        """GaussianMechanism with noise multiplier σ·B on the sum (the paper's σC after averaging),
        accounted at σ (the certified mechanism's event: an upper bound, :data:`PAPER_NOISE_NOTE`)."""
        b = float(run.recipe.batch.expected_batch_size)
        self.info["effective_noise_multiplier"] = run.sigma * b
        return GaussianMechanism(run.sigma * b, spec.clip.sensitivity, run.rng,
                                 hardened=run.recipe.privacy.hardened_noise, accounted_sigma=run.sigma)

    def build(self, spec, run):
        """Stage 2 (Algorithm 2): the subspace engine, the optimizer's parameters and the
        unprojection transform (with ``paper_noise_placement``: the σB mechanism too)."""
        r, cfg, basis = run.recipe, self.cfg, self.basis
        if not run.private:
            raise SubspaceError("DP-SFT stage 2 privatises subspace coordinates; set privacy.enabled: true "
                                "(or subspace.source: none for a non-private run)")
        if basis is None:
            return spec.replace(mechanism=self._paper_mechanism(spec, run))
        if r.method_config("rmt").method != "none":
            raise SubspaceError("denoise and subspace are not combined: the noise of DP-SFT is k-dimensional")
        clip = spec.clip
        if r.privacy.clipping.style in ("head_body", "per_layer", "per_group"):
            # The k coordinates are one group: head_body / per_layer shape stage 1's clipping only;
            # stage 2 clips ‖s_i‖ in R^k to the same C (same sensitivity, same mechanism).
            clip = FlatClip(r.privacy.clipping.max_norm)
        # A Python way in's per-example loss when its engine runs the forward (DPTrainer); dpft
        # train's classification runs: the task's cross-entropy.
        loss = getattr(run, "per_example_loss", None) or classification_loss
        engine = SubspaceEngine(run.model, loss, clip, basis)
        # The view a way in whose user runs the forward and backward (make_private) drives instead.
        engine.live_view = lambda: LiveSubspace(engine)
        basis = self.basis = engine.basis  # P on the model's device (the engine moves it there)
        if cfg.start == "stage1":
            if basis.start is None:
                raise SubspaceError("subspace.start=stage1 but the basis holds no stage-1 parameters Θ*; "
                                    "use subspace.start: initial")
            with torch.no_grad():
                for n, p in engine.model_params.items():
                    if basis.start[n].shape != p.shape:
                        raise SubspaceError(f"Θ* of {n} has shape {tuple(basis.start[n].shape)}, the model "
                                            f"{tuple(p.shape)} (different number of labels in stage 1?)")
                    rows = local_rows(p)  # FSDP2: this rank's rows of Θ*
                    held(p).copy_(basis.start[n] if rows is None else basis.start[n][rows[0]:rows[1]])
        transforms = list(spec.transforms)
        if cfg.optimizer_space == "full":
            params = engine.model_params
            transforms.insert(0, unproject_held(basis, params, COORDS))
        else:
            z = nn.Parameter(torch.zeros(basis.k, device=run.device))
            params = {COORDS: z}
        if run.evaluate is not None:  # a Python way in holds no dev set
            self.info["start_dev_accuracy"] = run.evaluate()["dev_accuracy"]
        # A Python way in keeps the user's optimizer: "full" steps the same trainable parameters.
        optimizer = run.make_optimizer(params) if run.make_optimizer is not None else spec.optimizer
        if cfg.optimizer_space == "coords":  # Θ = Θ_start + P z after every step of the coordinates
            self.sync = CoordsSync(run.model, params[COORDS], engine.model_params, basis).attach(optimizer)
        spec = spec.replace(engine=engine, clip=clip, params=params, transforms=transforms, optimizer=optimizer)
        if cfg.paper_noise_placement:
            spec = spec.replace(mechanism=self._paper_mechanism(spec, run))
        return spec

    def before_step(self, step: int, run) -> None:
        if getattr(self, "sync", None) is not None:  # coords: Θ_start + P z after a resume's load of z
            self.sync.refresh()

    def evaluate(self, run, evaluate):
        if getattr(self, "sync", None) is not None:  # coords: a resumed run that evaluates before any step
            self.sync.refresh()
        return None

    def report(self, run) -> dict:
        return self.info

    @classmethod
    def markdown(cls, rep) -> list[str]:
        s = rep.get(cls.report_key)
        if not s:
            return []
        if s.get("source") == "none":
            return [f"**Paper noise placement:** {s.get('paper_noise_placement', '')}", ""]
        return [f"**Subspace (DP-SFT):** source {s['source']}"
                + (f" — {s['public_source']}" if s.get("public_source") else "")
                + f"; k = {s['k']}, d = {s['d']:,}, P = {s['basis_memory']} ({s['dtype']})",
                *([f"- {s['paper_noise_placement']}"] if s.get("paper_noise_placement") else []), ""]


def write_info(info: dict, run_dir: Path, path: Path | None = None) -> Path:
    """Write the subspace info as JSON beside the run (``<run>/subspace/info.json``)."""
    path = path or Path(run_dir) / "subspace" / "info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1, default=str))
    return path


__all__ = ["DPSFT", "LiveSubspace", "PHASE", "Snapshots", "SubspaceCfg", "build_subspace", "run_stage1",
           "stage1_recipe", "write_info"]
