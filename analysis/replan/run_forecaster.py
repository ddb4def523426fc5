"""The final-loss forecast of a live run under any replan option's schedule: the curve model
(analysis.curves.fit) fitted to the run's own healthy points, or the ladder's curve model matched to the
run's level, whichever predicts the run's last quarter best; anchored on forecast.json's trajectory
of this very plan when there is one (see _make_curve_forecaster for the interval's parts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from scipy.stats import norm

from analysis.curves import fit as curves
from analysis.monitor.divergence import divergence_onset
from analysis.monitor.watch import spec_warmup_steps
from core.schedule import lr_at
from analysis.replan.state import OptionForecast
from core.spec import Spec

__all__ = ["Forecaster", "curve_forecaster", "INTERVAL_LEVEL"]

INTERVAL_LEVEL = 0.9
# forecaster(state, option_spec, resume_step) -> OptionForecast or None
Forecaster = Callable[[Any, Spec, int], "OptionForecast | None"]


def curve_forecaster(state) -> Forecaster | None:
    """Fits the curve model (analysis.curves.fit) to the run's own curve so far and predicts the final
    loss under any option's schedule; None when too few healthy points. `state` is the replanner's
    RunState (its spec, metrics frame df, monitor report and forecast are read)."""
    return _make_curve_forecaster(curves, state)


FINAL_POINTS = 5  # the forecast final loss is the mean training loss over the last 5 steps
N_BOOT = 8  # bootstrap refits behind the curve model's band
MAX_FIT_POINTS = 1000  # longer runs are fitted on bin means
ANCHOR_CORRECTION_SD = 0.5  # relative uncertainty of a schedule's effect on the plan's forecast
LADDER = "ladder"


@dataclass
class _Candidate:
    """A curve model for this run: predict(steps, lr) = fit.predict(..., params) + shift, on the fit's
    clock (k of its steps per step of this run: a ladder model counts steps of its smallest batch)."""

    name: str
    fit: Any
    params: float | None = None
    shift: float = 0.0
    shift_sd: float = 0.0  # uncertainty of the level matched to the run
    k: float = 1.0

    def _clock(self, steps, lr_T):
        if self.k == 1.0:
            return steps, lr_T
        lr_T = np.asarray(lr_T)
        u = np.arange(int(math.ceil(len(lr_T) * self.k)))
        return (np.round(np.asarray(steps) * self.k).astype(np.int64),
                lr_T[np.minimum(np.floor(u / self.k).astype(np.int64), len(lr_T) - 1)])

    def predict(self, steps, lr_T, _z=None):
        steps, lr_T = self._clock(steps, lr_T)
        return np.asarray(self.fit.predict(steps, lr_T, params=self.params, _z=_z), dtype=np.float64) + self.shift

    def boot_sd(self, steps, lr_T) -> float:
        """The spread of the bootstrap refits' mean over `steps` (0 without a bootstrap)."""
        zs = getattr(self.fit, "boot_z", None)
        if zs is None or len(zs) < 2:
            return 0.0
        draws = np.stack([np.mean(self.predict(steps, lr_T, _z=z)) for z in zs])
        return float(np.std(draws, ddof=1))


def _make_curve_forecaster(curves, state) -> Forecaster | None:
    """The curve model for the run's healthy points after warmup. Candidates: the run's own fits
    ("mpl", the Multi-Power Law, and "lra", the simpler annealing law) and, given a forecast.json
    with a curve model ("ladder": fitted on the ladder's rungs, at the forecast hero's size), that
    model with its level matched to the run (a constant shift). Each candidate is fitted (or matched)
    on the first 75% of the points; the one whose prediction of the last 25% has the smallest mean
    error wins, and is refitted on all of them (own fits with bootstrap refits for the band). A
    short, noisy curve can leave the seven-parameter MPL loose; a ladder model knows the curve's
    shape from whole rungs.

    A candidate whose curve under the plan runs to zero or below is dropped.

    When forecast.json forecasts this very run (its hero spec id), a second forecast anchors on
    its trajectory: the plan's forecast loss at the option's last steps (with its band), plus the
    chosen model's difference between the option's schedule and the plan's at those steps (known
    within +-50%). The method with the narrower interval on the plan itself is used for every option
    of the replan (early in a long run the ladder knows the level far better than the run's own
    first points); options forecast by different methods would not be comparable.

    The interval of an option's final loss adds, in quadrature: the model's uncertainty, the
    larger of its band less the per-point scatter (bootstrap spread and the curve model's own
    extrapolation term) and the run's holdout error per step extrapolated times the steps from the
    last data point to the forecast (a curve law fitted on the start of a run can bend away from
    it); the matched level's standard error (ladder model); and the noise of a FINAL_POINTS-step
    mean (from the run's step-to-step scatter). Runs longer than MAX_FIT_POINTS points are fitted on
    bin means."""
    spec = state.spec
    df = state.df
    steps = df["step"].to_numpy()
    loss = df["loss"].to_numpy(dtype=np.float64)
    ok = np.isfinite(loss) & (loss > 0)
    onset = divergence_onset(state.report, spec.total_steps)
    if onset is not None:
        ok &= steps < onset[0]  # a replan forecasts a healthy run
    # The curve laws describe training after warmup (the published fits start there too).
    ok &= steps >= spec_warmup_steps(spec)
    s_obs, l_obs = steps[ok], loss[ok]
    if len(s_obs) < 16:
        return None
    d = np.diff(l_obs)
    point_noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2)  # one step's scatter
    if len(s_obs) > MAX_FIT_POINTS:
        # A long run: fit bin means (as published curves log 128-step averages); the fit's cost
        # grows with the points, its information hardly.
        edges = np.linspace(0, len(s_obs), MAX_FIT_POINTS + 1).astype(int)
        s_obs = np.array([int(round(s_obs[a:b].mean())) for a, b in zip(edges[:-1], edges[1:])])
        l_obs = np.array([l_obs[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    lr_run = lr_at(spec, np.arange(spec.total_steps))
    errors = (curves.CurveError, ValueError, FloatingPointError, ZeroDivisionError)

    ladder_fit, ladder_n, ladder_k = None, None, 1.0
    fc = state.forecast
    if fc is not None and fc.curve_model:
        try:
            ladder_fit = curves.CurveFit.from_dict(fc.curve_model)
            ladder_n = fc.hero.active_params if fc.hero else None
            clock = fc.curve_model.get("clock_tokens_per_step")
            ladder_k = spec.data.tokens_per_step / float(clock) if clock else 1.0
        except errors:
            ladder_fit = None

    def build(name: str, mask, n_boot: int = 0) -> _Candidate:
        if name == LADDER:
            base = _Candidate(LADDER, ladder_fit, ladder_n, k=ladder_k)
            r = l_obs[mask] - base.predict(s_obs[mask], lr_run)
            base.shift = float(np.mean(r))
            base.shift_sd = float(np.std(r, ddof=1) / math.sqrt(len(r))) if len(r) > 1 else 0.0
            return base
        c = curves.Curve.from_schedule(s_obs[mask], lr_run, l_obs[mask], name=spec.name)
        return _Candidate(name, curves.fit_curves([c], model=name, n_boot=n_boot))

    head = np.arange(len(s_obs)) < int(0.75 * len(s_obs))
    # how far the holdout extrapolated: from the last fitted step to the middle of the held-out ones
    holdout_reach = max(float(np.mean(s_obs[~head])) - float(s_obs[head][-1]), 1.0)
    names = ([LADDER] if ladder_fit is not None else []) + list(curves.MODELS)
    holdout: dict[str, float] = {}
    for name in names:
        try:
            cand = build(name, head)
            holdout[name] = float(abs(np.mean(cand.predict(s_obs[~head], lr_run) - l_obs[~head])))
        except errors:
            continue
    chosen = None
    for name in sorted(holdout, key=holdout.get):
        try:
            cand = build(name, np.ones(len(s_obs), bool), n_boot=N_BOOT)
            end = cand.predict(np.array([spec.total_steps - 1]), lr_run)[0]
        except errors:
            continue
        if math.isfinite(end) and end > 0:  # a law that runs below zero by the plan's end is no model
            chosen = cand
            break
    if chosen is None:
        return None
    err_per_step = holdout[chosen.name] / holdout_reach
    last_obs = int(s_obs[-1])
    zq = float(norm.ppf(0.5 + INTERVAL_LEVEL / 2))

    def _both(option: Spec, resume_step: int) -> tuple[dict | None, dict | None]:
        """(the run's own curve model's forecast, the forecast anchored on forecast.json's plan)."""
        total = option.total_steps
        lr_T = lr_at(option, np.arange(total))
        lr_T[:resume_step] = lr_run[:resume_step]  # the steps before the resume are the parent's
        last = np.arange(max(total - FINAL_POINTS, 0), total)
        try:
            mean = float(np.mean(chosen.predict(last, lr_T)))
            boot_sd = chosen.boot_sd(last, lr_T)
        except errors:
            return None, None
        # The fit's own uncertainty is its bootstrap spread; its extrapolation error is this run's
        # own holdout (the error per step of a fit on the first 75% of the run, on the rest) times
        # the steps this forecast reaches beyond the data. Not the curve band's generic extrapolation
        # term too: it measures the same thing on the same curve, and would count it twice. The
        # larger of the two counts, plus the matched level's error.
        reach_err = err_per_step * max(float(np.mean(last)) - last_obs, 0.0)
        model_sd = math.sqrt(max(boot_sd**2, reach_err**2) + chosen.shift_sd**2)
        noise_sd = point_noise / math.sqrt(len(last))
        half = zq * math.sqrt(model_sd**2 + noise_sd**2)
        record = {"holdout_err": holdout, "fitted_points": int(len(s_obs)),
                  "what": f"mean training loss over the last {len(last)} steps"}
        out = OptionForecast(mean, max(mean - half, 0.0), mean + half, INTERVAL_LEVEL, chosen.name,
                             {"model_sd": model_sd, "noise_sd": noise_sd, **record})
        if not (math.isfinite(mean) and math.isfinite(half)) or mean <= 0:
            out = None
        anchored = _anchored(last, lr_T, noise_sd)
        if anchored is not None:
            anchored = OptionForecast(anchored.mean, anchored.lo, anchored.hi, anchored.level, anchored.model,
                                      {**anchored.detail, **record})
        return out, anchored

    def forecast(st, option: Spec, resume_step: int) -> OptionForecast | None:
        # one method for every option of a replan (chosen on the plan itself, the narrower interval):
        # options forecast by different methods are not comparable with each other
        if "anchored" not in method:
            own_p, anch_p = _both(spec, min(state.step + 1, spec.total_steps))
            method["anchored"] = anch_p is not None and (
                own_p is None or anch_p.width < own_p.width)
        own, anchored = _both(option, resume_step)
        first, second = (anchored, own) if method["anchored"] else (own, anchored)
        return first if first is not None else second

    method: dict[str, bool] = {}

    # The forecast's own trajectory of this run's plan (forecast.json, made from the ladder before
    # the run started) anchors the level; the run's curve model only supplies how the option's
    # schedule moves the loss from the plan's at the same step (an annealing effect, which a curve
    # law gets far better than the level far out), taken as known within +-ANCHOR_CORRECTION_SD.
    traj = fc if fc is not None and fc.is_for(spec.id) else None

    def _anchored(last: np.ndarray, lr_T: np.ndarray, noise_sd: float) -> OptionForecast | None:
        if traj is None or last[0] < traj.traj_step[0] or last[-1] > traj.traj_step[-1] or last[-1] >= len(lr_run):
            return None
        x = last.astype(np.float64)
        a_mean = float(np.mean(np.interp(x, traj.traj_step, traj.traj_loss)))
        a_half = float(np.mean(np.interp(x, traj.traj_step, traj.traj_hi) - np.interp(x, traj.traj_step, traj.traj_lo))) / 2
        try:
            corr = float(np.mean(chosen.predict(last, lr_T)) - np.mean(chosen.predict(last, lr_run)))
        except errors:
            return None
        mean = a_mean + corr
        half = math.sqrt(a_half**2 + (zq * ANCHOR_CORRECTION_SD * corr) ** 2 + (zq * noise_sd) ** 2)
        if not (math.isfinite(mean) and math.isfinite(half)) or mean <= 0:
            return None
        return OptionForecast(mean, max(mean - half, 0.0), mean + half, INTERVAL_LEVEL, f"forecast+{chosen.name}",
                              {"anchor": a_mean, "schedule_correction": corr, "noise_sd": noise_sd})

    return forecast
