"""`ladder submit`: train an experiment's specs on Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from ladder.commands.status import experiment_name
from ladder.controller import submit
from ladder.datacheck import refuse_repeats
from ladder.errors import LadderError
from ladder.ledger import ladder_root
from ladder.wandb_tracking import sync_to_wandb


def submit_cmd(
    experiment: str = typer.Argument(..., help="experiment file (or module name) defining EXPERIMENT"),
    only: Optional[str] = typer.Option(None, "--only", help="regex over spec names (may select the hero)"),
    engine: Optional[str] = typer.Option(None, "--engine", help="train every spec with this engine (changes spec ids)"),
    address: Optional[str] = typer.Option(None, "--address", help="join this Ray cluster (default: $RAY_ADDRESS, else a local Ray)"),
    max_concurrent: Optional[int] = typer.Option(None, "--max-concurrent", help="at most N runs at once"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, start nothing"),
    include_hero: bool = typer.Option(False, "--include-hero", help="also train the hero spec"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow store (default sqlite:///<root>/mlflow.db)"),
    root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    retries: int = typer.Option(3, "--retries", min=0, help="Ray retries of a run whose worker or node is lost"),
    ray_timeout: Optional[float] = typer.Option(
        None, "--ray-timeout", help="seconds to wait for --address to answer (default $MOE_LADDER_LIMITS ray_timeout_s, else 30)"),
    no_tracking: bool = typer.Option(False, "--no-tracking", help="do not log to MLflow (ladder sync can upload later)"),
    local: bool = typer.Option(False, "--local", help="no Ray: the runs one after another in subprocesses on this machine"),
    rerun_diverged: bool = typer.Option(False, "--rerun-diverged",
                                        help="train diverged specs again, from their newest intact checkpoint"),
    tracker: str = typer.Option("mlflow", "--tracker", help="mlflow (live), wandb (uploaded when the submission "
                                "ends, offline unless $WANDB_MODE=online), mlflow,wandb, or none"),
) -> None:
    """Train the experiment's rungs (finished ones are skipped, interrupted ones resume)."""
    trackers = {t.strip() for t in tracker.split(",") if t.strip()}
    if not trackers or trackers - {"mlflow", "wandb", "none"} or ("none" in trackers and len(trackers) > 1):
        raise LadderError(f"--tracker {tracker!r}: mlflow, wandb, mlflow,wandb or none")
    refuse_repeats(experiment, only=only, include_hero=include_hero)  # data seen twice: one line, exit 2
    try:
        result = submit(
            experiment,
            only=only,
            engine=engine,
            address=address,
            max_concurrent=max_concurrent,
            dry_run=dry_run,
            include_hero=include_hero,
            tracking_uri=tracking_uri,
            root=root,
            retries=retries,
            tracking=not no_tracking and "mlflow" in trackers,
            local=local,
            ray_timeout=ray_timeout,
            rerun_diverged=rerun_diverged,
        )
    except KeyboardInterrupt:
        raise SystemExit(130)  # the controller already said how to resume
    if "wandb" in trackers and not dry_run:
        sent = sync_to_wandb(ladder_root(root), experiment_name(experiment))
        typer.echo(f"W&B: {sum(w.uploaded for w in sent)} new steps of {len(sent)} runs "
                   f"(`ladder sync --tracker wandb` sends what comes later)")
    if not dry_run and not result.ok:
        raise SystemExit(1)  # some run failed or diverged; the table says which


def register(app: typer.Typer) -> None:
    app.command("submit")(submit_cmd)
