"""read_table: the CSV reader the fitters share; every bad input names the file, column and row."""

from __future__ import annotations

import pytest

from analysis.runs.csvio import TableError, read_table


def _csv(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_required_columns_come_back_as_floats_and_extra_columns_are_kept(tmp_path):
    p = _csv(tmp_path, "step,lr,loss,note\n0,0,5,a\n10,0.001,4.5,b\n")
    df = read_table(p, ["step", "lr", "loss"])
    assert df["step"].dtype == "float64" and df["loss"].tolist() == [5.0, 4.5]
    assert df["note"].tolist() == ["a", "b"]


def test_missing_column_is_named_with_the_columns_present(tmp_path):
    p = _csv(tmp_path, "step,loss\n1,2\n")
    with pytest.raises(TableError, match=r"missing column\(s\) 'lr'.*'step', 'loss'"):
        read_table(p, ["step", "lr", "loss"])


def test_empty_cell_is_reported_as_missing_with_its_row(tmp_path):
    p = _csv(tmp_path, "step,loss\n1,2\n2,\n3,1\n")
    with pytest.raises(TableError, match=r"'loss' has 1 missing/NaN value\(s\), first at row 2"):
        read_table(p, ["step", "loss"])


def test_literal_nan_is_rejected(tmp_path):
    p = _csv(tmp_path, "step,loss\n1,nan\n")
    with pytest.raises(TableError, match="NaN"):
        read_table(p, ["step", "loss"])


def test_text_in_a_numeric_column_is_named(tmp_path):
    p = _csv(tmp_path, "step,loss\n1,2.0\n2,abc\n")
    with pytest.raises(TableError, match=r"'loss' row 2: value 'abc' is not a number"):
        read_table(p, ["step", "loss"])


def test_non_positive_value_is_rejected_only_where_asked(tmp_path):
    p = _csv(tmp_path, "step,lr\n0,0\n1,0.1\n")
    assert len(read_table(p, ["step", "lr"])) == 2  # zero step and zero LR are fine unless asked
    with pytest.raises(TableError, match=r"'lr' must be positive, row 1 has 0"):
        read_table(p, ["step"], positive=["lr"])


def test_unsorted_steps_are_rejected_when_asked(tmp_path):
    p = _csv(tmp_path, "step,loss\n0,3\n20,2\n10,1\n")
    assert len(read_table(p, ["step", "loss"])) == 3
    with pytest.raises(TableError, match=r"'step' must be strictly increasing.*row 3 has 10 after 20"):
        read_table(p, ["loss"], increasing="step")


def test_repeated_step_is_rejected_as_unsorted(tmp_path):
    p = _csv(tmp_path, "step,loss\n0,3\n5,2\n5,1\n")
    with pytest.raises(TableError, match="strictly increasing"):
        read_table(p, ["step", "loss"], increasing="step")


def test_too_few_rows(tmp_path):
    p = _csv(tmp_path, "step,loss\n1,2\n")
    with pytest.raises(TableError, match=r"1 data row\(s\), need at least 3"):
        read_table(p, ["step", "loss"], min_rows=3)


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(TableError, match="no such file"):
        read_table(tmp_path / "nope.csv", ["a"])
    with pytest.raises(TableError, match="file is empty"):
        read_table(_csv(tmp_path, ""), ["a"])


def test_table_error_is_a_value_error_so_the_cli_exits_2():
    assert issubclass(TableError, ValueError)
