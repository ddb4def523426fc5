"""The ladder's rungs as the forecast reads them (RungRun: spec, run dir, metrics, its final eval
record) and the hero's final-loss forecast from them: the compute law on one point per rung family
(analysis.runs.replicates) with the interval of analysis.forecast.final_loss, its leave-largest-out
backtest and coverage (analysis.forecast.hero describes the whole forecast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from analysis.forecast.file import ForecastBacktest, ForecastError
from analysis.forecast.final_loss import MIN_FIT, FinalLaw, Point, fit_final_law
from analysis.forecast.final_loss import coverage as final_coverage
from analysis.runs import replicates
from core import costs
from core.spec import Spec

LEVEL = 0.9
FINAL_FLAG, FINAL_SE = "extra.eval_final", "extra.eval_loss_se"  # the final eval's record (engines/trainer.py)


@dataclass
class RungRun:
    spec: Spec
    run_dir: Path
    metrics: pd.DataFrame

    def _final_row(self) -> pd.Series | None:
        """The record of the final eval (eval_final, else the last finite eval loss)."""
        m = self.metrics
        if "eval_loss" not in m:
            return None
        ev = pd.to_numeric(m["eval_loss"], errors="coerce")
        ok = np.isfinite(ev)
        if FINAL_FLAG in m:
            fin = ok & (m[FINAL_FLAG] == True)  # noqa: E712 (a column of True/NaN)
            if fin.any():
                return m[fin].iloc[-1]
        return m[ok].iloc[-1] if ok.any() else None

    @property
    def final_loss(self) -> float:
        row = self._final_row()
        if row is None:
            raise ForecastError(f"rung {self.spec.name}: no eval loss in {self.run_dir}")
        return float(row["eval_loss"])

    @property
    def final_se(self) -> float | None:
        """The final eval loss's standard error (None where the run does not report one)."""
        row = self._final_row()
        v = row.get(FINAL_SE) if row is not None else None
        v = pd.to_numeric(pd.Series([v]), errors="coerce").iloc[0]
        return float(v) if np.isfinite(v) else None

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


def ladder_points(rungs: Sequence[Any]) -> tuple[list[Point], replicates.Noise | None]:
    """One point per rung family (runs that differ only in their seed, at their mean final loss) and the
    ladder's measurement noise; Point lists (bench) pass through, their noise unmeasured."""
    if all(isinstance(r, Point) for r in rungs):
        return list(rungs), None
    fams = replicates.group(rungs)
    nz = replicates.noise(fams)
    return [Point(f.name, costs.total_flops(f.spec), f.final_loss, nz.family_var[f.name], tuple(f.names))
            for f in fams], nz


def final_law(rungs: Sequence[Any], nested: bool = True) -> FinalLaw:
    points, nz = ladder_points(rungs)
    if nz is None:
        return fit_final_law(points, seed_var=None, seed_dof=0, nested=nested)
    law = fit_final_law(points, seed_var=nz.seed_var, seed_dof=nz.seed_dof, eval_var=nz.eval_var, nested=nested)
    law.warnings[:0] = [f"measurement: {w}" for w in nz.warnings]
    return law


def _law(rungs) -> Any:
    """The compute law's point fit on one point per rung family."""
    return final_law(rungs, nested=False).fit


def largest_family_out(rungs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(the runs of every family but the largest, the largest family's runs): no replicate of the
    held-out family stays among the fitted."""
    if all(isinstance(r, Point) for r in rungs):
        ordered = sorted(rungs, key=lambda r: r.flops)
        return ordered[:-1], ordered[-1:]
    big = replicates.family_key(max(rungs, key=lambda r: r.flops).spec)
    return ([r for r in rungs if replicates.family_key(r.spec) != big],
            [r for r in rungs if replicates.family_key(r.spec) == big])


def backtest(rungs: list[RungRun]) -> ForecastBacktest | None:
    """Refit without the largest rung family and predict its mean final loss (with the same interval method)."""
    base, held = largest_family_out(rungs)
    if len(ladder_points(base)[0]) < MIN_FIT:
        return None
    target, _ = ladder_points(held)
    law = final_law(base)
    iv = law.interval(target[0].flops, target_var=target[0].var)
    actual = target[0].loss
    return ForecastBacktest(held_out=target[0].name, members=list(target[0].members), predicted=iv["mean"],
                            lo=iv["lo"], hi=iv["hi"], actual=actual, rel_error=(iv["mean"] - actual) / actual,
                            inside=bool(iv["lo"] <= actual <= iv["hi"]))


def final_interval(rungs: Sequence[Any], C: float) -> tuple[float, float, float, FinalLaw]:
    """(mean, lo, hi, law) of one run's final loss at compute C (analysis.forecast.final_loss)."""
    law = final_law(rungs)
    iv = law.interval(C)
    return iv["mean"], iv["lo"], iv["hi"], law


def final_loss_forecast(rungs: list[RungRun], hero: Spec) -> tuple[dict, FinalLaw, ForecastBacktest | None]:
    law = final_law(rungs)
    iv = law.interval(costs.total_flops(hero))
    if law.backtest.get("points"):
        reached = max(p["reach_efolds"] for p in law.backtest["points"])
        if iv["reach_efolds"] > reached * 1.5:
            law.warnings.append(f"final-loss interval: the hero lies {iv['reach_efolds']:.2f} e-folds of compute beyond "
                                f"the largest rung, further than any backtest reached ({reached:.2f}): its "
                                "extrapolation term is scaled up linearly")
    return {**iv, "method": law.describe()}, law, backtest(rungs)


def final_loss_coverage(rungs: list[RungRun]) -> dict | None:
    """Each rung family from the smaller ones (the envelope needs 3), with the whole interval method."""
    points, nz = ladder_points(rungs)
    kw = dict(seed_var=None, seed_dof=0) if nz is None else dict(seed_var=nz.seed_var, seed_dof=nz.seed_dof,
                                                                 eval_var=nz.eval_var)
    return final_coverage(points, level=LEVEL, **kw)



def floor_law(rungs: list[RungRun]) -> tuple[float, float]:
    """(E, p) for a curve size law's floor L0(N) = E + a N^-p from the ladder's compute law
    L(C) = E + A C^-alpha on the rungs' final losses: its E, and p = alpha x k where the rungs' compute
    grows as N^k (least squares of log C on log N). bench/forecast_backtest.py measures it."""
    fit = _law(rungs).to_dict()
    k = float(np.polyfit(np.log([r.active for r in rungs]), np.log([r.flops for r in rungs]), 1)[0])
    return float(fit["E"]), float(fit["alpha"]) * k
