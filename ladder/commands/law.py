"""`ladder law fit` (L(N, D) = E + A/N^alpha + B/D^beta, or its MoE form with a total-parameter term),
`ladder law envelope` (L(C) = E + A*C^-alpha), `ladder law predict` (a saved fit at held-out points,
with intervals) and `ladder law isoflop` (Chinchilla's approach 2) over a user's CSV file.

Rows can be filtered with `--where COL=VALUE` (also `!=`, `<`, `<=`, `>`, `>=`, and `COL=V1,V2` for a list;
repeatable, all must hold); several `--loss-col`
fit one law each. Every fit's JSON and table carry its `warnings` and, unless `--no-backtest`, the
coverage and width of its intervals on points it never saw (analysis.laws.backtest).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from core.fsutil import json_safe
from ladder.errors import LadderError
from analysis.runs.csvio import TableError, read_table
from analysis.laws.isoflop import IsoflopError, fit_isoflop, group_budgets
from ladder.law_table import WHERE_HELP, Where, apply_where, load_table, parse_where, validate_table, where_json

# The analysis modules (scipy, matplotlib) load when a law command runs, not with every `ladder` command.


def _fit_or_explain(fn, file: Path, *args, **kwargs):
    from analysis.laws.fit import FitError

    try:
        return fn(*args, **kwargs)
    except FitError as e:
        raise LadderError(f"{file}: {e}") from None


def _fmt(v: float) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


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
        f"{d['n_bootstrap']} bootstrap refits ({d['n_bootstrap_failed']} failed), {d['seconds']:.2f} s, "
        f"converged {d['converged']}",
        highlight=False,
    )
    for line in extra:
        console.print(line, highlight=False)
    _render_backtest(console, d.get("backtest"))
    _render_warnings(console, d.get("warnings"))


def _render_backtest(console: Console, bt: dict | None) -> None:
    for key, label in (("cross_validation", "held-out points"), ("extrapolation", "4x beyond the fitted")):
        b = (bt or {}).get(key)
        if not b or "coverage" not in b:
            continue
        console.print(f"backtest, {label} ({b['method']}, {b['n']} points): mean error {_pct(b['mean_abs_rel_err'])}, "
                      f"{100 * b['level']:.0f}% intervals hold {_pct(b['coverage'])}, mean width {_pct(b['mean_rel_width'])}",
                      highlight=False)


def _render_warnings(console: Console, warnings: list[str] | None) -> None:
    if not warnings:
        console.print("warnings: none", highlight=False)
    for w in warnings or []:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)


def _backtest(fit_fn, cols, loss, level, seed, start=None) -> dict:
    """start: the fit of all the points, which warm-starts the backtests' refits."""
    from analysis.laws import backtest as law_backtest

    return {
        "cross_validation": law_backtest.cross_validate(fit_fn, cols, loss, level=level, seed=seed, start=start),
        "extrapolation": law_backtest.extrapolate(fit_fn, cols, loss, level=level, seed=seed, start=start),
    }


def _png_path(png: Path | None, loss_col: str, several: bool) -> Path | None:
    if png is None:
        return None
    if not several:
        return png
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in loss_col)
    return png.with_name(f"{png.stem}-{safe}{png.suffix or '.png'}")


def _emit(docs: list[dict], as_json: bool, render) -> None:
    docs = [json_safe(d) for d in docs]
    if as_json:
        print(json.dumps(docs[0] if len(docs) == 1 else {"fits": docs}, indent=2))
        return
    for d in docs:
        render(d)


def _check_common(level: float, bootstrap: int) -> None:
    if not 0 < level < 1:
        raise LadderError(f"--level must be in (0, 1), got {level}")
    if bootstrap < 0:
        raise LadderError(f"--bootstrap must be >= 0, got {bootstrap}")


def _positive_list(name: str, values: list[float] | None) -> np.ndarray | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any(a <= 0):
        raise LadderError(f"{name} must be positive and finite")
    return a


def _csv_points(file: Path, params_col, total_col, tokens_col, flops_col, actual_col, where: list[Where]):
    """(N, N_total, D, C, actual) columns of a CSV, after --where; None for a column not named."""
    named = {k: v for k, v in (("N", params_col), ("N_total", total_col), ("D", tokens_col), ("C", flops_col),
                               ("actual", actual_col)) if v is not None}
    if not named or set(named) == {"actual"}:
        raise LadderError("--csv needs its columns: --params-col with --tokens-col or --flops-col, or --flops-col "
                          "alone for an envelope fit")
    try:
        df = apply_where(read_table(file, []), file, where).reset_index(drop=True)
        missing = [c for c in named.values() if c not in df.columns]
        if missing:
            raise TableError(f"{file}: missing column(s) {', '.join(map(repr, missing))} "
                             f"(columns present: {', '.join(map(repr, df.columns))})")
        df = validate_table(df, file, list(named.values()))
    except TableError as e:
        raise LadderError(str(e)) from None
    col = {k: df[v].to_numpy(dtype=np.float64) for k, v in named.items()}
    return col.get("N"), col.get("N_total"), col.get("D"), col.get("C"), col.get("actual")


def fit_cmd(
    file: Path = typer.Argument(..., help="CSV with one row per training run"),
    params_col: str = typer.Option(..., "--params-col", help="column of parameter counts N (active ones for MoE)"),
    total_col: Optional[str] = typer.Option(
        None, "--total-params-col",
        help="column of total parameters: fits the MoE law E + A/N^alpha + G/N_total^gamma + B/D^beta",
    ),
    tokens_col: Optional[str] = typer.Option(None, "--tokens-col", help="column of training tokens D"),
    flops_col: Optional[str] = typer.Option(None, "--flops-col", help="column of training FLOPs C (D = C / 6N)"),
    loss_col: List[str] = typer.Option(..., "--loss-col", help="column of final losses (repeatable: one fit each)"),
    where: Optional[List[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    drop_highest: int = typer.Option(0, "--drop-highest", help="drop the K highest-loss rows first"),
    bootstrap: int = typer.Option(200, "--bootstrap", help="bootstrap refits for the intervals (0: none)"),
    level: float = typer.Option(0.95, "--level", help="interval coverage"),
    seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
    budget: Optional[List[float]] = typer.Option(
        None, "--budget", help="FLOP budget C for the compute-optimal N*, D* (repeatable)"
    ),
    backtest: bool = typer.Option(True, "--backtest/--no-backtest",
                                  help="refit on held-out splits and report interval coverage and width"),
    png: Optional[Path] = typer.Option(None, "--png", help="write a plot of the fit here"),
) -> None:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta (Huber on log loss, L-BFGS, bootstrap intervals)."""
    from analysis.laws import backtest as law_backtest
    from analysis.laws.fit import fit_law, fit_moe_law
    if (tokens_col is None) == (flops_col is None):
        raise LadderError("give exactly one of --tokens-col (D) or --flops-col (C, with D = C / 6N)")
    _check_common(level, bootstrap)
    if budget and any(not (c > 0 and math.isfinite(c)) for c in budget):
        raise LadderError("--budget must be a positive number of FLOPs")
    if budget and total_col:
        raise LadderError("--budget needs a fixed sparsity: it is not defined for the --total-params-col law")
    conds = parse_where(where)
    second = tokens_col if tokens_col is not None else flops_col
    cols = {"N": params_col, "D": second, **({"N_total": total_col} if total_col else {})}
    docs = []
    for lc in loss_col:
        df = load_table(file, cols, lc, drop_highest, min_rows=7 if total_col else 5, where=conds)
        N = df[params_col].to_numpy()
        D = df[tokens_col].to_numpy() if tokens_col is not None else df[flops_col].to_numpy() / (6.0 * N)
        L = df[lc].to_numpy()
        opts = dict(n_bootstrap=bootstrap, level=level, seed=seed)
        if total_col:
            Nt = df[total_col].to_numpy()
            fit = _fit_or_explain(fit_moe_law, file, N, Nt, D, L, **opts)
            fn, xs = (lambda a, t, d, l, **k: fit_moe_law(a, t, d, l, strict=True, **k)), [N, Nt, D]
        else:
            fit = _fit_or_explain(fit_law, file, N, D, L, **opts)
            fn, xs = law_backtest.fit_n_d, [N, D]
        d = fit.to_dict()
        d["data"] = {
            "file": str(file), "params_col": params_col, "total_params_col": total_col,
            "tokens_col": tokens_col, "flops_col": flops_col, "where": where_json(conds),
            "loss_col": lc, "dropped_highest": drop_highest,
        }
        if budget:
            d["compute_optimal"] = [{"C": c, **fit.compute_optimal(c)} for c in budget]
        if backtest and fit.converged:
            d["backtest"] = _backtest(fn, xs, L, level, seed, start=fit)
        path = _png_path(png, lc, len(loss_col) > 1)
        if path is not None:
            from analysis import fitplots  # matplotlib only for a plot

            d["png"] = str(fitplots.plot_law_fit(fit, N, D, L, path, f"{fit._LAW}  ({file.name}, {lc})"))
        docs.append(d)

    def render(d):
        extra = []
        if "optimal_N_exponent" in d:
            extra.append(f"compute-optimal: N* ~ C^{d['optimal_N_exponent']:.3f}, D* ~ C^{d['optimal_D_exponent']:.3f}")
        for row in d.get("compute_optimal", []):
            ci = row.get("loss_ci") or [None, None]
            extra.append(
                f"C = {row['C']:.3g}: N* = {row['N']:.3g}, D* = {row['D']:.3g}, "
                f"loss {row['loss']:.4g} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            )
        _render(d, f"{d['law']}  ({file.name}, {d['data']['loss_col']})", extra)

    _emit(docs, as_json, render)


def envelope_cmd(
    file: Path = typer.Argument(..., help="CSV with one row per compute budget (its best run)"),
    flops_col: str = typer.Option(..., "--flops-col", help="column of training FLOPs C"),
    loss_col: List[str] = typer.Option(..., "--loss-col", help="column of losses (repeatable: one fit each)"),
    where: Optional[List[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    drop_highest: int = typer.Option(0, "--drop-highest", help="drop the K highest-loss rows first"),
    bootstrap: int = typer.Option(200, "--bootstrap", help="bootstrap refits for the intervals (0: none)"),
    level: float = typer.Option(0.95, "--level", help="interval coverage"),
    seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
    backtest: bool = typer.Option(True, "--backtest/--no-backtest",
                                  help="refit on held-out splits and report interval coverage and width"),
    png: Optional[Path] = typer.Option(None, "--png", help="write a plot of the fit here"),
) -> None:
    """Fit the compute envelope L(C) = E + A*C^-alpha."""
    from analysis.laws import backtest as law_backtest
    from analysis.laws.fit import fit_envelope
    _check_common(level, bootstrap)
    conds = parse_where(where)
    docs = []
    for lc in loss_col:
        df = load_table(file, {"C": flops_col}, lc, drop_highest, min_rows=3, where=conds)
        C, L = df[flops_col].to_numpy(), df[lc].to_numpy()
        fit = _fit_or_explain(fit_envelope, file, C, L, n_bootstrap=bootstrap, level=level, seed=seed)
        d = fit.to_dict()
        d["data"] = {"file": str(file), "flops_col": flops_col, "loss_col": lc, "where": where_json(conds),
                     "dropped_highest": drop_highest}
        if backtest and fit.converged:
            d["backtest"] = _backtest(law_backtest.fit_c, [C], L, level, seed, start=fit)
        path = _png_path(png, lc, len(loss_col) > 1)
        if path is not None:
            from analysis import fitplots  # matplotlib only for a plot

            d["png"] = str(fitplots.plot_envelope_fit(fit, C, L, path, f"{file.name}, {lc}"))
        docs.append(d)
    _emit(docs, as_json, lambda d: _render(d, f"{d['law']}  ({file.name}, {d['data']['loss_col']})", []))


def predict_cmd(
    fit_file: Path = typer.Argument(..., help="a fit's JSON (from `ladder law fit/envelope --json`)"),
    params: Optional[List[float]] = typer.Option(None, "--params", help="parameter count N (repeatable)"),
    total_params: Optional[List[float]] = typer.Option(None, "--total-params", help="total parameters (MoE law)"),
    tokens: Optional[List[float]] = typer.Option(None, "--tokens", help="training tokens D (repeatable)"),
    flops: Optional[List[float]] = typer.Option(None, "--flops", help="training FLOPs C (repeatable; D = C / 6N)"),
    level: Optional[float] = typer.Option(None, "--level", help="interval coverage (default: the fit's)"),
    csv: Optional[Path] = typer.Option(None, "--csv", help="predict every row of this CSV (its columns named by "
                                       "the --*-col options) instead of the values given"),
    params_col: Optional[str] = typer.Option(None, "--params-col", help="with --csv: column of N"),
    total_col: Optional[str] = typer.Option(None, "--total-params-col", help="with --csv: column of total parameters"),
    tokens_col: Optional[str] = typer.Option(None, "--tokens-col", help="with --csv: column of D"),
    flops_col: Optional[str] = typer.Option(None, "--flops-col", help="with --csv: column of C"),
    actual_col: Optional[str] = typer.Option(None, "--actual-col", help="with --csv: column of measured losses; "
                                             "each prediction is scored against it"),
    where: Optional[List[str]] = typer.Option(None, "--where", help=WHERE_HELP + "; with --csv"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Predict a saved fit at held-out points, with prediction intervals; with --csv and --actual-col,
    score it on measured losses (error per row, mean and worst relative error, interval coverage)."""
    from analysis.laws.predict import predict_saved_fit, read_saved_fit

    if csv is not None and any(v for v in (params, total_params, tokens, flops)):
        raise LadderError("give either --csv FILE with its columns or --params/--tokens/--flops values, not both")
    if csv is None and (any(v is not None for v in (params_col, total_col, tokens_col, flops_col, actual_col))
                        or where):
        raise LadderError("--params-col, --tokens-col, --flops-col, --total-params-col, --actual-col and "
                          "--where read a --csv FILE; give one")
    doc, fit = read_saved_fit(fit_file, level)
    actual = None
    if csv is not None:
        N, Nt, D, C, actual = _csv_points(csv, params_col, total_col, tokens_col, flops_col, actual_col,
                                          parse_where(where))
    else:
        N, Nt, D, C = (_positive_list(n, v) for n, v in
                       (("--params", params), ("--total-params", total_params), ("--tokens", tokens),
                        ("--flops", flops)))
    rows, out = predict_saved_fit(doc, fit, fit_file, N, Nt, D, C, level, actual)
    if actual is not None:
        out["data"] = {"file": str(csv), "actual_col": actual_col, "where": where_json(parse_where(where))}
    out = json_safe(out)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    console = Console()
    t = Table(title=f"{out['law']}  ({fit_file.name})", header_style="bold")
    cols = list(rows) + ["loss", f"{100 * out['level']:.0f}% interval"] + (["actual", "error"] if actual is not None else [])
    for c in cols:
        t.add_column(c, justify="right")
    for r in out["predictions"]:
        extra = [_fmt(r["actual"]), f"{100 * r['rel_error']:+.2f}%" + ("" if r["inside"] else " !")] \
            if actual is not None else []
        t.add_row(*[f"{r[k]:.4g}" for k in rows], _fmt(r["loss"]), f"[{_fmt(r['lo'])}, {_fmt(r['hi'])}]", *extra)
    console.print(t)
    if actual is not None:
        sc = out["score"]
        console.print(f"{sc['n']} points: mean |error| {100 * sc['mean_abs_rel_error']:.2f}%, worst "
                      f"{100 * sc['max_abs_rel_error']:.2f}%; {sc['inside']}/{sc['n']} inside the "
                      f"{100 * out['level']:.0f}% interval (!: outside)", highlight=False)
    _render_warnings(console, out["warnings"])


def isoflop_cmd(
    file: Path = typer.Argument(..., help="CSV with one row per training run"),
    params_col: str = typer.Option(..., "--params-col", help="column of parameter counts N"),
    flops_col: str = typer.Option(..., "--flops-col", help="column of training FLOPs C"),
    loss_col: str = typer.Option(..., "--loss-col", help="column of final losses"),
    where: Optional[List[str]] = typer.Option(None, "--where", help=WHERE_HELP),
    tol: float = typer.Option(0.05, "--group-tol", help="runs within this many decades of C share a budget"),
    budget: Optional[List[float]] = typer.Option(None, "--budget", help="FLOP budget for N*, D* (repeatable)"),
    as_json: bool = typer.Option(False, "--json"),
    png: Optional[Path] = typer.Option(None, "--png", help="write a plot of the profiles and minima here"),
) -> None:
    """IsoFLOP profiles (Chinchilla approach 2): a loss minimum per budget, then N*(C) and D*(C)."""
    from analysis import fitplots
    if not tol > 0:
        raise LadderError(f"--group-tol must be positive, got {tol}")
    df = load_table(file, {"N": params_col, "C": flops_col}, loss_col, 0, min_rows=3, where=parse_where(where))
    N, C, L = df[params_col].to_numpy(), df[flops_col].to_numpy(), df[loss_col].to_numpy()
    try:
        fit = fit_isoflop(N, C, L, tol=tol)
    except IsoflopError as e:
        raise LadderError(f"{file}: {e}") from None
    d = fit.to_dict()
    d["data"] = {"file": str(file), "params_col": params_col, "flops_col": flops_col, "loss_col": loss_col,
                 "group_tol": tol}
    if budget:
        d["compute_optimal"] = [fit.optimal(float(c)) for c in _positive_list("--budget", budget)]
    if png is not None:
        d["png"] = str(fitplots.plot_isoflop(N, C, L, group_budgets(C, tol), fit, png))
    d = json_safe(d)
    if as_json:
        print(json.dumps(d, indent=2))
        return
    console = Console()
    t = Table(title=f"IsoFLOP minima ({file.name})", header_style="bold")
    for c in ("C", "runs", "N*", "D*", "loss at N*"):
        t.add_column(c, justify="right")
    for m in d["minima"]:
        t.add_row(f"{m['C']:.3g}", str(m["runs"]), f"{m['N']:.3g}", f"{m['D']:.3g}", f"{m['loss']:.4g}")
    console.print(t)
    console.print(f"N* ~ C^{d['a']:.3f} (se {_fmt(d['a_se'])}), D* ~ C^{d['b']:.3f}", highlight=False)
    for r in d.get("compute_optimal", []):
        console.print(f"C = {r['C']:.3g}: N* = {r['N']:.3g}, D* = {r['D']:.3g}", highlight=False)
    _render_warnings(console, d["warnings"])


def register(app: typer.Typer) -> None:
    law_app = typer.Typer(help="Fit scaling laws to CSV files.", no_args_is_help=True)
    app.add_typer(law_app, name="law")
    law_app.command("fit")(fit_cmd)
    law_app.command("envelope")(envelope_cmd)
    law_app.command("predict")(predict_cmd)
    law_app.command("isoflop")(isoflop_cmd)
