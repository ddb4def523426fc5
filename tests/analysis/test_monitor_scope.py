"""How a calibration applies to the run it judges (analysis.monitor.scope), on the H200 hero's
committed healthy seeds: seeds 0-3 calibrate against the budget ladder's forecast, seed 4 (trained
later, never seen by the calibration) is judged as it was trained and altered as each property
needs. Also: the logged LR leaving its schedule, and a compressed forecast file."""

from __future__ import annotations

import gzip
import tarfile
from pathlib import Path

import numpy as np
import pytest

from analysis.forecast.file import load_forecast
from analysis.monitor.calib import calibrate
from analysis.monitor.series import UNMARKED, eval_sample
from analysis.monitor.watch import MonitorSettings, monitor
from analysis.runs.metrics import MetricsError, check_spec_matches, read_metrics_frame
from core.spec import load_spec

pytestmark = pytest.mark.slow

LADDER = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200_ladder"


@pytest.fixture(scope="module")
def forecast(tmp_path_factory):
    return load_forecast(LADDER / "budget" / "forecast.json.gz")


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    with tarfile.open(LADDER / "budget" / "hero_seed4.tar.gz") as tar:
        tar.extractall(root, filter="data")
    d = next((root / "proxy_h200").iterdir())
    return read_metrics_frame(d), load_spec(d / "spec.yaml")


@pytest.fixture(scope="module")
def cal(tmp_path_factory, forecast):
    root = tmp_path_factory.mktemp("heroes")
    with tarfile.open(LADDER / "h200_ladder.tar.gz") as tar:
        tar.extractall(root, filter="data", members=[m for m in tar.getmembers() if "/hero-" in m.name])
    dirs = sorted((root / "proxy_h200").iterdir())
    runs = [(d.name, read_metrics_frame(d), load_spec(d / "spec.yaml")) for d in dirs]
    return calibrate(runs, runs[0][2].total_steps, forecast)


def _judge(df, spec, forecast, cal):
    with np.errstate(all="ignore"):
        return monitor(df, spec, forecast, MonitorSettings(), calibration=cal)


def _raised(rep, prefix: str) -> list:
    return [f for f in rep.flags if f.kind.startswith(prefix) and f.severity != "info"]


def test_a_held_out_seed_is_a_replicate_judged_silent(held, forecast, cal):
    rep = _judge(*held, forecast, cal)
    assert rep.summary["calibration_scope"]["relation"] == "replicate"
    assert rep.worst in (None, "info"), [(f.kind, f.severity) for f in rep.flags]


def test_another_spec_is_judged_against_the_calibrated_one_and_the_difference_is_named(held, forecast, cal):
    df, spec = held
    scope = _judge(df, spec.replace(**{"optim.eps": 1e-3}), forecast, cal).summary["calibration_scope"]
    assert scope["relation"] == "other_spec"
    assert [d for d in scope["differs"] if d.startswith("optim.eps:")] and len(scope["differs"]) == 1


def _periodic_eval_times(df, factor: float):
    out = df.copy()
    final = out["extra.eval_final"].fillna(False).astype(bool)
    for col in ("eval_loss", "extra.eval_loss_periodic"):
        out.loc[~final, col] = out.loc[~final, col] * factor
    return out


def test_an_eval_level_off_by_ten_percent_is_flagged_on_the_healthy_runs_sample(held, forecast, cal):
    df, spec = held
    assert cal.eval_sample == UNMARKED == eval_sample(df)
    assert _raised(_judge(_periodic_eval_times(df, 1.10), spec, forecast, cal), "eval_loss_above_band")


def test_a_run_whose_periodic_evals_scored_another_sample_is_not_judged_on_their_level(held, forecast, cal):
    df, spec = held
    df = _periodic_eval_times(df, 1.10)
    df["extra.eval_periodic_windows"] = np.where(df["eval_loss"].notna(), 128.0, np.nan)
    rep = _judge(df, spec, forecast, cal)
    assert not _raised(rep, "eval_loss") and not _raised(rep, "train_eval_gap")
    assert "stratified:128" in rep.summary["eval_not_calibrated"]
    assert "stratified:128" in rep.summary["calibration_scope"]["eval_skipped"]


def _loss_times_from(df, step: int, factor: float):
    out = df.copy()
    out.loc[out["step"] >= step, "loss"] *= factor
    return out


def test_a_replicate_whose_loss_steps_up_eight_percent_is_flagged(held, forecast, cal):
    df, spec = held
    assert _raised(_judge(_loss_times_from(df, 1500, 1.08), spec, forecast, cal), "loss_above_band")


def test_a_branch_is_not_flagged_for_its_step_away_at_the_join(held, forecast, cal):
    df, spec = held
    branch = spec.replace(role="branch", **{"lineage.parent_id": "f5e935e1ecc24199", "lineage.resume_step": 1500})
    rep = _judge(_loss_times_from(df, 1500, 1.08), branch, forecast, cal)
    assert rep.summary["calibration_scope"]["relation"] == "branch"
    assert rep.summary["calibration_scope"]["level_until_step"] == 1500
    assert not _raised(rep, "loss_")


def test_a_branch_that_steps_up_after_its_join_is_flagged(held, forecast, cal):
    df, spec = held
    branch = spec.replace(role="branch", **{"lineage.parent_id": "f5e935e1ecc24199", "lineage.resume_step": 1500})
    rep = _judge(_loss_times_from(_loss_times_from(df, 1500, 1.08), 2000, 1.08), branch, forecast, cal)
    flags = _raised(rep, "loss_above_band")
    assert flags and flags[0].first_step >= 2000


def test_an_lr_that_leaves_its_schedule_mid_run_is_critical_at_once(held, forecast, cal):
    df, spec = held
    df = df.copy()
    df.loc[df["step"] >= 500, "lr"] *= 30
    check_spec_matches(spec, df)  # it followed the schedule first: the spec's run with a fault
    flags = [f for f in _judge(df, spec, forecast, cal).flags if f.kind == "lr_off_schedule"]
    assert [(f.severity, f.first_step) for f in flags] == [("critical", 500)]


def test_an_lr_off_its_schedule_from_the_start_is_another_spec(held):
    df, spec = held
    df = df.copy()
    df["lr"] *= 2
    with pytest.raises(MetricsError, match="is not the run's"):
        check_spec_matches(spec, df)


def test_a_gzipped_forecast_reads_as_the_plain_one(tmp_path, forecast):
    plain = tmp_path / "forecast.json"
    plain.write_bytes(gzip.open(LADDER / "budget" / "forecast.json.gz").read())
    again = load_forecast(plain)
    assert again.hero == forecast.hero and again.created == forecast.created and np.array_equal(again.traj_loss, forecast.traj_loss)
