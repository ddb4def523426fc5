"""`ladder curve fit`: fit a schedule-aware loss-curve model (analysis.curves) to CSV curves and
predict others.

    ladder curve fit --train A.csv [B.csv ...] --predict X.csv [Y.csv ...] --out DIR [--json]

Curve files have columns step, lr, loss and optionally params (the model's parameter count, the
same on every row); a file only to be predicted may leave out loss. The lr column samples the
schedule at the logged steps (linear between samples; before the first sample a linear warmup from
0 at step 0). For each predicted file DIR/<same name>.csv gets columns step, lr, loss (when given),
pred.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from ladder.errors import LadderError
from core.fsutil import json_safe

_LIST_OPTIONS = ("--train", "--predict")


def _split_lists(args: list[str]) -> dict[str, list[str]]:
    """--train A B --predict X Y (or repeated --train A --train B) from the unparsed arguments."""
    out: dict[str, list[str]] = {k: [] for k in _LIST_OPTIONS}
    current = None
    for tok in args:
        name, eq, value = tok.partition("=")
        if name in _LIST_OPTIONS:
            current = name
            if eq:
                out[current].append(value)
            continue
        if tok.startswith("-") and len(tok) > 1:
            raise LadderError(f"unknown option {tok!r} (see `ladder curve fit --help`)")
        if current is None:
            raise LadderError(f"unexpected argument {tok!r}: curve files follow --train or --predict")
        out[current].append(tok)
    return out


def _read_curve(path: Path, need_loss: bool):
    """A validated Curve from a CSV; every problem is a LadderError naming the file."""
    import pandas as pd

    from analysis.csvio import TableError, read_table
    from analysis.curves import Curve, CurveError

    try:
        header = pd.read_csv(path, nrows=0).columns if path.is_file() else []
    except Exception:
        header = []
    header = [str(c).strip() for c in header]
    has_loss = "loss" in header
    has_params = "params" in header
    cols = ["step", "lr"] + (["loss"] if need_loss or has_loss else []) + (["params"] if has_params else [])
    positive = [c for c in cols if c != "step"]
    try:
        df = read_table(path, cols, positive=positive, increasing="step", min_rows=2)
    except TableError as e:
        raise LadderError(str(e)) from None
    step = df["step"].to_numpy()
    if np.any(step < 0) or np.any(step != np.round(step)):
        bad = int(np.flatnonzero((step < 0) | (step != np.round(step)))[0]) + 1
        raise LadderError(f"{path}: column 'step' row {bad}: {step[bad - 1]:g} is not a non-negative whole step")
    params = None
    if has_params:
        p = df["params"].to_numpy()
        if np.any(p != p[0]):
            bad = int(np.flatnonzero(p != p[0])[0]) + 1
            raise LadderError(f"{path}: column 'params' must be the same on every row; row {bad} has {p[bad - 1]:g}, row 1 {p[0]:g}")
        params = float(p[0])
    try:
        return Curve(
            step=step.astype(np.int64), lr=df["lr"].to_numpy(), loss=df["loss"].to_numpy() if "loss" in df else None,
            params=params, name=path.stem,
        )
    except CurveError as e:
        raise LadderError(f"{path}: {e}") from None


def register(app: typer.Typer) -> None:
    curve_app = typer.Typer(help="Schedule-aware loss-curve models (Multi-Power Law).", no_args_is_help=True)
    app.add_typer(curve_app, name="curve")

    @curve_app.command(
        "fit", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def fit_cmd(
        ctx: typer.Context,
        out: Path = typer.Option(None, "--out", help="directory for the predicted curves (DIR/<name>.csv)"),
        as_json: bool = typer.Option(False, "--json", help="print fitted parameters and per-file errors as JSON"),
        model: str = typer.Option("mpl", "--model", help="mpl (Multi-Power Law) or lra (Tissue et al. baseline)"),
        bands: bool = typer.Option(False, "--bands", help="add lo, hi columns (90% band, 32 bootstrap refits)"),
    ) -> None:
        """Fit a loss-curve model to --train A.csv [B.csv ...] and predict --predict X.csv [Y.csv ...].

        Curve CSVs have columns step, lr, loss (loss optional in predicted files) and optionally params (parameter count, the same on every row).

        The lr column samples the schedule at the logged steps: linear between samples, a linear warmup from 0 at step 0 before the first.

        Curves of several sizes fit a size law; a predicted file's params says which size to predict.
        """
        from analysis.curves import CurveError, MODELS, fit_curves, relative_errors
        from core.fsutil import atomic_write_text

        lists = _split_lists(list(ctx.args))
        train, predict = [Path(p) for p in lists["--train"]], [Path(p) for p in lists["--predict"]]
        if not train:
            raise LadderError("give the curves to fit: --train A.csv [B.csv ...]")
        if predict and out is None:
            raise LadderError("give --out DIR for the predicted curves")
        if model not in MODELS:
            raise LadderError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
        names = [p.name for p in predict]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise LadderError(f"two --predict files share the name {dup[0]!r}: their outputs would collide in --out")
        if out is not None:
            if out.exists() and not out.is_dir():
                raise LadderError(f"--out {out}: exists and is not a directory")
            inputs = {p.resolve() for p in train + predict}
            for p in predict:
                if (out / p.name).resolve() in inputs:
                    raise LadderError(f"--out {out}: writing {p.name} there would overwrite an input file")

        train_curves = [_read_curve(p, need_loss=True) for p in train]
        pred_curves = [_read_curve(p, need_loss=False) for p in predict]
        try:
            fit = fit_curves(train_curves, model=model, n_boot=32 if bands else 0)
        except CurveError as e:
            raise LadderError(str(e)) from None

        results = []
        for path, c in zip(predict, pred_curves):
            try:
                pred = fit.predict_curve(c)
            except CurveError as e:
                raise LadderError(f"{path}: {e}") from None
            cols = {"step": c.step, "lr": c.lr}
            if c.loss is not None:
                cols["loss"] = c.loss
            cols["pred"] = pred
            if bands:
                lo, hi = fit.band(c.step, c.lr_per_step, params=c.params)
                cols["lo"], cols["hi"] = lo, hi
            buf = io.StringIO()
            buf.write(",".join(cols) + "\n")
            for row in zip(*cols.values()):
                buf.write(",".join(str(int(v)) if k == "step" else repr(float(v)) for k, v in zip(cols, row)) + "\n")
            dest = atomic_write_text(out / path.name, buf.getvalue())
            r = {"file": str(path), "out": str(dest), "n": len(c.step), "params": c.params}
            if c.loss is not None:
                r.update(relative_errors(pred, c.loss))
            results.append(r)

        d = fit.to_dict()
        doc = {
            "model": model,
            "params": fit.params,
            "curve_params": None if fit.law_kind != "none" else fit.curve_params(),
            "size_model": d.get("size_law") or d.get("size_prior"),
            "converged": True,
            "fit": {k: v for k, v in fit.info.items() if k != "train"},
            "train": [{"file": str(p), **t} for p, t in zip(train, fit.info["train"])],
            "predict": results,
        }
        with_loss = [r for r in results if "mean_rel_err" in r]
        if with_loss:
            doc["predict_summary"] = {
                "mean_rel_err": float(np.mean([r["mean_rel_err"] for r in with_loss])),
                "max_rel_err": float(max(r["max_rel_err"] for r in with_loss)),
                "mean_of_file_max_rel_err": float(np.mean([r["max_rel_err"] for r in with_loss])),
            }
        doc = json_safe(doc)
        if as_json:
            print(json.dumps(doc, indent=2))
            return
        console = Console()
        t = Table(title=f"{model} fit ({fit.info['n_points']} points, {fit.info['seconds']:.1f} s)", header_style="bold")
        t.add_column("parameter")
        t.add_column("value", justify="right")
        for k, v in fit.params.items():
            t.add_row(k, f"{v:.5g}")
        console.print(t)
        if results:
            t = Table(header_style="bold")
            for col in ("file", "points", "mean rel. err", "max rel. err", "written"):
                t.add_column(col)
            for r in results:
                t.add_row(
                    Path(r["file"]).name, str(r["n"]),
                    f"{100 * r['mean_rel_err']:.3f}%" if "mean_rel_err" in r else "-",
                    f"{100 * r['max_rel_err']:.3f}%" if "max_rel_err" in r else "-",
                    r["out"],
                )
            console.print(t)
