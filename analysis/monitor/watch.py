"""Watch a live run against its forecast and flag what deviates.

    report = monitor(df, spec=None, forecast=None, settings=MonitorSettings(), ..., calibration=None)

`df` is a metrics frame (analysis.runs.metrics.read_metrics_frame): step, loss and whatever else the
run logged. Each flag is {kind, severity, first_step, evidence}; the evidence holds a sentence
("text") and the numbers behind it. first_step is the step at which the monitor, reading the run
as it grew, would have raised the flag (its onset, where it differs, is in the evidence).

A severity is a promise. info: for the record (nothing to do). warning: look (a healthy run of
this spec does not do this). critical: act now (the run is broken or is wasting its compute).
Warnings can keep that promise only where healthy runs of the spec have been seen: `calibration`
(analysis.monitor.calib; bench/faults.py writes one from healthy replicates) gives the band's width
per stretch of training, the sequential tests, the early transient and the spike thresholds.
Without one, the forecast band is the forecast's own interval: departures from it are info unless
gross, one band width beyond it (three half-widths from its centre: 4.9 sd of a calibrated 90%
band, a chance of about 1e-6 for a healthy run's level; measured, the H200 hero's five healthy
seeds reach at most 1.5 half-widths of either committed forecast's band).

The kinds, with their severities:

- `non_finite` (critical): a NaN or inf loss or grad norm.
- `run_diverged` / `run_failed` (critical): the run's status.json says so.
- `lr_off_schedule` (critical): the logged LR followed the spec's schedule, then left it (a
  scheduler fault, a resume at the wrong step, a spike); an LR off it from the first points is
  another spec, refused where the run is read (analysis.runs.metrics.check_spec_matches).
- `train_eval_divergence` (critical): held-out eval loss risen over its running minimum (by
  `eval_rise_sigma` x its standard error where the records carry eval_loss_se, else by
  `eval_rise_rel`) while the train loss near it fell, at `eval_rise_points` consecutive eval
  points: a data fault (a mixture switch, repeated data).
- with a calibration, `<series>_above_band` / `<series>_below_band` for the train loss, grad norm,
  eval loss (and each source's), router entropy and the eval/train gap (warning; critical once the
  departure reaches `crit_sd` healthy sds): the level or change test of analysis.monitor.calib
  alarmed, at the stated `false_alarm_rate` a run (split over series and directions, the expert
  load's among them: its flags are `expert_load_imbalance` below).
- without a calibration, `loss_above_band` / `loss_below_band` (info; warning beyond the band by
  `band_gross_widths` band widths): the (optionally smoothed) loss outside the forecast band for
  `band_k` consecutive points; matched by step, or by tokens when the run's tokens per step differ
  from the forecast hero's.
- `loss_jump` (warning, info with a calibration; critical past `loss_jump_crit`): the loss,
  smoothed by a rolling median of `loss_jump_smooth` points, rises more than `loss_jump_warn`
  (relative) above its running minimum, and by more than `loss_jump_sigma` times the smoothed
  loss's own noise.
- `loss_spike` / `grad_norm_spike` (info; warning past the early transient when z passes the
  healthy runs' own largest spike in that stretch x `spike_healthy_margin`; without a
  calibration, a loss spike past `spike_gross_factor` x `spike_sigma`, a grad-norm spike never:
  healthy runs spike in grad norm): a point more than `spike_sigma` standard deviations above the
  quadratic trend of the previous `spike_local_window` points. The evidence
  also reports OLMo 2's spike score (share of points 7 sigma off the rolling mean of 1,000).
- `grad_norm_high` (warning above `grad_norm_warn`, critical above `grad_norm_crit`, Marin's 2
  and 4; info with a calibration, whose grad-norm band judges): the rolling median of
  `grad_norm_k` points over the threshold, past the early transient.
- `grad_norm_above_envelope` (info): grad norm above the forecast envelope's upper edge for
  `band_k` consecutive points (the envelope is the forecast's interval, not healthy spread).
- `grad_norm_growth` (warning; info with a calibration): over a trailing window log(grad norm)
  grows by more than `grad_trend_ratio` x what the forecast envelope grows, the slope
  `grad_trend_min_t` standard errors above zero.
- `repeated_batch` (critical; info when the spec allows more than one epoch): a step read the very
  same tokens as an earlier step (the recorded extra.batch_hash): a replay, a loop, a data loader
  restarted at its start.
- `token_drops` (warning; critical past `drop_crit`): drop_frac_send + drop_frac_recv above
  `drop_budget` (7%, Marin's alert) for `drop_k` consecutive points past the transient.
- `expert_load_imbalance` (warning; critical with a calibration once `crit_sd` healthy sds away):
  the busiest expert's load over the mean (expert_load_max) too high. With a calibration, the
  sequential test above on log(load) against the healthy runs' level, upwards, the healthy sd
  floored at `load_min_sd` (a load below the healthy band is `expert_load_max_below_band`, info);
  without one (info with one), its rolling median of `load_smooth` points above `load_warn` (4x:
  with 64 experts top-8 the busiest expert picked by half the tokens) for `load_k` points once the
  router has settled below it past the early transient, or not settled by `load_settle_frac` of
  training (analysis.monitor.load).
- `expert_load_rising` (info): the rolling median of `load_trend_points` load points risen over its
  own low since the router settled by more than `load_trend_ratio` (healthy runs' load falls).
- `router_entropy_collapse` (warning): the rolling median of router entropy below
  `entropy_floor_frac` x log(top_k) or `entropy_rel_floor` x its early value.
- `throughput_drop` (warning): the median logged tokens/s of the last `throughput_points` points
  below `throughput_drop_frac` of the run's own median before them (with a calibration, lower
  where the healthy runs' own rate swung lower: a shared machine's swings are not the run's).
- `throughput_low` (info): measured tokens/s below `throughput_frac` x the plan (given tokens/s,
  or the spec's hardware at its expected MFU), with the projected finish at the measured rate.
- `forecast_spec_mismatch` (info): the forecast was made for another spec id than the run's.

With a calibration the summary's `calibration_scope` says how it applies to the run
(analysis.monitor.scope: a replicate, a branch, another spec, and whether the eval-loss series are
judged: only on the healthy runs' eval sample, else `eval_not_calibrated` says why).

The early transient (where grad-norm, spike, drop and entropy tests wait): the settings'
`ignore_first_steps`; else where the calibration's healthy runs stop spiking (the first 5 clean
stretches in a row end it); else the later of the spec's
warmup and the forecast trajectory's first step (the forecaster's own cut of the early curve).

Where things are: the settings, flags and report in analysis.monitor.flags; one check function per
flag family in analysis.monitor.checks (CHECKS below runs them in order); the statistics they share
in analysis.monitor.stats; the forecast file's reader in analysis.forecast.file; the picture in
analysis.monitor.plot; the calibrated checks in analysis.monitor.seq, the expert-load checks in
analysis.monitor.load, the calibration and the sequential tests in analysis.monitor.calib.
"""

from __future__ import annotations

import time as _time
from typing import Any

import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast, load_forecast
from analysis.monitor.calib import Calibration, load_calibration
from analysis.monitor.checks import (RunCurves, check_band, check_grad_norm, check_loss_jump, check_lr_schedule,
                                     check_non_finite, check_repeated_batches, check_router_entropy, check_run_status,
                                     check_spikes, check_throughput, check_token_drops)
from analysis.monitor.load import check_expert_load, check_sequential_load
from analysis.monitor.scope import calibration_scope
from analysis.monitor.seq import check_throughput_drop, check_train_eval
from analysis.monitor.stats import (column, json_num, measured_tokens_per_s, olmo_spike_score, planned_tokens_per_s,
                                    spec_warmup_steps)
from analysis.monitor.flags import SEVERITY_RANK, Flag, MonitorReport, MonitorSettings, Severity
from core.spec import Spec

__all__ = ["CHECKS", "Calibration", "Flag", "Forecast", "MonitorReport", "MonitorSettings", "SEVERITY_RANK", "Severity",
           "load_calibration", "load_forecast", "measured_tokens_per_s", "monitor", "olmo_spike_score",
           "planned_tokens_per_s", "spec_warmup_steps", "transient_end"]

# One function per flag family, in the order their flags and summaries are gathered.
CHECKS = (check_non_finite, check_run_status, check_lr_schedule, check_repeated_batches, check_band, check_sequential_load, check_train_eval,
          check_loss_jump, check_spikes, check_grad_norm, check_token_drops, check_router_entropy, check_expert_load,
          check_throughput, check_throughput_drop)


def transient_end(spec: Spec | None, forecast: Forecast | None, calibration: Calibration | None,
                  cfg: MonitorSettings) -> tuple[int, str]:
    """(first step past the early transient, where that comes from): the settings' ignore_first_steps;
    else the later of what the healthy runs of the calibration show and the spec's warmup (while the
    learning rate still rises a spike that the healthy runs happened not to show is routine: a few
    replicates cannot rule it out); else the later of the spec's warmup and the forecast
    trajectory's first step (the forecaster's own cut of the early curve)."""
    if cfg.ignore_first_steps is not None:
        return cfg.ignore_first_steps, "settings"
    warm = spec_warmup_steps(spec) if spec else 0
    if calibration is not None:
        if warm > calibration.transient_end_step:
            return warm, "the spec's warmup (past the healthy runs' transient)"
        return calibration.transient_end_step, "healthy runs"
    first = int(forecast.traj_step[0]) if forecast is not None and len(forecast.traj_step) else 0
    return max(warm, first), "warmup / forecast start"


def monitor(
    df: pd.DataFrame,
    spec: Spec | None = None,
    forecast: Forecast | None = None,
    settings: MonitorSettings | None = None,
    *,
    plan_tokens_per_s: float | None = None,
    status: dict | None = None,
    now: float | None = None,
    calibration: Calibration | None = None,
) -> MonitorReport:
    cfg = settings or MonitorSettings()
    if calibration is not None:
        calibration.check_forecast(forecast)
    steps = df["step"].to_numpy(dtype=np.int64)
    skip, skip_from = transient_end(spec, forecast, calibration, cfg)
    scope = calibration_scope(calibration, spec, df) if calibration is not None else None
    curves = RunCurves(df=df, spec=spec, forecast=forecast, cfg=cfg, status=status,
                       now=_time.time() if now is None else now, plan_tokens_per_s=plan_tokens_per_s, steps=steps,
                       loss=df["loss"].to_numpy(dtype=np.float64), grad_norm=column(df, "grad_norm"),
                       after_warm=steps >= skip, calibration=calibration, transient_end=skip, scope=scope)
    flags: list[Flag] = []
    found: dict = {}
    for check in CHECKS:
        f, summary = check(curves)
        flags += f
        found.update(summary)
    return MonitorReport(*_summarise(curves, flags, found))


def _summarise(c: RunCurves, flags: list[Flag], found: dict) -> tuple[list[Flag], dict, dict]:
    steps, loss, n, spec, cfg = c.steps, c.loss, c.n, c.spec, c.cfg
    finite_loss = np.where(np.isfinite(loss), loss, np.nan)
    flags.sort(key=lambda f: (f.first_step, -SEVERITY_RANK[f.severity]))
    summary: dict[str, Any] = {
        "points": int(n),
        "step": int(steps[-1]) if n else None,
        "tokens": json_num(column(c.df, "tokens")[-1]) if column(c.df, "tokens") is not None else None,
        "loss": json_num(loss[-1]) if n else None,
        "loss_smoothed": json_num(np.median(finite_loss[np.isfinite(finite_loss)][-cfg.loss_jump_smooth:]))
        if np.isfinite(finite_loss).any() else None,
        "spec_id": spec.id if spec else None,
        "total_steps": spec.total_steps if spec else None,
        "spike_score": {},
        "transient_end_step": int(c.transient_end),
        "calibrated": c.calibration is not None,
        "calibration_scope": c.scope.to_dict() if c.scope is not None else None,
        **found,
    }
    return flags, summary, cfg.model_dump()

