"""Forward-pass local DP: clip a hidden matrix to Frobenius norm C and add Gaussian noise.

Sources: EW-FT (Zhang et al., Sci. China Inf. Sci. 2026, Section 5.3, Eq. (11)) and
DP-Forward (Du et al., CCS 2023). The user runs pre(·) locally; per example the (T × h)
hidden matrix — or the (T × k) code of a stacked autoencoder's encoder — is clipped to
Frobenius norm C (Eq. 11) and perturbed with N(0, σ_e² (2C)² I); only that noisy matrix leaves
the device. post(·) (autoencoder decoder, remaining blocks, head) is trained on it.

Sensitivity. Any two clipped matrices differ by at most 2C in Frobenius norm (replace one
user's input by any other), so the noise std σ_e·2C makes one release the Gaussian mechanism
with noise multiplier σ_e relative to its sensitivity. (DP-Forward's code hard-codes the
sensitivity to 1 whatever C is; not copied.)

Two guarantees, stated separately (see :func:`local_epsilon` and the training stream's ledger):

* local (per release): for *any* two inputs x, x′, one noisy matrix is (ε_loc, δ)-DP with
  ε_loc from the analytic Gaussian mechanism (Balle & Wang 2018), computed by
  ``dp_accounting.gaussian_mechanism.get_epsilon_gaussian``; k releases of the same example
  compose (PLD, replace-one, :func:`local_epsilon_composed`).
* example-level (training stream): the Poisson-sampled stream of releases, accounted as the
  paper does (``accounting/ewpba.py``, recorded per step in the run's ledger).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from dp_accounting.gaussian_mechanism import get_epsilon_gaussian
from torch import nn
from dpft.privacy.randomness import Randomness


class LDPError(ValueError):
    """A forward-LDP configuration that cannot work; the message names the fix."""


def clip_frobenius(x: torch.Tensor, max_norm: float, normalize: bool = False) -> torch.Tensor:
    """Per-example Frobenius clipping (EW-FT Eq. 11).

    Args:
        x: ``(B, T, d)`` (or ``(B, d)``) hidden matrices; example i is ``x[i]``.
        max_norm: C > 0.
        normalize: scale every example to norm exactly C instead of clipping (Eq. 11's
            "‖pre(·)‖_F = C" option).

    Returns:
        Same shape; each ``x[i]`` has Frobenius norm ≤ C (= C with ``normalize``).
    """
    if not max_norm > 0:
        raise LDPError(f"clipping norm C must be > 0, got {max_norm}")
    flat = x.reshape(x.shape[0], -1)
    norms = flat.norm(dim=1).clamp_min(1e-12)
    scale = max_norm / norms if normalize else torch.clamp(max_norm / norms, max=1.0)
    return x * scale.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def local_epsilon(sigma: float, delta: float) -> float:
    """ε of one release at noise multiplier σ (std σ·2C, sensitivity 2C), any two inputs.

    Analytic Gaussian mechanism (Balle & Wang 2018, via dp_accounting).
    """
    if sigma <= 0:
        return math.inf
    return float(get_epsilon_gaussian(sigma, delta))


def local_epsilon_composed(sigmas: Sequence[float], delta: float) -> float:
    """ε of several releases of the same example at σ's ``sigmas`` (any two inputs).

    Release j moves by at most 2C (any two inputs) under noise of std 2Cσ_j: a Gaussian
    mechanism with distance/std ratio 1/σ_j. Adaptive composition of Gaussian mechanisms is
    *exactly* one Gaussian mechanism with ratio μ = (Σ_j σ_j⁻²)^½ (Dong, Roth & Su 2019, GDP
    Cor. 2), so the ε is the analytic Gaussian mechanism's at σ = 1/μ (:func:`local_epsilon`,
    Balle & Wang 2018) — the same value dp_accounting's replace-one PLD accountant gives up to
    its pessimistic discretisation (``tests/test_ldp.py``), without the PLD's arrays, which for a
    tiny σ run to minutes.
    """
    sigmas = [float(s) for s in sigmas if s is not None]
    if not sigmas:
        return 0.0
    if min(sigmas) <= 0:
        return math.inf
    return local_epsilon(sum(s ** -2 for s in sigmas) ** -0.5, delta)


class StackedAutoencoder(nn.Module):
    """Token-wise stacked autoencoder ``sizes[0] → … → sizes[-1] → … → sizes[0]``.

    ``sizes = [384, 64]`` is one linear layer each way (the paper's 768×64 for BERT-base);
    ``[384, 256, 64]`` stacks two with GELU between. Input/output ``(B, T, sizes[0])``; code
    ``(B, T, sizes[-1])``.
    """

    def __init__(self, sizes: Sequence[int]):
        super().__init__()
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2 or min(sizes) < 1:
            raise LDPError(f"autoencoder sizes need ≥ 2 positive widths (e.g. [384, 64]), got {sizes}")
        self.sizes = sizes

        def stack(dims):
            layers: list[nn.Module] = []
            for i in range(len(dims) - 1):
                layers.append(nn.Linear(dims[i], dims[i + 1]))
                if i < len(dims) - 2:
                    layers.append(nn.GELU())
            return nn.Sequential(*layers)

        self.encoder = stack(sizes)
        self.decoder = stack(sizes[::-1])

    def encode(self, h: torch.Tensor) -> torch.Tensor:
        return self.encoder(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


class GaussianLDP(nn.Module):
    """The noise perturbation layer: [encoder] → clip to C → + N(0, σ²(2C)²) → [decoder].

    ``release(h)`` is the user's side (what crosses the wire); ``reconstruct(z)`` the
    server's. ``forward = reconstruct ∘ release``. σ is set per epoch by the schedule
    (``set_sigma``); in eval mode noise is added only if ``eval_noise``.

    Args:
        max_norm: C (Frobenius, per example).
        sigma: noise multiplier relative to the sensitivity 2C.
        autoencoder: optional :class:`StackedAutoencoder` (its encoder runs on the user side).
        normalize: scale to ‖·‖_F = C instead of clipping.
        generator: the :class:`~dpft.privacy.randomness.SecretStream` of the noise (the run's
            ``rng.stream("ldp", step)``); None = a fresh secret source's stream. Every
            release is the stream's next draw (≥ 128 bits of secret entropy, see
            privacy/randomness.py).

    Raises:
        LDPError: C ≤ 0 or a bad ``std_factor``.
        TypeError: ``generator`` is a plain ``torch.Generator`` (its CPU seed has 32 bits: a
            seed search recovers the clean codes); pass ``Randomness().stream("ldp")``.
    """

    def __init__(self, max_norm: float = 1.0, sigma: float = 0.0, autoencoder: Optional[StackedAutoencoder] = None,
                 normalize: bool = False, eval_noise: bool = True, generator=None,
                 std_factor: float = 2.0, detach: bool = True):
        super().__init__()
        if not max_norm > 0:
            raise LDPError(f"ldp.max_norm (C) must be > 0, got {max_norm}")
        if std_factor not in (1.0, 2.0):
            raise LDPError(f"std_factor must be 2 (certified: replace-one sensitivity 2C) or 1 (the "
                           f"NOT CERTIFIED DP-Forward code reproduction), got {std_factor}")
        self.max_norm = float(max_norm)
        self.sigma = float(sigma)
        self.autoencoder = autoencoder
        self.normalize = normalize
        self.eval_noise = eval_noise
        self.generator = generator
        #: 2 = certified (std σ·2C). 1 = DP-Forward's code (std σ·C: sensitivity hard-coded to 1).
        self.std_factor = float(std_factor)
        #: True = certified (nothing flows back into the user's side). False = DP-Forward's code:
        #: the layers before the noise are trained *through* the noise, non-privately.
        self.detach = bool(detach)

    @property
    def generator(self):
        """The noise's :class:`~dpft.privacy.randomness.SecretStream` (None: made on first use)."""
        return self._generator

    @generator.setter
    def generator(self, stream) -> None:
        if isinstance(stream, torch.Generator):
            raise TypeError("GaussianLDP needs a dpft SecretStream, not a torch.Generator (a CPU generator keeps "
                            "32 bits of its seed, so a seed search recovers the clean codes): pass "
                            "dpft.privacy.randomness.Randomness().stream('ldp')")
        self._generator = stream

    def __getstate__(self):
        # A copy or pickle of the layer (deepcopy, torch.save) never carries the noise's secret
        # stream: the copy draws from a fresh secret source unless given one.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_generator": None}

    @property
    def sensitivity(self) -> float:
        """Replace-one L2 (Frobenius) sensitivity of the clipped matrix: 2C (the std unit of the
        noise; C in the NOT CERTIFIED ``std_factor = 1`` reproduction)."""
        return self.std_factor * self.max_norm

    def set_sigma(self, sigma: float) -> None:
        if sigma < 0:
            raise LDPError(f"σ must be ≥ 0, got {sigma}")
        self.sigma = float(sigma)

    @torch.no_grad()
    def noise_like(self, z: torch.Tensor) -> torch.Tensor:
        std = self.sigma * self.sensitivity  # σ_e · 2C: replace-one sensitivity, see module doc
        if self.generator is None:
            self.generator = Randomness().stream("ldp")  # secret, never the global torch generator
        n = self.generator.normal(z.shape, dtype=torch.float32, device=z.device)
        return (n * std).to(z.dtype)

    def release(self, h: torch.Tensor) -> torch.Tensor:
        """User side: ``(B, T, d)`` hidden matrices → ``(B, T, k)`` noisy (clipped) codes.

        The output is detached: nothing computed from the clean input flows back (with
        ``detach=False``, the NOT CERTIFIED reproduction, gradients flow through the noise into
        the encoder and whatever computed ``h``).
        """
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.detach):
            z = self.autoencoder.encode(h) if self.autoencoder is not None else h
            z = clip_frobenius(z, self.max_norm, self.normalize)
            if self.training or self.eval_noise:
                z = z + self.noise_like(z)
        return z.detach() if self.detach else z

    def reconstruct(self, z: torch.Tensor) -> torch.Tensor:
        """Server side: noisy code → hidden matrix for post(·) (decoder, trainable)."""
        return self.autoencoder.decode(z) if self.autoencoder is not None else z

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.reconstruct(self.release(h))


def pretrain_autoencoder(ae: StackedAutoencoder, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         max_norm: float, epochs: int = 1, lr: float = 1e-3, sigma: float = 0.0,
                         seed: int = 0) -> list[float]:
    """Reconstruction pre-training on *public* hidden states (EW-FT Section 5.3).

    Each batch is ``(h, mask)``: ``h`` ``(B, T, d)`` hidden states of public text from pre(·),
    ``mask`` ``(B, T)`` 1 on real tokens. Loss: mean squared error between ``h`` and
    decode(clip_C(encode(h)) [+ N(0, σ²(2C)²)]) on real tokens, relative to the per-example
    clip scale (the decoder learns to undo the clipping's scale too). Returns the loss per
    epoch (mean over batches). Uses no private data: pass public text only.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(ae.parameters(), lr=lr)
    batches = list(batches)
    if not batches:
        raise LDPError("autoencoder pre-training got no public batches; give ldp.autoencoder.public_task data")
    hist = []
    ae.train()
    for _ in range(epochs):
        tot = 0.0
        for h, mask in batches:
            z = clip_frobenius(ae.encode(h), max_norm)
            if sigma > 0:
                # public data: a seeded CPU draw (not a release), moved to the codes' device
                z = z + (torch.randn(z.shape, generator=gen) * sigma * 2 * max_norm).to(z.device, z.dtype)
            rec = ae.decode(z)
            m = mask.unsqueeze(-1).to(h.dtype)
            loss = (((rec - h) ** 2) * m).sum() / (m.sum() * h.shape[-1]).clamp_min(1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += float(loss.detach())
        hist.append(tot / len(batches))
    return hist


# ---------------------------------------------------------------------------- split model
class SplitClassifier(nn.Module):
    """A BERT-family sequence classifier cut at a noise layer: pre(·) → LDP → post(·) → head.

    Positions (``position``): ``embeddings`` (after the embedding layer), ``encoder:l`` (after
    block l, 1-based), ``output`` (after the last block, before pooler/classifier).

    pre(·) and the autoencoder encoder are frozen (the user's side; trained only on public
    data); post(·), decoder, pooler and classifier train. Inputs are padded to the fixed
    length ``max_length`` so the release is always ``(T = max_length) × k``.

    Args:
        pass_mask: give post(·) the attention mask of the padded input (``ldp.mask_after_noise``).
            The mask is a function of the token count only; it is *not* noised, so with it the
            token count of each example is released in the clear and the guarantee covers the
            text of inputs of equal token count. False: post(·) attends to every position and
            nothing but the noisy matrix leaves the user (the split deployment's choice).
        release_cls: at ``output``, release only the [CLS] row of the last block, ``(B, 1, h)``
            (DP-Forward noises the pooled [CLS] vector there); the pooler trains on the server.
        pooled_release: NOT CERTIFIED reproduction of DP-Forward's code at ``output``: the
            pooler runs on the user side and its ``(B, 1, h)`` output is released.
        train_pre: NOT CERTIFIED reproduction: pre(·) (and the encoder) stay trainable, run
            with dropout in train mode and get gradients through the noise (with a
            ``noise.detach = False`` layer); the cache of pre(·) is refused.

    ``forward(input_ids, attention_mask, token_type_ids)`` → object with ``.logits`` ``(B, labels)``.
    """

    def __init__(self, model: nn.Module, position: str, noise: GaussianLDP, max_length: int,
                 pass_mask: bool = False, release_cls: bool = False, pooled_release: bool = False,
                 train_pre: bool = False):
        super().__init__()
        base = getattr(model, "bert", None)
        if base is None or not hasattr(model, "classifier"):
            raise LDPError(f"forward LDP supports BERT-family sequence classifiers (e.g. minilm); got "
                           f"{type(model).__name__}")
        self.model = model
        self.noise = noise
        self.max_length = int(max_length)
        blocks = base.encoder.layer
        self.cut = parse_position(position, len(blocks))
        self.position = position
        self.pad_id = model.config.pad_token_id or 0
        self.pass_mask = bool(pass_mask)
        at_output = self.cut == len(blocks)
        if (release_cls or pooled_release) and not at_output:
            raise LDPError("releasing the [CLS] / pooled vector needs ldp.position: output")
        if pooled_release and base.pooler is None:
            raise LDPError("pooled_release needs a model with a pooler")
        self.release_cls = bool(release_cls or pooled_release)
        self.pooled_release = bool(pooled_release)
        self.train_pre = bool(train_pre)
        if self.train_pre and noise.detach:
            raise LDPError("train_pre (reproduction) needs a noise layer with detach=False")
        #: Per-example cache of pre(·) outputs (pre(·) is frozen and deterministic and every
        #: example is padded to max_length on its own, so a row depends only on its tokens).
        #: A speed-up only: the noise is drawn fresh at every release. None = off.
        self.pre_cache: Optional[dict] = None
        if not self.train_pre:
            for p in base.embeddings.parameters():
                p.requires_grad_(False)
            for blk in list(blocks)[: self.cut]:
                for p in blk.parameters():
                    p.requires_grad_(False)
            if self.pooled_release:
                for p in base.pooler.parameters():
                    p.requires_grad_(False)
            if noise.autoencoder is not None:
                for p in noise.autoencoder.encoder.parameters():
                    p.requires_grad_(False)

    # -- user side
    def _pad(self, input_ids, attention_mask, token_type_ids):
        b, t = input_ids.shape
        if t > self.max_length:
            raise LDPError(f"inputs of length {t} exceed model.max_length = {self.max_length}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if t < self.max_length:
            extra = self.max_length - t
            input_ids = torch.cat([input_ids, input_ids.new_full((b, extra), self.pad_id)], 1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], 1)
            token_type_ids = torch.cat([token_type_ids, token_type_ids.new_zeros((b, extra))], 1)
        return input_ids, attention_mask, token_type_ids

    def pre(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        """pre(·): ``(B, T')`` token ids → ``(B, max_length, h)`` clean hidden states (user side;
        ``(B, 1, h)`` with ``release_cls``). No gradient unless ``train_pre`` (reproduction)."""
        if self.train_pre:
            if self.pre_cache is not None:
                raise LDPError("train_pre: pre(·) changes during training, its cache must be off")
            return self._pre(input_ids, attention_mask, token_type_ids)
        with torch.no_grad():
            if self.pre_cache is None:
                return self._pre(input_ids, attention_mask, token_type_ids)
            ids, mask, tt = self._pad(input_ids, attention_mask, token_type_ids)
            keys = [(r.tolist(), m.tolist(), t.tolist()) for r, m, t in zip(ids, mask, tt)]
            keys = [repr(k) for k in keys]
            miss = [i for i, k in enumerate(keys) if k not in self.pre_cache]
            if miss:
                h = self._pre(ids[miss], mask[miss], tt[miss])
                for j, i in enumerate(miss):
                    self.pre_cache[keys[i]] = h[j].clone()
            return torch.stack([self.pre_cache[k] for k in keys])

    def _pre(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        base = self.model.bert
        was = base.training
        if not self.train_pre:
            base.eval()  # the user's frozen part: deterministic (no dropout)
        try:
            ids, mask, tt = self._pad(input_ids, attention_mask, token_type_ids)
            h = base.embeddings(input_ids=ids, token_type_ids=tt)
            if self.cut:
                m = create_bidirectional_mask(config=base.config, inputs_embeds=h, attention_mask=mask)
                for blk in base.encoder.layer[: self.cut]:
                    h = blk(h, attention_mask=m)
                    h = h[0] if isinstance(h, tuple) else h
            if self.pooled_release:
                h = base.pooler(h).unsqueeze(1)  # DP-Forward's code: the pooled [CLS] vector
            elif self.release_cls:
                h = h[:, :1]  # the [CLS] row: all the head reads at `output`
        finally:
            base.train(was)
        return h

    def release(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        """Everything the user sends: the noisy (clipped, encoded) ``(B, max_length, k)`` matrix
        (``(B, 1, k)`` with ``release_cls``)."""
        return self.noise.release(self.pre(input_ids, attention_mask, token_type_ids))

    def padded_mask(self, input_ids, attention_mask=None) -> torch.Tensor:
        """``(B, max_length)`` attention mask of the padded input (a function of the token count)."""
        return self._pad(input_ids, attention_mask, None)[1]

    # -- server side
    def post(self, z: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """post(·) and the head: noisy code ``(B, T, k)`` → logits ``(B, labels)``.

        ``mask`` ``(B, T)``: attention mask for the blocks after the noise (None = attend to
        every position)."""
        base = self.model.bert
        h = self.noise.reconstruct(z)
        if self.pooled_release:
            return self.model.classifier(self.model.dropout(h[:, 0]))
        m = None
        if mask is not None and self.cut < len(base.encoder.layer):
            from transformers.masking_utils import create_bidirectional_mask

            m = create_bidirectional_mask(config=base.config, inputs_embeds=h, attention_mask=mask)
        for blk in base.encoder.layer[self.cut:]:
            h = blk(h, attention_mask=m)
            h = h[0] if isinstance(h, tuple) else h
        pooled = base.pooler(h) if base.pooler is not None else h[:, 0]
        return self.model.classifier(self.model.dropout(pooled))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_):
        from transformers.modeling_outputs import SequenceClassifierOutput

        z = self.release(input_ids, attention_mask, token_type_ids)
        mask = self.padded_mask(input_ids, attention_mask) if self.pass_mask else None
        return SequenceClassifierOutput(logits=self.post(z, mask))

    def save_pretrained(self, out) -> None:
        """The inner model (``save_pretrained``) and the autoencoder (``autoencoder.safetensors``)."""
        from pathlib import Path

        from safetensors.torch import save_file

        self.model.save_pretrained(out)
        if self.noise.autoencoder is not None:
            save_file({k: v.contiguous() for k, v in self.noise.autoencoder.state_dict().items()},
                      str(Path(out) / "autoencoder.safetensors"))


def parse_position(position: str, n_blocks: int) -> int:
    """``embeddings`` → 0, ``encoder:l`` → l (1 ≤ l ≤ L), ``output`` → L: blocks in pre(·)."""
    if position == "embeddings":
        return 0
    if position == "output":
        return n_blocks
    if position.startswith("encoder:"):
        try:
            k = int(position.split(":", 1)[1])
        except ValueError:
            k = -1
        if 1 <= k <= n_blocks:
            return k
    raise LDPError(f"ldp.position {position!r} not understood; use 'embeddings', 'encoder:l' with "
                   f"1 ≤ l ≤ {n_blocks}, or 'output'")
