"""``dpft ldp-server``: the service provider's side of the split deployment — post(·) trained on
noisy codes only, behind the token/size guard and the call-order state machine
(see :mod:`dpft.methods.ewft.split`)."""

import json
import math
import secrets
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dpft.methods.ewft.split.protocol import (
    ALLOWED,
    BODY_MARGIN,
    CALL_ORDER,
    ERROR_WORD,
    JSON_LIMIT,
    MIN_TOKEN_CHARS,
    FinishRequest,
    PlanRequest,
    Refused,
    default_max_batch,
    is_loopback,
    tensor_digest,
)
from dpft.privacy.ldp import GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, pretrain_autoencoder
from dpft.config.recipe import TaskCfg
from dpft.placement.device import resolve_device
from dpft.privacy.label_rr import forward_corrected_loss, rr_transition_matrix


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

    def __init__(self, recipe: Any, run_dir: str | Path, max_batch: Optional[int] = None,
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
        allowed, _ = CALL_ORDER[call]
        if self.phase == "finished":
            raise Refused(409, "finished")
        if self.phase not in allowed:
            raise Refused(409, "out_of_order")

    def leave(self, call: str) -> None:
        self.phase = CALL_ORDER[call][1]

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
        # post(·) trains on the recipe's perf.device; what crosses the wire stays on the host.
        self.device = resolve_device(r.perf.device)
        split = SplitClassifier(model, c.position, GaussianLDP(c.max_norm, 0.0, ae), r.model.max_length)
        split.to(self.device)
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
        return st_save({k: v.detach().cpu().contiguous() for k, v in ae.encoder.state_dict().items()})

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
        z, y = t["z"].to(self.device), t["labels"].to(self.device)
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
        logits = self.split.post(t["z"].to(self.device)).float().cpu()
        if "labels" not in t:  # label-private client: it scores the logits itself
            return {"logits": logits.tolist(), "n": int(t["z"].shape[0])}
        return {"correct": int((logits.argmax(-1) == t["labels"]).sum()), "n": int(t["z"].shape[0]),
                "loss_sum": float(F.cross_entropy(logits, t["labels"], reduction="sum"))}

    def finish(self) -> dict[str, Any]:
        """Save post(·) (``model/``); the server stops after replying."""
        self.split.save_pretrained(self.run_dir / "model")
        return {"ok": True, "steps": self.steps_done}


def _pretrain_public(split: SplitClassifier, ae: StackedAutoencoder, tok, r: Any) -> list[float]:
    from dpft.data.tasks import load_task

    a = r.ldp.autoencoder
    pub = load_task(TaskCfg(name=a.public_task, max_train_examples=a.public_examples), seed=r.seed)
    texts = list(pub.train["text"])
    batches = []
    for k in range(0, len(texts), a.pretrain_batch_size):
        enc = tok(texts[k:k + a.pretrain_batch_size], truncation=True, max_length=r.model.max_length,
                  padding=True, return_tensors="pt")
        dev = next(split.parameters()).device
        enc = {k: v.to(dev) for k, v in enc.items()}
        h = split.pre(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
        batches.append((h, torch.ones(h.shape[:2], device=h.device)))
    return pretrain_autoencoder(ae, batches, r.ldp.max_norm, epochs=a.pretrain_epochs, lr=a.pretrain_lr,
                                seed=r.seed)


def _error_body(status: int, reason: str) -> bytes:
    return json.dumps({"error": ERROR_WORD.get(status, "error"), "reason": reason}).encode()


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


def make_server(recipe: Any, run_dir: str | Path, port: int = 0, host: str = "127.0.0.1",
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
    if ssl_certfile is None and not is_loopback(host):
        raise LDPError(f"ldp-server: plain HTTP only on a loopback address, not {host!r}; "
                       f"give --ssl-certfile and --ssl-keyfile to serve elsewhere")
    state = LDPServerState(recipe, run_dir, max_batch=max_batch, max_body_bytes=max_body_bytes)
    return LDPServer(state, token if token is not None else secrets.token_urlsafe(32), host, port,
                     ssl_certfile, ssl_keyfile)
