"""`ladder calibrate`: the monitor's calibration from the hero's finished replicates in the ledger,
written beside the forecast, and `ladder compare --forecast` picking it up without a flag; on the
H200 hero's committed seeds (the budget ladder's forecast), a seed the calibration never saw is judged
healthy."""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from tests import cli_fork

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results" / "h200_ladder"
EXP = "experiments/proxy_h200.py"


@pytest.fixture
def root(tmp_path) -> Path:
    """The budget ladder's forecast and the hero's seeds 0-3 (first ladder's tarball) in a ledger;
    seed 4 (trained after the forecast) kept aside under tmp/held/."""
    with tarfile.open(RESULTS / "h200_ladder.tar.gz") as tar:
        tar.extractall(tmp_path / "runs", filter="data", members=[m for m in tar.getmembers() if "/hero-" in m.name])
    with tarfile.open(RESULTS / "budget" / "hero_seed4.tar.gz") as tar:
        tar.extractall(tmp_path / "held", filter="data")
    fc = tmp_path / "analysis" / "proxy_h200" / "forecast.json"
    fc.parent.mkdir(parents=True)
    fc.write_bytes(gzip.open(RESULTS / "budget" / "forecast.json.gz").read())
    return tmp_path


def _ladder(*args):
    return cli_fork.ladder(*map(str, args), cwd=REPO, timeout=600)


def test_calibrate_writes_the_calibration_beside_the_forecast_and_compare_uses_it(root):
    out = _ladder("calibrate", EXP, "--root", root)
    assert out.returncode == 0, out.stderr[-2000:]
    cal = json.loads((root / "analysis" / "proxy_h200" / "calibration.json").read_text())
    assert sorted(r["name"] for r in cal["runs"]) == ["hero-d512", "hero-d512-seed1", "hero-d512-seed2", "hero-d512-seed3"]
    held = next((root / "held" / "proxy_h200").iterdir())
    res = _ladder("compare", held, "--forecast", root / "analysis" / "proxy_h200" / "forecast.json", "--json")
    assert "calibration: " in res.stderr and "4 healthy runs" in res.stderr
    flags = json.loads(res.stdout)["flags"]
    assert res.returncode == 0 and not [f for f in flags if f["severity"] != "info"], flags


def test_calibrate_needs_two_finished_replicates(root):
    for d in (root / "runs" / "proxy_h200").iterdir():
        if "-seed" in d.name:
            shutil.rmtree(d)
    out = _ladder("calibrate", EXP, "--root", root)
    assert out.returncode == 2
    assert "at least 2 finished runs of the hero's spec" in out.stderr and "found 1" in out.stderr


def test_a_calibration_made_against_another_forecast_is_not_used(root):
    assert _ladder("calibrate", EXP, "--root", root).returncode == 0
    fc = root / "analysis" / "proxy_h200" / "forecast.json"
    d = json.loads(fc.read_text())
    d["created"] = "2026-01-01T00:00:00+00:00"  # another forecast in the same place
    fc.write_text(json.dumps(d))
    held = next((root / "held" / "proxy_h200").iterdir())
    res = _ladder("compare", held, "--forecast", fc, "--json")
    assert "not using" in res.stderr and "calibrate again" in res.stderr
