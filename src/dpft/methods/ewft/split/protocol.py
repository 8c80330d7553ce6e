"""The split deployment's wire protocol, shared by server and client: tensor names and body
limits, the bearer token file, digests of tensors and encoder weights, the request models, the
call order and the refusal format (see :mod:`dpft.methods.ewft.split`)."""

import hashlib
import ipaddress
import math
import os
import secrets
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from dpft.privacy.ldp import LDPError

#: Tensor names a client may send; anything else is refused by the server.
ALLOWED = {"z", "labels"}
#: Largest JSON body (bytes) the server reads (``/plan``, ``/finish``, anything before the plan).
JSON_LIMIT = 64 * 1024
#: Extra bytes allowed over ``max_batch × T × k × 4 + max_batch × 8`` (safetensors header).
BODY_MARGIN = 64 * 1024
#: Shortest token the server accepts from a ``--token-file``.
MIN_TOKEN_CHARS = 32


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


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Refused(Exception):
    """A request the server refuses: HTTP ``status`` and a fixed ``reason`` code (never text
    derived from an exception)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


#: The short ``error`` word of each refusal status; the reply is ``{"error", "reason"}``.
ERROR_WORD = {400: "bad request", 401: "unauthorized", 404: "not found", 405: "method not allowed",
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
CALL_ORDER = {
    "plan": ({"new"}, "planned"),
    "encoder": ({"planned", "encoder"}, "encoder"),
    "step": ({"encoder", "step"}, "step"),
    "eval": ({"encoder", "step", "eval"}, "eval"),
    "finish": ({"planned", "encoder", "step", "eval"}, "finished"),
}
