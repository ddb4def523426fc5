"""The healthy runs' spread of a block mean, and the degrees of freedom it really rests on.

    s = spread(M_RB, S_RB, per_block)      # Spread: mu, sd, scatter, dof, widen, z per block

analysis.monitor.calib's module docstring states the arithmetic; this module computes it.

Shape legend: R healthy runs, B blocks, n the blocks where the runs logged the series.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd

__all__ = ["NEIGHBOURS", "Spread", "effective_dof", "lag_correlation", "spread", "tail_widening"]

NEIGHBOURS = 2  # blocks each side whose healthy variance is pooled with a block's own


@dataclass(frozen=True)
class Spread:
    """Per block (B,): the healthy mean mu, the predictive sd of a new run's block mean (widened
    for its dof), one point's within-block scatter, the dof and widening each rests on; z (R, B):
    each run's deviation from mu over the pooled sd (NaN where not pooled); lag_corr: the
    deviations' correlation at lags 1..2 NEIGHBOURS (logged blocks)."""

    mu: np.ndarray
    sd: np.ndarray
    scatter: np.ndarray
    dof: np.ndarray
    widen: np.ndarray
    z: np.ndarray
    lag_corr: np.ndarray


def lag_correlation(Z_RN: np.ndarray, lags: int) -> np.ndarray:
    """(lags,): the runs' standardised deviations' correlation at lag 1..lags (uncentred: a
    deviation from the healthy mean has mean 0), clipped to [0, 1]; 1 (no independence claimed)
    where fewer than 5 pairs measure it."""
    out = np.ones(lags)
    for lag in range(1, lags + 1):
        if Z_RN.shape[1] <= lag:
            continue
        a, b = Z_RN[:, lag:].ravel(), Z_RN[:, :-lag].ravel()
        ok = np.isfinite(a) & np.isfinite(b)
        den = float(np.sqrt(np.sum(a[ok] ** 2) * np.sum(b[ok] ** 2)))
        if ok.sum() >= 5 and den > 0:
            out[lag - 1] = float(np.clip(np.sum(a[ok] * b[ok]) / den, 0.0, 1.0))
    return out


def effective_dof(d_N: np.ndarray, corr: np.ndarray, w: int = NEIGHBOURS) -> np.ndarray:
    """(n,): the dof of the variance pooled over each logged block's 2 w + 1 nearest, whose own
    dofs d_j (runs there - 1) are correlated: nu = (sum d_j)^2 / sum_jk rho_jk^2 min(d_j, d_k),
    rho_jk the deviations' correlation at lag |j - k| (rho^2: that of their squares)."""
    n = len(d_N)
    r2 = np.concatenate([[1.0], np.asarray(corr, dtype=np.float64) ** 2])
    out = np.empty(n)
    for i in range(n):
        j = np.arange(max(0, i - w), min(n, i + w + 1))
        d = d_N[j]
        lag = np.abs(j[:, None] - j[None, :])
        rr = r2[np.minimum(lag, len(r2) - 1)]
        out[i] = d.sum() ** 2 / max(float(np.sum(rr * np.minimum(d[:, None], d[None, :]))), 1e-12)
    return out


def spread(M_RB: np.ndarray, S_RB: np.ndarray, per_block: np.ndarray) -> Spread:
    """The spread of R healthy runs' block means M_RB (within-block scatters S_RB, points per block
    per_block). A block's variance is pooled over the 2 NEIGHBOURS + 1 nearest blocks where the
    runs logged the series (every block for the train loss; one in several for a periodic eval),
    weighted by their dofs, floored at the noise of one run's block mean (the within-block scatter),
    and widened by the t quantile of the effective dof of that pool (effective_dof)."""
    R, B = M_RB.shape
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN block is NaN, as meant
        mu = np.nanmean(M_RB, 0)
        cnt = np.isfinite(M_RB).sum(0)
        var = np.where(cnt >= 2, np.nanvar(M_RB, 0, ddof=1), np.nan) if R >= 2 else np.full(B, np.nan)
        scat = np.sqrt(np.nanmean(S_RB ** 2, 0))
    floor = (np.nan_to_num(scat, nan=0.0) ** 2) / per_block
    pooled, dof_b = np.full(B, np.nan), np.full(B, 1.0)
    z = np.full((R, B), np.nan)
    corr = np.ones(2 * NEIGHBOURS)
    have = np.flatnonzero(np.isfinite(var))
    if len(have):
        d = (cnt[have] - 1).astype(np.float64)
        win = 2 * NEIGHBOURS + 1
        num = pd.Series(var[have] * d).rolling(win, center=True, min_periods=1).sum().to_numpy()
        den = pd.Series(d).rolling(win, center=True, min_periods=1).sum().to_numpy()
        pool = num / den
        with np.errstate(invalid="ignore", divide="ignore"):
            z[:, have] = (M_RB[:, have] - mu[have]) / np.sqrt(np.where(pool > 0, pool, np.nan))
        corr = lag_correlation(z[:, have], 2 * NEIGHBOURS)
        nu = effective_dof(d, corr)
        # every block takes the pool of the nearest block that has a variance of its own
        j = np.clip(np.searchsorted(have, np.arange(B)), 0, len(have) - 1)
        left = np.clip(j - 1, 0, len(have) - 1)
        j = np.where(np.abs(have[left] - np.arange(B)) < np.abs(have[j] - np.arange(B)), left, j)
        pooled, dof_b = pool[j], np.maximum(nu[j], 1.0)
    v = np.where(cnt >= 1, np.maximum(np.nan_to_num(pooled, nan=0.0), floor), np.nan)
    from scipy import stats  # calibration only: the CLI's import of the monitor stays light

    widen_b = stats.t.ppf(0.975, dof_b) / NormalDist().inv_cdf(0.975)
    sd = np.sqrt(v * (1 + 1 / max(R, 1))) * widen_b
    return Spread(mu=mu, sd=np.where(sd > 0, sd, np.nan), scatter=scat, dof=dof_b, widen=widen_b, z=z, lag_corr=corr)


def tail_widening(dof: float, tail: float) -> float:
    """How much wider than its 97.5% widening a spread resting on `dof` degrees of freedom must be
    for a normal test at one-sided `tail` to keep its rate: [t_dof(1 - tail) / z(1 - tail)] /
    [t_dof(0.975) / z(0.975)] (1 for many dof; about 2.3 at 4 dof and 7.5 at 2 for tail 1.4e-4)."""
    from scipy import stats  # a calibration from two runs only: the CLI's import of the monitor stays light

    dof = max(float(dof), 1.0)
    z = NormalDist()
    return float((stats.t.ppf(1 - tail, dof) / z.inv_cdf(1 - tail)) / (stats.t.ppf(0.975, dof) / z.inv_cdf(0.975)))
