"""`ladder calibrate`: the monitor's calibration from the healthy replicates a ladder already trains
(the hero's finished runs at other seeds), made against the experiment's forecast and written beside
it as calibration.json, where `ladder compare --forecast` finds it. bench/faults.py calibrates with
the same function (analysis.monitor.calib.calibrate)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from analysis.monitor.calib import calibrate
from analysis.monitor.flags import MonitorSettings
from analysis.monitor.watch import load_forecast
from analysis.runs.replicates import family_key
from ladder.commands.forecast import analysis_dir, finished_runs
from ladder.errors import LadderError
from ladder.experiment import load_experiment
from ladder.ledger import ladder_root

CALIBRATION_FILE = "calibration.json"


def healthy_replicate_specs(exp) -> list:
    """The experiment's specs that differ from its hero only in the seed (the hero left out)."""
    if exp.hero is None:
        return []
    key = family_key(exp.hero)
    return [s for s in exp.all_specs() if s is not exp.hero and s.name != exp.hero.name and family_key(s) == key]


def healthy_replicates(root: Path, exp) -> list[tuple[str, object, object]]:
    """(name, metrics frame, spec) of every finished run of the experiment that differs from its hero
    only in the seed (the hero itself among them)."""
    done, _ = finished_runs(root, exp, [exp.hero, *healthy_replicate_specs(exp)])
    return [(spec.name, frame, spec) for spec, _, frame in done]


def calibrate_cmd(
    experiment: str = typer.Argument(..., help="experiment file whose hero's replicates are the healthy runs"),
    root: Optional[str] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    forecast: Optional[str] = typer.Option(None, "--forecast", help="the forecast to calibrate against (default: "
                                           "the experiment's forecast.json)"),
    settings_path: Optional[str] = typer.Option(None, "--settings", help="YAML of monitor thresholds"),
) -> None:
    """The monitor's calibration from the hero's finished replicates, written beside the forecast."""
    exp = load_experiment(experiment)
    if exp.hero is None:
        raise LadderError(f"{experiment}: the experiment has no hero to calibrate the monitor for")
    r = ladder_root(root)
    fc_path = Path(forecast) if forecast else analysis_dir(r, exp.name) / "forecast.json"
    if not fc_path.exists():
        raise LadderError(f"{fc_path}: no forecast to calibrate against (run `ladder forecast {experiment}` first)")
    fc = load_forecast(str(fc_path))
    runs = healthy_replicates(r, exp)
    if len(runs) < 2:
        raise LadderError(f"a calibration needs at least 2 finished runs of the hero's spec at different seeds, found "
                          f"{len(runs)} ({', '.join(n for n, _, _ in runs) or 'none'}): declare replicates "
                          f"(ladder.experiment.replicate) and train them (`ladder submit {experiment} --only '^{exp.hero.name}'`)")
    s = MonitorSettings.load(settings_path, {})
    cal = calibrate(runs, exp.hero.total_steps, fc, spike_window=s.spike_local_window,
                    spike_min_history=s.spike_min_history, spike_sigma=s.spike_sigma,
                    throughput_points=s.throughput_points)
    path = cal.save(fc_path.parent / CALIBRATION_FILE)
    Console().print(f"calibrated the monitor on {len(runs)} healthy runs ({', '.join(n for n, _, _ in runs)}) "
                    f"against {fc_path}: {len(cal.series)} series, early transient to step {cal.transient_end_step}; "
                    f"wrote {path} (`ladder compare RUN --forecast {fc_path}` uses it)", highlight=False, soft_wrap=True)
    if len(runs) < 3:
        Console().print(f"[yellow]{len(runs)} healthy runs leave none out to measure the band's width: it is widened by the "
                        f"t distribution of their few degrees of freedom, so only gross departures warn; train a third seed "
                        f"(ladder.experiment.replicate) for a band that catches subtler ones[/yellow]", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)
