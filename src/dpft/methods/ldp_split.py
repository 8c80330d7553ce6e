"""Split deployment of forward-pass LDP: ``dpft ldp-client`` ⟷ ``dpft ldp-server`` over HTTP.

The client (the data holder) runs pre(·), the autoencoder encoder, Frobenius clipping and
the Gaussian noise (privacy/ldp.py) and sends only the noisy codes ``z`` ``(B, T, k)`` float32
and the labels ``(B,)`` (in the clear: not covered by the guarantee; see methods/ewft.py). The
server trains post(·) — decoder, remaining blocks, pooler, head — and never receives raw text,
token ids, attention masks or clean embeddings. The client adds the noise, so the client
holds the ledger and writes the privacy report; the server only trains.

Wire format: JSON for control messages; ``application/octet-stream`` safetensors for tensors
(``z``, ``labels``). Every request the server receives is logged to ``wire.jsonl`` (path,
tensor names, dtypes, shapes) so what crossed the wire can be inspected.

Endpoints: ``POST /plan`` (JSON: num_labels, total_steps, expected_batch_size) → builds the
model and pre-trains the autoencoder on public text; ``GET /encoder`` → the (public) encoder
weights; ``POST /step?step=i`` → one optimizer step on a noisy batch; ``POST /eval`` → correct
count and loss on noisy dev codes; ``POST /finish`` → saves post(·), stops.

Standard library ``http.server`` on loopback; one client at a time.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dpft.config import Recipe
from dpft.privacy.ldp import GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder

#: Tensor names a client may send; anything else is refused by the server.
ALLOWED = {"z", "labels"}


# ------------------------------------------------------------------------------------ server
class LDPServerState:
    """The service provider: post(·) and the head, trained on noisy codes only."""

    def __init__(self, recipe: Recipe, run_dir: str | Path):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.split: Optional[SplitClassifier] = None
        self.lock = threading.Lock()
        self.steps_done = 0
        self.losses: list[float] = []

    def log(self, entry: dict[str, Any]) -> None:
        with open(self.run_dir / "wire.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def plan(self, p: dict[str, Any]) -> dict[str, Any]:
        from dpft.models.load import load_classifier

        r, c = self.recipe, self.recipe.ldp
        tok, model = load_classifier(r.model.name, int(p["num_labels"]), seed=r.seed)
        ae = None
        if c.autoencoder.sizes:
            torch.manual_seed(r.seed)
            ae = StackedAutoencoder(c.autoencoder.sizes)
        self.split = SplitClassifier(model, c.position, GaussianLDP(c.max_norm, 0.0, ae), r.model.max_length)
        self.pretrain_loss: list[float] = []
        if ae is not None and c.autoencoder.pretrain_epochs > 0:
            self.pretrain_loss = _pretrain_public(self.split, ae, tok, r)
        self.params = [q for q in self.split.parameters() if q.requires_grad]
        o = r.optimizer
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        total = int(p["total_steps"])
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: max(0.0, (total - s) / total))
        self.denom = float(p["expected_batch_size"])
        k = c.autoencoder.sizes[-1] if c.autoencoder.sizes else int(model.config.hidden_size)
        return {"ok": True, "release_shape": [r.model.max_length, k], "pretrain_loss": self.pretrain_loss}

    def encoder_bytes(self) -> bytes:
        ae = self.split.noise.autoencoder if self.split is not None else None
        if ae is None:
            return st_save({})
        return st_save({k: v.contiguous() for k, v in ae.encoder.state_dict().items()})

    def step(self, t: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        self.split.train()
        torch.manual_seed(step)  # dropout of post(·)
        z, y = t["z"], t["labels"]
        if z.shape[0]:
            loss = F.cross_entropy(self.split.post(z).float(), y, reduction="sum")
            (loss / self.denom).backward()  # divide by the expected batch size, as the Trainer does
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            val = float(loss) / z.shape[0]
        else:
            val = float("nan")
        self.sched.step()
        self.steps_done += 1
        self.losses.append(val)
        return {"loss": val, "step": step}

    @torch.no_grad()
    def evaluate(self, t: dict[str, torch.Tensor]) -> dict[str, Any]:
        self.split.eval()
        logits = self.split.post(t["z"]).float()
        return {"correct": int((logits.argmax(-1) == t["labels"]).sum()), "n": int(t["z"].shape[0]),
                "loss_sum": float(F.cross_entropy(logits, t["labels"], reduction="sum"))}

    def finish(self) -> dict[str, Any]:
        self.split.save_pretrained(self.run_dir / "model")
        return {"ok": True, "steps": self.steps_done}


def _pretrain_public(split: SplitClassifier, ae: StackedAutoencoder, tok, r: Recipe) -> list[float]:
    from dpft.config import TaskCfg
    from dpft.data.tasks import load_task
    from dpft.privacy.ldp import pretrain_autoencoder

    a = r.ldp.autoencoder
    pub = load_task(TaskCfg(name=a.public_task, max_train_examples=a.public_examples), seed=r.seed)
    texts = list(pub.train["text"])
    batches = []
    for k in range(0, len(texts), a.pretrain_batch_size):
        enc = tok(texts[k:k + a.pretrain_batch_size], truncation=True, max_length=r.model.max_length,
                  padding=True, return_tensors="pt")
        h = split.pre(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
        batches.append((h, torch.ones(h.shape[:2])))
    return pretrain_autoencoder(ae, batches, r.ldp.max_norm, epochs=a.pretrain_epochs, lr=a.pretrain_lr,
                                seed=r.seed)


def make_server(recipe: Recipe, run_dir: str | Path, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """An HTTP server bound to ``host:port`` (0 = any free port) serving one LDP training run.

    Raises:
        LDPError: the recipe has no ``ldp.enabled: true``.
    """
    if not recipe.ldp.enabled:
        raise LDPError("ldp-server needs a recipe with ldp.enabled: true (see recipes/sst2-minilm-ewft.yaml)")
    state = LDPServerState(recipe, run_dir)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet; wire.jsonl is the log
            pass

        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj, code=200):
            self._reply(code, json.dumps(obj).encode())

        def do_GET(self):
            u = urlparse(self.path)
            state.log({"method": "GET", "path": u.path})
            if u.path == "/encoder" and state.split is not None:
                return self._reply(200, state.encoder_bytes(), "application/octet-stream")
            self._json({"error": f"unknown or premature GET {u.path}"}, 404)

        def do_POST(self):
            u = urlparse(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            ctype = self.headers.get("Content-Type", "")
            entry: dict[str, Any] = {"method": "POST", "path": u.path, "content_type": ctype, "bytes": len(body)}
            try:
                with state.lock:
                    if ctype == "application/octet-stream":
                        t = st_load(body)
                        entry["tensors"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in t.items()}
                        state.log(entry)
                        bad = set(t) - ALLOWED
                        if bad or "z" not in t or "labels" not in t or not t["z"].is_floating_point():
                            return self._json({"error": f"refused: only float z and labels may be sent, got {sorted(t)}"}, 400)
                        if u.path == "/step":
                            step = int(parse_qs(u.query).get("step", ["0"])[0])
                            return self._json(state.step(t, step))
                        if u.path == "/eval":
                            return self._json(state.evaluate(t))
                    else:
                        p = json.loads(body or b"{}")
                        entry["json_keys"] = sorted(p)
                        state.log(entry)
                        if u.path == "/plan":
                            return self._json(state.plan(p))
                        if u.path == "/finish":
                            out = state.finish()
                            self._json(out)
                            threading.Thread(target=self.server.shutdown, daemon=True).start()
                            return None
                return self._json({"error": f"unknown POST {u.path}"}, 404)
            except Exception as exc:  # noqa: BLE001 - the client gets the reason
                return self._json({"error": f"{type(exc).__name__}: {exc}"}, 500)

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.state = state  # type: ignore[attr-defined]
    return srv


# ------------------------------------------------------------------------------------ client
class LDPClient:
    """The data holder: pre(·) + encoder + clip + noise; sends noisy codes and labels only.

    Holds the ledger (it adds the noise) and writes ``client_report.json``. ``sent`` keeps
    every request body it sent (for inspection of the wire in tests).
    """

    def __init__(self, recipe: Recipe, server: str, run_dir: str | Path, keep_wire: bool = False):
        import math as _m

        from dpft.accounting.calibrate import check_delta
        from dpft.accounting.ewpba import make_schedule
        from dpft.accounting.ledger import PrivacyLedger
        from dpft.data.sampler import PoissonSampler
        from dpft.data.tasks import load_task
        from dpft.data.tokenize import tokenize_split
        from dpft.models.load import load_classifier

        r, c = recipe, recipe.ldp
        if not c.enabled:
            raise LDPError("ldp-client needs a recipe with ldp.enabled: true")
        e = r.schedule.epochs
        if e is None or e != int(e):
            raise LDPError("ldp-client needs schedule.epochs = a whole number E")
        self.recipe, self.server = r, server.rstrip("/")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.keep_wire = keep_wire
        self.sent: list[tuple[str, bytes]] = []
        self.task = load_task(r.task, seed=r.seed)
        self.n = len(self.task.train)
        check_delta(c.delta, self.n)
        self.tokenizer, model = load_classifier(r.model.name, self.task.num_labels, seed=r.seed)
        self.with_tt = "token_type_ids" in self.tokenizer.model_input_names
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.train_tok = tokenize_split(self.task.train, self.tokenizer, r.model.max_length)
        self.dev_tok = tokenize_split(self.task.dev, self.tokenizer, r.model.max_length)
        self.sampler = PoissonSampler(self.n, r.batch.expected_batch_size, r.seed)
        self.epochs = int(e)
        self.steps_per_epoch = _m.ceil(self.n / r.batch.expected_batch_size)
        self.total_steps = self.epochs * self.steps_per_epoch
        self.schedule = make_schedule(c.schedule, c.target_epsilon, c.delta, self.sampler.q, self.steps_per_epoch,
                                      self.epochs, c.step_distance)
        self.ledger = PrivacyLedger()
        ae = StackedAutoencoder(c.autoencoder.sizes) if c.autoencoder.sizes else None
        self.layer = GaussianLDP(c.max_norm, self.schedule.sigmas[0], ae, normalize=c.normalize,
                                 eval_noise=c.eval_noise, generator=torch.Generator().manual_seed(r.seed + 7919))
        self.split = SplitClassifier(model, c.position, self.layer, r.model.max_length)

    # -- transport
    def _post(self, path: str, body: bytes, ctype: str) -> dict[str, Any]:
        if self.keep_wire:
            self.sent.append((path, body))
        req = urllib.request.Request(self.server + path, data=body, headers={"Content-Type": ctype}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=3600) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise LDPError(f"server refused {path}: {exc.read().decode()[:300]}") from None

    def _send_tensors(self, path: str, z: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return self._post(path, st_save({"z": z.float().contiguous(), "labels": labels.long().contiguous()}),
                          "application/octet-stream")

    def _release(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        from dpft.data.tokenize import collate

        b = collate(list(rows), self.pad_id, self.with_tt)
        return self.split.release(b["input_ids"], b["attention_mask"], b.get("token_type_ids")), b["labels"]

    def run(self) -> dict[str, Any]:
        """Plan, fetch the public encoder, send every step's noisy batch, evaluate, finish."""
        from dpft.privacy.ldp import local_epsilon

        r = self.recipe
        plan = self._post("/plan", json.dumps({"num_labels": self.task.num_labels, "total_steps": self.total_steps,
                                               "expected_batch_size": r.batch.expected_batch_size}).encode(),
                          "application/json")
        if self.layer.autoencoder is not None:
            with urllib.request.urlopen(self.server + "/encoder", timeout=600) as resp:
                self.layer.autoencoder.encoder.load_state_dict(st_load(resp.read()))
        losses = []
        for step in range(self.total_steps):
            self.layer.train()
            self.layer.set_sigma(self.schedule.sigma_at(step))
            idx = self.sampler.indices(step)
            if len(idx):
                z, y = self._release(self.train_tok.select(idx.tolist()))
            else:
                k = plan["release_shape"]
                z, y = torch.zeros(0, *k), torch.zeros(0, dtype=torch.long)
            losses.append(self._send_tensors(f"/step?step={step}", z, y)["loss"])
            self.ledger.record("ldp-forward", self.schedule.step_event(step))
        self.layer.eval()
        correct = n = 0
        loss_sum = 0.0
        bs = r.eval.batch_size
        for k in range(0, len(self.dev_tok), bs):
            z, y = self._release(self.dev_tok.select(range(k, min(k + bs, len(self.dev_tok)))))
            out = self._send_tensors("/eval", z, y)
            correct, n, loss_sum = correct + out["correct"], n + out["n"], loss_sum + out["loss_sum"]
        self._post("/finish", b"{}", "application/json")
        d = r.ldp.delta
        rep = {"dev_accuracy": correct / max(n, 1), "dev_loss": loss_sum / max(n, 1), "n_dev": n,
               "train_loss": [x for x in losses if not math.isnan(x)][-10:],
               "epsilon_stream": self.ledger.epsilon(d).epsilon, "delta": d,
               "epsilon_local_per_release": [local_epsilon(s, d) for s in self.schedule.sigmas],
               "schedule": self.schedule.as_dict(), "steps": self.total_steps}
        self.ledger.save(self.run_dir / "ledger.json")
        (self.run_dir / "client_report.json").write_text(json.dumps(rep, indent=1))
        return rep
