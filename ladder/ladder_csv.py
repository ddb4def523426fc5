"""A ladder trained elsewhere, listed in a CSV: one row per rung, its spec and its curve.

    name,spec,curve,final_loss
    d512,specs/d512.yaml,curves/d512.csv,
    d768,specs/d768.yaml,wandb:runs/wandb/offline-run-20260101_120000-abc123,3.112

`spec` is a spec YAML (`ladder spec from-run` writes one from the stack's config); `curve` is
anything `ladder compare` reads that needs no server: a CSV export, a metrics.jsonl or run
directory, or `wandb:DIR` (and `mlflow:RUN_ID` with MLFLOW_TRACKING_URI set). Relative paths are
relative to the CSV. `final_loss` (optional) is the rung's final held-out loss where the curve
has no eval_loss (or to use another measurement of it); it is the value the law fits. Every
rung's final loss must be measured the same way: on one held-out set, by one evaluator.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.forecast.hero import RungRun
from analysis.runs.names import MetricNames
from analysis.runs.metrics import MetricsError, tokens_from_spec
from analysis.runs.sources import open_source
from core.spec import load_spec
from ladder.errors import LadderError

__all__ = ["read_ladder_csv"]

COLUMNS = ("name", "spec", "curve")


def _resolve(base: Path, ref: str) -> str:
    for prefix in ("wandb:", "mlflow:"):
        if ref.startswith(prefix):
            rest = ref[len(prefix):]
            if prefix == "wandb:" and not Path(rest).is_absolute() and (base / rest).exists():
                return prefix + str(base / rest)
            return ref
    p = Path(ref).expanduser()
    return str(p if p.is_absolute() else base / p)


def read_ladder_csv(path: str | Path, names: MetricNames | None = None) -> list[RungRun]:
    """The rungs a ladder CSV lists, each with its spec and curve (tokens from the spec where the
    curve has none, the final loss placed at its last step where given)."""
    path = Path(path)
    if not path.is_file():
        raise LadderError(f"{path}: no such ladder CSV")
    try:
        table = pd.read_csv(path, dtype={"name": str, "spec": str, "curve": str})
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise LadderError(f"{path}: not a readable CSV ({(str(e).strip().splitlines() or ['empty'])[0]})") from None
    table.columns = [str(c).strip() for c in table.columns]
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise LadderError(f"{path}: missing column(s) {', '.join(map(repr, missing))} (a ladder CSV has name, spec, "
                          f"curve and optionally final_loss; columns present: {', '.join(map(repr, table.columns))})")
    base = path.parent
    rungs, seen = [], set()
    for i, row in table.iterrows():
        where = f"{path} row {i + 1}"
        name = str(row["name"]).strip()
        if not name or name in seen:
            raise LadderError(f"{where}: rung name {name!r} is empty or repeated")
        seen.add(name)
        spec = load_spec(_resolve(base, str(row["spec"]).strip()))
        if spec.name != name:
            spec = spec.replace(name=name)
        curve = _resolve(base, str(row["curve"]).strip())
        try:
            metrics = open_source(curve, names=names).read()
        except MetricsError as e:
            raise LadderError(f"{where}: {e}") from None
        metrics = tokens_from_spec(metrics, spec)
        final = row.get("final_loss") if "final_loss" in table.columns else None
        if final is not None and not (isinstance(final, float) and math.isnan(final)):
            try:
                value = float(final)
            except (TypeError, ValueError):
                raise LadderError(f"{where}: final_loss {final!r} is not a number") from None
            if not math.isfinite(value) or value <= 0:
                raise LadderError(f"{where}: final_loss {final!r} must be a positive finite number")
            metrics = metrics.copy()
            if "eval_loss" not in metrics.columns:
                metrics["eval_loss"] = np.nan
            metrics.loc[metrics.index[-1], "eval_loss"] = value
        elif "eval_loss" not in metrics.columns or not pd.to_numeric(metrics["eval_loss"], errors="coerce").notna().any():
            raise LadderError(f"{where}: the curve {curve} has no eval_loss; give the rung's final held-out loss in a "
                              "final_loss column")
        rungs.append(RungRun(spec, Path(curve), metrics))
    return rungs
