"""Where a live run is (RunState: its metrics, the monitor's report on them, throughput, kept
checkpoints), a replan's options and the replan as values (Option, Replan: their table rows and
replan.json), the deadline, the gate of the next context stage, and the files a replan writes
(analysis.replan.contingency makes the options).
"""

from __future__ import annotations

import re
import time as _time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.monitor.watch import Forecast, MonitorReport, MonitorSettings, measured_tokens_per_s, monitor, planned_tokens_per_s
from analysis.replan.file import OptionRow, ReplanDoc, write_replan_json
from analysis.runs.metrics import RunRef, ancestor_checkpoints
from core.errors import InputError
from core.spec import Spec, save_spec


class ReplanError(InputError):
    """A replan that cannot be made from this input; nothing has been written."""


# ---- where the run is --------------------------------------------------------------------------


@dataclass
class RunState:
    spec: Spec
    df: pd.DataFrame
    report: MonitorReport
    step: int  # last logged step
    tokens_per_s: float
    tokens_per_s_source: str
    checkpoints: list[int]
    checkpoints_assumed: bool
    now: float
    ref: RunRef | None = None
    run_dir: Path | None = None
    forecast: Forecast | None = None
    ancestors: list[tuple[int, Path, str]] = field(default_factory=list)  # (step, run dir, spec id), newest first

    @property
    def done_steps(self) -> int:
        return self.step + 1

    @property
    def budget_frac(self) -> float:
        return self.done_steps / self.spec.total_steps

    @property
    def drop_frac(self) -> float | None:
        cols = [c for c in ("drop_frac_send", "drop_frac_recv") if c in self.df.columns]
        if not cols:
            return None
        d = self.df[cols].fillna(0.0).sum(axis=1).to_numpy()[-20:]
        return float(np.mean(d)) if len(d) else None

    @property
    def fall_so_far(self) -> float | None:
        """The run's first finite training loss less the mean of its last 5 finite ones (None with
        fewer than 10 finite losses, or when the loss has not fallen)."""
        loss = self.df["loss"].to_numpy(dtype=np.float64)
        loss = loss[np.isfinite(loss)]
        if len(loss) < 10:
            return None
        fall = float(loss[0] - np.mean(loss[-5:]))
        return fall if fall > 0 else None

    def latest_checkpoint(self) -> int:
        """Newest kept checkpoint <= the run's progress; 0 (a fresh start from the spec's seed) when
        none is kept. (A rewind's checkpoint: analysis.replan.rewind.)"""
        ok = [c for c in self.checkpoints if c <= self.done_steps]
        return max(ok) if ok else 0

    @classmethod
    def build(cls, df: pd.DataFrame, spec: Spec, ref: RunRef | None = None, *, tokens_per_s: float | None = None,
              forecast: Forecast | None = None, settings: MonitorSettings | None = None,
              now: float | None = None) -> "RunState":
        now = _time.time() if now is None else now
        if len(df) == 0:
            raise ReplanError("the metrics have no records: nothing to replan from")
        report = monitor(df, spec, forecast, settings, plan_tokens_per_s=tokens_per_s,
                         status=ref.status() if ref else None, now=now)
        if tokens_per_s is not None:
            if not tokens_per_s > 0:
                raise ReplanError(f"--tokens-per-s must be positive (got {tokens_per_s})")
            tps, src = float(tokens_per_s), "given"
        else:
            tps, src = measured_tokens_per_s(df), "measured"
            if tps is None:
                tps, src = planned_tokens_per_s(spec), "planned (hardware x expected MFU)"
            if tps is None or not tps > 0:
                raise ReplanError("the metrics hold no throughput (tokens_per_s or time): pass --tokens-per-s")
        step = int(df["step"].iloc[-1])
        ckpts = ref.checkpoint_steps() if ref is not None else []
        assumed = False
        if not ckpts and (ref is None or ref.run_dir is None):
            # Metrics from elsewhere: assume the spec's checkpoint cadence.
            every = spec.run.checkpoint_every
            ckpts = list(range(every, step + 2, every))
            assumed = True
        run_dir = ref.run_dir if ref else None
        return cls(spec, df, report, step, tps, src, ckpts, assumed, now, ref, run_dir, forecast,
                   ancestor_checkpoints(run_dir, spec))


# ---- options -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionForecast:
    """An option's forecast final loss: its mean and interval at `level`, the model that made it,
    and that model's own record (its error terms, the anchor, a pooling)."""

    mean: float
    lo: float
    hi: float
    level: float
    model: str
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def shifted(self, mean: float, **detail: Any) -> OptionForecast:
        """The same interval moved to `mean` (lo kept at 0 or above), with `detail` added."""
        d = mean - self.mean
        return OptionForecast(mean, max(self.lo + d, 0.0), self.hi + d, self.level, self.model,
                              {**self.detail, **detail})


@dataclass
class Option:
    kind: str
    title: str
    spec: Spec | None
    resume_step: int | None
    reason: str
    allowed: bool = True
    note: str = ""
    finish: str | None = None
    finish_ts: float | None = None
    device_hours: float | None = None
    forecast: OptionForecast | None = None
    meets_deadline: bool | None = None
    memory_gb: float | None = None
    path: str | None = None
    resume_dir: Path | None = None  # the run dir of the checkpoint it resumes, when its lineage names another run
    resume_checkpoint: Path | None = None  # the checkpoint directory it resumes from, where known

    def row(self, n: int) -> OptionRow:
        fc = self.forecast
        return OptionRow(
            n=n, kind=self.kind, title=self.title, allowed=self.allowed,
            spec_id=self.spec.id if self.spec else None, spec_path=self.path,
            resume_step=self.resume_step,
            resume_run_dir=str(self.resume_dir) if self.resume_dir else None,
            resume_checkpoint=str(self.resume_checkpoint) if self.resume_checkpoint else None,
            total_steps=self.spec.total_steps if self.spec else None,
            tokens=self.spec.data.total_tokens if self.spec else None,
            finish=self.finish, meets_deadline=self.meets_deadline, device_hours=self.device_hours,
            forecast_loss=fc.mean if fc else None, forecast_lo=fc.lo if fc else None,
            forecast_hi=fc.hi if fc else None, forecast_level=fc.level if fc else None, memory_gb=self.memory_gb,
            reason=self.reason, note=self.note,
        )


@dataclass
class Replan:
    state: RunState
    deadline: float | None
    options: list[Option]
    recommended: int | None  # index into options
    recommendation: str
    context_gate: dict | None
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[OptionRow]:
        return [o.row(i + 1) for i, o in enumerate(self.options)]

    def document(self) -> ReplanDoc:
        """replan.json's document (analysis.replan.file)."""
        st = self.state
        return ReplanDoc(
            run={
                "spec_id": st.spec.id, "name": st.spec.name, "step": st.step, "total_steps": st.spec.total_steps,
                "budget_frac": st.budget_frac, "tokens_per_s": st.tokens_per_s,
                "tokens_per_s_source": st.tokens_per_s_source, "checkpoints": st.checkpoints,
                "checkpoints_assumed": st.checkpoints_assumed, "drop_frac": st.drop_frac,
                "fall_so_far": st.fall_so_far,
                "run_dir": str(st.run_dir) if st.run_dir else None,
            },
            now=_iso(st.now),
            deadline=_iso(self.deadline) if self.deadline else None,
            flags=tuple(st.report.flags),
            options=tuple(self.rows()),
            recommended=(self.recommended + 1) if self.recommended is not None else None,
            recommendation=self.recommendation,
            context_gate=self.context_gate,
            notes=self.notes,
        )

    def to_dict(self) -> dict[str, Any]:
        return self.document().to_dict()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_deadline(deadline: str | None, days: float | None, now: float) -> float | None:
    """--deadline DATE (ISO date or date-time; naive means UTC) or --days N -> unix time."""
    if deadline is not None and days is not None:
        raise ReplanError("give --deadline or --days, not both")
    if days is not None:
        if not days > 0:
            raise ReplanError(f"--days must be positive (got {days}): a deadline in the past")
        return now + days * 86400.0
    if deadline is None:
        return None
    try:
        dt = datetime.fromisoformat(deadline.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReplanError(f"--deadline {deadline!r} is not a date (use e.g. 2026-12-24 or 2026-12-24T18:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    ts = dt.timestamp()
    if ts <= now:
        raise ReplanError(f"--deadline {deadline} is in the past (now is {_iso(now)})")
    return ts


def _timing(opt: Option, st: RunState, start_step: int, deadline: float | None) -> None:
    spec = opt.spec or st.spec
    remaining_tokens = max(spec.total_steps - start_step, 0) * spec.data.tokens_per_step
    secs = remaining_tokens / st.tokens_per_s
    opt.finish_ts = st.now + secs
    opt.finish = _iso(opt.finish_ts)
    opt.device_hours = secs * max(spec.hardware.n_gpus, 1) / 3600.0
    if deadline is not None:
        opt.meets_deadline = opt.finish_ts <= deadline


def _parse_gate(gate: str) -> tuple[str, str, float] | None:
    m = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*(<=|<|>=|>|==)\s*([-+0-9.eE]+)\s*", gate)
    if not m:
        return None
    try:
        return m.group(1), m.group(2), float(m.group(3))
    except ValueError:
        return None


def context_gate(st: RunState) -> dict | None:
    """Whether the next gated context stage may be enabled, judged on the measured metrics."""
    stages = sorted((c for c in st.spec.data.context_stages if c.gated), key=lambda c: c.start_frac)
    if not stages:
        return None
    nxt = stages[0]
    out: dict[str, Any] = {"stage": nxt.model_dump(mode="json"), "gate": nxt.gate, "allowed": False}
    parsed = _parse_gate(nxt.gate)
    if parsed is None:
        out["note"] = f"cannot read the gate {nxt.gate!r} (expected e.g. 'drop_frac <= 0.07')"
        return out
    metric, op, bound = parsed
    if metric == "drop_frac":
        value = st.drop_frac
    elif metric in st.df.columns:
        v = pd.to_numeric(st.df[metric], errors="coerce").dropna().to_numpy()[-20:]
        value = float(np.mean(v)) if len(v) else None
    else:
        value = None
    if value is None:
        out["note"] = f"the run logs no {metric!r}: the gate cannot be judged"
        return out
    allowed = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound, "==": value == bound}[op]
    out.update({"metric": metric, "measured": value, "bound": bound, "allowed": bool(allowed),
                "note": f"measured {metric} {value:.4g} {'meets' if allowed else 'fails'} the gate {nxt.gate!r} "
                        f"for {nxt.seq_len}-token context"})
    return out



def write_replan(plan: Replan, out_dir: str | Path) -> dict[str, str]:
    """Writes each allowed option's spec (`<n>-<kind>.yaml`) and replan.json; returns their paths."""
    out = Path(out_dir)
    paths: dict[str, str] = {}
    for i, o in enumerate(plan.options):
        if o.spec is None or not o.allowed or o.kind == "keep":
            continue
        p = out / f"{i + 1}-{o.kind}.yaml"
        save_spec(o.spec, p)
        o.path = str(p)
        paths[o.kind] = str(p)
    paths["replan.json"] = str(write_replan_json(out / "replan.json", plan.document()))
    return paths
