"""`ladder train SPEC --run-dir DIR`: one spec, in this process, no Ray and no MLflow (the path
used on a bare GPU machine and in tests), through the submission's own worker
(ladder.worker.run_claimed). The run dir is the record: metrics.jsonl, status.json, checkpoints/;
running the same command again resumes from the newest checkpoint. One writer at a time per run
dir: the worker holds the run dir's claim (ladder/ledger.py: Claim) while it trains, so a second
`ladder train`, or a submission's worker, on the same run dir is refused in one line naming the
holder."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import typer
from core.spec import load_spec
from engines.base import DivergedError, read_status
from engines.options import Options
from engines.registry import engine_names
from ladder.errors import LadderError
from ladder.preflight import check_memory
from ladder.worker import Attempt, Busy, ClaimLost, run_claimed


def train(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="spec file (.yaml or .json)"),
    run_dir: Optional[Path] = typer.Option(
        None, "--run-dir", help="where metrics, status and checkpoints go (default: runs/<name>-<spec id>)"
    ),
    engine: Optional[str] = typer.Option(None, "--engine", help="engine to use instead of the spec's"),
    no_resume: bool = typer.Option(
        False, "--no-resume", help="start over, discarding this run dir's checkpoints (its metrics are kept aside)"),
    rerun_diverged: bool = typer.Option(
        False, "--rerun-diverged", help="train a diverged run again, from its newest intact checkpoint"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar, only the final line"),
) -> None:
    """Train one spec in-process with a progress bar (step, loss, tokens/s)."""
    from rich.console import Console

    spec = load_spec(spec_path)
    if engine is not None:
        if engine not in engine_names():
            raise LadderError(f"unknown engine {engine!r}; registered engines: {', '.join(sorted(engine_names()))}")
        spec = spec.replace(engine=engine)
    check_memory([spec])
    run_dir = run_dir or Path("runs") / f"{spec.name}-{spec.id}"
    if run_dir.exists() and not run_dir.is_dir():
        raise LadderError(f"--run-dir {run_dir}: is a file, not a directory")
    status = read_status(run_dir) if run_dir.is_dir() else {}
    if status.get("state") == "diverged" and not (rerun_diverged or no_resume):
        raise LadderError(f"{run_dir} diverged at step {status.get('step')}; train it again on purpose with "
                          "--rerun-diverged (from its newest intact checkpoint) or --no-resume (from scratch)")
    console = Console(stderr=True)
    # the environment's engine options, read once, here (the worker lays them over the spec's)
    ctx = {"root": str(run_dir), "owner": f"train-{os.getpid()}", "options": Options.from_env().set_fields(),
           "resume": not no_resume, "ray_train": False}
    att = Attempt()
    try:
        with nullcontext(lambda update, force=False: None) if quiet else _progress(spec, console) as report:
            run_claimed(spec, run_dir, ctx, report, att)
    except Busy as busy:
        holder = busy.holder or {}
        raise LadderError(f"{run_dir} is being trained by another process ({holder.get('host')} pid "
                          f"{holder.get('pid')}); wait for it to end, or stop it first") from None
    except ClaimLost as err:
        raise LadderError(f"{run_dir}: {err}; stopped") from None
    except DivergedError as err:
        console.print(f"[red]diverged:[/red] {err}", highlight=False)
        raise typer.Exit(3)
    last = att.last
    if att.outcome == "skipped":
        console.print(f"{spec.name}: already finished ({run_dir})", highlight=False)
        return
    if att.outcome != "finished":
        console.print(f"[red]failed:[/red] {spec.name}: {att.note} ({run_dir})", highlight=False)
        raise typer.Exit(1)
    ev = f", eval loss {last.eval_loss:.4f}" if last.eval_loss is not None else ""
    console.print(
        f"{spec.name}: finished step {last.step + 1}/{spec.total_steps}, loss {last.loss:.4f}{ev} -> {run_dir}",
        highlight=False,
    )


@contextmanager
def _progress(spec, console):
    """A progress bar (step, loss, tokens/s) driven by the worker's reports."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                  TimeRemainingColumn(), console=console, transient=False) as progress:
        task = progress.add_task(spec.name, total=spec.total_steps, loss="-", tps="-")

        def report(update: dict, force: bool = False) -> None:
            fields = {}
            if update.get("loss") is not None:
                fields["loss"] = f"{update['loss']:.4f}"
            if update.get("tokens_per_s") is not None:
                fields["tps"] = f"{update['tokens_per_s']:,.0f}"
            progress.update(task, completed=update.get("step", 0), **fields)

        yield report


def register(app: typer.Typer) -> None:
    app.command("train")(train)
