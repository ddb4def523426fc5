"""What a calibration says of the run it judges, and how it is applied.

    scope = calibration_scope(cal, spec, df)   # Scope: relation, what the monitor does, and why

A calibration is the healthy spread of one spec's replicates (analysis.monitor.calib). The run it
judges is one of:

- a replicate (the calibrated spec but for the seed and name): the calibration applies as is; it
  is what the calibration predicts (each healthy run was judged by the others' calibration, leave
  one out, when bench/faults.py measured the false alarms);
- a branch (a continuation of a parent's run from lineage.resume_step: a replan's option, a
  resume with new settings): up to its join step it is its parent's run and is judged as
  calibrated; after it, its own spec trains, whose level no healthy run measured, so the level
  tests stop there and the change tests (the run against its own recent level, in the healthy
  runs' one-step spread of that stretch) go on judging it;
- another spec (a run the user compares with this forecast whose spec differs beyond the seed: a
  wrong setting is what the monitor is for): judged against the calibrated spec's healthy runs,
  the fields that differ named;
- unknown (no spec for the run, or a calibration file that does not record its spec): as is.

Whatever the relation, the eval-loss series are judged only when the run's periodic evals are
sampled as the healthy runs' were (analysis.monitor.series.eval_sample): another sample sits at
another level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from analysis.runs.replicates import family_key
from core.spec import Spec

__all__ = ["Scope", "calibration_scope", "spec_fields", "spec_differences"]

# spec fields that do not change what a run computes from step to step
_NOT_COMPARED = ("name", "seed", "role", "lineage", "options", "hardware", "run")


@dataclass(frozen=True)
class Scope:
    relation: str  # "replicate", "branch", "other_spec" or "unknown"
    text: str
    level_until_step: int | None = None  # the level tests judge blocks that end by this step only
    eval_skipped: str | None = None  # why the eval-loss series are not judged against the calibration
    differs: tuple[str, ...] = ()  # "field: calibrated -> run" for another spec

    def to_dict(self) -> dict[str, Any]:
        return {"relation": self.relation, "text": self.text, "level_until_step": self.level_until_step,
                "eval_skipped": self.eval_skipped, "differs": list(self.differs)}


def spec_fields(spec: Spec) -> dict[str, Any]:
    """The spec's compared fields, flattened ("optim.eps": 1e-08, ...)."""
    out: dict[str, Any] = {}

    def walk(d: Any, prefix: str) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = d

    dump = spec.model_dump(mode="json")
    walk({k: v for k, v in dump.items() if k not in _NOT_COMPARED}, "")
    return out


def spec_differences(calibrated: dict[str, Any], spec: Spec) -> tuple[str, ...]:
    run = spec_fields(spec)
    keys = sorted(set(calibrated) | set(run))
    return tuple(f"{k}: {calibrated.get(k)!r} -> {run.get(k)!r}" for k in keys if calibrated.get(k) != run.get(k))


def calibration_scope(cal, spec: Spec | None, df: pd.DataFrame) -> Scope:
    """How the calibration `cal` (analysis.monitor.calib.Calibration) applies to a run of `spec`."""
    eval_skipped = cal.eval_sample_differs(df)
    names = ", ".join(r.name for r in cal.runs)
    base = f"calibrated on {len(cal.runs)} healthy runs ({names})"
    if spec is None:
        return Scope("unknown", f"{base}; applied as is (the run's spec is not known)", eval_skipped=eval_skipped)
    join = spec.lineage.resume_step
    if join is not None:
        parent = spec.lineage.parent_id or "its parent"
        return Scope("branch", f"{base}; the run is a branch of {parent} from step {join}: judged as calibrated up to "
                     f"step {join}, after it by the change tests only (its own spec's level was never measured on "
                     f"healthy runs)", level_until_step=int(join), eval_skipped=eval_skipped)
    if cal.family is None:
        return Scope("unknown", f"{base}; applied as is (the calibration does not record its spec)",
                     eval_skipped=eval_skipped)
    if family_key(spec) == cal.family:
        return Scope("replicate", f"{base}; the run is a replicate of that spec (seed {spec.seed}): applied as is",
                     eval_skipped=eval_skipped)
    differs = spec_differences(cal.spec or {}, spec) if cal.spec else ()
    what = "; ".join(differs[:6]) + (f"; {len(differs) - 6} more" if len(differs) > 6 else "") if differs else "not recorded"
    return Scope("other_spec", f"{base}; the run's spec differs from theirs ({what}): judged against the calibrated "
                 f"spec's healthy runs", eval_skipped=eval_skipped, differs=differs)
