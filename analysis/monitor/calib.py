"""The monitor's calibration on healthy runs, and the sequential test it feeds.

    cal = calibrate(healthy_frames, total_steps, forecast=None)   # Calibration
    cal.save("calibration.json"); cal = load_calibration("calibration.json")
    seq = sequential_test(steps, values, "loss", cal, forecast, alpha)     # analysis.monitor.seq

A flag is worth reading only if healthy runs do not raise it. So the width the monitor allows at
each stretch of training is measured on healthy runs of the same spec (replicates with other
seeds; the fault suite, bench/faults.py, makes them), not set by one global factor, and a departure
is judged by a sequential test whose false-alarm rate is stated.

Shape legend: B blocks (stretches of training), R healthy runs, N logged points of one run.

The residual r_t and the block means m_b a run is judged by are analysis.monitor.series'.

What the healthy runs give, per block b (R runs, block means m_rb):
    mu_b    = mean_r m_rb                      the healthy offset from the reference
    v_b     = var_r m_rb (ddof 1), pooled over the 2 w + 1 nearest blocks where the runs logged
              the series (w = 2; every block for the train loss, one in several for a periodic
              eval) and floored at the within-block scatter over the block's points (the noise of
              one run's block mean cannot be smaller than that)
    sd_b    = sqrt(v_b (1 + 1/R)) x c_b        the spread of a new healthy run's block mean
              (predictive: mu_b itself is a mean of R runs), where c_b = t_{dof_b}(0.975) / z(0.975)
              widens it for the few runs it was estimated from; dof_b, the effective degrees of
              freedom of the pool (analysis.monitor.spread), counts runs rather than blocks:
                  dof_b = (sum_j d_j)^2 / sum_jk rho_|j-k|^2 min(d_j, d_k)
              over the pooled blocks j, k, with d_j = (runs at j) - 1 and rho_L the correlation of the
              runs' deviations (m_rb - mu_b over the pooled sd, uncentred, clipped to [0, 1]) at lag L
              logged blocks (two normal deviations correlated by rho have squares correlated by
              rho^2, hence the variances of the blocks). Blocks whose deviations are independent give
              (R - 1)(2 w + 1); a seed's level that never changes gives R - 1: the pooled blocks then
              share their runs' levels, and a pair of runs that happen to agree agrees in all five.
              On the H200 hero's seeds (rho_1 about 0.5 for the train loss, 0.8 for the grad norm,
              0.9-1 for the eval loss and router entropy) two runs give 1.2-2.5 dof, not the 5 once
              counted (c_b about 2-5, not 1.31).
The early transient (the loss falling fast and differently from seed to seed) needs no step cut:
its blocks have a large sd_b, so the same standardised residual means the same there as later.

The standardised residual of a monitored run is u_b = (m_b - mu_b) / sd_b. On a healthy run it
is about N(0, 1) but not independent from block to block: a seed that runs a little high stays
high for a while. The runs left out one at a time (each standardised by the others' mu and sd, as
a new run is) measure that: the band's width is scaled up by their root-mean-square u when it
exceeds 1 (never narrowed), and rho, their pooled autocorrelation at lags 2-8 (clipped to
[0, 0.9]), is the share of u's variance that is the run's own persistent level (u = L + noise,
var L = rho). Two runs leave none out (one left has no spread): their own deviations over the
pooled sd measure rho then (0.5 where they cannot). Two sequential tests, each one-sided in
both directions (Page's CUSUM: S_b = max(0, S_{b-1} + x_b - k), alarm when S_b > h):

- the level test, on x_b = +-u_b / sqrt(1 - rho) (the noise part in its own units) with the
  reference value k = 0.5 + z_tol sqrt(rho / (1 - rho)), z_tol the (1 - alpha/4) normal
  quantile: a healthy run may hold any level its seed gives it, up to z_tol of its spread,
  without accumulating; beyond it, its excess adds up block after block;
- the change test, on x_b = +-(u_b - l_{b-1}) / c_b with k = 0.5: the run against its own recent
  level l (exponentially smoothed, l_b = l_{b-1} + lam (u_b - l_{b-1}), l = 0 before the first
  block), where lam is the smoothing that predicts the left-out healthy runs' next block best
  and c_b those prediction errors' spread per stretch (pooled over 5 blocks each side). A step
  change shows here at once, whatever level the run held before it.

The threshold h comes from the stated false-alarm rate: a healthy run of B_run tested blocks
should raise one test's alarm in one direction with probability a, so its in-control run length
must be ARL0 = -B_run / ln(1 - a) (alarms as a Poisson process), and Siegmund's approximation for
N(0, 1) increments against the reference value 0.5 (the level test at its tolerance's edge too),
    ARL0(h) = (exp(2 k b) - 2 k b - 1) / (2 k^2),   k = 0.5, b = h + 1.166,
is solved for h. The monitor's false_alarm_rate (default 0.01 a run) is split evenly over the
series it tests and their two directions; within one direction a quarter goes to the level
tolerance, a quarter to the level test's h and half to the change test's h. Measured on simulated
healthy runs whose levels wander (tests/analysis/test_monitor_calib.py) the rate comes out within
about 2x of the stated one: the healthy runs' spread is itself estimated from a few runs. The fault
suite reports the flags of real replicates the calibration never saw.

Two healthy runs. The 97.5% widening c_b keeps a 95% band honest, but the tests work far out in
the tail (a = alpha/4, about 1.4e-4 a series and direction at the default rate), where a spread
resting on few dof is wrong most: a pair of seeds that happen to agree makes every later healthy
run look many sds off. With three or more runs the left-out runs measure the width the band needs
(the scale above); two leave none out, so there the t distribution sets it: sd_b is widened
further by [t_dof(1 - a) / z(1 - a)] / [t_dof(0.975) / z(0.975)] (dof the series' fewest;
analysis.monitor.spread.tail_widening): about 2.3 at 4 dof, 7.5 at 2, 22 at 1.4. The stated rate
then holds (simulated: 0.007 a direction against 0.02 stated; 0.17 before, when the five pooled
blocks counted as 5 dof), but only gross departures alarm: calibrate on 3 or more runs to catch
subtler ones (the monitor's summary says so). Measured on the H200 hero's seeds:
docs/results/faults_h200 ("Few healthy runs").

The block where a test alarms is the step it is reported at (the first step flagged); the block
after the last zero of its sum before it is the change's estimated onset. Critical: the departure
reaches crit_sd healthy sds at or after the alarm.

Without healthy runs the monitor can still read the forecast band (analysis.monitor.checks), but
that band is the forecast's own interval for the level, not calibrated on this spec's runs: it
keeps its flags at info, and warns only on a departure beyond a whole band width.

The series are analysis.monitor.series' (expert_load_max among them, judged upwards only:
analysis.monitor.load). A calibration file written before a series was added has no entry for
it: the series is then simply not judged calibrated (its uncalibrated rules still apply).

A calibration file records what it was made from (the runs, their spec ids, the forecast's path,
creation time and hero spec id, the runs' common spec and how their periodic evals were sampled);
the monitor refuses one made against another forecast, and analysis.monitor.scope says how it
applies to the run judged (a replicate, a branch, another spec; eval-loss series only on the same
eval sample).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast
from analysis.runs.replicates import family_key
from analysis.monitor.series import (UNMARKED, block_means, eval_sample, is_eval_series, residual, series_values,
                                     source_eval_names, throughput_ratio)
from analysis.monitor.scope import spec_fields
from analysis.monitor.spread import spread
from analysis.monitor.stats import column, local_spike_z
from core.errors import InputError
from core.fsutil import atomic_write_text
from core.spec import Spec
from core.safeload import load_file

__all__ = ["Calibration", "SeriesCalibration", "calibrate", "cusum_threshold", "load_calibration", "own_change", "SERIES"]

SERIES = ("loss", "grad_norm", "eval_loss", "router_entropy", "train_eval_gap", "expert_load_max")
SPIKE_SERIES = ("loss", "grad_norm")
LAMBDAS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # smoothing of the run's own level tried
LAMBDA_DEFAULT = 0.2
CHANGE_POOL = 5
TRANSIENT_CLEAN = 5  # clean blocks in a row that end the early transient
RHO_DEFAULT = 0.5  # the persistent share of a healthy run's variance when fewer than 3 runs measure it
K_REF = 0.5  # CUSUM reference value, in sds of the innovation
SIEGMUND = 1.166


def cusum_threshold(blocks: int, alpha: float, k: float = K_REF) -> float:
    """h such that a healthy run of `blocks` tested blocks alarms with probability alpha (one side)."""
    arl0 = -max(blocks, 1) / math.log1p(-alpha)

    def arl(h: float) -> float:
        b = 2 * k * (h + SIEGMUND)
        return math.log(max(math.expm1(b) - b, 1e-300) / (2 * k * k)) - math.log(arl0)

    if arl(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while arl(hi) < 0:
        lo, hi = hi, hi * 2
    for _ in range(60):  # bisection: arl is increasing in h
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if arl(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@dataclass
class SeriesCalibration:
    """What the healthy runs say about one series, per block (see the module docstring)."""

    mu: list[float]
    sd: list[float]
    scatter: list[float]  # one point's robust scatter within a block (pooled over the runs)
    spike_z: list[float]  # the largest local-trend spike z any healthy run showed in the block
    rho: float  # the persistent (run-level) share of a healthy run's standardised variance
    change_sd: list[float]  # per block: sd of a healthy run's one-step prediction error of its own level
    change_lambda: float  # the smoothing of that level
    runs: int
    dof: float  # the fewest effective degrees of freedom a block's spread rests on
    widen: float  # c above

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray(self.mu, dtype=np.float64), np.asarray(self.sd, dtype=np.float64))


@dataclass(frozen=True)
class ForecastRef:
    """The forecast a calibration was made against."""

    path: str
    created: str | None
    hero_spec_id: str | None


@dataclass(frozen=True)
class CalibratedRun:
    """One healthy run a calibration was made from."""

    name: str
    spec_id: str | None
    seed: int | None
    last_step: int


@dataclass
class Calibration:
    """The healthy runs' spread per block for every series, and what it was made from."""

    edges: list[int]
    total_steps: int
    series: dict[str, SeriesCalibration]
    reference: str  # "forecast" or "healthy mean"
    forecast: ForecastRef | None  # the forecast it was made against
    runs: list[CalibratedRun]  # the healthy runs
    transient_end_step: int  # where the healthy runs' early spikes and grad-norm excursions end
    tokens_per_s: float | None  # the healthy runs' median throughput
    throughput_min_ratio: float | None = None  # the lowest (recent median / earlier median) tokens/s a healthy run showed
    drop_frac_max: float | None = None  # the largest token-drop fraction (send + recv) a healthy run showed past the transient
    method: str = "healthy replicates: per-block mean and spread of the log residual; AR(1)-whitened CUSUM"
    extra: dict[str, Any] = field(default_factory=dict)
    # how the healthy runs' periodic evals were sampled (analysis.monitor.series.eval_sample); a file
    # written before it was recorded was made on unmarked runs
    eval_sample: str | None = UNMARKED
    family: str | None = None  # the healthy runs' spec with seed and name set aside (analysis.runs.replicates.family_key)
    spec: dict[str, Any] | None = None  # that spec's compared fields (analysis.monitor.scope.spec_fields)

    def eval_sample_differs(self, df: pd.DataFrame) -> str | None:
        """Why the run's periodic eval levels do not compare with the healthy runs' (None when they do)."""
        run = eval_sample(df)
        if run is None or run == (self.eval_sample or UNMARKED):
            return None
        return (f"the run's periodic evals are sampled {run}, the calibration's healthy runs' {self.eval_sample or UNMARKED} "
                f"(a different sample has another level): its eval-loss series are not judged against the calibration; "
                f"calibrate on replicates trained by the same code")

    @property
    def edges_array(self) -> np.ndarray:
        return np.asarray(self.edges, dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(_json_safe(self.to_dict()), indent=1) + "\n")
        return path

    def check_forecast(self, forecast: Forecast | None, where: str = "calibration") -> None:
        """ValueError when the calibration was made against another forecast (or none was given)."""
        if self.reference != "forecast":
            return
        want = self.forecast or ForecastRef("?", None, None)
        if forecast is None:
            raise InputError(f"{where} was made against the forecast {want.path} (hero spec "
                             f"{want.hero_spec_id}); pass it with --forecast")
        got = _forecast_id(forecast)
        if (want.created, want.hero_spec_id) != (got.created, got.hero_spec_id):
            raise InputError(f"{where} was made against the forecast created {want.created} for spec "
                             f"{want.hero_spec_id}, not {forecast.path} (created {got.created}, "
                             f"spec {got.hero_spec_id}); calibrate again against this forecast")


def _json_safe(x):
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _forecast_id(forecast: Forecast) -> ForecastRef:
    return ForecastRef(forecast.path, forecast.created, forecast.hero.spec_id if forecast.hero else None)


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such calibration file")
    try:
        d = load_file(path, "json")
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    try:
        series = {k: SeriesCalibration(**{f: (np.nan if v is None else v) if not isinstance(v, list) else
                                          [np.nan if x is None else x for x in v] for f, v in s.items()})
                  for k, s in d["series"].items()}
        fc = d.get("forecast")
        cal = Calibration(**{**{k: v for k, v in d.items() if k not in ("series", "forecast", "runs")},
                             "series": series, "forecast": ForecastRef(**fc) if fc is not None else None,
                             "runs": [CalibratedRun(**r) for r in d["runs"]]})
    except (KeyError, TypeError) as e:
        raise InputError(f"{path}: not a monitor calibration ({e})") from None
    B = len(cal.edges) - 1
    if B < 1 or any(len(s.mu) != B or len(s.sd) != B for s in cal.series.values()):
        raise InputError(f"{path}: calibration blocks do not match its edges")
    return cal


def _lagged(U: np.ndarray, lags: range) -> float:
    num = den = 0.0
    for lag in lags:
        a, b = U[:, lag:].ravel(), U[:, :-lag].ravel()
        ok = np.isfinite(a) & np.isfinite(b)
        num += float(np.sum(a[ok] * b[ok]))
        den += float(np.sum(b[ok] ** 2))
    return num / den if den > 0 else float("nan")


def _series_calibration(runs: Sequence[tuple[np.ndarray, np.ndarray]], series: str, edges: np.ndarray,
                        forecast: Forecast | None, spike_window: int, spike_min_history: int) -> SeriesCalibration:
    B = len(edges) - 1
    M, S, Z = [], [], []
    for steps, values in runs:
        r = residual(series, steps, values, forecast)
        m, sc, _ = block_means(steps, r, edges, complete_to=int(steps[-1]))
        M.append(m)
        S.append(sc)
        zb = np.full(B, np.nan)
        if series in SPIKE_SERIES:
            z, _ = local_spike_z(steps, np.asarray(values, dtype=np.float64), spike_window, spike_min_history)
            idx = np.searchsorted(edges, steps, side="right") - 1
            ok = np.isfinite(z) & (idx >= 0) & (idx < B)
            if ok.any():
                zz = pd.Series(z[ok]).groupby(idx[ok]).max()
                zb[zz.index.to_numpy()] = zz.to_numpy()
        Z.append(zb)
    M_RB, S_RB, Z_RB = np.array(M), np.array(S), np.array(Z)
    R = len(runs)
    per_block = np.maximum(np.diff(edges), 1)
    sp = spread(M_RB, S_RB, per_block)
    mu, sd, scat = sp.mu, sp.sd, sp.scatter
    used = np.isfinite(mu)
    dof = float(np.min(sp.dof[used])) if used.any() else 1.0
    widen = float(np.max(sp.widen[used])) if used.any() else float(np.max(sp.widen))
    with np.errstate(invalid="ignore"):
        spike = np.max(np.where(np.isfinite(Z_RB), Z_RB, -np.inf), 0)
    spike = np.where(np.isfinite(spike), spike, np.nan)
    # leave one run out: each run standardised by the others' mu and sd, as a new run would be
    scale, rho, change_sd, change_lambda = 1.0, RHO_DEFAULT, None, LAMBDA_DEFAULT
    if R == 2:  # no run can be left out (one left has no spread): the pair's own deviations measure the persistence
        r_pair = _lagged(sp.z, range(2, 9))
        if np.isfinite(r_pair):
            rho = float(np.clip(r_pair, 0.0, 0.9))
    if R >= 3:
        U = []
        for i in range(R):
            keep = np.arange(R) != i
            sp_i = spread(M_RB[keep], S_RB[keep], per_block)
            U.append((M_RB[i] - sp_i.mu) / sp_i.sd)
        U_RB = np.array(U)
        fin = np.isfinite(U_RB)
        if fin.sum() >= 10:
            # the band's width as the runs it never saw need it (never narrowed)
            scale = max(1.0, float(np.sqrt(np.mean(U_RB[fin] ** 2))))
            U_RB = U_RB / scale
            r_long = _lagged(U_RB, range(2, 9))
            if np.isfinite(r_long):
                rho = float(np.clip(r_long, 0.0, 0.9))
            # the local-level model's smoothing that predicts the healthy runs' next block best, and
            # the spread of its prediction errors per stretch (pooled over CHANGE_POOL blocks each side)
            best = None
            for lam in LAMBDAS:
                D_RB = np.array([own_change(u, lam) for u in U_RB])
                fin_d = np.isfinite(D_RB)
                if fin_d.sum() >= 10 and (best is None or np.mean(D_RB[fin_d] ** 2) < best[1]):
                    best = (lam, float(np.mean(D_RB[fin_d] ** 2)), D_RB)
            if best is not None:
                change_lambda = best[0]
                D_RB = best[2]
                sq = np.where(np.isfinite(D_RB), D_RB ** 2, 0.0).sum(0)
                n = np.isfinite(D_RB).sum(0).astype(np.float64)
                win = 2 * CHANGE_POOL + 1
                pooled = (pd.Series(sq).rolling(win, center=True, min_periods=1).sum()
                          / pd.Series(n).rolling(win, center=True, min_periods=1).sum()).to_numpy()
                change_sd = np.sqrt(np.where(np.isfinite(pooled) & (pooled > 0), pooled, best[1])).tolist()
    if change_sd is None:  # u = level + independent noise: the noise part, and the level's
        change_sd = [math.sqrt((1 - rho) * (1 + change_lambda))] * B
    return SeriesCalibration(mu=mu.tolist(), sd=(sd * scale).tolist(), scatter=scat.tolist(), spike_z=spike.tolist(),
                             rho=rho, change_sd=change_sd, change_lambda=change_lambda, runs=R, dof=dof, widen=widen * scale)


def own_change(u: np.ndarray, lam: float, restart: int | None = None) -> np.ndarray:
    """Per block: the one-step prediction error of the run's own level, u_b - l_{b-1}, with the
    level l exponentially smoothed (l_b = l_{b-1} + lam (u_b - l_{b-1}), l = 0 before the first
    block: the healthy mean); NaN where u is. From block `restart` on (a branch's own spec) the
    level starts again at the first value there: the branch's own course is judged, not its step
    away from its parent at the join."""
    out = np.full(len(u), np.nan)
    level = 0.0
    for b in range(len(u)):
        if np.isfinite(u[b]):
            if restart is not None and b >= restart:
                level, restart = u[b], None
            out[b] = u[b] - level
            level += lam * out[b]
    return out


def calibrate(healthy: Sequence[tuple[str, pd.DataFrame, Any]], total_steps: int, forecast: Forecast | None = None,
              n_blocks: int = 100, spike_window: int = 50, spike_min_history: int = 10,
              spike_sigma: float = 7.0, throughput_points: int = 20) -> Calibration:
    """A calibration from healthy runs [(name, metrics frame, spec or None)] of one spec."""
    if len(healthy) < 2:
        raise InputError(f"a calibration needs at least 2 healthy runs (got {len(healthy)}): their spread is the band")
    B = max(1, min(n_blocks, total_steps))
    edges = np.unique(np.round(np.linspace(0, total_steps, B + 1)).astype(np.int64))
    series: dict[str, SeriesCalibration] = {}
    # the fixed series, and the held-out eval loss of each source when every healthy run logs it
    per_source = sorted(set.intersection(*[set(source_eval_names(df)) for _, df, _ in healthy]))
    samples = sorted({s for _, df, _ in healthy if (s := eval_sample(df)) is not None})
    sample = samples[0] if len(samples) == 1 else None
    if len(samples) > 1:  # their levels do not pool
        warnings.warn(f"the healthy runs' periodic evals were sampled differently ({', '.join(samples)}): "
                      f"the eval-loss series are left out of the calibration")
    for name in (*SERIES, *per_source):
        if is_eval_series(name) and len(samples) > 1:
            continue
        runs = [sv for _, df, _ in healthy if (sv := series_values(df, name)) is not None]
        if len(runs) >= 2:
            series[name] = _series_calibration(runs, name, edges, forecast, spike_window, spike_min_history)
    # the transient: from step 0 to the first run of TRANSIENT_CLEAN blocks in which no healthy run
    # spiked past spike_sigma (a spike later on is the per-stretch spike threshold's business; a
    # grad norm over a fixed threshold says nothing here: healthy runs of some specs stay over it)
    hot_B = np.zeros(len(edges) - 1, dtype=bool)
    for cal in series.values():
        hot_B |= np.nan_to_num(np.asarray(cal.spike_z, dtype=np.float64), nan=0.0) > spike_sigma
    transient, clean = 0, 0
    for b, hot in enumerate(hot_B):
        clean = 0 if hot else clean + 1
        if hot:
            transient = int(edges[b + 1])
        if clean >= TRANSIENT_CLEAN:
            break
    tps = [float(np.nanmedian(v)) for _, df, _ in healthy if (v := column(df, "tokens_per_s")) is not None]
    ratios = [r for _, df, _ in healthy if (r := throughput_ratio(df, throughput_points)) is not None]
    drops = []
    for _, df, _ in healthy:
        ds, dr = column(df, "drop_frac_send"), column(df, "drop_frac_recv")
        if ds is not None or dr is not None:
            d = np.nan_to_num(ds if ds is not None else 0.0) + np.nan_to_num(dr if dr is not None else 0.0)
            d = np.broadcast_to(d, (len(df),))[df["step"].to_numpy() >= transient]
            if len(d):
                drops.append(float(np.max(d)))
    runs_meta = []
    for name, df, spec in healthy:
        runs_meta.append(CalibratedRun(name=name, spec_id=getattr(spec, "id", None), seed=getattr(spec, "seed", None),
                                       last_step=int(df["step"].iloc[-1])))
    return Calibration(edges=edges.tolist(), total_steps=int(total_steps), series=series,
                       reference="forecast" if forecast is not None else "healthy mean",
                       forecast=_forecast_id(forecast) if forecast is not None else None, runs=runs_meta,
                       transient_end_step=int(transient), tokens_per_s=float(np.median(tps)) if tps else None,
                       throughput_min_ratio=float(np.nanmin(np.concatenate(ratios))) if ratios else None,
                       drop_frac_max=max(drops) if drops else None, eval_sample=sample,
                       **_family(healthy))


def _family(healthy: Sequence[tuple[str, pd.DataFrame, Any]]) -> dict[str, Any]:
    """The healthy runs' common spec (family key and compared fields); none without specs or when
    they differ beyond the seed."""
    specs = [spec for _, _, spec in healthy if isinstance(spec, Spec)]
    keys = {family_key(s) for s in specs}
    if len(specs) < len(healthy) or len(keys) != 1:
        return {"family": None, "spec": None}
    return {"family": keys.pop(), "spec": spec_fields(specs[0])}
