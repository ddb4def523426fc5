"""The loss's batch-to-batch deviation as a property of the data stream, carried from the rungs to
the run they forecast.

Runs that read one data stream (the same sources, mixture, tokenizer, sequence length, held-out
share and seed, and no phases or context stages that depend on a run's length) see the same tokens
at the same position of their training, whatever their batch size. A batch's loss deviates from
the run's smooth trend by an amount that is mostly the content's: on the H200 ladder the per-step
log deviations of a rung and of the next size up, averaged over the same token windows, correlate
0.99, and removing them leaves about 1% of the 6-7% per-step scatter. The deviation the rungs
measured at tokens (a, b] is therefore a forecast of the deviation another run of that stream will
show there; a smooth curve model cannot forecast it at all.

Method (stated, no parameter fitted to the target):
- each run's deviation per step is log(loss) minus its centred rolling mean of log(loss) over
  TREND_STEPS steps (its own smooth trend; what the curve model describes);
- a target step covering tokens (s b, (s+1) b] (b its tokens per step) gets, from each run whose
  logged steps cover that window, the token-weighted mean of that run's deviations over it (exact for
  a piecewise-constant deviation per step), and the mean over those runs; a step no run covers gets
  0 and is marked uncovered;
- the scatter left after the transfer (`residual_sd`) is measured leave-one-run-out on the runs
  themselves: each run's deviations forecast from the others where they cover it.

The forecast of a run's per-step loss is then the smooth forecast x exp(deviation).

Shape legend: n logged steps of one run, T target steps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

TREND_STEPS = 101  # width of each run's own smooth trend (centred rolling mean of log loss), in its steps

__all__ = ["TREND_STEPS", "StreamRun", "same_stream", "stream_key", "deviations", "transfer", "loo_residual_sd"]


class StreamRun:
    """A run's per-step train loss on its token clock: steps (n,), loss (n,), tokens per step."""

    def __init__(self, name: str, steps, loss, tokens_per_step: float, key=None):
        steps, loss = np.asarray(steps, dtype=np.int64), np.asarray(loss, dtype=np.float64)
        ok = np.isfinite(loss) & (loss > 0)
        order = np.argsort(steps[ok], kind="stable")
        self.name, self.steps, self.loss = name, steps[ok][order], loss[ok][order]
        self.tokens_per_step, self.key = float(tokens_per_step), key

    @classmethod
    def from_run(cls, run) -> "StreamRun":
        """From an analysis.forecast.hero.RungRun (spec + metrics frame)."""
        df = run.metrics.dropna(subset=["loss"]) if "loss" in run.metrics else run.metrics.iloc[:0]
        return cls(run.spec.name, df["step"].to_numpy(), pd.to_numeric(df["loss"], errors="coerce").to_numpy(),
                   run.spec.data.tokens_per_step, stream_key(run.spec))


def stream_key(spec) -> tuple | None:
    """What makes two runs read the same tokens at the same position; None when the stream depends on
    the run's own length (data phases or context stages), so nothing is carried."""
    d = spec.data
    if d.phases or d.context_stages:
        return None
    return (repr(d.sources), d.tokenizer, d.seq_len, d.eval_fraction, d.max_epochs, spec.seed)


def same_stream(target_spec, runs: Sequence) -> list:
    """The runs (RungRun) that read the target's data stream."""
    key = stream_key(target_spec)
    return [] if key is None else [r for r in runs if stream_key(r.spec) == key]


def deviations(run: StreamRun, trend_steps: int = TREND_STEPS) -> np.ndarray:
    """log(loss) minus its centred rolling mean over trend_steps steps, per logged step (n,)."""
    ll = np.log(run.loss)
    trend = pd.Series(ll).rolling(trend_steps, center=True, min_periods=1).mean().to_numpy()
    return ll - trend


def _window_means(run: StreamRun, dev: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Token-weighted mean of the run's per-step deviation over each token window (lo, hi]; NaN where
    the run's logged steps do not cover it. Step s of the run covers tokens (s b, (s+1) b]."""
    b = run.tokens_per_step
    if len(run.steps) < 2:
        return np.full(len(lo), np.nan)
    # contiguous logged steps only: a gap ends the covered range
    gaps = np.flatnonzero(np.diff(run.steps) != 1)
    last = gaps[0] + 1 if len(gaps) else len(run.steps)
    steps, dev = run.steps[:last], dev[:last]
    edges = np.r_[steps[0], steps + 1] * b
    F = np.r_[0.0, np.cumsum(dev * b)]
    out = (np.interp(hi, edges, F) - np.interp(lo, edges, F)) / np.maximum(hi - lo, 1e-12)
    return np.where((lo >= edges[0]) & (hi <= edges[-1]), out, np.nan)


def transfer(runs: Sequence[StreamRun], target_steps, target_tokens_per_step: float,
             trend_steps: int = TREND_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """(deviation (T,), covered (T,) bool) for the target's steps from the runs' deviations."""
    s = np.asarray(target_steps, dtype=np.float64)
    lo, hi = s * target_tokens_per_step, (s + 1) * target_tokens_per_step
    if not runs:
        return np.zeros(len(s)), np.zeros(len(s), dtype=bool)
    W = np.array([_window_means(r, deviations(r, trend_steps), lo, hi) for r in runs])
    covered = np.isfinite(W).any(0)
    dev = np.zeros(len(s))
    if covered.any():
        dev[covered] = np.nanmean(W[:, covered], 0)
    return dev, covered


def loo_residual_sd(runs: Sequence[StreamRun], trend_steps: int = TREND_STEPS) -> dict:
    """Each run's per-step deviations forecast from the other runs where they cover it: the robust sd
    (1.4826 x MAD) of what is left, and of the deviations themselves, pooled over the runs."""
    left, raw = [], []
    for i, r in enumerate(runs):
        others = list(runs[:i]) + list(runs[i + 1:])
        if not others:
            continue
        d = deviations(r, trend_steps)
        pred, cov = transfer(others, r.steps, r.tokens_per_step, trend_steps)
        left.append(d[cov] - pred[cov])
        raw.append(d[cov])
    if not left or not sum(len(x) for x in left):
        return {"n": 0}
    mad = lambda v: float(1.4826 * np.median(np.abs(v - np.median(v))))  # noqa: E731
    L, R = np.concatenate(left), np.concatenate(raw)
    return {"n": int(len(L)), "residual_sd": mad(L), "deviation_sd": mad(R),
            "method": "leave-one-run-out over the runs that read this stream"}
