"""Task registry and loading through ``datasets``.

Every task yields two ``datasets.Dataset`` splits with columns ``text``, optional
``text_pair`` and ``label`` (int in ``[0, num_labels)``). Registered tasks load from the hub
when online; offline they read the same files from ``DPFT_DATA_DIR`` (the layout of
``../shared/data``: ``sst2/train.tsv`` …). ``files`` loads your own CSV, TSV, JSONL or Parquet.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import datasets

from dpft.config import TaskCfg

datasets.disable_progress_bars()  # dpft's own bar is the one that matters


class DataError(ValueError):
    """Bad or missing data; the message names the file/column and the fix."""


@dataclass
class TaskData:
    """Loaded task. ``train``/``dev`` have columns text, [text_pair], label (int)."""

    name: str
    train: datasets.Dataset
    dev: datasets.Dataset
    label_names: list[str]
    source: str
    notes: list[str] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def has_pair(self) -> bool:
        return "text_pair" in self.train.column_names


def data_dir() -> Optional[Path]:
    d = os.environ.get("DPFT_DATA_DIR")
    return Path(d) if d else None


def _load_file(path: str | Path) -> datasets.Dataset:
    """One local file through ``datasets`` (format from the extension)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {p}")
    name = p.name.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if p.stat().st_size == 0:
        raise DataError(f"data file {p} is empty; give a file with a header and at least one row")
    try:
        return _load_by_type(p, name)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets/pandas parse errors
        raise DataError(f"cannot read {p} ({type(exc).__name__}: {str(exc)[:200]}); "
                        "check that it is a well-formed file with a header row (or no rows at all)") from None


def _load_by_type(p: Path, name: str) -> datasets.Dataset:
    files = {"train": str(p)}
    if name.endswith(".tsv"):
        # QUOTE_NONE: SST/GLUE text holds bare quote characters.
        ds = datasets.load_dataset("csv", data_files=files, delimiter="\t", quoting=csv.QUOTE_NONE)
    elif name.endswith(".csv"):
        ds = datasets.load_dataset("csv", data_files=files)
    elif name.endswith((".jsonl", ".json")):
        ds = datasets.load_dataset("json", data_files=files)
    elif name.endswith(".parquet"):
        ds = datasets.load_dataset("parquet", data_files=files)
    else:
        raise DataError(f"unsupported file type {p.name}: use .csv, .tsv, .jsonl/.json or .parquet")
    return ds["train"]


def _standardise(ds: datasets.Dataset, text: str, pair: Optional[str], label: str, where: str) -> datasets.Dataset:
    cols = ds.column_names
    for role, c in (("text", text), ("text pair", pair), ("label", label)):
        if c is not None and c not in cols:
            raise DataError(
                f"{where}: no {role} column {c!r}; columns are {cols}. "
                f"Pass --{role.replace(' ', '-')}-column with one of them"
            )
    keep = {text: "text", label: "label"}
    if pair:
        keep[pair] = "text_pair"
    ds = ds.select_columns(list(keep)).rename_columns({k: v for k, v in keep.items() if k != v})
    return ds


def _encode_labels(train, dev, where: str, label_names: Optional[list[str]] = None):
    """Map labels to ints. Strings get a sorted label set from train; ints must be in range."""
    if len(train) == 0:
        raise DataError(f"{where}: the training split is empty; give a file with at least one row")
    if len(dev) == 0:
        raise DataError(f"{where}: the dev split is empty; give a dev file or a larger train file")
    feat = train.features["label"]
    if isinstance(feat, datasets.ClassLabel):
        return train, dev, list(feat.names)
    tr_vals = train["label"]
    if any(v is None for v in tr_vals) or any(v is None for v in dev["label"]):
        raise DataError(f"{where}: some rows have no label; drop them or fill the label column")
    if label_names is not None and all(isinstance(v, str) for v in tr_vals):
        names = label_names
    elif all(isinstance(v, str) for v in tr_vals):
        names = sorted(set(tr_vals))
    else:
        try:
            ints = sorted({int(v) for v in tr_vals})
        except (TypeError, ValueError) as exc:
            raise DataError(f"{where}: labels must be all integers or all strings ({exc})") from None
        if ints[0] < 0:
            raise DataError(f"{where}: negative label {ints[0]}; labels must be 0..K-1 or strings")
        k = ints[-1] + 1 if label_names is None else len(label_names)
        names = label_names or [str(i) for i in range(k)]
        if any(int(v) >= k for v in dev["label"]) or ints[-1] >= k:
            bad = max(int(v) for v in list(dev["label"]) + list(tr_vals))
            raise DataError(f"{where}: label {bad} outside the label set 0..{k - 1}; fix the labels")
        ints_ok = lambda ex: {"label": int(ex["label"])}  # noqa: E731
        return train.map(ints_ok), dev.map(ints_ok), names
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({str(v) for v in dev["label"] if v not in index} | {str(v) for v in tr_vals if v not in index})
    if unknown:
        raise DataError(f"{where}: labels {unknown[:5]} are not in the label set {names}; fix or drop those rows")
    enc = lambda ex: {"label": index[ex["label"]]}  # noqa: E731
    train = train.map(enc).cast_column("label", datasets.Value("int64"))
    dev = dev.map(enc).cast_column("label", datasets.Value("int64"))
    return train, dev, names


@dataclass
class TaskSpec:
    """A registered task: local files (relative to DPFT_DATA_DIR) and its hub equivalent."""

    name: str
    text: str
    pair: Optional[str]
    label: str
    train_file: Optional[str]
    dev_file: Optional[str]
    hub: tuple[str, ...]
    hub_dev_split: str
    label_names: Optional[list[str]] = None
    note: Optional[str] = None


REGISTRY: dict[str, TaskSpec] = {
    "sst2": TaskSpec("sst2", "sentence", None, "label", "sst2/train.tsv", "sst2/dev.tsv",
                     ("glue", "sst2"), "validation", ["negative", "positive"]),
    "sst5": TaskSpec("sst5", "sentence", None, "label", "sst5/train.tsv", "sst5/dev.tsv",
                     ("SetFit/sst5",), "validation",
                     ["very negative", "negative", "neutral", "positive", "very positive"]),
    "imdb": TaskSpec("imdb", "text", None, "label", "imdb/train.jsonl.gz", "imdb/test.jsonl.gz",
                     ("imdb",), "test", ["negative", "positive"],
                     note="IMDB has no dev split; its test split is used as dev"),
    "qnli": TaskSpec("qnli", "question", "sentence", "label", None, "qnli/dev.tsv",
                     ("glue", "qnli"), "validation", ["entailment", "not_entailment"],
                     note="offline QNLI has no train split: GLUE dev is split 4,000 train / 1,463 eval"),
}


def load_task(cfg: TaskCfg, seed: int = 0) -> TaskData:
    """Load a task from the registry or from files.

    Raises:
        DataError: unknown task, missing file/column, empty split, labels out of range.
    """
    notes: list[str] = []
    if cfg.name == "files" or cfg.train_file:
        if not cfg.train_file:
            raise DataError("task 'files' needs --train-file (CSV, TSV, JSONL or Parquet)")
        text = cfg.text_column or "text"
        label = cfg.label_column or "label"
        train = _standardise(_load_file(cfg.train_file), text, cfg.text_pair_column, label, cfg.train_file)
        if cfg.dev_file:
            dev = _standardise(_load_file(cfg.dev_file), text, cfg.text_pair_column, label, cfg.dev_file)
        else:
            if len(train) < 2:
                raise DataError(f"{cfg.train_file}: too few rows to hold out a dev split; give --dev-file")
            split = train.train_test_split(test_size=cfg.dev_fraction, seed=seed)
            train, dev = split["train"], split["test"]
            notes.append(f"dev = {cfg.dev_fraction:.0%} of {cfg.train_file} held out (seed {seed})")
        train, dev, names = _encode_labels(train, dev, cfg.train_file)
        data = TaskData("files", train, dev, names, f"files: {cfg.train_file}", notes)
    else:
        if cfg.name not in REGISTRY:
            raise DataError(f"unknown task {cfg.name!r}; known: {sorted(REGISTRY)} or 'files' with --train-file")
        spec = REGISTRY[cfg.name]
        root = data_dir()
        if root is not None:
            data = _load_local(spec, root, seed)
        else:
            data = _load_hub(spec)
    data = _subsample(data, cfg, seed)
    return data


def _load_local(spec: TaskSpec, root: Path, seed: int) -> TaskData:
    where = f"DPFT_DATA_DIR={root} ({spec.name})"
    dev_path = root / spec.dev_file
    if not dev_path.is_file():
        raise DataError(f"{where}: missing {dev_path}; point DPFT_DATA_DIR at a folder laid out like ../shared/data")
    dev = _standardise(_load_file(dev_path), spec.text, spec.pair, spec.label, str(dev_path))
    notes = [spec.note] if spec.note else []
    if spec.train_file is None:
        split = dev.train_test_split(train_size=4000, seed=seed, shuffle=True)
        train, dev = split["train"], split["test"]
    else:
        train_path = root / spec.train_file
        train = _standardise(_load_file(train_path), spec.text, spec.pair, spec.label, str(train_path))
    train, dev, names = _encode_labels(train, dev, where, spec.label_names)
    return TaskData(spec.name, train, dev, names, f"local files under {root}", notes)


def _load_hub(spec: TaskSpec) -> TaskData:
    try:
        ds = datasets.load_dataset(*spec.hub)
    except Exception as exc:  # noqa: BLE001 - offline, missing, renamed…
        raise DataError(
            f"could not load {spec.name} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Offline? Set DPFT_DATA_DIR to a folder with the task files (e.g. ../shared/data)"
        ) from None
    train = _standardise(ds["train"], spec.text, spec.pair, spec.label, spec.name)
    dev = _standardise(ds[spec.hub_dev_split], spec.text, spec.pair, spec.label, spec.name)
    train, dev, names = _encode_labels(train, dev, spec.name, spec.label_names)
    return TaskData(spec.name, train, dev, names, "hub: " + "/".join(spec.hub), [spec.note] if spec.note else [])


def _subsample(data: TaskData, cfg: TaskCfg, seed: int) -> TaskData:
    if cfg.max_train_examples and cfg.max_train_examples < len(data.train):
        data.train = data.train.shuffle(seed=seed).select(range(cfg.max_train_examples))
        data.notes.append(f"training set: a seeded random subset of {cfg.max_train_examples} examples (N = {cfg.max_train_examples})")
    if cfg.max_dev_examples and cfg.max_dev_examples < len(data.dev):
        data.dev = data.dev.shuffle(seed=seed).select(range(cfg.max_dev_examples))
        data.notes.append(f"dev set: a seeded random subset of {cfg.max_dev_examples} examples")
    return data
