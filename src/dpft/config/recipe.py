"""Recipe schema: one YAML file names everything a run needs; pydantic validates it.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls back to a
default. Every key can be overridden from the command line (``--set a.b=value`` or the named
flags of ``dpft train``).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, field_serializer, field_validator, model_validator

from dpft.config.base import EvalCfg, LogCfg, OutputCfg, PerfCfg, PluginConfig
from dpft.config.refusals import refuse
from dpft.config.tasks import is_pair_task
from dpft.config.methods_hook import (NO_REGISTRY, MethodsSchema, handed_schema, methods_schema,  # noqa: F401
                                     set_methods_schema)  # public here: dpft.config.recipe.set_methods_schema
from dpft.config.tune import Duration, TuneCfg, time_budget_steps


#: ``auto``: chosen by accounting/budget.py (issue 35) before the run is planned.
Auto = Literal["auto"]
_PosInt = Annotated[int, Field(ge=1)]


#: The strict base of every section (public name: :class:`~dpft.config.base.PluginConfig`).
_Strict = PluginConfig


def _refuses(key: str, way: str, bad, field: str, mode: str = "after", **values):
    """A validator of ``field`` raising the shared refusal ``key`` (config/refusals.py, worded as in every way
    in) where ``bad(value)``; None, booleans and (before validation) non-scalars are left to pydantic."""
    def check(cls, v):
        if v is not None and not isinstance(v, bool) and (mode == "after" or isinstance(v, (int, float, str))) and bad(v):
            raise refuse(key, way, got=v, **values)
        return v
    return field_validator(field, mode=mode)(classmethod(check))


_CLIP_STYLES = ("flat", "per_layer", "automatic", "head_body")
_below_one = lambda v: not isinstance(v, str) and v < 1  # noqa: E731  (a string is pydantic's to parse)


class AdapterCfg(_Strict):
    """Bottleneck adapters (Houlsby et al. 2019; models/adapters.py): the Adapter-DP baseline."""

    type: Literal["houlsby"] = "houlsby"
    #: Bottleneck width = hidden size // reduction_factor (16: 384 → 24 for MiniLM).
    reduction_factor: int = Field(16, ge=1)
    nonlinearity: Literal["relu", "gelu"] = "relu"


class ModelCfg(_Strict):
    #: Hugging Face model directory, hub id, or ``minilm`` (embedded all-MiniLM-L6-v2).
    name: str = "minilm"
    #: Tokens per example (longer inputs are truncated).
    max_length: int = Field(64, ge=2, le=8192)
    #: Sentence representation fed to the classification head: ``model`` = the architecture's
    #: own head (BERT: [CLS] → pooler), ``mean`` = masked mean of the last hidden states (how
    #: sentence-transformers models such as all-MiniLM-L6-v2 were trained; a much better start).
    pooling: Literal["model", "mean"] = "model"
    #: Dropout before the head with ``pooling: mean``.
    head_dropout: float = Field(0.1, ge=0, lt=1)
    #: How a sentence pair (``task.text_pair_column``, QNLI) reaches the head with ``pooling: mean``:
    #: ``joint`` = one encoding of the pair; ``siamese`` = each sentence encoded alone and the head on
    #: ``[u, v, |u − v|, √H · u ⊙ v]`` of the two normalised embeddings (Sentence-BERT's classification
    #: features; models/hf_mean_pool.py). ``siamese`` needs a frozen encoder (``trainable.mode: head``).
    pair: Literal["joint", "siamese"] = "joint"
    #: Override every dropout probability of the model (``0`` disables dropout, which often
    #: helps under DP: the clipped, noisy gradient is regularised enough). None = as loaded.
    dropout: Optional[float] = Field(None, ge=0, lt=1)
    #: Bottleneck adapters in every block (BERT family); only adapters + head train
    #: (needs ``trainable.mode: head``). None = no adapters.
    adapter: Optional[AdapterCfg] = None
    #: QLoRA (models/quant.py): load the causal LM's frozen base quantized with bitsandbytes —
    #: ``nf4`` (4-bit NormalFloat, double quantization, computed in perf.dtype) or ``int8``
    #: (LLM.int8 with llm_int8_threshold 0: no outlier columns chosen across examples) — and train
    #: LoRA adapters on it (needs ``trainable.mode: lora``, ``pip install 'dpft[quant]'``). None =
    #: full precision.
    quantization: Optional[Literal["nf4", "int8"]] = None

    @model_validator(mode="after")
    def _quantization_without_adapter(self):
        if self.quantization is not None and self.adapter is not None:
            raise ValueError(f"model.quantization {self.quantization} with model.adapter: bottleneck adapters are "
                             "not verified over a quantized base; drop one (QLoRA trains LoRA: trainable.mode: lora)")
        return self


class TaskCfg(_Strict):
    #: Registered task (sst2, sst5, imdb, qnli), ``files`` for your own CSV/TSV/JSONL/Parquet,
    #: ``text`` (causal-LM corpus) or ``instruct`` (prompt/completion or chat, causal LM), or
    #: ``seq2seq`` (source/target pairs, encoder-decoder: T5, BART).
    name: str = "sst2"
    train_file: Optional[str] = None
    dev_file: Optional[str] = None
    #: A labelled test file (same columns and format as the training file; registered tasks:
    #: their own column names), evaluated ONCE after the last step with the final weights and
    #: reported apart from dev (report.json ``test``). Never used for selection or stopping.
    #: Classification tasks only.
    test_file: Optional[str] = None
    text_column: Optional[str] = None
    text_pair_column: Optional[str] = None
    label_column: Optional[str] = None
    #: ``files``: the classes in id order (default: the training rows' sorted distinct string labels, or
    #: 0..K-1 for integers); ``dpft tune``'s trials keep the task's own order with it.
    label_names: Optional[list[str]] = None
    #: Use only the first n training examples (after a seeded shuffle); N is then n.
    max_train_examples: Optional[int] = Field(None, ge=1)
    max_dev_examples: Optional[int] = Field(None, ge=1)
    #: The dev file is public (not private data): ``dpft tune`` scores trials on it exactly.
    dev_public: bool = False
    #: Fraction of train held out as dev when the task has no dev file.
    dev_fraction: float = Field(0.1, gt=0, lt=1)
    #: ``text`` task (causal LM) only: the privacy unit. ``block`` = the corpus is tokenised,
    #: concatenated and cut into blocks of model.max_length tokens, one block one example;
    #: ``document`` = one text row is one example (its tokens never share a row with another
    #: row's, truncated to model.max_length). See data/text.py.
    unit: Literal["block", "document"] = "block"
    # ---- user-level privacy (issue 17 item 2; step/sample.py UserPoissonSampler, grads/groups.py)
    #: Column naming each row's user (person). Set: the privacy unit is the user, not the row —
    #: Poisson sampling over users (batch.expected_batch_size = expected *users* per step), at
    #: most ``max_rows_per_user`` rows of a sampled user per step, the user's summed gradient
    #: clipped to C. None (default): example-level DP.
    user_column: Optional[str] = None
    #: k: rows a sampled user contributes per step at most (a fresh random subset each time).
    max_rows_per_user: int = Field(4, ge=1)
    #: ``group``: the user's summed gradient clipped to C exactly (group norm from book-keeping
    #: quantities); ``per_example_over_k``: each row clipped to C/k, then summed (conservative).
    user_clipping: Literal["group", "per_example_over_k"] = "group"
    _k = _refuses("task.max_rows_per_user:range", "recipe", _below_one, "max_rows_per_user", "before")
    _user_clip = _refuses("task.user_clipping:unknown", "recipe", lambda v: v not in ("group", "per_example_over_k"),
                          "user_clipping", "before")

    # ---- ``instruct`` task (issue 17; data/instruct.py): prompt/completion or chat rows, loss on
    # the completion / assistant tokens only. Columns not named here are kept (e.g. a user id).
    #: Prompt and completion columns (used when the file has no ``messages_column``).
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    #: Column holding a list of ``{role, content}`` messages (chat data).
    messages_column: str = "messages"
    #: ``auto`` = the tokenizer's chat template when it has one, else ``simple`` (data/instruct.py).
    template: Literal["auto", "chat", "simple"] = "auto"
    #: ``simple`` template: text between a prompt and its completion.
    separator: str = "\n"
    # ---- ``seq2seq`` task (issue 27; data/seq2seq.py): source → target pairs for encoder-decoder
    # models (T5, BART), loss on the target tokens; source = prompt_column, target = completion_column.
    #: Target tokens per example (EOS included); None = model.max_length.
    max_target_length: Optional[int] = Field(None, ge=2, le=8192)

    @model_validator(mode="after")
    def _test_file_classification(self):
        if self.test_file and self.name in ("text", "instruct", "seq2seq"):
            raise ValueError(f"task.test_file is evaluated for classification tasks only (task {self.name!r}); "
                             "use `dpft predict RUN_DIR --file F` for generations")
        return self


class LoraCfg(_Strict):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    #: None: the architecture's (PEFT's targets for its model type, else its attention's query and value
    #: projections; models/lora_targets.py), e.g. query, value on BERT and q_proj, v_proj on Llama
    target_modules: Optional[list[str]] = None


class TrainableCfg(_Strict):
    #: full · head · last_k · bias · lora · units · auto (``dpft train`` / ``dpft tune`` choose from N, ε
    #: and the compute budget before the plan: run/scope.py; the Python ways in need a scope)
    mode: Literal["full", "head", "last_k", "bias", "lora", "units", "auto"] = "full"
    #: Number of top transformer blocks trained with ``last_k`` (the head always trains).
    last_k: int = Field(2, ge=1)
    #: Freeze the token (word) embedding matrix in ``full`` mode.
    freeze_embeddings: bool = False
    lora: LoraCfg = LoraCfg()
    #: (units mode) named units to train: ``embeddings``, ``block.i``, ``head``, or module paths
    #: (models/units.py); DP-SelFT writes its selected units here.
    units: list[str] = []
    #: (units mode) the classification head (often freshly initialised) trains too.
    units_with_head: bool = True
    #: (units mode) LoRA (``lora`` settings) on the selected units' Linear layers instead of
    #: updating them directly (DP-SelFT+LoRA).
    units_lora: bool = False

    @model_validator(mode="after")
    def _units_given(self):
        if self.mode == "units" and not self.units:
            raise ValueError("trainable.mode=units needs trainable.units (e.g. [block.4, block.5, head])")
        return self


class ClippingCfg(_Strict):
    #: flat · per_layer (C/√G per parameter) · automatic (AUTO-S) · head_body (head and the
    #: rest clipped separately to C√f and C√(1−f); f = head_fraction)
    style: Literal["flat", "per_layer", "automatic", "head_body"] = "flat"
    #: Share f of C² given to the task head with style head_body.
    head_fraction: float = Field(0.5, gt=0, lt=1)
    #: Clipping norm C (L2, per example).
    max_norm: float = Field(1.0, gt=0)
    #: AUTO-S stability constant (automatic style only).
    gamma: float = Field(0.01, gt=0)
    _style = _refuses("privacy.clipping.style:unknown", "recipe", lambda v: v not in _CLIP_STYLES, "style", "before",
                      allowed=_CLIP_STYLES)


class PrivacyCfg(_Strict):
    #: False = non-private reference run (no clipping, no noise, no guarantee).
    enabled: bool = True
    target_epsilon: Optional[float] = 8.0
    delta: float = 1e-5
    #: Fix σ (finite, ≥ 0) instead of calibrating it from target_epsilon.
    noise_multiplier: Optional[float] = None
    clipping: ClippingCfg = ClippingCfg()
    #: Per-example engine: bookkeeping (fast, one backward) or reference (torch.func).
    engine: Literal["auto", "bookkeeping", "reference"] = "auto"
    #: REPRODUCIBLE MODE (research and tests only). False (default): every mechanism draws from
    #: one secret key from the OS CSPRNG that is never written (privacy/randomness.py). True:
    #: the key is derived from the recorded ``seed`` — same batches and noise for the same seed,
    #: and the ε holds only while that seed stays secret (the report says so).
    reproducible: bool = False
    #: Accepted for compatibility and ignored: every mechanism's normal is always the sum of four
    #: independent generators' normals / 2 (≥ 128 secret bits per draw, and Opacus secure_mode's
    #: denser support; privacy/randomness.py).
    hardened_noise: bool = True
    #: ``gaussian``: independent noise every step (DP-SGD). ``banded_mf``: correlated noise of a
    #: ``bands``-banded matrix factorization with cyclic Poisson (b-min-separated) participation
    #: (Choquette-Choo et al. 2023; step/correlated.py, docs/mechanisms.md).
    mechanism: Literal["gaussian", "banded_mf"] = "gaussian"
    #: Bands b of ``banded_mf`` (b = 1 is DP-SGD); memory: b − 1 noise buffers of the trainable size.
    bands: int = Field(4, ge=1)

    _eps = _refuses("privacy.target_epsilon:range", "recipe", lambda v: not v > 0, "target_epsilon")
    _delta = _refuses("privacy.delta:range", "recipe", lambda v: not 0 < v < 1, "delta")
    _sigma = _refuses("privacy.noise_multiplier:range", "recipe", lambda v: not (v >= 0 and math.isfinite(v)),
                      "noise_multiplier")

    @model_validator(mode="after")
    def _target_or_sigma(self):
        # a recipe's target_epsilon has a default (8), so a given noise_multiplier wins over it: only "neither"
        if self.enabled and self.target_epsilon is None and self.noise_multiplier is None:
            raise refuse("privacy.noise_multiplier:both_or_neither", "recipe")
        return self


class OptimizerCfg(_Strict):
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: float = Field(5e-4, gt=0)
    #: Learning rate of the task head (classifier/score/pooler) when it differs from ``lr``:
    #: a freshly initialised head needs larger steps than pretrained weights, and under DP its
    #: few coordinates see far less noise per coordinate than the body's millions.
    head_lr: Optional[float] = Field(None, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)


class ScheduleCfg(_Strict):
    #: Number of logical (noisy) steps; or give epochs (steps = epochs / q); ``auto``: see compute_budget.
    steps: Optional[_PosInt | Auto] = None
    #: Examples processed (B·T) for ``steps: auto`` / ``batch.expected_batch_size: auto``; None = 3 epochs.
    compute_budget: Optional[int] = Field(None, ge=1)
    #: Wall-clock budget (``30m``, ``2h``, seconds) for ``steps: auto``: T from a timed probe step
    #: (run/timing.py); given alone it sets ``steps: auto``.
    time_budget: Optional[Duration] = None
    epochs: Optional[float] = Field(None, gt=0)
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["linear", "constant"] = "linear"

    _time_budget = model_validator(mode="before")(time_budget_steps)

    @model_validator(mode="after")
    def _one_of(self):
        if self.steps is None and self.epochs is None:
            raise refuse("schedule.steps:no_length", "recipe", why="a run")
        if self.steps is not None and self.epochs is not None:
            raise refuse("schedule.steps:both_lengths", "recipe")
        return self


class BatchCfg(_Strict):
    #: Expected logical batch size q·N (Poisson sampling rate q = this / N); ``auto``: accounting/budget.py.
    expected_batch_size: _PosInt | Auto = 256
    #: Largest micro-batch run through the model at once (memory bound).
    max_physical_batch_size: int = Field(32, ge=1)
    _physical = _refuses("batch.max_physical_batch_size:range", "recipe", _below_one, "max_physical_batch_size",
                         "before")

    #: Variable sampling rate: ``[[from_step, expected_batch_size], ...]`` (steps 0-based,
    #: first entry at step 0). Each step's own q goes in the ledger (step/sample.py ``ScheduledPoissonSampler``).
    schedule: Optional[list[tuple[int, int]]] = None
    #: Truncated Poisson: at most this many examples per logical batch (a uniformly random subset
    #: when more are drawn), accounted by ``TruncatedSubsampledGaussianDpEvent``; micro-batches
    #: then have fixed shapes (max_physical_batch_size × model.max_length, padding masked).
    max_batch_size: Optional[int] = Field(None, ge=1)


# ---- perf: performance settings (issue 16). Speed and memory only: nothing here can change
# the guarantee, which privacy: alone defines (DESIGN.md "Performance settings are not privacy
# settings"; dpft/placement/device.py).
class Recipe(_Strict):
    """A dpft run. See ``recipes/sst2-minilm.yaml`` for an annotated example."""

    name: str = "run"
    #: Public seed: initialisation of a new head, data subsets and dev hold-outs. Mechanisms
    #: (sampling, noise, randomized response) use it only with ``privacy.reproducible: true``.
    seed: int = 0
    model: ModelCfg = ModelCfg()
    task: TaskCfg = TaskCfg()
    trainable: TrainableCfg = TrainableCfg()
    privacy: PrivacyCfg = PrivacyCfg()
    optimizer: OptimizerCfg = OptimizerCfg()
    schedule: ScheduleCfg = ScheduleCfg(steps=100)
    batch: BatchCfg = BatchCfg()
    #: Device, precision, activation checkpointing, compile: never the guarantee.
    perf: PerfCfg = PerfCfg()
    eval: EvalCfg = EvalCfg()
    log: LogCfg = LogCfg()
    output: OutputCfg = OutputCfg()
    #: The run's methods (methods/base.py): a list of ``{name: <registered method>, <its keys>}``,
    #: each validated by the registered method's own config model. The built-ins' historical
    #: sections ``subspace:`` (DP-SFT), ``ldp:`` (EW-FT / DP-Forward), ``adam_ac:`` (DP-Adam-AC)
    #: and ``denoise:`` (RMT) are accepted and moved here.
    methods: list[Any] = []
    #: Private hyperparameter search (``dpft tune``; config_tune.py). Ignored by ``dpft train``.
    tune: Optional[TuneCfg] = None
    #: Write a checkpoint every this many steps (and at the end).
    checkpoint_every: int = Field(50, ge=1)
    #: Also checkpoint at every release (issue 36: a crash then replays nothing). None (auto): when
    #: the trainable part is small — ``trainable.mode`` lora, head or bias, at most 20M parameters —
    #: so the checkpoint is cheap; true / false force it.
    checkpoint_every_release: Optional[bool] = None
    output_dir: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_sections(cls, data: Any) -> Any:
        """Move ``subspace:``/``ldp:``/``adam_ac:``/``denoise:`` into ``methods:``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        methods = list(data.get("methods") or [])
        if handed_schema() is None:  # no registry handed: a recipe that names no method still validates
            named = [k for k in _LEGACY_ATTRS if data.get(k) is not None] + (["methods"] if methods else [])
            if named:
                raise ValueError(f"{', '.join(named)}: {NO_REGISTRY}")
            return data
        for section, name in methods_schema().legacy_sections().items():
            if section in data:
                body = data.pop(section)
                if body is None:
                    continue
                if isinstance(body, BaseModel):
                    body = body.model_dump()
                if not isinstance(body, dict):
                    raise ValueError(f"{section}: expected a mapping of keys, got {body!r}")
                if any(_method_entry_name(m) == name for m in methods):
                    raise ValueError(f"method {name!r} given both as {section}: and in methods:; keep one")
                methods.append({"name": name, **body})
        data["methods"] = methods
        return data

    @model_validator(mode="before")
    @classmethod
    def _perf_alias(cls, data: Any) -> Any:
        """``perf.max_physical_batch_size`` is accepted and moved to
        ``batch.max_physical_batch_size`` (where existing recipes keep it): the physical batch
        is a performance setting, but one key holds it."""
        if not isinstance(data, dict) or not isinstance(data.get("perf"), dict):
            return data
        if "max_physical_batch_size" not in data["perf"]:
            return data
        data = dict(data)
        perf = dict(data["perf"])
        v = perf.pop("max_physical_batch_size")
        batch = data.get("batch")
        batch = dict(batch) if isinstance(batch, dict) else (batch.model_dump() if isinstance(batch, BaseModel) else {})
        if "max_physical_batch_size" in batch and batch["max_physical_batch_size"] != v:
            raise ValueError(f"perf.max_physical_batch_size = {v!r} and batch.max_physical_batch_size = "
                             f"{batch['max_physical_batch_size']!r} disagree; keep one (it lives in batch:)")
        batch["max_physical_batch_size"] = v
        data["perf"], data["batch"] = perf, batch
        return data

    @field_validator("methods", mode="before")
    @classmethod
    def _validate_methods(cls, v: Any) -> list[Any]:
        if not v:
            return []
        config_model = methods_schema().config_model
        out, seen = [], set()
        for i, item in enumerate(v or []):
            if isinstance(item, BaseModel):
                out.append(item)
                continue
            if not isinstance(item, dict) or "name" not in item:
                raise ValueError(f"methods[{i}]: expected {{name: <method>, ...}}, got {item!r}")
            body = dict(item)
            name = body.pop("name")
            if name in seen:
                raise ValueError(f"methods: {name!r} appears twice")
            seen.add(name)
            out.append(config_model(name).model_validate(body))
        return out

    @field_serializer("methods")
    def _dump_methods(self, v: list[Any]) -> list[dict[str, Any]]:
        if not v:
            return []
        name_of = methods_schema().name_of
        return [{"name": name_of(c), **c.model_dump(mode="json")} for c in v]

    @model_validator(mode="after")
    def _siamese_reads_frozen_features(self):
        """``model.pair: siamese`` runs the encoder on two rows per example: only the head may train."""
        if self.model.pair != "siamese":
            return self
        fix = []
        if self.model.pooling != "mean":
            fix.append(f"model.pooling: mean (not {self.model.pooling})")
        if self.trainable.mode not in ("head", "auto"):
            fix.append(f"trainable.mode: head (not {self.trainable.mode}: the encoder would see two rows per "
                       "example, so per-example gradients would be per sentence)")
        if self.model.adapter is not None:
            fix.append("no model.adapter (adapters train inside the encoder)")
        if self.task.name == "files" and not self.task.text_pair_column:
            fix.append("task.text_pair_column (the second sentence's column)")
        elif not is_pair_task(self.task.name, self.task.text_pair_column):
            fix.append(f"a sentence-pair task (task {self.task.name} has one text per row)")
        if fix:
            raise ValueError("model.pair: siamese needs " + "; ".join(fix) + ", or model.pair: joint")
        return self

    def method_config(self, name: str) -> BaseModel:
        """The config of method ``name`` in this recipe, or its defaults when absent."""
        cls = methods_schema().config_model(name)
        for c in self.methods:
            if type(c) is cls:
                return c
        return cls()

    def __getattr__(self, item: str) -> Any:
        # Historical sections (recipe.subspace, recipe.ldp, …) read the method configs.
        if item in _LEGACY_ATTRS:
            return self.method_config(_LEGACY_ATTRS[item])
        return super().__getattr__(item)  # type: ignore[misc]


#: Recipe attributes kept for the built-in methods' historical sections.
_LEGACY_ATTRS = {"subspace": "dpsft", "ldp": "ewft", "adam_ac": "dp_adam_ac", "denoise": "rmt"}


def _method_entry_name(m: Any) -> Optional[str]:
    if isinstance(m, dict):
        return m.get("name")
    return None


class RecipeError(ValueError):
    """A recipe that does not validate; the message lists each bad key and what to do."""


def _model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The pydantic model a field holds (also inside ``Optional[...]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        m = _model_in(arg)
        if m is not None:
            return m
    return None


def recipe_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every valid dotted key of a recipe (sections and leaves), walking nested models in
    field order: ``name``, …, ``privacy``, ``privacy.target_epsilon``, ``privacy.clipping.style``…"""
    keys: list[str] = []
    for field, info in model.model_fields.items():
        key = prefix + field
        keys.append(key)
        sub = _model_in(info.annotation)
        if sub is not None:
            keys.extend(recipe_keys(sub, key + "."))
    schema = handed_schema()
    if model is Recipe and not prefix and schema is not None:
        # the built-in methods' sections (subspace., ldp., adam_ac., denoise.) from their configs
        for section, name in schema.legacy_sections().items():
            keys.append(section)
            keys.extend(recipe_keys(schema.config_model(name), section + "."))
    return keys


def suggest_key(key: str, keys: Optional[list[str]] = None) -> Optional[str]:
    """The valid dotted key closest to an unknown one (difflib ratios), or None.

    A candidate scores the better of its whole-key ratio (``privacy.epsilon`` →
    ``privacy.target_epsilon``) and its last-part ratio, so that the right field under the wrong
    section, or under none, is still found (``optimizer.epochs`` → ``schedule.epochs``,
    ``epsilon`` → ``privacy.target_epsilon``); a last part that contains the other (or is
    contained in it) scores at least 0.8. Ties go to the key first in recipe order; below 0.6
    there is no suggestion."""
    keys = recipe_keys() if keys is None else keys
    leaf = key.rsplit(".", 1)[-1]
    best, best_score = None, 0.6
    for cand in keys:
        cleaf = cand.rsplit(".", 1)[-1]
        part = difflib.SequenceMatcher(None, leaf, cleaf).ratio()
        if min(len(leaf), len(cleaf)) >= 3 and (leaf in cleaf or cleaf in leaf):
            part = max(part, 0.8)
        score = max(difflib.SequenceMatcher(None, key, cand).ratio(), part)
        if score > best_score or (best is None and score == best_score):
            best, best_score = cand, score
    return best


def _hint(key: str) -> str:
    best = suggest_key(key)
    return f"; did you mean '{best}'?" if best else " (see recipes/sst2-minilm.yaml for the keys)"


def _override_of(loc: str, origins: dict[str, str], unknown: bool) -> Optional[str]:
    """The override key whose value holds the error at ``loc``, else None (the value came from
    the recipe file). ``loc`` is that key or lies inside the value it set (``--set
    privacy.clipping={...}``); for an unknown key also a section above it (``--set foo.bar=1``
    fails at ``foo``). A section's own check (``schedule: set steps or epochs``) is blamed on
    no flag: any of its keys may be at fault."""
    for k in reversed(list(origins)):
        if k == loc or loc.startswith(k + ".") or (unknown and k.startswith(loc + ".")):
            return k
    return None


def _format_errors(err: ValidationError, source: str, origins: Optional[dict[str, str]] = None) -> str:
    """One line per error, each blamed on where its value came from.

    ``origins`` maps each override key to how the user gave it (``--set privacy.epsilon=3``,
    ``--epsilon -1``); an error at such a key names that flag, not the recipe file. Unknown
    keys get the closest valid key (``did you mean …``)."""
    origins = origins or {}
    lines, all_flags = [], True
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        unknown = e["type"] == "extra_forbidden"
        ov = _override_of(loc, origins, unknown) if e["loc"] else None
        got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
        if ov is not None:
            if unknown:
                key = ov if len(ov) > len(loc) else loc  # --set foo.bar=1: 'foo.bar' is the unknown key
                lines.append(f"{origins[ov]}: unknown key '{key}'{_hint(key)}")
            else:
                lines.append(f"{origins[ov]}: {loc}: {e['msg']}{got}")
            continue
        all_flags = False
        if unknown:
            where = f" in {source}" if source != "(no file)" else ""
            lines.append(f"{loc}: unknown key{where}{_hint(loc)}")
        else:
            lines.append(f"{loc}: {e['msg']}{got}")
    if all_flags and len(lines) == 1:
        return lines[0]
    head = "invalid settings:" if all_flags else f"invalid recipe {source}:"
    return "\n".join([head, *("  - " + x for x in lines)])


def _parse_scalar(text: str) -> Any:
    """A CLI value as YAML would read it (``1e-5`` → float, ``true`` → bool, ``[a,b]`` → list)."""
    v = yaml.safe_load(text)
    if isinstance(v, str):
        try:
            return float(v) if any(c in v for c in ".eE") else v
        except ValueError:
            return v
    return v


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``privacy.target_epsilon``) in a nested dict, creating levels."""
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return data


def load_recipe(path: str | Path | None, overrides: dict[str, Any] | None = None,
                origins: dict[str, str] | None = None) -> Recipe:
    """Read a YAML recipe, apply dotted-key overrides, validate.

    ``origins`` says how each override was given (``{"privacy.epsilon": "--set privacy.epsilon=3"}``)
    so that an error in it names that flag rather than the file; an override without one is
    named ``override KEY=VALUE``.

    Raises:
        RecipeError: missing file, bad YAML, unknown key or bad value (all listed).
    """
    data: dict[str, Any] = {}
    source = str(path) if path else "(no file)"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {p} (see recipes/ for examples)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise RecipeError(f"recipe {p} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {p} must be a mapping of keys, got {type(data).__name__}")
    overrides = dict(overrides or {})
    named = {k: (origins or {}).get(k) or f"override {k}={v!r}" for k, v in overrides.items()}
    data = apply_overrides(data, overrides)
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_errors(err, source, named)) from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
