"""Forecast the hero from its ladder: final loss with an interval, loss trajectory with a band under
the hero's own schedule, and a grad-norm envelope; a typed value (HeroForecast) whose JSON is
forecast.json.

- Final loss, on a ladder that trains sizes at several budgets (a grid): L(N, D) over every family
  (analysis.forecast.grid). On one line of runs:
  the compute envelope L(C) = E + A*C^-alpha fitted on one point per rung family (runs
  that differ only in their seed, at their mean final eval loss: analysis.runs.replicates), with the
  interval of analysis.forecast.final_loss: parametric-bootstrap fit variance + the hero's measurement
  variance (the replicates' seed spread and the eval standard error) + the ladder's leave-one-out
  backtest term scaled by the e-folds of compute beyond the largest rung, t-calibrated. Runs scored
  on different eval sets are refused (replicates.check_yardstick). Backtests hold a whole family out.
- Trajectory: the schedule-aware curve model (analysis.curves.fit) fitted on all rung trajectories with
  their sizes (each from FIT_FROM of its steps on, its clock in steps of the smallest batch's tokens so
  that rungs of different batch sizes share the LR area per token), evaluated at the hero's size under
  lr_at(hero, step); it is then shifted to end on the law's final loss so the two forecasts agree
  (the compute law anchors the size dependence), and its band grows to the law's interval there
  (without one run's eval measurement noise, which a train loss does not carry). Where the
  rungs read the hero's tokens (the same data stream, at any batch size) the trajectory carries the
  rungs' per-step deviations from their own trend there (analysis.forecast.stream_residual: the batch
  content's share of the step-to-step noise), and the band's noise term there is the scatter they
  leave (leave-one-rung-out). Its half-widths are then scaled by the factor that would have held
  LEVEL of the largest rung's curve forecast the same way from the smaller rungs, measured
  separately on the steps that carry stream deviations and on the rest (calibrate_trajectory).
- Grad norm: analysis.forecast.gradnorm (log grad norm per bin of the fraction of training, linear in log
  active params with one slope; band from nested leave-largest-out backtests).

Every interval reports, under `coverage`, the coverage and width its method reached on the ladder's
own rungs held out (each rung from the smaller ones; the trajectory: the largest rung's curve from
the others). `warnings` names what a reader must know: the law's and the curve model's own
warnings, rungs that repeated data or whose eval loss parts from their train loss (memorisation), a
NaN final eval.

Before any of it, the regime check (analysis.forecast.regime) reads the rungs' curves; its verdict
and the two routes side by side (the law's final loss, the curve model's own) are
analysis.forecast.verdicts'.

The rungs (RungRun) and the final-loss forecast live in analysis.forecast.rungs; this module keeps
the trajectory, the grad-norm envelope and the forecast that puts them together.

Shape legend: R rungs, T hero steps.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from analysis import fitwarn
from analysis.forecast import gradnorm, grid
from analysis.forecast.file import (ForecastBacktest, ForecastError, ForecastHero, ForecastLaw, ForecastTrajectory,
                                    HeroForecast, RungFit, RungFits)
from analysis.forecast.verdicts import regime_verdict, routes
from analysis.laws import backtest as law_backtest
from analysis.laws.fitted import FitError
from analysis.runs import replicates
from analysis.curves.data import CurveError
from analysis.curves.fit import Curve, fit_curves
from analysis.forecast.final_loss import MIN_FIT
from analysis.forecast.rungs import (LEVEL, RungRun, backtest, final_interval, final_law,  # noqa: F401 (the forecast's names)
                                     final_loss_coverage, final_loss_forecast, floor_law, ladder_points,
                                     largest_family_out)
from analysis.forecast.stream_residual import TREND_STEPS, StreamRun, loo_residual_sd, same_stream
from analysis.forecast.stream_residual import transfer as stream_transfer
from core import costs
from core.schedule import lr_at
from core.spec import Spec
from engines.epochs import repeat_warning

Z90 = 1.6448536269514722
# the curve model is fitted on each rung from this fraction of its steps on (chosen over 0, 0.05 by the
# leave-largest-out backtests of both ladders; the multipower curves start 9% in, after their warmup)
FIT_FROM = 0.1
# carry the rungs' batch-content deviations to the hero's steps at the tokens they read (chosen by the
# backtests of both ladders; analysis.forecast.stream_residual)
STREAM_DEVIATIONS = True
CALIB_MIN, CALIB_MAX = 0.5, 10.0  # the trajectory band's calibration factor is kept in this range
# the band's misfit term: the rungs' trend (running median over this many steps: the step noise is the
# noise term's) about the curve model, per this many stretches of training
MISFIT_SMOOTH, MISFIT_BINS = 25, 20


def _ref_steps(spec: Spec, ref_tokens: float) -> tuple[float, np.ndarray]:
    """(k, lr_U): a run's schedule in steps of `ref_tokens` tokens (k of them per step of its own),
    so that runs of different batch sizes share one clock, the LR area per token."""
    k = spec.data.tokens_per_step / ref_tokens
    U = int(math.ceil(spec.total_steps * k))
    return k, lr_at(spec, np.minimum(np.floor(np.arange(U) / k), spec.total_steps - 1).astype(np.int64))


def rung_curves(rungs: list[RungRun], ref_tokens: float):
    """Each rung's train loss from FIT_FROM of its steps on (past warmup: the curve model's LR-area
    term describes training after the first steep fall), in steps of ref_tokens tokens."""
    out = []
    for r in rungs:
        df = r.metrics.dropna(subset=["loss"])
        df = df[df["step"] >= FIT_FROM * r.spec.total_steps]
        k, lr_U = _ref_steps(r.spec, ref_tokens)
        out.append(Curve.from_schedule(np.round(df["step"].to_numpy() * k).astype(np.int64), lr_U,
                                       loss=df["loss"].to_numpy(), params=r.active, name=r.spec.name))
    return out


def train_eval_ratio(rungs: list[RungRun]) -> float:
    """Train loss over the last 5% of steps / final eval loss, of the largest rung: the trajectory
    forecasts the per-step train loss a run logs, the law its final eval loss."""
    big = max(rungs, key=lambda r: r.flops)
    df = big.metrics.dropna(subset=["loss"])
    tail = df["loss"].iloc[-max(5, len(df) // 20):]
    return float(tail.mean()) / big.final_loss


@dataclass(frozen=True)
class Trajectory:
    """What trajectory_forecast returns: the hero's band (the forecast file's `trajectory`), the
    fitted curve model (`curve_model`) and each rung's fitted curve (`rung_fits`)."""

    band: ForecastTrajectory
    curve_model: dict
    rung_fits: RungFits


def trajectory_forecast(rungs: list[RungRun], hero: Spec, final: dict,
                        stream_deviations: bool = STREAM_DEVIATIONS) -> Trajectory:
    """Hero train loss per step from the curve model, aligned to the final-loss forecast; the band
    holds the final interval (opening with progress) and the step-to-step noise of the rungs. With
    stream_deviations, the steps whose tokens the rungs read carry the rungs' per-step deviations there
    (analysis.forecast.stream_residual) and their noise term is the scatter those leave."""
    ref = min([r.spec.data.tokens_per_step for r in rungs] + [hero.data.tokens_per_step])
    fit = fit_curves(rung_curves(rungs, ref))
    steps_T = np.arange(hero.total_steps)
    k, lr_U = _ref_steps(hero, ref)
    n_hero = float(costs.param_counts(hero.model)["active"])
    pred_T = np.asarray(fit.predict(np.round(steps_T * k).astype(np.int64), lr_U, params=n_hero), dtype=float)
    rho = train_eval_ratio(rungs)
    shift = final["mean"] * rho - pred_T[-1]
    pred_T = pred_T + shift
    rung_fits, noise, misfit = {}, [], []
    for r in rungs:
        st = r.metrics["step"].to_numpy()
        kr, lr_r = _ref_steps(r.spec, ref)
        p = np.asarray(fit.predict(np.round(st * kr).astype(np.int64), lr_r, params=r.active), dtype=float)
        rung_fits[r.spec.name] = RungFit(tokens=(st * r.spec.data.tokens_per_step).tolist(), pred=p.tolist())
        late = slice(len(st) // 2, None)
        y = r.metrics["loss"].to_numpy()
        noise.append(float(np.nanstd(y[late] - p[late])))
        trend = pd.Series(y).rolling(MISFIT_SMOOTH, center=True, min_periods=1).median().to_numpy()
        misfit.append(((st + 1) / r.spec.total_steps, np.log(trend / p)))
    sigma = float(np.median(noise))
    frac_T = (steps_T + 1) / hero.total_steps
    misfit_T = misfit_profile(misfit, frac_T) * pred_T
    early = 0.02 * pred_T * (1 - frac_T)
    # the batch-content deviations the rungs measured at the hero's tokens (analysis.forecast.stream_residual):
    # where they cover a step, the forecast carries them and the step noise is what they leave
    noise_T, cov_T = np.full(hero.total_steps, sigma), np.zeros(hero.total_steps, dtype=bool)
    stream = {"method": "none: no rung reads the hero's data stream" if stream_deviations else "off", "covered_steps": 0}
    if stream_deviations:
        srs = [StreamRun.from_run(r) for r in same_stream(hero, rungs)]
        dev_T, cov_T = stream_transfer(srs, steps_T, hero.data.tokens_per_step)
        loo = loo_residual_sd(srs)
        if cov_T.any() and loo.get("n", 0) > 0:
            pred_T = pred_T * np.exp(dev_T)
            noise_T = np.where(cov_T, loo["residual_sd"] * pred_T, sigma)
            stream = {"method": "per-step deviations of the rungs that read the hero's data stream, at its tokens "
                      f"(analysis.forecast.stream_residual, trend {TREND_STEPS} steps)", "runs": [r.name for r in srs],
                      "covered_steps": int(cov_T.sum()),
                      "first_uncovered_step": int(np.argmin(cov_T)) if not cov_T.all() else None,
                      "residual_sd": loo["residual_sd"], "deviation_sd": loo["deviation_sd"]}
        else:
            cov_T = np.zeros(hero.total_steps, dtype=bool)
    noise_T = np.hypot(noise_T, misfit_T)
    lo_T = pred_T - np.hypot((final["mean"] - final["lo"]) * rho * np.sqrt(frac_T), Z90 * noise_T) - early
    hi_T = pred_T + np.hypot((final["hi"] - final["mean"]) * rho * np.sqrt(frac_T), Z90 * noise_T) + early
    # the curve model describes training after warmup (its LR-area term diverges at step 0), and no
    # loss sits above that of a uniform prediction
    pred_T, lo_T, hi_T = (np.minimum(a, math.log(hero.model.vocab_size)) for a in (pred_T, lo_T, hi_T))
    sched = hero.schedule
    warm = sched.warmup_steps if sched.warmup_steps is not None else round(sched.warmup_frac * hero.total_steps)
    start = min(max(warm, round(0.02 * hero.total_steps)), hero.total_steps - 2)
    every = max(1, hero.total_steps // 400)
    # every k-th step, and every step that carries stream deviations
    keep = np.unique(np.r_[steps_T[start::every], steps_T[cov_T & (steps_T >= start)], steps_T[-1]])
    traj = ForecastTrajectory(
        step=keep.tolist(), tokens=(keep * hero.data.tokens_per_step).tolist(), loss=pred_T[keep].tolist(),
        lo=lo_T[keep].tolist(), hi=hi_T[keep].tolist(), shift=float(shift), quantity="train loss per step",
        train_eval_ratio=rho, step_noise=sigma, stream=stream, misfit_rel=(misfit_T / pred_T)[keep].tolist(),
        stream_covered=cov_T[keep].tolist(),
        method="curve model" + (" + stream deviations" if stream["covered_steps"] else ""))
    model = fit.to_dict()
    model["clock_tokens_per_step"] = ref  # the fit's step is this many tokens (a run of k x as many: step x k)
    return Trajectory(traj, model, RungFits(rung_fits))


def misfit_profile(misfit: list[tuple[np.ndarray, np.ndarray]], frac_T: np.ndarray) -> np.ndarray:
    """The rungs' own trend (a MISFIT_SMOOTH-step running median) about the curve model, as a relative
    sd per stretch of training: the root mean square of log(trend / fit) over the rungs in MISFIT_BINS
    bins of the fraction of training, at the hero's fractions. Where the model describes the rungs
    badly (before FIT_FROM, through a transition whose timing differs from run to run) the band
    widens by as much; elsewhere it adds little to the step noise."""
    edges = np.linspace(0.0, 1.0, MISFIT_BINS + 1)
    f = np.concatenate([m[0] for m in misfit])
    e = np.concatenate([m[1] for m in misfit])
    ok = np.isfinite(e)
    f, e = f[ok], e[ok]
    idx = np.clip(np.searchsorted(edges, f, side="right") - 1, 0, MISFIT_BINS - 1)
    rms = np.array([np.sqrt(np.mean(e[idx == b] ** 2)) if np.any(idx == b) else np.nan for b in range(MISFIT_BINS)])
    centres = (edges[:-1] + edges[1:]) / 2
    have = np.isfinite(rms)
    return np.interp(frac_T, centres[have], rms[have]) if have.any() else np.zeros_like(frac_T)


def scaled_rung_trajectory(rungs: list[RungRun], hero: Spec, final: dict, n: int = 200) -> ForecastTrajectory:
    """Fallback trajectory when the curve model cannot be fitted: the largest rung's loss over the
    fraction of training, scaled to end on the hero's final-loss forecast (and its interval)."""
    big = max(rungs, key=lambda r: r.flops)
    df = big.metrics.dropna(subset=["loss"])
    frac = (df["step"].to_numpy() + 1) / big.spec.total_steps
    smooth = pd.Series(df["loss"].to_numpy()).rolling(9, min_periods=1, center=True).mean().to_numpy()
    steps = np.unique(np.linspace(0, hero.total_steps - 1, n).round().astype(int))
    curve = np.interp((steps + 1) / hero.total_steps, frac, smooth) * (final["mean"] * train_eval_ratio(rungs) / smooth[-1])
    scale_lo, scale_hi = final["lo"] / final["mean"], final["hi"] / final["mean"]
    return ForecastTrajectory(step=steps.tolist(), tokens=(steps * hero.data.tokens_per_step).tolist(),
                              loss=curve.tolist(), lo=(curve * scale_lo).tolist(), hi=(curve * scale_hi).tolist(),
                              method=f"scaled {big.spec.name}")


def _grads(r: RungRun) -> gradnorm.RungGrad:
    df = r.metrics.dropna(subset=["grad_norm"]) if "grad_norm" in r.metrics else r.metrics.iloc[:0]
    return gradnorm.RungGrad(r.spec.name, r.active, (df["step"].to_numpy() + 1) / r.spec.total_steps,
                             df["grad_norm"].to_numpy() if len(df) else [])


def grad_norm_envelope(rungs: list[RungRun], hero: Spec, n_bins: int = 50) -> dict:
    """One RungGrad per rung family (its seeds' points together), so that the envelope's nested
    backtest never sees a replicate of the rung it holds out."""
    grads = []
    for fam in replicates.group(rungs):
        gs = [_grads(r) for r in fam.runs]
        grads.append(gradnorm.RungGrad(fam.name, gs[0].size, np.concatenate([np.asarray(g.frac, float) for g in gs]),
                                       np.concatenate([np.asarray(g.g, float) for g in gs])))
    return gradnorm.envelope(grads, float(costs.param_counts(hero.model)["active"]), hero.total_steps, n_bins=n_bins,
                             level=LEVEL)


def trajectory_coverage(rungs: list[RungRun], stream_deviations: bool = STREAM_DEVIATIONS) -> dict | None:
    """The largest rung's train-loss curve forecast from the others as the hero's is (the curve model,
    aligned to final_interval's forecast of its final loss), against its own run."""
    base, held = largest_family_out(rungs)
    if len(ladder_points(base)[0]) < MIN_FIT:
        return None
    target = held[0]  # the family's first seed (its curve; the law predicts the family's mean)
    pts, nz = grid.grid_points(base)
    if grid.is_grid(pts) and len(pts) >= grid.MIN_POINTS:  # as the hero's: the law's level, by the hero's route
        N, D = grid.hero_point(target.spec)
        iv = grid.fit_grid_law(pts, nz, N, D).interval(N, D, target_var=0.0)
    else:
        iv = final_law(base).interval(target.flops, target_var=0.0)
    mean, lo, hi = iv["mean"], iv["lo"], iv["hi"]
    traj = trajectory_forecast(base, target.spec, {"mean": mean, "lo": lo, "hi": hi, "level": LEVEL},
                               stream_deviations).band
    p, l, h, y = on_run_steps(traj, target)
    cov = on_run_covered(traj, target)
    out = law_backtest.summarise(p, l, h, y)
    # the factor by which the band's half-widths (each side its own) would hold LEVEL of these points:
    # one for the steps that carry stream deviations and one for the rest (their errors differ in kind)
    half = np.where(y >= p, h - p, p - l)
    ratio = np.abs(y - p) / np.where(half > 0, half, np.nan)

    def factor(m) -> float | None:
        r = ratio[m & np.isfinite(ratio)]
        return float(np.clip(np.quantile(r, LEVEL), CALIB_MIN, CALIB_MAX)) if len(r) else None

    f_all = factor(np.ones(len(y), dtype=bool)) or 1.0
    out.update(method=f"{target.spec.name}'s train loss from the smaller rungs", level=LEVEL, calibration_factor=f_all)
    if cov.any():  # calibration_factor is then the uncovered steps' one
        out.update(calibration_factor_covered=factor(cov) or f_all, calibration_factor=factor(~cov) or f_all,
                   calibration_factor_all=f_all, covered_share=float(cov.mean()))
    return out


def stream_covered(traj: ForecastTrajectory) -> np.ndarray:
    """Whether each of the trajectory's steps carries stream deviations (none for a trajectory without them)."""
    return np.asarray(traj.stream_covered or np.zeros(len(traj.step or []), dtype=bool), dtype=bool)


def _run_points(traj: ForecastTrajectory, run: RungRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the trajectory's steps, the run's logged steps inside them, the run's loss there)."""
    df = run.metrics.dropna(subset=["loss"])
    steps = np.asarray(traj.step)
    st = df["step"].to_numpy()
    keep = (st >= steps.min()) & (st <= steps.max())
    return steps, st[keep], df["loss"].to_numpy()[keep]


def on_run_steps(traj: ForecastTrajectory, run: RungRun) -> tuple[np.ndarray, ...]:
    """(forecast, lo, hi, loss) at every logged step of the run inside the trajectory's steps (the
    trajectory holds every step where it carries stream deviations, every k-th elsewhere)."""
    steps, st, y = _run_points(traj, run)
    p, l, h = (np.interp(st, steps, np.asarray(a, dtype=float)) for a in (traj.loss, traj.lo, traj.hi))
    return p, l, h, y


def on_run_covered(traj: ForecastTrajectory, run: RungRun) -> np.ndarray:
    """Whether each step on_run_steps returns carries stream deviations (they are kept one by one)."""
    steps, st, _ = _run_points(traj, run)
    return np.isin(st, steps[stream_covered(traj)])


def calibrate_trajectory(traj: ForecastTrajectory, backtest: dict | None) -> ForecastTrajectory:
    """The trajectory with its band's half-widths scaled by the backtest's calibration factor (the largest
    rung's curve forecast from the others, as the hero's is), so that LEVEL of that rung's points
    would have fallen inside; the hero's own run is then the independent check. Steps that carry
    stream deviations get the factor measured on such steps of the backtest, the rest the other."""
    factor = (backtest or {}).get("calibration_factor")
    if not factor or not traj.loss:
        return replace(traj, calibration={"factor": 1.0, "method": "none: no backtest of the trajectory on this ladder"})
    p, lo, hi = (np.asarray(a, dtype=float) for a in (traj.loss, traj.lo, traj.hi))
    f_cov = backtest.get("calibration_factor_covered", factor)
    f = np.where(stream_covered(traj), f_cov, factor)
    calibration = {"factor": factor, "method": "half-widths x the factor that holds "
                   f"{LEVEL:.0%} of the largest rung's points forecast from the smaller rungs"}
    if "calibration_factor_covered" in backtest:
        calibration.update(factor_covered=f_cov, method=calibration["method"] + ", measured separately "
                           "on the steps that carry stream deviations (factor_covered) and on the rest")
    return replace(traj, lo=(p - f * (p - lo)).tolist(), hi=(p + f * (hi - p)).tolist(), calibration=calibration)


def calibration_warnings(backtest: dict | None) -> list[str]:
    """A trajectory calibration factor held at CALIB_MIN or CALIB_MAX: the band is then wider
    (at the lower bound) or narrower (at the upper) than its backtest asked for."""
    bt = backtest or {}
    split = "calibration_factor_covered" in bt
    out = []
    for key, what in (("calibration_factor", "steps without stream deviations" if split else "every step"),
                      ("calibration_factor_covered", "steps with stream deviations")):
        f = bt.get(key)
        if f is not None and f <= CALIB_MIN:
            out.append(f"trajectory band: its calibration factor on {what} sits at its lower bound "
                       f"{CALIB_MIN:g}: the band there is wider than its backtest asked for")
        elif f is not None and f >= CALIB_MAX:
            out.append(f"trajectory band: its calibration factor on {what} sits at its upper bound "
                       f"{CALIB_MAX:g}: the band there is narrower than its backtest asked for")
    return out


def memorisation_warnings(rungs: list[RungRun]) -> list[str]:
    """Rungs whose final eval loss sits well above their train loss over the last 5% of steps."""
    out = []
    for r in rungs:
        df = r.metrics.dropna(subset=["loss"])
        if not len(df) or "eval_loss" not in r.metrics:
            continue
        train = float(df["loss"].iloc[-max(5, len(df) // 20):].mean())
        try:
            out += fitwarn.memorisation(r.spec.name, train, r.final_loss)
        except ValueError:
            continue
    return out


def _envelope_route(rungs: list[RungRun], hero: Spec) -> tuple[dict, ForecastLaw, ForecastBacktest | None, dict, list[str]]:
    """(hero.final_loss, law, backtest, train-loss level, warnings) of the compute envelope L(C)."""
    final, law_fit, bt = final_loss_forecast(rungs, hero)
    # the trajectory is train loss: it ends on the law's level without the eval measurement of one run
    law_level = law_fit.interval(costs.total_flops(hero), target_var=0.0)
    fl = law_fit.fit.to_dict()
    Cs = np.geomspace(min(r.flops for r in rungs) / 2, costs.total_flops(hero) * 2, 60)
    curve = {"flops": Cs.tolist(), "loss": [], "lo": [], "hi": []}
    for C in Cs:
        iv = law_fit.interval(float(C))
        curve["loss"].append(iv["mean"])
        curve["lo"].append(iv["lo"])
        curve["hi"].append(iv["hi"])
    ci = ({k: [float(v) for v in np.quantile(law_fit.draws[:, i], [(1 - LEVEL) / 2, (1 + LEVEL) / 2])]
           for i, k in enumerate(("E", "A", "alpha"))} if len(law_fit.draws) > 1 else None)
    law = ForecastLaw(kind="compute", label="L(C) = E + A C^-alpha", E=fl.get("E"), A=fl.get("A"), alpha=fl.get("alpha"),
                      ci=ci, ci_level=LEVEL, converged=fl.get("converged", True), warnings=fl.get("warnings", []),
                      interval="one run's final loss at C (analysis.forecast.final_loss; hero.final_loss.method)",
                      points=final["method"]["points"], curve=curve)
    return final, law, bt, law_level, list(law_fit.warnings)


def forecast(experiment: str, rungs: list[RungRun], hero: Spec, stream_deviations: bool = STREAM_DEVIATIONS) -> HeroForecast:
    if len(rungs) < 3:
        raise ForecastError(f"forecast needs at least 3 finished rungs with eval losses, found {len(rungs)}")
    fingerprint = replicates.check_yardstick(rungs)
    if len(replicates.group(rungs)) < MIN_FIT:
        raise ForecastError(f"forecast needs at least {MIN_FIT} rung sizes (families of seeds), found "
                         f"{len(replicates.group(rungs))}: {', '.join(r.spec.name for r in rungs)}")
    pts, nz = grid.grid_points(rungs)
    too_few = grid.is_grid(pts) and len(pts) < grid.MIN_POINTS
    if grid.is_grid(pts) and not too_few:  # sizes at several budgets: L(N, D) over every family (analysis.forecast.grid)
        gf = grid.grid_forecast(pts, nz, hero, costs.total_flops(hero) / costs.tokens(hero))
        final, law, bt, law_level, law_warnings, final_cov = gf.final, gf.law, gf.backtest, gf.level, gf.warnings, gf.coverage
    else:  # one line of runs: the compute envelope L(C) (analysis.forecast.final_loss)
        final, law, bt, law_level, law_warnings = _envelope_route(rungs, hero)
        final_cov = final_loss_coverage(rungs)
    fc = HeroForecast(
        experiment=experiment,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        sources={"rungs": [{"name": r.spec.name, "spec_id": r.spec.id, "run_dir": str(r.run_dir), "active_params": r.active,
                            "total_params": costs.param_counts(r.spec.model)["total"], "tokens": costs.tokens(r.spec),
                            "flops": r.flops, "final_loss": r.final_loss, "final_loss_se": r.final_se,
                            "seed": r.spec.seed, "family": replicates.family_key(r.spec)} for r in rungs],
                 "eval_fingerprint": fingerprint,
                 "measurement": replicates.noise(replicates.group(rungs)).to_dict()},
        law=law,
        hero=ForecastHero(spec_id=hero.id, name=hero.name, total_steps=hero.total_steps,
                          tokens_per_step=hero.data.tokens_per_step,
                          active_params=costs.param_counts(hero.model)["active"],
                          total_params=costs.param_counts(hero.model)["total"], flops=costs.total_flops(hero),
                          final_loss=final),
        backtest=bt,
        trajectory=None,
        grad_norm=grad_norm_envelope(rungs, hero),
    )
    fc.warnings += law_warnings
    if too_few:
        fc.warnings.append(f"the rungs vary size and tokens independently, but L(N, D) needs at least {grid.MIN_POINTS} "
                           f"families and the ladder has {len(pts)}: the forecast fits L(C) on them instead, which "
                           "reads budgets of one size as sizes")
    fc.regime = regime_verdict(rungs, hero, law, final)
    fc.warnings += [f"regime: {w['kind']}: {w['message']}" for w in fc.regime.warnings]
    try:
        tf = trajectory_forecast(rungs, hero, law_level, stream_deviations)
        fc.trajectory, fc.curve_model, fc.rung_fits = tf.band, tf.curve_model, tf.rung_fits
        fc.warnings += [f"curve model: {w}" for w in fc.curve_model.get("warnings", [])]
        fc.warnings += routes(fc.hero.final_loss, fc.trajectory)
    except CurveError as e:  # a curve fit that cannot be made (CurveFitError among them): the final-loss
        # forecast stands on its own; say why the curve model is missing
        fc.curve_model_error = f"{type(e).__name__}: {e}"
        fc.trajectory = scaled_rung_trajectory(rungs, hero, law_level)
        fc.warnings.append(f"no curve model ({fc.curve_model_error}): the trajectory is the largest rung's, scaled")
    fc.coverage = {"final_loss": final_cov, "grad_norm": fc.grad_norm.get("backtest")}
    try:
        fc.coverage["trajectory"] = trajectory_coverage(rungs, stream_deviations)
    except (CurveError, FitError) as e:  # a backtest that cannot be made (no law, no curve fit) is reported, not fatal
        fc.coverage["trajectory"] = {"error": f"{type(e).__name__}: {e}"}
    fc.trajectory = calibrate_trajectory(fc.trajectory, fc.coverage["trajectory"])
    fc.warnings += calibration_warnings(fc.coverage["trajectory"])
    for k, v in fc.coverage.items():
        if v is None:
            fc.warnings.append(f"the {k.replace('_', ' ')} interval has no backtest on this ladder (too few rungs): "
                               "its coverage is unknown")
    fc.warnings += memorisation_warnings(rungs)
    fc.warnings += [w for w in (repeat_warning(r.spec) for r in rungs) if w]  # rungs that saw data twice
    fc.warnings += [w for w in (r.final_eval_warning for r in rungs) if w]
    return fc
