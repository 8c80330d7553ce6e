"""``dpft push RUN_DIR REPO_ID``: the run's release set to the Hugging Face Hub.

Only released files go (outputs/release.py ``RELEASE_SET``): the model folder at the repository's
root (so ``pipeline(model=REPO_ID)`` loads it; a LoRA run with a merged model puts the merged
model at the root and the adapter under ``adapter/``), and the run's report, ledger, metrics,
plot and recipe under ``dpft_run/``. Never the private diagnostics, dev predictions, the
checkpoint (optimizer state; large) or anything else in the folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional
from dpft.outputs.release import DIAGNOSTICS_FILE, RELEASE_SET

#: Run files uploaded under ``dpft_run/`` (each is in the release set).
RUN_FILES = ("report.md", "report.json", "ledger.json", "metrics.jsonl", "training.png", "recipe.yaml")


def release_files(run_dir: str | Path) -> dict[str, Path]:
    """``{path in the repository: local file}`` of what :func:`push` uploads.

    Raises:
        FileNotFoundError: ``run_dir`` is not a finished run (no ``model/`` or ``report.json``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "model").is_dir() or not (run_dir / "report.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished dpft run (needs model/ and report.json)")
    merged = run_dir / "model_merged"
    root, extra = (merged, {"adapter": run_dir / "model"}) if merged.is_dir() else (run_dir / "model", {})
    out: dict[str, Path] = {}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            out[f.relative_to(root).as_posix()] = f
    for prefix, d in extra.items():
        for f in sorted(d.rglob("*")):
            if f.is_file():
                out[f"{prefix}/{f.relative_to(d).as_posix()}"] = f
    for name in RUN_FILES:
        assert name in RELEASE_SET, name  # only released files
        if (run_dir / name).is_file():
            out[f"dpft_run/{name}"] = run_dir / name
    assert not any(p.name == DIAGNOSTICS_FILE for p in out.values())
    return out


def push(run_dir: str | Path, repo_id: str, private: bool = True, token: Optional[str] = None,
         commit_message: Optional[str] = None, api=None) -> str:
    """Create ``repo_id`` (a model repository; private by default) if needed and upload the run's
    release set in one commit; returns the commit URL (or what ``upload_folder`` returns).

    ``api``: an ``huggingface_hub.HfApi`` (tests pass a mock).
    """
    from huggingface_hub import HfApi

    files = release_files(run_dir)
    api = api or HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpft-push-") as tmp:
        stage = Path(tmp)
        for rel, src in files.items():
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                dst.hardlink_to(src)
            except OSError:  # another file system
                shutil.copy2(src, dst)
        res = api.upload_folder(folder_path=str(stage), repo_id=repo_id, repo_type="model",
                                commit_message=commit_message or f"dpft run {Path(run_dir).name}")
    return str(res)


def push_failure(exc: BaseException, repo_id: str) -> Optional[str]:
    """One line naming why ``dpft push`` failed and the fix, for the failures a user meets (offline
    mode, no network, no or a refused token, no permission, a bad repository id); None for any
    other exception (then its traceback is the useful report). Nothing was uploaded in each case:
    the upload is one commit, made last."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:  # the exception and its causes
        chain.append(e)
        e = e.__cause__ or e.__context__
    names = {c.__class__.__name__ for c in chain}
    again = "then run the same dpft push again (nothing was uploaded)"
    if "OfflineModeIsEnabled" in names:
        return f"cannot push: offline mode is on (HF_HUB_OFFLINE=1); unset HF_HUB_OFFLINE on a machine with network, {again}"
    if "LocalTokenNotFoundError" in names:
        return f"cannot push: no Hugging Face token; log in with `hf auth login` or pass --token, {again}"
    if "HFValidationError" in names:
        return f"cannot push: {repo_id!r} is not a valid repository id; give OWNER/NAME (e.g. you/sst2-dp)"
    status = next((getattr(getattr(c, "response", None), "status_code", None) for c in chain
                   if getattr(getattr(c, "response", None), "status_code", None) is not None), None)
    if status == 401:
        return f"cannot push: the Hub refused the token (401 Unauthorized); log in again with `hf auth login` or pass a valid --token, {again}"
    if status == 403:
        return (f"cannot push: this token may not create or write {repo_id} (403 Forbidden); use a token with write "
                f"access to that owner, {again}")
    network = ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "NetworkError", "ConnectionError",
               "gaierror", "ProxyError", "SSLError")
    if names & set(network) or any(isinstance(c, (ConnectionError, TimeoutError)) for c in chain):
        from huggingface_hub import constants

        cause = next(c for c in chain if c.__class__.__name__ in network or isinstance(c, (ConnectionError,
                                                                                             TimeoutError)))
        first = (str(cause).splitlines() or [""])[0][:160]
        return (f"cannot push: cannot reach the Hugging Face Hub at {constants.ENDPOINT} "
                f"({cause.__class__.__name__}: {first}); check the network, proxy or HF_ENDPOINT, {again}")
    if status is not None:
        first = (str(chain[0]).splitlines() or [""])[0][:200]
        return f"cannot push: the Hub answered {status} ({first}); {again}"
    return None
