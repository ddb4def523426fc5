"""Backtests of a scaling-law fit on its own data: how far off, and how often inside its interval,
a prediction lands on points the fit never saw.

- `cross_validate`: leave-one-out (up to 40 points) or K-fold (K = 10, seeded) refits; each held-out
  point is predicted with the refit's prediction interval (analysis.laws.fit: bootstrap spread and
  residual scatter in quadrature).
- `extrapolate`: refit on the points whose first variable (N, or C) is at most 1/`factor` of its
  largest value and predict the rest: the 'size 4x beyond the largest fitted' a ladder is for.

Both report the mean absolute relative error, the signed mean, the interval's coverage and its mean
relative width (hi - lo) / prediction, at the fit's level.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from analysis.laws.fit import FitError, fit_envelope, fit_law

LOO_MAX = 40
K_FOLDS = 10
BOOT = 50  # bootstrap refits per backtest fit

__all__ = ["cross_validate", "extrapolate", "summarise"]


def summarise(pred_R, lo_R, hi_R, loss_R) -> dict[str, Any]:
    pred_R, lo_R, hi_R, loss_R = (np.asarray(a, dtype=np.float64) for a in (pred_R, lo_R, hi_R, loss_R))
    rel_R = (pred_R - loss_R) / loss_R
    inside_R = (loss_R >= lo_R) & (loss_R <= hi_R)
    return {
        "n": int(len(loss_R)),
        "mean_abs_rel_err": float(np.mean(np.abs(rel_R))),
        "mean_signed_rel_err": float(np.mean(rel_R)),
        "max_abs_rel_err": float(np.max(np.abs(rel_R))),
        "coverage": float(np.mean(inside_R)),
        "mean_rel_width": float(np.mean((hi_R - lo_R) / pred_R)),
    }


def _predict(fit, cols: Sequence[np.ndarray], idx: np.ndarray, level: float):
    p = fit._predict([c[idx] for c in cols], level)
    return np.atleast_1d(p["loss"]), np.atleast_1d(p["lo"]), np.atleast_1d(p["hi"])


def cross_validate(fit_fn: Callable, cols: Sequence[np.ndarray], loss: np.ndarray, *, level: float,
                   seed: int = 0, start=None) -> dict[str, Any] | None:
    """Leave-one-out (n <= LOO_MAX) or K-fold refits with `fit_fn(*cols, loss, n_bootstrap, level, seed)`;
    start: the fit of all the points, which warm-starts every refit (each fold's optimum lies next to it)."""
    n = len(loss)
    folds_n = n if n <= LOO_MAX else K_FOLDS
    order = np.random.default_rng(seed).permutation(n)
    pred, lo, hi, truth = [], [], [], []
    failed = 0
    for f in range(folds_n):
        test = order[f::folds_n]
        train = np.setdiff1d(np.arange(n), test)
        try:
            fit = fit_fn(*[c[train] for c in cols], loss[train], n_bootstrap=BOOT, level=level, seed=seed,
                         **({"start": start} if start is not None else {}))
        except FitError:
            failed += 1
            continue
        p, l, h = _predict(fit, cols, test, level)
        pred.append(p), lo.append(l), hi.append(h), truth.append(loss[test])
    if not pred:
        return None
    out = summarise(np.concatenate(pred), np.concatenate(lo), np.concatenate(hi), np.concatenate(truth))
    out.update(method="leave-one-out" if folds_n == n else f"{folds_n}-fold cross-validation",
               level=level, failed_fits=failed)
    return out


def extrapolate(fit_fn: Callable, cols: Sequence[np.ndarray], loss: np.ndarray, *, level: float, factor: float = 4.0,
                min_points: int = 5, seed: int = 0, start=None) -> dict[str, Any] | None:
    """Fit on points with cols[0] <= max / factor, predict the others; start: the fit of all the points
    (its own extrapolation sub-fit, on the same points when factor is 4, warm-starts this one)."""
    x = cols[0]
    cut = float(np.max(x)) / factor
    train, test = np.flatnonzero(x <= cut * (1 + 1e-9)), np.flatnonzero(x > cut * (1 + 1e-9))
    if len(train) < min_points or not len(test):
        return None
    try:
        warm = getattr(start, "sub_params", None)
        fit = fit_fn(*[c[train] for c in cols], loss[train], n_bootstrap=BOOT, level=level, seed=seed,
                     **({"start": warm} if warm else {}))
    except FitError as e:
        return {"method": f"fit below max/{factor:g}, predict above", "error": str(e)}
    p, l, h = _predict(fit, cols, test, level)
    out = summarise(p, l, h, loss[test])
    reach = float(np.max(x[test]) / np.max(x[train]))
    out.update(method=f"fit on points with the first variable <= max/{factor:g}, predict the rest", level=level,
               n_train=int(len(train)), reach=reach, fit_converged=bool(fit.converged), fit_warnings=fit.warnings)
    return out


def fit_n_d(N, D, loss, **kw):
    return fit_law(N, D, loss, strict=True, **kw)


def fit_c(C, loss, **kw):
    return fit_envelope(C, loss, strict=True, **kw)
