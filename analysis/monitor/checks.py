"""The monitor's checks, one function per flag family. Each takes the run's curves and returns its
flags and what it adds to the report's summary; analysis.monitor.watch documents every flag and threshold."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast
from analysis.monitor.calib import Calibration
from analysis.monitor.scope import Scope
from analysis.runs.metrics import LR_AGREED_POINTS, frame_tokens_per_step, lr_departure
from analysis.monitor.stats import (column, first_run, interp_inside, iso_utc, json_num, local_spike_z,
                                    measured_tokens_per_s, olmo_spike_score, planned_tokens_per_s, rolling_median)
from analysis.monitor.flags import Flag, MonitorSettings
from core.spec import Spec


CALIBRATE_HINT = ("to calibrate, train two or more healthy seeds of the hero's spec (ladder.experiment.replicate) "
                  "and run `ladder calibrate EXPERIMENT`: it writes calibration.json beside the forecast, where "
                  "compare finds it")


@dataclass
class RunCurves:
    """What every check reads: the frame, its columns as arrays, and the context."""

    df: pd.DataFrame
    spec: Spec | None
    forecast: Forecast | None
    cfg: MonitorSettings
    status: dict | None
    now: float
    plan_tokens_per_s: float | None
    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray | None
    after_warm: np.ndarray  # past the early transient
    calibration: Calibration | None = None
    transient_end: int = 0
    scope: Scope | None = None  # how the calibration applies to this run (analysis.monitor.scope)

    @property
    def n(self) -> int:
        return len(self.steps)


def check_non_finite(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`non_finite`: a NaN or inf loss or grad norm."""
    steps, loss, gn = c.steps, c.loss, c.grad_norm
    flags: list[Flag] = []
    for name, v in (("loss", loss), ("grad_norm", gn)):
        if v is None:
            continue
        bad = ~np.isfinite(v)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            flags.append(Flag("non_finite", "critical", int(steps[i]), {
                "text": f"{name} is {v[i]} at step {steps[i]} ({int(bad.sum())} non-finite point(s))",
                "metric": name, "count": int(bad.sum()), "last_finite_step": json_num(steps[i - 1]) if i else None}))
    return flags, {}


def check_lr_schedule(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`lr_off_schedule` (critical): the logged LR followed the spec's schedule and then left it
    (analysis.runs.metrics.lr_departure; an LR off the schedule from its first points is another
    spec, refused where the run is read)."""
    if c.spec is None:
        return [], {}
    dep = lr_departure(c.spec, c.df)
    if dep is None or dep["agreed_before"] < LR_AGREED_POINTS:
        return [], {}
    ratio = dep["lr"] / dep["schedule"] if dep["schedule"] else float("inf")
    return [Flag("lr_off_schedule", "critical", dep["step"], {
        "text": f"the logged LR left the spec's schedule at step {dep['step']} ({dep['lr']:.6g} against "
                f"{dep['schedule']:.6g}, {ratio:.3g}x) after following it for {dep['agreed_before']} points: the "
                f"optimizer is not running the spec (a scheduler or resume fault), or the spec given is not the run's",
        "lr": json_num(dep["lr"]), "schedule": json_num(dep["schedule"]), "ratio": json_num(ratio)})], {}


def check_run_status(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`run_diverged` / `run_failed`: what the run's own status says."""
    steps, n, status = c.steps, c.n, c.status
    flags: list[Flag] = []
    state = (status or {}).get("state")
    if state in ("diverged", "failed"):
        at = (status or {}).get("step", int(steps[-1]) if n else 0)
        flags.append(Flag(f"run_{state}", "critical", int(at if isinstance(at, (int, float)) else steps[-1]), {
            "text": f"the run's status.json says {state}" + (f": {status.get('error') or status.get('reason')}"
                                                             if (status.get("error") or status.get("reason")) else ""),
            "status": {k: v for k, v in status.items() if isinstance(v, (str, int, float, bool)) or v is None}}))
    return flags, {}


def gross_false_alarm(widths: float, level: float = 0.9) -> float:
    """The chance that one healthy point lies beyond the band by `widths` band widths on one side,
    were the forecast's `level` interval a calibrated normal band: its half width is z sigma, so
    the gross line sits z (1 + 2 widths) sigma from the centre (4.9 sigma, 4e-7, at one width of a
    90% band)."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    return 1.0 - NormalDist().cdf(z * (1 + 2 * widths))


def check_band(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`loss_above_band` / `loss_below_band` against the forecast band (without a calibration: the
    band is the forecast's interval, not healthy runs' spread, so outside it is info and beyond it
    by band_gross_widths band widths a warning), and `forecast_spec_mismatch`."""
    df, steps, loss, n, spec, cfg, forecast = c.df, c.steps, c.loss, c.n, c.spec, c.cfg, c.forecast
    band_summary: dict[str, Any] = {}
    if forecast is None:
        return [], band_summary
    flags: list[Flag] = []
    tok = column(df, "tokens")
    fc_tps = forecast.hero.tokens_per_step if forecast.hero else None
    run_tps = spec.data.tokens_per_step if spec is not None else frame_tokens_per_step(df)
    same_steps = fc_tps is not None and run_tps is not None and abs(float(fc_tps) - float(run_tps)) < 1e-9 * float(fc_tps)
    if (not same_steps and forecast.traj_tokens is not None and tok is not None
            and np.all(np.isfinite(forecast.traj_tokens))):
        # another batch size than the forecast's hero: compare at equal tokens
        xq, xp, axis = tok, forecast.traj_tokens, "tokens"
    else:
        xq, xp, axis = steps.astype(np.float64), forecast.traj_step, "step"
    lo, hi, mid = (interp_inside(xq, xp, a) for a in (forecast.traj_lo, forecast.traj_hi, forecast.traj_loss))
    sm = rolling_median(loss, cfg.band_smooth)
    inside = np.isfinite(lo) & np.isfinite(sm)
    with np.errstate(divide="ignore", invalid="ignore"):
        width = np.log(hi / lo) * cfg.band_gross_widths
        gross_hi, gross_lo = hi * np.exp(width), lo * np.exp(-width)
    for kind, mask, gross, word in (
        ("loss_above_band", inside & (sm > hi), inside & (sm > gross_hi), "above"),
        ("loss_below_band", inside & (sm < lo), inside & (sm < gross_lo), "below"),
    ):
        if c.calibration is not None and "loss" in c.calibration.series:
            break  # the calibrated sequential test (analysis.monitor.seq) judges the loss
        r = first_run(mask, cfg.band_k)
        if r:
            a, b = r
            rg = first_run(gross, cfg.band_k)
            sev, at = ("warning", rg) if rg else ("info", r)
            a, b = at
            flags.append(Flag(kind, sev, int(steps[b]), {
                "text": f"loss {word} the forecast band for {cfg.band_k} consecutive points from step {steps[a]} "
                        f"({sm[a]:.4f} vs band [{lo[a]:.4f}, {hi[a]:.4f}])"
                        + (f", beyond it by {cfg.band_gross_widths:g} band width(s) (the band is the forecast's "
                           f"interval, uncalibrated; were it a calibrated 90% band, a healthy point would lie this far "
                           f"out with probability {gross_false_alarm(cfg.band_gross_widths):.1e}: {CALIBRATE_HINT})" if rg else
                           " (the forecast's interval, not calibrated on healthy runs of this spec: for the record; "
                           f"a warning beyond it by {cfg.band_gross_widths:g} band width(s); {CALIBRATE_HINT})")
                        + f"; {int(mask.sum())} point(s) {word} in all",
                "loss": json_num(sm[a]), "band_lo": json_num(lo[a]), "band_hi": json_num(hi[a]), "forecast": json_num(mid[a]),
                "onset_step": int(steps[r[0]]), "points_outside": int(mask.sum()), "axis": axis}))
    last_in = np.flatnonzero(np.isfinite(lo))
    if len(last_in):
        j = last_in[-1]
        band_summary = {"forecast_loss": json_num(mid[j]), "band_lo": json_num(lo[j]), "band_hi": json_num(hi[j]), "at_step": int(steps[j])}
    hero_id = forecast.hero.spec_id if forecast.hero else None
    if spec is not None and hero_id and hero_id != spec.id:
        flags.append(Flag("forecast_spec_mismatch", "info", int(steps[0]) if n else 0, {
            "text": f"the forecast was made for spec {hero_id}, the run is spec {spec.id}",
            "forecast_spec_id": hero_id, "run_spec_id": spec.id}))
    return flags, band_summary


def check_loss_jump(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`loss_jump`: the smoothed loss rises over its running minimum by more than its noise allows."""
    steps, loss, cfg = c.steps, c.loss, c.cfg
    flags: list[Flag] = []
    finite_loss = np.where(np.isfinite(loss), loss, np.nan)
    sm = rolling_median(finite_loss, cfg.loss_jump_smooth)
    if np.isfinite(sm).any():
        runmin = pd.Series(sm).cummin().to_numpy()
        rel = sm / runmin - 1.0
        fin = finite_loss[np.isfinite(finite_loss)]
        d = np.diff(fin)
        noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) >= 2 else 0.0
        # a median of k points scatters ~1.25 sigma / sqrt(k)
        gate = cfg.loss_jump_sigma * 1.2533 * noise / math.sqrt(cfg.loss_jump_smooth)
        rise = np.nan_to_num(sm - runmin, nan=-1)
        warn = np.flatnonzero((np.nan_to_num(rel, nan=-1) > cfg.loss_jump_warn) & (rise > gate))
        if len(warn):
            i = int(warn[0])
            crit = np.flatnonzero((np.nan_to_num(rel, nan=-1) > cfg.loss_jump_crit) & (rise > gate))
            peak = int(np.nanargmax(rel))
            # with a calibration the healthy runs' loss band judges warnings; a jump keeps its critical
            sev = "critical" if len(crit) else ("info" if c.calibration is not None else "warning")
            flags.append(Flag("loss_jump", sev, int(steps[crit[0]]) if len(crit) and c.calibration is not None
                              else int(steps[i]), {
                "text": f"smoothed loss rose {rel[i]:.1%} above its running minimum {runmin[i]:.4f} at step {steps[i]}"
                        + (f", {rel[crit[0]]:.1%} by step {steps[crit[0]]}" if len(crit) and crit[0] != i else "")
                        + f"; peak rise {rel[peak]:.1%} at step {steps[peak]}",
                "rise": json_num(rel[i]), "running_min": json_num(runmin[i]), "peak_rise": json_num(rel[peak]),
                "noise_sd": json_num(noise), "rise_in_sd": json_num((sm[i] - runmin[i]) / max(gate / max(cfg.loss_jump_sigma, 1e-12), 1e-12)),
                "peak_step": int(steps[peak]), "critical_step": int(steps[crit[0]]) if len(crit) else None}))
    return flags, {}


def check_spikes(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`loss_spike` / `grad_norm_spike` against the local trend, with OLMo 2's spike score."""
    steps, loss, gn, n, cfg = c.steps, c.loss, c.grad_norm, c.n, c.cfg
    flags: list[Flag] = []
    spike_scores: dict[str, float] = {}
    for name, v in (("loss", loss), ("grad_norm", gn)):
        if v is None or n < cfg.spike_min_history + 1:
            continue
        spike_scores[name] = olmo_spike_score(v, cfg.spike_window, cfg.spike_sigma)
        z, pred = local_spike_z(steps, v, cfg.spike_local_window, cfg.spike_min_history)
        thr = spike_threshold(c, name)
        hits = np.flatnonzero(np.nan_to_num(z, nan=0.0) > cfg.spike_sigma)
        if len(hits):
            late = hits[c.after_warm[hits] & (z[hits] > thr[hits])]
            i = int(late[0]) if len(late) else int(hits[0])
            sev = "warning" if len(late) else "info"
            flags.append(Flag(f"{name}_spike", sev, int(steps[i]), {
                "text": f"{name} {v[i]:.4g} at step {steps[i]} is {z[i]:.1f} sigma above its local trend "
                        f"({pred[i]:.4g}; threshold {thr[i]:.1f}); {len(hits)} spike point(s)"
                        + ("" if len(late) else f", none past the early transient (step {c.transient_end}) and "
                                                f"its warning threshold")
                        + f"; OLMo 2 spike score {spike_scores[name]:.4f}",
                "value": json_num(v[i]), "expected": json_num(pred[i]), "z": json_num(z[i]), "threshold": json_num(thr[i]),
                "n_spikes": int(len(hits)), "spike_score": spike_scores[name],
                "spike_steps": [int(s) for s in steps[hits[:20]]]}))
    return flags, {"spike_score": spike_scores}


def spike_threshold(c: RunCurves, name: str) -> np.ndarray:
    """Per point, the z a spike must pass to warn: with a calibration, spike_sigma or the largest
    local z healthy runs showed in the point's stretch (and the two each side), and past the
    transient anywhere past it, x spike_healthy_margin, whichever is higher; without one, spike_gross_factor x spike_sigma for
    the loss and never for the grad norm."""
    thr = np.full(c.n, c.cfg.spike_sigma)
    cal = c.calibration
    if name != "loss":
        # a grad-norm spike alone is routine in healthy runs (a healthy H200 hero's grad norm spiked
        # 4x, 55 sigma, for one step): it is for the record; a sustained rise is the band's business
        return np.full(c.n, np.inf)
    if cal is None or name not in cal.series:
        # nothing says how large this spec's healthy spikes get: only a gross loss spike warns
        return thr * c.cfg.spike_gross_factor
    z = np.asarray(cal.series[name].spike_z, dtype=np.float64)
    near = pd.Series(z).rolling(5, center=True, min_periods=1).max().to_numpy()
    edges = cal.edges_array
    # a few healthy runs spike where they happen to: past the transient, anywhere
    late = z[edges[1:] > cal.transient_end_step]
    anywhere = float(np.nanmax(late)) if np.isfinite(late).any() else 0.0
    b = np.clip(np.searchsorted(edges, c.steps, side="right") - 1, 0, len(z) - 1)
    healthy = np.maximum(np.nan_to_num(near[b], nan=0.0), np.where(c.steps >= cal.transient_end_step, anywhere, 0.0))
    return np.maximum(thr, healthy * c.cfg.spike_healthy_margin)


def check_grad_norm(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`grad_norm_high`, `grad_norm_above_envelope` and `grad_norm_growth`."""
    steps, gn, after_warm, cfg, forecast = c.steps, c.grad_norm, c.after_warm, c.cfg, c.forecast
    flags: list[Flag] = []
    gn_summary: dict[str, Any] = {}
    if gn is not None:
        gsm = rolling_median(np.where(np.isfinite(gn), gn, np.nan), cfg.grad_norm_k)
        gsm = np.where(after_warm, gsm, np.nan)
        over_w = np.flatnonzero(np.nan_to_num(gsm) > cfg.grad_norm_warn)
        if len(over_w):
            i = int(over_w[0])
            over_c = np.flatnonzero(np.nan_to_num(gsm) > cfg.grad_norm_crit)
            # with a calibration the healthy runs' grad-norm band judges (its crit_sd makes a gross
            # rise critical); the fixed thresholds (Marin's) are for runs without one
            sev = "info" if c.calibration is not None else ("critical" if len(over_c) else "warning")
            flags.append(Flag("grad_norm_high", sev, int(steps[i]), {
                "text": f"grad norm (median of {cfg.grad_norm_k}) {gsm[i]:.3g} > {cfg.grad_norm_warn:g} at step {steps[i]}"
                        + (f"; > {cfg.grad_norm_crit:g} from step {steps[over_c[0]]}" if len(over_c) else "")
                        + f"; max {np.nanmax(gsm):.3g}",
                "grad_norm": json_num(gsm[i]), "threshold_warn": cfg.grad_norm_warn, "threshold_crit": cfg.grad_norm_crit,
                "critical_step": int(steps[over_c[0]]) if len(over_c) else None, "max": json_num(np.nanmax(gsm))}))
        env_mean = None
        if forecast is not None and forecast.gn_step is not None and forecast.gn_mean is not None:
            env_mean = interp_inside(steps.astype(np.float64), forecast.gn_step, forecast.gn_mean)
            if forecast.gn_hi is not None:
                hi = interp_inside(steps.astype(np.float64), forecast.gn_step, forecast.gn_hi)
                mask = np.isfinite(hi) & np.isfinite(gn) & (gn > hi) & after_warm
                r = first_run(mask, cfg.band_k)
                if r:
                    a, b = r
                    flags.append(Flag("grad_norm_above_envelope", "info", int(steps[b]), {
                        "text": f"grad norm above the forecast envelope for {cfg.band_k} consecutive points from step "
                                f"{steps[a]} ({gn[a]:.3g} vs upper edge {hi[a]:.3g}; the envelope is the forecast's "
                                f"interval, not healthy runs' spread: for the record)",
                        "grad_norm": json_num(gn[a]), "envelope_hi": json_num(hi[a]), "detected_step": int(steps[b]),
                        "points_outside": int(mask.sum())}))
        g = grad_growth(steps, gn, env_mean, after_warm, cfg)
        if g is not None:
            if c.calibration is not None:
                g.severity = "info"  # the healthy runs' grad-norm band judges
            flags.append(g)
        fin = np.flatnonzero(np.isfinite(gn))
        if len(fin):
            gn_summary = {"grad_norm": json_num(gn[fin[-1]]), "grad_norm_median_last": json_num(np.nanmedian(gn[fin[-cfg.grad_norm_k:]]))}
    return flags, gn_summary


def check_repeated_batches(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`repeated_batch`: a step read the very same tokens as an earlier one (the runs' recorded
    extra.batch_hash, engines/trainer.batch_hash): a replay, a loop, a data loader restarted at its
    start. Critical, unless the spec lets the data run past one epoch (then info: a planned repeat
    can read a batch again)."""
    df, steps = c.df, c.steps
    name = next((n for n in ("extra.batch_hash", "batch_hash") if n in df.columns), None)
    if name is None:
        return [], {}
    h = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=np.float64)
    ok = np.isfinite(h)
    if not ok.any():
        return [], {}
    hv, sv = h[ok], steps[ok]
    _, first_idx, inverse = np.unique(hv, return_index=True, return_inverse=True)
    repeat = first_idx[inverse] != np.arange(len(hv))
    summary = {"repeated_batches": int(repeat.sum())}
    if not repeat.any():
        return [], summary
    i = int(np.flatnonzero(repeat)[0])
    earlier = int(sv[first_idx[inverse[i]]])
    planned = c.spec is not None and c.spec.data.max_epochs > 1
    return [Flag("repeated_batch", "info" if planned else "critical", int(sv[i]), {
        "text": f"step {sv[i]} read the very same batch as step {earlier}; {int(repeat.sum())} of {len(hv)} logged "
                f"steps repeat an earlier batch" + (" (the spec allows more than one epoch)" if planned else ""),
        "repeats_step": earlier, "repeated": int(repeat.sum())})], summary


def check_token_drops(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`token_drops`: send + recv drop fraction over the budget after warmup."""
    df, steps, after_warm, cfg = c.df, c.steps, c.after_warm, c.cfg
    flags: list[Flag] = []
    ds, dr = column(df, "drop_frac_send"), column(df, "drop_frac_recv")
    drop_summary: dict[str, Any] = {}
    if ds is not None or dr is not None:
        drop = np.nan_to_num(ds if ds is not None else 0.0) + np.nan_to_num(dr if dr is not None else 0.0)
        drop = np.broadcast_to(drop, steps.shape).astype(np.float64)
        # an untrained router's drops during warmup say nothing about the run
        r = first_run((drop > cfg.drop_budget) & after_warm, cfg.drop_k)
        if r:
            a, b = r
            rc = first_run((drop > cfg.drop_crit) & after_warm, cfg.drop_k)
            sev = "critical" if rc else "warning"
            cal = c.calibration
            if cal is not None and cal.drop_frac_max is not None:
                # healthy runs of this spec drop this much: only more than they ever did is news
                over = first_run((drop > cal.drop_frac_max * cfg.spike_healthy_margin) & after_warm, cfg.drop_k)
                sev = ("critical" if rc and over else "warning") if over else "info"
                if over:
                    a, b = over
            flags.append(Flag("token_drops", sev, int(steps[a]), {
                "text": f"token-drop fraction {drop[a]:.1%} (send + recv) over the {cfg.drop_budget:.0%} budget for "
                        f"{cfg.drop_k} consecutive points from step {steps[a]}; last {drop[-1]:.1%}, max {drop.max():.1%}",
                "drop_frac": json_num(drop[a]), "drop_frac_last": json_num(drop[-1]), "drop_frac_max": json_num(drop.max()),
                "budget": cfg.drop_budget, "critical_step": int(steps[rc[0]]) if rc else None}))
        tail = drop[-max(cfg.throughput_points, 1):]
        drop_summary = {"drop_frac": json_num(float(np.mean(tail)))}
    return flags, drop_summary


def check_router_entropy(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`router_entropy_collapse`: below log(top_k)'s floor or a share of the early entropy."""
    df, steps, after_warm, spec, cfg = c.df, c.steps, c.after_warm, c.spec, c.cfg
    flags: list[Flag] = []
    ent = column(df, "router_entropy")
    ent_summary: dict[str, Any] = {}
    if ent is not None:
        esm = rolling_median(np.where(np.isfinite(ent), ent, np.nan), cfg.entropy_k)
        valid = np.flatnonzero(after_warm & np.isfinite(ent) & (ent > 0))
        if len(valid) >= cfg.entropy_early_points:
            early = float(np.median(ent[valid[: cfg.entropy_early_points]]))
            floors = [("early value", cfg.entropy_rel_floor * early)]
            if spec is not None and spec.model.top_k > 1:
                floors.append((f"log(top_k={spec.model.top_k})", cfg.entropy_floor_frac * math.log(spec.model.top_k)))
            floor_name, floor = max(floors, key=lambda t: t[1])
            mask = after_warm & np.isfinite(esm) & (esm < floor)
            hits = np.flatnonzero(mask)
            if len(hits):
                i = int(hits[0])
                flags.append(Flag("router_entropy_collapse", "warning", int(steps[i]), {
                    "text": f"router entropy {esm[i]:.3f} nats at step {steps[i]} below its floor {floor:.3f} "
                            f"(from the {floor_name}; early value {early:.3f})",
                    "entropy": json_num(esm[i]), "floor": json_num(floor), "floor_from": floor_name, "early": json_num(early)}))
            ent_summary = {"router_entropy": json_num(ent[valid[-1]]), "router_entropy_early": json_num(early)}
    return flags, ent_summary


def check_throughput(c: RunCurves) -> tuple[list[Flag], dict[str, Any]]:
    """`throughput_low`, and the projected finish at the measured rate."""
    df, steps, n, spec, cfg, now, plan_tokens_per_s = c.df, c.steps, c.n, c.spec, c.cfg, c.now, c.plan_tokens_per_s
    flags: list[Flag] = []
    measured = measured_tokens_per_s(df, cfg.throughput_points)
    plan = plan_tokens_per_s if plan_tokens_per_s is not None else (planned_tokens_per_s(spec) if spec else None)
    tput: dict[str, Any] = {"tokens_per_s": json_num(measured), "plan_tokens_per_s": json_num(plan)}
    if spec is not None and n:
        done_steps = int(steps[-1]) + 1
        remaining_tokens = max(spec.total_steps - done_steps, 0) * spec.data.tokens_per_step
        t_last = column(df, "time")
        base = float(t_last[np.isfinite(t_last)][-1]) if t_last is not None and np.isfinite(t_last).any() else now
        tput["remaining_tokens"] = remaining_tokens
        if measured:
            tput["projected_finish"] = iso_utc(base + remaining_tokens / measured)
        if plan:
            tput["planned_finish"] = iso_utc(base + remaining_tokens / plan)
    if (measured is not None and plan is not None and measured < cfg.throughput_frac * plan
            and tput.get("remaining_tokens", 1) > 0):
        flags.append(Flag("throughput_low", "info", int(steps[-1]), {
            "text": f"measured {measured:,.0f} tokens/s is {measured / plan:.0%} of the plan's {plan:,.0f}"
                    + (f"; projected finish {tput['projected_finish']} instead of {tput['planned_finish']}"
                       if "projected_finish" in tput and "planned_finish" in tput else ""),
            "tokens_per_s": json_num(measured), "plan_tokens_per_s": json_num(plan), "ratio": json_num(measured / plan),
            **{k: tput[k] for k in ("projected_finish", "planned_finish") if k in tput}}))
    return flags, tput


def grad_growth(steps, gn, env_mean, after_warm, cfg: MonitorSettings) -> Flag | None:
    ok = np.flatnonzero(after_warm & np.isfinite(gn) & (gn > 0))
    if len(ok) < cfg.grad_trend_min_points:
        return None
    s_all, lg_all = steps[ok].astype(np.float64), np.log(gn[ok])
    m = len(ok)
    stride = max(1, m // 400)
    for end in range(cfg.grad_trend_min_points - 1, m, stride):
        w = max(cfg.grad_trend_min_points, int(cfg.grad_trend_window_frac * (end + 1)))
        a = max(0, end - w + 1)
        s, lg = s_all[a : end + 1], lg_all[a : end + 1]
        ds = s - s.mean()
        sxx = float(ds @ ds)
        if sxx <= 0 or len(s) < 3:
            continue
        slope = float(ds @ (lg - lg.mean())) / sxx
        resid = lg - lg.mean() - slope * ds
        se = math.sqrt(max(float(resid @ resid) / (len(s) - 2), 1e-30) / sxx)
        growth = math.exp(slope * (s[-1] - s[0]))
        env_growth = 1.0
        if env_mean is not None:
            e0, e1 = env_mean[ok[a]], env_mean[ok[end]]
            if np.isfinite(e0) and np.isfinite(e1) and e0 > 0:
                env_growth = float(e1 / e0)
        if slope / se >= cfg.grad_trend_min_t and growth > cfg.grad_trend_ratio * max(env_growth, 1e-12):
            return Flag("grad_norm_growth", "warning", int(s[-1]), {
                "text": f"grad norm grew {growth:.2f}x over steps {int(s[0])}-{int(s[-1])} "
                        f"(envelope {env_growth:.2f}x; slope {slope / se:.1f} standard errors above zero)",
                "growth": json_num(growth), "envelope_growth": json_num(env_growth), "t": json_num(slope / se),
                "window_start_step": int(s[0]), "window_end_step": int(s[-1])})
    return None
