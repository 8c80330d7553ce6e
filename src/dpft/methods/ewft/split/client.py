"""``dpft ldp-client``: the data holder's side of the split deployment — pre(·), encoder, clip
and noise; holds the ledger and writes the privacy report (see :mod:`dpft.methods.ewft.split`)."""

import json
import re
import ssl
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dpft.methods.ewft.split.protocol import (
    BODY_MARGIN,
    MIN_TOKEN_CHARS,
    encoder_digest,
    is_loopback,
    write_private,
)
from dpft.privacy.ldp import GaussianLDP, LDPError, SplitClassifier, StackedAutoencoder, clip_frobenius, local_epsilon
from dpft.privacy.randomness import Randomness, SecretStream
from dpft.accounting.calibrate import check_delta
from dpft.accounting.ewpba import NoiseSchedule, make_schedule, schedule_epsilon
from dpft.accounting.ledger import PrivacyLedger
from dpft.methods.ewft.method import STREAM_STATEMENT, label_section, linked_section, max_releases_per_epoch, privatize_labels
from dpft.placement.device import resolve_device
from dpft.step.sample import PoissonSampler

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

    def __init__(self, recipe: Any, server: str, run_dir: str | Path, token: str, keep_wire: bool = False,
                 ca_file: Optional[str] = None, encoder_sha256: Optional[str] = None):
        import math as _m

        import httpx

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
        if u.scheme == "http" and not is_loopback(u.hostname):
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
        if c.noise_multiplier is not None:  # a fixed σ, as methods/ewft/method.py's LDPRun

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
            self.train_tok, self.noisy_labels = privatize_labels(self.train_tok, c.label_epsilon,
                                                                 self.task.num_labels, self.rng.stream("label_rr"))
        self.split = SplitClassifier(model, c.position, self.layer, r.model.max_length)

        # pre(·), the encoder, the clipping and the noise run on the client's perf.device; the
        # noisy codes are copied to the host only to be sent.
        self.device = resolve_device(r.perf.device)
        self.split.to(self.device)

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
        z = z.float().cpu().contiguous()
        if not bool(torch.isfinite(z).all()):
            raise LDPError(f"ldp-client: refusing to send a non-finite code to {path}")
        t = {"z": z}
        if labels is not None:
            t["labels"] = labels.long().cpu().contiguous()
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

        b = collate(list(rows), self.pad_id, self.with_tt, device=self.device)
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
