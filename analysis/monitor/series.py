"""The series the monitor judges and a run's residual against its reference, by block.

    steps, values = series_values(df, "loss")               # finite points of one series
    r = residual("loss", steps, values, forecast)           # log x_t - log ref(t)
    m, scatter, n = block_means(steps, r, edges)            # per block of training
    m = block_mean(steps, r, edges)                         # the means alone (cheaper)

Shape legend: B blocks (stretches of training), N logged points of one run.

The residual. For a series x (train loss, grad norm, held-out eval loss and each source's when every healthy
run logs it, router entropy, the expert load (expert_load_max: the busiest expert's load over the mean), and
the train/eval gap: eval loss over the median train loss of the 10 points before it) a run's
residual at step t is
r_t = log x_t - log ref(t), ref the forecast's trajectory (loss: trajectory.loss; grad norm:
grad_norm.mean) where the forecast covers t, or 1 for a series the forecast does not forecast
(router entropy, expert load, the gap, the eval losses) and when the calibration was made without
a forecast (then the healthy runs' mean, analysis.monitor.calib, is the reference itself). Log, so
a residual is relative.

Blocks. Training is cut into B equal stretches of steps (edges from 0 to the calibrating spec's
total steps; default B = 100, 1% each). A run's block mean m_b is the mean of its finite
residuals in block b; only complete blocks are tested (a live run's last, partial block waits).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast
from analysis.monitor.stats import column

__all__ = ["EVAL_SERIES", "UNMARKED", "block_mean", "block_means", "eval_sample", "eval_series", "is_eval_series", "reference", "residual", "series_values", "source_eval_names", "throughput_ratio"]


def _col(df: pd.DataFrame, name: str) -> np.ndarray | None:
    """A column by its name, or as the trainer's extras carry it (extra.<name>)."""
    v = column(df, name)
    return v if v is not None else column(df, f"extra.{name}")


# the series whose level is the periodic eval's: they compare across runs only on the same sample
EVAL_SERIES = ("eval_loss", "train_eval_gap")
UNMARKED = "unmarked"  # records that do not say how their periodic evals were sampled


def is_eval_series(series: str) -> bool:
    return series in EVAL_SERIES or series.startswith("eval_loss/")


def eval_sample(df: pd.DataFrame) -> str | None:
    """How a run's periodic evals were sampled, from its records: "stratified:<k>" (each source's
    stratified sample of k windows, engines.evalset.periodic_windows: the trainer logs
    eval_periodic_windows at every eval), "unmarked" for records that do not say (runs from before
    the stratified sample scored a prefix of each source, which sits below the final eval; another
    stack's export), None without any eval. Two runs' periodic eval levels compare only when
    these agree."""
    ev = eval_series(df)[0]
    if ev is None or not np.isfinite(ev).any():
        return None
    k = _col(df, "eval_periodic_windows")
    if k is None or not np.isfinite(k).any():
        return UNMARKED
    return f"stratified:{int(np.nanmax(k))}"


def eval_series(df: pd.DataFrame) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(eval loss (N,), its standard error (N,) or None): the periodic subset's value where the
    records carry it (eval_loss_periodic: the same windows at every eval, the final one included,
    so one continuous series), else eval_loss. At a final eval (every window) the standard error
    logged is the whole set's, not the periodic subset's: it is dropped there."""
    ev = _col(df, "eval_loss_periodic")
    periodic = ev is not None
    if ev is None:
        ev = column(df, "eval_loss")
    se = _col(df, "eval_loss_se")
    final = _col(df, "eval_final")
    if se is not None and periodic and final is not None:
        se = np.where(np.nan_to_num(final) > 0, np.nan, se)
    return ev, se


def source_eval_names(df: pd.DataFrame) -> list[str]:
    """eval_loss/<source> series the frame carries (as columns or extras)."""
    out = set()
    for c in df.columns:
        c = str(c)
        c = c[len("extra."):] if c.startswith("extra.") else c
        if c.startswith("eval_loss/"):
            out.add(c)
    return sorted(out)


def series_values(df: pd.DataFrame, series: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values) of a series in a metrics frame, finite points only; None when absent.
    train_eval_gap is the eval loss (eval_series) over the median train loss of the (up to 10)
    points before it; a source's eval loss leaves out the final eval (scored on every window, not
    the periodic subset); an expert load of 0 is one not measured."""
    steps = df["step"].to_numpy(dtype=np.int64)
    if series.startswith("eval_loss/"):
        v, final = _col(df, series), _col(df, "eval_final")
        if v is None:
            return None
        ok = np.isfinite(v) & ~(np.nan_to_num(final) > 0 if final is not None else False)
        return (steps[ok], v[ok]) if ok.any() else None
    if series == "eval_loss":
        v = eval_series(df)[0]
        if v is None:
            return None
        ok = np.isfinite(v)
        return (steps[ok], v[ok]) if ok.any() else None
    if series == "train_eval_gap":
        ev, loss = eval_series(df)[0], column(df, "loss")
        if ev is None or loss is None:
            return None
        idx = np.flatnonzero(np.isfinite(ev))
        med = pd.Series(np.where(np.isfinite(loss), loss, np.nan)).rolling(10, min_periods=3).median().to_numpy()
        v = ev[idx] / med[idx]
        ok = np.isfinite(v) & (v > 0)
        return (steps[idx][ok], v[ok]) if ok.any() else None
    v = column(df, series)
    if v is None:
        return None
    ok = np.isfinite(v)
    if series == "expert_load_max":  # 0: an engine that does not measure it (the record's default)
        ok &= v > 0
    return (steps[ok], v[ok]) if ok.any() else None


def throughput_ratio(df: pd.DataFrame, k: int) -> np.ndarray | None:
    """Per point: the median logged tokens/s of the last k points over the median of all points
    before them (NaN until there are 2 k points); None without tokens/s."""
    tps = column(df, "tokens_per_s")
    if tps is None:
        return None
    v = pd.Series(tps[np.isfinite(tps) & (tps > 0)])
    if len(v) < 2 * k:
        return None
    ratio = np.array((v.rolling(k).median() / v.expanding().median().shift(k)).to_numpy(), dtype=np.float64)
    ratio[: 2 * k - 1] = np.nan
    return ratio


def reference(series: str, steps: np.ndarray, forecast: Forecast | None) -> np.ndarray:
    """log ref(t) per step: the forecast's trajectory (NaN outside it), or 0 without a forecast."""
    s = np.asarray(steps, dtype=np.float64)
    if forecast is None:
        return np.zeros(len(s))
    if series == "loss":
        xp, fp = forecast.traj_step, forecast.traj_loss
    elif series == "grad_norm" and forecast.gn_step is not None and forecast.gn_mean is not None:
        xp, fp = forecast.gn_step, forecast.gn_mean
    else:
        return np.zeros(len(s))
    ok = np.isfinite(fp) & (fp > 0)
    out = np.interp(s, xp[ok], np.log(fp[ok]))
    out[(s < xp[ok][0]) | (s > xp[ok][-1])] = np.nan
    return out


def residual(series: str, steps: np.ndarray, values: np.ndarray, forecast: Forecast | None) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = np.where(np.isfinite(v) & (v > 0), np.log(np.where(v > 0, v, 1.0)), np.nan)
    return lv - reference(series, steps, forecast)


def _by_block(steps: np.ndarray, r: np.ndarray, edges: np.ndarray) -> tuple[int, pd.DataFrame]:
    """(B, the finite residuals inside the blocks with their block index b)."""
    B = len(edges) - 1
    idx = np.searchsorted(edges, steps, side="right") - 1
    ok = np.isfinite(r) & (idx >= 0) & (idx < B)
    return B, pd.DataFrame({"b": idx[ok], "r": r[ok]})


def _mean(B: int, g, edges: np.ndarray, complete_to: int | None) -> np.ndarray:
    mean = np.full(B, np.nan)
    if g is not None:
        m = g.mean()
        mean[m.index.to_numpy()] = m.to_numpy()
    if complete_to is not None:
        mean[edges[1:] - 1 > complete_to] = np.nan
    return mean


def block_mean(steps: np.ndarray, r: np.ndarray, edges: np.ndarray, complete_to: int | None = None) -> np.ndarray:
    """block_means' mean (B,) alone, the same numbers, for the tests that read only the level: the
    scatter's two medians a block are nine tenths of block_means' cost, and the monitor reads the
    means of every series at every check."""
    B, df = _by_block(steps, r, edges)
    return _mean(B, df.groupby("b")["r"] if len(df) else None, edges, complete_to)


def block_means(steps: np.ndarray, r: np.ndarray, edges: np.ndarray, complete_to: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean (B,), within-block robust scatter of one point (B,), points (B,)) of residuals r by
    block; a block past `complete_to` (the last step logged) is NaN: it is not complete yet."""
    B, df = _by_block(steps, r, edges)
    g = df.groupby("b")["r"] if len(df) else None
    mean = _mean(B, g, edges, complete_to)
    n = np.zeros(B, dtype=np.int64)
    scat = np.full(B, np.nan)
    if g is not None:
        c = g.count()
        n[c.index.to_numpy()] = c.to_numpy()
        dev = (df["r"] - g.transform("median")).abs()
        mad = 1.4826 * dev.groupby(df["b"]).median()
        mad[c.reindex(mad.index) < 3] = np.nan
        scat[mad.index.to_numpy()] = mad.to_numpy()
    return mean, scat, n
