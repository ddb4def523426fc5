"""`ladder sync`: upload to MLflow what the run dirs have and MLflow lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from ladder.commands.status import experiment_name
from ladder.errors import LadderError
from ladder.ledger import ladder_root
from ladder.tracking import resolve_tracking_uri, sync_runs


def register(app: typer.Typer) -> None:
    @app.command("sync")
    def sync_cmd(
        experiment: Optional[str] = typer.Argument(None, help="experiment name or file (default: every experiment)"),
        tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow store (default sqlite:///<root>/mlflow.db)"),
        root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    ) -> None:
        """Upload missing metrics of every run (nothing is sent twice)."""
        from rich.console import Console
        from rich.table import Table

        r = ladder_root(root)
        uri = resolve_tracking_uri(tracking_uri, r)
        try:
            results = sync_runs(r, experiment_name(experiment), uri)
        except LadderError:
            raise
        except Exception as err:
            raise LadderError(f"cannot reach MLflow at {uri}: {type(err).__name__}: {str(err)[:300]}") from err
        t = Table(title=f"sync to {uri}")
        for col in ("experiment", "spec", "state", "uploaded", "mlflow run", "note"):
            t.add_column(col)
        for s in results:
            t.add_row(s.experiment, s.name, s.state, str(s.uploaded), s.run_id or "-", s.error or "")
        Console().print(t)
        if any(s.error and not s.error.startswith("skipped") for s in results):
            raise SystemExit(1)
