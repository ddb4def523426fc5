"""`ladder demo`: the main job, as the commands a user would type, one after another:
submit the rungs and the hero's replicates (its spec at other seeds, the experiment's extras),
forecast the hero, calibrate the monitor on the replicates, train the hero while `compare --follow`
watches it (with the calibration beside the forecast), replan it as if its deadline were cut, and
write the report."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from analysis.monitor.comparison import Comparison, ComparisonError, write_comparison
from analysis.replan.file import read_replan, write_replan_json
from ladder.commands.calibrate import healthy_replicate_specs
from ladder.commands.forecast import analysis_dir
from ladder.experiment import load_experiment
from ladder.ledger import is_finished, ladder_root, last_metrics, run_dir_for
from ladder.tracking import experiment_id, ui_url

console = Console()


def _ladder(*args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    console.print(f"\n[bold cyan]$ ladder {' '.join(shlex.quote(a) for a in args)}[/bold cyan]", soft_wrap=True)
    cmd = [sys.executable, "-m", "ladder.cli", *args]
    out = subprocess.run(cmd, text=True, capture_output=capture)
    if check and out.returncode != 0:
        raise typer.Exit(out.returncode)
    return out


def _steps_done(run_dir: Path) -> int:
    last = last_metrics(run_dir)
    return -1 if last is None else int(last["step"])


def demo_cmd(
    experiment: str = typer.Argument("experiments/proxy_cpu.py", help="experiment file"),
    out: str = typer.Option("report", "--out", help="report directory"),
    cut: float = typer.Option(0.6, "--cut", help="the replan's deadline as a share of the hero's projected time left"),
) -> None:
    """Train the ladder, forecast, train and watch the hero, replan it, and write the report."""
    t0 = time.time()
    exp = load_experiment(experiment)
    root = ladder_root()
    adir = analysis_dir(root, exp.name)
    adir.mkdir(parents=True, exist_ok=True)
    hero = exp.hero
    hero_dir = run_dir_for(root, exp.name, hero)
    fc = str(adir / "forecast.json")

    _ladder("plan", experiment)
    _ladder("submit", experiment)
    replicates = [s.name for s in healthy_replicate_specs(exp)]
    if replicates:
        _ladder("submit", experiment, "--only", "^(" + "|".join(map(re.escape, replicates)) + ")$")
    _ladder("forecast", experiment)
    if len(replicates) >= 2:
        _ladder("calibrate", experiment)

    hero_was_done = is_finished(hero_dir, hero)
    log = open(adir / "hero_submit.log", "a")
    console.print(f"\n[bold cyan]$ ladder submit {experiment} --only '^{hero.name}$'[/bold cyan]  (in the background, log: {log.name})")
    proc = subprocess.Popen([sys.executable, "-m", "ladder.cli", "submit", experiment, "--only", f"^{hero.name}$"],
                            stdout=log, stderr=subprocess.STDOUT)
    if not hero_was_done:
        # replan while the horizon may still change (the first quarter of the budget)
        target = max(2, int(0.15 * hero.total_steps))
        while _steps_done(hero_dir) < target and proc.poll() is None:
            time.sleep(1.0)

        last = last_metrics(hero_dir) or {}
        tps = float(last.get("tokens_per_s") or 1.0)
        left_s = (hero.total_steps - _steps_done(hero_dir)) * hero.data.tokens_per_step / tps
        days = cut * left_s / 86400
        _ladder("replan", str(hero_dir), "--spec", str(hero_dir / "spec.yaml"), "--days", f"{days:.6f}",
                "--forecast", fc, "--out", str(adir / "replan"), check=False)
    _ladder("compare", str(hero_dir), "--forecast", fc, "--follow", "--interval", "5", "--png", str(adir / "compare.png"),
            check=False)
    rc = proc.wait()
    log.close()
    if rc != 0:
        console.print(f"[red]hero submission exited {rc}; see {log.name}[/red]")
    res = _ladder("compare", str(hero_dir), "--forecast", fc, "--json", check=False, capture=True)
    try:
        write_comparison(adir / "compare.json", Comparison.from_dict(json.loads(res.stdout)))
    except json.JSONDecodeError:
        console.print(f"[yellow]compare gave no JSON: {res.stderr.strip()[-300:]}[/yellow]")
    except ComparisonError as e:
        console.print(f"[yellow]compare gave no comparison: {e}[/yellow]")
    replan_doc = read_replan(adir / "replan" / "replan.json")
    if replan_doc is not None:
        write_replan_json(adir / "replan.json", replan_doc)
    _ladder("report", experiment, "--out", out)

    summary = json.loads((Path(out) / "summary.json").read_text())
    console.rule("[bold]demo done")
    console.print(summary["verdict"], highlight=False)
    console.print(f"report:    {(Path(out) / 'index.html').resolve()}", soft_wrap=True, highlight=False)
    db = f"sqlite:///{root / 'mlflow.db'}"
    try:
        link = ui_url("http://127.0.0.1:5000", experiment_id(db, exp.name))
    except Exception:  # no MLflow store (nothing was tracked): the server's front page
        link = "http://127.0.0.1:5000"
    # soft_wrap: a command or URL is never broken across lines, whatever the output's width
    console.print(f"MLflow UI: .venv/bin/mlflow ui --backend-store-uri {db} --host 127.0.0.1 --port 5000"
                  f"  then open {link}", soft_wrap=True, highlight=False, markup=False)
    console.print(f"took {time.time() - t0:.0f} s")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
