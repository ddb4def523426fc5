"""Expert load: the busiest expert's share of the routed work, as the monitor judges it.

Every step's record carries expert_load_max, the busiest expert's assignments over the mean
expert's (the largest over the layers): 1.0 is perfect balance, and with E routed experts and
top-k routing it cannot pass E / k (every token picks that expert). Healthy H200 heroes (64
experts, top-8) start near 8 (an untrained router), come below 4 within about 5% of training and
sit at 1.5-2 late; a router whose balancing stopped drives it back towards 8. On an expert-parallel
mesh that is dropped tokens (capacity-bounded dispatch) or one rank doing several times the
others' expert work while they wait (dropless).

    flags, summary = check_sequential_load(c)   # the calibrated tests, the load's flags named
    flags, summary = check_expert_load(c)       # the absolute rule and the trend

The flags:

- `expert_load_imbalance` (warning; critical once the departure reaches crit_sd healthy sds): with a
  calibration, the sequential test of analysis.monitor.calib on log(expert_load_max) against the
  healthy runs' own level per block (no forecast of the load: the reference is the healthy mean, as
  for router entropy) alarmed upwards, the healthy sd floored at `load_min_sd` (10% in log units:
  the heroes' healthy sd there is 3-9%, and seed 3 of the four, judged by the other three, sat 22%
  above them at 10-14% of training, where the router is still settling; a busiest expert 10% busier
  costs a mesh at most a tenth of its expert time). A load below the healthy runs' (better balanced)
  is `expert_load_max_below_band` at info: it costs nothing.
- `expert_load_imbalance` (warning; info with a calibration of the load, whose test judges), without
  one: the rolling median of `load_smooth` points above `load_warn` times the mean for `load_k`
  consecutive points once the run's own router has settled (that median below `load_warn` for
  `load_smooth` points in a row past the early transient: a router still balancing dips under it and
  back), or never settled by `load_settle_frac` of training. Why 4x: with 64 experts top-8 it is the
  busiest expert picked by half of all tokens (4 x 8 / 64), half of the way to the whole batch; at
  the dispatch's capacity factor 1.15 it overflows its capacity 3.5 times (about 70% of its
  assignments dropped), or, dropless, its rank's expert work is 4x the mean rank's. The healthy runs
  committed (the budget ladder's eight, the first ladder's twelve with the hero's four seeds) never
  hold a settled rolling median above 4: their highest once settled is 3.86 (the first ladder's d192
  and d320 at seed 1, just after settling), the heroes' 3.6; they settle by step 98-185. Where E / k
  is not above `load_warn` the load cannot reach it and the rule is not applied.
- `expert_load_rising` (info): the rolling median of `load_trend_points` points, past the
  settling, risen over its own minimum since then by more than `load_trend_ratio`: healthy runs'
  load falls through training (the heroes' from about 3 at 5% to 1.7 at the end); the committed
  ones' largest such rise is 1.19.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from analysis.monitor.checks import RunCurves
from analysis.monitor.flags import Flag
from analysis.monitor.seq import check_sequential
from analysis.monitor.series import block_mean, residual, series_values
from analysis.monitor.stats import first_run, json_num

__all__ = ["LOAD", "check_expert_load", "check_sequential_load", "max_possible_load"]

LOAD = "expert_load_max"
MESH = "on an expert-parallel mesh: dropped tokens, or one rank's expert work stalling the step"


def max_possible_load(spec) -> float | None:
    """E / k: the busiest expert's load over the mean when every token picks it; None without a spec."""
    m = getattr(spec, "model", None)
    e, k = getattr(m, "n_routed_experts", None), getattr(m, "top_k", None)
    return float(e) / float(k) if e and k else None


def check_sequential_load(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """analysis.monitor.seq.check_sequential (the false-alarm rate split over every series it
    tests, the load included), with the load's flags named for what they mean: above its band is
    `expert_load_imbalance`, below it (better balanced than healthy runs) is for the record."""
    flags, summary = check_sequential(c)  # the load's healthy sd floored at load_min_sd there
    out = []
    for f in flags:
        if f.kind == f"{LOAD}_below_band":
            out.append(Flag(f.kind, "info", f.first_step, {**f.evidence, "text": "expert load better balanced than "
                            "the healthy runs': " + f.evidence["text"]}))
        elif f.kind == f"{LOAD}_above_band":
            out.append(_imbalance_flag(c, f))
        else:
            out.append(f)
    return out, summary


def _imbalance_flag(c: RunCurves, f: Flag) -> Flag:
    cal = c.calibration
    edges = cal.edges_array
    steps, v = series_values(c.df, LOAD)
    m = block_mean(steps, residual(LOAD, steps, v, None), edges, complete_to=int(steps[-1]))
    mu = np.asarray(cal.series[LOAD].mu, dtype=np.float64)
    b = int(np.clip(np.searchsorted(edges, f.first_step, side="right") - 1, 0, len(mu) - 1))
    run, healthy = (math.exp(x) if np.isfinite(x) else float("nan") for x in (m[b], mu[b]))
    ev = f.evidence
    how = ("its level against the healthy runs'" if ev.get("test") == "level"
           else "a change against its own recent level")
    u = ev.get("sd_from_healthy")
    text = (f"expert load imbalance: the busiest expert's load {run:.2f}x the mean (block mean to step "
            f"{edges[b + 1] - 1}) where the healthy runs sit at {healthy:.2f}x, "
            f"{u if u is not None else float('nan'):+.1f} healthy sds at the alarm; the sequential test ({how}) alarmed at step {f.first_step}, the rise beginning "
            f"near step {ev.get('onset_step')}")
    if ev.get("critical_step") is not None:
        text += f"; critical from step {ev['critical_step']}"
    text += f" ({MESH})"
    return Flag("expert_load_imbalance", f.severity, f.first_step, {
        **ev, "text": text, "load_max_over_mean": json_num(run), "healthy_load_max_over_mean": json_num(healthy),
        "series": LOAD})


def check_expert_load(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`expert_load_imbalance` by the absolute rule and `expert_load_rising` (module docstring)."""
    sv = series_values(c.df, LOAD)
    if sv is None:
        return [], {}
    # a calibration without the load (a file written before it was a series) does not judge it
    cfg, calibrated = c.cfg, c.calibration is not None and LOAD in c.calibration.series
    steps, v = sv
    v = np.asarray(v, dtype=np.float64)
    rm = pd.Series(v).rolling(cfg.load_smooth, min_periods=cfg.load_smooth).median().to_numpy()
    past = steps >= c.transient_end
    summary: dict[str, Any] = {"expert_load_max": json_num(v[-1]),
                               "expert_load_max_smoothed": json_num(rm[-1]) if np.isfinite(rm[-1]) else None}
    top = max_possible_load(c.spec)
    # settled: the rolling median below load_warn for load_smooth points in a row past the transient
    # (a router still balancing hovers about it a while: healthy heroes dip under 4 and back over)
    below = pd.Series(past & np.isfinite(rm) & (rm < cfg.load_warn)).rolling(cfg.load_smooth).sum().to_numpy()
    settled = np.flatnonzero(below >= cfg.load_smooth)
    settle = int(settled[0]) if len(settled) else None
    summary["expert_load_settled_step"] = int(steps[settle]) if settle is not None else None
    flags: list[Flag] = []
    sev = "info" if calibrated else "warning"
    if top is None or top > cfg.load_warn:
        why = (f"{cfg.load_warn:g}x the mean" + (f" (the most it can be is {top:g}x: every token picking that expert)"
                                                 if top is not None else ""))
        if settle is not None:
            over = (np.arange(len(v)) > settle) & np.isfinite(rm) & (rm > cfg.load_warn)
            hit = first_run(over, cfg.load_k)
            if hit:
                a, b = hit
                i = a + cfg.load_k - 1
                flags.append(Flag("expert_load_imbalance", sev, int(steps[i]), {
                    "text": f"expert load imbalance: the busiest expert's load {rm[i]:.2f}x the mean (median of "
                            f"{cfg.load_smooth} points) at step {steps[i]}, above {why} for {cfg.load_k} points from "
                            f"step {steps[a]}, after the router had settled at {rm[settle]:.2f}x by step "
                            f"{steps[settle]}; max {np.nanmax(rm[a:]):.2f}x ({MESH})",
                    "load_max_over_mean": json_num(rm[i]), "threshold": cfg.load_warn, "onset_step": int(steps[a]),
                    "settled_step": int(steps[settle]), "rule": "absolute", "series": LOAD}))
        elif c.spec is not None and steps[-1] >= cfg.load_settle_frac * c.spec.total_steps:
            i = int(np.searchsorted(steps, math.ceil(cfg.load_settle_frac * c.spec.total_steps)))
            i = min(i, len(steps) - 1)
            flags.append(Flag("expert_load_imbalance", sev, int(steps[i]), {
                "text": f"expert load imbalance: the busiest expert's load never came below {why} (median of "
                        f"{cfg.load_smooth} points) by {cfg.load_settle_frac:.0%} of training (step {steps[i]}: "
                        f"{rm[i]:.2f}x): the router never balanced ({MESH})",
                "load_max_over_mean": json_num(rm[i]), "threshold": cfg.load_warn, "onset_step": int(steps[0]),
                "settled_step": None, "rule": "absolute", "series": LOAD}))
    if settle is not None:
        tr = pd.Series(v[settle:]).rolling(cfg.load_trend_points, min_periods=cfg.load_trend_points).median().to_numpy()
        low = np.fmin.accumulate(np.where(np.isfinite(tr), tr, np.inf))
        ratio = np.where(np.isfinite(tr) & np.isfinite(low), tr / low, np.nan)
        up = np.flatnonzero(np.nan_to_num(ratio, nan=0.0) > cfg.load_trend_ratio)
        summary["expert_load_rise"] = json_num(np.nanmax(ratio)) if np.isfinite(ratio).any() else None
        if len(up):
            j = int(up[0])
            i, lo = settle + j, settle + int(np.argmin(np.where(np.isfinite(tr[: j + 1]), tr[: j + 1], np.inf)))
            flags.append(Flag("expert_load_rising", "info", int(steps[i]), {
                "text": f"expert load rising: the busiest expert's load {tr[j]:.2f}x the mean (median of "
                        f"{cfg.load_trend_points} points) at step {steps[i]}, {ratio[j]:.2f} times its low of "
                        f"{low[j]:.2f}x at step {steps[lo]} (healthy runs' load falls through training)",
                "load_max_over_mean": json_num(tr[j]), "low": json_num(low[j]), "low_step": int(steps[lo]),
                "ratio": json_num(ratio[j]), "threshold": cfg.load_trend_ratio, "series": LOAD}))
    return flags, summary
