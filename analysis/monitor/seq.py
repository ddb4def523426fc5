"""The monitor's calibrated checks: the sequential test of each series against its healthy band,
train falling while held-out eval rises, and a throughput drop against the run's own rate.
analysis.monitor.watch documents every flag; analysis.monitor.calib the calibration and the test."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from analysis.monitor.calib import K_REF, Calibration, cusum_threshold, own_change
from analysis.forecast.file import Forecast
from analysis.monitor.spread import tail_widening
from analysis.monitor.series import block_mean, eval_series, is_eval_series, residual, series_values, throughput_ratio
from analysis.monitor.checks import RunCurves
from analysis.monitor.stats import column, json_num
from analysis.monitor.flags import Flag

# a series whose healthy sd has its own floor (a MonitorSettings field) instead of min_sd: a busiest expert
# within load_min_sd of the healthy runs' load is no fault a mesh feels, however alike those runs were
_SD_FLOOR = {"expert_load_max": "load_min_sd"}
# what each series' departure means; a data fault shows first in the train/eval gap
_WHAT = {"loss": "train loss", "grad_norm": "grad norm", "eval_loss": "held-out eval loss",
         "router_entropy": "router entropy", "train_eval_gap": "eval loss / train loss"}


def _block_step(edges: np.ndarray, b: int) -> int:
    return int(edges[b + 1] - 1)


def check_sequential(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`<series>_above_band` / `<series>_below_band`: the CUSUM on the standardised block residual
    alarms (warning); critical when the departure reaches crit_sd healthy sds after the alarm. An
    alarm of the change test (the run against its own recent level) warns from the first block
    where the run is also warn_sd healthy sds from the healthy runs; until then it is info."""
    cal, cfg = c.calibration, c.cfg
    if cal is None:
        return [], {}
    flags: list[Flag] = []
    summary: dict[str, Any] = {}
    edges = cal.edges_array
    scope = c.scope
    skip_eval = scope is not None and scope.eval_skipped is not None
    present = {name: sv for name in cal.series
               if not (skip_eval and is_eval_series(name)) and (sv := series_values(c.df, name)) is not None}
    if skip_eval:
        summary["eval_not_calibrated"] = scope.eval_skipped
    level_until = scope.level_until_step if scope is not None else None
    few = sorted({cal.series[n].runs for n in present if cal.series[n].runs < 3})
    if few:
        summary["calibration_few_runs"] = (
            f"calibrated on {few[0]} healthy runs: none can be left out to measure the band's width, so it is "
            f"widened by the t distribution of its few degrees of freedom at the tests' tail (analysis.monitor.calib) "
            f"and only departures far outside the healthy runs alarm; calibrate on 3 or more")
    # the run's false-alarm rate, split evenly over the series tested and their two directions
    alpha = cfg.false_alarm_rate / max(2 * len(present), 1)
    for series, (steps, v) in present.items():
        col = stem = series
        floor = getattr(cfg, _SD_FLOOR[series]) if series in _SD_FLOOR else cfg.min_sd
        res = sequential_test(steps, v, series, cal, c.forecast, alpha, floor, level_until_step=level_until)
        if res is None or not res.tested:
            continue
        last = np.flatnonzero(np.isfinite(res.u))
        summary[f"{stem}_sd_from_healthy"] = json_num(res.u[last[-1]]) if len(last) else None
        for word, alarm, onset, sign, S, test in (("above", res.alarm_up, res.onset_up, 1.0, res.s_up, res.test_up),
                                                  ("below", res.alarm_down, res.onset_down, -1.0, res.s_down, res.test_down)):
            if alarm is None:
                continue
            after = sign * res.u[alarm:]
            gross = np.flatnonzero(np.nan_to_num(after, nan=-np.inf) >= cfg.crit_sd)
            # a change against the run's own level that stays where healthy runs go (within warn_sd
            # of them) is for the record; it warns once the level leaves that range too
            outside = np.flatnonzero(np.nan_to_num(after, nan=-np.inf) >= cfg.warn_sd)
            if len(gross):
                sev = "critical"
            elif test == "change" and not len(outside):
                sev = "info"
            else:
                sev = "warning"
            step = _block_step(edges, alarm)
            if test == "change" and sev == "warning":
                step = _block_step(edges, alarm + int(outside[0]))
            rel = math.expm1(res.m[alarm] - res.mu[alarm]) if np.isfinite(res.m[alarm]) else float("nan")
            how = ("its level against the healthy runs'" if test == "level" else "a change against its own recent level")
            what = _WHAT.get(col) or (f"held-out eval loss of {col.split('/', 1)[1]}" if col.startswith("eval_loss/") else col)
            text = (f"{what} {word} its healthy band: the sequential test ({how}) alarmed at step {step}, the change "
                    f"beginning near step {int(edges[onset])}; {rel:+.1%} from the healthy runs, "
                    f"{res.u[alarm]:+.1f} healthy sds")
            if len(gross):
                g = alarm + int(gross[0])
                text += f"; {res.u[g]:+.1f} sds at step {_block_step(edges, g)}"
            flags.append(Flag(f"{stem}_{word}_band", sev, step, {
                "text": text, "test": test, "cusum_over_threshold": json_num(S[alarm]),
                "onset_step": int(edges[onset]), "sd_from_healthy": json_num(res.u[alarm]),
                "rel_from_healthy": json_num(rel), "critical_step": _block_step(edges, alarm + int(gross[0])) if len(gross) else None,
                "false_alarm_rate": alpha, "axis": "step"}))
    return flags, summary


def check_train_eval(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`train_eval_divergence` (critical): held-out eval loss (the periodic subset's series where
    the records carry it: analysis.monitor.series.eval_series) risen over its running minimum (by
    eval_rise_sigma standard errors when eval_loss_se is logged, else by eval_rise_rel) while the
    train loss near it fell below what it was at that minimum, at eval_rise_points consecutive
    eval points."""
    cfg = c.cfg
    ev, se = eval_series(c.df)
    if ev is None:
        return [], {}
    idx = np.flatnonzero(np.isfinite(ev))
    if len(idx) < cfg.eval_rise_points + 1:
        return [], {}
    loss = np.where(np.isfinite(c.loss), c.loss, np.nan)

    def train_near(i: int) -> float:
        # the train loss's median over the points since the eval before (at least 5)
        j = int(np.searchsorted(idx, i))
        lo = idx[j - 1] + 1 if j > 0 else 0
        lo = min(lo, max(i - 4, 0))
        w = loss[lo:i + 1]
        return float(np.nanmedian(w)) if np.isfinite(w).any() else float("nan")

    run, imin, first = 0, idx[0], None
    for i in idx[1:]:
        e_min, e = ev[imin], ev[i]
        if se is not None and np.isfinite(se[i]) and np.isfinite(se[imin]):
            thr, how = cfg.eval_rise_sigma * math.hypot(se[i], se[imin]), f"{cfg.eval_rise_sigma:g} standard errors"
        else:
            thr, how = cfg.eval_rise_rel * abs(e_min), f"{cfg.eval_rise_rel:.0%}"
        risen = e - e_min > thr
        falling = train_near(i) < train_near(imin)
        run = run + 1 if (risen and falling) else 0
        if run == 1:
            first = i
        if run >= cfg.eval_rise_points:
            tr0, tr1 = train_near(imin), train_near(i)
            return [Flag("train_eval_divergence", "critical", int(c.steps[i]), {
                "text": f"held-out eval loss rose {e_min:.4f} -> {e:.4f} (step {c.steps[imin]} -> {c.steps[i]}, more than "
                        f"{how}) while train loss fell {tr0:.4f} -> {tr1:.4f}: the model fits what it trains on and "
                        f"loses what it is scored on (a data fault: a mixture switch, repeated data)",
                "eval_min": json_num(e_min), "eval_min_step": int(c.steps[imin]), "eval": json_num(e),
                "train_at_min": json_num(tr0), "train": json_num(tr1), "first_rise_step": int(c.steps[first]),
                "threshold": json_num(thr)})], {}
        if e < e_min:
            imin = i
    return [], {}


def check_throughput_drop(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`throughput_drop` (warning): the median logged tokens/s of the last throughput_points points
    below a share of the median of all the points before them: throughput_drop_frac, or with a
    calibration the lowest such ratio a healthy run showed / spike_healthy_margin when lower (a
    shared machine's own swings are not a fault of the run)."""
    cfg = c.cfg
    k = cfg.throughput_points
    ratio = throughput_ratio(c.df, k)
    if ratio is None:
        return [], {}
    frac, why = cfg.throughput_drop_frac, "the setting"
    cal = c.calibration
    if cal is not None and cal.throughput_min_ratio is not None and \
            cal.throughput_min_ratio / cfg.spike_healthy_margin < frac:
        frac, why = cal.throughput_min_ratio / cfg.spike_healthy_margin, "the healthy runs' lowest / margin"
    tps = column(c.df, "tokens_per_s")
    ok = np.flatnonzero(np.isfinite(tps) & (tps > 0))
    hit = np.flatnonzero(np.nan_to_num(ratio, nan=np.inf) < frac)
    if not len(hit):
        return [], {}
    j = int(hit[0])
    i = ok[j]
    return [Flag("throughput_drop", "warning", int(c.steps[i]), {
        "text": f"tokens/s fell to {ratio[j]:.0%} of the run's own earlier rate (median of the last {k} points "
                f"against the median before them; threshold {frac:.0%} from {why})",
        "ratio": json_num(ratio[j]), "threshold": json_num(frac)})], {}


@dataclass
class SequentialResult:
    """One series' test: per block u, e, S+ and S- (the larger of the two tests' sums over their
    thresholds: an alarm is S > h = 1), and the first alarm each way."""

    u: np.ndarray
    e: np.ndarray
    s_up: np.ndarray
    s_down: np.ndarray
    h: float
    k: float
    tested: int
    alarm_up: int | None  # block index
    alarm_down: int | None
    onset_up: int | None
    onset_down: int | None
    m: np.ndarray  # the run's block means
    mu: np.ndarray
    sd: np.ndarray
    test_up: str | None = None  # which test alarmed: "level" or "change"
    test_down: str | None = None


def tolerance(rho: float, alpha: float) -> tuple[float, float]:
    """(z_tol, k'): the level a healthy run may hold and the CUSUM reference value in units of
    the block noise (module docstring)."""
    z_tol = NormalDist().inv_cdf(1 - alpha)
    return z_tol, K_REF + z_tol * math.sqrt(rho / (1 - rho))


def sequential_test(steps: np.ndarray, values: np.ndarray, series: str, cal: Calibration,
                    forecast: Forecast | None, alpha: float, min_sd: float = 0.0,
                    level_until_step: int | None = None) -> SequentialResult | None:
    """The test of one series; alpha is this series' share of the false-alarm rate for one
    direction (split evenly between the level tolerance and the CUSUM threshold). With
    level_until_step (a branch's join, analysis.monitor.scope) the level test reads the blocks that
    end by that step only; the change test reads every block, its own level starting again at the
    first block after it."""
    sc = cal.series.get(series)
    if sc is None or not len(steps):
        return None
    edges = cal.edges_array
    r = residual(series, steps, values, forecast)
    m = block_mean(steps, r, edges, complete_to=int(steps[-1]))
    mu, sd = sc.arrays()
    if sc.runs < 3:  # no left-out run measures the width: the t distribution at the tolerance's tail sets it
        sd = sd * tail_widening(sc.dof, alpha / 4)
    sd = np.maximum(sd, min_sd)
    u = (m - mu) / sd
    B = len(u)
    rho = float(sc.rho)
    _, k = tolerance(rho, alpha / 4)
    # h for the worst level the tolerance allows: there the increments e - k have the mean -K_REF
    h = cusum_threshold(max(int(np.sum(np.isfinite(mu) & np.isfinite(sd))), 1), alpha / 4, K_REF)
    noise = math.sqrt(1 - rho)
    e = u / noise
    # the change test: u against the run's own recent level, in healthy sds of that difference
    restart = None if level_until_step is None else int(np.searchsorted(edges[1:] - 1, level_until_step, side="right"))
    c = own_change(u, float(sc.change_lambda), restart) / np.maximum(np.asarray(sc.change_sd, dtype=np.float64), 1e-12)
    h_change = cusum_threshold(max(int(np.sum(np.isfinite(mu) & np.isfinite(sd))), 1), alpha / 2, K_REF)
    s_up, s_dn = np.zeros(B), np.zeros(B)
    alarm = {"up": None, "down": None}
    onset = {"up": None, "down": None}
    test = {"up": None, "down": None}
    state = {("level", "up"): 0.0, ("level", "down"): 0.0, ("change", "up"): 0.0, ("change", "down"): 0.0}
    zero = {key: 0 for key in state}
    tested = 0
    for b in range(B):
        if np.isfinite(e[b]):
            tested += 1
        level_x = e[b] if level_until_step is None or edges[b + 1] - 1 <= level_until_step else np.nan
        for name, x, kk, hh in (("level", level_x, k, h), ("change", c[b], K_REF, h_change)):
            if not np.isfinite(x):
                continue
            for side, sign in (("up", 1.0), ("down", -1.0)):
                key = (name, side)
                state[key] = max(0.0, state[key] + sign * x - kk)
                if state[key] == 0.0:
                    zero[key] = b + 1
                if alarm[side] is None and state[key] > hh:
                    alarm[side], onset[side], test[side] = b, min(zero[key], b), name
        s_up[b] = max(state[("level", "up")] / max(h, 1e-12), state[("change", "up")] / max(h_change, 1e-12))
        s_dn[b] = max(state[("level", "down")] / max(h, 1e-12), state[("change", "down")] / max(h_change, 1e-12))
    alarm_up, alarm_dn, onset_up, onset_dn = alarm["up"], alarm["down"], onset["up"], onset["down"]
    return SequentialResult(u=u, e=e, s_up=s_up, s_down=s_dn, h=1.0, k=k, tested=tested, alarm_up=alarm_up,
                            alarm_down=alarm_dn, onset_up=onset_up, onset_down=onset_dn, m=m, mu=mu, sd=sd,
                            test_up=test["up"], test_down=test["down"])
