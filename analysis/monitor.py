"""Watch a live run against its forecast and flag what deviates.

    report = monitor(df, spec=None, forecast=None, settings=MonitorSettings(), ...)

`df` is a metrics frame (analysis.metrics_io.read_metrics_frame): step, loss and whatever else the
run logged. Each flag is {kind, severity (info | warning | critical), first_step, evidence}; the
evidence holds a sentence ("text") and the numbers behind it. The kinds:

- `non_finite` (critical): a NaN or inf loss or grad norm.
- `run_diverged` / `run_failed` (critical): the run's status.json says so.
- `loss_above_band` (warning) / `loss_below_band` (info): the (optionally smoothed) loss lies above
  the forecast band's upper edge (or below its lower edge) for `band_k` consecutive points. Matched
  by step, or by tokens when the run's tokens per step differ from the forecast hero's.
- `loss_jump` (warning; critical past `loss_jump_crit`): the loss, smoothed by a rolling median of
  `loss_jump_smooth` points, rises more than `loss_jump_warn` (relative) above its running minimum,
  and by more than `loss_jump_sigma` times the smoothed loss's own noise (robust scatter of the
  step-to-step differences): a small run's batch-to-batch noise alone moves its smoothed loss by
  10%, a divergence moves it by tens of sigmas. This is the divergence alarm.
- `loss_spike` / `grad_norm_spike` (warning): a point more than `spike_sigma` standard deviations
  above the linear trend of the previous `spike_local_window` points. The evidence also reports the
  spike score as OLMo 2 defines it: the share of points more than 7 sigma from the rolling mean of
  the previous 1,000 points (`spike_window`). That score alone misses spikes on a curve that is still
  falling fast (the fall inflates the rolling sigma), hence the local-trend test for the flag.
- `grad_norm_high` (warning above `grad_norm_warn`, critical above `grad_norm_crit`; defaults 2 and 4
  as on the Marin ladder): the rolling median of `grad_norm_k` points over the threshold, after the
  warmup (`ignore_first_steps`, default: the spec's warmup steps).
- `grad_norm_above_envelope` (warning): grad norm above the forecast envelope's upper edge for
  `band_k` consecutive points.
- `grad_norm_growth` (warning): over a trailing window (`grad_trend_window_frac` of the points after
  warmup, at least `grad_trend_min_points`), log(grad norm) grows by a factor more than
  `grad_trend_ratio` times what the forecast envelope grows over the same steps (no envelope: flat),
  with the slope at least `grad_trend_min_t` standard errors above zero.
- `token_drops` (warning; critical past `drop_crit`): drop_frac_send + drop_frac_recv above
  `drop_budget` (default 7%, Marin's alert) for `drop_k` consecutive points after the warmup.
- `router_entropy_collapse` (warning): the rolling median of router entropy (nats, mean per token)
  falls below `entropy_floor_frac` x log(top_k) -- a router whose tokens put all their weight on
  fewer experts than they are routed to, so top-k degenerates toward top-1 -- or below
  `entropy_rel_floor` x its early value (median of its first `entropy_early_points` after warmup),
  a sharp fall from the near-uniform log(n_experts) at initialisation.
- `throughput_low` (warning): measured tokens/s (tokens over wall time across the last
  `throughput_points` records, else the median logged tokens/s) below
  `throughput_frac` x the plan (given tokens/s, or the spec's hardware at its expected MFU), with the
  projected finish date at the measured rate.
- `forecast_spec_mismatch` (info): the forecast was made for another spec id than the run's.

Where things are: the settings, flags and report in analysis.monitor_types; one check function per
flag family in analysis.monitor_checks (CHECKS below runs them in order); the statistics they share
in analysis.monitor_stats; the forecast file's reader in analysis.forecast_file; the picture in
analysis.monitor_plot.
"""

from __future__ import annotations

import time as _time
from typing import Any

import numpy as np
import pandas as pd

from analysis.forecast_file import Forecast, load_forecast
from analysis.monitor_calib import Calibration, load_calibration
from analysis.monitor_checks import (RunCurves, check_band, check_grad_norm, check_loss_jump, check_non_finite,
                                     check_router_entropy, check_run_status, check_spikes, check_throughput,
                                     check_token_drops)
from analysis.monitor_seq import check_sequential, check_throughput_drop, check_train_eval
from analysis.monitor_stats import (column, json_num, measured_tokens_per_s, olmo_spike_score, planned_tokens_per_s,
                                    spec_warmup_steps)
from analysis.monitor_types import SEVERITY_RANK, Flag, MonitorReport, MonitorSettings, Severity
from core.spec import Spec

__all__ = ["CHECKS", "Calibration", "Flag", "load_calibration", "transient_end", "Forecast", "MonitorReport", "MonitorSettings", "SEVERITY_RANK", "Severity", "load_forecast",
           "measured_tokens_per_s", "monitor", "olmo_spike_score", "planned_tokens_per_s", "spec_warmup_steps"]

# One function per flag family, in the order their flags and summaries are gathered.
CHECKS = (check_non_finite, check_run_status, check_band, check_sequential, check_train_eval, check_loss_jump,
          check_spikes, check_grad_norm, check_token_drops, check_router_entropy, check_throughput, check_throughput_drop)


def transient_end(spec: Spec | None, forecast: Forecast | None, calibration: Calibration | None,
                  cfg: MonitorSettings) -> tuple[int, str]:
    """(first step past the early transient, where that comes from): the settings' ignore_first_steps;
    else what the healthy runs of the calibration show; else the later of the spec's warmup and the
    forecast trajectory's first step (the forecaster's own cut of the early curve)."""
    if cfg.ignore_first_steps is not None:
        return cfg.ignore_first_steps, "settings"
    if calibration is not None:
        return calibration.transient_end_step, "healthy runs"
    warm = spec_warmup_steps(spec) if spec else 0
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
    curves = RunCurves(df=df, spec=spec, forecast=forecast, cfg=cfg, status=status,
                       now=_time.time() if now is None else now, plan_tokens_per_s=plan_tokens_per_s, steps=steps,
                       loss=df["loss"].to_numpy(dtype=np.float64), grad_norm=column(df, "grad_norm"),
                       after_warm=steps >= skip, calibration=calibration, transient_end=skip)
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
        **found,
    }
    return flags, summary, cfg.model_dump()

