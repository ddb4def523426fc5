"""The parts of a forecast.json (`ladder forecast`) that the monitor and the replanner read.

    fc = load_forecast("forecast.json")   # Forecast: the loss trajectory with its band, the grad-norm
                                          # envelope when there is one, the hero and the curve model
    fc.hero.spec_id, fc.hero.tokens_per_step   # ForecastHero: the run the forecast is for
    doc = read_hero_forecast("forecast.json")  # HeroForecast: the whole document, as the forecast wrote it

Every problem raises ForecastError (an InputError: one line, exit 2) naming the file and the field.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InputError
from core.safeload import MAX_BYTES, parse_json

__all__ = ["Forecast", "ForecastError", "ForecastHero", "HeroForecast", "load_forecast", "read_hero_forecast"]


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
            if isinstance(v, bool) or not isinstance(v, kinds[f.name]):
                raise ForecastError(f"{path}: forecast hero.{f.name} is {type(v).__name__}, not "
                                    f"{' or '.join(k.__name__ for k in kinds[f.name])}")
            got[f.name] = v
        return cls(**got)


@dataclass
class HeroForecast:
    """A hero's forecast from its ladder (analysis.forecast.hero.forecast): to_dict() is
    forecast.json, from_dict() reads it back."""

    experiment: str
    created: str
    sources: dict[str, Any]
    law: dict[str, Any]
    hero: ForecastHero
    backtest: dict[str, Any] | None
    trajectory: dict[str, Any]
    grad_norm: dict[str, Any]
    curve_model: dict[str, Any] | None = None
    rung_fits: dict[str, Any] | None = None
    curve_model_error: str | None = None
    coverage: dict[str, Any] = field(default_factory=dict)
    regime: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def final_loss(self) -> dict[str, float]:
        return self.hero.final_loss

    def to_dict(self) -> dict[str, Any]:
        d = {"experiment": self.experiment, "created": self.created, "sources": self.sources, "law": self.law,
             "hero": self.hero.to_dict(), "backtest": self.backtest, "trajectory": self.trajectory,
             "grad_norm": self.grad_norm, "coverage": self.coverage, "regime": self.regime,
             "warnings": list(self.warnings)}
        for k in ("curve_model", "rung_fits", "curve_model_error"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "forecast") -> HeroForecast:
        """forecast.json read back: ForecastError naming the section when one is of the wrong
        type, or when the hero has no final loss with finite mean, lo and hi. Sections a forecast
        written before them lacks read as empty."""
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
                 "coverage": dict, "regime": dict, "warnings": list}
        for k, kind in kinds.items():
            if d.get(k) is not None and not isinstance(d[k], kind):
                raise ForecastError(f"{path}: forecast {k} is {type(d[k]).__name__}, not {kind.__name__}")
        empty = {"experiment": "", "created": "", "sources": {}, "law": {}, "trajectory": {}, "grad_norm": {},
                 "coverage": {}, "regime": {}, "warnings": []}
        got = {k: d[k] if d.get(k) is not None else empty.get(k) for k in kinds}
        return cls(hero=hero, **got)



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
