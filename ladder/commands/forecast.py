"""`ladder forecast` (fit the ladder, forecast the hero) and `ladder report` (the HTML page)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ladder.errors import LadderError
from ladder.ledger import inside, is_finished, ladder_root, run_dir_for
from analysis.forecast.file import ForecastError, HeroForecast, read_hero_forecast, write_hero_forecast
from analysis.monitor.comparison import read_comparison
from analysis.replan.file import read_replan
from analysis.runs.names import load_metric_names
from analysis.runs.metrics import read_metrics_frame
from core.spec import load_spec
from core import costs
from core.errors import InputError
from core.safeload import InputLimitError
from core.rundir import METRICS_FILE
from ladder.experiment import load_experiment
from analysis.runs.replicates import YardstickError, family_key
from ladder.tracking import log_artifact_to_parent, log_forecast, store_errors


def analysis_dir(root: Path, experiment: str) -> Path:
    """Where an experiment's forecast, comparison and replans live (beside its runs)."""
    return inside(Path(root) / "analysis", experiment)


def read_forecast(path: Path):
    """The forecast.json the report reads (analysis.forecast.file.read_hero_forecast), None when
    absent; a damaged one is a LadderError naming it."""
    if not path.exists():
        return None
    try:
        return read_hero_forecast(path)
    except InputLimitError as err:
        raise LadderError(str(err)) from None
    except ForecastError as err:
        raise LadderError(f"{err}; rerun `ladder forecast`") from None


def check_losses_fall(rungs) -> None:
    """LadderError naming the rungs unless their final losses fall as compute grows (a negative rank
    correlation, the largest rung below the smallest): a law fitted to anything else is no forecast."""
    by_flops = sorted(rungs, key=lambda x: x.flops)
    losses = [x.final_loss for x in by_flops]
    what = ", ".join(f"{x.spec.name} {x.flops:.2g} FLOPs: {x.final_loss:.4g}" for x in by_flops)
    if not all(math.isfinite(v) for v in losses):
        raise LadderError(f"cannot forecast: a rung has no finite final loss ({what})")
    n = len(losses)
    rank = sorted(range(n), key=lambda i: losses[i])
    r = [0] * n
    for k, i in enumerate(rank):
        r[i] = k
    rho = 1 - 6 * sum((i - r[i]) ** 2 for i in range(n)) / (n * (n * n - 1))  # Spearman, compute rank = index
    if rho >= 0 or losses[-1] >= losses[0]:
        raise LadderError(f"cannot forecast: the rungs' final losses do not fall as compute grows ({what}); "
                          f"check their learning rates and token budgets, or rerun the rungs that stand out")


def finished_runs(root: Path, exp, specs) -> tuple[list[tuple], list[str]]:
    """([(spec, run dir, metrics frame)] of the specs whose runs finished, [names of the others])."""
    done, missing = [], []
    for spec in specs:
        d = run_dir_for(root, exp.name, spec)
        if is_finished(d, spec):
            done.append((spec, d, read_metrics_frame(d / METRICS_FILE)))
        else:
            missing.append(spec.name)
    return done, missing


def finished_rungs(root: Path, exp, holdout: str | None = None):
    from analysis.forecast.hero import RungRun

    done, missing = finished_runs(root, exp, exp.rungs)
    rungs = [RungRun(spec, d, frame) for spec, d, frame in done]
    if holdout:
        by_flops = sorted(rungs, key=lambda r: r.flops)
        target = by_flops[-1].spec.name if holdout.upper() == "LAST" and by_flops else holdout
        named = [r for r in rungs if r.spec.name == target]
        if not named:
            raise LadderError(f"--holdout {holdout}: no finished rung named {target!r}")
        family = family_key(named[0].spec)  # its replicates (other seeds) are held out with it
        rungs = [r for r in rungs if family_key(r.spec) != family]
    return rungs, missing


def _refuse_if_strict(fc: HeroForecast, strict: bool) -> None:
    """With --strict, a ladder whose regime check warns gets no point forecast (a LadderError, exit 2)."""
    found = (fc.regime.warnings if fc.regime else None) or []
    if strict and found:
        raise LadderError("--strict: no forecast from rungs outside the hero's regime: "
                          + "; ".join(f"{w['kind']} ({w['message']})" for w in found))


def _print_forecast(fc: HeroForecast, name: str, rungs, path: Path, as_json: bool, done: bool = True) -> bool:
    """Warnings, then the JSON (True: nothing more to print) or the forecast's headline lines."""
    for w in fc.warnings:
        Console(stderr=True).print(f"warning: {w}", style="yellow", highlight=False, markup=False)
    if as_json:
        print(json.dumps(fc.to_dict(), default=float))
        return True
    c = Console()
    h = fc.hero.final_loss
    c.print(f"[bold]{name}[/bold]: hero {fc.hero.name} forecast final loss {h['mean']:.4f} "
            f"({int(100 * h['level'])}% interval {h['lo']:.4f} to {h['hi']:.4f}, +-{50 * (h['hi'] - h['lo']) / h['mean']:.1f}%) "
            f"from {len(rungs)} rungs in {len(h.get('method', {}).get('points', [])) or len(rungs)} families")
    if h.get("sd"):
        sd = h["sd"]
        c.print(f"interval parts (log-loss sd): fit {sd['fit']:.4f}, measurement {sd['measurement']:.4f}, "
                f"backtest {sd['backtest']:.4f} over {h['reach_efolds']:.2f} e-folds; t quantile {h['quantile']:.2f} "
                f"(dof {h['dof']:.3g})", highlight=False)
    law = fc.law
    if law.kind == "size_tokens":
        c.print(f"law: L(N, D) = {law.E:.3f} + {law.A:.3g}/N^{law.alpha:.3f} + {law.B:.3g}/D^{law.beta:.3f} "
                f"(N active parameters, D tokens)", highlight=False)
        for b in law.nearest_backtest or []:
            c.print(f"nearest-rung backtest: {b.held_out} from the other families predicted {b.predicted:.4f} "
                    f"({b.lo:.4f} to {b.hi:.4f}), actual {b.actual:.4f}, error {100 * b.rel_error:+.2f}%",
                    highlight=False)
        every = (fc.coverage.get("final_loss") or {}).get("every_family") or {}
        if every.get("n"):
            c.print(f"every family from the others: rms error {100 * every['rms_rel_error']:.2f}%, largest "
                    f"{100 * every['max_abs_rel_error']:.2f}% ({every['n']} families)", highlight=False)
    else:
        c.print(f"law: L(C) = {law.E:.3f} + {law.A:.3g} C^-{law.alpha:.3f}")
    if h.get("caveat"):
        c.print(f"[bold red]not to be trusted[/bold red]: {h['caveat']}", highlight=False)
    if h.get("routes"):
        r = h["routes"]
        c.print(f"routes: law {r['law']:.4f}, curve model {r['curve_model']:.4f} ({100 * r['rel_difference']:+.1f}%)"
                + (" [widened]" if "widened_from" in r else ""), highlight=False)
    if fc.backtest and law.kind != "size_tokens":
        b = fc.backtest
        c.print(f"backtest: {b.held_out} predicted {b.predicted:.4f} ({b.lo:.4f} to {b.hi:.4f}), "
                f"actual {b.actual:.4f} (mean of {len(b.members or [1])} run(s)), "
                f"error {100 * b.rel_error:+.2f}%")
    if fc.trajectory is None:
        c.print(f"[yellow]no trajectory: {fc.curve_model_error}[/yellow]")
    if done:
        _print_coverage(fc, path)
    return False


def _print_coverage(fc: HeroForecast, path: Path) -> None:
    c = Console()
    for name, cov in fc.coverage.items():
        if cov and "coverage" in cov:
            c.print(f"{name.replace('_', ' ')} interval, backtested on this ladder ({cov['method']}, {cov['n']} "
                    f"held-out points): {100 * cov['coverage']:.0f}% inside at {100 * cov['level']:.0f}%, "
                    f"mean width {100 * cov['mean_rel_width']:.1f}%, mean error {100 * cov['mean_abs_rel_err']:.1f}%",
                    highlight=False)
    c.print(f"wrote {path}", soft_wrap=True, highlight=False)


def forecast_cmd(
    experiment: Optional[str] = typer.Argument(None, help="experiment file (or give --from-csv and --hero)"),
    holdout: str = typer.Option(None, "--holdout", help="LAST (or a rung name): refit without it and report its error"),
    root: str = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    tracking_uri: str = typer.Option(None, "--tracking-uri"),
    no_tracking: bool = typer.Option(False, "--no-tracking", help="do not log to MLflow"),
    from_csv: Optional[Path] = typer.Option(
        None, "--from-csv", help="a ladder trained elsewhere: a CSV with one row per rung (name, spec, curve, "
        "optional final_loss); paths relative to the CSV"),
    hero_path: Optional[Path] = typer.Option(None, "--hero", help="with --from-csv: the hero's spec YAML"),
    metric_names: Optional[str] = typer.Option(
        None, "--metric-names", help="with --from-csv: the curves' metric names (olmo-core, levanter, torchtitan, "
        "or a YAML map)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="with --from-csv: directory for forecast.json and "
                                           "law.png (default: beside the CSV)"),
    as_json: bool = typer.Option(False, "--json", help="print the forecast JSON"),
    strict: bool = typer.Option(False, "--strict", help="refuse a point forecast (exit 2, nothing written) when the "
                                "regime check finds the rungs outside the hero's regime"),
) -> None:
    """Fit the laws and the curve model on the finished rungs; forecast the hero (forecast.json + plot).

    A ladder whose rungs ran elsewhere: --from-csv LADDER.csv --hero HERO.yaml (specs from
    `ladder spec from-run`, curves as CSV exports, metrics.jsonl, or wandb:DIR)."""
    from analysis.forecast.hero import forecast
    from analysis.report import plot_law

    if from_csv is not None:
        if experiment is not None or holdout:
            raise LadderError("--from-csv forecasts the ladder its CSV lists: give no experiment file nor --holdout")
        if hero_path is None:
            raise LadderError("--from-csv needs the hero's spec: --hero HERO.yaml")
        from ladder.ladder_csv import read_ladder_csv

        rungs = read_ladder_csv(from_csv, load_metric_names(metric_names))
        hero = load_spec(hero_path)
        if len(rungs) < 3:
            raise LadderError(f"{from_csv}: forecast needs at least 3 rungs, the file lists {len(rungs)}")
        name = from_csv.stem
        hf = forecast(name, rungs, hero)
        _refuse_if_strict(hf, strict)
        out = out_dir or from_csv.parent
        out.mkdir(parents=True, exist_ok=True)
        path = write_hero_forecast(out / "forecast.json", hf)
        plan = costs.plan([*(x.spec for x in rungs), hero], hero)
        plot_law(out, plan, {x.spec.name: x.final_loss for x in rungs}, hf, None)
        _print_forecast(hf, name, rungs, path, as_json)
        return
    if experiment is None:
        raise LadderError("give an experiment file, or --from-csv LADDER.csv --hero HERO.yaml")
    exp = load_experiment(experiment)
    if exp.hero is None:
        raise LadderError(f"{experiment}: the experiment has no hero to forecast")
    r = ladder_root(root)
    rungs, missing = finished_rungs(r, exp, holdout)
    if len(rungs) < 3:
        raise LadderError(f"forecast needs at least 3 finished rungs; unfinished: {', '.join(missing) or 'none'}"
                          f" (run `ladder submit {experiment}` first)")
    check_losses_fall(rungs)
    try:
        hf = forecast(exp.name, rungs, exp.hero)
    except YardstickError as e:
        raise LadderError(f"{experiment}: {e}") from None
    fl = hf.hero.final_loss
    if not all(math.isfinite(fl[k]) for k in ("mean", "lo", "hi")):  # nothing written from a failed fit
        raise LadderError(f"cannot forecast: the law fitted to rungs {', '.join(x.spec.name for x in rungs)} gives "
                          f"no finite hero loss ({fl['mean']}, interval {fl['lo']} to {fl['hi']})")
    _refuse_if_strict(hf, strict)
    if holdout:
        held = [s for s in exp.rungs if s.name not in {x.spec.name for x in rungs}]
        hf.holdout = [h.name for h in held]
    out = analysis_dir(r, exp.name)
    path = write_hero_forecast(out / ("forecast.json" if not holdout else "forecast_holdout.json"), hf)
    plan = costs.plan([*exp.rungs, exp.hero], exp.hero)
    plot_law(out, plan, {x.spec.name: x.final_loss for x in rungs}, hf, None)
    if not no_tracking:
        try:
            log_forecast(exp, path, tracking_uri, r)
            log_artifact_to_parent(exp, out / "law.png", None, tracking_uri, r)
        except store_errors() as e:  # the forecast file is the record; tracking can catch up later
            Console(stderr=True).print(f"warning: could not log the forecast to MLflow: {e}", style="yellow")
    if _print_forecast(hf, exp.name, rungs, path, as_json, done=False):
        return
    c = Console()
    if holdout:
        held = [s for s in exp.rungs if s.name in hf.holdout]
        for s in held:
            from analysis.forecast.hero import final_interval

            pred = final_interval(rungs, costs.total_flops(s))
            c.print(f"holdout {s.name}: predicted {pred[0]:.4f} ({pred[1]:.4f} to {pred[2]:.4f})")
    _print_coverage(hf, path)


def report_cmd(
    experiment: str = typer.Argument(..., help="experiment file"),
    out: str = typer.Option("report", "--out", help="output directory"),
    root: str = typer.Option(None, "--root"),
    tracking_uri: str = typer.Option(None, "--tracking-uri"),
    no_tracking: bool = typer.Option(False, "--no-tracking", help="do not attach the report to the MLflow parent run"),
) -> None:
    """A self-contained HTML report (plots as PNG files beside it)."""
    from analysis.report import build_report

    exp = load_experiment(experiment)
    r = ladder_root(root)
    specs = [*exp.rungs, *([exp.hero] if exp.hero else [])]
    plan = costs.plan(specs, exp.hero)
    runs = {}
    for s in specs:
        m = run_dir_for(r, exp.name, s) / METRICS_FILE
        if m.exists() and m.stat().st_size:
            runs[s.name] = read_metrics_frame(m)
    adir = analysis_dir(r, exp.name)
    forecast = read_forecast(adir / "forecast.json")
    try:
        compare = read_comparison(adir / "compare.json")
        replan = read_replan(adir / "replan.json")
    except InputError as err:
        raise LadderError(str(err)) from None
    flags = [f.to_dict() for f in compare.flags] if compare else []
    rows = [o.to_dict() for o in replan.options] if replan else []
    hero_finished = exp.hero is None or is_finished(run_dir_for(r, exp.name, exp.hero), exp.hero)
    extras = {s.name: read_metrics_frame(run_dir_for(r, exp.name, s) / METRICS_FILE) for s in exp.extras
              if is_finished(run_dir_for(r, exp.name, s), s)}
    page = build_report(Path(out), exp.name, plan, runs, forecast, flags, rows, replan.recommendation if replan else None,
                        hero_finished=hero_finished, extras=extras)
    if not no_tracking and forecast is not None:
        try:
            for f in sorted(Path(out).iterdir()):
                log_artifact_to_parent(exp, f, "report", tracking_uri, r)
        except store_errors() as e:  # the report on disk is the record
            Console(stderr=True).print(f"warning: could not attach the report to MLflow: {e}", style="yellow")
    summary = json.loads((Path(out) / "summary.json").read_text())
    Console().print(summary["verdict"], highlight=False)
    Console().print(f"report: {page.resolve()}", soft_wrap=True, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("forecast")(forecast_cmd)
    app.command("report")(report_cmd)
