"""The parts of a forecast.json (`ladder forecast`) that the monitor and the replanner read.

    fc = load_forecast("forecast.json")   # Forecast: the loss trajectory with its band, the grad-norm
                                          # envelope when there is one, the hero and the curve model
    fc.hero.spec_id, fc.hero.tokens_per_step   # ForecastHero: the run the forecast is for
    doc = read_hero_forecast("forecast.json")  # HeroForecast: the whole document, as the forecast wrote it
    doc.law, doc.backtest, doc.trajectory, doc.regime, doc.rung_fits   # its typed sections (ForecastLaw, ...)
    write_hero_forecast("forecast.json", doc)  # the one writer

Every problem raises ForecastError (an InputError: one line, exit 2) naming the file and the field.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from core.errors import InputError
from core.fsutil import atomic_write_json
from core.safeload import MAX_BYTES, kind_error, parse_json

__all__ = ["Forecast", "ForecastBacktest", "ForecastError", "ForecastHero", "ForecastLaw", "ForecastRegime",
           "ForecastTrajectory", "HeroForecast", "RungFit", "RungFits", "load_forecast", "read_hero_forecast",
           "write_hero_forecast"]


class ForecastError(InputError):
    """A forecast that cannot be made from these rungs, or a forecast file that cannot be read."""


@dataclass(frozen=True)
class ForecastHero:
    """forecast.json's "hero": the run the forecast is for, and its final loss's interval
    (point, lo, hi and the method's record). A forecast written before a field was recorded reads
    it as None."""

    spec_id: str | None = None
    name: str | None = None
    total_steps: int | None = None
    tokens_per_step: int | None = None
    active_params: int | None = None
    total_params: int | None = None
    flops: float | None = None
    final_loss: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> ForecastHero:
        """ForecastError naming the field when `d` is not a hero section."""
        if not isinstance(d, dict):
            raise ForecastError(f"{path}: forecast hero is not a mapping")
        kinds = {"spec_id": (str,), "name": (str,), "total_steps": (int,), "tokens_per_step": (int,), "active_params": (int,),
                 "total_params": (int,), "flops": (int, float), "final_loss": (dict,)}
        got: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name)
            if v is None:
                continue
            if (wrong := kind_error(v, kinds[f.name])) is not None:
                raise ForecastError(f"{path}: forecast hero.{f.name} {wrong}")
            got[f.name] = v
        return cls(**got)


def _typed(cls, d: Any, where: str, path: str | Path) -> dict[str, Any]:
    """The fields of `cls` that mapping `d` holds (a null one left out), each of its kind in
    cls.KINDS; ForecastError naming the field otherwise. A bool is no number."""
    if not isinstance(d, dict):
        raise ForecastError(f"{path}: forecast {where} is {type(d).__name__}, not a mapping")
    got: dict[str, Any] = {}
    for f in fields(cls):
        v = d.get(f.name)
        if v is None:
            continue
        if (wrong := kind_error(v, cls.KINDS[f.name])) is not None:
            raise ForecastError(f"{path}: forecast {where}.{f.name} {wrong}")
        got[f.name] = v
    return got


def _present(obj: Any, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """A section's fields in order, those that are None left out (but those in `keep`)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None or f.name in keep}


_NUM = (int, float)


@dataclass(frozen=True)
class ForecastBacktest:
    """forecast.json's "backtest" (and each of law.nearest_backtest): a rung family held out, the law
    refitted without it, its prediction with the interval against the family's mean final loss."""

    held_out: str | None = None
    members: list[str] | None = None
    predicted: float | None = None
    lo: float | None = None
    hi: float | None = None
    actual: float | None = None
    rel_error: float | None = None
    inside: bool | None = None

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "held_out": (str,), "members": (list,), "predicted": _NUM, "lo": _NUM, "hi": _NUM, "actual": _NUM,
        "rel_error": _NUM, "inside": (bool,)}

    def to_dict(self) -> dict[str, Any]:
        return _present(self)

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast", where: str = "backtest") -> ForecastBacktest:
        return cls(**_typed(cls, d, where, path))


@dataclass(frozen=True)
class ForecastLaw:
    """forecast.json's "law": the fitted final-loss law (kind "compute": L(C) = E + A C^-alpha;
    "size_tokens": L(N, D) = E + A/N^alpha + B/D^beta), its parameters' intervals, the points it was
    fitted on and its curve for the plot."""

    kind: str | None = None
    label: str | None = None
    E: float | None = None
    A: float | None = None
    B: float | None = None
    alpha: float | None = None
    beta: float | None = None
    ci: dict[str, Any] | None = None  # always written (null where the fit drew no bootstrap)
    ci_level: float | None = None
    converged: bool | None = None
    warnings: list[str] | None = None
    interval: str | None = None
    points: list[dict[str, Any]] | None = None
    nearest_backtest: list[ForecastBacktest] | None = None
    curve: dict[str, Any] | None = None

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "kind": (str,), "label": (str,), "E": _NUM, "A": _NUM, "B": _NUM, "alpha": _NUM, "beta": _NUM, "ci": (dict,),
        "ci_level": _NUM, "converged": (bool,), "warnings": (list,), "interval": (str,), "points": (list,),
        "nearest_backtest": (list,), "curve": (dict,)}

    def to_dict(self) -> dict[str, Any]:
        d = _present(self, keep=("ci",))
        if self.nearest_backtest is not None:
            d["nearest_backtest"] = [b.to_dict() for b in self.nearest_backtest]
        return d

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> ForecastLaw:
        got = _typed(cls, d, "law", path)
        if "nearest_backtest" in got:
            got["nearest_backtest"] = [ForecastBacktest.from_dict(b, path, f"law.nearest_backtest[{i}]")
                                       for i, b in enumerate(got["nearest_backtest"])]
        return cls(**got)


@dataclass(frozen=True)
class ForecastRegime:
    """forecast.json's "regime": the regime check's findings on the rungs (each a mapping with its
    kind and message: analysis.forecast.regime.RegimeWarning), the kinds it looks for, its method."""

    warnings: list[dict[str, Any]] | None = None
    kinds: list[str] | None = None
    method: str | None = None

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {"warnings": (list,), "kinds": (list,), "method": (str,)}

    def to_dict(self) -> dict[str, Any]:
        return _present(self)

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> ForecastRegime:
        got = _typed(cls, d, "regime", path)
        for i, w in enumerate(got.get("warnings") or []):
            if not isinstance(w, dict):
                raise ForecastError(f"{path}: forecast regime.warnings[{i}] is {type(w).__name__}, not a mapping")
        return cls(**got)


@dataclass(frozen=True)
class ForecastTrajectory:
    """forecast.json's "trajectory": the hero's train loss per step with its band (step, tokens,
    loss, lo, hi), how it was made (method; the curve model's shift onto the law's level, the
    train/eval ratio, the step noise, the stream deviations it carries and where) and the band's
    calibration. A fallback trajectory (the largest rung's, scaled) has only the first and method."""

    step: list[int] | None = None
    tokens: list[float] | None = None
    loss: list[float] | None = None
    lo: list[float] | None = None
    hi: list[float] | None = None
    shift: float | None = None
    quantity: str | None = None
    train_eval_ratio: float | None = None
    step_noise: float | None = None
    stream: dict[str, Any] | None = None
    misfit_rel: list[float] | None = None
    stream_covered: list[bool] | None = None
    method: str | None = None
    calibration: dict[str, Any] | None = None

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "step": (list,), "tokens": (list,), "loss": (list,), "lo": (list,), "hi": (list,), "shift": _NUM,
        "quantity": (str,), "train_eval_ratio": _NUM, "step_noise": _NUM, "stream": (dict,), "misfit_rel": (list,),
        "stream_covered": (list,), "method": (str,), "calibration": (dict,)}

    def to_dict(self) -> dict[str, Any]:
        return _present(self)

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> ForecastTrajectory:
        return cls(**_typed(cls, d, "trajectory", path))


@dataclass(frozen=True)
class RungFit:
    """One rung's curve-model fit in forecast.json's "rung_fits": its predicted loss at its tokens."""

    tokens: list[float]
    pred: list[float]

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {"tokens": (list,), "pred": (list,)}

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "pred": self.pred}


@dataclass(frozen=True)
class RungFits:
    """forecast.json's "rung_fits": each rung's curve-model fit, by rung name."""

    by_name: dict[str, RungFit]

    def get(self, name: str) -> RungFit | None:
        return self.by_name.get(name)

    def to_dict(self) -> dict[str, Any]:
        return {name: f.to_dict() for name, f in self.by_name.items()}

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> RungFits:
        if not isinstance(d, dict):
            raise ForecastError(f"{path}: forecast rung_fits is {type(d).__name__}, not a mapping")
        out = {}
        for name, f in d.items():
            got = _typed(RungFit, f, f"rung_fits.{name}", path)
            missing = [k for k in ("tokens", "pred") if k not in got]
            if missing:
                raise ForecastError(f"{path}: forecast rung_fits.{name} has no {missing[0]}")
            out[name] = RungFit(**got)
        return cls(out)


@dataclass
class HeroForecast:
    """A hero's forecast from its ladder (analysis.forecast.hero.forecast): to_dict() is
    forecast.json, from_dict() reads it back. An empty law, trajectory or regime section ({} in the
    file) reads as None; holdout names the rung families a `--holdout` forecast left out."""

    experiment: str
    created: str
    sources: dict[str, Any]
    law: ForecastLaw | None
    hero: ForecastHero
    backtest: ForecastBacktest | None
    trajectory: ForecastTrajectory | None
    grad_norm: dict[str, Any]
    curve_model: dict[str, Any] | None = None
    rung_fits: RungFits | None = None
    curve_model_error: str | None = None
    coverage: dict[str, Any] = field(default_factory=dict)
    regime: ForecastRegime | None = None
    warnings: list[str] = field(default_factory=list)
    holdout: list[str] | None = None

    @property
    def final_loss(self) -> dict[str, float]:
        return self.hero.final_loss

    def to_dict(self) -> dict[str, Any]:
        d = {"experiment": self.experiment, "created": self.created, "sources": self.sources,
             "law": self.law.to_dict() if self.law else {}, "hero": self.hero.to_dict(),
             "backtest": self.backtest.to_dict() if self.backtest else None,
             "trajectory": self.trajectory.to_dict() if self.trajectory else {},
             "grad_norm": self.grad_norm, "coverage": self.coverage,
             "regime": self.regime.to_dict() if self.regime else {}, "warnings": list(self.warnings)}
        for k in ("curve_model", "rung_fits", "curve_model_error", "holdout"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v.to_dict() if isinstance(v, RungFits) else v
        return d

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> HeroForecast:
        """forecast.json read back: ForecastError naming the section (or the field of a section)
        when one is of the wrong type, or when the hero has no final loss with finite mean, lo and
        hi. Sections a forecast written before them lacks read as empty."""
        if not isinstance(d, dict):
            raise ForecastError(f"{path}: not a forecast (a JSON object is expected)")
        hero = ForecastHero.from_dict(d["hero"], path) if d.get("hero") is not None else None
        fl = hero.final_loss if hero else None
        if not isinstance(fl, dict) or not all(isinstance(fl.get(k), (int, float)) and not isinstance(fl.get(k), bool)
                                               for k in ("mean", "lo", "hi")):
            raise ForecastError(f"{path}: not a forecast (no hero.final_loss with mean, lo and hi)")
        if not all(math.isfinite(fl[k]) for k in ("mean", "lo", "hi")):
            raise ForecastError(f"{path}: its hero final loss is not a number ({fl['mean']}, interval {fl['lo']} "
                                f"to {fl['hi']})")
        kinds = {"experiment": str, "created": str, "sources": dict, "law": dict, "backtest": dict, "trajectory": dict,
                 "grad_norm": dict, "curve_model": dict, "rung_fits": dict, "curve_model_error": str,
                 "coverage": dict, "regime": dict, "warnings": list, "holdout": list}
        for k, kind in kinds.items():
            if d.get(k) is not None and not isinstance(d[k], kind):
                raise ForecastError(f"{path}: forecast {k} is {type(d[k]).__name__}, not {kind.__name__}")
        sections = {"law": ForecastLaw, "backtest": ForecastBacktest, "trajectory": ForecastTrajectory,
                    "rung_fits": RungFits, "regime": ForecastRegime}
        empty = {"experiment": "", "created": "", "sources": {}, "grad_norm": {}, "coverage": {}, "warnings": []}
        got = {k: d[k] if d.get(k) is not None else empty.get(k) for k in kinds if k not in sections}
        got.update({k: c.from_dict(d[k], path) if d.get(k) else None for k, c in sections.items()})
        return cls(hero=hero, **got)


def write_hero_forecast(path: str | Path, fc: HeroForecast) -> Path:
    """forecast.json, written atomically (core.fsutil) as read_hero_forecast reads it."""
    return atomic_write_json(path, fc.to_dict())


def read_hero_forecast(path: str | Path) -> HeroForecast:
    """forecast.json (gzipped or not) as the HeroForecast that wrote it; ForecastError naming the
    file and the problem otherwise."""
    path = Path(path)
    if not path.exists():
        raise ForecastError(f"{path}: no such forecast file")
    try:
        raw = parse_json(read_maybe_gzip(path), str(path))  # nesting within core.safeload's limit
    except (UnicodeDecodeError, json.JSONDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise ForecastError(f"{path}: not valid JSON ({e})") from None
    return HeroForecast.from_dict(raw, path)


@dataclass
class Forecast:
    """The parts of forecast.json the monitor and the replanner read."""

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
    hero: ForecastHero | None = None
    curve_model: dict[str, Any] | None = None  # read by analysis.curves.CurveFit.from_dict
    created: str | None = None

    def is_for(self, spec_id: str | None) -> bool:
        """Whether this forecast was made for the run of this spec id."""
        return self.hero is not None and spec_id is not None and self.hero.spec_id == spec_id


def _arr(d: dict, key: str, where: str, path: Path) -> np.ndarray:
    if key not in d:
        raise ForecastError(f"{path}: forecast has no {where}.{key}")
    try:
        a = np.asarray([np.nan if v is None else v for v in d[key]], dtype=np.float64)
    except (TypeError, ValueError):
        raise ForecastError(f"{path}: forecast {where}.{key} is not a list of numbers") from None
    return a


def read_maybe_gzip(path: Path, limit: int = MAX_BYTES) -> str:
    """A file's text, gunzipped when its name ends in .gz (a committed forecast is compressed),
    refused past `limit` bytes either way."""
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ForecastError(f"{path}: more than {limit} bytes{' uncompressed' if path.suffix == '.gz' else ''} "
                            f"(the limit for a forecast file)")
    return data.decode("utf-8")


def load_forecast(path: str | Path) -> Forecast:
    path = Path(path)
    if not path.exists():
        raise ForecastError(f"{path}: no such forecast file")
    try:
        raw = parse_json(read_maybe_gzip(path), str(path))
    except (UnicodeDecodeError, json.JSONDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise ForecastError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "trajectory" not in raw:
        raise ForecastError(f"{path}: not a forecast (no 'trajectory' section)")
    tr = raw["trajectory"]
    if not isinstance(tr, dict):
        raise ForecastError(f"{path}: not a forecast (its 'trajectory' is not a mapping)")
    step = _arr(tr, "step", "trajectory", path)
    loss = _arr(tr, "loss", "trajectory", path)
    lo = _arr(tr, "lo", "trajectory", path)
    hi = _arr(tr, "hi", "trajectory", path)
    if not (len(step) == len(loss) == len(lo) == len(hi)) or len(step) < 2:
        raise ForecastError(f"{path}: trajectory step/loss/lo/hi must be lists of one length >= 2")
    if np.any(np.diff(step) <= 0):
        raise ForecastError(f"{path}: trajectory steps must be strictly increasing")
    tokens = _arr(tr, "tokens", "trajectory", path) if "tokens" in tr else None
    hero = ForecastHero.from_dict(raw["hero"], path) if raw.get("hero") else None
    cm = raw.get("curve_model")
    if cm is not None and not isinstance(cm, dict):
        raise ForecastError(f"{path}: forecast curve_model is not a mapping")
    created = raw.get("created")
    fc = Forecast(str(path), step, tokens, loss, lo, hi, hero=hero, curve_model=cm,
                  created=created if isinstance(created, str) else None)
    gn = raw.get("grad_norm")
    if isinstance(gn, dict) and gn.get("step"):
        fc.gn_step = _arr(gn, "step", "grad_norm", path)
        fc.gn_mean = _arr(gn, "mean", "grad_norm", path)
        fc.gn_lo = _arr(gn, "lo", "grad_norm", path) if "lo" in gn else None
        fc.gn_hi = _arr(gn, "hi", "grad_norm", path) if "hi" in gn else None
    return fc
