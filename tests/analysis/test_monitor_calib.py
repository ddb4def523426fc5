"""The monitor's calibration on healthy runs and its sequential test, on simulated runs whose
healthy spread is known: its false-alarm rate, its detection delay, and the checks it feeds."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.monitor.watch import MonitorSettings, monitor
from analysis.monitor.calib import Calibration, calibrate, cusum_threshold, load_calibration
from analysis.monitor.seq import sequential_test
from analysis.monitor.spread import effective_dof, tail_widening
from analysis.monitor.series import eval_series, series_values, source_eval_names
from analysis.forecast.file import ForecastError, load_forecast
from tests.analysis.test_monitor import forecast_file

TOTAL = 1000


def healthy_run(rng, shift_from: int | None = None, shift: float = 0.0) -> pd.DataFrame:
    """A loss curve with a run-level offset that wanders slowly (a seed's own data order) and
    per-step noise; `shift` (relative) from step shift_from on."""
    t = np.arange(TOTAL)
    level = 0.02 * rng.standard_normal() + np.cumsum(0.002 * rng.standard_normal(TOTAL))
    log_loss = np.log(2 + 3 * np.exp(-t / 200)) + level + 0.05 * rng.standard_normal(TOTAL)
    if shift_from is not None:
        log_loss[shift_from:] += math.log1p(shift)
    return pd.DataFrame({"step": t, "loss": np.exp(log_loss)})


def cal_from(rng, n: int = 6) -> Calibration:
    return calibrate([(f"h{i}", healthy_run(rng), None) for i in range(n)], TOTAL)


def test_cusum_threshold_meets_the_run_length_the_false_alarm_rate_asks():
    """Siegmund's ARL0 at the returned h equals -blocks / ln(1 - alpha); a lower rate needs a higher h."""
    for blocks, alpha, k in ((100, 0.01, 0.5), (50, 0.05, 2.0)):
        h = cusum_threshold(blocks, alpha, k)
        b = 2 * k * (h + 1.166)
        assert math.isclose((math.expm1(b) - b) / (2 * k * k), -blocks / math.log1p(-alpha), rel_tol=1e-6)
    assert cusum_threshold(100, 0.001) > cusum_threshold(100, 0.01)


def test_healthy_runs_the_calibration_never_saw_alarm_near_the_stated_rate():
    """Per direction, averaged over calibrations from 6 runs each (a calibration is itself a
    sample): within 2.5x of the stated rate. The fault suite measures it on real replicates."""
    alpha, n, rates = 0.02, 150, []
    for seed in (0, 7, 11):
        rng = np.random.default_rng(seed)
        cal = cal_from(rng)
        hits = 0
        for _ in range(n):
            res = sequential_test(*series_values(healthy_run(rng), "loss"), "loss", cal, None, alpha)
            hits += (res.alarm_up is not None) + (res.alarm_down is not None)
        rates.append(hits / (2 * n))
    assert np.mean(rates) <= 2.5 * alpha, rates


def test_the_pooled_spread_counts_runs_not_correlated_blocks():
    """Five pooled blocks of two runs (1 dof each): 5 dof when their deviations are independent, 1
    when a run's level never changes, between otherwise; and the tail widening grows as dof fall."""
    d = np.ones(20)
    assert effective_dof(d, np.zeros(4))[10] == pytest.approx(5.0)
    assert effective_dof(d, np.ones(4))[10] == pytest.approx(1.0)
    assert 1.0 < effective_dof(d, np.full(4, 0.7))[10] < 5.0
    assert tail_widening(30, 1e-4) < tail_widening(4, 1e-4) < tail_widening(2, 1e-4)


def test_two_healthy_runs_whose_levels_wander_keep_the_stated_rate_on_a_third():
    """Two healthy runs: each block's variance has one degree of freedom, and the blocks pooled
    with it share the same two wandering levels (a pair that happens to agree agrees in all of
    them), so the pool's effective dof counts runs, not blocks, and with no run to leave out the
    t distribution at the tolerance's tail widens the band. Averaged over pairs (a pair is itself
    a sample), a third healthy run alarms within 2.5x of the stated rate per direction; counting
    the pooled blocks as independent (5 dof) it alarmed at about 9x."""
    alpha, hits, tries = 0.02, 0, 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        cal = cal_from(rng, n=2)
        assert cal.series["loss"].dof < 3  # well under the (R - 1)(2 w + 1) = 5 of independent blocks
        for _ in range(15):
            res = sequential_test(*series_values(healthy_run(rng), "loss"), "loss", cal, None, alpha)
            hits += (res.alarm_up is not None) + (res.alarm_down is not None)
            tries += 2
    assert hits / tries <= 2.5 * alpha, hits / tries


def test_a_step_of_four_healthy_sds_is_caught_within_three_percent_of_training():
    """At step 500 the healthy runs spread by about 4.5% (their levels wander); a 20% step is
    about 4 of their sds. A step inside the healthy spread is, by design, not a fault."""
    rng = np.random.default_rng(1)
    cal = cal_from(rng)
    delays = []
    for _ in range(40):
        df = healthy_run(rng, shift_from=500, shift=0.20)
        res = sequential_test(*series_values(df, "loss"), "loss", cal, None, 0.01)
        assert res.alarm_up is not None
        delays.append(cal.edges[res.alarm_up + 1] - 1 - 500)
    assert np.median(delays) <= 0.03 * TOTAL, delays


def test_the_monitor_warns_on_a_calibrated_departure_and_stays_quiet_on_a_healthy_run():
    rng = np.random.default_rng(2)
    cal = cal_from(rng)
    quiet = monitor(healthy_run(rng), calibration=cal)
    assert not [f for f in quiet.flags if f.severity != "info"], [(f.kind, f.evidence["text"]) for f in quiet.flags]
    loud = monitor(healthy_run(rng, shift_from=600, shift=0.6), calibration=cal)
    f = next(f for f in loud.flags if f.kind == "loss_above_band")
    assert f.severity == "critical" and 600 <= f.first_step <= 620
    assert 590 <= f.evidence["onset_step"] <= 610


def test_calibration_round_trips_and_refuses_another_forecast(tmp_path):
    rng = np.random.default_rng(3)
    t = np.arange(TOTAL)
    fc = load_forecast(forecast_file(tmp_path / "f.json", t, 2 + 3 * np.exp(-t / 200), 0.05))
    cal = calibrate([(f"h{i}", healthy_run(rng), None) for i in range(3)], TOTAL, forecast=fc)
    back = load_calibration(cal.save(tmp_path / "cal.json"))
    assert back.runs == cal.runs and back.forecast == cal.forecast
    assert back.edges == cal.edges and np.allclose(back.series["loss"].sd, cal.series["loss"].sd, equal_nan=True)
    back.check_forecast(fc)
    with pytest.raises(ValueError, match="pass it with --forecast"):
        back.check_forecast(None)
    other = forecast_file(tmp_path / "g.json", t, 2 + 3 * np.exp(-t / 200), 0.05)
    doc = json.loads(other.read_text())
    doc["created"] = "another"
    other.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="calibrate again"):
        monitor(healthy_run(rng), forecast=load_forecast(other), calibration=back)


def test_a_calibration_needs_two_healthy_runs():
    with pytest.raises(ValueError, match="at least 2 healthy runs"):
        calibrate([("h", healthy_run(np.random.default_rng(4)), None)], TOTAL)


def _eval_frame(eval_values, se=None) -> pd.DataFrame:
    steps = np.arange(200)
    df = pd.DataFrame({"step": steps, "loss": 3.0 - 0.004 * steps})
    ev = np.full(200, np.nan)
    at = np.arange(19, 200, 20)
    ev[at] = eval_values
    df["eval_loss"] = ev
    if se is not None:
        s = np.full(200, np.nan)
        s[at] = se
        df["eval_loss_se"] = s
    return df


def test_train_falling_while_eval_rises_is_critical_and_eval_falling_is_not():
    falling = 3.0 - 0.004 * np.arange(19, 200, 20)
    assert "train_eval_divergence" not in {f.kind for f in monitor(_eval_frame(falling)).flags}
    rising = falling.copy()
    rising[5:] = falling[4] + 0.1 * np.arange(1, 6)  # from step 119 on, eval climbs
    f = next(f for f in monitor(_eval_frame(rising)).flags if f.kind == "train_eval_divergence")
    assert f.severity == "critical" and f.first_step == 139


def test_train_eval_divergence_weighs_the_rise_by_eval_loss_se():
    falling = 3.0 - 0.004 * np.arange(19, 200, 20)
    rising = falling.copy()
    rising[5:] = falling[4] + 0.1 * np.arange(1, 6)
    assert "train_eval_divergence" not in {f.kind for f in monitor(_eval_frame(rising, se=0.2)).flags}
    assert "train_eval_divergence" in {f.kind for f in monitor(_eval_frame(rising, se=0.01)).flags}


def test_a_throughput_drop_against_the_runs_own_rate_warns():
    steps = np.arange(200)
    tps = np.where(steps < 120, 1000.0, 200.0)
    df = pd.DataFrame({"step": steps, "loss": 3 - 0.001 * steps, "tokens_per_s": tps})
    f = next(f for f in monitor(df).flags if f.kind == "throughput_drop")
    assert f.severity == "warning" and 120 <= f.first_step <= 140
    steady = df.assign(tokens_per_s=np.where(steps < 120, 1000.0, 800.0))
    assert "throughput_drop" not in {f.kind for f in monitor(steady).flags}


def test_spikes_warn_only_past_what_healthy_runs_show():
    rng = np.random.default_rng(5)
    cal = cal_from(rng)
    df = healthy_run(rng)
    df.loc[700, "loss"] *= 1.6
    f = next(f for f in monitor(df, calibration=cal).flags if f.kind == "loss_spike")
    assert f.severity == "warning" and f.first_step == 700
    uncalibrated = next(f for f in monitor(df, settings=MonitorSettings(spike_gross_factor=100)).flags
                        if f.kind == "loss_spike")
    assert uncalibrated.severity == "info"


def test_the_eval_series_is_the_periodic_subset_as_the_trainer_records_it():
    """The trainer's extras: eval_loss_periodic continues through the final eval (every window),
    whose standard error is the whole set's and is dropped."""
    df = pd.DataFrame({"step": [9, 19, 29], "loss": [3.0, 2.9, 2.8], "eval_loss": [3.1, 3.0, 2.5],
                       "extra.eval_loss_periodic": [3.1, 3.0, 2.95], "extra.eval_loss_se": [0.02, 0.02, 0.005],
                       "extra.eval_final": [0.0, 0.0, 1.0], "extra.eval_loss/code": [3.2, 3.1, 2.6]})
    ev, se = eval_series(df)
    assert list(ev) == [3.1, 3.0, 2.95]
    assert list(se[:2]) == [0.02, 0.02] and np.isnan(se[2])
    assert source_eval_names(df) == ["eval_loss/code"]
    steps, v = series_values(df, "eval_loss/code")
    assert list(steps) == [9, 19] and list(v) == [3.2, 3.1]


def test_a_forecast_hero_field_of_the_wrong_type_is_refused_naming_it(tmp_path):
    t = np.arange(TOTAL)
    path = forecast_file(tmp_path / "f.json", t, 2 + 3 * np.exp(-t / 200), 0.05)
    doc = json.loads(path.read_text())
    assert load_forecast(path).hero.spec_id == "x"
    doc["hero"]["tokens_per_step"] = "4096"
    path.write_text(json.dumps(doc))
    with pytest.raises(ForecastError, match=r"hero\.tokens_per_step is str, not int"):
        load_forecast(path)
