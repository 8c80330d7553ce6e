"""Split deployment of forward-pass LDP: ``dpft ldp-client`` ⟷ ``dpft ldp-server`` over HTTP(S).

The client (the data holder) runs pre(·), the autoencoder encoder, Frobenius clipping and
the Gaussian noise and sends only the noisy codes ``z`` ``(B, T, k)`` float32 and the labels
``(B,)`` int64 — in the clear, or with ``ldp.label_epsilon`` = ε₂ the K-ary randomized-response
labels drawn once before training (privacy/label_rr.py); then the dev labels never leave the
client either (``/eval`` gets ``z`` only and returns logits). The server trains post(·) —
decoder, remaining blocks, pooler, head — and never receives raw text, token ids, attention
masks or clean embeddings. The client adds the noise, so the client holds the ledger and
writes the privacy report; the server only trains.

The server knows which client sent which row, so its view has no subsampling amplification:
the client's report leads with the example-level guarantee of this deployment — the PLD
replace-one composition of the releases one example made (methods/ewft.py ``linked_section``)
— and gives the amplified stream ε only with its assumption spelled out. Every dev example's
noisy code sent to ``/eval`` is a release of that dev example too; the report says so
(``privacy.dev_releases``). ``/eval`` codes are always noised (``ldp.eval_noise: false`` is
refused in this deployment).

Randomness: the noise (stream ``ldp``; ``ldp_eval`` for dev batches) and the randomized
response (``label_rr``) come from the client's :class:`dpft.privacy.randomness.Randomness`: a
256-bit key from the OS CSPRNG held in memory only, never written, so nobody — the server,
which has the recipe, included — can regenerate the noise. ``privacy.reproducible: true``
derives the key from ``recipe.seed`` instead (research and tests only: the server has the
seed, so the report then says there is no privacy against the server).

Security of the channel (threat model: the server is honest-but-curious or malicious; the
network is loopback, or TLS):

* a shared bearer token (``secrets.token_urlsafe(32)``, written 0600) on every request,
  compared with ``secrets.compare_digest``; a request without it gets 401 and nothing else;
* plain HTTP only on a loopback address; elsewhere TLS (``--ssl-certfile/--ssl-keyfile`` on
  the server, an ``https://`` URL and optionally ``--ca-file`` on the client);
* body limits (413) computed from the plan, tensor names/dtypes/shapes/values checked
  against the plan (400), JSON bodies validated by pydantic models (422);
* a call-order state machine plan → encoder → step* → eval* → finish (409 otherwise);
* error replies are ``{"error": <short>, "reason": <fixed code>}`` — never exception text;
* the client checks the encoder weights it receives (names, shapes, float32, finite), pins
  them by sha256 (:func:`encoder_digest`, recorded in its report and ``client_secret.json``,
  optionally checked against ``--encoder-sha256``), replaces a non-finite code row by zeros
  before clipping and noise, and never sends a non-finite value.

Wire format: JSON for control messages; ``application/octet-stream`` safetensors for tensors
(``z``, ``labels``). Every request the server receives is logged to ``wire.jsonl`` (path,
status, reason code, tensor names, dtypes, shapes, sha256 of the bytes) so what crossed the
wire can be inspected.

Endpoints (all need ``Authorization: Bearer <token>``): ``POST /plan`` (JSON: num_labels,
total_steps, expected_batch_size) → builds the model and pre-trains the autoencoder on public
text; ``GET /encoder`` → the (public) encoder weights; ``POST /step?step=i`` → one optimizer
step on a noisy batch (steps in order 0, 1, …); ``POST /eval`` → correct count and loss on
noisy dev codes (or, without labels, the logits); ``POST /finish`` → saves post(·), stops.

FastAPI + uvicorn on the server, httpx on the client; one client at a time.
"""

import hashlib
import ipaddress
import json
import math
import os
import re
import secrets
import socket
import ssl
import threading
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dpft.config import Recipe
from dpft.privacy.ldp import GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, clip_frobenius
from dpft.privacy.randomness import Randomness, SecretStream

#: Tensor names a client may send; anything else is refused by the server.
ALLOWED = {"z", "labels"}
#: Largest JSON body (bytes) the server reads (``/plan``, ``/finish``, anything before the plan).
JSON_LIMIT = 64 * 1024
#: Extra bytes allowed over ``max_batch × T × k × 4 + max_batch × 8`` (safetensors header).
BODY_MARGIN = 64 * 1024
#: Shortest token the server accepts from a ``--token-file``.
MIN_TOKEN_CHARS = 32


# ------------------------------------------------------------------------------------ shared
def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by its owner only (mode 0600).

    The file is created with ``os.open(..., 0o600)`` (never world-readable, not even for an
    instant) and an existing file is re-moded to 0600 before it is overwritten.
    """
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_token(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped).

    Raises:
        LDPError: the file is missing or holds fewer than ``MIN_TOKEN_CHARS`` characters.
    """
    try:
        tok = Path(path).read_text().strip()
    except OSError as exc:
        raise LDPError(f"cannot read the ldp token file {path}: {exc.strerror}") from None
    if len(tok) < MIN_TOKEN_CHARS or any(c.isspace() for c in tok):
        raise LDPError(f"the ldp token in {path} must be one word of ≥ {MIN_TOKEN_CHARS} characters "
                       f"(the server writes one made by secrets.token_urlsafe(32))")
    return tok


def load_or_create_token(path: str | Path, overwrite: bool = False) -> str:
    """Read the token in ``path``, or (missing file, or ``overwrite``) make one with
    ``secrets.token_urlsafe(32)`` and write it there with mode 0600."""
    p = Path(path)
    if p.exists() and not overwrite:
        return read_token(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    tok = secrets.token_urlsafe(32)
    write_private(p, tok + "\n")
    return tok


def default_max_batch(expected_batch_size: float, eval_batch_size: int) -> int:
    """Largest batch the server accepts: ``max(eval batch, ⌈B + 10√B + 16⌉)`` rows.

    A Poisson(B) batch exceeds B + 10√B + 16 with negligible probability (< 1e-15 for any B).
    """
    b = float(expected_batch_size)
    return max(int(eval_batch_size), math.ceil(b + 10.0 * math.sqrt(b) + 16))


def encoder_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 pin of encoder weights: over the sorted names, each name, dtype, shape and the
    contiguous little-endian bytes. Independent of the safetensors header layout."""
    h = hashlib.sha256()
    for k in sorted(state):
        v = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's contiguous CPU bytes (logged in wire.jsonl for inspection)."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------ server
class Refused(Exception):
    """A request the server refuses: HTTP ``status`` and a fixed ``reason`` code (never text
    derived from an exception)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


#: The short ``error`` word of each refusal status; the reply is ``{"error", "reason"}``.
_ERROR_WORD = {400: "bad request", 401: "unauthorized", 404: "not found", 405: "method not allowed",
               409: "out of order", 413: "too large", 415: "unsupported media type", 422: "bad request",
               500: "internal error", 503: "unavailable"}


class PlanRequest(BaseModel):
    """``POST /plan`` body: K labels, the number of optimizer steps, the expected batch size B."""

    model_config = ConfigDict(extra="forbid")
    num_labels: StrictInt = Field(ge=2, le=10_000)
    total_steps: StrictInt = Field(ge=1, le=100_000_000)
    expected_batch_size: float = Field(gt=0, le=10_000_000)


class FinishRequest(BaseModel):
    """``POST /finish`` body: ``{}``."""

    model_config = ConfigDict(extra="forbid")


#: Call order: endpoint → (phases it may be called in, phase after it).
_ORDER = {
    "plan": ({"new"}, "planned"),
    "encoder": ({"planned", "encoder"}, "encoder"),
    "step": ({"encoder", "step"}, "step"),
    "eval": ({"encoder", "step", "eval"}, "eval"),
    "finish": ({"planned", "encoder", "step", "eval"}, "finished"),
}


class LDPServerState:
    """The service provider: post(·) and the head, trained on noisy codes only.

    A state machine over ``phase``: ``new`` → (plan) ``planned`` → (encoder) ``encoder`` →
    (step, in order 0 … total_steps − 1) ``step`` → (eval) ``eval`` → (finish) ``finished``;
    a call out of this order raises :class:`Refused` (409). All calls hold ``lock``.

    Args:
        recipe: the shared recipe (``ldp.enabled``).
        run_dir: where ``wire.jsonl`` and (at finish) ``model/`` go.
        max_batch: largest batch (rows) of ``/step`` and ``/eval``; None = :func:`default_max_batch`.
        max_body_bytes: largest tensor body; None = ``max_batch × T × k × 4 + max_batch × 8 + 64 KiB``.
    """

    def __init__(self, recipe: Recipe, run_dir: str | Path, max_batch: Optional[int] = None,
                 max_body_bytes: Optional[int] = None):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.split: Optional[SplitClassifier] = None
        self.lock = threading.Lock()
        self.log_lock = threading.Lock()
        self.phase = "new"
        self.steps_done = 0
        self.total_steps = 0
        self.num_labels = 0
        self.losses: list[float] = []
        self.max_batch = int(max_batch) if max_batch is not None else default_max_batch(
            recipe.batch.expected_batch_size, recipe.eval.batch_size)
        if self.max_batch < 1:
            raise LDPError(f"ldp-server: max batch must be ≥ 1, got {self.max_batch}")
        self._max_body = max_body_bytes
        self.code_shape: Optional[tuple[int, int]] = None  # (T, k) after the plan

    def log(self, entry: dict[str, Any]) -> None:
        with self.log_lock, open(self.run_dir / "wire.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def body_limit(self, path: str) -> int:
        """Largest body (bytes) accepted on ``path`` now: tensors after the plan, else JSON."""
        if path in ("/step", "/eval") and self.code_shape is not None:
            if self._max_body is not None:
                return int(self._max_body)
            t, k = self.code_shape
            return self.max_batch * t * k * 4 + self.max_batch * 8 + BODY_MARGIN
        return JSON_LIMIT

    def enter(self, call: str) -> None:
        """Check that ``call`` may come now (else :class:`Refused` 409); the caller holds the lock."""
        allowed, _ = _ORDER[call]
        if self.phase == "finished":
            raise Refused(409, "finished")
        if self.phase not in allowed:
            raise Refused(409, "out_of_order")

    def leave(self, call: str) -> None:
        self.phase = _ORDER[call][1]

    def plan(self, p: PlanRequest) -> dict[str, Any]:
        """Build post(·) (and the autoencoder, pre-trained on public text); reply the release shape."""
        from dpft.models.load import load_classifier

        r, c = self.recipe, self.recipe.ldp
        if abs(p.expected_batch_size - float(r.batch.expected_batch_size)) > 1e-9:
            raise Refused(400, "plan_mismatch")
        tok, model = load_classifier(r.model.name, p.num_labels, seed=r.seed)
        ae = None
        if c.autoencoder.sizes:
            torch.manual_seed(r.seed)
            ae = StackedAutoencoder(c.autoencoder.sizes)
        split = SplitClassifier(model, c.position, GaussianLDP(c.max_norm, 0.0, ae), r.model.max_length)
        pretrain_loss: list[float] = []
        if ae is not None and c.autoencoder.pretrain_epochs > 0:
            pretrain_loss = _pretrain_public(split, ae, tok, r)
        self.split, self.pretrain_loss = split, pretrain_loss
        self.params = [q for q in self.split.parameters() if q.requires_grad]
        o = r.optimizer
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        total = self.total_steps = p.total_steps
        self.num_labels = p.num_labels
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: max(0.0, (total - s) / total))
        self.denom = float(p.expected_batch_size)
        self.loss = lambda logits, y: F.cross_entropy(logits, y, reduction="none")
        if c.label_epsilon is not None and c.label_loss_correction:
            from dpft.privacy.label_rr import forward_corrected_loss, rr_transition_matrix

            # T is public (ε₂ and K from the shared recipe): labels arrive randomized
            tmat = rr_transition_matrix(c.label_epsilon, p.num_labels)
            self.loss = lambda logits, y: forward_corrected_loss(logits, y, tmat)
        k = c.autoencoder.sizes[-1] if c.autoencoder.sizes else int(model.config.hidden_size)
        self.code_shape = (int(r.model.max_length), int(k))
        return {"ok": True, "release_shape": list(self.code_shape), "max_batch": self.max_batch,
                "pretrain_loss": self.pretrain_loss}

    def encoder_bytes(self) -> bytes:
        """The public encoder weights as safetensors bytes (empty without an autoencoder)."""
        ae = self.split.noise.autoencoder if self.split is not None else None
        if ae is None:
            return st_save({})
        return st_save({k: v.contiguous() for k, v in ae.encoder.state_dict().items()})

    def check_tensors(self, t: dict[str, torch.Tensor], call: str) -> None:
        """Refuse (400) tensors that are not what the plan allows.

        ``/step``: exactly ``z`` float32 ``(b, T, k)`` with 0 ≤ b ≤ max_batch and ``labels``
        int64 ``(b,)`` with values in [0, K). ``/eval``: ``z`` with 1 ≤ b ≤ max_batch, labels
        optional. ``z`` must be finite. Reasons: bad_names, bad_dtype, bad_shape, bad_batch,
        nonfinite, bad_labels.
        """
        names = set(t)
        if names - ALLOWED or "z" not in names or (call == "step" and "labels" not in names):
            raise Refused(400, "bad_names")
        z = t["z"]
        if z.dtype != torch.float32:
            raise Refused(400, "bad_dtype")
        if z.dim() != 3 or tuple(z.shape[1:]) != self.code_shape:
            raise Refused(400, "bad_shape")
        b = int(z.shape[0])
        if b > self.max_batch or (call == "eval" and b == 0):
            raise Refused(400, "bad_batch")
        if not bool(torch.isfinite(z).all()):
            raise Refused(400, "nonfinite")
        if "labels" in t:
            y = t["labels"]
            if y.dtype != torch.int64:
                raise Refused(400, "bad_dtype")
            if tuple(y.shape) != (b,):
                raise Refused(400, "bad_shape")
            if b and (int(y.min()) < 0 or int(y.max()) >= self.num_labels):
                raise Refused(400, "bad_labels")

    def step(self, t: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
        """One optimizer step on a checked batch; ``step`` must be the next one (else 409)."""
        if step != self.steps_done or step >= self.total_steps:
            raise Refused(409, "step_order")
        self.split.train()
        torch.manual_seed(step)  # dropout of post(·)
        z, y = t["z"], t["labels"]
        if z.shape[0]:
            loss = self.loss(self.split.post(z).float(), y).sum()
            (loss / self.denom).backward()  # divide by the expected batch size, as the Trainer does
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            val = float(loss.detach()) / z.shape[0]
        else:
            val = float("nan")
        self.sched.step()
        self.steps_done += 1
        self.losses.append(val)
        return {"loss": None if math.isnan(val) else val, "step": step}

    @torch.no_grad()
    def evaluate(self, t: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Correct count and summed loss on noisy dev codes, or (no labels) the logits ``(b, K)``."""
        self.split.eval()
        logits = self.split.post(t["z"]).float()
        if "labels" not in t:  # label-private client: it scores the logits itself
            return {"logits": logits.tolist(), "n": int(t["z"].shape[0])}
        return {"correct": int((logits.argmax(-1) == t["labels"]).sum()), "n": int(t["z"].shape[0]),
                "loss_sum": float(F.cross_entropy(logits, t["labels"], reduction="sum"))}

    def finish(self) -> dict[str, Any]:
        """Save post(·) (``model/``); the server stops after replying."""
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


def _error_body(status: int, reason: str) -> bytes:
    return json.dumps({"error": _ERROR_WORD.get(status, "error"), "reason": reason}).encode()


class _Guard:
    """ASGI middleware in front of every route: bearer token (401) and declared body size (413),
    checked from the headers alone, before any body byte is read."""

    def __init__(self, app, token: str, state: LDPServerState):
        self.app, self.token, self.state = app, token.encode(), state

    async def _refuse(self, send, status: int, reason: str, extra: tuple = ()) -> None:
        body = _error_body(status, reason)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                                *extra]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.lower(), v)
        path = scope.get("path", "")
        auth = headers.get(b"authorization", b"")
        if not (auth[:7] == b"Bearer " and secrets.compare_digest(auth[7:], self.token)):
            self.state.log({"method": scope.get("method"), "path": path, "status": 401, "reason": "token"})
            return await self._refuse(send, 401, "token", ((b"www-authenticate", b"Bearer"),))
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                n = -1
            if n < 0:
                return await self._refuse(send, 400, "bad_length")
            if n > self.state.body_limit(path):
                self.state.log({"method": scope.get("method"), "path": path, "status": 413, "reason": "body_size",
                                "bytes": n})
                return await self._refuse(send, 413, "body_size")
        return await self.app(scope, receive, send)


def build_app(state: LDPServerState, token: str, on_finish: Callable[[], None]):
    """The FastAPI app of one run: routes, token/size guard, generic error replies.

    ``on_finish`` is called after the ``/finish`` reply has been sent (stops the server).
    """
    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.background import BackgroundTask
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response

    if len(token) < MIN_TOKEN_CHARS:
        raise LDPError(f"ldp-server token must have ≥ {MIN_TOKEN_CHARS} characters")
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, token=token, state=state)

    def reply(status: int, reason: str) -> Response:
        return Response(_error_body(status, reason), status_code=status, media_type="application/json")

    def finish_log(request: Request, status: int, reason: Optional[str] = None) -> None:
        entry = getattr(request.state, "wire", None) or {"method": request.method, "path": request.url.path}
        entry["status"] = status
        if reason is not None:
            entry["reason"] = reason
        state.log(entry)

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused):
        finish_log(request, exc.status, exc.reason)
        return reply(exc.status, exc.reason)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        finish_log(request, 422, "invalid_request")
        return reply(422, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        finish_log(request, exc.status_code, reason)
        return reply(exc.status_code, reason)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # the reply never carries the exception text
        finish_log(request, 500, "internal")
        return reply(500, "internal")

    async def read_body(request: Request, ctype: str) -> bytes:
        if request.headers.get("content-type", "").split(";")[0].strip() != ctype:
            raise Refused(415, "content_type")
        limit, buf = state.body_limit(request.url.path), bytearray()
        async for chunk in request.stream():  # counted: a chunked body without a length is capped too
            buf += chunk
            if len(buf) > limit:
                raise Refused(413, "body_size")
        request.state.wire["bytes"] = len(buf)
        return bytes(buf)

    def start(request: Request, **extra) -> None:
        request.state.wire = {"method": request.method, "path": request.url.path,
                              "content_type": request.headers.get("content-type", ""), **extra}

    def locked(call: str, fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            with state.lock:
                state.enter(call)
                out = fn()
                state.leave(call)
                return out
        return run

    async def json_body(request: Request, model):
        body = await read_body(request, "application/json")
        try:
            obj = model.model_validate_json(body or b"{}")
        except ValidationError:
            raise Refused(422, "invalid_json") from None
        request.state.wire["json_keys"] = sorted(obj.model_dump(exclude_unset=True))
        return obj

    async def tensor_body(request: Request) -> dict[str, torch.Tensor]:
        body = await read_body(request, "application/octet-stream")
        try:
            t = st_load(body)
        except Exception:  # noqa: BLE001 - malformed bytes: fixed reason only
            raise Refused(400, "bad_tensors") from None
        # sha256 of each tensor's bytes: what arrived can be matched afterwards
        request.state.wire["tensors"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                                             "sha256": tensor_digest(v)} for k, v in t.items()}
        return t

    @app.post("/plan")
    async def plan(request: Request):
        start(request)
        p = await json_body(request, PlanRequest)
        out = await run_in_threadpool(locked("plan", lambda: state.plan(p)))
        finish_log(request, 200)
        return JSONResponse(out)

    @app.get("/encoder")
    async def encoder(request: Request):
        start(request)
        body = await run_in_threadpool(locked("encoder", lambda: {"b": state.encoder_bytes()}))
        finish_log(request, 200)
        return Response(body["b"], media_type="application/octet-stream")

    @app.post("/step")
    async def step(request: Request, step: int = Query(..., ge=0)):
        start(request, step=step)
        t = await tensor_body(request)

        def run():
            state.check_tensors(t, "step")
            return state.step(t, step)
        out = await run_in_threadpool(locked("step", run))
        finish_log(request, 200)
        return JSONResponse(out)

    @app.post("/eval")
    async def evaluate(request: Request):
        start(request)
        t = await tensor_body(request)

        def run():
            state.check_tensors(t, "eval")
            return state.evaluate(t)
        out = await run_in_threadpool(locked("eval", run))
        finish_log(request, 200)
        return JSONResponse(out)

    @app.post("/finish")
    async def finish(request: Request):
        start(request)
        await json_body(request, FinishRequest)
        out = await run_in_threadpool(locked("finish", state.finish))
        finish_log(request, 200)
        return JSONResponse(out, background=BackgroundTask(on_finish))

    return app


class LDPServer:
    """One split-LDP training run served by uvicorn on ``host:port``.

    Attributes: ``state`` (:class:`LDPServerState`), ``token`` (the bearer token), ``url``,
    ``port``, ``server_address`` ``(host, port)``. ``serve_forever()`` blocks until ``/finish``
    (or ``shutdown()``); it may run in a thread.
    """

    def __init__(self, state: LDPServerState, token: str, host: str, port: int,
                 ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None):
        import uvicorn

        self.state, self.token, self.host = state, token, host
        self.tls = ssl_certfile is not None
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.sock = socket.socket(info[0], socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(info[4])
        self.sock.listen(64)  # connections queue from now on, before uvicorn starts accepting
        self.port = int(self.sock.getsockname()[1])
        self.server_address = (host, self.port)
        self.app = build_app(state, token, self.shutdown)
        cfg = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False, server_header=False,
                             proxy_headers=False, limit_concurrency=8, timeout_keep_alive=30,
                             ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile)
        self.server = uvicorn.Server(cfg)

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{h}:{self.port}"

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.sock])

    def shutdown(self) -> None:
        self.server.should_exit = True


def make_server(recipe: Recipe, run_dir: str | Path, port: int = 0, host: str = "127.0.0.1",
                token: Optional[str] = None, ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None,
                max_batch: Optional[int] = None, max_body_bytes: Optional[int] = None) -> LDPServer:
    """A server bound to ``host:port`` (0 = any free port) serving one LDP training run.

    Args:
        token: the bearer token; None = a fresh ``secrets.token_urlsafe(32)`` (``server.token``).
        ssl_certfile, ssl_keyfile: PEM files: serve HTTPS. Required for a non-loopback ``host``.
        max_batch, max_body_bytes: limits (see :class:`LDPServerState`).

    Raises:
        LDPError: the recipe has no ``ldp.enabled: true``; a non-loopback host without TLS; a
            token shorter than 32 characters; only one of the two TLS files.
    """
    if not recipe.ldp.enabled:
        raise LDPError("ldp-server needs a recipe with ldp.enabled: true (see recipes/sst2-minilm-ewft.yaml)")
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise LDPError("ldp-server: give both --ssl-certfile and --ssl-keyfile, or neither")
    if ssl_certfile is None and not _is_loopback(host):
        raise LDPError(f"ldp-server: plain HTTP only on a loopback address, not {host!r}; "
                       f"give --ssl-certfile and --ssl-keyfile to serve elsewhere")
    state = LDPServerState(recipe, run_dir, max_batch=max_batch, max_body_bytes=max_body_bytes)
    return LDPServer(state, token if token is not None else secrets.token_urlsafe(32), host, port,
                     ssl_certfile, ssl_keyfile)


# ------------------------------------------------------------------------------------ client
_REASON = re.compile(r"^[a-z_]{1,40}$")


class LDPClient:
    """The data holder: pre(·) + encoder + clip + noise; sends noisy codes and labels only.

    Holds the ledger (it adds the noise) and writes ``client_report.json`` and (mode 0600)
    ``client_secret.json`` — the randomness mode and the encoder's sha256 pin; no seed or key
    is ever written in the default secure mode. ``sent`` keeps every request body it sent
    (for inspection of the wire in tests, with ``keep_wire``).

    Args:
        recipe: the recipe (the same as the server's); ``ldp.eval_noise`` must stay true.
        server: ``http://`` URL of a loopback server, or ``https://`` URL.
        run_dir: where the ledger, the report and the secret file go.
        token: the server's bearer token (see ``dpft ldp-server --token-file``).
        ca_file: PEM CA bundle to verify an https server (None = the system's).
        encoder_sha256: refuse an encoder whose :func:`encoder_digest` differs.

    Raises:
        LDPError: a recipe this deployment cannot run (no ldp, fractional epochs,
            ``eval_noise: false``, σ ≤ 0), plain HTTP to a non-loopback host, a bad token.
    """

    def __init__(self, recipe: Recipe, server: str, run_dir: str | Path, token: str, keep_wire: bool = False,
                 ca_file: Optional[str] = None, encoder_sha256: Optional[str] = None):
        import math as _m

        import httpx

        from dpft.accounting.calibrate import check_delta
        from dpft.accounting.ewpba import make_schedule
        from dpft.accounting.ledger import PrivacyLedger
        from dpft.step.sample import PoissonSampler
        from dpft.data.tasks import load_task
        from dpft.data.tokenize import tokenize_split
        from dpft.models.load import load_classifier

        r, c = recipe, recipe.ldp
        if not c.enabled:
            raise LDPError("ldp-client needs a recipe with ldp.enabled: true")
        if not c.eval_noise:
            raise LDPError("ldp-client: ldp.eval_noise: false would send the clean dev codes to the server; "
                           "the split deployment always noises /eval — remove that setting")
        if c.reproduce is not None or c.reproduce_flaws:
            raise LDPError("ldp-client: ldp.reproduce (a NOT CERTIFIED in-process reproduction) is not available "
                           "in the split deployment; remove it")
        # ldp.mask_after_noise is an in-process option: this deployment never sends a mask (the
        # token count stays protected) and, at `output`, releases the whole T × k matrix.
        e = r.schedule.epochs
        if e is None or e != int(e):
            raise LDPError("ldp-client needs schedule.epochs = a whole number E")
        if not token or len(token) < MIN_TOKEN_CHARS:
            raise LDPError(f"ldp-client needs the server's bearer token (≥ {MIN_TOKEN_CHARS} characters; "
                           f"--token-file)")
        u = urlparse(server)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise LDPError(f"ldp-client: server must be an http(s):// URL, got {server!r}")
        if u.scheme == "http" and not _is_loopback(u.hostname):
            raise LDPError(f"ldp-client: plain HTTP only to a loopback address, not {u.hostname!r}; use https://")
        if encoder_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", encoder_sha256.lower()):
            raise LDPError("ldp-client: --encoder-sha256 must be 64 hex digits")
        self.expected_encoder_sha256 = encoder_sha256.lower() if encoder_sha256 else None
        self.encoder_sha256: Optional[str] = None
        self.recipe, self.server = r, server.rstrip("/")
        verify: Any = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.http = httpx.Client(base_url=self.server, headers={"Authorization": f"Bearer {token}"},
                                 verify=verify, timeout=httpx.Timeout(3600.0, connect=30.0), trust_env=False,
                                 follow_redirects=False)
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
        #: The client's secret randomness (never sent, never written in secure mode): sampling,
        #: noise and randomized response.
        self.reproducible = bool(getattr(r.privacy, "reproducible", False))
        self.rng = Randomness(r.seed) if self.reproducible else Randomness()
        self.sampler = PoissonSampler(self.n, r.batch.expected_batch_size, self.rng)
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
        if not min(self.schedule.sigmas) > 0:
            raise LDPError("ldp-client: every σ_e must be > 0 (σ = 0 releases the clean codes)")
        self.ledger = PrivacyLedger()
        self.hardened = bool(getattr(r.privacy, "hardened_noise", True))
        #: Rows whose clean code was non-finite and was replaced by zeros (client-side diagnostic).
        self.rows_zeroed = 0
        self._write_secret()
        ae = StackedAutoencoder(c.autoencoder.sizes) if c.autoencoder.sizes else None
        self.layer = GaussianLDP(c.max_norm, self.schedule.sigmas[0], ae, normalize=c.normalize, eval_noise=True)
        self.code_shape = (int(r.model.max_length),
                           int(c.autoencoder.sizes[-1]) if ae is not None else int(model.config.hidden_size))
        #: Label privacy: RR labels drawn once, before training (every epoch sends the same ỹ).
        self.true_labels = torch.tensor([int(v) for v in self.train_tok["label"]], dtype=torch.long)
        self.noisy_labels: Optional[torch.Tensor] = None
        if c.label_epsilon is not None:
            from dpft.methods.ewft import privatize_labels

            self.train_tok, self.noisy_labels = privatize_labels(self.train_tok, c.label_epsilon,
                                                                 self.task.num_labels, self.rng.stream("label_rr"))
        self.split = SplitClassifier(model, c.position, self.layer, r.model.max_length)

    def _randomness_section(self) -> dict[str, Any]:
        if self.reproducible:
            return {"mode": "reproducible", "key": "derived from recipe.seed",
                    "statement": "privacy.reproducible: true — the noise and randomized-response key is derived "
                                 "from recipe.seed, which the server has: it can regenerate the noise and subtract "
                                 "it. NO privacy against this server; for research and tests only."}
        return {"mode": "secure", "key": "256-bit key from the OS CSPRNG, held in memory only, never written",
                "statement": "nobody, the server included, can regenerate the noise or the randomized response"}

    def _write_secret(self) -> None:
        write_private(self.run_dir / "client_secret.json", json.dumps(
            {"randomness": self._randomness_section(), "encoder_sha256": self.encoder_sha256,
             "server": self.server,
             "note": "client side only (mode 0600); holds no seed or key in secure mode"}, indent=1))

    # -- transport
    def _request(self, method: str, path: str, body: Optional[bytes] = None, ctype: Optional[str] = None,
                 params: Optional[dict] = None, cap: int = 64 * 2**20) -> bytes:
        """One request; the reply body (at most ``cap`` bytes). Raises LDPError on any failure."""
        import httpx

        headers = {"Content-Type": ctype} if ctype else {}
        try:
            with self.http.stream(method, path, content=body, headers=headers, params=params) as resp:
                buf = bytearray()
                for chunk in resp.iter_bytes():
                    buf += chunk
                    if len(buf) > cap:
                        raise LDPError(f"server reply to {path} exceeds {cap} bytes: refused")
                status = resp.status_code
        except httpx.HTTPError as exc:
            raise LDPError(f"ldp-client: request {method} {path} to {self.server} failed "
                           f"({type(exc).__name__})") from None
        if status != 200:
            reason = "?"
            try:
                rr = json.loads(bytes(buf)).get("reason", "?")
                reason = rr if isinstance(rr, str) and _REASON.match(rr) else "?"
            except (ValueError, AttributeError):
                pass
            raise LDPError(f"server refused {path}: HTTP {status} ({reason})")
        return bytes(buf)

    def _post(self, path: str, body: bytes, ctype: str, params: Optional[dict] = None) -> dict[str, Any]:
        if self.keep_wire:
            self.sent.append((path + (f"?step={params['step']}" if params else ""), body))
        out = self._request("POST", path, body, ctype, params)
        try:
            obj = json.loads(out)
        except ValueError:
            raise LDPError(f"server reply to {path} is not JSON") from None
        if not isinstance(obj, dict):
            raise LDPError(f"server reply to {path} is not a JSON object")
        return obj

    def _send_tensors(self, path: str, z: torch.Tensor, labels: Optional[torch.Tensor],
                      params: Optional[dict] = None) -> dict[str, Any]:
        """Send ``z`` ``(b, T, k)`` float32 [+ ``labels`` ``(b,)`` int64]; refuses a non-finite z."""
        z = z.float().contiguous()
        if not bool(torch.isfinite(z).all()):
            raise LDPError(f"ldp-client: refusing to send a non-finite code to {path}")
        t = {"z": z}
        if labels is not None:
            t["labels"] = labels.long().contiguous()
        return self._post(path, st_save(t), "application/octet-stream", params)

    def load_encoder(self, body: bytes) -> Optional[str]:
        """Check and load the server's encoder weights (safetensors bytes); return their sha256 pin.

        Every tensor must have the name, shape and dtype (float32) of this client's own encoder
        and be finite: a NaN/inf weight turns the code into NaN through the clipping, the
        noise does not hide NaN, and the server would read the input back. The pin
        (:func:`encoder_digest`) is recorded in ``client_secret.json`` and the report and
        compared with ``encoder_sha256`` if given.

        Raises:
            LDPError: unreadable bytes, other names/shapes/dtypes, a non-finite weight, a pin
                mismatch, or weights sent for a recipe without an autoencoder.
        """
        try:
            t = st_load(body)
        except Exception:  # noqa: BLE001 - any malformed payload
            raise LDPError("server sent unreadable encoder weights: refused") from None
        ae = self.layer.autoencoder
        if ae is None:
            if t:
                raise LDPError("server sent encoder weights but the recipe has no autoencoder: refused")
            return None
        own = ae.encoder.state_dict()
        if set(t) != set(own):
            raise LDPError(f"server sent encoder weights {sorted(t)}, expected {sorted(own)}: refused")
        for k, v in t.items():
            if v.dtype != torch.float32 or tuple(v.shape) != tuple(own[k].shape):
                raise LDPError(f"server sent encoder weight {k!r} of {v.dtype} {tuple(v.shape)}, expected "
                               f"float32 {tuple(own[k].shape)}: refused")
            if not bool(torch.isfinite(v).all()):
                raise LDPError(f"server sent a non-finite encoder weight {k!r} (NaN/inf would survive the clipping "
                               f"and the noise and reveal the input): refused")
        digest = encoder_digest(t)
        if self.expected_encoder_sha256 is not None and digest != self.expected_encoder_sha256:
            raise LDPError(f"server sent an encoder with sha256 {digest}, not the pinned "
                           f"{self.expected_encoder_sha256}: refused")
        ae.encoder.load_state_dict(t, strict=True)
        self.encoder_sha256 = digest
        self._write_secret()
        return digest

    @torch.no_grad()
    def release_codes(self, h: torch.Tensor, sigma: float, gen: SecretStream) -> torch.Tensor:
        """Clean hidden states ``(b, T, d)`` → noisy codes ``(b, T, k)`` float32 (what is sent).

        encoder → rows with any non-finite value replaced by zeros (a data-independent code of
        norm 0 ≤ C: the sensitivity 2C and the guarantee are unchanged, and no abort tells the
        server which row overflowed) → Frobenius clip to C → + N(0, (σ·2C)²): the next draw of the
        secret stream ``gen`` (:meth:`SecretStream.normal`: four independent generators, ≥ 128
        bits of secret entropy; ``privacy.hardened_noise`` no longer changes it).

        Raises:
            LDPError: σ ≤ 0, or (never expected) a non-finite result.
        """
        if not sigma > 0:
            raise LDPError(f"ldp-client: σ must be > 0, got {sigma}")
        ae = self.layer.autoencoder
        z = (ae.encode(h) if ae is not None else h).float()
        z = clip_frobenius(self._zero_nonfinite_rows(z), self.layer.max_norm, self.layer.normalize)
        z = self._zero_nonfinite_rows(z)  # belt and braces: clipping a finite row never makes it non-finite
        std = sigma * self.layer.sensitivity  # σ_e · 2C
        out = z + gen.normal(tuple(z.shape), dtype=torch.float32, device=z.device) * std
        if not bool(torch.isfinite(out).all()):
            raise LDPError("ldp-client: non-finite noisy code: refused")
        return out

    def _zero_nonfinite_rows(self, z: torch.Tensor) -> torch.Tensor:
        bad = ~torch.isfinite(z.reshape(z.shape[0], -1)).all(1)
        if bool(bad.any()):
            z = z.clone()
            z[bad] = 0.0
            self.rows_zeroed += int(bad.sum())
        return z

    def _release(self, rows, sigma: float, gen: SecretStream) -> tuple[torch.Tensor, torch.Tensor]:
        from dpft.data.tokenize import collate

        b = collate(list(rows), self.pad_id, self.with_tt)
        h = self.split.pre(b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
        return self.release_codes(h, sigma, gen), b["labels"]

    def run(self) -> dict[str, Any]:
        """Plan, fetch and check the public encoder, send every step's noisy batch, evaluate on
        noisy dev codes, finish; write the ledger and ``client_report.json``."""
        try:
            return self._run()
        finally:
            self.http.close()

    def _run(self) -> dict[str, Any]:
        from dpft.privacy.ldp import local_epsilon

        r = self.recipe
        plan = self._post("/plan", json.dumps({"num_labels": self.task.num_labels, "total_steps": self.total_steps,
                                               "expected_batch_size": r.batch.expected_batch_size}).encode(),
                          "application/json")
        if plan.get("release_shape") != list(self.code_shape):
            raise LDPError(f"server plans releases of shape {plan.get('release_shape')}, this client makes "
                           f"{list(self.code_shape)}: refused (same recipe on both sides?)")
        max_batch = plan.get("max_batch")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise LDPError("server plan has no valid max_batch")
        n_params = sum(p.numel() for p in self.layer.autoencoder.encoder.parameters()) \
            if self.layer.autoencoder is not None else 0
        self.load_encoder(self._request("GET", "/encoder", cap=n_params * 4 + BODY_MARGIN))
        losses = []
        for step in range(self.total_steps):
            sigma = self.schedule.sigma_at(step)
            self.layer.set_sigma(sigma)
            idx = self.sampler.indices(step)
            if len(idx) > max_batch:
                raise LDPError(f"step {step}: Poisson batch of {len(idx)} rows exceeds the server's max_batch "
                               f"{max_batch}")
            if len(idx):
                z, y = self._release(self.train_tok.select(idx.tolist()), sigma, self.rng.stream("ldp", step))
            else:
                z, y = torch.zeros(0, *self.code_shape), torch.zeros(0, dtype=torch.long)
            out = self._send_tensors("/step", z, y, params={"step": step})
            losses.append(out.get("loss"))
            self.ledger.record("ldp-forward", self.schedule.step_event(step))
        # evaluation: every dev code is noised at the last epoch's σ — one release per dev example
        sigma_eval = self.schedule.sigmas[-1]
        correct = n = 0
        loss_sum = 0.0
        bs = max(1, min(r.eval.batch_size, max_batch))
        for i, k in enumerate(range(0, len(self.dev_tok), bs)):
            z, y = self._release(self.dev_tok.select(range(k, min(k + bs, len(self.dev_tok)))), sigma_eval,
                                 self.rng.stream("ldp_eval", i))
            if self.noisy_labels is None:
                out = self._send_tensors("/eval", z, y)
            else:  # label privacy: dev labels stay here; score the returned logits locally
                lg = torch.tensor(self._send_tensors("/eval", z, None).get("logits"), dtype=torch.float32)
                if tuple(lg.shape) != (len(y), self.task.num_labels):
                    raise LDPError("server /eval reply has logits of the wrong shape")
                out = {"correct": int((lg.argmax(-1) == y).sum()), "n": int(len(y)),
                       "loss_sum": float(F.cross_entropy(lg, y, reduction="sum"))}
            correct, n, loss_sum = correct + out["correct"], n + out["n"], loss_sum + out["loss_sum"]
        self._post("/finish", b"{}", "application/json")
        d = r.ldp.delta
        eps_stream = self.ledger.epsilon(d).epsilon
        rep = {"dev_accuracy": correct / max(n, 1), "dev_loss": loss_sum / max(n, 1), "n_dev": n,
               "train_loss": [x for x in losses if x is not None][-10:],
               "epsilon_stream": eps_stream, "delta": d,
               "epsilon_local_per_release": [local_epsilon(s, d) for s in self.schedule.sigmas],
               "schedule": self.schedule.as_dict(), "steps": self.total_steps,
               "encoder_sha256": self.encoder_sha256,
               "client_diagnostics": {"rows_zeroed_nonfinite_code": self.rows_zeroed,
                                      "note": "data holder only; not a release"}}
        rep.update(self.privacy_report(eps_stream, n_dev=n, sigma_eval=sigma_eval))
        self.ledger.save(self.run_dir / "ledger.json")
        (self.run_dir / "client_report.json").write_text(json.dumps(rep, indent=1))
        return rep

    def privacy_report(self, eps_stream: float, n_dev: int = 0, sigma_eval: Optional[float] = None) -> dict[str, Any]:
        """The guarantees of this split deployment, leading with the example-level one.

        The server links rows to this client, so no subsampling amplification: the example-level
        ε is the PLD replace-one composition (dp_accounting) of the releases one example made —
        at most the largest per-epoch release count at each epoch's σ_e, from the seeded sampler
        (``methods.ewft.linked_section``; ≥ the amplified stream ε). The amplified stream ε is
        kept, with its assumption. Labels: ε₂ by randomized response, or in the clear. Dev
        examples: one noisy code each at ``sigma_eval`` (local ε), labels in the clear or kept.
        """
        from dpft.methods.ewft import (STREAM_STATEMENT, label_section, linked_section,
                                       max_releases_per_epoch)
        from dpft.privacy.ldp import local_epsilon

        c = self.recipe.ldp
        d = c.delta
        per_epoch = max_releases_per_epoch(self.sampler, self.n, self.epochs, self.steps_per_epoch, self.total_steps)
        seq = [s for s, k in zip(self.schedule.sigmas, per_epoch) for _ in range(k)]
        linked = linked_section(seq, d, c.label_epsilon, self.task.num_labels)
        headline = linked["epsilon_with_label"] if linked["epsilon_with_label"] is not None else linked["epsilon"]
        s_eval = float(sigma_eval if sigma_eval is not None else self.schedule.sigmas[-1])
        eps_dev = local_epsilon(s_eval, d)
        labels_kept = c.label_epsilon is not None
        dev = {"n_dev": n_dev, "releases_per_dev_example": 1, "sigma": s_eval, "epsilon_code": eps_dev, "delta": d,
               "epsilon_with_label": eps_dev if labels_kept else None,
               "labels": "kept on the client (the server returns logits)" if labels_kept
               else "sent in the clear with the codes: no guarantee for a dev example's label",
               "statement": "every dev example's noisy code sent to /eval is one release of that dev example "
                            "(clipped to C, Gaussian noise of std σ·2C; the server links it to this client): "
                            f"(ε = {eps_dev:.4g}, δ = {d:g})-DP for its text. Dev examples are not training "
                            "examples; if an example is in both, its releases compose."}
        return {
            "epsilon_example_split_deployment": headline,
            "epsilon_dev_example_split_deployment": dev["epsilon_with_label"],
            "max_releases_per_example_by_epoch": per_epoch,
            "privacy": {
                "randomness": self._randomness_section(),
                "example_level_split_deployment": linked,
                "stream_amplified": {"epsilon": eps_stream, "delta": d, "statement": STREAM_STATEMENT,
                                     "assumption": "holds only against an observer who does not learn which "
                                                   "examples a step used nor which row is whose — not this "
                                                   "deployment's server"},
                "label": label_section(c.label_epsilon, self.task.num_labels, c.label_loss_correction, eps_stream, d),
                "dev_releases": dev,
            },
        }
