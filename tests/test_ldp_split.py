"""Split deployment: ldp-server in its own process on loopback, ldp-client in-process; what
crosses the wire is inspected on both sides (methods/ldp_split.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load as st_load

from dpft.config import load_recipe
from dpft.methods.ldp_split import LDPClient
from dpft.privacy.ldp import clip_frobenius

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def split_run(tiny_model_dir, sst_like_files, tmp_path):
    return _split(tiny_model_dir, sst_like_files, tmp_path, {"target_epsilon": 4.0})


def _split(tiny_model_dir, sst_like_files, tmp_path, ldp_extra):
    """Server in a subprocess on loopback, client in-process; returns (client, report, server dir, proc)."""
    rec = {
        "model": {"name": str(tiny_model_dir), "max_length": 16},
        "task": {"name": "files", "train_file": str(sst_like_files["csv"])},
        "privacy": {"enabled": False},
        "ldp": {"enabled": True, "position": "encoder:1", "delta": 1e-3,
                "autoencoder": {"sizes": [16, 4], "pretrain_epochs": 0}, **ldp_extra},
        "optimizer": {"lr": 1e-2}, "schedule": {"epochs": 2}, "batch": {"expected_batch_size": 8},
        "eval": {"batch_size": 16},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(rec))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    srv_dir = tmp_path / "server"
    proc = subprocess.Popen([sys.executable, "-m", "dpft.cli", "ldp-server", str(path), "--port", "0", "-o", str(srv_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[-1]
        client = LDPClient(load_recipe(path), url, tmp_path / "client", keep_wire=True)
        rep = client.run()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return client, rep, srv_dir, proc


def test_round_trip_and_wire_contents(split_run):
    client, rep, srv_dir, proc = split_run
    assert proc.returncode == 0  # the server stopped after /finish
    assert 0 <= rep["dev_accuracy"] <= 1 and rep["n_dev"] == len(client.task.dev)
    assert 4.0 - 1e-4 <= rep["epsilon_stream"] <= 4.0
    assert (srv_dir / "model" / "autoencoder.safetensors").is_file()

    # server side: every tensor request carried exactly a float code z (B, T, k) and labels (B,)
    log = [json.loads(x) for x in (srv_dir / "wire.jsonl").read_text().splitlines()]
    tensors = [e for e in log if "tensors" in e]
    assert len(tensors) == client.total_steps + -(-len(client.task.dev) // 16)
    for e in tensors:
        t = e["tensors"]
        assert set(t) == {"z", "labels"}
        assert t["z"]["dtype"] == "torch.float32" and t["z"]["shape"][1:] == [16, 4]
        assert t["labels"]["dtype"] == "torch.int64" and t["labels"]["shape"] == t["z"]["shape"][:1]
    json_msgs = [e for e in log if "json_keys" in e]
    assert {tuple(e["json_keys"]) for e in json_msgs} <= {("expected_batch_size", "num_labels", "total_steps"), ()}

    # client side: no raw text in any body; z is the clean code plus noise of std σ·2C
    texts = [t.encode() for t in client.task.train["text"]] + [t.encode() for t in client.task.dev["text"]]
    for _, body in client.sent:
        assert not any(t in body for t in texts)
    path, body = next((p, b) for p, b in client.sent if p == "/step?step=0")
    z = st_load(body)["z"]
    idx = client.sampler.indices(0)
    from dpft.data.tokenize import collate

    b = collate(list(client.train_tok.select(idx.tolist())), client.pad_id, client.with_tt)
    with torch.no_grad():
        clean = clip_frobenius(client.layer.autoencoder.encode(client.split.pre(b["input_ids"], b["attention_mask"],
                                                                                 b.get("token_type_ids"))), 1.0)
    resid = (z - clean).flatten()
    sigma0 = client.schedule.sigmas[0]
    assert resid.std().item() == pytest.approx(sigma0 * 2.0, rel=0.15)

    # the noise seed is the client's secret, not derived from the recipe the server also has
    secret = json.loads((client.run_dir / "client_secret.json").read_text())
    assert secret["secret_seed"] == client.secret_seed and not (srv_dir / "client_secret.json").exists()
    assert rep["privacy"]["label"]["privacy"] == "none"


def _release_counts(client):
    """Largest number of releases of one example per epoch, counted here from the sampler."""
    out = []
    for e in range(client.epochs):
        c = torch.zeros(client.n, dtype=torch.long)
        for step in range(e * client.steps_per_epoch, (e + 1) * client.steps_per_epoch):
            c[client.sampler.indices(step)] += 1
        out.append(int(c.max()))
    return out


def test_split_deployment_example_level_epsilon(split_run):
    """The server links rows to users: the client's example-level ε is the replace-one PLD
    composition of the releases (no amplification), ≥ the amplified stream ε."""
    from dpft.privacy.ldp import local_epsilon_composed

    client, rep, _, _ = split_run
    counts = _release_counts(client)
    assert rep["max_releases_per_example_by_epoch"] == counts
    seq = [s for s, k in zip(client.schedule.sigmas, counts) for _ in range(k)]
    linked = rep["privacy"]["example_level_split_deployment"]
    assert linked["epsilon"] == pytest.approx(local_epsilon_composed(seq, 1e-3), abs=1e-12)
    assert rep["epsilon_example_split_deployment"] == linked["epsilon"]  # labels in the clear: no label term
    assert rep["epsilon_example_split_deployment"] >= rep["epsilon_stream"]
    assert rep["privacy"]["stream_amplified"]["epsilon"] == rep["epsilon_stream"]
    assert "not this deployment's server" in rep["privacy"]["stream_amplified"]["assumption"]
    saved = json.loads((client.run_dir / "client_report.json").read_text())
    assert saved["epsilon_example_split_deployment"] == rep["epsilon_example_split_deployment"]


def test_split_sends_only_randomized_labels(tiny_model_dir, sst_like_files, tmp_path):
    """label_epsilon = 0.1: every label that crosses the wire is the client's recorded RR output
    (checked on the client's bodies and on the server's sha256 log); dev labels never leave."""
    from dpft.methods.ldp_split import tensor_digest
    from dpft.privacy.label_rr import example_epsilon_with_label, randomized_response

    client, rep, srv_dir, proc = _split(tiny_model_dir, sst_like_files, tmp_path,
                                        {"noise_multiplier": 1.0, "target_epsilon": None, "label_epsilon": 0.1})
    assert proc.returncode == 0
    true, noisy = client.true_labels, client.noisy_labels
    assert torch.equal(noisy, randomized_response(true, 0.1, 2, torch.Generator().manual_seed(client.label_rr_seed)))
    log = [json.loads(x) for x in (srv_dir / "wire.jsonl").read_text().splitlines()]
    sent_all, true_all = [], []
    steps = [(p, b) for p, b in client.sent if p.startswith("/step")]
    assert len(steps) == client.total_steps
    for path, body in steps:
        step = int(path.split("=")[1])
        idx = client.sampler.indices(step)
        labels = st_load(body)["labels"]
        assert torch.equal(labels, noisy[idx])  # the recorded RR outputs, in the batch's order
        sent_all.append(labels)
        true_all.append(true[idx])
    sent_all, true_all = torch.cat(sent_all), torch.cat(true_all)
    assert (sent_all != true_all).sum() >= 5  # keep probability 0.525: the true labels did not travel
    # server side: the labels that arrived are byte-identical to the RR outputs
    step_logs = [e["tensors"] for e in log if "tensors" in e and e["path"] == "/step"]
    assert len(step_logs) == client.total_steps
    for step, t in enumerate(step_logs):
        assert t["labels"]["sha256"] == tensor_digest(noisy[client.sampler.indices(step)].long())
    # evaluation: z only, the client scores the returned logits
    evals = [e["tensors"] for e in log if "tensors" in e and e["path"] == "/eval"]
    assert evals and all(set(t) == {"z"} for t in evals)
    assert 0 <= rep["dev_accuracy"] <= 1 and rep["n_dev"] == len(client.task.dev)
    # report: label ε₂, the split-deployment ε with the label composed in, the upper bound
    lab = rep["privacy"]["label"]
    assert lab["epsilon"] == pytest.approx(0.1, abs=1e-3) and lab["delta"] == 0.0
    assert lab["combined_upper_bound"]["epsilon"] == pytest.approx(rep["epsilon_stream"] + lab["epsilon"])
    counts = _release_counts(client)
    seq = [s for s, k in zip(client.schedule.sigmas, counts) for _ in range(k)]
    assert rep["epsilon_example_split_deployment"] == pytest.approx(example_epsilon_with_label(seq, 1e-3, 0.1, 2))
    assert rep["epsilon_example_split_deployment"] > rep["privacy"]["example_level_split_deployment"]["epsilon"]


def test_server_refuses_token_ids(tiny_model_dir, tmp_path):
    """A request carrying anything but z and labels is refused (and logged)."""
    import threading
    import urllib.error
    import urllib.request

    from safetensors.torch import save as st_save

    from dpft.methods.ldp_split import make_server

    rec = load_recipe(None, {"model.name": str(tiny_model_dir), "privacy.enabled": False, "ldp.enabled": True,
                             "ldp.position": "encoder:1", "schedule.epochs": 1})
    srv = make_server(rec, tmp_path / "s", port=0)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        body = st_save({"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)})
        req = urllib.request.Request(f"http://127.0.0.1:{srv.server_address[1]}/step?step=0", data=body,
                                     headers={"Content-Type": "application/octet-stream"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400 and "only float z and labels" in err.value.read().decode()
    finally:
        srv.shutdown()
