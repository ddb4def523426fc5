"""The parts of a forecast.json (`ladder forecast`) that the monitor and the replanner read.

    fc = load_forecast("forecast.json")   # Forecast: the loss trajectory with its band, the grad-norm
                                          # envelope when there is one, the hero and the curve model
    fc.hero.spec_id, fc.hero.tokens_per_step   # ForecastHero: the run the forecast is for

Every problem raises ForecastError (an InputError: one line, exit 2) naming the file and the field.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InputError
from core.safeload import MAX_BYTES

__all__ = ["Forecast", "ForecastError", "ForecastHero", "load_forecast"]


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
        raw = json.loads(read_maybe_gzip(path))
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
