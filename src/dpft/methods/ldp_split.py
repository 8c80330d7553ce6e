"""Split deployment of forward-pass LDP: ``dpft ldp-client`` ⟷ ``dpft ldp-server`` over HTTP.

The client (the data holder) runs pre(·), the autoencoder encoder, Frobenius clipping and
the Gaussian noise (privacy/ldp.py) and sends only the noisy codes ``z`` ``(B, T, k)`` float32
and the labels ``(B,)`` — in the clear, or with ``ldp.label_epsilon`` = ε₂ the K-ary
randomized-response labels drawn once before training (privacy/label_rr.py); then the dev
labels never leave the client either (``/eval`` gets ``z`` only and returns logits). The
server trains post(·) — decoder, remaining blocks, pooler, head — and never receives raw text,
token ids, attention masks or clean embeddings. The client adds the noise, so the client
holds the ledger and writes the privacy report; the server only trains.

The server knows which client sent which row, so its view has no subsampling amplification:
the client's report leads with the example-level guarantee of this deployment — the PLD
replace-one composition of the releases one example made (methods/ewft.py ``linked_section``)
— and gives the amplified stream ε only with its assumption spelled out.

The noise and randomized-response seeds are the client's secret (drawn from ``secrets`` unless
given, written only to the client's ``client_secret.json``): the server has the recipe, so a
seed derived from ``recipe.seed`` would let it regenerate the noise and subtract it.

Wire format: JSON for control messages; ``application/octet-stream`` safetensors for tensors
(``z``, ``labels``). Every request the server receives is logged to ``wire.jsonl`` (path,
tensor names, dtypes, shapes, sha256 of the bytes) so what crossed the wire can be inspected.

Endpoints: ``POST /plan`` (JSON: num_labels, total_steps, expected_batch_size) → builds the
model and pre-trains the autoencoder on public text; ``GET /encoder`` → the (public) encoder
weights; ``POST /step?step=i`` → one optimizer step on a noisy batch; ``POST /eval`` → correct
count and loss on noisy dev codes (or, without labels, the logits); ``POST /finish`` → saves post(·), stops.

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
def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's contiguous CPU bytes (logged in wire.jsonl for inspection)."""
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


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
        self.loss = lambda logits, y: F.cross_entropy(logits, y, reduction="none")
        if c.label_epsilon is not None and c.label_loss_correction:
            from dpft.privacy.label_rr import forward_corrected_loss, rr_transition_matrix

            # T is public (ε₂ and K from the shared recipe): labels arrive randomized
            tmat = rr_transition_matrix(c.label_epsilon, int(p["num_labels"]))
            self.loss = lambda logits, y: forward_corrected_loss(logits, y, tmat)
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
            loss = self.loss(self.split.post(z).float(), y).sum()
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
        if "labels" not in t:  # label-private client: it scores the logits itself
            return {"logits": logits.tolist(), "n": int(t["z"].shape[0])}
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
                        # sha256 of each tensor's bytes: what arrived can be matched afterwards
                        entry["tensors"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                                                "sha256": tensor_digest(v)} for k, v in t.items()}
                        state.log(entry)
                        bad = set(t) - ALLOWED
                        need_labels = u.path != "/eval"  # /eval may omit labels (label-private client)
                        if bad or "z" not in t or (need_labels and "labels" not in t) or not t["z"].is_floating_point():
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

    def __init__(self, recipe: Recipe, server: str, run_dir: str | Path, keep_wire: bool = False,
                 secret_seed: Optional[int] = None):
        import math as _m
        import secrets

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
        if c.noise_multiplier is not None:  # a fixed σ, as methods/ewft.py's LDPRun
            from dpft.accounting.ewpba import NoiseSchedule, schedule_epsilon

            if not c.noise_multiplier > 0:
                raise LDPError("ldp-client: ldp.noise_multiplier must be > 0 (σ = 0 releases the clean codes)")
            s = [float(c.noise_multiplier)] * self.epochs
            eps = schedule_epsilon(s, self.sampler.q, self.steps_per_epoch, c.delta)
            self.schedule = NoiseSchedule(s, self.sampler.q, self.steps_per_epoch, c.delta, eps, eps, "fixed")
        else:
            self.schedule = make_schedule(c.schedule, c.target_epsilon, c.delta, self.sampler.q, self.steps_per_epoch,
                                          self.epochs, c.step_distance)
        self.ledger = PrivacyLedger()
        #: The client's secret (never sent; the server knows recipe.seed). Noise and RR seeds.
        self.secret_seed = int(secret_seed) if secret_seed is not None else secrets.randbits(62)
        from dpft.data.sampler import hash_seed

        noise_seed, self.label_rr_seed = hash_seed(self.secret_seed, 1), hash_seed(self.secret_seed, 2)
        (self.run_dir / "client_secret.json").write_text(json.dumps(
            {"secret_seed": self.secret_seed, "noise_seed": noise_seed, "label_rr_seed": self.label_rr_seed,
             "note": "client side only: with these seeds and the data the noise and the kept labels can be "
                     "recomputed; never give them to the server"}, indent=1))
        ae = StackedAutoencoder(c.autoencoder.sizes) if c.autoencoder.sizes else None
        self.layer = GaussianLDP(c.max_norm, self.schedule.sigmas[0], ae, normalize=c.normalize,
                                 eval_noise=c.eval_noise, generator=torch.Generator().manual_seed(noise_seed))
        #: Label privacy: RR labels drawn once, before training (every epoch sends the same ỹ).
        self.true_labels = torch.tensor([int(v) for v in self.train_tok["label"]], dtype=torch.long)
        self.noisy_labels: Optional[torch.Tensor] = None
        if c.label_epsilon is not None:
            from dpft.methods.ewft import privatize_labels

            self.train_tok, self.noisy_labels = privatize_labels(self.train_tok, c.label_epsilon,
                                                                 self.task.num_labels, self.label_rr_seed)
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

    def _send_tensors(self, path: str, z: torch.Tensor, labels: Optional[torch.Tensor]) -> dict[str, Any]:
        t = {"z": z.float().contiguous()}
        if labels is not None:
            t["labels"] = labels.long().contiguous()
        return self._post(path, st_save(t), "application/octet-stream")

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
            if self.noisy_labels is None:
                out = self._send_tensors("/eval", z, y)
            else:  # label privacy: dev labels stay here; score the returned logits locally
                lg = torch.tensor(self._send_tensors("/eval", z, None)["logits"], dtype=torch.float32)
                out = {"correct": int((lg.argmax(-1) == y).sum()), "n": int(len(y)),
                       "loss_sum": float(F.cross_entropy(lg, y, reduction="sum"))}
            correct, n, loss_sum = correct + out["correct"], n + out["n"], loss_sum + out["loss_sum"]
        self._post("/finish", b"{}", "application/json")
        d = r.ldp.delta
        eps_stream = self.ledger.epsilon(d).epsilon
        rep = {"dev_accuracy": correct / max(n, 1), "dev_loss": loss_sum / max(n, 1), "n_dev": n,
               "train_loss": [x for x in losses if not math.isnan(x)][-10:],
               "epsilon_stream": eps_stream, "delta": d,
               "epsilon_local_per_release": [local_epsilon(s, d) for s in self.schedule.sigmas],
               "schedule": self.schedule.as_dict(), "steps": self.total_steps}
        rep.update(self.privacy_report(eps_stream))
        self.ledger.save(self.run_dir / "ledger.json")
        (self.run_dir / "client_report.json").write_text(json.dumps(rep, indent=1))
        return rep

    def privacy_report(self, eps_stream: float) -> dict[str, Any]:
        """The guarantees of this split deployment, leading with the example-level one.

        The server links rows to this client, so no subsampling amplification: the example-level
        ε is the PLD replace-one composition (dp_accounting) of the releases one example made —
        at most the largest per-epoch release count at each epoch's σ_e, from the seeded sampler
        (``methods.ewft.linked_section``; ≥ the amplified stream ε). The amplified stream ε is
        kept, with its assumption. Labels: ε₂ by randomized response, or in the clear.
        """
        from dpft.methods.ewft import (STREAM_STATEMENT, label_section, linked_section,
                                       max_releases_per_epoch)

        c = self.recipe.ldp
        d = c.delta
        per_epoch = max_releases_per_epoch(self.sampler, self.n, self.epochs, self.steps_per_epoch, self.total_steps)
        seq = [s for s, k in zip(self.schedule.sigmas, per_epoch) for _ in range(k)]
        linked = linked_section(seq, d, c.label_epsilon, self.task.num_labels)
        headline = linked["epsilon_with_label"] if linked["epsilon_with_label"] is not None else linked["epsilon"]
        return {
            "epsilon_example_split_deployment": headline,
            "max_releases_per_example_by_epoch": per_epoch,
            "privacy": {
                "example_level_split_deployment": linked,
                "stream_amplified": {"epsilon": eps_stream, "delta": d, "statement": STREAM_STATEMENT,
                                     "assumption": "holds only against an observer who does not learn which "
                                                   "examples a step used nor which row is whose — not this "
                                                   "deployment's server"},
                "label": label_section(c.label_epsilon, self.task.num_labels, c.label_loss_correction, eps_stream, d),
            },
        }
