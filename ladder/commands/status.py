"""`ladder status` (a table) and `ladder runs --json` (for scripts): the ledger of runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def experiment_name(experiment: str | None) -> str | None:
    """A name as given, or the name an experiment file declares."""
    if experiment is None:
        return None
    from ladder.ledger import as_experiment

    exp = as_experiment(experiment)
    return exp.name if exp is not None else experiment


def register(app: typer.Typer) -> None:
    @app.command("status")
    def status_cmd(
        experiment: Optional[str] = typer.Argument(None, help="experiment file (shows pending specs too) or name"),
        root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $LADDER_ROOT or ./.ladder)"),
        tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="whose MLflow run ids to show"),
    ) -> None:
        """A table of every spec: state, step/total, last loss, tokens/s, MLflow run id."""
        from rich.console import Console
        from rich.table import Table

        from ladder.ledger import ladder_root, records
        from ladder.tracking import resolve_tracking_uri

        r = ladder_root(root)
        recs = records(r, experiment, resolve_tracking_uri(tracking_uri, r))
        colour = {"finished": "green", "running": "cyan", "failed": "red", "diverged": "magenta", "pending": "dim"}
        many_exps = len({x.experiment for x in recs}) > 1
        roles = any(x.role != "rung" for x in recs)
        t = Table(title=f"ladder runs under {r}")
        cols = [*(["experiment"] if many_exps else []), "spec", *(["role"] if roles else []), "id", "state", "step", "loss",
                "tok/s", "mlflow run", "note"]
        for col in cols:
            t.add_column(col, no_wrap=col in ("id", "state", "step", "spec"))
        for x in recs:
            step = f"0/{x.total_steps}" if x.step is None else f"{x.step + 1}/{x.total_steps}"
            row = [
                *([x.experiment] if many_exps else []),
                x.name,
                *([x.role] if roles else []),
                x.spec_id,
                f"[{colour.get(x.state, 'white')}]{x.state}[/]",
                step,
                "-" if x.loss is None else f"{x.loss:.4f}",
                "-" if x.tokens_per_s is None else f"{x.tokens_per_s:,.0f}",
                (x.mlflow_run_id or "-")[:8],
                x.detail or (f"held by {x.holder}" if x.holder else ""),
            ]
            t.add_row(*row)
        Console().print(t if recs else f"no runs under {r}")

    @app.command("runs")
    def runs_cmd(
        experiment: Optional[str] = typer.Argument(None, help="experiment file or name"),
        as_json: bool = typer.Option(False, "--json", help="one JSON array on stdout"),
        root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $LADDER_ROOT or ./.ladder)"),
        tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="whose MLflow run ids to show"),
    ) -> None:
        """The ledger for scripts: tab-separated lines, or JSON with --json."""
        import dataclasses

        from ladder.ledger import ladder_root, records
        from ladder.tracking import resolve_tracking_uri

        r = ladder_root(root)
        rows = [dataclasses.asdict(x) for x in records(r, experiment, resolve_tracking_uri(tracking_uri, r))]
        if as_json:
            typer.echo(json.dumps(rows, indent=1, default=float))
            return
        for row in rows:
            typer.echo("\t".join(str(row[k]) for k in ("experiment", "name", "spec_id", "state", "step", "total_steps", "loss", "run_dir")))
