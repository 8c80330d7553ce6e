"""dpft's mean-pooling classifier in its standard Hugging Face form, as a file that needs only
``torch`` and ``transformers`` (issue 36 item 5).

A run's ``model/`` folder holds a copy of this file beside ``config.json``, whose ``auto_map``
names its classes (the Hugging Face convention for custom heads), so a person with only
transformers loads the model as trained::

    from transformers import AutoModelForSequenceClassification, pipeline
    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)
    clf = pipeline("text-classification", model=folder, trust_remote_code=True)

With dpft imported the same classes are registered locally (``dpft.models.standard.register``),
so ``trust_remote_code`` is not needed there. Do not import dpft here: the copy in a model folder
must load without it.

Model: encoder + masked mean of the last hidden states (over positions with
``attention_mask == 1``) + dropout + linear head; ``input_ids (B, T)`` → ``logits (B, L)``.

Sentence pairs (config ``pair: siamese``, issue 45): the tokenizer's joint pair encoding
(``[CLS] a [SEP] b [SEP]``, or ``<s> a </s></s> b </s>``) is split back into its two sentences,
each encoded alone (:func:`split_pair`), and the head reads ``[u, v, |u − v|, √H · u ⊙ v]`` of the two
L2-normalised mean embeddings (Reimers & Gurevych 2019, Sentence-BERT §3, the classification
objective that sentence encoders such as all-MiniLM-L6-v2 were trained with): ``(B, 4H)``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

#: ``model_type`` of the mean-pooling classifier in ``config.json``.
MODEL_TYPE = "dpft_mean_pool"

#: How a sentence pair reaches the head: ``joint`` (one encoding of the pair, one mean) or
#: ``siamese`` (each sentence encoded alone, :func:`siamese_features`).
PAIR_MODES = ("joint", "siamese")



def masked_mean(h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, T, H)`` hidden states → ``(B, H)``: the mean over positions with ``attention_mask == 1``
    (all positions without a mask), so padding never enters an example's representation."""
    if attention_mask is None:
        return h.mean(dim=1)
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def split_pair(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0):
    """A batch of joint pair encodings → the two sentences as if each were tokenized alone.

    Row ``[CLS] a… [SEP] b… [SEP]`` (BERT) or ``<s> a… </s></s> b… </s>`` (RoBERTa, MPNet): the
    separator is the row's last real token; the first sentence runs to its first occurrence, the
    second starts after it (and after a doubled separator), re-prefixed with the row's first token.
    Positions that are not the sentence hold ``pad_id`` with mask 0, so position ids (BERT: by
    index; RoBERTa: by non-pad count) are those of the sentence alone.

    Args:
        input_ids, attention_mask: ``(B, T)``, right-padded.
    Returns:
        ``(ids_a, mask_a, ids_b, mask_b)``, each ``(B, T)``.
    Raises:
        ValueError: a row holds one sentence (no second segment): this head classifies pairs.
    """
    B, T = input_ids.shape
    mask = attention_mask.to(torch.long)
    pos = torch.arange(T, device=input_ids.device).expand(B, T)
    last = (mask.sum(1) - 1).clamp_min(0)
    sep = input_ids.gather(1, last[:, None])                       # (B, 1): the row's separator id
    is_sep = (input_ids == sep) & (mask > 0)
    s1 = torch.where(is_sep, pos, T).min(1).values                # first separator: end of a
    nxt = input_ids.gather(1, (s1 + 1).clamp(max=T - 1)[:, None])[:, 0]
    b0 = s1 + 1 + (nxt == sep[:, 0]).long() * (s1 + 1 < last).long()  # skip a doubled separator
    if bool((b0 >= last).any()):
        raise ValueError("pair: siamese classifies sentence pairs, but a row holds one sentence; give text and "
                         "text_pair (task.text_pair_column), or use a model saved with pair: joint")
    keep_a = (pos <= s1[:, None]) & (mask > 0)
    ids_a = torch.where(keep_a, input_ids, torch.full_like(input_ids, pad_id))
    src = b0[:, None] - 1 + pos                                   # column j of b reads column b0-1+j
    ok = (src < T) & mask.gather(1, src.clamp(max=T - 1)).bool()
    ids_b = torch.where(ok, input_ids.gather(1, src.clamp(max=T - 1)), torch.full_like(input_ids, pad_id))
    ids_b[:, 0] = input_ids[:, 0]
    ok[:, 0] = True
    return ids_a, keep_a.to(attention_mask.dtype), ids_b, ok.to(attention_mask.dtype)


def siamese_features(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, H)`` mean embeddings of the two sentences → ``(B, 4H)`` ``[u, v, |u − v|, √H · u ⊙ v]``
    of their L2-normalised forms (Sentence-BERT's classification features, Reimers & Gurevych 2019
    §3; normalised as the sentence encoders' own output).

    The product block is scaled by √H: a unit vector's entries are about 1/√H, so ``u ⊙ v``'s are
    about 1/H and its block's norm about 1/√H (0.07 for MiniLM) against about 1 for each other block.
    A DP head has one clipping norm and one noise scale for every coordinate, so unscaled it learns
    almost nothing from the block whose sum is the two texts' cosine; scaled, its norm is about 1
    like the others (QNLI, 4,000 rows: +4 to +7 points at ε = 1 to 8 in the probe,
    benchmarks/results/scope_evidence.md). √H depends on the architecture only: public."""
    u = nn.functional.normalize(u, dim=-1)
    v = nn.functional.normalize(v, dim=-1)
    return torch.cat([u, v, (u - v).abs(), u * v * u.shape[-1] ** 0.5], dim=-1)


def pair_width(pair: str) -> int:
    """Head input width in units of the hidden size H: 1 (``joint``) or 4 (``siamese``)."""
    if pair not in PAIR_MODES:
        raise ValueError(f"pair must be one of {PAIR_MODES}, got {pair!r}")
    return 4 if pair == "siamese" else 1


def pooled_features(encoder: nn.Module, pair: str, input_ids=None, attention_mask=None, **kw) -> torch.Tensor:
    """What the head reads: ``(B, H)`` masked mean of ``encoder``'s last hidden states
    (``joint``), or ``(B, 4H)`` :func:`siamese_features` of the two sentences, encoded alone in
    one ``(2B, T)`` batch (``siamese``: ``token_type_ids`` dropped, each sentence is segment 0;
    positions outside a sentence hold the encoder config's ``pad_token_id``, 0 when unset)."""
    if pair == "siamese" and input_ids is None:
        raise ValueError("pair: siamese splits the token ids of each pair: give input_ids, not inputs_embeds")
    if pair == "joint":
        return masked_mean(encoder(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state,
                           attention_mask)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    ids_a, mask_a, ids_b, mask_b = split_pair(input_ids, attention_mask,
                                              getattr(encoder.config, "pad_token_id", None) or 0)
    ids, mask = torch.cat([ids_a, ids_b]), torch.cat([mask_a, mask_b])
    h = masked_mean(encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    return siamese_features(*h.split(input_ids.shape[0]))


class DpftMeanPoolConfig(PretrainedConfig):
    """Config of :class:`DpftMeanPoolForSequenceClassification`.

    Keys (besides the usual ``id2label`` / ``label2id``): ``encoder`` (dict: the encoder's own
    config, with its ``model_type``), ``head_dropout`` (float, dropout before the linear head),
    ``pair`` (``joint`` when absent, or ``siamese``: :data:`PAIR_MODES`).
    No custom ``__init__``: extra keys become attributes in transformers 4 and 5 alike.
    """

    model_type = MODEL_TYPE

    def encoder_config(self) -> PretrainedConfig:
        enc = dict(getattr(self, "encoder", None) or {})
        if "model_type" not in enc:
            raise ValueError(f"{MODEL_TYPE} config has no encoder.model_type; was it written by dpft?")
        return AutoConfig.for_model(enc.pop("model_type"), **enc)


def _encoder_from_config(cfg: PretrainedConfig) -> nn.Module:
    try:  # BERT-likes: no [CLS] pooler (unused by the mean-pooled head, as in training)
        return AutoModel.from_config(cfg, add_pooling_layer=False)
    except TypeError:
        return AutoModel.from_config(cfg)


class DpftMeanPoolForSequenceClassification(PreTrainedModel):
    """Encoder + masked mean of the last hidden states + dropout + linear head.

    The same computation as :class:`dpft.models.load.MeanPoolClassifier` (the module dpft trains):
    ``forward(input_ids (B,T), attention_mask (B,T), ...)`` → ``logits (B, L)``; the mean runs
    over positions with ``attention_mask == 1``. With ``labels (B,)`` the output carries the
    cross-entropy ``loss`` (mean over the batch).
    """

    config_class = DpftMeanPoolConfig
    base_model_prefix = "dpft_mean_pool"  # not "encoder": the encoder is a part, not the base model
    _no_split_modules: list[str] = []

    def __init__(self, config: DpftMeanPoolConfig):
        super().__init__(config)
        enc_cfg = config.encoder_config()
        self.encoder = _encoder_from_config(enc_cfg)
        self.dropout = nn.Dropout(float(getattr(config, "head_dropout", 0.0) or 0.0))
        self.pair = str(getattr(config, "pair", None) or "joint")
        self.classifier = nn.Linear(enc_cfg.hidden_size * pair_width(self.pair), config.num_labels)
        self.post_init()

    def _init_weights(self, module):  # only a fresh head is ever initialised here
        if isinstance(module, nn.Linear) and module is getattr(self, "classifier", None):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.encoder.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.encoder.set_input_embeddings(value)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, return_dict=None, **_ignored):
        kw = {k: v for k, v in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                                ("position_ids", position_ids), ("inputs_embeds", inputs_embeds)) if v is not None}
        pooled = pooled_features(self.encoder, self.pair, input_ids, **kw)  # (B, H) or (B, 4H)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float(), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    @classmethod
    def from_encoder(cls, name_or_path: str, labels: Sequence[str], head_dropout: float = 0.0,
                     pair: str = "joint", **kwargs) -> "DpftMeanPoolForSequenceClassification":
        """A pre-trained encoder (folder or hub id) with a fresh head for ``labels`` — the base a
        mean-pooling LoRA adapter is applied to."""
        from transformers.utils import logging as hf_logging

        enc_cfg = AutoConfig.from_pretrained(name_or_path)
        model = cls(_config(enc_cfg, labels, head_dropout, pair))
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the unused [CLS] pooler's weights are expected to be skipped
        try:
            try:
                enc = AutoModel.from_pretrained(name_or_path, add_pooling_layer=False, **kwargs)
            except TypeError:
                enc = AutoModel.from_pretrained(name_or_path, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        model.encoder.load_state_dict(enc.state_dict())
        return model


def _config(enc_cfg: PretrainedConfig, labels: Sequence[str], head_dropout: float,
            pair: str = "joint") -> DpftMeanPoolConfig:
    enc = enc_cfg.to_dict()
    for k in ("id2label", "label2id", "architectures", "_name_or_path", "transformers_version"):
        enc.pop(k, None)
    pair_width(pair)
    return DpftMeanPoolConfig(encoder=enc, head_dropout=float(head_dropout), pair=pair, **label_maps(labels),
                              architectures=[DpftMeanPoolForSequenceClassification.__name__])


def label_maps(labels: Sequence[str]) -> dict[str, dict]:
    """``{"id2label": {0: name, …}, "label2id": {name: 0, …}}`` for config.json."""
    names = [str(x) for x in labels]
    return {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}


# save_pretrained copies this file into the model folder and writes ``auto_map`` in config.json
# (transformers' custom_object_save), so that the folder loads without dpft.
DpftMeanPoolConfig.register_for_auto_class()
DpftMeanPoolForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
