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
replace-one composition of the releases one example made (methods/ewft/method.py ``linked_section``)
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

Files: ``protocol.py`` (what crosses the wire and how it is checked), ``server.py``
(:class:`LDPServerState`, :func:`build_app`, :func:`make_server`), ``client.py`` (:class:`LDPClient`).
"""

from dpft.methods.ewft.split.client import LDPClient
from dpft.methods.ewft.split.protocol import (
                                             ALLOWED,
                                             BODY_MARGIN,
                                             JSON_LIMIT,
                                             MIN_TOKEN_CHARS,
                                             FinishRequest,
                                             PlanRequest,
                                             Refused,
                                             default_max_batch,
                                             encoder_digest,
                                             load_or_create_token,
                                             read_token,
                                             tensor_digest,
                                             write_private,
)
from dpft.methods.ewft.split.server import (
                                             LDPServer,
                                             LDPServerState,
                                             build_app,
                                             make_server,
)

__all__ = ["ALLOWED", "BODY_MARGIN", "JSON_LIMIT", "MIN_TOKEN_CHARS", "FinishRequest", "LDPClient", "LDPServer",
           "LDPServerState", "PlanRequest", "Refused", "build_app", "default_max_batch", "encoder_digest",
           "load_or_create_token", "make_server", "read_token", "tensor_digest", "write_private"]
