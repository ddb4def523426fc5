"""forecast.json's typed sections (analysis.forecast.file): the committed forecasts read back to the
JSON they hold, and a section field of the wrong type is refused in one line that names it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from analysis.forecast.file import ForecastError, read_hero_forecast
from core.fsutil import json_text

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "docs" / "results").rglob("forecast*.json.gz"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_committed_forecast_reads_back_to_the_json_it_holds(path):
    raw = json.loads(gzip.open(path).read())
    raw.setdefault("regime", {})  # written before the regime check: reads as an empty section
    assert json_text(read_hero_forecast(path).to_dict()) == json_text(raw)


def _doc(**sections):
    return {"hero": {"final_loss": {"mean": 2.0, "lo": 1.9, "hi": 2.1, "level": 0.9}}, **sections}


@pytest.mark.parametrize("sections, field", [
    ({"law": {"kind": "compute", "E": "1.7"}}, "law.E is str"),
    ({"law": {"nearest_backtest": [{"held_out": "d384", "lo": [1.0]}]}}, "law.nearest_backtest[0].lo is list"),
    ({"backtest": {"held_out": "d384", "inside": 1}}, "backtest.inside is int"),
    ({"trajectory": {"step": [0, 1], "loss": "2.0"}}, "trajectory.loss is str"),
    ({"regime": {"warnings": ["a transition"]}}, "regime.warnings[0] is str"),
    ({"rung_fits": {"d192": {"tokens": [1, 2]}}}, "rung_fits.d192 has no pred"),
])
def test_a_section_field_of_the_wrong_type_is_refused_in_one_line_naming_it(tmp_path, sections, field):
    path = tmp_path / "forecast.json"
    path.write_text(json.dumps(_doc(**sections)))
    with pytest.raises(ForecastError) as e:
        read_hero_forecast(path)
    assert field in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
