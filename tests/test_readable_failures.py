"""Readable failures (issue 36 item 8): ``dpft push`` without the Hub in one line with the fix;
an offline ``--model`` that is not cached refused before any loading, in a whole sentence; no
bitsandbytes "Failed to load" warning on a run that loads no quantized model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpft.cli.commands import app

def _finished_run(d: Path) -> Path:
    (d / "model").mkdir(parents=True)
    (d / "model" / "config.json").write_text("{}")
    (d / "report.json").write_text("{}")
    return d


def test_push_offline_is_one_line_with_the_fix(tmp_path, monkeypatch):
    """Old: a 122-line traceback ending in OfflineModeIsEnabled."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = CliRunner().invoke(app, ["push", str(_finished_run(tmp_path / "run")), "me/x"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: cannot push: offline mode is on (HF_HUB_OFFLINE=1); unset HF_HUB_OFFLINE on a machine with network, "
        "then run the same dpft push again (nothing was uploaded)"]


def test_push_without_network_names_the_hub_and_the_fix(tmp_path, monkeypatch):
    """Old: a 275-line traceback ending in httpx.ConnectError."""
    import httpx
    from huggingface_hub import HfApi

    def no_network(self, *a, **k):
        try:
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        except httpx.ConnectError as exc:
            raise RuntimeError("wrapped by the client") from exc

    monkeypatch.setattr(HfApi, "create_repo", no_network)
    r = CliRunner().invoke(app, ["push", str(_finished_run(tmp_path / "run")), "me/x"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    flat = " ".join(r.output.split())
    assert "cannot push: cannot reach the Hugging Face Hub at https://" in flat
    assert "(ConnectError: [Errno -2] Name or service not known); check the network, proxy or HF_ENDPOINT" in flat
    # and a refused token (401) names the login
    from huggingface_hub.errors import HfHubHTTPError

    def unauthorized(self, *a, **k):
        resp = httpx.Response(401, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
        raise HfHubHTTPError("401 Client Error: Unauthorized for url", response=resp)

    monkeypatch.setattr(HfApi, "create_repo", unauthorized)
    r = CliRunner().invoke(app, ["push", str(tmp_path / "run"), "me/x"])
    assert r.exit_code == 2 and "401 Unauthorized); log in again with `hf auth login`" in " ".join(r.output.split())


def test_offline_model_that_is_not_cached_is_refused_before_loading(tmp_path, monkeypatch, sst_like_files):
    """Old: "cannot load model 'bert-base-uncased' (OSError: We couldn't connect to 'https://huggingface.co' …
    offline mode at 'https://). Give a folder …" — cut mid-URL, after the data were read."""
    import dpft.data.tasks as tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tasks, "load_task", lambda *a, **k: (_ for _ in ()).throw(AssertionError("data read")))
    r = CliRunner().invoke(app, ["train", "--train-file", str(sst_like_files["csv"]), "--model", "some-org/some-model",
                                 "-o", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert ("error: model 'some-org/some-model' is neither a local folder nor in the Hugging Face cache, and "
            "HF_HUB_OFFLINE=1 forbids downloading it: download it once online (hf download some-org/some-model)") \
        in flat and "https://)" not in flat
    assert not (tmp_path / "o").exists()


def _python(code: str) -> subprocess.CompletedProcess:
    import dpft

    env = {**os.environ, "PYTHONPATH": str(Path(dpft.__file__).parents[1]), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_saving_a_model_does_not_import_peft_or_bitsandbytes():
    """Old: every run's save imported peft, which imports bitsandbytes: "Failed to load CPU
    gemm_4bit_forward from kernels-community …" on every run of a machine without its kernels."""
    r = _python("import sys, torch\nfrom dpft.models.export import _is_peft\n"
                "assert _is_peft(torch.nn.Linear(2, 2)) is False\n"
                "print('peft' in sys.modules, 'bitsandbytes' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_lora_runs_import_peft_without_the_bitsandbytes_warning():
    pytest.importorskip("bitsandbytes")
    r = _python("from dpft.models.load import import_peft\nimport_peft()\nimport peft\nprint(peft.LoraConfig.__name__)")
    assert r.returncode == 0, r.stderr
    assert "Failed to load" not in r.stderr and r.stdout.strip() == "LoraConfig"
