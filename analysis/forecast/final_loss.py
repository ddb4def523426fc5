"""The final-loss interval of a run beyond the ladder (the hero): the compute law L(C) = E + A*C^-alpha
fitted on one point per rung family (its mean final eval loss, analysis.runs.replicates), and an interval
built from what is known, in log loss:

    V(C) = v_fit(C) + v_meas + tau^2 * rho(C)^2

- v_fit: the law's own uncertainty, a parametric bootstrap: each point's log loss redrawn about the
  fitted law with its measurement sd (the family mean's: seed spread / n plus the eval set's standard
  error; where the ladder has no replicates, the larger of that and the fit's residual scatter), the
  law refitted from the fit (N_DRAWS refits); the variance of their log predictions at C.
- v_meas: the target's own measurement noise: one run's (seed spread plus eval standard error) for the
  hero, the family mean's for a rung.
- tau^2 rho^2: what the law misses beyond its own noise when it extrapolates, from the ladder's
  leave-one-out backtest: each family with at least MIN_FIT smaller ones is predicted from those;
  its log error e_k, less what noise explains (its measurement and the sub-fit's v_fit), per e-fold
  rho_k = log(C_k / C_k-1) of reach: tau^2 = max(0, sum(e_k^2 - m_k)) / sum(rho_k^2). rho(C) =
  log(C / C_max) beyond the largest family. Where no backtest can run (fewer than MIN_FIT + 1
  families), tau is the prior TAU_PRIOR and `warnings` says so; it is never silently 0.
- Calibration for few points: the half-width is t_nu(0.5 + level/2) sqrt(V), nu the Welch-Satterthwaite
  degrees of freedom of V from its parts' (the bootstrap's N_DRAWS - 1, the seed spread's pooled dof or
  the residuals' n - 3, the backtest's number of points; a prior or the eval set's own standard error
  counts as known).

`coverage` reports what the method reached on the ladder itself: each family with at least MIN_FIT
smaller ones predicted from those, with the whole method (its own nested backtest), coverage and
mean width. bench/forecast_backtest.py measures it on Chinchilla and on the committed ladders.

Shape legend: B bootstrap draws, P points (families).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.stats import t as student_t

from analysis.laws import backtest as law_backtest
from analysis.laws.fit import EnvelopeFit, FitError, fit_envelope, refit_envelope

LEVEL = 0.9
MIN_FIT = 3  # the envelope's parameters: a fit needs this many families
N_DRAWS = 64  # parametric bootstrap refits
# log-loss sd per e-fold of compute beyond the largest fitted point, used where a ladder is too short
# for its own backtest: the leave-one-out backtests of the compute envelopes cut from Epoch's Chinchilla
# points give 0.0098 (bench/forecast_backtest.py: 4 points predicting the next 2).
TAU_PRIOR = 0.010
PRIOR_DOF = 3  # the prior counts as this many backtest points
LACK_OF_FIT = 4.0  # residual variance over this many times the points' measured variance is named

__all__ = ["LEVEL", "MIN_FIT", "TAU_PRIOR", "Point", "FinalLaw", "fit_final_law", "coverage"]


@dataclass
class Point:
    """One rung family as the law sees it: compute, mean final loss and the variance of its log."""

    name: str
    flops: float
    loss: float
    var: float = 0.0
    members: tuple[str, ...] = ()


def _eval(theta_BQ: np.ndarray, C) -> np.ndarray:
    C = np.asarray(C, dtype=np.float64)
    return theta_BQ[..., 0, None] + theta_BQ[..., 1, None] * C.reshape(-1) ** -theta_BQ[..., 2, None]


@dataclass
class FinalLaw:
    points: list[Point]
    fit: EnvelopeFit
    draws: np.ndarray = field(repr=False)  # (B, 3) parametric bootstrap refits (E, A, alpha)
    point_sd: np.ndarray = field(repr=False)  # the log-loss sd each point was redrawn with
    run_var: float  # one run's measurement variance (the target's when it is a single run)
    run_dof: float
    tau: float
    tau_dof: float
    backtest: dict[str, Any]
    level: float = LEVEL
    warnings: list[str] = field(default_factory=list)

    @property
    def c_max(self) -> float:
        return max(p.flops for p in self.points)

    def fit_var(self, C) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            logd = np.log(_eval(self.draws, C))
        ok = np.all(np.isfinite(logd), axis=1)
        return np.var(logd[ok], axis=0, ddof=1) if ok.sum() > 1 else np.zeros(np.size(C))

    def interval(self, C: float, target_var: float | None = None, level: float | None = None) -> dict[str, Any]:
        """{mean, lo, hi, level, parts...} of the final loss at compute C; target_var: the target's
        measurement variance (default: one run's)."""
        level = self.level if level is None else level
        mean = float(self.fit.predict(C)["loss"])
        parts = {"fit": float(self.fit_var(C)[0]),
                 "measurement": self.run_var if target_var is None else float(target_var),
                 "backtest": (self.tau * max(math.log(C / self.c_max), 0.0)) ** 2}
        dofs = {"fit": max(len(self.draws) - 1, 1), "measurement": self.run_dof if target_var is None else math.inf,
                "backtest": self.tau_dof}
        V = sum(parts.values())
        denom = sum(v * v / dofs[k] for k, v in parts.items() if math.isfinite(dofs[k]) and dofs[k] > 0)
        nu = V * V / denom if denom > 0 else math.inf
        q = float(student_t.ppf(0.5 + level / 2, nu)) if math.isfinite(nu) else float(student_t.ppf(0.5 + level / 2, 1e9))
        half = q * math.sqrt(V)
        return {"mean": mean, "lo": mean * math.exp(-half), "hi": mean * math.exp(half), "level": level,
                "sd": {k: math.sqrt(v) for k, v in parts.items()}, "dof": nu, "quantile": q,
                "reach_efolds": max(math.log(C / self.c_max), 0.0)}

    def describe(self) -> dict[str, Any]:
        """What forecast.json records of the method."""
        return {"method": ("log-loss variance = parametric-bootstrap fit variance + measurement variance + "
                           "tau^2 x (e-folds of compute beyond the largest rung)^2, tau from the ladder's leave-one-out "
                           "backtest (each rung family from the smaller ones, less what noise explains); half-width "
                           "t_nu x sd, nu the Welch-Satterthwaite degrees of freedom (analysis.forecast.final_loss)"),
                "n_draws": int(len(self.draws)), "tau": self.tau, "tau_dof": self.tau_dof,
                "run_sd": math.sqrt(self.run_var), "run_dof": self.run_dof,
                "point_sd": {p.name: float(s) for p, s in zip(self.points, self.point_sd)},
                "points": [{"name": p.name, "flops": p.flops, "loss": p.loss, "sd": math.sqrt(p.var),
                            "members": list(p.members)} for p in self.points],
                "backtest": self.backtest}


def _resid_var(fit: EnvelopeFit, points: Sequence[Point]) -> tuple[float, int]:
    n = len(points)
    if n <= MIN_FIT:
        return 0.0, 0
    r = np.log([p.loss for p in points]) - np.log(fit.predict(np.array([p.flops for p in points]))["loss"])
    return float(np.sum(r * r) / (n - MIN_FIT)), n - MIN_FIT


def _point_fit(points: Sequence[Point], level: float) -> EnvelopeFit:
    return fit_envelope([p.flops for p in points], [p.loss for p in points], level=level, strict=False,
                        n_bootstrap=0)


def _draws(fit: EnvelopeFit, points: Sequence[Point], sd_P: np.ndarray, n: int, seed: int) -> np.ndarray:
    if not fit.converged and not np.isfinite(fit.params.get("alpha", math.nan)):
        return np.empty((0, 3))
    C = np.array([p.flops for p in points])
    base = np.log(fit.predict(C)["loss"])
    z = np.random.default_rng(seed).standard_normal((n, len(points)))
    d = refit_envelope(C, np.exp(base + z * sd_P), fit.params)
    return d[np.all(np.isfinite(d), axis=1)]


def fit_final_law(points: Sequence[Point], *, seed_var: float | None, seed_dof: int, eval_var: float = 0.0,
                  level: float = LEVEL, nested: bool = True, seed: int = 0) -> FinalLaw:
    """The law on `points` (one per family) and its interval's parts. seed_var (with seed_dof): one run's
    seed-to-seed variance of log loss, None where the ladder has no replicates; eval_var: the eval set's
    own sampling variance of one run. nested=False skips the backtest (tau 0: for the backtest's own
    sub-fits)."""
    pts = sorted(points, key=lambda p: p.flops)
    if len(pts) < MIN_FIT:
        raise FitError(f"the compute law needs at least {MIN_FIT} rung families, found {len(pts)}")
    fit = _point_fit(pts, level)
    warnings = [f"final-loss law: {w}" for w in fit.warnings]
    rv, rdof = _resid_var(fit, pts)
    var_P = np.array([p.var for p in pts])
    if seed_var is not None:
        run_var, run_dof = seed_var + eval_var, float(seed_dof) if seed_dof else math.inf
        sd_P = np.sqrt(np.where(var_P > 0, var_P, run_var))  # a point with no variance of its own: one run's
        if rdof and rv > LACK_OF_FIT * float(np.mean(var_P)):
            warnings.append(f"final-loss law: the rungs scatter about the law by {math.sqrt(rv):.2%} (rms, {rdof} dof), "
                            f"more than their measured noise ({math.sqrt(float(np.mean(var_P))):.2%}): the law may not "
                            "describe this ladder; the backtest term is what carries that into the interval")
    else:  # no replicates: the residual scatter stands for the unmeasured seed noise where it is larger
        sd_P = np.sqrt(np.maximum(var_P, rv))
        run_var, run_dof = max(eval_var, rv), (float(rdof) if rv > eval_var and rdof else math.inf)
        if not rdof:
            warnings.append(f"final-loss interval: {len(pts)} rung sizes and no replicates leave the ladder's noise "
                            "unmeasured (no residual degrees of freedom): the interval carries only the eval "
                            "standard error and the backtest term for it")
    draws = _draws(fit, pts, sd_P, N_DRAWS, seed)
    if len(draws) < N_DRAWS // 2:
        warnings.append(f"final-loss interval: only {len(draws)} of {N_DRAWS} bootstrap refits found a law")
    law = FinalLaw(pts, fit, draws, sd_P, run_var, run_dof, 0.0, math.inf,
                   {"method": "none (a backtest's own sub-fit)"}, level, warnings)
    if nested:
        _backtest(law, seed_var=seed_var, seed_dof=seed_dof, eval_var=eval_var, seed=seed)
    return law


def _backtest(law: FinalLaw, *, seed_var, seed_dof, eval_var, seed) -> None:
    pts = law.points
    rows, num, den = [], 0.0, 0.0
    for k in range(MIN_FIT, len(pts)):
        try:
            sub = fit_final_law(pts[:k], seed_var=seed_var, seed_dof=seed_dof, eval_var=eval_var, level=law.level,
                                nested=False, seed=seed + k)
        except FitError:
            continue
        C = pts[k].flops
        pred = float(sub.fit.predict(C)["loss"])
        if not (math.isfinite(pred) and pred > 0):
            continue
        e = math.log(pts[k].loss / pred)
        m = float(sub.fit_var(C)[0]) + pts[k].var
        rho = math.log(C / pts[k - 1].flops)
        num += e * e - m
        den += rho * rho
        rows.append({"held_out": pts[k].name, "fitted": [p.name for p in pts[:k]], "predicted": pred,
                     "actual": pts[k].loss, "log_error": e, "noise_var": m, "reach_efolds": rho})
    # tau^2 is a variance estimated from a handful of held-out rungs: its prior (TAU_PRIOR, worth
    # PRIOR_DOF backtest points) is updated by them as a scaled inverse chi-square (conjugate) prior is
    tau2_prior = TAU_PRIOR**2
    if rows:
        n = len(rows)
        own = max(num, 0.0) / den * n  # the ladder's sum of (e^2 - noise) / rho^2 over its n points, pooled
        law.tau = math.sqrt((PRIOR_DOF * tau2_prior + own) / (PRIOR_DOF + n))
        law.tau_dof = float(PRIOR_DOF + n)
        law.backtest = {"method": f"each rung family from all smaller ones (at least {MIN_FIT}); tau^2 = (PRIOR_DOF "
                        "x prior^2 + n x max(0, sum(e^2 - noise)) / sum(reach^2)) / (PRIOR_DOF + n), dof PRIOR_DOF + n",
                        "points": rows, "tau": law.tau, "dof": law.tau_dof, "tau_ladder": math.sqrt(own / n),
                        "tau_prior": TAU_PRIOR, "prior_dof": PRIOR_DOF}
        if n < PRIOR_DOF:
            law.warnings.append(f"final-loss interval: its backtest rests on {n} held-out rung(s) "
                                f"({', '.join(r['held_out'] for r in rows)}), fewer than the prior's weight "
                                f"({PRIOR_DOF}): its extrapolation term leans on the prior {TAU_PRIOR} per e-fold")
    else:
        law.tau, law.tau_dof = TAU_PRIOR, float(PRIOR_DOF)
        law.backtest = {"method": f"none: {len(pts)} rung families leave none with {MIN_FIT} smaller ones to fit "
                        f"from; tau is the prior {TAU_PRIOR} per e-fold (Chinchilla envelopes)", "points": [],
                        "tau": law.tau, "dof": law.tau_dof, "tau_prior": TAU_PRIOR, "prior_dof": PRIOR_DOF}
        law.warnings.append(f"final-loss interval: no backtest can run on {len(pts)} rung families (it needs "
                            f"{MIN_FIT + 1}): its extrapolation term is the prior {TAU_PRIOR} per e-fold, not "
                            "this ladder's own")


def coverage(points: Sequence[Point], *, seed_var, seed_dof, eval_var=0.0, level: float = LEVEL,
             seed: int = 0) -> dict[str, Any] | None:
    """Each family with at least MIN_FIT smaller ones predicted from those with the whole method
    (its own nested backtest), against the family's mean final loss."""
    pts = sorted(points, key=lambda p: p.flops)
    pred, lo, hi, act, names = [], [], [], [], []
    for k in range(MIN_FIT, len(pts)):
        try:
            law = fit_final_law(pts[:k], seed_var=seed_var, seed_dof=seed_dof, eval_var=eval_var, level=level,
                                seed=seed)
        except FitError:
            continue
        iv = law.interval(pts[k].flops, target_var=pts[k].var)
        pred.append(iv["mean"]), lo.append(iv["lo"]), hi.append(iv["hi"]), act.append(pts[k].loss)
        names.append(pts[k].name)
    if not pred:
        return None
    out = law_backtest.summarise(pred, lo, hi, act)
    out.update(method=f"each rung family from the smaller ones (at least {MIN_FIT}), the whole interval method",
               level=level, held_out=names)
    return out
