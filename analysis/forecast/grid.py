"""The hero's final loss from a ladder that trains each size at several token budgets (a grid, as AI2's
OLMo ladder does): L(N, D) = E + A/N^alpha + B/D^beta (analysis.laws.fit.fit_law, N active
parameters, D tokens) fitted on one point per rung family (its mean final eval loss), and an
interval built, in log loss, from

    V = v_fit + v_meas + v_backtest

- v_fit: a parametric bootstrap: each point's log loss redrawn about the fitted law with its
  measurement sd (the family mean's: analysis.runs.replicates), the law refitted from the fit
  (N_DRAWS refits); the variance of their log predictions at the hero.
- v_meas: one run's measurement variance (the replicates' seed spread plus the eval standard error).
- v_backtest: leave-one-out of the K_NEAR families nearest the hero in (log N, log D): each refitted
  without it and predicted, its log error e_k less its own measurement variance m_k:
  max(0, mean(e_k^2 - m_k)). These are the points whose loss pins the hero; a law that cannot predict
  them from the rest cannot be trusted at the hero, which lies among them.
- The half-width is t_nu(0.5 + level/2) sqrt(V), nu the Welch-Satterthwaite degrees of freedom of V
  (the bootstrap's N_DRAWS - 1, the seed spread's pooled dof, the backtest's K_NEAR).

A ladder identifies both terms only when sizes vary at fixed tokens and tokens at fixed size:
`is_grid` says whether it does (at least two sizes trained at two or more budgets each).

Shape legend: P points (families), B bootstrap draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.stats import t as student_t

from analysis.forecast.file import ForecastBacktest, ForecastLaw
from analysis.laws.fit import FitError, LawFit, fit_law, natural_eval
from analysis.runs import replicates
from core import costs
from core.spec import Spec

LEVEL = 0.9
N_DRAWS = 32  # parametric bootstrap refits
K_NEAR = 3  # families nearest the hero held out, one at a time, by the backtest
MIN_POINTS = 6  # the law's 5 parameters and one degree of freedom

__all__ = ["GridPoint", "GridLaw", "is_grid", "grid_points", "fit_grid_law"]


@dataclass(frozen=True)
class GridPoint:
    """One rung family: active parameters N, tokens D, mean final loss and the variance of its log."""

    name: str
    N: float
    D: float
    loss: float
    var: float
    members: tuple[str, ...] = ()


def _budgets(points: Sequence[GridPoint]) -> dict[float, list[float]]:
    """Tokens per active parameter of each size's families (core.costs.budgets_by_size)."""
    return costs.budgets_by_size((p.N, p.D / p.N) for p in points)


def is_grid(points: Sequence[GridPoint]) -> bool:
    """At least two sizes trained at two or more budgets each: N and D vary independently."""
    return sum(len(b) >= 2 for b in _budgets(points).values()) >= 2


def grid_points(rungs: Sequence[Any]) -> tuple[list[GridPoint], replicates.Noise]:
    fams = replicates.group(rungs)
    nz = replicates.noise(fams)
    return [GridPoint(f.name, float(costs.param_counts(f.spec.model)["active"]), float(costs.tokens(f.spec)),
                      f.final_loss, nz.family_var[f.name], tuple(f.names)) for f in fams], nz


def _fit(points: Sequence[GridPoint], loss=None, start=None) -> LawFit:
    return fit_law([p.N for p in points], [p.D for p in points], [p.loss for p in points] if loss is None else loss,
                   n_bootstrap=0, strict=False, start=start)


def _theta(fit: LawFit) -> np.ndarray:
    p = fit.params
    return np.array([p["E"], p["A"], p["B"], p["alpha"], p["beta"]])


def _log_pred(theta: np.ndarray, N: float, D: float) -> float:
    return float(np.log(natural_eval(theta, [np.array([N]), np.array([D])]))[0])


@dataclass
class GridLaw:
    """The fitted law on the grid and what its interval is built from."""

    points: list[GridPoint]
    fit: LawFit
    draws: np.ndarray  # B x 5 (E, A, B, alpha, beta) of the parametric bootstrap
    run_var: float
    run_dof: float
    backtest: list[dict[str, Any]]
    level: float = LEVEL
    warnings: list[str] = field(default_factory=list)

    @property
    def backtest_var(self) -> float:
        return _excess_var(self.backtest)

    def interval(self, N: float, D: float, level: float | None = None, target_var: float | None = None,
                 backtest_var: float | None = None) -> dict[str, Any]:
        """{mean, lo, hi, level, parts...} of one run's final loss at (N, D); target_var: its measurement
        variance (default: one run's; 0 for a train-loss level), backtest_var: the backtest term's (default: all)."""
        level = self.level if level is None else level
        mean = math.exp(_log_pred(_theta(self.fit), N, D))
        logs = np.array([_log_pred(th, N, D) for th in self.draws]) if len(self.draws) > 1 else np.zeros(1)
        parts = {"fit": float(np.var(logs, ddof=1)) if len(logs) > 1 else 0.0,
                 "measurement": self.run_var if target_var is None else float(target_var),
                 "backtest": self.backtest_var if backtest_var is None else float(backtest_var)}
        dofs = {"fit": max(len(self.draws) - 1, 1), "measurement": self.run_dof if target_var is None else math.inf,
                "backtest": max(len(self.backtest), 1)}
        V = sum(parts.values())
        denom = sum(v * v / dofs[k] for k, v in parts.items() if math.isfinite(dofs[k]) and dofs[k] > 0)
        nu = V * V / denom if denom > 0 else 1e9
        q = float(student_t.ppf(0.5 + level / 2, nu))
        half = q * math.sqrt(V)
        return {"mean": mean, "lo": mean * math.exp(-half), "hi": mean * math.exp(half), "level": level,
                "sd": {k: math.sqrt(v) for k, v in parts.items()}, "dof": nu, "quantile": q, "reach_efolds": 0.0}

    def describe(self) -> dict[str, Any]:
        return {"method": ("L(N, D) = E + A/N^alpha + B/D^beta on one point per rung family (active parameters, tokens); "
                           "log-loss variance = parametric-bootstrap fit variance + one run's measurement variance + "
                           f"the leave-one-out backtest of the {K_NEAR} families nearest the hero (less their measurement "
                           "variance); half-width t_nu x sd (analysis.forecast.grid)"),
                "n_draws": int(len(self.draws)), "run_sd": math.sqrt(self.run_var), "run_dof": self.run_dof,
                "points": [{"name": p.name, "active_params": p.N, "tokens": p.D, "loss": p.loss, "sd": math.sqrt(p.var),
                            "members": list(p.members)} for p in self.points],
                "backtest": self.backtest}


def _without(points: Sequence[GridPoint], held: GridPoint, fit: LawFit) -> np.ndarray | None:
    """The law's parameters refitted without `held` (from the full fit), None where it cannot be."""
    rest = [p for p in points if p.name != held.name]
    if len(rest) < MIN_POINTS - 1:
        return None
    try:
        return _theta(_fit(rest, start=fit.params))
    except FitError:
        return None


def _excess_var(rows: Sequence[dict[str, Any]]) -> float:
    """What held-out log errors leave beyond their own measurement variance: max(0, mean(e^2 - m))."""
    if not rows:
        return 0.0
    return max(0.0, float(np.mean([b["log_error"] ** 2 - b["measurement_var"] for b in rows])))


def _nearest(points: Sequence[GridPoint], N: float, D: float, k: int) -> list[GridPoint]:
    return sorted(points, key=lambda p: math.hypot(math.log(p.N / N), math.log(p.D / D)))[:k]


def fit_grid_law(points: Sequence[GridPoint], noise: replicates.Noise, hero_N: float, hero_D: float,
                 level: float = LEVEL, seed: int = 0) -> GridLaw:
    """The law, its bootstrap and its backtest at the hero; FitError where the grid is too small to fit."""
    points = list(points)
    if len(points) < MIN_POINTS:
        raise FitError(f"L(N, D) needs at least {MIN_POINTS} rung families (5 parameters and one to spare), "
                       f"found {len(points)}")
    fit = _fit(points)
    warnings = [f"L(N, D): {w}" for w in fit.warnings]
    theta = _theta(fit)
    sd_P = np.sqrt([max(p.var, 1e-8) for p in points])
    rng = np.random.default_rng(seed)
    logfit_P = np.log(natural_eval(theta, [np.array([p.N for p in points]), np.array([p.D for p in points])]))
    draws = []
    for _ in range(N_DRAWS):
        y = np.exp(logfit_P + rng.normal(0.0, sd_P))
        try:
            draws.append(_theta(_fit(points, loss=y, start=fit.params)))
        except FitError:
            continue
    bt = []
    for held in _nearest(points, hero_N, hero_D, K_NEAR):
        sub = _without(points, held, fit)
        if sub is None:
            continue
        pred = math.exp(_log_pred(sub, held.N, held.D))
        bt.append({"held_out": held.name, "members": list(held.members), "active_params": held.N, "tokens": held.D,
                   "predicted": pred, "actual": held.loss, "rel_error": pred / held.loss - 1,
                   "log_error": math.log(pred / held.loss), "measurement_var": held.var,
                   "hero_from_rest": math.exp(_log_pred(sub, hero_N, hero_D))})
    if len(bt) < K_NEAR:
        warnings.append(f"L(N, D) interval: only {len(bt)} of the {K_NEAR} families nearest the hero could be "
                        "held out and refitted: its backtest term is less certain than its dof says")
    if len(points) <= 2 * 5:
        warnings.append(f"L(N, D): {len(points)} rung families for 5 parameters: the fit is barely determined, "
                        "and its interval leans on the nearest-point backtest")
    run_dof = noise.seed_dof if noise.seed_var is not None else 0
    if noise.seed_var is None:
        warnings.append("L(N, D) interval: no replicates, so one run's seed noise is unmeasured and left out")
    return GridLaw(points=points, fit=fit, draws=np.array(draws), run_var=noise.run_var,
                   run_dof=run_dof if run_dof > 0 else math.inf, backtest=bt, level=level, warnings=warnings)


def hero_point(hero: Spec) -> tuple[float, float]:
    return float(costs.param_counts(hero.model)["active"]), float(costs.tokens(hero))


@dataclass
class GridForecast:
    """What the forecast takes from the grid route: forecast.json's hero.final_loss, law, backtest and
    the final-loss coverage, and the train-loss level (no eval measurement) the trajectory ends on."""

    final: dict[str, Any]
    law: ForecastLaw
    backtest: ForecastBacktest | None
    coverage: dict[str, Any] | None
    level: dict[str, Any]
    warnings: list[str]


def _held_interval(law: GridLaw, b: dict[str, Any]) -> ForecastBacktest:
    """The held-out family's prediction with the method's interval: the sub-fit's mean, the full law's
    fit variance, the family mean's measurement variance and the other held-out points' backtest term."""
    others = [o for o in law.backtest if o["held_out"] != b["held_out"]]
    iv = law.interval(b["active_params"], b["tokens"], target_var=b["measurement_var"], backtest_var=_excess_var(others))
    scale = b["predicted"] / iv["mean"]
    return ForecastBacktest(held_out=b["held_out"], members=b["members"], predicted=b["predicted"], lo=iv["lo"] * scale,
                            hi=iv["hi"] * scale, actual=b["actual"], rel_error=b["rel_error"],
                            inside=bool(iv["lo"] * scale <= b["actual"] <= iv["hi"] * scale))


def every_family_backtest(law: GridLaw) -> dict[str, Any]:
    """Leave-one-out over every family (each refitted without it and predicted): the law's errors across
    the whole grid, beside the nearest families' that set the interval."""
    rows = []
    for held in law.points:
        sub = _without(law.points, held, law.fit)
        if sub is None:
            continue
        pred = math.exp(_log_pred(sub, held.N, held.D))
        rows.append({"held_out": held.name, "predicted": pred, "actual": held.loss, "rel_error": pred / held.loss - 1})
    errs = np.array([r["rel_error"] for r in rows])
    return {"points": rows, "n": len(rows), "rms_rel_error": float(np.sqrt(np.mean(errs ** 2))) if len(rows) else None,
            "max_abs_rel_error": float(np.max(np.abs(errs))) if len(rows) else None,
            "method": "each family from all the others (L(N, D) refitted; point predictions)"}


def grid_forecast(points: Sequence[GridPoint], nz: replicates.Noise, hero: Spec, flops_per_token: float) -> GridForecast:
    N, D = hero_point(hero)
    law = fit_grid_law(points, nz, N, D)
    iv = law.interval(N, D)
    level = law.interval(N, D, target_var=0.0)
    Ds = np.geomspace(min(p.D for p in points) / 2, D * 2, 60)
    curve = {"flops": (Ds * flops_per_token).tolist(), "loss": [], "lo": [], "hi": [],
             "at": f"the hero's size ({N:.4g} active parameters), tokens varied"}
    for d in Ds:
        c = law.interval(N, float(d))
        for k, key in (("mean", "loss"), ("lo", "lo"), ("hi", "hi")):
            curve[key].append(c[k])
    fl = law.fit.to_dict()
    held = [_held_interval(law, b) for b in law.backtest]
    law_d = ForecastLaw(kind="size_tokens", label="L(N, D) = E + A/N^alpha + B/D^beta",
                        **{k: fl[k] for k in ("E", "A", "B", "alpha", "beta")}, ci=None, ci_level=LEVEL,
                        converged=fl.get("converged", True), warnings=fl.get("warnings", []),
                        interval="one run's final loss at (N, D) (analysis.forecast.grid; hero.final_loss.method)",
                        points=[{"name": p.name, "active_params": p.N, "tokens": p.D, "loss": p.loss} for p in points],
                        nearest_backtest=held, curve=curve)
    coverage = ({"coverage": float(np.mean([h.inside for h in held])), "n": len(held), "level": LEVEL,
                 "mean_rel_width": float(np.mean([(h.hi - h.lo) / h.predicted for h in held])),
                 "mean_abs_rel_err": float(np.mean([abs(h.rel_error) for h in held])),
                 "method": f"each of the {K_NEAR} families nearest the hero from the others, with the whole interval method",
                 "every_family": every_family_backtest(law)}
                if held else None)
    return GridForecast(final={**iv, "method": law.describe()}, law=law_d, backtest=held[0] if held else None,
                        coverage=coverage, level=level, warnings=law.warnings)
