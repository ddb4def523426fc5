"""The monitor's vocabulary: its settings (thresholds with documented defaults), a flag, a report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.errors import InputError
from core.safeload import kind_error, load_file

__all__ = ["SEVERITY_RANK", "Flag", "MonitorReport", "MonitorSettings", "Severity"]

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
    load_warn: float = Field(4.0, gt=1, description="expert_load_max (busiest expert over the mean) that warns "
                             "without a calibration: with 64 experts top-8, the busiest expert picked by half the tokens")
    load_smooth: int = Field(25, ge=1, description="rolling-median points of the expert-load tests")
    load_k: int = Field(5, ge=1, description="consecutive points of that median over load_warn before a flag")
    load_settle_frac: float = Field(0.25, gt=0, le=1, description="share of training by which the router must have "
                                    "brought the load below load_warn (healthy heroes: about 5%)")
    load_min_sd: float = Field(0.1, ge=0, description="floor on the expert load's healthy sd in log units (10%): "
                               "a busiest expert that much busier than healthy runs' is no fault a mesh feels")
    load_trend_points: int = Field(50, ge=2, description="rolling-median points of the expert-load trend")
    load_trend_ratio: float = Field(1.5, gt=1, description="that median over its own low since the router settled: "
                                    "a rising load (healthy runs' falls)")
    throughput_frac: float = Field(0.9, gt=0, le=1, description="share of planned tokens/s below which to flag")
    throughput_points: int = Field(20, ge=1, description="last points whose median is the measured tokens/s")
    throughput_drop_frac: float = Field(1 / 3, gt=0, lt=1, description="recent tokens/s below this share of the "
                                        "run's own earlier rate: a throughput drop")
    false_alarm_rate: float = Field(0.01, gt=0, lt=0.5, description="chance a healthy run trips one direction of "
                                    "one series' sequential test (analysis.monitor.calib)")
    min_sd: float = Field(0.01, ge=0, description="floor on a series' healthy sd in log units (1%): smaller "
                          "departures are not worth a flag however steady the healthy runs are")
    warn_sd: float = Field(1.96, gt=0, description="healthy sds a run must also be from the healthy runs for a change "
                           "against its own level to warn (the healthy band's 95% range)")
    crit_sd: float = Field(8.0, gt=0, description="healthy sds a departure must reach, past the alarm, to be critical")
    spike_healthy_margin: float = Field(1.5, ge=1, description="with a calibration, a spike must exceed the healthy "
                                        "runs' largest local z in its stretch by this factor to warn")
    spike_gross_factor: float = Field(3.0, ge=1, description="without a calibration, a loss spike warns only past "
                                      "this many times spike_sigma (else it is info; a grad-norm spike alone is info)")
    band_gross_widths: float = Field(1.0, gt=0, description="without a calibration: band widths beyond the "
                                     "forecast band that make a departure a warning (1: three half-widths from its "
                                     "centre, 4.9 sd of a calibrated 90% band; the H200 hero's five healthy seeds "
                                     "reach at most 1.5 half-widths)")
    eval_rise_sigma: float = Field(3.0, gt=0, description="eval loss rise over its running minimum, in standard "
                                   "errors (eval_loss_se), that counts as a rise")
    eval_rise_rel: float = Field(0.02, gt=0, description="the relative rise that counts without eval_loss_se")
    eval_rise_points: int = Field(2, ge=1, description="consecutive eval points risen, with train loss falling")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "MonitorSettings":
        """Defaults, then a YAML file's values, then explicit overrides (e.g. from `--set k=v`)."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.exists():
                raise InputError(f"{p}: no such monitor settings file")
            try:
                loaded = load_file(p, "yaml") or {}
            except yaml.YAMLError as e:
                raise InputError(f"{p}: not valid YAML: {e}") from None
            if not isinstance(loaded, dict):
                raise InputError(f"{p}: monitor settings must be a mapping of threshold names to values")
            data.update(loaded)
        data.update(overrides or {})
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            parts = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"]) or "(settings)"
                parts.append(f"{loc}: {err['msg']}")
            raise InputError("invalid monitor settings: " + "; ".join(parts)) from None


@dataclass
class Flag:
    kind: str
    severity: Severity
    first_step: int
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "flag") -> Flag:
        """A flag as to_dict() wrote it; InputError naming `where` and the field otherwise."""
        if not isinstance(d, dict):
            raise InputError(f"{where} is {type(d).__name__}, not a mapping")
        kinds = {"kind": (str,), "severity": (str,), "first_step": (int, type(None)), "evidence": (dict,)}
        for k, kind in kinds.items():
            if (wrong := kind_error(d.get(k), kind)) is not None:
                raise InputError(f"{where}.{k} {wrong}")
        if d["severity"] not in SEVERITY_RANK:
            raise InputError(f"{where}.severity is {d['severity']!r}, not one of {', '.join(SEVERITY_RANK)}")
        return cls(d["kind"], d["severity"], d["first_step"], d["evidence"])


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
