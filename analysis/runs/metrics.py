"""Read a run's metrics into a DataFrame, from this project's metrics.jsonl or from a CSV exported
elsewhere, so a run not launched here can be compared and replanned too.

    read_metrics_frame(path, columns=None) -> pd.DataFrame

`path` is a run directory (its metrics.jsonl), a .jsonl file or a .csv file. The frame has one row
per step, sorted by step (a repeated step keeps its last record, as a resumed writer would), with at
least the columns `step` and `loss`; `tokens`, `grad_norm`, `lr`, `drop_frac_send`, ... are kept
when present. A CSV's column names are matched case-insensitively against common aliases
(`_step`, `global_step`, `iteration` for step; `train_loss`, `train/loss`, `loss/train` for loss;
`train/grad_norm`, `grad/norm` for grad_norm; ...), or named explicitly with
`columns={"loss": "my loss column"}`.

Non-finite loss or grad-norm values are kept (the monitor flags them); a cell that is not a number
at all is an error naming the file, column and row. Every problem raises `MetricsError` (a
ValueError: the CLI prints it as a one-line error, exit 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from analysis.runs.names import ALIASES, MetricNames
from core import env
from core.errors import InputError
from core.rundir import METRICS_FILE, iter_run_dirs, parse_metrics_lines
from core.schedule import lr_at
from core.spec import load_spec
from engines.checkpoint import list_checkpoints

__all__ = ["MetricsError", "RunRef", "read_metrics_frame", "finish_frame", "tokens_from_spec", "resolve_metrics_path",
           "resolve_run", "check_spec_matches", "lr_departure", "LR_AGREED_POINTS"]


class MetricsError(InputError):
    """A metrics file that cannot be read as a run's curve; the message names file and problem."""


def resolve_metrics_path(path: str | Path) -> Path:
    """A run dir -> its metrics.jsonl; a file -> itself. Missing -> MetricsError."""
    p = Path(path)
    if p.is_dir():
        m = p / METRICS_FILE
        if not m.exists():
            raise MetricsError(f"{p}: run directory has no {METRICS_FILE} (has the run started?)")
        return m
    if not p.exists():
        raise MetricsError(f"{p}: no such metrics file")
    return p


def _read_jsonl(path: Path) -> pd.DataFrame:
    """Records of a metrics.jsonl; bad lines are skipped with a warning naming file:line (core.rundir)."""
    records = []
    for rec in parse_metrics_lines(path.read_bytes(), path):
        extra = rec.pop("extra", None)
        if isinstance(extra, dict):
            for k, v in extra.items():
                rec.setdefault(f"extra.{k}", v)
        records.append(rec)
    return pd.DataFrame.from_records(records)


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise MetricsError(f"{path}: file is empty (expected a CSV with a header row)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise MetricsError(f"{path}: not a readable CSV ({str(e).strip().splitlines()[0]})") from None


def _rename(df: pd.DataFrame, path: Path, columns: Mapping[str, str] | None) -> pd.DataFrame:
    df.columns = [str(c).strip() for c in df.columns]
    rename: dict[str, str] = {}
    columns = dict(columns or {})
    for canon, given in columns.items():
        if given not in df.columns:
            raise MetricsError(
                f"{path}: column {given!r} (given for {canon}) not found; columns present: "
                + ", ".join(repr(c) for c in df.columns)
            )
        rename[given] = canon
    lower = {c.lower(): c for c in df.columns}
    for canon, names in ALIASES.items():
        if canon in columns or canon in df.columns:
            continue
        for n in names:
            if n in lower and lower[n] not in rename:
                rename[lower[n]] = canon
                break
    return df.rename(columns=rename)


def _numeric(df: pd.DataFrame, col: str, path: Path, allow_missing: bool) -> None:
    raw = df[col]
    num = pd.to_numeric(raw, errors="coerce")
    bad = num.isna() & raw.notna()
    # json NaN / inf arrive as floats already; text "nan"/"inf" in a CSV parse as floats too.
    if bad.any():
        r = int(np.flatnonzero(bad.to_numpy())[0])
        raise MetricsError(f"{path}: column {col!r} row {r + 1}: value {raw.iloc[r]!r} is not a number")
    if not allow_missing and num.isna().any():
        r = int(np.flatnonzero(num.isna().to_numpy())[0])
        raise MetricsError(f"{path}: column {col!r} row {r + 1} is empty")
    df[col] = num.astype(np.float64)


WANDB_STAT_SUFFIXES = ("__MIN", "__MAX")


def normalise_wandb_export(df: pd.DataFrame, origin: str) -> pd.DataFrame:
    """A W&B panel export ("Export panel data as CSV": `Step`, `<run> - <metric>`, and
    `<run> - <metric>__MIN` / `__MAX` when points were bucketed) -> `Step` and `<metric>` columns.
    A CSV of another shape is returned as it is; one with several runs is refused (export one)."""
    cols = [str(c) for c in df.columns]
    runs: dict[str, list[str]] = {}
    for c in cols:
        if " - " in c:
            run, _ = c.split(" - ", 1)
            runs.setdefault(run, []).append(c)
    if not runs or not any(c.lower() == "step" for c in cols):
        return df
    if len(runs) > 1:
        raise MetricsError(
            f"{origin}: a W&B export with {len(runs)} runs ({', '.join(sorted(runs))}); export one run's panel, "
            "or name the columns with --metric-names"
        )
    drop = [c for c in cols if c.endswith(WANDB_STAT_SUFFIXES)]
    df = df.drop(columns=drop)
    return df.rename(columns={c: c.split(" - ", 1)[1] for c in df.columns if " - " in str(c)})


def read_metrics_frame(path: str | Path, columns: Mapping[str, str] | None = None,
                       names: MetricNames | None = None) -> pd.DataFrame:
    """A run's metrics frame from a run dir, a metrics.jsonl or a CSV (a W&B panel export too);
    `names` maps another stack's metric names onto this project's first."""
    path = resolve_metrics_path(path)
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        df = _read_jsonl(path)
    elif path.suffix in (".csv", ".tsv", ".txt"):
        df = normalise_wandb_export(_read_csv(path), str(path))
    else:
        raise MetricsError(f"{path}: unknown metrics format {path.suffix!r} (expected .jsonl or .csv)")
    return finish_frame(df, path, columns, names)


def finish_frame(df: pd.DataFrame, path: str | Path, columns: Mapping[str, str] | None = None,
                 names: MetricNames | None = None) -> pd.DataFrame:
    """Name map, aliases, numeric checks, one row per step sorted by step (`path` names the
    origin in errors: a file, or mlflow:RUN_ID)."""
    if df.empty:
        raise MetricsError(f"{path}: no metric records")
    if names is not None:
        df = names.apply(df)
    df = _rename(df, path, columns)
    for need in ("step", "loss"):
        if need not in df.columns:
            raise MetricsError(
                f"{path}: no {need} column (looked for {', '.join(repr(a) for a in ALIASES[need])}"
                + (f" and the names of {names.label}" if names is not None else "")
                + f"; columns present: {', '.join(repr(c) for c in df.columns)})"
                + ("; name it with --loss-col or --metric-names" if need == "loss" else "")
            )
    _numeric(df, "step", path, allow_missing=False)
    # A NaN/inf loss is data (the monitor flags it); an empty loss cell in a CSV is read as NaN too.
    _numeric(df, "loss", path, allow_missing=True)
    for c in df.columns:
        if c in ("step", "loss"):
            continue
        if c in ALIASES or df[c].dtype.kind in "biuf":
            num = pd.to_numeric(df[c], errors="coerce")
            if c in ALIASES or num.notna().sum() >= df[c].notna().sum():
                df[c] = num.astype(np.float64)
    steps = df["step"].to_numpy()
    if (steps < 0).any() or (np.abs(steps - np.round(steps)) > 0).any():
        r = int(np.flatnonzero((steps < 0) | (np.abs(steps - np.round(steps)) > 0))[0])
        raise MetricsError(f"{path}: column 'step' row {r + 1}: {steps[r]:g} is not a non-negative whole number")
    df["step"] = df["step"].astype(np.int64)
    df = df.drop_duplicates("step", keep="last").sort_values("step", kind="stable").reset_index(drop=True)
    if names is not None:
        df.attrs["first_step"] = names.first_step  # the stack's step count (see MetricNames.first_step)
    return df


def first_step(df: pd.DataFrame) -> int:
    """The step number the frame's stack gives its first step (0 unless a metric-name map says)."""
    return int(df.attrs.get("first_step") or 0)


def tokens_from_spec(df: pd.DataFrame, spec: Any) -> pd.DataFrame:
    """Add `tokens` (seen after each step) from the spec's batch x sequence schedule when the run
    logged steps only. Steps count from 0 (this project) or 1 (a stack whose first logged step is
    1 counts steps done), so tokens = (step + offset) x tokens per step, with the ungated context
    stages of the spec (they keep tokens per step at batch_size x seq_len, rounded as the engines
    do)."""
    if "tokens" in df.columns and np.isfinite(df["tokens"].to_numpy(dtype=np.float64)).any():
        return df
    d = spec.data
    total = spec.total_steps
    starts = sorted((int(c.start_frac * total), c.seq_len) for c in d.context_stages if not c.gated)
    steps = df["step"].to_numpy(dtype=np.int64)
    # steps done after each record: known where a metric-name map gave the stack's first step, else
    # guessed from the first record (0: this project's count)
    if df.attrs.get("first_step") is not None:
        done = steps - first_step(df) + 1
    else:
        done = steps + (1 if len(steps) and steps.min() == 0 else 0)
    # tokens after `done` steps: the base tokens per step until each stage, each stage's after
    bounds = [(0, d.seq_len)] + starts
    tok = np.zeros(len(done), dtype=np.float64)
    for i, (start, seq) in enumerate(bounds):
        end = bounds[i + 1][0] if i + 1 < len(bounds) else None
        per = max(1, d.batch_size * d.seq_len // seq) * seq
        n = np.clip(done - start, 0, None if end is None else end - start)
        tok += n * per
    df = df.copy()
    df["tokens"] = tok
    return df


def frame_tokens_per_step(df: pd.DataFrame) -> float | None:
    """Tokens per step the metrics imply (the tokens column's slope over steps), or None."""
    if "tokens" not in df.columns:
        return None
    ok = df[np.isfinite(df["tokens"].to_numpy(dtype=np.float64))]
    if len(ok) < 2:
        return None
    a, b = ok.iloc[0], ok.iloc[-1]
    return float(b["tokens"] - a["tokens"]) / float(b["step"] - a["step"])


# ---- which run: a run dir, a metrics file, or a spec id in the ledger -------------------------

SPEC_FILES = ("spec.yaml", "spec.yml", "spec.json")


@dataclass
class RunRef:
    """Where a run's metrics are, and what is known about its spec."""

    label: str
    metrics_path: Path
    run_dir: Path | None = None
    spec: Any = None  # core.spec.Spec, when the run dir holds its spec file
    spec_id: str | None = None  # from the spec file, a checkpoint's state.json or status.json

    def status(self) -> dict:
        if self.run_dir is None:
            return {}
        p = self.run_dir / "status.json"
        try:
            return json.loads(p.read_text()) if p.exists() else {}
        except json.JSONDecodeError:
            return {}  # being replaced right now; the next read sees the new file

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the run dir (oldest first)."""
        if self.run_dir is None:
            return []
        out = []
        for d in list_checkpoints(self.run_dir):
            try:
                out.append(int(d.name.split("_", 1)[1]))
            except (IndexError, ValueError):
                continue
        return sorted(out)


def _parent_dir(run_dir: Path, parent_id: str | None) -> Path | None:
    """The run dir a continuation was seeded from: the `initialised_from` of a kept checkpoint
    (engines.checkpoint.init_from_checkpoint records it), else the parent's spec id in the ledger
    the run dir sits in (<root>/runs/<experiment>/<name>-<id>)."""
    for ck in list_checkpoints(run_dir):
        try:
            src = json.loads((ck / "state.json").read_text()).get("initialised_from")
        except (OSError, ValueError):
            continue
        if src:
            return Path(src).parent.parent
    if parent_id and run_dir.parent.parent.name == "runs":
        try:
            return _ledger_run_dir(parent_id, run_dir.parent.parent.parent)
        except MetricsError:
            return None
    return None


def ancestor_checkpoints(run_dir: str | Path | None, spec: Any, depth: int = 8) -> list[tuple[int, Path, str]]:
    """Kept checkpoints of the runs this one continues (spec.lineage: parent_id from resume_step),
    each strictly before the step its child resumed from, as (step, the ancestor's run dir, its spec
    id), newest first. A parent whose run dir holds another spec id than the lineage names is not
    followed. [] for a run that continues nothing or whose parent is not found."""
    out: list[tuple[int, Path, str]] = []
    if run_dir is None or spec is None:
        return out
    d, seen = Path(run_dir), {Path(run_dir).resolve()}
    for _ in range(depth):
        lin = spec.lineage
        if lin.parent_id is None or lin.resume_step is None:
            break
        parent = _parent_dir(d, lin.parent_id)
        if parent is None or not parent.is_dir() or parent.resolve() in seen:
            break
        pspec, pid = _run_dir_facts(parent)
        if pid != lin.parent_id:
            break
        for ck in reversed(list_checkpoints(parent)):
            step = int(ck.name[5:])
            if step < lin.resume_step:
                out.append((step, parent, pid))
        if pspec is None:
            break
        d, spec = parent, pspec
        seen.add(parent.resolve())
    return out


def _run_dir_facts(run_dir: Path) -> tuple[Any, str | None]:
    spec = None
    for name in SPEC_FILES:
        if (run_dir / name).exists():
            spec = load_spec(run_dir / name)
            return spec, spec.id
    sid = None
    st = run_dir / "status.json"
    if st.exists():
        try:
            sid = json.loads(st.read_text()).get("spec_id")
        except json.JSONDecodeError:
            pass
    ck = run_dir / "checkpoints"
    if sid is None and ck.is_dir():
        for d in sorted(ck.glob("step_*"), reverse=True):
            try:
                sid = json.loads((d / "state.json").read_text()).get("spec_id")
                break
            except (OSError, json.JSONDecodeError):
                continue
    return spec, sid


def _ledger_run_dir(run_id: str, root: str | Path | None) -> Path | None:
    """The run dir of a spec id (or a unique prefix of one, or a spec name) under a ladder root's
    runs/<experiment>/<name>-<id>/ (root: --root, else $MOE_LADDER_ROOT, else ./.ladder); None if unknown."""
    base = Path(root or env.text("ROOT") or ".ladder").expanduser() / "runs"
    if not base.is_dir():
        return None
    dirs = [rd.path for rd in iter_run_dirs(base)]
    by_id = [(d.name.rpartition("-")[2], d) for d in dirs]
    hits = [(sid, d) for sid, d in by_id if sid == run_id]
    if not hits and len(run_id) >= 6:
        hits = [(sid, d) for sid, d in by_id if sid.startswith(run_id)]
    if not hits:
        hits = [(sid, d) for sid, d in by_id if d.name.rpartition("-")[0] == run_id]
    if len({sid for sid, _ in hits}) > 1:
        raise MetricsError(f"run id {run_id!r} is ambiguous in the ledger: {', '.join(sorted({sid for sid, _ in hits}))}")
    return hits[-1][1] if hits else None


def resolve_run(run: str | None = None, metrics: str | Path | None = None, root: str | Path | None = None) -> RunRef:
    """RUN_ID (a run dir, a metrics file, or a spec id in the ledger) or --metrics FILE -> RunRef."""
    if (run is None) == (metrics is None):
        raise MetricsError("give either a RUN_ID (spec id or run dir) or --metrics FILE, not both or neither")
    if metrics is not None:
        path = resolve_metrics_path(metrics)
        run_dir = path.parent if path.name == METRICS_FILE else (Path(metrics) if Path(metrics).is_dir() else None)
        spec, sid = _run_dir_facts(run_dir) if run_dir is not None else (None, None)
        return RunRef(str(metrics), path, run_dir, spec, sid)
    p = Path(run)
    if p.is_dir():
        spec, sid = _run_dir_facts(p)
        return RunRef(run, resolve_metrics_path(p), p, spec, sid)
    if p.is_file():
        return resolve_run(None, p, root)
    run_dir = _ledger_run_dir(run, root)
    if run_dir is None:
        raise MetricsError(
            f"unknown run id {run!r}: not a run directory, not a metrics file, and no run with that spec id "
            "in the ledger"
        )
    spec, sid = _run_dir_facts(run_dir)
    return RunRef(run, resolve_metrics_path(run_dir), run_dir, spec, sid)


# A logged LR that followed the spec's schedule for this many points before it departed is the
# spec's run with a fault in its optimizer (the monitor's lr_off_schedule), not another spec.
LR_AGREED_POINTS = 5


def lr_departure(spec: Any, df: pd.DataFrame) -> dict[str, Any] | None:
    """Where the logged LR first departs from the spec's schedule (from its lineage.resume_step on:
    the records before it are the parent's), or None: {step (as shown), index, lr, schedule,
    agreed_before (checked points that agreed before it)}. Exports from elsewhere may log the LR a
    step early or late, or in float32: those agree."""
    if "lr" not in df.columns:
        return None
    shown = df["step"].to_numpy()
    steps = shown - first_step(df)
    lr = df["lr"].to_numpy(dtype=np.float64)
    ok = np.isfinite(lr) & (steps >= (spec.lineage.resume_step or 0)) & (steps >= 0)
    want = lr_at(spec, np.maximum(steps, 0))
    bad = ok & ~np.isclose(lr, want, rtol=1e-3, atol=1e-12)
    for shift in (-1, 1):
        bad &= ~np.isclose(lr, lr_at(spec, np.maximum(steps + shift, 0)), rtol=1e-3, atol=1e-12)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return {"step": int(shown[i]), "index": i, "lr": float(lr[i]), "schedule": float(want[i]),
            "agreed_before": int(np.sum(ok[:i]))}


def check_spec_matches(spec: Any, df: pd.DataFrame, ref: RunRef | None = None) -> None:
    """Raise MetricsError when `spec` is not the spec the metrics came from: another spec id in the
    run dir, an LR column that is not this spec's schedule from its first points (from its
    lineage.resume_step on: the records before it are the parent's; an LR that followed the
    schedule for LR_AGREED_POINTS points and then left it is a fault of the run, which the monitor
    flags), tokens per step that differ, or steps past its end."""
    import numpy as np

    origin = ref.label if ref else "the run"
    if ref is not None and ref.spec_id and ref.spec_id != spec.id:
        raise MetricsError(
            f"spec {spec.name!r} (id {spec.id}) is not the run's: {origin} was trained from spec id {ref.spec_id}"
        )
    shown = df["step"].to_numpy()
    first = first_step(df)
    steps = shown - first  # this project's count: the stack's first step is step 0
    if len(steps) and steps[-1] >= spec.total_steps:
        raise MetricsError(
            f"spec {spec.name!r} (id {spec.id}) is not the run's: {origin} has step {shown[-1]} but the spec "
            f"ends at step {spec.total_steps - 1 + first}" + (f" (its steps counted from {first})" if first else "")
        )
    dep = lr_departure(spec, df)
    if dep is not None and dep["agreed_before"] < LR_AGREED_POINTS:
        raise MetricsError(
            f"spec {spec.name!r} (id {spec.id}) is not the run's: at step {dep['step']} {origin} logged lr "
            f"{dep['lr']:.6g} but the spec's schedule gives {dep['schedule']:.6g}"
        )
    tps = frame_tokens_per_step(df)
    if tps is not None and abs(tps - spec.data.tokens_per_step) > 1e-6 * spec.data.tokens_per_step:
        raise MetricsError(
            f"spec {spec.name!r} (id {spec.id}) is not the run's: {origin} has {tps:g} tokens per step, "
            f"the spec {spec.data.tokens_per_step}"
        )
