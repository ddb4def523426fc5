"""`ladder compare`: a live run (or any exported loss curve) against its forecast, with flags.

Exit status by the worst severity raised, so it can gate a cron job: 0 none or info, 1 warning,
3 critical; 2 on bad input. With --follow each new flag, and each escalation of a flag to a
higher severity, is printed once, when it happens, with its step; --quiet prints only those of
warning or critical severity (and errors), nothing else.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table
from analysis.runs.names import load_metric_names
from analysis.runs.metrics import check_spec_matches, tokens_from_spec
from analysis.monitor.comparison import Comparison
from analysis.monitor.watch import SEVERITY_RANK, MonitorSettings, load_calibration, load_forecast, monitor
from core.errors import InputError
from core.spec import load_spec

EXIT_WARNING = 1
EXIT_CRITICAL = 3
EXIT_BY_SEVERITY = {None: 0, "info": 0, "warning": EXIT_WARNING, "critical": EXIT_CRITICAL}
TERMINAL_STATES = ("finished", "diverged", "failed")
SEVERITY_STYLE = {"info": "blue", "warning": "yellow", "critical": "bold red"}


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """["band_k=5", "drop_budget=0.05"] -> {"band_k": "5", ...} (pydantic casts the values)."""
    out: dict[str, Any] = {}
    for p in pairs or []:
        if "=" not in p:
            raise InputError(f"--set {p!r}: expected NAME=VALUE, e.g. --set grad_norm_warn=1.5")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def open_inputs(run: str | None, metrics: str | None, spec_path: str | None, root: str | None,
                loss_col: str | None, tracking_uri: str | None = None, metric_names: str | None = None):
    """(source, frame, spec): the run's metrics through its source (a run dir, a file, MLflow or W&B),
    and its spec (--spec, else the run's own: its run dir's spec.yaml, or the spec artifact of an
    MLflow run this project logged)."""
    from analysis.runs.sources import FileSource, open_source

    names = load_metric_names(metric_names)
    src = open_source(run, metrics, root=root, tracking_uri=tracking_uri, names=names,
                      columns={"loss": loss_col} if loss_col else None)
    df = src.read()
    spec = load_spec(spec_path) if spec_path else src.spec
    if spec is not None:
        df = tokens_from_spec(df, spec)
        check_spec_matches(spec, df, src.ref if isinstance(src, FileSource) else None)
    return src, df, spec


def load_inputs(run: str | None, metrics: str | None, spec_path: str | None, root: str | None,
                loss_col: str | None, tracking_uri: str | None = None, metric_names: str | None = None):
    """(ref, frame, spec) for a run dir or metrics file; (source, frame, spec) for an MLflow run."""
    from analysis.runs.sources import FileSource

    src, df, spec = open_inputs(run, metrics, spec_path, root, loss_col, tracking_uri, metric_names)
    return (src.ref if isinstance(src, FileSource) else src), df, spec


def render(report, console: Console, title: str) -> None:
    s = report.summary
    t = Table(title=title, header_style="bold", show_lines=False)
    for col in ("severity", "kind", "first step", "evidence"):
        t.add_column(col, overflow="fold")
    for f in report.flags:
        t.add_row(f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/]", f.kind, str(f.first_step), f.evidence.get("text", ""))
    if not report.flags:
        t.add_row("[green]ok[/]", "-", "-", "no flags")
    console.print(t)
    bits = [f"step {s.get('step')}"]
    if s.get("total_steps"):
        bits[0] += f"/{s['total_steps']}"
    if isinstance(s.get("loss_smoothed"), float):
        bits.append(f"loss {s['loss_smoothed']:.4f}")
    if isinstance(s.get("forecast_loss"), float):
        bits.append(f"forecast {s['forecast_loss']:.4f} [{s['band_lo']:.4f}, {s['band_hi']:.4f}]")
    if isinstance(s.get("grad_norm"), float):
        bits.append(f"grad norm {s['grad_norm']:.3g}")
    if isinstance(s.get("drop_frac"), float):
        bits.append(f"drops {s['drop_frac']:.1%}")
    if isinstance(s.get("tokens_per_s"), float):
        bits.append(f"{s['tokens_per_s']:,.0f} tokens/s")
    if s.get("projected_finish"):
        bits.append(f"projected finish {s['projected_finish']}")
    console.print(", ".join(bits), highlight=False)


class Announcer:
    """Prints each flag kind once when it first appears and once more at each escalation."""

    def __init__(self, console: Console, quiet: bool):
        self.console, self.quiet = console, quiet
        self.said: dict[str, str] = {}  # kind -> the highest severity printed

    def __call__(self, report) -> None:
        for f in sorted(report.flags, key=lambda f: (f.first_step, -SEVERITY_RANK[f.severity])):
            before = self.said.get(f.kind)
            if before is not None and SEVERITY_RANK[f.severity] <= SEVERITY_RANK[before]:
                continue
            self.said[f.kind] = f.severity
            if self.quiet and f.severity == "info":
                continue
            word = "new" if before is None else f"escalated from {before}"
            step = f.evidence.get("critical_step") if before is not None and f.severity == "critical" else None
            self.console.print(f"[{SEVERITY_STYLE[f.severity]}]{f.severity}[/] {f.kind} @ step "
                               f"{step if step is not None else f.first_step} ({word}): {f.evidence.get('text', '')}",
                               highlight=False, soft_wrap=True)  # one alert, one line


def beside_forecast(forecast_path: Path, fc) -> tuple[object | None, str | None]:
    """(the calibration.json beside a forecast file, made against that forecast; what to tell the user)."""
    path = forecast_path.parent / "calibration.json"
    if not path.exists():
        return None, None
    cal = load_calibration(path)
    try:
        cal.check_forecast(fc, where=str(path))
    except ValueError as e:
        return None, f"not using {path}: {e}"
    return cal, f"calibration: {path} ({len(cal.runs)} healthy runs: {', '.join(r.name for r in cal.runs)})"


def compare_cmd(
    run: Optional[str] = typer.Argument(None, help="spec id in the ledger, a run directory, mlflow:RUN_ID, wandb:DIR "
                                        "(a W&B run directory) or wandb:ENTITY/PROJECT/RUN_ID"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="metrics.jsonl or an exported CSV (step, loss, ...)"),
    forecast: Optional[str] = typer.Option(None, "--forecast", help="forecast.json from `ladder forecast`"),
    calibration: Optional[str] = typer.Option(
        None, "--calibration", help="calibration.json from `ladder calibrate` or bench/faults.py (healthy replicates): "
        "the band and the sequential test's spread per stretch of training (default: the calibration.json beside "
        "--forecast, when it was made against that forecast)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only warnings and criticals (for CI and cron); "
                               "the exit status says the worst severity"),
    spec_path: Optional[str] = typer.Option(None, "--spec", help="the run's spec (default: the run's own spec.yaml)"),
    follow: bool = typer.Option(False, "--follow", help="re-read as the run grows until it finishes"),
    interval: float = typer.Option(10.0, "--interval", help="seconds between reads with --follow"),
    max_wait: Optional[float] = typer.Option(None, "--max-wait", help="stop following after this many seconds"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    png: Optional[str] = typer.Option(None, "--png", help="write the live curve over the forecast band here"),
    settings_path: Optional[str] = typer.Option(None, "--settings", help="YAML of monitor thresholds"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="threshold override NAME=VALUE (repeatable)"),
    tokens_per_s: Optional[float] = typer.Option(None, "--tokens-per-s", help="planned throughput"),
    loss_col: Optional[str] = typer.Option(None, "--loss-col", help="the CSV's loss column, if not a usual name"),
    metric_names: Optional[str] = typer.Option(
        None, "--metric-names", help="the stack's metric names: olmo-core, levanter, marin, torchtitan, or a YAML map"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI of an mlflow:RUN_ID"),
    root: Optional[str] = typer.Option(None, "--root", help="ledger root (default: the ledger's own)"),
) -> None:
    """Flag where a run leaves its forecast: band, spikes, grad norm, drops, router entropy, NaN, throughput."""
    from analysis.monitor.plot import plot_report

    settings = MonitorSettings.load(settings_path, parse_overrides(overrides))
    fc = load_forecast(forecast) if forecast else None
    cal = load_calibration(calibration) if calibration else None
    if cal is not None:
        cal.check_forecast(fc, where=str(calibration))
    elif forecast:  # `ladder calibrate` writes calibration.json beside the forecast it was made against
        cal, said = beside_forecast(Path(forecast), fc)
        if said:
            Console(stderr=True).print(said, style="dim", highlight=False, soft_wrap=True)
    if tokens_per_s is not None and tokens_per_s <= 0:
        raise InputError(f"--tokens-per-s must be positive (got {tokens_per_s})")
    if interval <= 0:
        raise InputError(f"--interval must be positive (got {interval})")
    console = Console(stderr=as_json) if sys.stdout.isatty() or as_json else Console(width=160)
    start = time.monotonic()
    while True:
        try:
            src, df, spec = open_inputs(run, metrics, spec_path, root, loss_col, tracking_uri, metric_names)
            break
        except ValueError as e:
            # --follow on a run that has not logged yet: wait for its first records
            waiting = follow and any(w in str(e) for w in ("no metrics.jsonl", "no metric records", "no step with a loss",
                                                           "no metric this project reads", "no such W&B run directory",
                                                           "no run-<id>.wandb here"))
            if not waiting or (max_wait is not None and time.monotonic() - start >= max_wait):
                raise
            if not quiet:
                console.print(f"[dim]waiting for the run's first metrics ({e})[/]", highlight=False)
            time.sleep(interval)
    announce = Announcer(console, quiet)
    last_step = None
    while True:
        with np.errstate(all="ignore"):  # NaN and inf points are flags, not numpy's warnings on stderr
            report = monitor(df, spec, fc, settings, plan_tokens_per_s=tokens_per_s, status=src.status(),
                             calibration=cal)
        if follow:
            announce(report)
            state = src.status().get("state")
            if not quiet and report.summary.get("step") != last_step:
                console.print(f"[dim]step {report.summary.get('step')} ({state or 'no status'})[/]", highlight=False)
            last_step = report.summary.get("step")
            done = state in TERMINAL_STATES
            timed_out = max_wait is not None and time.monotonic() - start >= max_wait
            if not (done or timed_out):
                time.sleep(interval)
                try:
                    df = src.read()
                except ValueError as e:  # a tracking server restarting: keep the last frame, try again
                    console.print(f"[dim]{e}; trying again in {interval:g} s[/]", highlight=False)
                    continue
                if spec is not None:
                    df = tokens_from_spec(df, spec)
                continue
        break
    if png:
        with np.errstate(all="ignore"):
            plot_report(df, report, fc, png, title=f"{src.label}: worst flag {report.worst or 'none'}")
    if as_json:
        print(Comparison.of(src.label, src.describe(), report, str(Path(png)) if png else None).text())
    elif quiet:
        if not follow:
            Announcer(console, quiet)(report)
    else:
        render(report, console, f"compare: {src.label}")
        if png:
            console.print(f"plot: {png}", soft_wrap=True, highlight=False)
    code = EXIT_BY_SEVERITY[report.worst]
    if code:
        # SystemExit, not typer.Exit: the CLI runs click with standalone_mode=False, which turns an
        # Exit into a return value and loses its code.
        raise SystemExit(code)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare_cmd)
