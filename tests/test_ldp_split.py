"""Split deployment: ldp-server in its own process on loopback, ldp-client in-process; what
crosses the wire is inspected on both sides (methods/ldp_split/)."""

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load as st_load

from dpft.config.recipe import load_recipe
from dpft.methods.ewft.split import LDPClient, make_server, read_token
from dpft.privacy.ldp import LDPError, clip_frobenius

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def split_run(tiny_model_dir, sst_like_files, tmp_path):
    return _split(tiny_model_dir, sst_like_files, tmp_path, {"target_epsilon": 4.0})


def _split(tiny_model_dir, sst_like_files, tmp_path, ldp_extra, subprocess_server=True, **client_kw):
    """Server on loopback (a `dpft ldp-server` subprocess, or a thread), client in-process;
    returns (client, report, server dir, proc or None)."""
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
    srv_dir = tmp_path / "server"
    if not subprocess_server:
        srv, th = _thread_server(load_recipe(path), srv_dir)
        try:
            client = LDPClient(load_recipe(path), srv.url, tmp_path / "client", token=srv.token, keep_wire=True,
                               **client_kw)
            rep = client.run()
            th.join(timeout=60)
            assert not th.is_alive()
        finally:
            srv.shutdown()
        return client, rep, srv_dir, None
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "dpft.cli.commands", "ldp-server", str(path), "--port", "0", "-o", str(srv_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("token file: "), line + proc.stderr.read()
        token_file = Path(line.split(": ", 1)[1].strip())
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[-1]
        client = LDPClient(load_recipe(path), url, tmp_path / "client", token=read_token(token_file),
                           keep_wire=True, **client_kw)
        rep = client.run()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return client, rep, srv_dir, proc


def _thread_server(recipe, run_dir, **kw):
    """A real server (make_server) serving in a daemon thread; returns (server, thread)."""
    srv = make_server(recipe, run_dir, port=0, **kw)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    return srv, th


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

    # the noise key is the client's secret: in memory only, no seed written; the secret file is 0600
    sfile = client.run_dir / "client_secret.json"
    assert stat.S_IMODE(sfile.stat().st_mode) == 0o600
    assert stat.S_IMODE((srv_dir / "ldp_token").stat().st_mode) == 0o600
    secret = json.loads(sfile.read_text())
    assert secret["randomness"]["mode"] == "secure" and _no_seed(secret)
    assert secret["encoder_sha256"] == rep["encoder_sha256"] == client.encoder_sha256 and len(rep["encoder_sha256"]) == 64
    assert not (srv_dir / "client_secret.json").exists()
    assert rep["privacy"]["label"]["privacy"] == "none"
    assert rep["privacy"]["randomness"]["mode"] == "secure"
    # every dev example's noisy code is a release of it, reported at the last epoch's σ
    dev = rep["privacy"]["dev_releases"]
    assert dev["n_dev"] == len(client.task.dev) and dev["releases_per_dev_example"] == 1
    assert dev["sigma"] == client.schedule.sigmas[-1] and dev["epsilon_with_label"] is None  # labels in the clear
    assert all(e["status"] == 200 for e in log)


def _no_seed(obj) -> bool:
    """No key names a seed or key material and no number is stored (nothing regenerates the noise)."""
    if isinstance(obj, dict):
        return all("seed" not in k and k != "key_bytes" and _no_seed(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_no_seed(v) for v in obj)
    return not isinstance(obj, (int, float)) or isinstance(obj, bool)


def _release_counts(client):
    """Largest number of releases of one example per epoch, counted here from the sampler."""
    out = []
    for e in range(client.epochs):
        c = torch.zeros(client.n, dtype=torch.long)
        for step in range(e * client.steps_per_epoch, (e + 1) * client.steps_per_epoch):
            c[client.sampler.indices(step)] += 1
        out.append(int(c.max()))
    return out


def test_split_deployment_example_level_epsilon(tiny_model_dir, sst_like_files, tmp_path):
    """The server links rows to users: the client's example-level ε is the replace-one PLD
    composition of the releases (no amplification), ≥ the amplified stream ε."""
    from dpft.privacy.ldp import local_epsilon_composed

    client, rep, _, _ = _split(tiny_model_dir, sst_like_files, tmp_path, {"target_epsilon": 4.0},
                               subprocess_server=False)
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
    from dpft.methods.ewft.split import tensor_digest
    from dpft.privacy.label_rr import example_epsilon_with_label, randomized_response

    client, rep, srv_dir, _ = _split(tiny_model_dir, sst_like_files, tmp_path,
                                     {"noise_multiplier": 1.0, "target_epsilon": None, "label_epsilon": 0.1},
                                     subprocess_server=False)
    true, noisy = client.true_labels, client.noisy_labels
    assert torch.equal(noisy, randomized_response(true, 0.1, 2, client.rng.stream("label_rr")))
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
    # dev labels stayed on the client: the dev example's guarantee is the code's local ε
    dev = rep["privacy"]["dev_releases"]
    assert dev["epsilon_with_label"] == dev["epsilon_code"] == rep["epsilon_dev_example_split_deployment"]




# ------------------------------------------------------------------ hardening: server side
TOKEN = "t" * 43


def _recipe(tiny_model_dir, **extra):
    ov = {"model.name": str(tiny_model_dir), "model.max_length": 16, "privacy.enabled": False,
          "ldp.enabled": True, "ldp.position": "encoder:1", "ldp.autoencoder.sizes": [16, 4],
          "ldp.autoencoder.pretrain_epochs": 0, "schedule.epochs": 1, "batch.expected_batch_size": 8,
          "eval.batch_size": 16}
    ov.update(extra)
    return load_recipe(None, ov)


def _tensors(**t) -> bytes:
    from safetensors.torch import save as st_save

    return st_save({k: v.contiguous() for k, v in t.items()})


def _ok_batch(b=3, k=4):
    return _tensors(z=torch.randn(b, 16, k), labels=torch.zeros(b, dtype=torch.long))


OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def test_server_token_limits_order_and_generic_errors(tiny_model_dir, tmp_path):
    """The app behind uvicorn (in-process): 401 without the token, 409 out of call order, 413
    over the body limit, 400/415/422 for bodies the plan does not allow — each reply a fixed
    {"error", "reason"} with no exception text — and every request in wire.jsonl."""
    from starlette.testclient import TestClient

    from dpft.methods.ewft.split import LDPServerState, build_app

    state = LDPServerState(_recipe(tiny_model_dir), tmp_path / "s")
    finished = []
    app = build_app(state, TOKEN, lambda: finished.append(True))
    bare = TestClient(app, raise_server_exceptions=False)
    c = TestClient(app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {TOKEN}"})
    plan = {"num_labels": 2, "total_steps": 3, "expected_batch_size": 8}

    def refused(resp, status, reason):
        assert resp.status_code == status, (resp.status_code, resp.text)
        body = resp.json()
        assert set(body) == {"error", "reason"} and body["reason"] == reason
        for word in ("Traceback", "Error", "Exception", "File ", "line ", "torch", "safetensors", "pydantic"):
            assert word not in resp.text
        return body

    # 401: no token, a wrong token, another scheme — on known and unknown paths alike
    refused(bare.post("/plan", json=plan), 401, "token")
    refused(bare.get("/encoder"), 401, "token")
    refused(bare.get("/nothing"), 401, "token")
    refused(bare.post("/plan", json=plan, headers={"Authorization": "Bearer " + "x" * 43}), 401, "token")
    refused(bare.post("/plan", json=plan, headers={"Authorization": f"Basic {TOKEN}"}), 401, "token")
    assert bare.post("/plan", json=plan).headers["www-authenticate"] == "Bearer"
    assert state.phase == "new"

    # 409: nothing before the plan
    refused(c.post("/step", params={"step": 0}, content=_ok_batch(), headers=OCTET), 409, "out_of_order")
    refused(c.post("/eval", content=_ok_batch(), headers=OCTET), 409, "out_of_order")
    refused(c.get("/encoder"), 409, "out_of_order")
    refused(c.post("/finish", json={}), 409, "out_of_order")
    # 413 before the plan: only small JSON bodies are read
    refused(c.post("/plan", content=b"{" + b" " * 70000 + b"}", headers=JSON), 413, "body_size")
    # 422 / 400: bad plans, generic replies
    refused(c.post("/plan", content=b"{not json", headers=JSON), 422, "invalid_json")
    refused(c.post("/plan", json={**plan, "num_labels": "2"}), 422, "invalid_json")
    refused(c.post("/plan", json={**plan, "extra": 1}), 422, "invalid_json")
    refused(c.post("/plan", json={**plan, "num_labels": 1}), 422, "invalid_json")
    refused(c.post("/plan", content=json.dumps(plan).encode(), headers={"Content-Type": "text/plain"}), 415,
            "content_type")
    refused(c.post("/plan", json={**plan, "expected_batch_size": 9}), 400, "plan_mismatch")
    refused(c.get("/nothing"), 404, "not_found")
    refused(c.post("/step", params={"step": "x"}, content=_ok_batch(), headers=OCTET), 422, "invalid_request")

    r = c.post("/plan", json=plan)
    assert r.status_code == 200 and r.json()["release_shape"] == [16, 4]
    max_batch = r.json()["max_batch"]
    assert max_batch == state.max_batch >= 16
    refused(c.post("/plan", json=plan), 409, "out_of_order")  # a second plan
    refused(c.post("/step", params={"step": 0}, content=_ok_batch(), headers=OCTET), 409, "out_of_order")
    assert c.get("/encoder").status_code == 200

    # 413: a declared length over max_batch × T × k × 4 + max_batch × 8 + 64 KiB
    limit = state.body_limit("/step")
    assert limit == max_batch * 16 * 4 * 4 + max_batch * 8 + 64 * 1024
    refused(c.post("/step", params={"step": 0}, content=b"\0" * (limit + 1), headers=OCTET), 413, "body_size")
    # 400: anything but float32 z (b, T, k) with b ≤ max_batch, finite, and int64 labels in [0, K)
    y = torch.zeros(3, dtype=torch.long)
    bad = {
        "bad_names": _tensors(input_ids=torch.ones(3, 16, dtype=torch.long), labels=y),
        "bad_dtype": _tensors(z=torch.randn(3, 16, 4, dtype=torch.float64), labels=y),
        "bad_shape": _tensors(z=torch.randn(3, 16, 5), labels=y),
        "bad_batch": _tensors(z=torch.randn(max_batch + 1, 16, 4), labels=torch.zeros(max_batch + 1, dtype=torch.long)),
        "nonfinite": _tensors(z=torch.tensor(float("nan")).expand(3, 16, 4), labels=y),
        "bad_labels": _tensors(z=torch.randn(3, 16, 4), labels=torch.tensor([0, 1, 2])),
        "bad_tensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage",
    }
    for reason, body in bad.items():
        refused(c.post("/step", params={"step": 0}, content=body, headers=OCTET), 400, reason)
    refused(c.post("/step", params={"step": 0}, content=_tensors(z=torch.randn(3, 16, 4), labels=y.int()),
                   headers=OCTET), 400, "bad_dtype")
    refused(c.post("/step", params={"step": 0}, content=_tensors(z=torch.randn(3, 16, 4)), headers=OCTET), 400,
            "bad_names")
    refused(c.post("/step", params={"step": 0}, content=_ok_batch(), headers=JSON), 415, "content_type")
    # steps in order only
    refused(c.post("/step", params={"step": 1}, content=_ok_batch(), headers=OCTET), 409, "step_order")
    assert c.post("/step", params={"step": 0}, content=_ok_batch(), headers=OCTET).status_code == 200
    assert c.post("/step", params={"step": 1}, content=_tensors(z=torch.zeros(0, 16, 4),
                                                                 labels=torch.zeros(0, dtype=torch.long)),
                  headers=OCTET).status_code == 200
    refused(c.post("/step", params={"step": 1}, content=_ok_batch(), headers=OCTET), 409, "step_order")
    refused(c.post("/eval", content=_tensors(z=torch.zeros(0, 16, 4)), headers=OCTET), 400, "bad_batch")
    r = c.post("/eval", content=_tensors(z=torch.randn(2, 16, 4)), headers=OCTET)
    assert r.status_code == 200 and len(r.json()["logits"]) == 2
    refused(c.post("/step", params={"step": 2}, content=_ok_batch(), headers=OCTET), 409, "out_of_order")
    refused(c.post("/finish", json={"x": 1}), 422, "invalid_json")
    assert c.post("/finish", json={}).status_code == 200 and finished == [True]
    for req in (lambda: c.post("/finish", json={}), lambda: c.get("/encoder"), lambda: c.post("/plan", json=plan),
                lambda: c.post("/eval", content=_tensors(z=torch.randn(2, 16, 4)), headers=OCTET)):
        refused(req(), 409, "finished")
    assert (tmp_path / "s" / "model" / "autoencoder.safetensors").is_file()

    # an internal failure replies 500 with the fixed reason only
    state2 = LDPServerState(_recipe(tiny_model_dir, **{"model.name": str(tmp_path / "no-such-model")}),
                            tmp_path / "s2")
    c2 = TestClient(build_app(state2, TOKEN, lambda: None), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"})
    refused(c2.post("/plan", json=plan), 500, "internal")
    assert state2.phase == "new"

    log = [json.loads(x) for x in (tmp_path / "s" / "wire.jsonl").read_text().splitlines()]
    assert [e["status"] for e in log].count(401) == 6 and all("status" in e for e in log)
    assert TOKEN not in (tmp_path / "s" / "wire.jsonl").read_text()
    assert {e["reason"] for e in log if e["status"] == 400} >= set(bad)


# ------------------------------------------------------------------ hardening: client side
def _client(tiny_model_dir, sst_like_files, tmp_path, url="http://127.0.0.1:9", **kw):
    rec = _recipe(tiny_model_dir, **{"task.name": "files", "task.train_file": str(sst_like_files["csv"]),
                                     "ldp.target_epsilon": 4.0, "ldp.delta": 1e-3, **kw.pop("recipe", {})})
    return LDPClient(rec, url, tmp_path / "client", token=TOKEN, keep_wire=True, **kw)


def test_client_refuses_nonfinite_encoder_from_a_malicious_server(tiny_model_dir, sst_like_files, tmp_path):
    """A real server tampered to send an inf encoder weight: the client refuses it before any
    code leaves (an inf weight becomes NaN through the clipping and survives the noise)."""
    import httpx

    rec = _recipe(tiny_model_dir, **{"task.name": "files", "task.train_file": str(sst_like_files["csv"]),
                                     "ldp.target_epsilon": 4.0, "ldp.delta": 1e-3})
    srv, th = _thread_server(rec, tmp_path / "s")
    try:
        assert httpx.get(srv.url + "/encoder").status_code == 401  # uvicorn: no token, no service
        good = srv.state.encoder_bytes

        def evil() -> bytes:
            t = st_load(good())
            t["0.weight"][0, 0] = float("inf")
            return _tensors(**t)

        srv.state.encoder_bytes = evil
        client = LDPClient(rec, srv.url, tmp_path / "client", token=srv.token, keep_wire=True)
        with pytest.raises(LDPError, match="non-finite encoder weight '0.weight'"):
            client.run()
        assert [p for p, _ in client.sent] == ["/plan"]  # nothing released
        assert client.encoder_sha256 is None
    finally:
        srv.shutdown()
        th.join(timeout=30)


def test_client_encoder_checks_and_sha256_pin(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.methods.ewft.split import encoder_digest

    client = _client(tiny_model_dir, sst_like_files, tmp_path)
    own = {k: v.clone() for k, v in client.layer.autoencoder.encoder.state_dict().items()}
    good = {k: torch.randn_like(v) for k, v in own.items()}
    pin = encoder_digest(good)
    assert client.load_encoder(_tensors(**good)) == pin == client.encoder_sha256
    assert json.loads((client.run_dir / "client_secret.json").read_text())["encoder_sha256"] == pin
    for t, msg in [({**good, "0.weight": good["0.weight"].double()}, "float32"),
                   ({**good, "0.weight": good["0.weight"][:2]}, "expected float32"),
                   ({"0.weight": good["0.weight"]}, "expected"),
                   ({**good, "0.bias": torch.full_like(good["0.bias"], float("nan"))}, "non-finite"),
                   ({**good, "0.weight": torch.full_like(good["0.weight"], float("-inf"))}, "non-finite")]:
        with pytest.raises(LDPError, match=msg):
            client.load_encoder(_tensors(**t))
    with pytest.raises(LDPError, match="unreadable"):
        client.load_encoder(b"junk")
    # pinned: another encoder is refused, the pinned one accepted
    pinned = _client(tiny_model_dir, sst_like_files, tmp_path, encoder_sha256=pin)
    other = {k: v + 1 for k, v in good.items()}
    with pytest.raises(LDPError, match="not the pinned"):
        pinned.load_encoder(_tensors(**other))
    assert pinned.load_encoder(_tensors(**good)) == pin


def test_client_zeroes_nonfinite_codes_and_never_sends_them(tiny_model_dir, sst_like_files, tmp_path):
    """A finite but huge encoder weight overflows some codes to inf: those rows are replaced by
    zeros before clipping and noise (no abort tells the server which row); a non-finite z is
    never sent; the secret file is 0600 and holds no seed."""
    client = _client(tiny_model_dir, sst_like_files, tmp_path)
    sfile = client.run_dir / "client_secret.json"
    assert stat.S_IMODE(sfile.stat().st_mode) == 0o600
    assert _no_seed(json.loads(sfile.read_text()))
    h = torch.randn(3, 16, 16)
    h[1, 0, 0] = float("inf")
    gen = client.rng.stream("ldp", 0)
    z = client.release_codes(h, 0.5, gen)
    assert z.shape == (3, 16, 4) and torch.isfinite(z).all() and client.rows_zeroed == 1
    noise = client.rng.stream("ldp", 0).normal((3, 16, 4)) * 0.5 * 2 * client.layer.max_norm
    assert torch.allclose(z[1], noise[1])  # row 1: pure noise
    assert not torch.allclose(z[0], noise[0])
    with torch.no_grad():
        client.layer.autoencoder.encoder[0].weight.fill_(3e38)
    z = client.release_codes(torch.randn(2, 16, 16), 0.5, client.rng.stream("ldp", 1))
    assert torch.isfinite(z).all() and client.rows_zeroed == 3
    with pytest.raises(LDPError, match="σ must be > 0"):
        client.release_codes(h, 0.0, gen)
    bad = torch.randn(2, 16, 4)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(LDPError, match="non-finite code"):
        client._send_tensors("/step", bad, torch.zeros(2, dtype=torch.long), params={"step": 0})
    assert client.sent == []


def test_client_refuses_unsafe_settings(tiny_model_dir, sst_like_files, tmp_path):
    with pytest.raises(LDPError, match="eval_noise"):
        _client(tiny_model_dir, sst_like_files, tmp_path, recipe={"ldp.eval_noise": False})
    with pytest.raises(LDPError, match="plain HTTP"):
        _client(tiny_model_dir, sst_like_files, tmp_path, url="http://10.1.2.3:8765")
    with pytest.raises(LDPError, match="token"):
        LDPClient(_recipe(tiny_model_dir), "http://127.0.0.1:9", tmp_path / "c", token="short")
    with pytest.raises(LDPError, match="loopback"):
        make_server(_recipe(tiny_model_dir), tmp_path / "s", host="0.0.0.0")


def test_server_tls(tiny_model_dir, tmp_path):
    """--ssl-certfile/--ssl-keyfile: HTTPS with a self-signed certificate, verified by the CA file."""
    import shutil
    import ssl

    import httpx

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    srv, th = _thread_server(_recipe(tiny_model_dir), tmp_path / "s", ssl_certfile=str(cert), ssl_keyfile=str(key))
    try:
        assert srv.url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=str(cert))
        hdr = {"Authorization": f"Bearer {srv.token}"}
        assert httpx.get(srv.url + "/encoder", verify=ctx).status_code == 401
        r = httpx.get(srv.url + "/encoder", verify=ctx, headers=hdr)
        assert r.status_code == 409 and r.json()["reason"] == "out_of_order"
        with pytest.raises(httpx.ConnectError):  # not trusted without the CA file
            httpx.get(srv.url + "/encoder", headers=hdr)
    finally:
        srv.shutdown()
        th.join(timeout=30)
