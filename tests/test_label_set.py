"""Errors that never print private rows (issue 36 item 2, and item 6's label cases): a label
column that cannot be labels (text and label columns swapped, 1,000 classes of 5 rows, a typo
class) is refused with its count and the fix before any model is loaded; integer labels with
gaps are refused; a one-class training file is blamed, not the dev file; no message quotes a
label value or a row's text."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dpft.config.recipe import TaskCfg
from dpft.data.tasks import DataError, load_task


def _csv(path, rows, header="text,label"):
    path.write_text("\n".join([header, *rows]) + "\n")
    return str(path)


def _sentence(i: int) -> str:
    return f"the private note number {i} says the patient felt better on day {i % 7}"


def test_swapped_text_and_label_columns_refused_in_one_short_line_before_loading(tmp_path, monkeypatch):
    """Old: the error listed the whole "label set" (thousands of training sentences, 659 KB)."""
    import dpft.models.build as build
    from dpft.cli.commands import app

    tr = _csv(tmp_path / "train.csv", [f"{_sentence(i)},{i % 2}" for i in range(300)])
    dv = _csv(tmp_path / "dev.csv", [f"{_sentence(1000 + i)},{i % 2}" for i in range(40)])

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the label check")

    monkeypatch.setattr(build, "load_classifier", boom)
    r = CliRunner().invoke(app, ["train", "--train-file", tr, "--dev-file", dv, "--text-column", "label",
                                 "--label-column", "text", "-o", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "column 'text' has 300 distinct values in 300 training rows (more than N/10 = 30" in out
    assert "--label-column names the label and --text-column the text (now 'text' and 'label': swapped?)" in out
    assert "private note" not in r.output and "patient" not in r.output
    assert len(r.output) < 800 and "Traceback" not in r.output


def test_a_thousand_classes_of_five_rows_are_refused(tmp_path):
    """Old: trained silently to dev accuracy 0.01."""
    rows = [f"{_sentence(i)},c{i % 1000}" for i in range(5000)]
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "t.csv", rows), dev_fraction=0.1)
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert msg.startswith(cfg.train_file) and "has 1000 distinct values in 4500 training rows" in msg
    assert "c17" not in msg and "private note" not in msg


def test_a_class_of_fewer_than_five_rows_is_refused_without_naming_it(tmp_path):
    rows = [f"{_sentence(i)},{'pos' if i % 2 else 'neg'}" for i in range(200)] + [f"{_sentence(900)},postive"] * 2
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "t.csv", rows), dev_file=_csv(tmp_path / "d.csv",
                                                                                          ["x,pos", "y,neg"]))
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert "1 of the 3 classes in column 'label' have fewer than 5 training rows (the smallest has 2)" in msg
    assert "postive" not in msg and "merge or drop the rare classes" in msg


def test_integer_labels_with_gaps_are_refused_with_the_fix(tmp_path):
    """Old: labels {0, 5} silently made a 6-class head."""
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "t.csv", [f"r{i},{0 if i % 2 else 5}" for i in range(40)]),
                  dev_file=_csv(tmp_path / "d.csv", ["a,0", "b,5"]))
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert msg.startswith(cfg.train_file)
    assert "integer labels in column 'label' leave 4 of the integers from 0 to the largest label unused in the " \
        "training rows" in msg and "(1, 2, 3, 4)" not in msg and "the head would have 6 classes for 2 present" in msg and "Renumber the labels 0..K-1" in msg


@pytest.mark.parametrize("train,dev", [("pos", "neg"), ("1", "0")])
def test_one_class_blames_the_training_file_not_the_dev_file(tmp_path, train, dev):
    """Old: "dev.csv: labels ['neg'] … are not in the label set ['pos']" (string labels) or
    "dev.csv: label 0 … outside the label set 0..1" — the dev file was blamed."""
    cfg = TaskCfg(name="files", train_file=_csv(tmp_path / "t.csv", [f"r{i},{train}" for i in range(8)]),
                  dev_file=_csv(tmp_path / "d.csv", [f"a,{dev}", f"b,{train}"]))
    with pytest.raises(DataError) as e:
        load_task(cfg)
    msg = str(e.value)
    assert msg.startswith(cfg.train_file) and "the training rows have one class (column 'label')" in msg
    assert f"'{train}'" not in msg


def test_instruction_messages_errors_describe_the_structure_not_the_text():
    from dpft.data.instruct import _messages_of

    with pytest.raises(DataError) as e:
        _messages_of({"secret": "my diagnosis is X"}, 3)
    assert "got a dict" in str(e.value) and "diagnosis" not in str(e.value)
    with pytest.raises(DataError) as e:
        _messages_of([{"role": "user", "text": "my diagnosis is X"}], 4)
    assert "got an object with keys ['role', 'text']" in str(e.value) and "diagnosis" not in str(e.value)
