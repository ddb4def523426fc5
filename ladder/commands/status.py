"""`ladder status` (a table) and `ladder runs --json` (for scripts): the ledger of runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from ladder.ledger import as_experiment, ladder_root, records
from ladder.tracking import resolve_tracking_uri


def experiment_name(experiment: str | None) -> str | None:
    """A name as given, or the name an experiment file declares."""
    if experiment is None:
        return None

    exp = as_experiment(experiment)
    return exp.name if exp is not None else experiment


# Columns in the order shown, and the order they are given up in when the terminal is narrow.
COLUMNS = ("experiment", "spec", "role", "id", "state", "step", "loss", "tok/s", "mlflow", "note")
DROP_FIRST = ("mlflow", "experiment", "role", "note", "tok/s", "id")
NOTE_MIN = 12  # a note wraps; it needs only this much


def short_rate(x: float | None) -> str:
    if x is None:
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def status_rows(recs) -> tuple[list[str], list[dict[str, str]]]:
    """The columns worth showing (one experiment: no experiment column; all rungs: no role) and
    each record's cells, plain text."""
    cols = [c for c in COLUMNS
            if not (c == "experiment" and len({x.experiment for x in recs}) <= 1)
            and not (c == "role" and all(x.role == "rung" for x in recs))]
    rows = []
    for x in recs:
        rows.append({
            "experiment": x.experiment, "spec": x.name, "role": x.role, "id": x.spec_id[:8], "state": x.state,
            "step": f"0/{x.total_steps}" if x.step is None else f"{x.step + 1}/{x.total_steps}",
            "loss": "-" if x.loss is None else f"{x.loss:.4f}", "tok/s": short_rate(x.tokens_per_s),
            "mlflow": (x.mlflow_run_id or "-")[:8], "note": x.detail or (f"held by {x.holder}" if x.holder else ""),
        })
    return cols, rows


def fit_columns(cols: list[str], rows: list[dict[str, str]], width: int) -> list[str]:
    """Drop columns, least useful first, until the table fits `width` characters (rich: 3 per
    column of padding and border, 1 more for the edge)."""
    def need(c: str) -> int:
        w = max([len(c)] + [len(r[c]) for r in rows])
        return (min(w, NOTE_MIN) if c == "note" else w) + 3

    keep = list(cols)
    for c in DROP_FIRST:
        if sum(need(k) for k in keep) + 1 <= width:
            break
        if c in keep:
            keep.remove(c)
    return keep


def status_cmd(
    experiment: Optional[str] = typer.Argument(None, help="experiment file (shows pending specs too) or name"),
    root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="whose MLflow run ids to show"),
) -> None:
    """A table of every spec: state, step/total, last loss, tokens/s, MLflow run id."""
    from rich.console import Console
    from rich.table import Table

    r = ladder_root(root)
    recs = records(r, experiment, resolve_tracking_uri(tracking_uri, r))
    colour = {"finished": "green", "running": "cyan", "failed": "red", "diverged": "magenta", "pending": "dim"}
    console = Console()
    cols, rows = status_rows(recs)
    shown = fit_columns(cols, rows, console.width)
    t = Table(title=f"ladder runs under {r}", title_justify="left")
    for col in shown:
        t.add_column(col, no_wrap=col != "note", overflow="fold" if col == "note" else "ellipsis")
    for row in rows:
        t.add_row(*(f"[{colour.get(row['state'], 'white')}]{row['state']}[/]" if c == "state" else row[c] for c in shown))
    if len(shown) < len(cols) and recs:
        t.caption = f"not shown at width {console.width}: {', '.join(c for c in cols if c not in shown)} (ladder runs --json has all)"
    console.print(t if recs else f"no runs under {r}")


def runs_cmd(
    experiment: Optional[str] = typer.Argument(None, help="experiment file or name"),
    as_json: bool = typer.Option(False, "--json", help="one JSON array on stdout"),
    root: Optional[Path] = typer.Option(None, "--root", help="ladder root (default $MOE_LADDER_ROOT or ./.ladder)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="whose MLflow run ids to show"),
) -> None:
    """The ledger for scripts: tab-separated lines, or JSON with --json."""
    import dataclasses

    r = ladder_root(root)
    rows = [dataclasses.asdict(x) for x in records(r, experiment, resolve_tracking_uri(tracking_uri, r))]
    if as_json:
        typer.echo(json.dumps(rows, indent=1, default=float))
        return
    for row in rows:
        typer.echo("\t".join(str(row[k]) for k in ("experiment", "name", "spec_id", "state", "step", "total_steps", "loss", "run_dir")))


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)
    app.command("runs")(runs_cmd)
