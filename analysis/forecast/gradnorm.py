"""The hero's grad-norm envelope from its ladder, with a band whose width is backtested.

Each rung's grad norm (before clipping) is binned over the fraction of training (n_bins medians).
Log grad norm is a line in log active parameters across the rungs, one slope shared by all bins
and a level per bin (pooled least squares; one rung: flat), evaluated at the hero's size: the
envelope's centre. The band is, in log space,
a normal interval of two parts in quadrature:

- the rungs' pooled scatter about their lines;
- the step-to-step scatter of a run about its bin median (robust, pooled over the rungs), so that
  the band holds single steps, as a monitor reads them;
- an extrapolation term: `extrap_sd` per e-fold of size beyond the largest rung, measured by nested
  leave-largest-out backtests on the rungs themselves (predict rung k from rungs 1..k-1, for every
  k >= 3; without one, a stated prior of PRIOR_EXTRAP_SD per e-fold).

`backtest()` reports the coverage and width the method reached on those held-out rungs (every
logged step, at the level of the band), so the JSON says how far to trust it.

Shape legend: R rungs, B bins.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy.stats import norm

from analysis.forecast.file import ForecastError

LEVEL = 0.9
PRIOR_EXTRAP_SD = 0.25  # log grad norm per e-fold of size, when no backtest is possible
MIN_SCATTER = 0.05  # log-space floor of the per-bin scatter (a line through two points has none)

__all__ = ["RungGrad", "binned", "envelope", "backtest"]


class RungGrad:
    """One rung's grad norms: size (active params), fraction of training and values."""

    def __init__(self, name: str, size: float, frac, grad_norm):
        self.name, self.size = name, float(size)
        f, g = np.asarray(frac, dtype=np.float64), np.asarray(grad_norm, dtype=np.float64)
        ok = np.isfinite(f) & np.isfinite(g) & (g > 0)
        self.frac, self.g = f[ok], g[ok]


def binned(r: RungGrad, n_bins: int) -> np.ndarray:
    """Median log grad norm per bin of the fraction of training (NaN where a bin is empty)."""
    idx = np.clip((r.frac * n_bins).astype(int), 0, n_bins - 1)
    out = np.full(n_bins, np.nan)
    for b in range(n_bins):
        m = idx == b
        if m.any():
            out[b] = float(np.log(np.median(r.g[m])))
    return out


def _line(x_R: np.ndarray, y_RB: np.ndarray, x_new: float) -> tuple[np.ndarray, np.ndarray]:
    """Lines of y on x sharing one slope across bins (pooled least squares; each bin its own level),
    evaluated at x_new; and the pooled residual sd (NaN when there is no spare degree of freedom)."""
    B = y_RB.shape[1]
    ok_RB = np.isfinite(y_RB)
    xm_B = np.array([x_R[ok_RB[:, b]].mean() if ok_RB[:, b].any() else np.nan for b in range(B)])
    ym_B = np.array([y_RB[ok_RB[:, b], b].mean() if ok_RB[:, b].any() else np.nan for b in range(B)])
    dx_RB = np.where(ok_RB, x_R[:, None] - xm_B[None], 0.0)
    dy_RB = np.where(ok_RB, y_RB - ym_B[None], 0.0)
    sxx = float(np.sum(dx_RB**2))
    slope = float(np.sum(dx_RB * dy_RB) / sxx) if sxx > 0 else 0.0
    mean_B = ym_B + slope * (x_new - xm_B)
    resid = (dy_RB - slope * dx_RB)[ok_RB]
    dof = int(ok_RB.sum()) - int(np.isfinite(ym_B).sum()) - (1 if sxx > 0 else 0)
    sd = float(np.sqrt(np.sum(resid**2) / dof)) if dof > 0 else np.nan
    return mean_B, np.full(B, sd)


def step_scatter(rungs: Sequence[RungGrad], n_bins: int) -> float:
    """Robust sd of log grad norm about its bin median, pooled over rungs and bins."""
    dev = []
    for r in rungs:
        idx = np.clip((r.frac * n_bins).astype(int), 0, n_bins - 1)
        med_B = binned(r, n_bins)
        dev.append(np.log(r.g) - med_B[idx])
    d = np.concatenate(dev) if dev else np.zeros(0)
    d = d[np.isfinite(d)]
    return float(1.4826 * np.median(np.abs(d))) if len(d) else 0.0


def _predict(rungs: Sequence[RungGrad], size: float, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Centre per bin (log) and the sd of its parts that do not grow with extrapolation."""
    x_R = np.log([r.size for r in rungs])
    y_RB = np.stack([binned(r, n_bins) for r in rungs])
    mean_B, sd_B = _line(x_R, y_RB, math.log(size))
    fallback = np.nanmedian(sd_B) if np.isfinite(sd_B).any() else MIN_SCATTER
    sd_B = np.maximum(np.where(np.isfinite(sd_B), sd_B, fallback), MIN_SCATTER)
    return mean_B, np.sqrt(sd_B**2 + step_scatter(rungs, n_bins) ** 2)


def _nested(rungs: Sequence[RungGrad], n_bins: int) -> list[dict[str, Any]]:
    """Predict each rung k (k >= 3 by size) from the smaller ones: log errors of its bin medians (for
    the extrapolation term) and of its every step (for coverage), and the e-folds of the reach."""
    ordered = sorted(rungs, key=lambda r: r.size)
    out = []
    for k in range(2, len(ordered)):
        target, base = ordered[k], ordered[:k]
        mean_B, sd_B = _predict(base, target.size, n_bins)
        idx = np.clip((target.frac * n_bins).astype(int), 0, n_bins - 1)
        out.append({"name": target.name, "efolds": math.log(target.size / base[-1].size),
                    "err_B": binned(target, n_bins) - mean_B, "err_S": np.log(target.g) - mean_B[idx],
                    "sd_S": sd_B[idx]})
    return out


def _extrap_sd(nested: list[dict[str, Any]]) -> tuple[float, str]:
    num = den = 0.0
    for t in nested:
        e = t["err_B"][np.isfinite(t["err_B"])]
        num += float(np.sum(e * e))
        den += len(e) * t["efolds"] ** 2
    if den <= 0:
        return PRIOR_EXTRAP_SD, f"prior {PRIOR_EXTRAP_SD} per e-fold (fewer than 3 rungs: no backtest)"
    return math.sqrt(num / den), f"nested leave-largest-out backtests on {len(nested)} rung(s)"


def envelope(rungs: Sequence[RungGrad], hero_size: float, hero_steps: int, n_bins: int = 50,
             level: float = LEVEL) -> dict[str, Any]:
    if not rungs:
        raise ForecastError("a grad-norm envelope needs at least one rung with grad norms")
    mean_B, sd_B = _predict(rungs, hero_size, n_bins)
    nested = _nested(rungs, n_bins)
    c, how = _extrap_sd(nested)
    efolds = max(math.log(hero_size / max(r.size for r in rungs)), 0.0)
    zq = float(norm.ppf(0.5 + level / 2))
    half_B = zq * np.sqrt(sd_B**2 + (c * efolds) ** 2)
    centers = (np.arange(n_bins) + 0.5) / n_bins
    steps = np.round(centers * hero_steps).astype(int)
    return {
        "step": steps.tolist(), "frac": centers.tolist(),
        "mean": np.exp(mean_B).tolist(), "lo": np.exp(mean_B - half_B).tolist(), "hi": np.exp(mean_B + half_B).tolist(),
        "level": level, "extrap_sd_per_efold": c, "extrap_sd_from": how, "hero_efolds": efolds,
        "method": ("per bin of the fraction of training: log grad norm linear in log active params across rungs "
                   "(one slope shared by the bins), at the hero's size; band: the rungs' scatter about the line, "
                   "their step-to-step scatter and extrap_sd per e-fold beyond the largest rung, in quadrature, "
                   "normal quantiles in log space"),
        "backtest": backtest(rungs, n_bins, level, nested),
    }


def backtest(rungs: Sequence[RungGrad], n_bins: int = 50, level: float = LEVEL,
             nested: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Coverage and width of the band on held-out rungs: each rung k >= 3 predicted from the smaller
    ones, with extrap_sd from the backtests among those smaller ones only (prior when there are none)."""
    ordered = sorted(rungs, key=lambda r: r.size)
    nested = _nested(ordered, n_bins) if nested is None else nested
    if not nested:
        return None
    zq = float(norm.ppf(0.5 + level / 2))
    inside, width, err, per = [], [], [], []
    for t in nested:
        k = [r.name for r in ordered].index(t["name"])
        c, _ = _extrap_sd(_nested(ordered[:k], n_bins))
        half_S = zq * np.sqrt(t["sd_S"] ** 2 + (c * t["efolds"]) ** 2)
        ok = np.isfinite(t["err_S"]) & np.isfinite(half_S)
        hit = np.abs(t["err_S"][ok]) <= half_S[ok]
        inside.append(hit)
        width.append(2 * np.sinh(half_S[ok]))  # (hi - lo) / centre for a log-symmetric band
        err.append(np.abs(np.expm1(t["err_S"][ok])))
        per.append({"held_out": t["name"], "coverage": float(np.mean(hit)), "mean_abs_rel_err": float(np.mean(err[-1]))})
    return {"method": "nested leave-largest-out: each rung from the smaller ones, every logged step", "level": level,
            "n": int(sum(len(x) for x in inside)), "coverage": float(np.mean(np.concatenate(inside))),
            "mean_rel_width": float(np.mean(np.concatenate(width))),
            "mean_abs_rel_err": float(np.mean(np.concatenate(err))), "held_out": per}
