"""`ladder sync`: upload to MLflow what the run dirs have and MLflow lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from ladder.commands.status import experiment_name
from ladder.errors import LadderError
from ladder.ledger import ladder_root
from ladder.tracking import check_store_writable, resolve_tracking_uri, store_errors, sync_runs
from ladder.wandb_tracking import sync_to_wandb


def sync_cmd(
    experiment: Optional[str] = typer.Argument(None, help="experiment name or file (default: every experiment)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow store (default sqlite:///<root>/mlflow.db)"),
    root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    tracker: str = typer.Option("mlflow", "--tracker", help="mlflow, wandb, or mlflow,wandb"),
    wandb_project: Optional[str] = typer.Option(None, "--wandb-project", help="W&B project (default ladder-<experiment>)"),
    wandb_mode: Optional[str] = typer.Option(None, "--wandb-mode", help="offline (default; runs under <root>/wandb) "
                                             "or online ($WANDB_MODE)"),
) -> None:
    """Upload missing metrics of every run (nothing is sent twice): to MLflow, and/or to W&B."""
    from rich.console import Console
    from rich.table import Table

    trackers = [t.strip() for t in tracker.split(",") if t.strip()]
    unknown = [t for t in trackers if t not in ("mlflow", "wandb")]
    if unknown or not trackers:
        raise LadderError(f"--tracker {tracker!r}: mlflow, wandb, or mlflow,wandb")
    r = ladder_root(root)
    if "wandb" in trackers:
        t = Table(title="sync to W&B")
        for col in ("experiment", "spec", "uploaded", "last step", "W&B run"):
            t.add_column(col)
        for w in sync_to_wandb(r, experiment_name(experiment), wandb_project, wandb_mode):
            t.add_row(w.experiment, w.name, str(w.uploaded), "-" if w.last_step is None else str(w.last_step),
                      w.run_dir or w.spec_id)
        Console(soft_wrap=True).print(t)
        if "mlflow" not in trackers:
            return
    uri = resolve_tracking_uri(tracking_uri, r)
    check_store_writable(uri)  # a read-only SQLite file: one line, not an SQL error a run
    try:
        results = sync_runs(r, experiment_name(experiment), uri)
    except LadderError:
        raise
    except store_errors() as err:
        raise LadderError(f"cannot reach MLflow at {uri}: {type(err).__name__}: {str(err)[:300]}") from err
    t = Table(title=f"sync to {uri}")
    for col in ("experiment", "spec", "state", "uploaded", "mlflow run", "note"):
        t.add_column(col)
    for s in results:
        t.add_row(s.experiment, s.name, s.state, str(s.uploaded), s.run_id or "-", s.error or "")
    Console().print(t)
    if any(s.error and not s.error.startswith("skipped") for s in results):
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    app.command("sync")(sync_cmd)
