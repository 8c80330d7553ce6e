"""Task registry and loading through ``datasets``.

Every task yields two ``datasets.Dataset`` splits with columns ``text``, optional
``text_pair`` and ``label`` (int in ``[0, num_labels)``). Registered tasks load from the hub
when online; offline they read the same files from ``DPFT_DATA_DIR`` (the layout of
``../shared/data``: ``sst2/train.tsv`` …). ``files`` loads your own CSV, TSV, JSONL or Parquet.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import datasets

from dpft.config.recipe import TaskCfg
from dpft.config.tasks import REGISTRY, TaskSpec

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
    #: Set by ``data.tokenize.tokenize_task``: ``{"max_length", "train", "dev"}``, the number of
    #: examples of each split truncated to ``max_length`` tokens.
    truncated: Optional[dict] = None

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def has_pair(self) -> bool:
        return "text_pair" in self.train.column_names


#: Project root when dpft runs from its source tree (src/dpft/data/tasks.py → the project).
_PROJECT = Path(__file__).resolve().parents[3]


def _looks_like_data(d: Path) -> bool:
    return (d / "MANIFEST.md").is_file() or any((d / spec.dev_file).is_file() for spec in REGISTRY.values())


def data_dir() -> Optional[Path]:
    """Folder of the registered tasks' files: ``DPFT_DATA_DIR`` when set; else ``../shared/data``
    beside the current folder or beside the project (what ``make demo`` uses) when it holds task
    files; else None (the Hugging Face hub)."""
    d = os.environ.get("DPFT_DATA_DIR")
    if d:
        return Path(d)
    for cand in (Path.cwd() / ".." / "shared" / "data", _PROJECT / ".." / "shared" / "data"):
        if cand.is_dir() and _looks_like_data(cand):
            return cand.resolve()
    return None


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the hub's host (HF_ENDPOINT), so that an offline machine fails in
    seconds rather than after the datasets library's retries (about a minute)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


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
    tabular = name.endswith((".csv", ".tsv"))
    no_rows = (f"{p} has a header but no rows; add data rows below the header" if tabular
               else f"{p} has no rows; give a file with at least one row")
    try:
        ds = _load_by_type(p, name)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets/pandas parse errors
        if "corresponds to no data" in str(exc):  # datasets' words for a file without rows
            raise DataError(no_rows) from None
        raise DataError(f"cannot read {p} ({type(exc).__name__}: {str(exc)[:200]}); "
                        "check that it is a well-formed file with a header row (or no rows at all)") from None
    if len(ds) == 0:
        raise DataError(no_rows)
    return ds


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


#: Column holding each row's 1-based position in its file, so that errors found after a
#: train/dev split still name the row (dropped before the data leave this module).
_ROW = "__dpft_row__"
#: Column of a split that names each row's user (privacy unit at user level, ``task.user_column``).
#: Any data path (classification, ``text``, instruction data) keeps it per row through
#: tokenisation; the trainer's user-level sampler reads it (step/sample.py ``UserPoissonSampler``).
USER_COLUMN = "user"


def _col(ds: datasets.Dataset, name: str) -> list:
    """One column as a list, read in one batch (``ds[name]`` iterates row by row in datasets ≥ 4)."""
    return ds.select_columns([name])[:][name]


def _rows(rows: list[int], shown: int = 5) -> str:
    """``"data row 3"`` / ``"data rows 3, 7, 9, … (12 in all)"``: 1-based, header not counted, in
    file order (a held-out split's rows come shuffled)."""
    rows = sorted(rows)
    head = ", ".join(str(r) for r in rows[:shown])
    more = f", … ({len(rows)} in all)" if len(rows) > shown else ""
    return f"data row{'s' if len(rows) > 1 else ''} {head}{more} (counting from 1, header excluded)"


def _standardise(ds: datasets.Dataset, text: str, pair: Optional[str], label: str, where: str,
                 user: Optional[str] = None) -> datasets.Dataset:
    """Keep and rename the text/[pair]/label (and, at user level, user) columns, check that no
    text is empty, and tag each row with its position in the file (column ``_ROW``).

    Raises:
        DataError: a missing column, or empty texts (the message names ``where`` and the rows).
    """
    cols = ds.column_names
    for role, c in (("text", text), ("text pair", pair), ("label", label), ("user", user)):
        if c is not None and c not in cols:
            raise DataError(
                f"{where}: no {role} column {c!r}; columns are {cols}. "
                f"Pass --{role.replace(' ', '-')}-column with one of them"
            )
    keep = {text: "text", label: "label"}
    if pair:
        keep[pair] = "text_pair"
    if user:
        keep[user] = USER_COLUMN
    ds = ds.select_columns(list(keep)).rename_columns({k: v for k, v in keep.items() if k != v})
    for std, c in (("text", text), ("text_pair", pair)):
        if c is None:
            continue
        empty = [i + 1 for i, t in enumerate(_col(ds, std)) if t is None or not str(t).strip()]
        if empty:
            raise DataError(f"{where}: empty text in column {c!r} at {_rows(empty)}; "
                            "fill those rows or drop them")
        feat = ds.features[std]
        if not (isinstance(feat, datasets.Value) and feat.dtype in ("string", "large_string")):
            ds = ds.cast_column(std, datasets.Value("string"))  # e.g. a column of numbers
    if user:
        missing = [i + 1 for i, u in enumerate(_col(ds, USER_COLUMN)) if u is None or not str(u).strip()]
        if missing:
            raise DataError(f"{where}: no user id in column {user!r} at {_rows(missing)}; every row needs its "
                            "user (person) at user-level privacy: fill those rows or drop them")
    return ds.add_column(_ROW, list(range(1, len(ds) + 1)))


def _drop_row(ds: datasets.Dataset) -> datasets.Dataset:
    return ds.remove_columns(_ROW) if _ROW in ds.column_names else ds


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _kind(v) -> str:
    """What a label is, never its value (``"a string"``, ``"a number that is not whole"``): the
    words a message uses for an offending label, since a label column may hold private text
    (``docs/bad_inputs.md``). The audit's ``label_quoted`` bug (audit/checks_data.py) plants a
    version that quotes the value."""
    if isinstance(v, str):
        return "a string"
    if isinstance(v, float) and not v.is_integer():
        return "a number that is not whole"
    if isinstance(v, (int, float)):
        return "a number"
    return f"a {type(v).__name__}"


def _int_labels(ds: datasets.Dataset, where: str, column: str) -> list[int]:
    """The labels of ``ds`` as ints; whole numbers written as floats (``1.0``) are accepted.

    Raises:
        DataError: a label that is not a number, or a number that is not whole (``1.5``); the
        message gives the rows and the label's kind, never its value.
    """
    out: list[int] = []
    frac: list[int] = []
    first_frac = None
    for v, r in zip(_col(ds, "label"), _col(ds, _ROW)):
        if isinstance(v, str) or not isinstance(v, (int, float)):  # its value is not quoted: it may be text
            raise DataError(f"{where}: the label in column {column!r} at {_rows([r])} is {_kind(v)} while "
                            "other labels are numbers; labels must be all integers 0..K-1 or all strings")
        if isinstance(v, float) and not v.is_integer():
            frac.append(r)
            first_frac = v if first_frac is None else first_frac
            continue
        out.append(int(v))
    if frac:
        raise DataError(f"{where}: column {column!r} has {len(frac)} non-integer label{'s' if len(frac) > 1 else ''} "
                        f"({_kind(first_frac)}) at {_rows(frac)}; labels must be whole numbers 0..K-1 or strings "
                        "(dpft does not round them)")
    return out


def _with_labels(ds: datasets.Dataset, labels: list[int]) -> datasets.Dataset:
    ds = ds.remove_columns("label").add_column("label", labels)
    return _drop_row(ds.cast_column("label", datasets.Value("int64")))


def _check_missing_labels(ds: datasets.Dataset, where: str, column: str) -> None:
    """Refuse rows without a label (None/NaN), naming every such row of ``ds`` in file order."""
    if isinstance(ds.features["label"], datasets.ClassLabel):
        return
    missing = [r for v, r in zip(_col(ds, "label"), _col(ds, _ROW)) if _is_missing(v)]
    if missing:
        raise DataError(f"{where}: no label in column {column!r} at {_rows(missing)}; "
                        "drop those rows or fill the label column")


def _check_two_classes(data: "TaskData", where: str, column: str) -> None:
    """A classifier needs at least two classes among its training rows.

    Raises:
        DataError: one class (the run would learn a constant and report a perfect dev score).
    """
    if len(set(_col(data.train, "label"))) < 2:
        _one_class(where, column)


def _one_class(where: str, column: str) -> None:
    # The class's value is not quoted: a label column may hold text (no message quotes a row).
    raise DataError(f"{where}: the training rows have one class (column {column!r}); a classifier needs at least "
                    "two. Check --label-column (is it the label?) or add rows of the other classes")


#: A class needs at least this many training rows (fewer: DP noise swamps it, or the value is a typo or
#: not a label), checked from :data:`MIN_ROWS_CHECKED` training rows on (smaller files are toy data).
MIN_ROWS_PER_CLASS = 5
MIN_ROWS_CHECKED = 100
#: At most max(this, N/10) classes: more cannot be labels (text and label columns swapped?).
MAX_CLASSES_FLOOR = 10


def _check_label_set(values: list, where: str, column: str, text_column: str) -> None:
    """Refuse a label column that is not a set of labels, from the training rows' values alone,
    before any model is loaded (issue 36 item 2): more classes than N/10 (and more than
    :data:`MAX_CLASSES_FLOOR`), or a class with fewer than :data:`MIN_ROWS_PER_CLASS` rows (in a
    file of at least :data:`MIN_ROWS_CHECKED` rows); one class; integer labels with gaps
    (``{0, 5}`` would silently size a 6-class head). Messages give counts, never a label value
    (a label column may hold the training texts: text and label columns swapped).

    Raises:
        DataError: naming the count and the fix."""
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    n, k = len(values), len(counts)
    if k < 2:
        _one_class(where, column)
    swap = (f"Check that --label-column names the label and --text-column the text (now {column!r} and "
            f"{text_column!r}: swapped?)")
    if k > MAX_CLASSES_FLOOR and k > n / 10:
        raise DataError(f"{where}: column {column!r} has {k} distinct values in {n} training rows (more than N/10 "
                        f"= {n // 10} and more than {MAX_CLASSES_FLOOR}): too many to be class labels, and a classifier cannot learn {k} classes "
                        f"from {n} rows under DP. {swap}, or merge rare classes")
    rare = sum(1 for c in counts.values() if c < MIN_ROWS_PER_CLASS) if n >= MIN_ROWS_CHECKED else 0
    if rare:
        raise DataError(f"{where}: {rare} of the {k} classes in column {column!r} have fewer than "
                        f"{MIN_ROWS_PER_CLASS} training rows (the smallest has {min(counts.values())}); DP noise "
                        f"swamps a class that rare. {swap}, or merge or drop the rare classes")
    if all(isinstance(v, int) for v in counts):
        hi = max(counts)
        gaps = [i for i in range(hi + 1) if i not in counts]
        if gaps:
            # counts only: which integers occur (or not) are label values
            raise DataError(f"{where}: integer labels in column {column!r} leave {len(gaps)} of the integers from 0 "
                            f"to the largest label unused in the training rows: the head would have {hi + 1} classes "
                            f"for {k} present. Renumber the labels 0..K-1, or write them as strings (e.g. \"c5\"), "
                            "which dpft maps to classes itself")


def _encode_labels(train, dev, train_where: str, dev_where: str, column: str = "label",
                   label_names: Optional[list[str]] = None, text_column: str = "text"):
    """Map labels to ints. Strings get a sorted label set from train; ints must be in range.

    ``train_where``/``dev_where`` name the file (or split) each comes from; ``column`` is the
    label column's name there. Errors name the file, the column and the first offending rows.
    """
    if len(train) == 0:
        raise DataError(f"{train_where}: the training split is empty; give a file with at least one row")
    if len(dev) == 0:
        raise DataError(f"{dev_where}: the dev split is empty; give a dev file or a larger train file")
    feat = train.features["label"]
    if isinstance(feat, datasets.ClassLabel):
        return _drop_row(train), _drop_row(dev), list(feat.names)
    splits = ((train, train_where), (dev, dev_where))
    for ds, where in splits:
        _check_missing_labels(ds, where, column)
    tr_vals = _col(train, "label")
    if all(isinstance(v, str) for v in tr_vals):
        if label_names is None:  # the training rows' values are the label set: check they are labels first
            _check_label_set(tr_vals, train_where, column, text_column)
        names = label_names if label_names is not None else sorted(set(tr_vals))
        index = {n: i for i, n in enumerate(names)}
        for ds, where in splits:
            unknown = [r for v, r in zip(_col(ds, "label"), _col(ds, _ROW)) if v not in index]
            if unknown:  # values not quoted (they may be text); the rows are named
                among = (f"the task's {len(names)} labels" if label_names is not None else
                         f"the {len(names)} labels of the training rows ({train_where})")
                raise DataError(f"{where}: {len(unknown)} label{'s' if len(unknown) > 1 else ''} in column {column!r} "
                                f"at {_rows(unknown)} {'are' if len(unknown) > 1 else 'is'} not among {among}; fix or "
                                "drop those rows (labels match exactly, case included)")
        return (_with_labels(train, [index[v] for v in tr_vals]),
                _with_labels(dev, [index[v] for v in _col(dev, "label")]), names)
    tr_ints = _int_labels(train, train_where, column)
    if label_names is None:
        _check_label_set(tr_ints, train_where, column, text_column)
    dv_ints = _int_labels(dev, dev_where, column)
    k = len(label_names) if label_names is not None else max(tr_ints) + 1
    names = label_names or [str(i) for i in range(k)]
    for ds, ints, where in ((train, tr_ints, train_where), (dev, dv_ints, dev_where)):
        bad = [r for v, r in zip(ints, _col(ds, _ROW)) if not 0 <= v < k]
        if bad:  # counted and located, never quoted: the values are private labels
            raise DataError(f"{where}: {len(bad)} label{'s' if len(bad) > 1 else ''} in column {column!r} at "
                            f"{_rows(bad)} {'are' if len(bad) > 1 else 'is'} outside the label set 0..{k - 1} (the "
                            f"{'task' if label_names is not None else 'training split'}'s: negative or ≥ {k}); fix "
                            "those labels (integer labels must be 0..K-1; strings are also accepted)")
    return _with_labels(train, tr_ints), _with_labels(dev, dv_ints), names


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
        train = _standardise(_load_file(cfg.train_file), text, cfg.text_pair_column, label, cfg.train_file,
                             user=cfg.user_column)
        dev_where = cfg.dev_file or f"{cfg.train_file} (held-out dev rows)"
        if cfg.dev_file:  # the dev set needs no user column
            dev = _standardise(_load_file(cfg.dev_file), text, cfg.text_pair_column, label, cfg.dev_file)
        else:
            if len(train) < 2:
                raise DataError(f"{cfg.train_file}: too few rows to hold out a dev split; give --dev-file")
            # before the split: every unlabelled row of the file, counted once, in file order
            _check_missing_labels(train, cfg.train_file, label)
            split = train.train_test_split(test_size=cfg.dev_fraction, seed=seed)
            train, dev = split["train"], split["test"]
            notes.append(f"dev = {cfg.dev_fraction:.0%} of {cfg.train_file} held out (seed {seed})")
        train, dev, names = _encode_labels(train, dev, cfg.train_file, dev_where, label, cfg.label_names,
                                           text_column=text)
        data = TaskData("files", train, dev, names, f"files: {cfg.train_file}", notes)
    else:
        if cfg.name not in REGISTRY:
            raise DataError(f"unknown task {cfg.name!r}; known: {sorted(REGISTRY)} or 'files' with --train-file")
        spec = REGISTRY[cfg.name]
        root = data_dir()
        if root is not None:
            data = _load_local(spec, root, seed, cfg.user_column)
        else:
            data = _load_hub(spec, cfg.user_column)
    data = _subsample(data, cfg, seed)
    _check_two_classes(data, cfg.train_file or f"task {data.name}", cfg.label_column or "label")
    return data


def _load_local(spec: TaskSpec, root: Path, seed: int, user: Optional[str] = None) -> TaskData:
    where = f"DPFT_DATA_DIR={root} ({spec.name})"
    dev_path = root / spec.dev_file
    if not dev_path.is_file():
        raise DataError(f"{where}: missing {dev_path}; point DPFT_DATA_DIR at a folder laid out like ../shared/data")
    dev = _standardise(_load_file(dev_path), spec.text, spec.pair, spec.label, str(dev_path),
                       user=user if spec.train_file is None else None)
    notes = [spec.note] if spec.note else []
    if spec.train_file is None:
        split = dev.train_test_split(train_size=4000, seed=seed, shuffle=True)
        train, dev = split["train"], split["test"]
        train_where = f"{dev_path} (rows used for training)"
    else:
        train_path = root / spec.train_file
        train = _standardise(_load_file(train_path), spec.text, spec.pair, spec.label, str(train_path), user=user)
        train_where = str(train_path)
    train, dev, names = _encode_labels(train, dev, train_where, str(dev_path), spec.label, spec.label_names)
    return TaskData(spec.name, train, dev, names, f"local files under {root}", notes)


def _load_hub(spec: TaskSpec, user: Optional[str] = None) -> TaskData:
    no_files = ("set DPFT_DATA_DIR to a folder with the task files laid out like ../shared/data "
                f"({spec.dev_file} …), or put that folder at ../shared/data beside the project")
    if _offline():
        raise DataError(f"task {spec.name}: no local task files and the hub is off (HF_HUB_OFFLINE/"
                        f"HF_DATASETS_OFFLINE); {no_files}")
    if not _hub_reachable():
        raise DataError(f"task {spec.name}: no local task files and the Hugging Face hub cannot be reached "
                        f"(offline?); {no_files}")
    try:
        ds = datasets.load_dataset(*spec.hub)
    except Exception as exc:  # noqa: BLE001 - offline, missing, renamed…
        raise DataError(
            f"could not load {spec.name} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Offline? Set DPFT_DATA_DIR to a folder with the task files (e.g. ../shared/data)"
        ) from None
    tw, dw = f"{spec.name} (hub train split)", f"{spec.name} (hub {spec.hub_dev_split} split)"
    train = _standardise(ds["train"], spec.text, spec.pair, spec.label, tw, user=user)
    dev = _standardise(ds[spec.hub_dev_split], spec.text, spec.pair, spec.label, dw)
    train, dev, names = _encode_labels(train, dev, tw, dw, spec.label, spec.label_names)
    return TaskData(spec.name, train, dev, names, "hub: " + "/".join(spec.hub), [spec.note] if spec.note else [])


def _subsample(data: TaskData, cfg: TaskCfg, seed: int) -> TaskData:
    if cfg.max_train_examples and cfg.max_train_examples < len(data.train):
        data.train = data.train.shuffle(seed=seed).select(range(cfg.max_train_examples))
        data.notes.append(f"training set: a seeded random subset of {cfg.max_train_examples} examples (N = {cfg.max_train_examples})")
    if cfg.max_dev_examples and cfg.max_dev_examples < len(data.dev):
        data.dev = data.dev.shuffle(seed=seed).select(range(cfg.max_dev_examples))
        data.notes.append(f"dev set: a seeded random subset of {cfg.max_dev_examples} examples")
    return data
