"""Input validation a new user meets (issue 13 item 6): bad labels, empty texts, header-only
files, very long fields, RDP log noise, and a DP-SFT "public" subspace built on the private data."""

from __future__ import annotations

import logging
import re

import pytest

from dpft.config.recipe import TaskCfg, load_recipe
from dpft.data.tasks import DataError, load_task


def _csv(path, rows, header="text,label"):
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


def _files(tmp_path, train_rows, dev_rows=None, header="text,label"):
    tr = _csv(tmp_path / "train.csv", train_rows, header)
    dv = _csv(tmp_path / "dev.csv", dev_rows, header) if dev_rows is not None else None
    return TaskCfg(name="files", train_file=tr, dev_file=dv)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from dpft.models.load import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("minilm"))


# 1. non-integer labels --------------------------------------------------------------------------

def test_fractional_labels_are_refused_with_file_column_and_rows(tmp_path):
    cfg = _files(tmp_path, ["a,0", "b,1.5", "c,1", "d,2.5"], ["e,0", "f,1"], header="text,y")
    cfg.label_column = "y"
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert cfg.train_file in msg and "'y'" in msg and "1.5" not in msg and "2.5" not in msg  # never the value
    assert "data rows 2, 4" in msg and "2 non-integer labels (a number that is not whole)" in msg


def test_whole_float_labels_are_accepted_as_ints(tmp_path):
    d = load_task(_files(tmp_path, ["a,0.0", "b,1.0", "c,1"], ["e,0", "f,1.0"]))
    assert d.train.features["label"].dtype == "int64" and sorted(d.train["label"]) == [0, 1, 1]
    assert list(d.dev["label"]) == [0, 1] and d.label_names == ["0", "1"]
    assert set(d.train.column_names) == {"text", "label"}  # the row-number column is gone


# 2. out-of-range labels name their file and row ---------------------------------------------------

def test_out_of_range_dev_label_names_the_dev_file_and_row(tmp_path):
    cfg = _files(tmp_path, ["a,0", "b,1"], ["e,0", "f,1", "g,7"])
    with pytest.raises(DataError, match="outside the label set 0..1") as e:
        load_task(cfg)
    msg = str(e.value)
    assert msg.startswith(cfg.dev_file) and "1 label in column 'label' at data row 3 " in msg
    assert "7" not in msg.replace(cfg.dev_file, "")  # the value is private: counted and located, never quoted


def test_negative_train_label_names_the_train_file(tmp_path):
    cfg = _files(tmp_path, ["a,0", "b,-1", "c,1"], ["e,0"])
    with pytest.raises(DataError, match="outside the label set") as e:
        load_task(cfg)
    assert str(e.value).startswith(cfg.train_file) and "data row 2 " in str(e.value)


def test_held_out_dev_label_names_the_train_file_row(tmp_path):
    """A label seen only in held-out rows: the message points at that row of the train file."""
    rows = [f"t{i},{i % 2}" for i in range(20)] + ["odd one,5"]
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "all.csv", rows), dev_fraction=0.5)
    for seed in range(20):  # find a split that puts the label-5 row in dev
        try:
            load_task(cfg, seed=seed)
        except DataError as exc:
            if "held-out" in str(exc):
                assert "data row 21 " in str(exc) and cfg.train_file in str(exc)
                return
    pytest.fail("no seed put row 21 in the held-out dev split")


def test_unknown_string_label_and_missing_label_name_file_and_rows(tmp_path):
    cfg = _files(tmp_path, ["a,pos", "b,neg"], ["e,pos", "f,meh"])
    with pytest.raises(DataError, match=r"1 label in column 'label' at data row 2 .*not among the 2 labels") as e:
        load_task(cfg)
    assert str(e.value).startswith(cfg.dev_file) and "meh" not in str(e.value)  # values never quoted (issue 36)
    cfg = _files(tmp_path, ["a,1", "b,", "c,0"], ["e,0"])
    with pytest.raises(DataError, match="no label in column 'label' at data row 2 ") as e:
        load_task(cfg)
    assert str(e.value).startswith(cfg.train_file)


# 3. empty texts ---------------------------------------------------------------------------------

def test_empty_text_names_file_column_and_rows(tmp_path):
    cfg = _files(tmp_path, ["a,0", ",1", "c,1", "  ,0"], ["e,0"])
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert msg.startswith(cfg.train_file) and "column 'text'" in msg and "data rows 2, 4 " in msg
    jl = tmp_path / "dev.jsonl"
    jl.write_text('{"text": "ok", "label": 0}\n{"text": "", "label": 1}\n')
    with pytest.raises(DataError, match=r"dev\.jsonl: empty text in column 'text' at data row 2 "):
        load_task(TaskCfg(name="files", train_file=_csv(tmp_path / "t.csv", ["a,0", "b,1"]), dev_file=str(jl)))


def test_empty_text_pair_is_named(tmp_path):
    cfg = _files(tmp_path, ["q1,s1,0", "q2,,1"], ["q3,s3,0"], header="q,s,label")
    cfg.text_column, cfg.text_pair_column = "q", "s"
    with pytest.raises(DataError, match=r"train\.csv: empty text in column 's' at data row 2 "):
        load_task(cfg)


def test_numeric_text_column_is_read_as_text(tmp_path, tokenizer):
    from dpft.data.tokenize import tokenize_split

    d = load_task(_files(tmp_path, ["12,0", "34,1"], ["56,0"]))
    assert list(d.train["text"]) in (["12", "34"], ["34", "12"])
    assert len(tokenize_split(d.dev, tokenizer, 8)) == 1


# 5. header-only files ----------------------------------------------------------------------------

@pytest.mark.parametrize("ext,header", [("csv", "text,label"), ("tsv", "text\tlabel")])
def test_header_only_file(tmp_path, ext, header):
    f = tmp_path / f"h.{ext}"
    f.write_text(header + "\n")
    with pytest.raises(DataError, match=re.escape(f"{f} has a header but no rows")):
        load_task(TaskCfg(name="files", train_file=str(f)))
    good = _csv(tmp_path / "g.csv", ["a,0", "b,1"])
    with pytest.raises(DataError, match=re.escape(f"{f} has a header but no rows")):
        load_task(TaskCfg(name="files", train_file=good, dev_file=str(f)))


def test_header_only_corpus_for_the_text_task(tmp_path):
    from dpft.data.text import read_texts

    f = tmp_path / "c.csv"
    f.write_text("text\n")
    with pytest.raises(DataError, match="has a header but no rows"):
        read_texts(f, None)


# 4. long fields: character cap, truncation count ----------------------------------------------

class _Recorder:
    """Wraps a tokenizer; records the longest string it is given. ``slow`` drops ``encodings``
    (a slow tokenizer's output) to test the other truncation count."""

    def __init__(self, tok, slow=False):
        self.tok, self.slow, self.longest = tok, slow, 0

    def __call__(self, text, pair=None, **kw):
        for t in list(text) + list(pair or []):
            self.longest = max(self.longest, len(t))
        enc = self.tok(text, pair, **kw)
        return dict(enc) if self.slow else enc


@pytest.mark.parametrize("slow", [False, True])
def test_long_fields_are_capped_and_truncations_counted(tmp_path, tokenizer, slow):
    from dpft.data.tokenize import CHARS_PER_TOKEN, tokenize_split

    huge = "word " * 400_000  # 2 MB
    cfg = _files(tmp_path, ["short,0", f"{huge},1", "a b c d e f g h i j k l m n o p,0", "mid one,1"], ["x,0"])
    d = load_task(cfg)
    rec = _Recorder(tokenizer, slow)
    st: dict = {}
    out = tokenize_split(d.train, rec, 16, st)
    assert rec.longest <= 16 * CHARS_PER_TOKEN
    assert st == {"n": 4, "truncated": 2}
    assert max(len(x) for x in out["input_ids"]) == 16
    assert "__dpft_truncated__" not in out.column_names
    plain = tokenize_split(d.train, tokenizer, 16)  # same ids as without the recorder
    assert list(plain["input_ids"]) == list(out["input_ids"])


def test_pair_truncation_is_counted(tmp_path, tokenizer):
    from dpft.data.tokenize import tokenize_split

    cfg = _files(tmp_path, ["q a b c d e,s f g h i j,0", "q,s,1"], ["q,s,0"], header="q,s,label")
    cfg.text_column, cfg.text_pair_column = "q", "s"
    d = load_task(cfg)
    st: dict = {}
    tokenize_split(d.train, tokenizer, 8, st)
    assert st["truncated"] == 1


def test_tokenize_task_note_keeps_the_private_count_out(tmp_path, tokenizer):
    from dpft.data.tokenize import tokenize_task

    long = " ".join(["w"] * 40)
    cfg = _files(tmp_path, [f"{long},0", f"{long},1", "ok,0"], [f"{long},0", "ok,1"])
    d = load_task(cfg)
    n0 = len(d.notes)
    tr, dv = tokenize_task(d, tokenizer, 16)
    assert len(tr) == 3 and len(dv) == 2
    assert d.truncated == {"max_length": 16, "train": 2, "dev": 1}
    note = d.notes[n0]
    assert "1 of 2 dev examples" in note and "model.max_length = 16" in note and "of 3" not in note
    d = load_task(cfg)
    tokenize_task(d, tokenizer, 16, private=False)
    assert "2 of 3 training and 1 of 2 dev examples" in d.notes[-1]
    d = load_task(cfg)
    tokenize_task(d, tokenizer, 64)
    assert d.truncated == {"max_length": 64, "train": 0, "dev": 0} and len(d.notes) == n0


def test_text_task_document_mode_counts_truncations(tmp_path, tokenizer):
    from dpft.data.text import load_text_task

    tr = tmp_path / "tr.txt"
    tr.write_text("\n".join(["a b c d e f g h i j k l", "a b", "x " * 5000, "c d e"]) + "\n")
    dv = tmp_path / "dv.txt"
    dv.write_text("a b c d e f g h i j k l\nq r\n")
    d = load_text_task(TaskCfg(name="text", train_file=str(tr), dev_file=str(dv), unit="document"), tokenizer, 8)
    assert d.truncated == {"max_length": 8, "train": 2, "dev": 1}
    assert any("1 of 2 dev documents" in n for n in d.notes)
    assert not any("of 4" in n for n in d.notes)


def test_long_texts_are_tokenised_in_pieces_exactly(tokenizer, monkeypatch):
    import dpft.data.text as text

    doc = "The cat sat.  On the\nmat,   it slept; " * 40
    full = text._encode([doc], tokenizer)
    monkeypatch.setattr(text, "PIECE_CHARS", 50)
    pieces = text._pieces(doc, 50)
    assert len(pieces) > 10 and "".join(pieces) == doc
    assert all(p[0].isspace() for p in pieces[1:])
    assert text._encode([doc], tokenizer) == full
    assert text._pieces("x" * 120, 50) == ["x" * 50, "x" * 50, "x" * 20]  # no boundary: plain cuts


# 6. no raw absl warnings from the RDP cross-check ---------------------------------------------

def test_rdp_cross_check_does_not_log_convergence_warnings(caplog):
    import dp_accounting as dpa

    from dpft.accounting.ledger import epsilon_of

    ev = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 10)
    with caplog.at_level(logging.WARNING):
        r = epsilon_of([ev], 1e-5)
    assert r.epsilon > 0 and r.epsilon_rdp > r.epsilon
    assert not [x for x in caplog.records if "converge" in x.getMessage()]
    with caplog.at_level(logging.WARNING):
        logging.getLogger("absl").warning("other absl warnings still show")
    assert any("still show" in x.getMessage() for x in caplog.records)


# 7. DP-SFT: a "public" subspace on the private data is refused ----------------------------------

def _sft(private: dict, public: dict):
    return load_recipe(None, {**{f"task.{k}": v for k, v in private.items()},
                              "subspace.source": "public", "subspace.public_task": public})


def test_public_subspace_on_the_private_task_is_refused(sst_like_files, tmp_path, monkeypatch):
    from dpft.methods.dpsft.method import check_public_source
    from dpft.transforms.subspace import SubspaceError

    csv, tsv = sst_like_files["csv"], sst_like_files["tsv"]
    msg = "built on the private data for free; use source: private"
    with pytest.raises(SubspaceError, match=f"private task 'sst2'.*{msg}"):
        check_public_source(_sft({"name": "sst2"}, {"name": "sst2"}))
    # the same file, spelled differently
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SubspaceError, match=msg):
        check_public_source(_sft({"name": "files", "train_file": str(csv)},
                                 {"name": "files", "train_file": f"./{csv.name}"}))
    # a registered task read from DPFT_DATA_DIR whose file is the private train file
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text(tsv.read_text())
    monkeypatch.setenv("DPFT_DATA_DIR", str(tmp_path))
    with pytest.raises(SubspaceError, match=msg):
        check_public_source(_sft({"name": "files", "train_file": "sst2/../sst2/train.tsv"}, {"name": "sst2"}))
    # allowed: another task or another file
    check_public_source(_sft({"name": "sst2"}, {"name": "imdb"}))
    check_public_source(_sft({"name": "files", "train_file": str(csv)}, {"name": "files", "train_file": str(tsv)}))


def test_trainer_refuses_the_private_file_as_public_subspace(tiny_model_dir, sst_like_files, tmp_path):
    from dpft.run.loop import Trainer
    from dpft.transforms.subspace import SubspaceError

    f = str(sst_like_files["csv"])
    rec = load_recipe(None, {
        "model.name": str(tiny_model_dir), "model.max_length": 16, "task.name": "files", "task.train_file": f,
        "batch.expected_batch_size": 8, "batch.max_physical_batch_size": 4, "schedule.steps": 3,
        "privacy.target_epsilon": 6.0, "privacy.delta": 1e-3, "subspace.k": 4, "subspace.steps": 4,
        "subspace.source": "public", "subspace.public_task": {"name": "files", "train_file": f}})
    with pytest.raises(SubspaceError, match="public subspace would be built on the private data"):
        Trainer(rec, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "subspace" / "stage1").exists()


# issue 24: a new user's rough edges ----------------------------------------------------------------

def test_missing_labels_in_a_held_out_split_are_counted_once_in_file_order(tmp_path):
    """NaN labels spread over train and the held-out dev rows: every one is named, in file order,
    counted over the whole file (the split used to name only its train share, shuffled)."""
    rows = [f"t{i},{'' if i + 1 in (3, 11, 17, 18, 19, 20) else i % 2}" for i in range(24)]
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "all.csv", rows), dev_fraction=0.5)
    with pytest.raises(DataError) as e:
        load_task(cfg, seed=1)
    msg = str(e.value)
    assert msg.startswith(cfg.train_file) and "held-out" not in msg
    assert "data rows 3, 11, 17, 18, 19, … (6 in all)" in msg


def test_row_lists_are_sorted():
    from dpft.data.tasks import _rows

    assert _rows([9, 2, 5]) == "data rows 2, 5, 9 (counting from 1, header excluded)"


@pytest.mark.parametrize("labels", [["pos"] * 6, [1] * 6, [0] * 6])
def test_one_class_training_file_is_refused_with_the_fix(tmp_path, labels):
    rows = [f"r{i},{v}" for i, v in enumerate(labels)]
    cfg = _files(tmp_path, rows, ["e,pos" if isinstance(labels[0], str) else "e,0"])
    with pytest.raises(DataError, match="the training rows have one class") as e:
        load_task(cfg)
    assert str(e.value).startswith(cfg.train_file) and "--label-column" in str(e.value)
    assert "one class (column 'label')" in str(e.value)
    assert f"'{labels[0]}'" not in str(e.value)  # the value is not quoted: it may be a text (issue 36 item 2)


def test_bare_registered_task_finds_shared_data_beside_the_project(monkeypatch, tmp_path):
    """No DPFT_DATA_DIR: ../shared/data beside the current folder or beside the project (what
    `make demo` uses) is found; with neither and the hub off, the error is immediate and names
    DPFT_DATA_DIR."""
    import time

    from dpft.data import tasks

    monkeypatch.delenv("DPFT_DATA_DIR", raising=False)
    shared = tmp_path / "shared" / "data"
    (shared / "sst2").mkdir(parents=True)
    (shared / "MANIFEST.md").write_text("task files\n")
    (tmp_path / "proj").mkdir()
    monkeypatch.chdir(tmp_path / "proj")
    monkeypatch.setattr(tasks, "_PROJECT", tmp_path / "elsewhere")
    assert tasks.data_dir() == shared.resolve()
    monkeypatch.chdir(tmp_path)
    assert tasks.data_dir() is None
    monkeypatch.setattr(tasks, "_PROJECT", tmp_path / "proj")  # the project's own ../shared/data
    assert tasks.data_dir() == shared.resolve()
    monkeypatch.setattr(tasks, "_PROJECT", tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(DataError, match="DPFT_DATA_DIR") as e:
        load_task(TaskCfg(name="sst2"))
    assert time.time() - t0 < 5 and "hub is off" in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(tasks, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(DataError, match="cannot be reached .*DPFT_DATA_DIR"):
        load_task(TaskCfg(name="sst2"))


def test_completion_column_named_label_is_accepted_and_kept_columns_are_checked(tmp_path):
    import datasets

    from dpft.data.instruct import read_conversations

    cfg = TaskCfg(name="instruct", prompt_column="question", completion_column="label")
    ds = datasets.Dataset.from_dict({"question": ["q1", "q2"], "label": ["a1", "a2"], "user": ["u", "v"]})
    convs, used = read_conversations(ds, cfg, "f.jsonl")
    assert used == ["question", "label"] and convs[0][1] == {"role": "assistant", "content": "a1"}
    ds = datasets.Dataset.from_dict({"question": ["q1"], "answer": ["a1"], "label": ["x"]})
    cfg = TaskCfg(name="instruct", prompt_column="question", completion_column="answer")
    with pytest.raises(DataError, match=r"\['label'\] have names dpft uses itself for the columns it keeps"):
        read_conversations(ds, cfg, "f.jsonl")


def test_user_level_instruct_note_names_the_user_as_the_privacy_unit(tmp_path):
    from conftest import SHARED_DATA
    from transformers import AutoTokenizer

    from dpft.data.instruct import load_instruct_task
    from dpft.outputs.report_lm import render_extra

    model = SHARED_DATA / "models" / "stories260K"
    if not model.is_dir():
        pytest.skip("stories260K not present")
    tok = AutoTokenizer.from_pretrained(model)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(f'{{"prompt": "p{i}", "completion": "c{i}", "who": "u{i % 3}"}}\n' for i in range(12)))
    cfg = TaskCfg(name="instruct", train_file=str(f), user_column="who")
    note = next(n for n in load_instruct_task(cfg, tok, 32, private=True).notes if "privacy unit" in n)
    assert note.startswith("privacy unit: one user (column 'who'") and "one example is one row" in note
    note = next(n for n in load_instruct_task(TaskCfg(name="instruct", train_file=str(f)), tok, 32).notes
                if "privacy unit" in n)
    assert note.startswith("privacy unit: one row (prompt/completion pair)")
    rep = {"lm": {"unit": "example", "block_size": 32, "samples": []},
           "dp": {"privacy_unit": {"unit": "user", "column": "who", "n_units": 3}}}
    line = next(x for x in render_extra(rep) if "privacy unit" in x)
    assert line.startswith("- privacy unit: one user (column 'who', N = 3 users); one example is one row")
