"""The expert load as a monitor signal (analysis.monitor.load), on the committed H200 runs: the
healthy ones raise no load flag, a planted imbalance and the router-collapse fault do."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from analysis.monitor.calib import calibrate, load_calibration
from analysis.monitor.watch import monitor
from analysis.runs.metrics import read_metrics_frame
from core.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
LADDER = ROOT / "docs" / "results" / "h200_ladder"
FAULTS = ROOT / "docs" / "results" / "faults_h200"
HERO_STEPS = 2727
ONSET = 400  # past the early transient (the heroes' routers settle by about step 100)


def load_flags(report, severities=("info", "warning", "critical")):
    return [f for f in report.flags if "load" in f.kind and f.severity in severities]


def calibrated(report):
    """The sequential test's load flag (the absolute rule's is info beside it)."""
    return next((f for f in report.flags if f.kind == "expert_load_imbalance" and "test" in f.evidence), None)


def _unpack(tmp_path_factory, tarball: Path) -> Path:
    root = tmp_path_factory.mktemp(tarball.name.split(".")[0])
    with tarfile.open(tarball) as tar:
        tar.extractall(root, filter="data")
    return root


def _run(d: Path):
    return d.name, read_metrics_frame(d / "metrics.jsonl"), load_spec(d / "spec.yaml")


@pytest.fixture(scope="module")
def healthy_runs(tmp_path_factory):
    """The budget ladder's eight rungs and the first ladder's twelve runs (the hero's four seeds among them)."""
    dirs = []
    for tarball in (LADDER / "budget_rungs.tar.gz", LADDER / "h200_ladder.tar.gz"):
        dirs += sorted((_unpack(tmp_path_factory, tarball) / "proxy_h200").iterdir())
    return [_run(d) for d in dirs]


@pytest.fixture(scope="module")
def heroes(healthy_runs):
    runs = [r for r in healthy_runs if r[0].startswith("hero-d512")]
    assert len(runs) == 4
    return runs


@pytest.fixture(scope="module")
def router_collapse(tmp_path_factory):
    return _run(_unpack(tmp_path_factory, FAULTS / "runs_as_trained.tar.gz") / "faults" / "runs" / "router_collapse")


def planted(df, onset=ONSET, low=6.0, high=8.0, seed=0):
    """The run's records with expert_load_max from `onset` on drawn between low and high (one
    expert taking most of a batch's share: load balancing off)."""
    out = df.copy()
    late = out["step"].to_numpy() >= onset
    out.loc[late, "expert_load_max"] = np.random.default_rng(seed).uniform(low, high, int(late.sum()))
    return out


def test_healthy_committed_runs_raise_no_load_flag_without_a_calibration(healthy_runs):
    assert len(healthy_runs) == 20
    for name, df, spec in healthy_runs:
        assert load_flags(monitor(df, spec)) == [], name


def test_healthy_heroes_raise_no_load_flag_against_a_calibration_from_the_other_three(heroes):
    for i, (name, df, spec) in enumerate(heroes):
        cal = calibrate([r for j, r in enumerate(heroes) if j != i], HERO_STEPS)
        assert "expert_load_max" in cal.series
        assert load_flags(monitor(df, spec, calibration=cal), ("warning", "critical")) == [], name


def test_a_planted_imbalance_warns_without_a_calibration_naming_the_load_and_its_step(heroes):
    name, df, spec = heroes[0]
    rep = monitor(planted(df), spec)
    f = rep.first("expert_load_imbalance")
    assert f is not None and f.severity == "warning"
    assert ONSET <= f.first_step <= ONSET + 25  # the rolling median of 25 points crosses 4 within ~13 points
    assert f.evidence["load_max_over_mean"] > 4.0 and f.evidence["threshold"] == 4.0
    assert "x the mean" in f.evidence["text"] and f"step {f.first_step}" in f.evidence["text"]


def test_a_planted_imbalance_is_flagged_by_the_calibrated_test_within_two_blocks(heroes):
    cal = calibrate(heroes[1:], HERO_STEPS)
    name, df, spec = heroes[0]
    f = calibrated(monitor(planted(df), spec, calibration=cal))
    block = HERO_STEPS / len(cal.series["expert_load_max"].mu)
    assert f is not None and f.severity == "critical"  # 6-8x against the healthy ~2x: many healthy sds
    assert ONSET <= f.first_step <= ONSET + 2 * block
    assert f.evidence["healthy_load_max_over_mean"] < 3.0 < 6.0 <= f.evidence["load_max_over_mean"]
    assert "healthy runs sit at" in f.evidence["text"]


def test_a_load_below_the_healthy_band_never_warns(heroes):
    """Better balance than the healthy runs costs nothing: only a rise in load warns."""
    cal = calibrate(heroes[1:], HERO_STEPS)
    name, df, spec = heroes[0]
    lower = df.copy()
    late = lower["step"] >= ONSET
    lower.loc[late, "expert_load_max"] = 1.0 + 0.3 * (lower.loc[late, "expert_load_max"] - 1.0)
    assert load_flags(monitor(lower, spec, calibration=cal), ("warning", "critical")) == []


def test_a_slow_rise_below_the_threshold_is_reported_as_a_trend_not_a_warning(heroes):
    name, df, spec = heroes[0]
    rising = df.copy()
    late = (rising["step"] >= ONSET).to_numpy()
    rising.loc[late, "expert_load_max"] *= np.linspace(1.0, 2.0, int(late.sum()))
    rep = monitor(rising, spec)
    assert [f.kind for f in load_flags(rep)] == ["expert_load_rising"]
    assert rep.first("expert_load_rising").severity == "info"


def test_the_router_collapse_fault_is_an_expert_load_imbalance_with_and_without_a_calibration(heroes, router_collapse):
    name, df, spec = router_collapse  # router weights x30 at step 136 (bench/faults.py)
    plain = monitor(df, spec).first("expert_load_imbalance")
    assert plain is not None and plain.severity == "warning" and 136 <= plain.first_step <= 136 + 30
    cal = calibrate(heroes, HERO_STEPS)
    f = calibrated(monitor(df, spec, calibration=cal))
    assert f is not None and f.severity == "critical" and 136 <= f.first_step <= 136 + 3 * HERO_STEPS / 100


def test_a_calibration_file_keeps_the_load_series(heroes, tmp_path):
    cal = calibrate(heroes[1:], HERO_STEPS)
    back = load_calibration(cal.save(tmp_path / "calibration.json"))
    assert back.series["expert_load_max"].mu == pytest.approx(cal.series["expert_load_max"].mu, nan_ok=True)


def test_the_committed_calibration_written_before_the_load_was_a_series_still_loads():
    cal = load_calibration(FAULTS / "calibration.json")
    assert "expert_load_max" not in cal.series and "router_entropy" in cal.series


def test_an_old_calibration_without_the_load_leaves_it_to_the_uncalibrated_rule(heroes, tmp_path):
    d = calibrate(heroes[1:], HERO_STEPS).to_dict()
    del d["series"]["expert_load_max"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d, default=lambda x: None if x != x else x))
    cal = load_calibration(path)
    name, df, spec = heroes[0]
    rep = monitor(planted(df), spec, calibration=cal)
    assert "expert_load_max_sd_from_healthy" not in rep.summary  # not judged calibrated
    f = rep.first("expert_load_imbalance")
    assert f is not None and f.severity == "warning" and f.evidence["rule"] == "absolute"
