"""replan.json (analysis.replan.file): a replan written by write_replan reads back as the document
that wrote it, byte for byte, and a field of the wrong type is refused in one line naming it."""

from __future__ import annotations

import json

import pytest

from analysis.replan.contingency import make_replan
from analysis.replan.file import OptionRow, ReplanFileError, read_replan
from analysis.replan.state import write_replan
from tests.analysis.test_replan import TOKENS_PER_STEP, proxy_spec, state_of


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    st = state_of(proxy_spec(steps=1000), upto=199)
    plan = make_replan(st, deadline=st.now + 400 * TOKENS_PER_STEP / 512.0, forecaster=None)
    out = tmp_path_factory.mktemp("replan")
    return plan, write_replan(plan, out)["replan.json"]


def test_a_written_replan_reads_back_as_its_document(written):
    plan, path = written
    doc = read_replan(path)
    assert doc.to_dict() == json.loads(json.dumps(plan.to_dict(), default=str))
    assert all(isinstance(o, OptionRow) for o in doc.options) and doc.recommendation == plan.recommendation


def test_a_replan_read_back_writes_the_same_bytes(written):
    _, path = written
    with open(path) as f:
        assert read_replan(path).text() == f.read()


def test_a_field_of_the_wrong_type_is_refused_in_one_line_naming_it(written, tmp_path):
    _, path = written
    doc = json.loads(open(path).read())
    doc["options"][1]["forecast_loss"] = "2.5"
    bad = tmp_path / "replan.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReplanFileError) as e:
        read_replan(bad)
    assert "options[1].forecast_loss is str" in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value)


def test_an_absent_replan_reads_as_none(tmp_path):
    assert read_replan(tmp_path / "replan.json") is None
