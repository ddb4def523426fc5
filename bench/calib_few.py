"""Healthy false alarms of the monitor calibrated on few healthy runs.

    .venv/bin/python bench/calib_few.py RUN_DIR RUN_DIR RUN_DIR ... [--forecast forecast.json] \
        [--sizes 2,3] [--out DIR]

The run directories are healthy replicates of one spec (full runs at other seeds, as
`bench/faults.py --healthy-runs` takes them, or the suite's OUT/runs/healthy_seed*). For each size R
in `--sizes`, each run is judged by the monitor (its final report over the whole run, with the
run's status) against a calibration (analysis.monitor.calib) from every choice of R of the other
runs: with four runs, R = 2 is 4 x 3 = 12 cases and R = 3 is 4 (leave one out). A warning or
critical on a healthy run is a false alarm; the stated rate is the monitor's false_alarm_rate a run.
The table (OUT/calib_few.md, every flag in OUT/calib_few.json) lists each case's warnings and
criticals, and per size the share of cases with one.

With `--faults RUN_DIR ...` (the fault suite's OUT/runs/<fault>) each fault run is judged too,
against a calibration from every choice of R of all the healthy runs: per fault and size, in how
many of those calibrations it raised a warning or critical at or after its onset (its fault.txt:
"<name> from step N"), and the earliest and latest first such step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.forecast.file import Forecast, load_forecast
from analysis.monitor.calib import calibrate
from analysis.monitor.watch import MonitorSettings, monitor
from analysis.runs.metrics import read_metrics_frame
from core.fsutil import atomic_write_text
from core.rundir import RunDir
from core.spec import Spec, load_spec

__all__ = ["judge_faults", "judge_few", "main"]


def _load(dirs: list[Path]) -> list[tuple[str, pd.DataFrame, Spec, dict]]:
    runs = []
    for d in dirs:
        spec = load_spec(d / "spec.yaml")
        runs.append((f"seed{spec.seed}", read_metrics_frame(d), spec, RunDir(d).read_status()))
    ids = {spec.replace(seed=runs[0][2].seed, name=runs[0][2].name).id for _, _, spec, _ in runs}
    if len(ids) != 1:
        raise ValueError("the runs are not replicates of one spec (their specs differ beyond the seed)")
    return runs


def judge_few(runs: list[tuple[str, pd.DataFrame, Spec, dict]], sizes: tuple[int, ...], forecast: Forecast | None,
              settings: MonitorSettings | None = None, log=print) -> list[dict[str, Any]]:
    """One row per (size, judged run, calibrating runs): the judged run's warnings and criticals."""
    settings = settings or MonitorSettings()
    total = runs[0][2].total_steps
    rows = []
    for R in sizes:
        for i, (name, df, spec, status) in enumerate(runs):
            others = [j for j in range(len(runs)) if j != i]
            for chosen in itertools.combinations(others, R):
                cal = calibrate([runs[j][:3] for j in chosen], total, forecast, spike_window=settings.spike_local_window,
                                spike_min_history=settings.spike_min_history, spike_sigma=settings.spike_sigma,
                                throughput_points=settings.throughput_points)
                rep = monitor(df, spec, forecast, settings, status=status, calibration=cal, plan_tokens_per_s=None)
                loud = [{"kind": f.kind, "severity": f.severity, "step": f.first_step,
                         "text": f.evidence.get("text", "")} for f in rep.flags if f.severity != "info"]
                rows.append({"R": R, "run": name, "calibrated_on": [runs[j][0] for j in chosen], "loud": loud,
                             "widen": {k: s.widen for k, s in cal.series.items()},
                             "dof": {k: s.dof for k, s in cal.series.items()}})
                log(f"R={R} {name} <- {'+'.join(runs[j][0] for j in chosen)}: "
                    + (", ".join(f"{f['kind']} ({f['severity']}) @{f['step']}" for f in loud) or "none"))
    return rows


def _onset(d: Path) -> int:
    try:
        return int((d / "fault.txt").read_text().rsplit("from step", 1)[1].split()[0])
    except (OSError, IndexError, ValueError):
        return 0


def judge_faults(runs: list[tuple[str, pd.DataFrame, Spec, dict]], faults: list[Path], sizes: tuple[int, ...],
                 forecast: Forecast | None, settings: MonitorSettings | None = None, log=print) -> list[dict[str, Any]]:
    """One row per (size, fault run): the first warning or critical step (at or after the onset)
    against each calibration from R of the healthy runs (None: not flagged)."""
    settings = settings or MonitorSettings()
    total = runs[0][2].total_steps
    loaded = [(d.name, read_metrics_frame(d), load_spec(d / "spec.yaml"), RunDir(d).read_status(), _onset(d))
              for d in faults]
    rows = []
    for R in sizes:
        firsts: dict[str, list] = {name: [] for name, *_ in loaded}
        for chosen in itertools.combinations(range(len(runs)), R):
            cal = calibrate([runs[j][:3] for j in chosen], total, forecast, spike_window=settings.spike_local_window,
                            spike_min_history=settings.spike_min_history, spike_sigma=settings.spike_sigma,
                            throughput_points=settings.throughput_points)
            for name, df, spec, status, onset in loaded:
                rep = monitor(df, spec, forecast, settings, status=status, calibration=cal, plan_tokens_per_s=None)
                loud = sorted((f.first_step, f.kind, f.severity) for f in rep.flags
                              if f.severity != "info" and f.first_step >= onset)
                firsts[name].append(loud[0] if loud else None)
        for name, *_, onset in loaded:
            got = [x for x in firsts[name] if x is not None]
            rows.append({"R": R, "fault": name, "onset": onset, "cases": len(firsts[name]), "caught": len(got),
                         "first": [list(x) if x else None for x in firsts[name]]})
            log(f"R={R} {name}: caught in {len(got)} of {len(firsts[name])}"
                + (f", first at {min(got)[0]}-{max(got)[0]}" if got else ""))
    return rows


def markdown(rows: list[dict[str, Any]], rate: float) -> str:
    lines = [f"Stated false-alarm rate {rate:g} a run.", "", "| R | judged | calibrated on | warnings or criticals |",
             "|---|---|---|---|"]
    for r in rows:
        loud = ", ".join(f"{f['kind']} ({f['severity']}) @{f['step']}" for f in r["loud"]) or "none"
        lines.append(f"| {r['R']} | {r['run']} | {' + '.join(r['calibrated_on'])} | {loud} |")
    lines += ["", "| R | cases | cases with a warning or critical |", "|---|---|---|"]
    for R in sorted({r["R"] for r in rows}):
        of = [r for r in rows if r["R"] == R]
        lines.append(f"| {R} | {len(of)} | {sum(bool(r['loud']) for r in of)} |")
    return "\n".join(lines) + "\n"


def faults_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| R | fault | onset | calibrations that flag it (warning or critical) | first flagged at (earliest-latest) |",
             "|---|---|---|---|---|"]
    for r in rows:
        got = [x[0] for x in r["first"] if x]
        lines.append(f"| {r['R']} | {r['fault']} | {r['onset']} | {r['caught']} of {r['cases']} | "
                     + (f"{min(got)}-{max(got)} |" if got else "- |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories of healthy replicates of one spec")
    p.add_argument("--forecast", default=None)
    p.add_argument("--sizes", default="2,3", help="how many healthy runs calibrate (comma-separated)")
    p.add_argument("--faults", nargs="*", default=[], help="fault run directories judged against calibrations "
                   "from R of all the healthy runs")
    p.add_argument("--out", default=None, help="write calib_few.md and calib_few.json here")
    a = p.parse_args(argv)
    runs = _load([Path(d) for d in a.runs])
    sizes = tuple(int(s) for s in a.sizes.split(",") if s.strip())
    if any(s < 2 or s > len(runs) - 1 for s in sizes):
        p.error(f"--sizes must lie in 2..{len(runs) - 1} (the runs other than the judged one)")
    if a.faults and any(not (Path(d) / "spec.yaml").exists() for d in a.faults):
        p.error("--faults takes run directories (each with its spec.yaml)")
    settings = MonitorSettings()
    rows = judge_few(runs, sizes, load_forecast(a.forecast) if a.forecast else None, settings)
    text = markdown(rows, settings.false_alarm_rate)
    fault_rows = []
    if a.faults:
        fault_rows = judge_faults(runs, [Path(d) for d in a.faults], sizes, load_forecast(a.forecast) if a.forecast
                                  else None, settings)
        text += "\n" + faults_markdown(fault_rows)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "calib_few.md", text)
        atomic_write_text(out / "calib_few.json", json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                                                 "faults": fault_rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
