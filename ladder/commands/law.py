"""`ladder law fit` (L(N, D) = E + A/N^alpha + B/D^beta, or its MoE form with a total-parameter term)
and `ladder law envelope` (L(C) = E + A*C^-alpha) over a user's CSV file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from ladder.errors import LadderError
from core.fsutil import json_safe


def _load(file: Path, cols: dict[str, str], loss_col: str, drop_highest: int, min_rows: int):
    """Read and validate the CSV (every named column numeric, finite, positive), then drop the
    `drop_highest` highest-loss rows."""
    from analysis.csvio import TableError, read_table

    if drop_highest < 0:
        raise LadderError(f"--drop-highest must be >= 0, got {drop_highest}")
    needed = [*cols.values(), loss_col]
    try:
        df = read_table(file, needed, positive=needed)
    except TableError as e:
        raise LadderError(str(e)) from None
    if drop_highest >= len(df):
        raise LadderError(f"{file}: --drop-highest {drop_highest} would drop all {len(df)} rows")
    if drop_highest:
        df = df.sort_values(loss_col, kind="stable").iloc[: len(df) - drop_highest]
    if len(df) < min_rows:
        dropped = f" after dropping {drop_highest}" if drop_highest else ""
        raise LadderError(
            f"{file}: {len(df)} row(s){dropped}, but the law has {min_rows} parameters: need at least {min_rows} rows"
        )
    return df


def _fit_or_explain(fn, file: Path, *args, **kwargs):
    from analysis.laws import FitError

    try:
        return fn(*args, **kwargs)
    except FitError as e:
        raise LadderError(f"{file}: {e}") from None


def _fmt(v: float) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _render(d: dict, title: str, extra: list[str]) -> None:
    console = Console()
    t = Table(title=title, header_style="bold")
    t.add_column("parameter")
    t.add_column("value", justify="right")
    t.add_column(f"{100 * d['ci_level']:.0f}% interval", justify="right")
    for k, (lo, hi) in d["ci"].items():
        t.add_row(k, _fmt(d[k]), f"[{_fmt(lo)}, {_fmt(hi)}]")
    console.print(t)
    console.print(
        f"{d['n_points']} points, Huber (delta {d['huber_delta']:g}) sum {d['loss']:.6g}, "
        f"{d['n_bootstrap']} bootstrap refits ({d['n_bootstrap_failed']} failed), {d['seconds']:.2f} s",
        highlight=False,
    )
    for line in extra:
        console.print(line, highlight=False)


def register(app: typer.Typer) -> None:
    law_app = typer.Typer(help="Fit scaling laws to CSV files.", no_args_is_help=True)
    app.add_typer(law_app, name="law")

    @law_app.command("fit")
    def fit_cmd(
        file: Path = typer.Argument(..., help="CSV with one row per training run"),
        params_col: str = typer.Option(..., "--params-col", help="column of parameter counts N (active ones for MoE)"),
        total_col: Optional[str] = typer.Option(
            None, "--total-params-col",
            help="column of total parameters: fits the MoE law E + A/N^alpha + G/N_total^gamma + B/D^beta",
        ),
        tokens_col: Optional[str] = typer.Option(None, "--tokens-col", help="column of training tokens D"),
        flops_col: Optional[str] = typer.Option(None, "--flops-col", help="column of training FLOPs C (D = C / 6N)"),
        loss_col: str = typer.Option(..., "--loss-col", help="column of final losses"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
        drop_highest: int = typer.Option(0, "--drop-highest", help="drop the K highest-loss rows first"),
        bootstrap: int = typer.Option(200, "--bootstrap", help="bootstrap refits for the intervals (0: none)"),
        level: float = typer.Option(0.95, "--level", help="interval coverage"),
        seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
        budget: Optional[List[float]] = typer.Option(
            None, "--budget", help="FLOP budget C for the compute-optimal N*, D* (repeatable)"
        ),
    ) -> None:
        """Fit L(N, D) = E + A/N^alpha + B/D^beta (Huber on log loss, L-BFGS, bootstrap intervals)."""
        from analysis.laws import fit_law, fit_moe_law

        if (tokens_col is None) == (flops_col is None):
            raise LadderError("give exactly one of --tokens-col (D) or --flops-col (C, with D = C / 6N)")
        if not 0 < level < 1:
            raise LadderError(f"--level must be in (0, 1), got {level}")
        if bootstrap < 0:
            raise LadderError(f"--bootstrap must be >= 0, got {bootstrap}")
        if budget and any(not (c > 0 and math.isfinite(c)) for c in budget):
            raise LadderError("--budget must be a positive number of FLOPs")
        if budget and total_col:
            raise LadderError("--budget needs a fixed sparsity: it is not defined for the --total-params-col law")
        second = tokens_col if tokens_col is not None else flops_col
        cols = {"N": params_col, "D": second, **({"N_total": total_col} if total_col else {})}
        df = _load(file, cols, loss_col, drop_highest, min_rows=7 if total_col else 5)
        N = df[params_col].to_numpy()
        D = df[tokens_col].to_numpy() if tokens_col is not None else df[flops_col].to_numpy() / (6.0 * N)
        L = df[loss_col].to_numpy()
        opts = dict(n_bootstrap=bootstrap, level=level, seed=seed)
        if total_col:
            fit = _fit_or_explain(fit_moe_law, file, N, df[total_col].to_numpy(), D, L, **opts)
        else:
            fit = _fit_or_explain(fit_law, file, N, D, L, **opts)

        d = fit.to_dict()
        d["data"] = {
            "file": str(file), "params_col": params_col, "total_params_col": total_col,
            "tokens_col": tokens_col, "flops_col": flops_col,
            "loss_col": loss_col, "dropped_highest": drop_highest,
        }
        if budget:
            d["compute_optimal"] = [{"C": c, **fit.compute_optimal(c)} for c in budget]
        d = json_safe(d)
        if as_json:
            print(json.dumps(d, indent=2))
            return
        extra = []
        if "optimal_N_exponent" in d:
            extra.append(f"compute-optimal: N* ~ C^{d['optimal_N_exponent']:.3f}, D* ~ C^{d['optimal_D_exponent']:.3f}")
        for row in d.get("compute_optimal", []):
            ci = row.get("loss_ci") or [None, None]
            extra.append(
                f"C = {row['C']:.3g}: N* = {row['N']:.3g}, D* = {row['D']:.3g}, "
                f"loss {row['loss']:.4g} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            )
        _render(d, f"{d['law']}  ({file.name})", extra)

    @law_app.command("envelope")
    def envelope_cmd(
        file: Path = typer.Argument(..., help="CSV with one row per compute budget (its best run)"),
        flops_col: str = typer.Option(..., "--flops-col", help="column of training FLOPs C"),
        loss_col: str = typer.Option(..., "--loss-col", help="column of losses"),
        as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
        drop_highest: int = typer.Option(0, "--drop-highest", help="drop the K highest-loss rows first"),
        bootstrap: int = typer.Option(200, "--bootstrap", help="bootstrap refits for the intervals (0: none)"),
        level: float = typer.Option(0.95, "--level", help="interval coverage"),
        seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
    ) -> None:
        """Fit the compute envelope L(C) = E + A*C^-alpha."""
        from analysis.laws import fit_envelope

        if not 0 < level < 1:
            raise LadderError(f"--level must be in (0, 1), got {level}")
        if bootstrap < 0:
            raise LadderError(f"--bootstrap must be >= 0, got {bootstrap}")
        df = _load(file, {"C": flops_col}, loss_col, drop_highest, min_rows=3)
        fit = _fit_or_explain(
            fit_envelope, file, df[flops_col].to_numpy(), df[loss_col].to_numpy(),
            n_bootstrap=bootstrap, level=level, seed=seed,
        )
        d = fit.to_dict()
        d["data"] = {"file": str(file), "flops_col": flops_col, "loss_col": loss_col, "dropped_highest": drop_highest}
        d = json_safe(d)
        if as_json:
            print(json.dumps(d, indent=2))
            return
        _render(d, f"{d['law']}  ({file.name})", [])
