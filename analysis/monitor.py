"""Watch a live run against its forecast and flag what deviates.

    report = monitor(df, spec=None, forecast=None, settings=MonitorSettings(), ...)

`df` is a metrics frame (analysis.metrics_io.read_metrics_frame): step, loss and whatever else the
run logged. Each flag is {kind, severity (info | warning | critical), first_step, evidence}; the
evidence holds a sentence ("text") and the numbers behind it. The kinds:

- `non_finite` (critical): a NaN or inf loss or grad norm.
- `run_diverged` / `run_failed` (critical): the run's status.json says so.
- `loss_above_band` (warning) / `loss_below_band` (info): the (optionally smoothed) loss lies above
  the forecast band's upper edge (or below its lower edge) for `band_k` consecutive points. Matched
  by step, or by tokens when the run's tokens per step differ from the forecast hero's.
- `loss_jump` (warning; critical past `loss_jump_crit`): the loss, smoothed by a rolling median of
  `loss_jump_smooth` points, rises more than `loss_jump_warn` (relative) above its running minimum,
  and by more than `loss_jump_sigma` times the smoothed loss's own noise (robust scatter of the
  step-to-step differences): a small run's batch-to-batch noise alone moves its smoothed loss by
  10%, a divergence moves it by tens of sigmas. This is the divergence alarm.
- `loss_spike` / `grad_norm_spike` (warning): a point more than `spike_sigma` standard deviations
  above the linear trend of the previous `spike_local_window` points. The evidence also reports the
  spike score as OLMo 2 defines it: the share of points more than 7 sigma from the rolling mean of
  the previous 1,000 points (`spike_window`). That score alone misses spikes on a curve that is still
  falling fast (the fall inflates the rolling sigma), hence the local-trend test for the flag.
- `grad_norm_high` (warning above `grad_norm_warn`, critical above `grad_norm_crit`; defaults 2 and 4
  as on the Marin ladder): the rolling median of `grad_norm_k` points over the threshold, after the
  warmup (`ignore_first_steps`, default: the spec's warmup steps).
- `grad_norm_above_envelope` (warning): grad norm above the forecast envelope's upper edge for
  `band_k` consecutive points.
- `grad_norm_growth` (warning): over a trailing window (`grad_trend_window_frac` of the points after
  warmup, at least `grad_trend_min_points`), log(grad norm) grows by a factor more than
  `grad_trend_ratio` times what the forecast envelope grows over the same steps (no envelope: flat),
  with the slope at least `grad_trend_min_t` standard errors above zero.
- `token_drops` (warning; critical past `drop_crit`): drop_frac_send + drop_frac_recv above
  `drop_budget` (default 7%, Marin's alert) for `drop_k` consecutive points after the warmup.
- `router_entropy_collapse` (warning): the rolling median of router entropy (nats, mean per token)
  falls below `entropy_floor_frac` x log(top_k) -- a router whose tokens put all their weight on
  fewer experts than they are routed to, so top-k degenerates toward top-1 -- or below
  `entropy_rel_floor` x its early value (median of its first `entropy_early_points` after warmup),
  a sharp fall from the near-uniform log(n_experts) at initialisation.
- `throughput_low` (warning): measured tokens/s (tokens over wall time across the last
  `throughput_points` records, else the median logged tokens/s) below
  `throughput_frac` x the plan (given tokens/s, or the spec's hardware at its expected MFU), with the
  projected finish date at the measured rate.
- `forecast_spec_mismatch` (info): the forecast was made for another spec id than the run's.
"""

from __future__ import annotations

import json
import math
import time as _time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.spec import Spec

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


class MonitorSettings(BaseModel):
    """Thresholds of the live-run monitor; every default is documented in the module docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    band_k: int = Field(3, ge=1, description="consecutive points outside the forecast band before a flag")
    band_smooth: int = Field(1, ge=1, description="rolling-median points applied to the loss before the band test")
    spike_sigma: float = Field(7.0, gt=0, description="sigmas that make a point a spike (OLMo 2 uses 7)")
    spike_window: int = Field(1000, ge=2, description="previous points in OLMo 2's rolling spike score")
    spike_local_window: int = Field(50, ge=3, description="previous points of the local trend for spike flags")
    spike_min_history: int = Field(10, ge=3, description="points needed before a spike can be flagged")
    loss_jump_smooth: int = Field(5, ge=1, description="rolling-median points of the loss-jump test")
    loss_jump_warn: float = Field(0.10, gt=0, description="relative rise over the running minimum: warning")
    loss_jump_crit: float = Field(0.25, gt=0, description="relative rise over the running minimum: critical")
    loss_jump_sigma: float = Field(8.0, ge=0, description="rise needed in units of the smoothed loss's noise")
    grad_norm_warn: float = Field(2.0, gt=0, description="grad norm warning threshold (Marin ladder)")
    grad_norm_crit: float = Field(4.0, gt=0, description="grad norm critical threshold (Marin ladder)")
    grad_norm_k: int = Field(3, ge=1, description="rolling-median points of the grad-norm threshold test")
    ignore_first_steps: int | None = Field(
        None, ge=0, description="steps excluded from grad-norm and entropy tests (None: the spec's warmup)"
    )
    grad_trend_window_frac: float = Field(0.5, gt=0, le=1, description="trailing share of points in the trend fit")
    grad_trend_min_points: int = Field(8, ge=3, description="fewest points in the trend fit")
    grad_trend_ratio: float = Field(2.0, gt=1, description="growth over the window, relative to the envelope's")
    grad_trend_min_t: float = Field(3.0, gt=0, description="slope t-statistic needed for a growth flag")
    drop_budget: float = Field(0.07, ge=0, le=1, description="token-drop fraction (send + recv) alert")
    drop_crit: float = Field(0.20, ge=0, le=1, description="token-drop fraction that is critical")
    drop_k: int = Field(3, ge=1, description="consecutive points over the drop budget before a flag")
    entropy_floor_frac: float = Field(0.5, ge=0, description="floor as a fraction of log(top_k) nats")
    entropy_rel_floor: float = Field(0.25, ge=0, le=1, description="floor as a fraction of the early entropy")
    entropy_early_points: int = Field(5, ge=1, description="points after warmup that give the early entropy")
    entropy_k: int = Field(3, ge=1, description="rolling-median points of the entropy test")
    throughput_frac: float = Field(0.9, gt=0, le=1, description="share of planned tokens/s below which to flag")
    throughput_points: int = Field(20, ge=1, description="last points whose median is the measured tokens/s")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "MonitorSettings":
        """Defaults, then a YAML file's values, then explicit overrides (e.g. from `--set k=v`)."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.exists():
                raise ValueError(f"{p}: no such monitor settings file")
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{p}: not valid YAML: {e}") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{p}: monitor settings must be a mapping of threshold names to values")
            data.update(loaded)
        data.update(overrides or {})
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            parts = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"]) or "(settings)"
                parts.append(f"{loc}: {err['msg']}")
            raise ValueError("invalid monitor settings: " + "; ".join(parts)) from None


@dataclass
class Flag:
    kind: str
    severity: Severity
    first_step: int
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Forecast:
    """The parts of forecast.json the monitor and the replanner read (notes/FORECAST.md)."""

    path: str
    traj_step: np.ndarray
    traj_tokens: np.ndarray | None
    traj_loss: np.ndarray
    traj_lo: np.ndarray
    traj_hi: np.ndarray
    gn_step: np.ndarray | None = None
    gn_mean: np.ndarray | None = None
    gn_lo: np.ndarray | None = None
    gn_hi: np.ndarray | None = None
    hero: dict[str, Any] = field(default_factory=dict)
    curve_model: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)


def _arr(d: dict, key: str, where: str, path: Path) -> np.ndarray:
    if key not in d:
        raise ValueError(f"{path}: forecast has no {where}.{key}")
    try:
        a = np.asarray([np.nan if v is None else v for v in d[key]], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: forecast {where}.{key} is not a list of numbers") from None
    return a


def load_forecast(path: str | Path) -> Forecast:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such forecast file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "trajectory" not in raw:
        raise ValueError(f"{path}: not a forecast (no 'trajectory' section)")
    tr = raw["trajectory"]
    step = _arr(tr, "step", "trajectory", path)
    loss = _arr(tr, "loss", "trajectory", path)
    lo = _arr(tr, "lo", "trajectory", path)
    hi = _arr(tr, "hi", "trajectory", path)
    if not (len(step) == len(loss) == len(lo) == len(hi)) or len(step) < 2:
        raise ValueError(f"{path}: trajectory step/loss/lo/hi must be lists of one length >= 2")
    if np.any(np.diff(step) <= 0):
        raise ValueError(f"{path}: trajectory steps must be strictly increasing")
    tokens = _arr(tr, "tokens", "trajectory", path) if "tokens" in tr else None
    fc = Forecast(str(path), step, tokens, loss, lo, hi, hero=raw.get("hero") or {}, curve_model=raw.get("curve_model"), raw=raw)
    gn = raw.get("grad_norm")
    if isinstance(gn, dict) and gn.get("step"):
        fc.gn_step = _arr(gn, "step", "grad_norm", path)
        fc.gn_mean = _arr(gn, "mean", "grad_norm", path)
        fc.gn_lo = _arr(gn, "lo", "grad_norm", path) if "lo" in gn else None
        fc.gn_hi = _arr(gn, "hi", "grad_norm", path) if "hi" in gn else None
    return fc


@dataclass
class MonitorReport:
    flags: list[Flag]
    summary: dict[str, Any]
    settings: dict[str, Any]

    @property
    def worst(self) -> Severity | None:
        if not self.flags:
            return None
        return max((f.severity for f in self.flags), key=SEVERITY_RANK.__getitem__)

    @property
    def critical(self) -> bool:
        return self.worst == "critical"

    def first(self, *kinds: str) -> Flag | None:
        hits = [f for f in self.flags if f.kind in kinds]
        return min(hits, key=lambda f: f.first_step) if hits else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "worst": self.worst,
            "flags": [f.to_dict() for f in self.flags],
            "summary": self.summary,
            "settings": self.settings,
        }


# ---- helpers --------------------------------------------------------------------------------


def _col(df: pd.DataFrame, name: str) -> np.ndarray | None:
    if name not in df.columns:
        return None
    v = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=np.float64)
    return None if np.all(np.isnan(v)) else v


def _first_run(mask_N: np.ndarray, k: int) -> tuple[int, int] | None:
    """(start, end) indices of the first run of k consecutive True values, or None."""
    run = 0
    for i, m in enumerate(mask_N):
        run = run + 1 if m else 0
        if run >= k:
            return i - k + 1, i
    return None


def _rolling_median(x: np.ndarray, k: int) -> np.ndarray:
    if k <= 1:
        return x.copy()
    return pd.Series(x).rolling(k, min_periods=k).median().to_numpy()


def _f(x: Any) -> Any:
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
    from numpy.lib.stride_tricks import sliding_window_view

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


def _interp(xq: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    out = np.interp(xq, xp, fp)
    out[(xq < xp[0]) | (xq > xp[-1])] = np.nan
    return out


def spec_warmup_steps(spec: Spec) -> int:
    s = spec.schedule
    return s.warmup_steps if s.warmup_steps is not None else int(round(s.warmup_frac * spec.total_steps))


def planned_tokens_per_s(spec: Spec) -> float | None:
    """Tokens/s the spec's hardware gives at its expected MFU (None when the cost model is missing)."""
    try:
        from core.costs import flops_per_token
    except ImportError:
        return None
    devices = max(spec.hardware.n_gpus, 1)
    return spec.hardware.expected_mfu * spec.hardware.peak_flops * devices / float(flops_per_token(spec))


def measured_tokens_per_s(df: pd.DataFrame, points: int = 20) -> float | None:
    """Tokens over wall time across the last `points` records (what a deadline sees: eval and
    checkpoint pauses included); else the median of the logged tokens_per_s."""
    tok, t = _col(df, "tokens"), _col(df, "time")
    if tok is not None and t is not None:
        ok = np.isfinite(tok) & np.isfinite(t) & (t > 0)
        tok, t = tok[ok][-points - 1 :], t[ok][-points - 1 :]
        if len(t) >= 2 and t[-1] > t[0] and tok[-1] > tok[0]:
            return float((tok[-1] - tok[0]) / (t[-1] - t[0]))
    tps = _col(df, "tokens_per_s")
    if tps is not None:
        v = tps[np.isfinite(tps) & (tps > 0)]
        if len(v):
            return float(np.median(v[-points:]))
    return None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the checks -------------------------------------------------------------------------------


def monitor(
    df: pd.DataFrame,
    spec: Spec | None = None,
    forecast: Forecast | None = None,
    settings: MonitorSettings | None = None,
    *,
    plan_tokens_per_s: float | None = None,
    status: dict | None = None,
    now: float | None = None,
) -> MonitorReport:
    cfg = settings or MonitorSettings()
    now = _time.time() if now is None else now
    flags: list[Flag] = []
    steps = df["step"].to_numpy(dtype=np.int64)
    loss = df["loss"].to_numpy(dtype=np.float64)
    gn = _col(df, "grad_norm")
    n = len(steps)
    skip = cfg.ignore_first_steps if cfg.ignore_first_steps is not None else (spec_warmup_steps(spec) if spec else 0)
    after_warm = steps >= skip

    # -- NaN / inf, and the run's own verdict
    for name, v in (("loss", loss), ("grad_norm", gn)):
        if v is None:
            continue
        bad = ~np.isfinite(v)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            flags.append(Flag("non_finite", "critical", int(steps[i]), {
                "text": f"{name} is {v[i]} at step {steps[i]} ({int(bad.sum())} non-finite point(s))",
                "metric": name, "count": int(bad.sum()), "last_finite_step": _f(steps[i - 1]) if i else None}))
    state = (status or {}).get("state")
    if state in ("diverged", "failed"):
        at = (status or {}).get("step", int(steps[-1]) if n else 0)
        flags.append(Flag(f"run_{state}", "critical", int(at if isinstance(at, (int, float)) else steps[-1]), {
            "text": f"the run's status.json says {state}" + (f": {status.get('error') or status.get('reason')}"
                                                             if (status.get("error") or status.get("reason")) else ""),
            "status": {k: v for k, v in status.items() if isinstance(v, (str, int, float, bool)) or v is None}}))

    # -- forecast band (by tokens when both sides have them, else by step)
    band_summary: dict[str, Any] = {}
    if forecast is not None:
        from analysis.metrics_io import frame_tokens_per_step

        tok = _col(df, "tokens")
        fc_tps = (forecast.hero or {}).get("tokens_per_step")
        run_tps = spec.data.tokens_per_step if spec is not None else frame_tokens_per_step(df)
        same_steps = fc_tps is not None and run_tps is not None and abs(float(fc_tps) - float(run_tps)) < 1e-9 * float(fc_tps)
        if (not same_steps and forecast.traj_tokens is not None and tok is not None
                and np.all(np.isfinite(forecast.traj_tokens))):
            # another batch size than the forecast's hero: compare at equal tokens
            xq, xp, axis = tok, forecast.traj_tokens, "tokens"
        else:
            xq, xp, axis = steps.astype(np.float64), forecast.traj_step, "step"
        lo, hi, mid = (_interp(xq, xp, a) for a in (forecast.traj_lo, forecast.traj_hi, forecast.traj_loss))
        sm = _rolling_median(loss, cfg.band_smooth)
        inside = np.isfinite(lo) & np.isfinite(sm)
        for kind, sev, mask, edge, word in (
            ("loss_above_band", "warning", inside & (sm > hi), hi, "above"),
            ("loss_below_band", "info", inside & (sm < lo), lo, "below"),
        ):
            r = _first_run(mask, cfg.band_k)
            if r:
                a, b = r
                flags.append(Flag(kind, sev, int(steps[a]), {
                    "text": f"loss {word} the forecast band for {cfg.band_k} consecutive points from step {steps[a]} "
                            f"({sm[a]:.4f} vs band [{lo[a]:.4f}, {hi[a]:.4f}]); {int(mask.sum())} point(s) {word} in all",
                    "loss": _f(sm[a]), "band_lo": _f(lo[a]), "band_hi": _f(hi[a]), "forecast": _f(mid[a]),
                    "detected_step": int(steps[b]), "points_outside": int(mask.sum()), "axis": axis}))
        last_in = np.flatnonzero(np.isfinite(lo))
        if len(last_in):
            j = last_in[-1]
            band_summary = {"forecast_loss": _f(mid[j]), "band_lo": _f(lo[j]), "band_hi": _f(hi[j]), "at_step": int(steps[j])}
        hero_id = (forecast.hero or {}).get("spec_id")
        if spec is not None and hero_id and hero_id != spec.id:
            flags.append(Flag("forecast_spec_mismatch", "info", int(steps[0]) if n else 0, {
                "text": f"the forecast was made for spec {hero_id}, the run is spec {spec.id}",
                "forecast_spec_id": hero_id, "run_spec_id": spec.id}))

    # -- loss jump (divergence) on the smoothed loss
    finite_loss = np.where(np.isfinite(loss), loss, np.nan)
    sm = _rolling_median(finite_loss, cfg.loss_jump_smooth)
    if np.isfinite(sm).any():
        runmin = pd.Series(sm).cummin().to_numpy()
        rel = sm / runmin - 1.0
        fin = finite_loss[np.isfinite(finite_loss)]
        d = np.diff(fin)
        noise = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) >= 2 else 0.0
        # a median of k points scatters ~1.25 sigma / sqrt(k)
        gate = cfg.loss_jump_sigma * 1.2533 * noise / math.sqrt(cfg.loss_jump_smooth)
        rise = np.nan_to_num(sm - runmin, nan=-1)
        warn = np.flatnonzero((np.nan_to_num(rel, nan=-1) > cfg.loss_jump_warn) & (rise > gate))
        if len(warn):
            i = int(warn[0])
            crit = np.flatnonzero((np.nan_to_num(rel, nan=-1) > cfg.loss_jump_crit) & (rise > gate))
            peak = int(np.nanargmax(rel))
            flags.append(Flag("loss_jump", "critical" if len(crit) else "warning", int(steps[i]), {
                "text": f"smoothed loss rose {rel[i]:.1%} above its running minimum {runmin[i]:.4f} at step {steps[i]}"
                        + (f", {rel[crit[0]]:.1%} by step {steps[crit[0]]}" if len(crit) and crit[0] != i else "")
                        + f"; peak rise {rel[peak]:.1%} at step {steps[peak]}",
                "rise": _f(rel[i]), "running_min": _f(runmin[i]), "peak_rise": _f(rel[peak]),
                "noise_sd": _f(noise), "rise_in_sd": _f((sm[i] - runmin[i]) / max(gate / max(cfg.loss_jump_sigma, 1e-12), 1e-12)),
                "peak_step": int(steps[peak]), "critical_step": int(steps[crit[0]]) if len(crit) else None}))

    # -- spikes
    spike_scores: dict[str, float] = {}
    for name, v in (("loss", loss), ("grad_norm", gn)):
        if v is None or n < cfg.spike_min_history + 1:
            continue
        spike_scores[name] = olmo_spike_score(v, cfg.spike_window, cfg.spike_sigma)
        z, pred = local_spike_z(steps, v, cfg.spike_local_window, cfg.spike_min_history)
        hits = np.flatnonzero(np.nan_to_num(z, nan=0.0) > cfg.spike_sigma)
        if len(hits):
            i = int(hits[0])
            flags.append(Flag(f"{name}_spike", "warning", int(steps[i]), {
                "text": f"{name} {v[i]:.4g} at step {steps[i]} is {z[i]:.1f} sigma above its local trend "
                        f"({pred[i]:.4g}); {len(hits)} spike point(s); OLMo 2 spike score {spike_scores[name]:.4f}",
                "value": _f(v[i]), "expected": _f(pred[i]), "z": _f(z[i]), "n_spikes": int(len(hits)),
                "spike_score": spike_scores[name], "spike_steps": [int(s) for s in steps[hits[:20]]]}))

    # -- grad norm: thresholds, envelope, growth
    gn_summary: dict[str, Any] = {}
    if gn is not None:
        gsm = _rolling_median(np.where(np.isfinite(gn), gn, np.nan), cfg.grad_norm_k)
        gsm = np.where(after_warm, gsm, np.nan)
        over_w = np.flatnonzero(np.nan_to_num(gsm) > cfg.grad_norm_warn)
        if len(over_w):
            i = int(over_w[0])
            over_c = np.flatnonzero(np.nan_to_num(gsm) > cfg.grad_norm_crit)
            flags.append(Flag("grad_norm_high", "critical" if len(over_c) else "warning", int(steps[i]), {
                "text": f"grad norm (median of {cfg.grad_norm_k}) {gsm[i]:.3g} > {cfg.grad_norm_warn:g} at step {steps[i]}"
                        + (f"; > {cfg.grad_norm_crit:g} from step {steps[over_c[0]]}" if len(over_c) else "")
                        + f"; max {np.nanmax(gsm):.3g}",
                "grad_norm": _f(gsm[i]), "threshold_warn": cfg.grad_norm_warn, "threshold_crit": cfg.grad_norm_crit,
                "critical_step": int(steps[over_c[0]]) if len(over_c) else None, "max": _f(np.nanmax(gsm))}))
        env_mean = None
        if forecast is not None and forecast.gn_step is not None and forecast.gn_mean is not None:
            env_mean = _interp(steps.astype(np.float64), forecast.gn_step, forecast.gn_mean)
            if forecast.gn_hi is not None:
                hi = _interp(steps.astype(np.float64), forecast.gn_step, forecast.gn_hi)
                mask = np.isfinite(hi) & np.isfinite(gn) & (gn > hi) & after_warm
                r = _first_run(mask, cfg.band_k)
                if r:
                    a, b = r
                    flags.append(Flag("grad_norm_above_envelope", "warning", int(steps[a]), {
                        "text": f"grad norm above the forecast envelope for {cfg.band_k} consecutive points from step "
                                f"{steps[a]} ({gn[a]:.3g} vs upper edge {hi[a]:.3g})",
                        "grad_norm": _f(gn[a]), "envelope_hi": _f(hi[a]), "detected_step": int(steps[b]),
                        "points_outside": int(mask.sum())}))
        g = _grad_growth(steps, gn, env_mean, after_warm, cfg)
        if g is not None:
            flags.append(g)
        fin = np.flatnonzero(np.isfinite(gn))
        if len(fin):
            gn_summary = {"grad_norm": _f(gn[fin[-1]]), "grad_norm_median_last": _f(np.nanmedian(gn[fin[-cfg.grad_norm_k:]]))}

    # -- token drops
    ds, dr = _col(df, "drop_frac_send"), _col(df, "drop_frac_recv")
    drop_summary: dict[str, Any] = {}
    if ds is not None or dr is not None:
        drop = np.nan_to_num(ds if ds is not None else 0.0) + np.nan_to_num(dr if dr is not None else 0.0)
        drop = np.broadcast_to(drop, steps.shape).astype(np.float64)
        # an untrained router's drops during warmup say nothing about the run
        r = _first_run((drop > cfg.drop_budget) & after_warm, cfg.drop_k)
        if r:
            a, b = r
            rc = _first_run((drop > cfg.drop_crit) & after_warm, cfg.drop_k)
            flags.append(Flag("token_drops", "critical" if rc else "warning", int(steps[a]), {
                "text": f"token-drop fraction {drop[a]:.1%} (send + recv) over the {cfg.drop_budget:.0%} budget for "
                        f"{cfg.drop_k} consecutive points from step {steps[a]}; last {drop[-1]:.1%}, max {drop.max():.1%}",
                "drop_frac": _f(drop[a]), "drop_frac_last": _f(drop[-1]), "drop_frac_max": _f(drop.max()),
                "budget": cfg.drop_budget, "critical_step": int(steps[rc[0]]) if rc else None}))
        tail = drop[-max(cfg.throughput_points, 1):]
        drop_summary = {"drop_frac": _f(float(np.mean(tail)))}

    # -- router entropy
    ent = _col(df, "router_entropy")
    ent_summary: dict[str, Any] = {}
    if ent is not None:
        esm = _rolling_median(np.where(np.isfinite(ent), ent, np.nan), cfg.entropy_k)
        valid = np.flatnonzero(after_warm & np.isfinite(ent) & (ent > 0))
        if len(valid) >= cfg.entropy_early_points:
            early = float(np.median(ent[valid[: cfg.entropy_early_points]]))
            floors = [("early value", cfg.entropy_rel_floor * early)]
            if spec is not None and spec.model.top_k > 1:
                floors.append((f"log(top_k={spec.model.top_k})", cfg.entropy_floor_frac * math.log(spec.model.top_k)))
            floor_name, floor = max(floors, key=lambda t: t[1])
            mask = after_warm & np.isfinite(esm) & (esm < floor)
            hits = np.flatnonzero(mask)
            if len(hits):
                i = int(hits[0])
                flags.append(Flag("router_entropy_collapse", "warning", int(steps[i]), {
                    "text": f"router entropy {esm[i]:.3f} nats at step {steps[i]} below its floor {floor:.3f} "
                            f"(from the {floor_name}; early value {early:.3f})",
                    "entropy": _f(esm[i]), "floor": _f(floor), "floor_from": floor_name, "early": _f(early)}))
            ent_summary = {"router_entropy": _f(ent[valid[-1]]), "router_entropy_early": _f(early)}

    # -- throughput and projected finish
    measured = measured_tokens_per_s(df, cfg.throughput_points)
    plan = plan_tokens_per_s if plan_tokens_per_s is not None else (planned_tokens_per_s(spec) if spec else None)
    tput: dict[str, Any] = {"tokens_per_s": _f(measured), "plan_tokens_per_s": _f(plan)}
    if spec is not None and n:
        done_steps = int(steps[-1]) + 1
        remaining_tokens = max(spec.total_steps - done_steps, 0) * spec.data.tokens_per_step
        t_last = _col(df, "time")
        base = float(t_last[np.isfinite(t_last)][-1]) if t_last is not None and np.isfinite(t_last).any() else now
        tput["remaining_tokens"] = remaining_tokens
        if measured:
            tput["projected_finish"] = _iso(base + remaining_tokens / measured)
        if plan:
            tput["planned_finish"] = _iso(base + remaining_tokens / plan)
    if (measured is not None and plan is not None and measured < cfg.throughput_frac * plan
            and tput.get("remaining_tokens", 1) > 0):
        flags.append(Flag("throughput_low", "warning", int(steps[-1]), {
            "text": f"measured {measured:,.0f} tokens/s is {measured / plan:.0%} of the plan's {plan:,.0f}"
                    + (f"; projected finish {tput['projected_finish']} instead of {tput['planned_finish']}"
                       if "projected_finish" in tput and "planned_finish" in tput else ""),
            "tokens_per_s": _f(measured), "plan_tokens_per_s": _f(plan), "ratio": _f(measured / plan),
            **{k: tput[k] for k in ("projected_finish", "planned_finish") if k in tput}}))

    flags.sort(key=lambda f: (f.first_step, -SEVERITY_RANK[f.severity]))
    summary: dict[str, Any] = {
        "points": int(n),
        "step": int(steps[-1]) if n else None,
        "tokens": _f(_col(df, "tokens")[-1]) if _col(df, "tokens") is not None else None,
        "loss": _f(loss[-1]) if n else None,
        "loss_smoothed": _f(np.median(finite_loss[np.isfinite(finite_loss)][-cfg.loss_jump_smooth:]))
        if np.isfinite(finite_loss).any() else None,
        "spec_id": spec.id if spec else None,
        "total_steps": spec.total_steps if spec else None,
        "spike_score": spike_scores,
        **band_summary, **gn_summary, **drop_summary, **ent_summary, **tput,
    }
    return MonitorReport(flags, summary, cfg.model_dump())


def _grad_growth(steps, gn, env_mean, after_warm, cfg: MonitorSettings) -> Flag | None:
    ok = np.flatnonzero(after_warm & np.isfinite(gn) & (gn > 0))
    if len(ok) < cfg.grad_trend_min_points:
        return None
    s_all, lg_all = steps[ok].astype(np.float64), np.log(gn[ok])
    m = len(ok)
    stride = max(1, m // 400)
    for end in range(cfg.grad_trend_min_points - 1, m, stride):
        w = max(cfg.grad_trend_min_points, int(cfg.grad_trend_window_frac * (end + 1)))
        a = max(0, end - w + 1)
        s, lg = s_all[a : end + 1], lg_all[a : end + 1]
        ds = s - s.mean()
        sxx = float(ds @ ds)
        if sxx <= 0 or len(s) < 3:
            continue
        slope = float(ds @ (lg - lg.mean())) / sxx
        resid = lg - lg.mean() - slope * ds
        se = math.sqrt(max(float(resid @ resid) / (len(s) - 2), 1e-30) / sxx)
        growth = math.exp(slope * (s[-1] - s[0]))
        env_growth = 1.0
        if env_mean is not None:
            e0, e1 = env_mean[ok[a]], env_mean[ok[end]]
            if np.isfinite(e0) and np.isfinite(e1) and e0 > 0:
                env_growth = float(e1 / e0)
        if slope / se >= cfg.grad_trend_min_t and growth > cfg.grad_trend_ratio * max(env_growth, 1e-12):
            return Flag("grad_norm_growth", "warning", int(s[-1]), {
                "text": f"grad norm grew {growth:.2f}x over steps {int(s[0])}-{int(s[-1])} "
                        f"(envelope {env_growth:.2f}x; slope {slope / se:.1f} standard errors above zero)",
                "growth": _f(growth), "envelope_growth": _f(env_growth), "t": _f(slope / se),
                "window_start_step": int(s[0]), "window_end_step": int(s[-1])})
    return None


# ---- the picture -----------------------------------------------------------------------------

SEVERITY_COLOR = {"info": "tab:blue", "warning": "tab:orange", "critical": "tab:red"}


def plot_report(df: pd.DataFrame, report: MonitorReport, forecast: Forecast | None, out: str | Path,
                title: str = "") -> Path:
    """PNG of the live loss (and grad norm) over the forecast band, with the flags marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.fsutil import atomic_write_bytes

    steps = df["step"].to_numpy()
    gn = _col(df, "grad_norm")
    ds, dr = _col(df, "drop_frac_send"), _col(df, "drop_frac_recv")
    drop = None
    if ds is not None or dr is not None:
        drop = np.nan_to_num(ds if ds is not None else 0.0) + np.nan_to_num(dr if dr is not None else 0.0)
        drop = np.broadcast_to(drop, steps.shape) if np.any(drop > 0) else None
    n_panels = 1 + (gn is not None) + (drop is not None)
    fig, axes = plt.subplots(n_panels, 1, figsize=(9, 2.2 + 2.3 * n_panels), sharex=True, squeeze=False)
    ax = axes[0, 0]
    if forecast is not None:
        ax.fill_between(forecast.traj_step, forecast.traj_lo, forecast.traj_hi, color="tab:green", alpha=0.2,
                        label="forecast band")
        ax.plot(forecast.traj_step, forecast.traj_loss, color="tab:green", lw=1, ls="--", label="forecast")
    loss = df["loss"].to_numpy(dtype=np.float64)
    ax.plot(steps, loss, color="0.6", lw=0.7, label="loss")
    k = max(report.settings.get("loss_jump_smooth", 5), 1)
    ax.plot(steps, _rolling_median(np.where(np.isfinite(loss), loss, np.nan), k), color="black", lw=1.2,
            label=f"loss (median of {k})")
    fin = loss[np.isfinite(loss)]
    if len(fin):
        lo_y = np.nanmin(fin) if forecast is None else min(np.nanmin(fin), np.nanmin(forecast.traj_lo))
        ax.set_ylim(lo_y - 0.05 * abs(lo_y), np.nanpercentile(fin, 99) * 1.05)
    ax.set_ylabel("loss")
    seen = set()
    for f in report.flags:
        c = SEVERITY_COLOR[f.severity]
        for a in axes[:, 0]:
            a.axvline(f.first_step, color=c, lw=1, alpha=0.7)
        if f.kind not in seen:
            ax.annotate(f.kind, (f.first_step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=7, color=c)
            seen.add(f.kind)
    ax.legend(loc="upper right", fontsize=8)
    if gn is not None:
        a2 = axes[1, 0]
        if forecast is not None and forecast.gn_step is not None and forecast.gn_mean is not None:
            if forecast.gn_lo is not None and forecast.gn_hi is not None:
                a2.fill_between(forecast.gn_step, forecast.gn_lo, forecast.gn_hi, color="tab:green", alpha=0.2,
                                label="forecast envelope")
            a2.plot(forecast.gn_step, forecast.gn_mean, color="tab:green", lw=1, ls="--")
        a2.plot(steps, gn, color="tab:purple", lw=0.8, label="grad norm")
        for thr, c in ((report.settings["grad_norm_warn"], "tab:orange"), (report.settings["grad_norm_crit"], "tab:red")):
            a2.axhline(thr, color=c, lw=0.8, ls=":")
        a2.set_yscale("log")
        a2.set_ylabel("grad norm")
        a2.legend(loc="upper right", fontsize=8)
    if drop is not None:
        a3 = axes[-1, 0]
        a3.plot(steps, 100 * drop, color="tab:brown", lw=0.8, label="dropped assignments (send + recv)")
        a3.axhline(100 * report.settings["drop_budget"], color="tab:orange", lw=0.8, ls=":", label="budget")
        a3.set_ylabel("drops (%)")
        a3.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or f"live run vs forecast — worst flag: {report.worst or 'none'}", fontsize=10)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())
