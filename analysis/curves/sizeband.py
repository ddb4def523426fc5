"""The curve band's size term from the fit's own sizes, per stretch of training.

A fit of several sizes predicts each of its sizes beyond the smallest from the smaller ones
(analysis.curves.fit._size_backtest). For each such held-out curve j the relative residual
pred / loss - 1 is averaged over each of STRETCHES equal stretches of relative position in the run
u = step / last step (the per-step noise averages out there; what is left is the size law's
systematic error, which changes sign along a curve and so cancels in the whole curve's mean), and
divided by the e-folds of N rho_j from the largest size that fit saw: a score s_jb per curve and stretch.

At a size rho e-folds beyond the fitted ones, the size term's half-width at stretch b is
rho x q_b x prediction, q_b the split-conformal quantile of the held-out scores of that stretch:
the ceil((n + 1) level)-th smallest of its n scores. With fewer than level / (1 - level) held-out
curves (9 at 90%) that rank exceeds n and the largest score stands (the band then holds at most
n / (n + 1) by its own argument: `short` says so). A stretch no held-out curve reached takes the
nearest stretch's quantile. The half-width adds in quadrature to the band's other half-widths.
The band uses it once MIN_HELD_OUT sizes were held out (three or more fitted sizes); with one held-out
size (its errors those of the one-size prior, not of the size law) it keeps its older terms.

Shape legend: J held-out curves, B stretches, n evaluated steps.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MIN_HELD_OUT", "STRETCHES", "stretch_index", "stretch_scores", "stretch_quantiles", "size_halfwidth"]

STRETCHES = 8  # equal stretches of relative position in the run (step / last step)
# the band (analysis.curves.fitted.CurveFit.band) uses these scores from this many held-out sizes on;
# below it keeps the bootstrap / LR-area / size_sd band
MIN_HELD_OUT = 2


def stretch_index(steps, n_stretches: int = STRETCHES) -> np.ndarray:
    """(n,) the stretch of each step: relative position step / last step in n_stretches equal bins."""
    s = np.asarray(steps, dtype=np.float64)
    u = s / max(float(s[-1]), 1.0) if len(s) else s
    return np.clip((u * n_stretches).astype(np.int64), 0, n_stretches - 1)


def stretch_scores(steps, pred, loss, efolds: float, n_stretches: int = STRETCHES) -> list[float | None]:
    """(B,) one held-out curve's |mean relative residual| per stretch / e-folds of N (None: no point there)."""
    if not efolds > 0:
        raise ValueError(f"e-folds of N must be positive, got {efolds}")
    r = np.asarray(pred, dtype=np.float64) / np.asarray(loss, dtype=np.float64) - 1.0
    b = stretch_index(steps, n_stretches)
    out: list[float | None] = []
    for i in range(n_stretches):
        m = (b == i) & np.isfinite(r)
        out.append(float(abs(r[m].mean()) / efolds) if m.any() else None)
    return out


def stretch_quantiles(scores: list[list[float | None]], level: float) -> tuple[np.ndarray, bool]:
    """(B,) the split-conformal `level` quantile of each stretch's held-out scores (J x B, None where
    a curve has no point), empty stretches filled from the nearest one; and whether any stretch had
    too few scores for the conformal rank (its largest score stands)."""
    if not scores:
        raise ValueError("no held-out scores")
    B = len(scores[0])
    q = np.full(B, np.nan)
    short = False
    for b in range(B):
        col = np.sort([s[b] for s in scores if s[b] is not None and math.isfinite(s[b])])
        if not len(col):
            continue
        k = math.ceil((len(col) + 1) * level)
        short |= k > len(col)
        q[b] = col[min(k, len(col)) - 1]
    have = np.flatnonzero(np.isfinite(q))
    if not len(have):
        raise ValueError("no held-out scores")
    for b in np.flatnonzero(~np.isfinite(q)):
        q[b] = q[have[np.argmin(np.abs(have - b))]]
    return q, short


def size_halfwidth(steps, pred, efolds: float, scores: list[list[float | None]], level: float) -> np.ndarray:
    """(n,) the size term's half-width at each step: e-folds of N beyond the fitted sizes x its
    stretch's conformal quantile x the prediction."""
    pred = np.asarray(pred, dtype=np.float64)
    if not efolds > 0:
        return np.zeros_like(pred)
    q, _ = stretch_quantiles(scores, level)
    return efolds * q[stretch_index(steps, len(q))] * pred
