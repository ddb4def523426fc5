"""`ladder curve fit`: fit a schedule-aware loss-curve model (analysis.curves.fit) to CSV curves and
predict others.

    ladder curve fit --train A.csv [B.csv ...] --predict X.csv [Y.csv ...] --out DIR [--json]
        [--params FILE=N ...] [--schedule FILE=SPEC.yaml|LR.csv ...] [--bands] [--png PLOT.png]

Curve files have columns step, lr, loss and optionally params (the model's parameter count, the
same on every row); a file only to be predicted may leave out loss. Instead of a params column,
`--params FILE=N` gives a file its size (`--params N` alone: every file without one). The lr column
samples the schedule at the logged steps (linear between samples; before the first sample a linear
warmup from 0 at step 0); `--schedule FILE=S` gives a file its dense per-step schedule instead,
from a spec (YAML/JSON: core.schedule.lr_at at every step) or a per-step LR file (a CSV with an lr
column, one row per step from step 0, or one number per line), so that a sharp LR drop between
logged steps is not smeared. For each predicted file DIR/<same name>.csv gets columns step, lr,
loss (when given), pred (and lo, hi with --bands).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import typer
from typer.core import TyperCommand
from rich.console import Console
from rich.table import Table

from ladder.errors import LadderError
from core.fsutil import atomic_write_text, json_safe
from analysis.runs.csvio import TableError, read_table
from core.schedule import lr_at
from core.spec import load_spec

_LIST_OPTIONS = ("--train", "--predict", "--params", "--schedule")


def _split_lists(args: list[str], other_options: dict[str, bool] | None = None) -> dict[str, list[str]]:
    """--train A B --predict X Y (or repeated --train A --train B) from the command line's arguments;
    `other_options` (option -> takes a value) are the command's other options, stepped over."""
    out: dict[str, list[str]] = {k: [] for k in _LIST_OPTIONS}
    other_options = other_options or {}
    current = None
    skip = False
    for tok in args:
        if skip:
            skip = False
            continue
        name, eq, value = tok.partition("=")
        if name in _LIST_OPTIONS:
            current = name
            if eq:
                out[current].append(value)
            continue
        if name in other_options:
            skip = other_options[name] and not eq
            current = None
            continue
        if tok.startswith("-") and len(tok) > 1:
            raise LadderError(f"unknown option {tok!r} (see `ladder curve fit --help`)")
        if current is None:
            raise LadderError(f"unexpected argument {tok!r}: curve files follow --train or --predict")

        out[current].append(tok)
    return out


class _ListOptionsCommand(TyperCommand):
    """Keeps the command line as given, so --train A B (several values after one option, which
    click's options cannot take) is read in order while --help still lists --train and the rest."""

    def parse_args(self, ctx, args):
        ctx.meta["ladder.raw_args"] = list(args)
        return super().parse_args(ctx, args)


def _per_file(values: list[str], files: list[Path], option: str) -> dict[Path, str]:
    """FILE=VALUE pairs (FILE: a given path, its name or its stem) and a bare VALUE for every file
    without one."""
    out: dict[Path, str] = {}
    default = None
    for v in values:
        key, eq, val = v.rpartition("=")
        if not eq:
            if default is not None:
                raise LadderError(f"{option} {v!r}: a value for every file was already given ({default!r})")
            default = val
            continue
        match = [f for f in files if key in (str(f), f.name, f.stem)]
        if not match:
            raise LadderError(f"{option} {v!r}: {key!r} is none of the --train/--predict files")
        for f in match:
            out[f] = val
    if default is not None:
        for f in files:
            out.setdefault(f, default)
    return out


def _params_value(text: str, option_value: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise LadderError(f"--params {option_value!r}: {text!r} is not a number") from None
    if not (v > 0 and np.isfinite(v)):
        raise LadderError(f"--params {option_value!r}: the parameter count must be positive")
    return v


def _dense_schedule(source: str) -> np.ndarray:
    """A per-step LR array from a spec file (YAML/JSON) or a per-step LR file."""
    import pandas as pd

    path = Path(source)
    if not path.is_file():
        raise LadderError(f"--schedule {source}: no such file")
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        spec = load_spec(path)
        return np.asarray(lr_at(spec, np.arange(spec.total_steps)), dtype=np.float64)
    try:
        df = pd.read_csv(path)
    except (ValueError, OSError) as e:  # pandas' ParserError and EmptyDataError are ValueErrors, as is a UnicodeDecodeError
        raise LadderError(f"--schedule {source}: not a readable per-step LR file ({e})") from None
    df.columns = [str(c).strip() for c in df.columns]
    if "lr" in df.columns:
        lr = pd.to_numeric(df["lr"], errors="coerce").to_numpy(dtype=np.float64)
        if "step" in df.columns:
            st = pd.to_numeric(df["step"], errors="coerce").to_numpy(dtype=np.float64)
            if not np.array_equal(st, np.arange(len(st))):
                raise LadderError(f"--schedule {source}: column 'step' must be 0, 1, 2, ... (one row per step)")
    else:  # one number per line, no header
        lr = pd.read_csv(path, header=None).iloc[:, 0]
        lr = pd.to_numeric(lr, errors="coerce").to_numpy(dtype=np.float64)
    if not len(lr) or not np.all(np.isfinite(lr)) or np.any(lr < 0):
        bad = int(np.flatnonzero(~np.isfinite(lr) | (lr < 0))[0]) + 1 if len(lr) else 0
        raise LadderError(f"--schedule {source}: the LR of row {bad} is not a non-negative number")
    return lr


def _read_curve(path: Path, need_loss: bool, params: float | None = None, schedule: np.ndarray | None = None):
    """A validated Curve from a CSV; every problem is a LadderError naming the file."""
    import pandas as pd

    from analysis.curves.fit import Curve, CurveError

    try:
        header = pd.read_csv(path, nrows=0).columns if path.is_file() else []
    except (ValueError, OSError):  # no header to read: read_table below says what is wrong with the file
        header = []
    header = [str(c).strip() for c in header]
    has_loss = "loss" in header
    has_params = "params" in header and params is None
    has_lr = "lr" in header or schedule is None
    cols = ["step"] + (["lr"] if has_lr else []) + (["loss"] if need_loss or has_loss else []) + (
        ["params"] if has_params else [])
    positive = [c for c in cols if c != "step"]
    try:
        df = read_table(path, cols, positive=positive, increasing="step", min_rows=2)
    except TableError as e:
        raise LadderError(str(e)) from None
    step = df["step"].to_numpy()
    if np.any(step < 0) or np.any(step != np.round(step)):
        bad = int(np.flatnonzero((step < 0) | (step != np.round(step)))[0]) + 1
        raise LadderError(f"{path}: column 'step' row {bad}: {step[bad - 1]:g} is not a non-negative whole step")
    if has_params:
        p = df["params"].to_numpy()
        if np.any(p != p[0]):
            bad = int(np.flatnonzero(p != p[0])[0]) + 1
            raise LadderError(f"{path}: column 'params' must be the same on every row; row {bad} has {p[bad - 1]:g}, row 1 {p[0]:g}")
        params = float(p[0])
    if schedule is not None and len(schedule) <= step[-1]:
        raise LadderError(f"{path}: its --schedule has {len(schedule)} steps, the curve reaches step {int(step[-1])}")
    try:
        return Curve(
            step=step.astype(np.int64), lr=schedule if schedule is not None else df["lr"].to_numpy(),
            loss=df["loss"].to_numpy() if "loss" in df else None, params=params, name=path.stem,
        )
    except CurveError as e:
        raise LadderError(f"{path}: {e}") from None


def _write_csv(dest: Path, cols: dict) -> Path:
    buf = io.StringIO()
    buf.write(",".join(cols) + "\n")
    for row in zip(*cols.values()):
        buf.write(",".join(str(int(v)) if k == "step" else repr(float(v)) for k, v in zip(cols, row)) + "\n")
    return atomic_write_text(dest, buf.getvalue())


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.3f}%"


def fit_cmd(
    ctx: typer.Context,
    _train: list[str] = typer.Option(None, "--train", metavar="A.csv [B.csv ...]",
                                     help="curves to fit (step, lr, loss; params optional)"),
    _predict: list[str] = typer.Option(None, "--predict", metavar="X.csv [Y.csv ...]",
                                       help="curves to predict (step, lr; loss optional, then scored)"),
    _params: list[str] = typer.Option(None, "--params", metavar="FILE=N | N",
                                      help="a file's parameter count (N alone: every file without one)"),
    _schedule: list[str] = typer.Option(None, "--schedule", metavar="FILE=SPEC.yaml | FILE=LR.csv",
                                        help="a file's dense per-step schedule"),
    out: Path = typer.Option(None, "--out", help="directory for the predicted curves (DIR/<name>.csv)"),
    as_json: bool = typer.Option(False, "--json", help="print fitted parameters and per-file errors as JSON"),
    model: str = typer.Option("mpl", "--model", help="mpl (Multi-Power Law) or lra (Tissue et al. baseline)"),
    bands: bool = typer.Option(False, "--bands", help="add lo, hi columns (90% band, 32 bootstrap refits, "
                                                      "calibrated leave-one-curve-out)"),
    size_prior: str = typer.Option("kaplan-floor", "--size-prior",
                                    help="one training size: kaplan-floor, kaplan or chinchilla"),
    png: Path = typer.Option(None, "--png", help="write a plot of the curves, fits and bands here"),
) -> None:
    """Fit a loss-curve model to --train A.csv [B.csv ...] and predict --predict X.csv [Y.csv ...].

    Curve CSVs have columns step, lr, loss (loss optional in predicted files) and optionally params (parameter count, the same on every row).

    --params FILE=N gives a file its size (--params N: every file without one); --schedule FILE=SPEC.yaml or FILE=LR.csv gives it a dense per-step schedule.

    The lr column samples the schedule at the logged steps: linear between samples, a linear warmup from 0 at step 0 before the first.

    Curves of several sizes fit a size law; a predicted file's params says which size to predict.
    """
    from analysis import fitplots
    from analysis.curves.fit import MODELS, SIZE_PRIORS, CurveError, fit_curves, relative_errors

    values = {o: not p.is_flag for p in ctx.command.params if p.param_type_name == "option"
              for o in p.opts if o not in _LIST_OPTIONS}
    lists = _split_lists(ctx.meta.get("ladder.raw_args", list(ctx.args)), values)
    train, predict = [Path(p) for p in lists["--train"]], [Path(p) for p in lists["--predict"]]
    if not train:
        raise LadderError("give the curves to fit: --train A.csv [B.csv ...]")
    if predict and out is None:
        raise LadderError("give --out DIR for the predicted curves")
    if model not in MODELS:
        raise LadderError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    if size_prior not in SIZE_PRIORS:
        raise LadderError(f"--size-prior must be one of {', '.join(SIZE_PRIORS)}, got {size_prior!r}")
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
    files = train + predict
    sizes = {f: _params_value(v, v) for f, v in _per_file(lists["--params"], files, "--params").items()}
    scheds = {}
    for f, src in _per_file(lists["--schedule"], files, "--schedule").items():
        scheds[f] = _dense_schedule(src)

    train_curves = [_read_curve(p, True, sizes.get(p), scheds.get(p)) for p in train]
    pred_curves = [_read_curve(p, False, sizes.get(p), scheds.get(p)) for p in predict]
    try:
        fit = fit_curves(train_curves, model=model, n_boot=32 if bands else 0, size_prior=size_prior)
    except CurveError as e:
        raise LadderError(str(e)) from None

    results, plots = [], []
    for c in train_curves:
        plots.append({"name": c.name, "step": c.step, "loss": c.loss, "pred": fit.predict_curve(c), "train": True})
    warnings = list(fit.warnings)
    for path, c in zip(predict, pred_curves):
        try:
            pred = fit.predict_curve(c)
        except CurveError as e:
            raise LadderError(f"{path}: {e}") from None
        cols = {"step": c.step, "lr": c.lr_per_step[c.step]}
        if c.loss is not None:
            cols["loss"] = c.loss
        cols["pred"] = pred
        r = {"file": str(path), "n": len(c.step), "params": c.params}
        if bands:
            lo, hi = fit.band(c.step, c.lr_per_step, params=c.params)
            cols["lo"], cols["hi"] = lo, hi
            r["band_rel_width"] = float(np.mean((hi - lo) / pred))
            if c.loss is not None:
                r["coverage"] = float(np.mean((c.loss >= lo) & (c.loss <= hi)))
        r["out"] = str(_write_csv(out / path.name, cols))
        if c.loss is not None:
            r.update(relative_errors(pred, c.loss))
            r["mean_signed_rel_err"] = float(np.mean((pred - c.loss) / c.loss))
        pw = fit.predict_warnings(c.params)
        if pw:
            r["warnings"] = pw
            warnings += [f"{path.name}: {w}" for w in pw]
        results.append(r)
        plots.append({"name": c.name, "step": c.step, "loss": c.loss, "pred": pred,
                      "lo": cols.get("lo"), "hi": cols.get("hi")})

    d = fit.to_dict()
    doc = {
        "model": model,
        "params": fit.params,
        "curve_params": None if fit.law_kind != "none" else fit.curve_params(),
        "size_model": d.get("size_law") or d.get("size_prior"),
        "converged": fit.converged,
        "warnings": warnings,
        "fit": {k: v for k, v in fit.info.items() if k != "train"},
        "train": [{"file": str(p), **t} for p, t in zip(train, fit.info["train"])],
        "predict": results,
    }
    if bands:
        doc["band"] = {"level": 0.9, "method": d["band_method"], "calibration": fit.calibration}
    with_loss = [r for r in results if "mean_rel_err" in r]
    if with_loss:
        doc["predict_summary"] = {
            "mean_rel_err": float(np.mean([r["mean_rel_err"] for r in with_loss])),
            "max_rel_err": float(max(r["max_rel_err"] for r in with_loss)),
            "mean_of_file_max_rel_err": float(np.mean([r["max_rel_err"] for r in with_loss])),
        }
        if bands:
            doc["predict_summary"]["coverage"] = float(
                np.sum([r["coverage"] * r["n"] for r in with_loss]) / np.sum([r["n"] for r in with_loss]))
            doc["predict_summary"]["band_rel_width"] = float(np.mean([r["band_rel_width"] for r in with_loss]))
    if png is not None:
        doc["png"] = str(fitplots.plot_curves(plots, png, f"{model} fit"))
    doc = json_safe(doc)
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    console = Console()
    t = Table(title=f"{model} fit ({fit.info['n_points']} points, {fit.info['seconds']:.1f} s, "
                    f"converged {fit.converged})", header_style="bold")
    t.add_column("parameter")
    t.add_column("value", justify="right")
    for k, v in fit.params.items():
        t.add_row(k, f"{v:.5g}")
    console.print(t)
    if results:
        t = Table(header_style="bold")
        heads = ["file", "points", "mean rel. err", "max rel. err"] + (["90% band holds", "band width"] if bands else [])
        for col in heads + ["written"]:
            t.add_column(col)
        for r in results:
            row = [Path(r["file"]).name, str(r["n"]), _pct(r.get("mean_rel_err")), _pct(r.get("max_rel_err"))]
            if bands:
                row += [_pct(r.get("coverage")), _pct(r.get("band_rel_width"))]
            t.add_row(*row, r["out"])
        console.print(t)
    if not warnings:
        console.print("warnings: none", highlight=False)
    for w in warnings:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)


def register(app: typer.Typer) -> None:
    curve_app = typer.Typer(help="Schedule-aware loss-curve models (Multi-Power Law).", no_args_is_help=True)
    app.add_typer(curve_app, name="curve")
    curve_app.command(
        "fit", cls=_ListOptionsCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(fit_cmd)
