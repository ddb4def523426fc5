"""Forecast the hero from its ladder: final loss with an interval, loss trajectory with a band under
the hero's own schedule, and a grad-norm envelope.

- Final loss: the compute envelope L(C) = E + A*C^-alpha fitted on the rungs' final eval losses
  (analysis.laws). Its bootstrap interval is widened by the ladder's own backtest: the error made
  predicting the largest rung from the others, scaled by how much further (in log compute) the hero
  lies beyond the largest rung than that rung lay beyond the next.
- Trajectory: the schedule-aware curve model (analysis.curves) fitted on all rung trajectories with
  their sizes, evaluated at the hero's size under lr_at(hero, step); it is then shifted to end on the
  law's final loss so the two forecasts agree, and its band grows to the final interval.
- Grad norm: each rung's grad norm over the fraction of training divided by its late-training
  level gives a shape; the levels scale as a power of active params; the hero's envelope is the
  median shape times its predicted level, banded by the spread across rungs.

Shape legend: R rungs, T hero steps.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core import costs
from core.schedule import lr_at
from core.spec import Spec
from engines.epochs import repeat_warning

LEVEL = 0.9
Z90 = 1.6448536269514722


@dataclass
class RungRun:
    spec: Spec
    run_dir: Path
    metrics: pd.DataFrame

    @property
    def final_loss(self) -> float:
        ev = self.metrics["eval_loss"].dropna() if "eval_loss" in self.metrics else pd.Series(dtype=float)
        if not len(ev):
            raise ValueError(f"rung {self.spec.name}: no eval loss in {self.run_dir}")
        return float(ev.iloc[-1])

    @property
    def final_eval_warning(self) -> str | None:
        """Why final_loss is not the eval at the run's last step (NaN, inf or not a number there)."""
        m = self.metrics
        if "eval_loss" not in m or not len(m):
            return None
        last = m.loc[m["step"].idxmax()]
        ev = pd.to_numeric(pd.Series([last["eval_loss"]]), errors="coerce").iloc[0]
        if np.isfinite(ev):
            return None
        finite = m[np.isfinite(pd.to_numeric(m["eval_loss"], errors="coerce"))]
        used = f"the eval at step {int(finite['step'].iloc[-1])} ({self.final_loss:.4f})" if len(finite) else "no eval"
        return (f"rung {self.spec.name}: the eval_loss of its last step {int(last['step'])} is {last['eval_loss']!r}, "
                f"not a finite number; the law uses {used} instead")

    @property
    def flops(self) -> float:
        return costs.total_flops(self.spec)

    @property
    def active(self) -> float:
        return float(costs.param_counts(self.spec.model)["active"])


def _law(rungs: list[RungRun], level: float = LEVEL):
    from analysis.laws import fit_envelope

    return fit_envelope([r.flops for r in rungs], [r.final_loss for r in rungs], level=level, strict=False,
                        n_bootstrap=200)


def _law_predict(fit, C: float) -> tuple[float, float, float]:
    p = fit.predict(C, level=LEVEL)
    mean = float(p["loss"])
    lo = p["lo"] if math.isfinite(p["lo"]) else mean
    hi = p["hi"] if math.isfinite(p["hi"]) else mean
    return mean, float(lo), float(hi)


def backtest(rungs: list[RungRun]) -> dict | None:
    """Refit without the largest rung and predict it."""
    if len(rungs) < 4:
        return None
    ordered = sorted(rungs, key=lambda r: r.flops)
    fit = _law(ordered[:-1])
    pred, lo, hi = _law_predict(fit, ordered[-1].flops)
    actual = ordered[-1].final_loss
    return {"held_out": ordered[-1].spec.name, "predicted": pred, "lo": lo, "hi": hi, "actual": actual,
            "rel_error": (pred - actual) / actual, "inside": bool(lo <= actual <= hi)}


def final_loss_forecast(rungs: list[RungRun], hero: Spec) -> tuple[dict, Any, dict | None]:
    fit = _law(rungs)
    C = costs.total_flops(hero)
    mean, lo, hi = _law_predict(fit, C)
    bt = backtest(rungs)
    if bt is not None:
        ordered = sorted(rungs, key=lambda r: r.flops)
        reach = math.log(C / ordered[-1].flops) / max(math.log(ordered[-1].flops / ordered[-2].flops), 1e-9)
        sigma = abs(bt["rel_error"]) * max(reach, 1.0) * mean
        half = Z90 * sigma
        lo, hi = min(lo, mean - half), max(hi, mean + half)
    return {"mean": mean, "lo": lo, "hi": hi, "level": LEVEL}, fit, bt


def _curves_from_rungs(rungs: list[RungRun]):
    from analysis.curves import Curve

    out = []
    for r in rungs:
        df = r.metrics.dropna(subset=["loss"])
        out.append(Curve(step=df["step"].to_numpy(), lr=df["lr"].to_numpy(), loss=df["loss"].to_numpy(), params=r.active))
    return out


def train_eval_ratio(rungs: list[RungRun]) -> float:
    """Train loss over the last 5% of steps / final eval loss, of the largest rung: the trajectory
    forecasts the per-step train loss a run logs, the law its final eval loss."""
    big = max(rungs, key=lambda r: r.flops)
    df = big.metrics.dropna(subset=["loss"])
    tail = df["loss"].iloc[-max(5, len(df) // 20):]
    return float(tail.mean()) / big.final_loss


def trajectory_forecast(rungs: list[RungRun], hero: Spec, final: dict) -> tuple[dict, dict, dict]:
    """Hero train loss per step from the curve model, aligned to the final-loss forecast; the band
    holds the final interval (opening with progress) and the step-to-step noise of the rungs."""
    from analysis.curves import fit_curves

    fit = fit_curves(_curves_from_rungs(rungs))
    steps_T = np.arange(hero.total_steps)
    lr_T = lr_at(hero, steps_T)
    n_hero = float(costs.param_counts(hero.model)["active"])
    pred_T = np.asarray(fit.predict(steps_T, lr_T, params=n_hero), dtype=float)
    rho = train_eval_ratio(rungs)
    shift = final["mean"] * rho - pred_T[-1]
    pred_T = pred_T + shift
    rung_fits, noise = {}, []
    for r in rungs:
        st = r.metrics["step"].to_numpy()
        p = np.asarray(fit.predict(st, r.metrics["lr"].to_numpy(), params=r.active), dtype=float)
        rung_fits[r.spec.name] = {"tokens": (st * r.spec.data.tokens_per_step).tolist(), "pred": p.tolist()}
        late = slice(len(st) // 2, None)
        noise.append(float(np.nanstd(r.metrics["loss"].to_numpy()[late] - p[late])))
    sigma = float(np.median(noise))
    frac_T = (steps_T + 1) / hero.total_steps
    early = 0.02 * pred_T * (1 - frac_T)
    lo_T = pred_T - np.hypot((final["mean"] - final["lo"]) * rho * np.sqrt(frac_T), Z90 * sigma) - early
    hi_T = pred_T + np.hypot((final["hi"] - final["mean"]) * rho * np.sqrt(frac_T), Z90 * sigma) + early
    # the curve model describes training after warmup (its LR-area term diverges at step 0), and no
    # loss sits above that of a uniform prediction
    pred_T, lo_T, hi_T = (np.minimum(a, math.log(hero.model.vocab_size)) for a in (pred_T, lo_T, hi_T))
    sched = hero.schedule
    warm = sched.warmup_steps if sched.warmup_steps is not None else round(sched.warmup_frac * hero.total_steps)
    start = min(max(warm, round(0.02 * hero.total_steps)), hero.total_steps - 2)
    every = max(1, hero.total_steps // 400)
    keep = np.unique(np.r_[steps_T[start::every], steps_T[-1]])
    traj = {"step": keep.tolist(), "tokens": (keep * hero.data.tokens_per_step).tolist(),
            "loss": pred_T[keep].tolist(), "lo": lo_T[keep].tolist(), "hi": hi_T[keep].tolist(), "shift": float(shift),
            "quantity": "train loss per step", "train_eval_ratio": rho, "step_noise": sigma, "method": "curve model"}
    return traj, fit.to_dict(), rung_fits


def scaled_rung_trajectory(rungs: list[RungRun], hero: Spec, final: dict, n: int = 200) -> dict:
    """Fallback trajectory when the curve model cannot be fitted: the largest rung's loss over the
    fraction of training, scaled to end on the hero's final-loss forecast (and its interval)."""
    big = max(rungs, key=lambda r: r.flops)
    df = big.metrics.dropna(subset=["loss"])
    frac = (df["step"].to_numpy() + 1) / big.spec.total_steps
    smooth = pd.Series(df["loss"].to_numpy()).rolling(9, min_periods=1, center=True).mean().to_numpy()
    steps = np.unique(np.linspace(0, hero.total_steps - 1, n).round().astype(int))
    curve = np.interp((steps + 1) / hero.total_steps, frac, smooth) * (final["mean"] * train_eval_ratio(rungs) / smooth[-1])
    scale_lo, scale_hi = final["lo"] / final["mean"], final["hi"] / final["mean"]
    return {"step": steps.tolist(), "tokens": (steps * hero.data.tokens_per_step).tolist(), "loss": curve.tolist(),
            "lo": (curve * scale_lo).tolist(), "hi": (curve * scale_hi).tolist(), "method": f"scaled {big.spec.name}"}


def grad_norm_envelope(rungs: list[RungRun], hero: Spec, n_bins: int = 50) -> dict:
    bins = np.linspace(0, 1, n_bins + 1)
    shapes, levels, sizes = [], [], []
    for r in rungs:
        df = r.metrics.dropna(subset=["grad_norm"])
        frac = (df["step"].to_numpy() + 1) / r.spec.total_steps
        g = df["grad_norm"].to_numpy()
        late = g[frac >= 0.5]
        level = float(np.median(late)) if len(late) else float(np.median(g))
        idx = np.clip(np.digitize(frac, bins) - 1, 0, n_bins - 1)
        shape = np.array([np.median(g[idx == b]) / level if np.any(idx == b) else np.nan for b in range(n_bins)])
        shapes.append(shape)
        levels.append(level)
        sizes.append(r.active)
    shapes_RB = np.array(shapes)
    slope, icpt = np.polyfit(np.log(sizes), np.log(levels), 1)
    resid = np.log(levels) - (icpt + slope * np.log(sizes))
    s_lvl = float(np.std(resid, ddof=1)) if len(levels) > 2 else 0.1
    level_hero = float(np.exp(icpt + slope * np.log(costs.param_counts(hero.model)["active"])))
    mid = np.nanmedian(shapes_RB, axis=0)
    lo = np.nanmin(shapes_RB, axis=0) * math.exp(-Z90 * s_lvl)
    hi = np.nanmax(shapes_RB, axis=0) * math.exp(Z90 * s_lvl)
    centers = 0.5 * (bins[1:] + bins[:-1])
    steps = np.round(centers * hero.total_steps).astype(int)
    return {"step": steps.tolist(), "frac": centers.tolist(), "mean": (mid * level_hero).tolist(),
            "lo": (lo * level_hero).tolist(), "hi": (hi * level_hero).tolist(),
            "level_exponent": float(slope), "hero_level": level_hero}


def forecast(experiment: str, rungs: list[RungRun], hero: Spec) -> dict:
    if len(rungs) < 3:
        raise ValueError(f"forecast needs at least 3 finished rungs with eval losses, found {len(rungs)}")
    final, fit, bt = final_loss_forecast(rungs, hero)
    fl = fit.to_dict()
    Cs = np.geomspace(min(r.flops for r in rungs) / 2, costs.total_flops(hero) * 2, 60)
    curve = {"flops": Cs.tolist(), "loss": [], "lo": [], "hi": []}
    for C in Cs:
        m, lo, hi = _law_predict(fit, float(C))
        curve["loss"].append(m)
        curve["lo"].append(lo)
        curve["hi"].append(hi)
    law = {"kind": "compute", "label": "L(C) = E + A C^-alpha", **{k: fl[k] for k in ("E", "A", "alpha") if k in fl},
           "ci": fl.get("ci"), "converged": fl.get("converged", True), "curve": curve}
    out = {
        "experiment": experiment,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "sources": {"rungs": [{"name": r.spec.name, "spec_id": r.spec.id, "run_dir": str(r.run_dir), "active_params": r.active,
                               "total_params": costs.param_counts(r.spec.model)["total"], "tokens": costs.tokens(r.spec),
                               "flops": r.flops, "final_loss": r.final_loss} for r in rungs]},
        "law": law,
        "hero": {"name": hero.name, "spec_id": hero.id, "total_steps": hero.total_steps,
                 "tokens_per_step": hero.data.tokens_per_step, "active_params": costs.param_counts(hero.model)["active"],
                 "total_params": costs.param_counts(hero.model)["total"], "flops": costs.total_flops(hero),
                 "final_loss": final},
        "backtest": bt,
    }
    try:
        traj, curve_model, rung_fits = trajectory_forecast(rungs, hero, final)
        out["trajectory"], out["curve_model"], out["rung_fits"] = traj, curve_model, rung_fits
    except Exception as e:  # the final-loss forecast stands on its own; say why the curve model is missing
        out["curve_model_error"] = f"{type(e).__name__}: {e}"
        out["trajectory"] = scaled_rung_trajectory(rungs, hero, final)
    out["grad_norm"] = grad_norm_envelope(rungs, hero)
    repeated = [w for w in (repeat_warning(r.spec) for r in rungs) if w]  # rungs that saw data twice
    if repeated:
        out.setdefault("warnings", []).extend(repeated)
    substituted = [w for w in (r.final_eval_warning for r in rungs) if w]
    if substituted:
        out.setdefault("warnings", []).extend(substituted)
    return out
