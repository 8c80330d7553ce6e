"""The ``instruct`` task: prompt/completion and chat data for causal-LM fine-tuning, with the
loss on the completion (assistant) tokens only.

Input: a CSV/TSV/JSONL/Parquet file (read through ``datasets``) with either

- a ``messages`` column (``task.messages_column``): a list of ``{"role", "content"}`` dicts,
  roles ``system``/``user``/``assistant`` (others are rendered like ``user``); in CSV/TSV the
  cell holds that list as JSON text. Every assistant message is a target; or
- ``prompt`` and ``completion`` columns (``task.prompt_column``, ``task.completion_column``);
  a row is the conversation ``[user: prompt, assistant: completion]``.

Rendering (``task.template``):

- ``chat`` (``auto`` when the tokenizer has a chat template): the tokenizer's own
  ``apply_chat_template``. Assistant turn j covers the characters between the rendering of
  ``messages[:j]`` with the generation prompt and the rendering of ``messages[:j+1]`` (so the
  end-of-turn marker of the template is a target: the model learns to stop).
- ``simple`` (``auto`` without a chat template), documented here because it is ours:
  prompt/completion rows render as ``BOS + prompt + separator | completion + EOS``
  (``task.separator``, default a newline); chat rows render each message as
  ``Role: content\\n`` except that an assistant message is ``Assistant: | content + EOS\\n``.
  ``|`` marks where the targets start; BOS/EOS are the tokenizer's (left out when it has none).

The whole text is tokenised once (``add_special_tokens=False``); a token is a target when its
character span (offset mapping of a fast tokenizer) overlaps an assistant span. Labels follow
the Hugging Face convention: ``labels[i] = input_ids[i]`` for targets, ``-100`` elsewhere (the
prompt, other roles, and padding, which collation adds); the loss (models/losses.py) shifts
them by one. One row is one example — **the privacy unit is one row** (one prompt/completion
pair or one conversation); rows are never packed together (packing would mix privacy units).
Columns other than the ones read are kept on every tokenised row (e.g. a user id column for
user-level privacy); a kept column may not have a reserved name (``input_ids``, ``labels``,
``label``, ``attention_mask``, ``position_ids``, ``token_type_ids``), while a column that is
read (the prompt or completion, e.g. a completion column called ``label``) may.

Truncation: a row longer than ``model.max_length`` tokens loses tokens from the **left** (the
start of the prompt or earlier turns) so that the last assistant turn keeps at least one
prompt token before it; if the last assistant turn alone is still too long, it is cut on the
right instead. The dev counts go in the report's notes; the training count is a statistic of
the private data: it is returned in ``truncated`` for the data holder and never written to the
release set (DESIGN.md "The release set"; run/loop.py prints it to the terminal only).

Dev generation: dev rows are grouped by their prompt tokens (everything before the last
assistant turn, cut from the left to ``max_length - 1`` tokens); each group is one prompt with all its references
(multi-reference scoring, as E2E in Li et al. 2022, "Large language models can be strong
differentially private learners"), in order of first appearance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import datasets

from dpft.config.recipe import TaskCfg
from dpft.data.stop import learned_stop_ids
from dpft.data.tasks import DataError, _load_file

#: Column names the trainer uses itself; a data column with one of these names is refused.
RESERVED_COLUMNS = ("input_ids", "labels", "label", "attention_mask", "position_ids", "token_type_ids")
#: Label value of a position that is not a target (ignored by the loss).
IGNORE = -100


@dataclass
class InstructData:
    """A tokenised instruction/chat dataset. ``train``/``dev`` rows carry ``input_ids`` and
    ``labels`` (lists of equal length) and every extra column of the file."""

    name: str
    train: datasets.Dataset
    dev: datasets.Dataset
    source: str
    template: str
    block_size: int
    #: Dev prompts for generation: ``[{"prompt_ids", "prompt", "references"}]`` (multi-reference).
    groups: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    label_names: list[str] = field(default_factory=list)
    #: ``{"max_length", "train", "dev"}`` examples truncated per split; ``train`` is private.
    truncated: Optional[dict] = None
    #: One row = one example (never packed).
    unit: str = "example"
    #: Token ids the completions end with (EOS, a chat template's end of turn): generation stops
    #: there (data/stop.py; issue 36 item 9).
    stop_ids: list[int] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        return 0


# ---------------------------------------------------------------------------- reading
def _messages_of(value: Any, row: int) -> list[dict[str, str]]:
    """A row's messages as ``[{"role", "content"}]``; JSON text is parsed (CSV cells).

    Raises:
        DataError: not a list of {role, content} with at least one non-empty assistant message.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"row {row}: the messages cell is not JSON; give a list of "
                            '{"role": ..., "content": ...} objects') from None
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"row {row}: messages must be a non-empty list of {{role, content}} objects, got "
                        f"{'an empty list' if isinstance(value, (list, tuple)) else 'a ' + type(value).__name__}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            got = (f"an object with keys {sorted(map(str, m))[:6]}" if isinstance(m, dict)
                   else f"a {type(m).__name__}")  # its structure only: the cell's text is a training row
            raise DataError(f"row {row}, message {k + 1}: expected {{\"role\": str, \"content\": str}}, got {got}")
        out.append({"role": m["role"].strip().lower(), "content": m["content"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        raise DataError(f"row {row}: no assistant message with content; the loss is on assistant tokens only, "
                        "so a row needs at least one")
    return out


def read_conversations(ds: datasets.Dataset, cfg: TaskCfg, where: str) -> tuple[list[list[dict]], list[str]]:
    """Conversations of a table and the columns they were read from.

    Returns:
        ``(conversations, used_columns)``; a prompt/completion row becomes
        ``[{"role": "user", ...}, {"role": "assistant", ...}]``.

    Raises:
        DataError: missing columns, empty prompts/completions, malformed messages.
    """
    cols = ds.column_names
    # Only the columns kept on the tokenised rows (those not read, and the user column) may not
    # take a name the trainer uses itself; a prompt or completion column may be called `label`.
    used = [cfg.messages_column] if cfg.messages_column in cols else [cfg.prompt_column, cfg.completion_column]
    bad = [c for c in cols if c in RESERVED_COLUMNS and (c not in used or c == cfg.user_column)]
    if bad:
        raise DataError(f"{where}: column(s) {bad} have names dpft uses itself for the columns it keeps; rename "
                        f"them (reserved: {', '.join(RESERVED_COLUMNS)}), or drop them from the file")
    if cfg.messages_column in cols:
        convs = [_messages_of(v, i + 1) for i, v in enumerate(ds[cfg.messages_column])]
        return convs, [cfg.messages_column]
    p, c = cfg.prompt_column, cfg.completion_column
    missing = [x for x in (p, c) if x not in cols]
    if missing:
        raise DataError(f"{where}: no {cfg.messages_column!r} column and no prompt/completion column(s) {missing}; "
                        f"columns are {cols}. Set --set task.prompt_column=… --set task.completion_column=… "
                        "(or task.messages_column for chat data)")
    convs = []
    for i, (a, b) in enumerate(zip(ds[p], ds[c])):
        if a is None or b is None or not str(b).strip():
            raise DataError(f"{where}: row {i + 1} has an empty {'prompt' if a is None else 'completion'}; "
                            "drop or fill it (the loss needs a completion)")
        convs.append([{"role": "user", "content": str(a)}, {"role": "assistant", "content": str(b)}])
    return convs, [p, c]


# ---------------------------------------------------------------------------- rendering
def resolve_template(template: str, tokenizer) -> str:
    """``chat`` or ``simple`` for ``task.template`` (``auto``: chat when the tokenizer has one).

    Raises:
        DataError: ``chat`` requested but the tokenizer has no chat template.
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise DataError("task.template=chat, but this tokenizer has no chat template; use template: simple "
                        "(or auto) or a model whose tokenizer has one")
    if template == "auto":
        return "chat" if has else "simple"
    return template


def render(conv: Sequence[dict], tokenizer, template: str, separator: str = "\n",
           prompt_completion: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """A conversation as text and the character spans of its assistant turns (the targets).

    Args:
        conv: ``[{"role", "content"}]``.
        template: ``chat`` (tokenizer's template) or ``simple`` (module docstring).
        prompt_completion: the row came from prompt/completion columns (``simple`` renders it
            as ``BOS prompt separator | completion EOS``).

    Returns:
        ``(text, [(start, end), ...])`` with one span per assistant message, in order.

    Raises:
        DataError: a chat template whose renderings are not prefixes of each other (it rewrites
            earlier turns), so targets cannot be located; use ``template: simple``.
    """
    bos = (tokenizer.bos_token or "") if template == "simple" else ""
    eos = (tokenizer.eos_token or "") if template == "simple" else ""
    if template == "simple":
        if prompt_completion:
            head = bos + conv[0]["content"] + separator
            return head + conv[1]["content"] + eos, [(len(head), len(head) + len(conv[1]["content"]) + len(eos))]
        text, spans = bos, []
        for m in conv:
            if m["role"] == "assistant":
                text += "Assistant: "
                spans.append((len(text), len(text) + len(m["content"]) + len(eos)))
                text += m["content"] + eos + "\n"
            else:
                text += f"{m['role'].capitalize()}: {m['content']}\n"
        return text, spans
    full = tokenizer.apply_chat_template(list(conv), tokenize=False)
    spans = []
    for j, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(list(conv[:j]), tokenize=False, add_generation_prompt=True) if j else ""
        upto = tokenizer.apply_chat_template(list(conv[:j + 1]), tokenize=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError("the tokenizer's chat template renders earlier turns differently once later ones are "
                            "added, so the assistant tokens cannot be located; set task.template: simple")
        spans.append((len(before), len(upto)))
    return full, spans


def _token_targets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token: does its character span overlap an assistant span (zero-width tokens: does it
    start inside one)?"""
    out = []
    for s, e in offsets:
        out.append(any((s < b and e > a) if e > s else (a <= s < b) for a, b in spans))
    return out


def _offsets(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Token ids and character offsets of each text (fast tokenizer; a slow one gets offsets
    from tokenising growing prefixes, which is exact for its own segmentation of each prefix)."""
    try:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [[tuple(o) for o in x] for x in enc["offset_mapping"]]
    except NotImplementedError:
        pass
    ids_all, offs_all = [], []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        offs, prev = [], 0
        for k in range(1, len(ids) + 1):
            end = len(tokenizer.decode(ids[:k]))
            offs.append((prev, max(prev, end)))
            prev = max(prev, end)
        ids_all.append(ids)
        offs_all.append(offs)
    return ids_all, offs_all


def encode(convs: list[list[dict]], tokenizer, template: str, max_length: int, separator: str = "\n",
           prompt_completion: bool = False) -> dict[str, list]:
    """Tokenise conversations into ``input_ids``/``labels`` with left truncation.

    Returns:
        ``{"input_ids", "labels", "prompt_len", "prompt_ids", "cut_left", "cut_right"}`` per
        row; ``prompt_len`` is the number of tokens of the (truncated) row before its last
        assistant turn; ``prompt_ids`` is the generation prompt: every token before the last
        assistant turn of the untruncated row, cut from the left to ``max_length - 1`` tokens.

    Raises:
        DataError: a row whose assistant turns produce no token (nothing to learn).
    """
    rendered = [render(c, tokenizer, template, separator, prompt_completion) for c in convs]
    all_ids, all_offs = _offsets(tokenizer, [t for t, _ in rendered])
    out: dict[str, list] = {"input_ids": [], "labels": [], "prompt_len": [], "prompt_ids": [], "cut_left": [],
                            "cut_right": []}
    for i, ((_, spans), ids, offs) in enumerate(zip(rendered, all_ids, all_offs)):
        tgt = _token_targets(offs, spans)
        last = _token_targets(offs, spans[-1:])
        if not any(last):
            raise DataError(f"row {i + 1}: its last assistant message gives no token; give it some content")
        p = last.index(True)  # first token of the last assistant turn
        ids, tgt = list(ids), list(tgt)
        # Generation prompt: the untruncated prompt cut from the left to max_length - 1 tokens
        # (it does not depend on the completion's length, so equal prompts group together).
        out["prompt_ids"].append(ids[max(0, p - (max_length - 1)):p])
        left = right = 0
        if len(ids) > max_length:
            left = min(len(ids) - max_length, max(p - 1, 0))  # keep ≥ 1 prompt token before the turn
            ids, tgt, p = ids[left:], tgt[left:], p - left
            if len(ids) > max_length:
                right = len(ids) - max_length
                ids, tgt = ids[:max_length], tgt[:max_length]
        out["input_ids"].append(ids)
        out["labels"].append([t if k else IGNORE for t, k in zip(ids, tgt)])
        out["prompt_len"].append(p)
        out["cut_left"].append(left)
        out["cut_right"].append(right)
    return out


def group_references(rows: dict[str, list], convs: list[list[dict]], prompt_display: list[str]) -> list[dict]:
    """Dev generation prompts grouped by prompt tokens (``rows["prompt_ids"]`` of :func:`encode`),
    each with all its references (the last assistant message of each row).

    Returns:
        ``[{"prompt_ids", "prompt", "references"}]`` in order of first appearance.
    """
    groups: dict[tuple, dict] = {}
    for key, conv, shown in zip(map(tuple, rows["prompt_ids"]), convs, prompt_display):
        ref = [m["content"] for m in conv if m["role"] == "assistant"][-1].strip()
        if key not in groups:
            groups[key] = {"prompt_ids": list(key), "prompt": shown, "references": []}
        groups[key]["references"].append(ref)
    return list(groups.values())


def _shown_prompt(conv: list[dict]) -> str:
    """What the report shows as a dev prompt: the last non-assistant message before the last
    assistant one."""
    last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
    before = [m["content"] for m in conv[:last] if m["role"] != "assistant"]
    return before[-1] if before else ""


def _tokenised(ds: datasets.Dataset, used: list[str], enc: dict[str, list],
               keep: Optional[str] = None) -> datasets.Dataset:
    """The tokenised split: ``input_ids``, ``labels``, every column not read and ``keep`` (the
    user column, kept per row even when it is also read, e.g. as the prompt)."""
    extra = {c: ds[c] for c in ds.column_names if c not in used or c == keep}
    return datasets.Dataset.from_dict({"input_ids": enc["input_ids"], "labels": enc["labels"], **extra})


def load_instruct_task(cfg: TaskCfg, tokenizer, max_length: int, seed: int = 0,
                       private: bool = True) -> InstructData:
    """Read, render, tokenise and mask an instruction/chat dataset (module docstring).

    Args:
        cfg: the recipe's task section (``train_file``, optional ``dev_file``, column names,
            ``template``, ``separator``, ``max_train_examples``, ``max_dev_examples``).
        max_length: tokens per example (``model.max_length``).
        private: leave the training truncation count out of ``notes`` (it is private).

    ``max_train_examples`` takes a seeded random subset of rows (N is then that number);
    ``max_dev_examples`` caps the dev rows of the dev loss; generation groups come from all dev
    rows (every reference of a prompt counts).

    Raises:
        DataError: no ``train_file``, unreadable or empty file, missing columns, bad rows.
    """
    if not cfg.train_file:
        raise DataError("task 'instruct' needs --train-file (CSV/TSV/JSONL/Parquet with prompt/completion "
                        "columns or a messages column)")
    template = resolve_template(cfg.template, tokenizer)
    notes: list[str] = []
    train_ds = _load_file(cfg.train_file)
    if cfg.dev_file:
        dev_ds = _load_file(cfg.dev_file)
    else:
        if len(train_ds) < 2:
            raise DataError(f"{cfg.train_file}: too few rows to hold out a dev split; give --dev-file")
        split = train_ds.train_test_split(test_size=cfg.dev_fraction, seed=seed)
        train_ds, dev_ds = split["train"], split["test"]
        notes.append(f"dev = {cfg.dev_fraction:.0%} of the rows of {cfg.train_file} held out (seed {seed})")
    if cfg.max_train_examples and cfg.max_train_examples < len(train_ds):
        train_ds = train_ds.shuffle(seed=seed).select(range(cfg.max_train_examples))
        notes.append(f"training set: a seeded random subset of {cfg.max_train_examples} rows "
                     f"(N = {cfg.max_train_examples})")
    tr_conv, tr_used = read_conversations(train_ds, cfg, str(cfg.train_file))
    dv_conv, dv_used = read_conversations(dev_ds, cfg, str(cfg.dev_file or cfg.train_file))
    pc_tr, pc_dv = tr_used != [cfg.messages_column], dv_used != [cfg.messages_column]
    tr = encode(tr_conv, tokenizer, template, max_length, cfg.separator, pc_tr)
    dv = encode(dv_conv, tokenizer, template, max_length, cfg.separator, pc_dv)
    # Every complete completion must end in a token generation stops at (data/stop.py).
    stop = learned_stop_ids(({"input_ids": a, "labels": b} for a, b in zip(tr["input_ids"], tr["labels"])),
                            tokenizer, f"{cfg.train_file} (training rows)", cut_right=tr["cut_right"])
    stop += [i for i in learned_stop_ids(({"input_ids": a, "labels": b} for a, b in zip(dv["input_ids"], dv["labels"])),
                                         tokenizer, f"{cfg.dev_file or cfg.train_file} (dev rows)",
                                         cut_right=dv["cut_right"]) if i not in stop]
    groups = group_references(dv, dv_conv, [_shown_prompt(c) for c in dv_conv])
    train = _tokenised(train_ds, tr_used, tr, keep=cfg.user_column)
    dev = _tokenised(dev_ds, dv_used, dv, keep=cfg.user_column)
    if cfg.max_dev_examples and cfg.max_dev_examples < len(dev):
        dev = dev.shuffle(seed=seed).select(range(cfg.max_dev_examples))
        notes.append(f"dev loss: a seeded random subset of {cfg.max_dev_examples} dev rows (generation uses "
                     "every dev row's reference)")
    n_cut = lambda e: sum(1 for a, b in zip(e["cut_left"], e["cut_right"]) if a or b)  # noqa: E731
    truncated = {"max_length": max_length, "train": n_cut(tr), "dev": n_cut(dv),
                 "train_right": sum(1 for b in tr["cut_right"] if b), "dev_right": sum(1 for b in dv["cut_right"] if b)}
    if truncated["dev"]:
        notes.append(f"truncated to {max_length} tokens: {truncated['dev']} of {len(dv_conv)} dev rows (from the "
                     f"left of the prompt; {truncated['dev_right']} also lost the end of their completion)"
                     + ("; the count for the private training set is not released" if private else ""))
    if truncated["train"] and not private:
        notes.append(f"truncated to {max_length} tokens: {truncated['train']} of {len(tr_conv)} training rows "
                     "(non-private run)")
    kept = [c for c in train.column_names if c not in ("input_ids", "labels")]
    row = f"one row ({'conversation' if not pc_tr else 'prompt/completion pair'}), never packed with another"
    unit = (f"privacy unit: one user (column {cfg.user_column!r}: all of that user's rows); one example is {row}"
            if cfg.user_column and private else f"privacy unit: {row}")
    notes.append(f"{unit}; loss on {'assistant' if not pc_tr else 'completion'} tokens only; template: "
                 f"{template}" + (f"; extra columns kept: {kept}" if kept else ""))
    notes.append(f"dev generation: {len(groups)} distinct prompts, {sum(len(g['references']) for g in groups)} "
                 "references (multi-reference scoring)")
    return InstructData("instruct", train, dev, f"instruction data: {cfg.train_file}", template, max_length,
                        groups, notes, truncated=truncated, stop_ids=stop)
