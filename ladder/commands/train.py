"""`ladder train SPEC --run-dir DIR`: one spec, in this process, no Ray and no MLflow (the path
used on a bare GPU machine and in tests). The run dir is the record: metrics.jsonl, status.json,
checkpoints/; running the same command again resumes from the newest checkpoint. One `ladder train`
at a time per run dir: it holds a claim (ladder/ledger.py: Claim) in run_dir/locks/ while it
trains, and a second one is refused in one line naming the holder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from core.spec import load_spec
from engines.base import DivergedError, read_status
from engines.options import EngineOptions, Options
from engines.registry import engine_names, get_engine
from ladder import ledger
from ladder.errors import LadderError
from ladder.preflight import check_memory


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
    # the spec's options with the environment's on top, read once, here
    eng = get_engine(spec.engine, EngineOptions.for_spec(spec, Options.from_env()))
    console = Console(stderr=True)
    last = None
    claim = ledger.Claim.acquire(run_dir, spec.id, f"train-{os.getpid()}", run_dir=str(run_dir))
    if claim is None:
        holder = ledger.live_claim(run_dir, spec.id) or {}
        raise LadderError(f"{run_dir} is being trained by another process ({holder.get('host')} pid "
                          f"{holder.get('pid')}); wait for it to end, or stop it first")
    try:
        records = _while_claimed(eng.train(spec, run_dir, resume=not no_resume), claim, run_dir)
        if quiet:
            for last in records:
                pass
        else:
            last = _with_progress(records, spec, console)
    except DivergedError as err:
        console.print(f"[red]diverged:[/red] {err}", highlight=False)
        raise typer.Exit(3)
    finally:
        claim.release()
    if last is None:
        console.print(f"{spec.name}: already finished ({run_dir})", highlight=False)
        return
    ev = f", eval loss {last.eval_loss:.4f}" if last.eval_loss is not None else ""
    console.print(
        f"{spec.name}: finished step {last.step + 1}/{spec.total_steps}, loss {last.loss:.4f}{ev} -> {run_dir}",
        highlight=False,
    )


def _while_claimed(records, claim, run_dir):
    """The engine's records while this process holds the run dir's claim; a lost claim (another
    process judged this one dead and took the run over) stops the training at the next step."""
    for rec in records:
        if claim.lost:
            raise LadderError(f"{run_dir}: another process took this run dir over; stopped")
        yield rec


def _with_progress(records, spec, console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    last = None
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(spec.name, total=spec.total_steps, loss="-", tps="-")
        for rec in records:
            if last is None:
                progress.update(task, completed=rec.step)
            last = rec
            progress.update(task, advance=1, loss=f"{rec.loss:.4f}", tps=f"{rec.tokens_per_s:,.0f}")
    return last


def register(app: typer.Typer) -> None:
    app.command("train")(train)
