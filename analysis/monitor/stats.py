"""Numbers the monitor's checks are made of: column access, runs of k points, rolling medians,
OLMo 2's spike score, the local-trend spike test, throughput measured and planned."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
from numpy.lib.stride_tricks import sliding_window_view

from core.costs import flops_per_token
from core.spec import Spec

__all__ = ["column", "first_run", "interp_inside", "iso_utc", "json_num", "local_spike_z", "measured_tokens_per_s",
           "olmo_spike_score", "planned_tokens_per_s", "rolling_median", "spec_warmup_steps"]



def column(df: pd.DataFrame, name: str) -> np.ndarray | None:
    if name not in df.columns:
        return None
    v = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=np.float64)
    return None if np.all(np.isnan(v)) else v


def first_run(mask_N: np.ndarray, k: int) -> tuple[int, int] | None:
    """(start, end) indices of the first run of k consecutive True values, or None."""
    run = 0
    for i, m in enumerate(mask_N):
        run = run + 1 if m else 0
        if run >= k:
            return i - k + 1, i
    return None


def rolling_median(x: np.ndarray, k: int) -> np.ndarray:
    if k <= 1:
        return x.copy()
    return pd.Series(x).rolling(k, min_periods=k).median().to_numpy()


def json_num(x: Any) -> Any:
    """A JSON-safe number (NaN/inf become strings, numpy scalars become Python numbers)."""
    if x is None:
        return None
    if isinstance(x, (np.integer,)):
        return int(x)
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def olmo_spike_score(x: np.ndarray, window: int = 1000, sigma: float = 7.0, min_history: int = 2) -> float:
    """OLMo 2's spike score: share of points more than `sigma` standard deviations from the rolling
    mean of the previous `window` points (points with fewer than `min_history` predecessors, or a
    non-finite value, are not scored)."""
    s = pd.Series(x).replace([np.inf, -np.inf], np.nan)
    prev = s.shift(1).rolling(window, min_periods=min_history)
    mu, sd = prev.mean().to_numpy(), prev.std(ddof=0).to_numpy()
    v = s.to_numpy()
    ok = np.isfinite(v) & np.isfinite(mu) & np.isfinite(sd)
    if not ok.any():
        return 0.0
    return float(np.mean(np.abs(v[ok] - mu[ok]) > sigma * np.maximum(sd[ok], 1e-12)))


def local_spike_z(steps: np.ndarray, x: np.ndarray, window: int, min_history: int) -> tuple[np.ndarray, np.ndarray]:
    """(z, prediction) of each point against a quadratic least-squares fit through the previous
    `window` finite points, extrapolated one point ahead (NaN where there is too little history).
    Quadratic, not linear: a curve still falling fast bends enough within one window that a line
    extrapolates far below the next point. z includes the fit's own extrapolation variance."""
    n = len(x)
    z_N = np.full(n, np.nan)
    pred_N = np.full(n, np.nan)
    if n <= min_history:
        return z_N, pred_N
    xf = np.where(np.isfinite(x), x, np.nan).astype(np.float64)
    pad = np.full(window, np.nan)
    xp = sliding_window_view(np.concatenate([pad, xf]), window)  # row i: the `window` points before i
    tp = sliding_window_view(np.concatenate([pad, steps.astype(np.float64)]), window)
    for a in range(0, n, 20000):
        b = min(n, a + 20000)
        X_CW = xp[a:b]
        T_CW = tp[a:b] - steps[a:b, None]  # relative to the point predicted: its own t is 0
        mask_CW = np.isfinite(X_CW) & np.isfinite(T_CW)
        cnt_C = mask_CW.sum(1)
        scale_C = np.nanmax(np.where(mask_CW, np.abs(T_CW), np.nan), axis=1, initial=0.0)
        scale_C = np.where(scale_C > 0, scale_C, 1.0)
        T_CW = np.where(mask_CW, T_CW / scale_C[:, None], 0.0)
        X_CW = np.where(mask_CW, X_CW, 0.0)
        w_CW = mask_CW.astype(np.float64)
        basis_CWP = np.stack([w_CW, T_CW * w_CW, T_CW * T_CW * w_CW], axis=-1)
        gram_CPP = np.einsum("cwp,cwq->cpq", basis_CWP, basis_CWP) + 1e-9 * np.eye(3)
        rhs_CP = np.einsum("cwp,cw->cp", basis_CWP, X_CW)
        ok_C = cnt_C >= max(min_history, 4)
        if not ok_C.any():
            continue
        inv_CPP = np.linalg.inv(gram_CPP[ok_C])
        coef_CP = np.einsum("cpq,cq->cp", inv_CPP, rhs_CP[ok_C])
        fit_CW = np.einsum("cwp,cp->cw", basis_CWP[ok_C], coef_CP)
        resid_CW = (X_CW[ok_C] - fit_CW) * w_CW[ok_C]
        sd_C = np.sqrt((resid_CW**2).sum(1) / np.maximum(cnt_C[ok_C] - 3, 1))
        level_C = np.abs(X_CW[ok_C].sum(1) / cnt_C[ok_C])
        # A floor on sigma so a perfectly smooth (e.g. logged-averaged) curve does not make every
        # wiggle a spike: 0.1% of the local level.
        sd_C = np.maximum(sd_C * np.sqrt(1.0 + inv_CPP[:, 0, 0]), 1e-3 * level_C)
        idx = np.arange(a, b)[ok_C]
        pred_N[idx] = coef_CP[:, 0]
        z_N[idx] = (xf[idx] - coef_CP[:, 0]) / np.where(sd_C > 0, sd_C, np.nan)
    z_N[~np.isfinite(z_N)] = np.nan
    return z_N, pred_N


def interp_inside(xq: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    out = np.interp(xq, xp, fp)
    out[(xq < xp[0]) | (xq > xp[-1])] = np.nan
    return out


def spec_warmup_steps(spec: Spec) -> int:
    s = spec.schedule
    return s.warmup_steps if s.warmup_steps is not None else int(round(s.warmup_frac * spec.total_steps))


def planned_tokens_per_s(spec: Spec) -> float | None:
    """Tokens/s the spec's hardware gives at its expected MFU."""
    devices = max(spec.hardware.n_gpus, 1)
    return spec.hardware.expected_mfu * spec.hardware.peak_flops * devices / float(flops_per_token(spec))


def measured_tokens_per_s(df: pd.DataFrame, points: int = 20) -> float | None:
    """Tokens over wall time across the last `points` records (what a deadline sees: eval and
    checkpoint pauses included); else the median of the logged tokens_per_s."""
    tok, t = column(df, "tokens"), column(df, "time")
    if tok is not None and t is not None:
        ok = np.isfinite(tok) & np.isfinite(t) & (t > 0)
        tok, t = tok[ok][-points - 1 :], t[ok][-points - 1 :]
        if len(t) >= 2 and t[-1] > t[0] and tok[-1] > tok[0]:
            return float((tok[-1] - tok[0]) / (t[-1] - t[0]))
    tps = column(df, "tokens_per_s")
    if tps is not None:
        v = tps[np.isfinite(tps) & (tps > 0)]
        if len(v):
            return float(np.median(v[-points:]))
    return None


def iso_utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
