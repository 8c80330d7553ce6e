"""No message quotes a label value (issue 44 item 5): a distinctive planted label is driven through
every data error that can see labels — the reading path (unknown dev label, label outside a task's
set, mixed types, non-integer, out of range, gaps, one class, too many classes, a rare class), the
test file of ``dpft predict``, label randomized response, and the CLI — and neither the message nor
the traceback text may hold it. The audit's ``label_quoted`` bug must be caught."""

from __future__ import annotations

import traceback

import pytest
import torch
from typer.testing import CliRunner

from dpft.audit import checks_data as cd
from dpft.data.tasks import DataError

SECRET, NUM = cd.SECRET, cd.SECRET_NUMBER


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("case", [
    "unknown label in the dev file", "label not in the task's label set", "string among numbers (mixed types)",
    "number that is not whole", "integer outside 0..K-1 (dev file)", "integer outside 0..K-1 (negative)",
    "integer labels with gaps", "one class", "more classes than N/10", "a class of fewer than 5 rows"])
def test_every_reading_error_refuses_without_quoting_the_planted_label(tmp_path, case):
    cases = cd.error_cases(tmp_path)
    with pytest.raises(DataError) as e:
        cases[case]()
    text = _text(e.value)
    assert SECRET not in text and str(NUM) not in text, text
    assert "data row" in str(e.value) or "class" in str(e.value) or "values" in str(e.value)  # says where / what


def test_the_cases_cover_every_label_refusal_of_the_reading_path(tmp_path):
    assert len(cd.error_cases(tmp_path)) == 10


def test_predict_test_file_labels_are_counted_not_quoted(tmp_path):
    from dpft.run.predict import read_rows

    f = tmp_path / "test.csv"
    f.write_text(f"text,label\na,pos\nb,{SECRET}\n")
    with pytest.raises(DataError, match=r"1 label\(s\) in column 'label' at data row 2 .* not among the run's 2") as e:
        read_rows(f, "text", None, "label", ["neg", "pos"], require_labels=True)
    text = _text(e.value)
    assert SECRET not in text and "'neg'" not in text and "'pos'" not in text  # nor the run's label set
    f.write_text(f"text,label\na,0\nb,{NUM}\n")
    with pytest.raises(DataError, match="outside the run's label set 0..1") as e:
        read_rows(f, "text", None, "label", ["0", "1"], require_labels=True)
    assert str(NUM) not in _text(e.value)


def test_label_randomized_response_counts_labels_out_of_range():
    from dpft.privacy.label_rr import LDPError, randomized_response

    with pytest.raises(LDPError, match=r"1 of 3 are outside it") as e:
        randomized_response(torch.tensor([0, NUM, 1]), 1.0, 2)
    assert str(NUM) not in _text(e.value)


def test_cli_refuses_an_unknown_dev_label_without_printing_it(tmp_path, monkeypatch):
    import dpft.models.build as build
    from dpft.cli.commands import app

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the label check")

    monkeypatch.setattr(build, "load_classifier", boom)
    tr, dv = tmp_path / "t.csv", tmp_path / "d.csv"
    tr.write_text("text,label\n" + "".join(f"row {i},{'pos' if i % 2 else 'neg'}\n" for i in range(20)))
    dv.write_text(f"text,label\na,pos\nb,{SECRET}\n")
    r = CliRunner().invoke(app, ["train", "--train-file", str(tr), "--dev-file", str(dv), "-o", str(tmp_path / "r")])
    assert r.exit_code == 2, r.output
    assert "not among the 2 labels of the training rows" in " ".join(r.output.split())
    assert SECRET not in r.output and "Traceback" not in r.output


def test_audit_catches_the_planted_label_quote():
    from dpft.audit import suite
    from dpft.audit.planted import ALL

    assert set(cd.PLANTED) <= set(ALL)
    assert any(m == "dpft.audit.checks_data" and set(cd.PLANTED) <= set(names) for m, _, names in suite.OPTIONAL_CHECKS)
    honest = cd.data_checks(None)
    assert honest and all(c.passed for c in honest), [c.row() for c in honest]
    checks = cd.data_checks("label_quoted")
    assert any(not c.passed for c in checks) and checks[0].stats["quoted"] >= 1, [c.row() for c in checks]
