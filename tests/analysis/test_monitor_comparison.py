"""compare.json (analysis.monitor.comparison): a comparison reads back as the one that wrote it, its
text is what `ladder compare --json` printed before it had a type, and a field of the wrong type is
refused in one line naming it."""

from __future__ import annotations

import json

import pytest

from analysis.monitor.comparison import Comparison, ComparisonError, read_comparison, write_comparison
from analysis.monitor.flags import Flag, MonitorReport

SOURCE = {"kind": "file", "metrics": "runs/hero/metrics.jsonl"}


def _report() -> MonitorReport:
    flags = [Flag("loss_spike", "warning", 120, {"text": "a spike of 9.1 sigma", "z": 9.1}),
             Flag("run_failed", "critical", 130, {"text": "the run's status.json says failed"})]
    return MonitorReport(flags, {"step": 131, "loss": 2.71}, {"band_k": 3})


def test_a_comparison_reads_back_as_the_one_that_wrote_it(tmp_path):
    c = Comparison.of("hero", SOURCE, _report(), png="compare.png")
    back = read_comparison(write_comparison(tmp_path / "compare.json", c))
    assert back == c and back.worst == "critical" and back.flags[1].first_step == 130


def test_its_text_is_the_json_compare_printed(tmp_path):
    report = _report()
    before = json.dumps({"run": "hero", "metrics": SOURCE["metrics"], "source": SOURCE, **report.to_dict()},
                        indent=2, default=str)
    path = write_comparison(tmp_path / "compare.json", Comparison.of("hero", SOURCE, report))
    assert path.read_text() == before


def test_a_field_of_the_wrong_type_is_refused_in_one_line_naming_it(tmp_path):
    doc = Comparison.of("hero", SOURCE, _report()).to_dict()
    doc["flags"][0]["first_step"] = "120"
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ComparisonError) as e:
        read_comparison(path)
    assert "flags[0].first_step is str" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_an_absent_comparison_reads_as_none(tmp_path):
    assert read_comparison(tmp_path / "compare.json") is None
