"""Backtests of every forecast interval on every dataset the project has: the table in docs/results/forecast-backtests.md.

Each row: a dataset, a split (what was fitted, what was predicted), the method, the number of
held-out points, their mean absolute relative error, the share inside the 90% interval (coverage)
and the interval's mean relative width (hi - lo) / prediction.

Datasets:
- chinchilla: Epoch AI's 240 Chinchilla points (5 highest-loss dropped), L(N, D): 10-fold
  cross-validation, and a fit on N <= max/4 predicting the rest; and the hero final-loss interval's
  method on ladders cut from their compute envelope (4 points predicting the next 2).
- multipower 25M / 100M (tests/data/multipower): the published protocol (fit cosine_24000,
  constant_24000, wsdcon_9; predict the other six), and across sizes: one size's protocol curves
  predict all nine curves of the other size (4x up and 4x down), told only N; with and without the
  fitted size's deviations at equal steps (the two sizes read one data order).
- a ladder directory of run dirs (spec.yaml + metrics.jsonl), e.g. the CPU demo's
  (`--ladder DIR`, default: trains experiments/proxy_cpu.py with its hero into --root) and, when
  present, docs/results/h200_ladder (its h200_ladder.tar.gz, unpacked into a temporary directory;
  whatever runs it holds): nested leave-largest-out of the final-loss law, the curve model
  predicting the largest rung's curve from the others (with and without the smaller runs' stream
  deviations, analysis.forecast.stream_residual), each one-size prior predicting every rung's curve from the
  next smaller rung's alone, the grad-norm envelope's nested backtest, and the hero forecast against
  the hero's own run when it has finished (its trajectory with and without stream deviations).

    .venv/bin/python bench/forecast_backtest.py [--ladder DIR ...] [--root DIR] [--no-train] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.laws import backtest as law_backtest
from analysis.runs import replicates
from analysis.forecast.file import ForecastTrajectory
from analysis.forecast.final_loss import TAU_PRIOR, Point
from analysis.curves.fit import SIZE_PRIORS, Curve, CurveError, fit_curves
from analysis.forecast.hero import (FIT_FROM, RungRun, final_interval, final_loss_coverage, floor_law, forecast,
                               largest_family_out, on_run_steps, rung_curves, trajectory_forecast)
from analysis.forecast.gradnorm import RungGrad, backtest as gn_backtest
from analysis.laws.fit import fit_envelope
from analysis.runs.metrics import read_metrics_frame
from analysis.forecast.stream_residual import StreamRun, deviations, same_stream
from analysis.forecast.stream_residual import transfer as stream_transfer
from core.rundir import iter_run_dirs
from core.spec import load_spec
from ladder.ledger import ladder_root

ROOT = Path(__file__).resolve().parents[1]

LEVEL = 0.9
CHINCHILLA = ROOT / "tests" / "data" / "chinchilla" / "svg_extracted_data.csv"
MULTIPOWER = ROOT / "tests" / "data" / "multipower"
H200 = ROOT / "docs" / "results" / "h200_ladder"
TRAIN = ["cosine_24000", "constant_24000", "wsdcon_9"]
TEST = ["constant_72000", "cosine_72000", "wsd_20000_24000", "wsdld_20000_24000", "wsdcon_3", "wsdcon_18"]
SIZES = {"25M": 25e6, "100M": 100e6}
ROWS: list[dict] = []


def row(dataset, split, method, n, err, cov, width, note=""):
    r = {"dataset": dataset, "split": split, "method": method, "n": n, "mean_abs_rel_err": err,
         "coverage": cov, "mean_rel_width": width, "note": note}
    ROWS.append(r)
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    print(f"{dataset:12s} {split:44s} {method:30s} n={n:<5d} err {pct(err):>7s} cover {pct(cov):>7s} "
          f"width {pct(width):>7s} {note}", flush=True)


# ---- Chinchilla ----------------------------------------------------------------------------------


def chinchilla() -> None:
    df = pd.read_csv(CHINCHILLA).sort_values("loss", kind="stable").iloc[:-5]
    N = df["Model Size"].to_numpy()
    D = df["Training FLOP"].to_numpy() / (6 * N)
    L = df["loss"].to_numpy()
    cv = law_backtest.cross_validate(law_backtest.fit_n_d, [N, D], L, level=LEVEL)
    row("chinchilla", "10-fold, held-out points", "L(N,D) prediction interval", cv["n"], cv["mean_abs_rel_err"],
        cv["coverage"], cv["mean_rel_width"])
    ex = law_backtest.extrapolate(law_backtest.fit_n_d, [N, D], L, level=LEVEL)
    row("chinchilla", f"fit N <= max/4, predict N up to {ex['reach']:.1f}x beyond", "L(N,D) prediction interval",
        ex["n"], ex["mean_abs_rel_err"], ex["coverage"], ex["mean_rel_width"])


def _envelopes(C: np.ndarray, L: np.ndarray) -> list[list[Point]]:
    """Compute envelopes of the Chinchilla points: the least loss per bin of log10 C (bins 0.5 and 0.6
    decades wide, each at two offsets), each sorted by compute."""
    lc = np.log10(C)
    out = []
    for width in (0.5, 0.6):
        for off in (0.0, width / 2):
            edges = np.arange(lc.min() - off, lc.max() + width, width)
            env = []
            for a, b in zip(edges[:-1], edges[1:]):
                m = (lc >= a) & (lc < b)
                if m.any():
                    i = int(np.argmin(np.where(m, L, np.inf)))
                    env.append(Point(f"C={C[i]:.3g}", float(C[i]), float(L[i])))
            out.append(sorted(env, key=lambda r: r.flops))
    return out


def chinchilla_envelope() -> None:
    """The hero final-loss interval's method (analysis.forecast.final_loss) on ladders cut from the Chinchilla
    points' compute envelopes: every window of 4 and of 6 consecutive envelope points predicting the
    next 2 (2-17x beyond). Also the extrapolation error per e-fold of compute that the method's prior
    TAU_PRIOR states: sqrt(sum e^2 / sum rho^2) of the point fits of 4 points on the next 2."""
    df = pd.read_csv(CHINCHILLA).sort_values("loss", kind="stable").iloc[:-5]
    C, L = df["Training FLOP"].to_numpy(), df["loss"].to_numpy()
    envs = _envelopes(C, L)
    for size in (4, 6):
        pred, lo, hi, act = [], [], [], []
        for env in envs:
            for s in range(len(env) - size):
                for t in env[s + size:s + size + 2]:
                    m_, l_, h_, _ = final_interval(env[s:s + size], t.flops)
                    pred.append(m_), lo.append(l_), hi.append(h_), act.append(t.final_loss if hasattr(t, "final_loss") else t.loss)
        r = law_backtest.summarise(pred, lo, hi, act)
        row("chinchilla", f"compute envelope: {size} points predict the next 2", "hero final-loss interval's method",
            r["n"], r["mean_abs_rel_err"], r["coverage"], r["mean_rel_width"], "4 binnings of the envelope; windows overlap")
    e2, r2 = 0.0, 0.0
    for env in envs:
        for s in range(len(env) - 4):
            fit = fit_envelope([p.flops for p in env[s:s + 4]], [p.loss for p in env[s:s + 4]], strict=False,
                               n_bootstrap=0)
            for t in env[s + 4:s + 6]:
                e2 += math.log(t.loss / fit.predict(t.flops)["loss"]) ** 2
                r2 += math.log(t.flops / env[s + 3].flops) ** 2
    print(f"chinchilla envelopes: extrapolation error per e-fold of compute sqrt(sum e^2 / sum rho^2) = "
          f"{math.sqrt(e2 / r2):.4f} (analysis.forecast.final_loss.TAU_PRIOR = {TAU_PRIOR})")


# ---- multipower ----------------------------------------------------------------------------------


def _load(size: str, name: str, params: float | None = None) -> Curve:
    df = pd.read_csv(MULTIPOWER / size / f"{name}.csv")
    return Curve(df["step"].to_numpy(), df["lr"].to_numpy(), df["loss"].to_numpy(), params=params, name=name)


def _curve_scores(fit, curves: list[Curve]) -> tuple[int, float, float, float]:
    n, err, inside, width = 0, [], [], []
    for c in curves:
        pred = fit.predict_curve(c)
        lo, hi = fit.band(c.step, c.lr_per_step, params=c.params, level=LEVEL)
        err.append(np.abs(pred / c.loss - 1))
        inside.append((c.loss >= lo) & (c.loss <= hi))
        width.append((hi - lo) / pred)
        n += len(c.step)
    cat = np.concatenate
    # mean over files of each file's mean error, as the paper reports
    return n, float(np.mean([e.mean() for e in err])), float(cat(inside).mean()), float(cat(width).mean())


def multipower(boot: int) -> None:
    for size, N in SIZES.items():
        fit = fit_curves([_load(size, n) for n in TRAIN], n_boot=boot)
        n, e, c, w = _curve_scores(fit, [_load(size, t) for t in TEST])
        row(f"multipower {size}", "protocol: fit 3 schedules, predict 6", "MPL band (calibrated LOO-curve)", n, e, c, w,
            f"calib x{fit.calib:.2f}")
    for src, dst in (("25M", "100M"), ("100M", "25M")):
        for prior in SIZE_PRIORS:
            fit = fit_curves([_load(src, n, SIZES[src]) for n in TRAIN], n_boot=boot, size_prior=prior)
            n, e, c, w = _curve_scores(fit, [_load(dst, t, SIZES[dst]) for t in TRAIN + TEST])
            row("multipower", f"{src} protocol curves -> all 9 {dst} curves", f"MPL, one-size {prior} prior",
                n, e, c, w)


def multipower_stream(width: int = 5) -> None:
    """Stream deviations across sizes on multipower: the two sizes' curves read one data order (their
    deviations at equal steps correlate 0.96-0.99), logged every 64-128 steps, so a logged point stands
    for its step alone. Each 25M / 100M curve's forecast from the other size's protocol fit (default
    prior) is multiplied by exp(the mean deviation of the fitted size's protocol curves at that step),
    a deviation being log loss minus its centred rolling mean over `width` logged points. Errors only."""
    def dev(size: str, name: str) -> pd.Series:
        df = pd.read_csv(MULTIPOWER / size / f"{name}.csv")
        run = StreamRun(name, df["step"], df["loss"], 1.0)
        return pd.Series(deviations(run, width), index=run.steps)

    for src, dst in (("25M", "100M"), ("100M", "25M")):
        fit = fit_curves([_load(src, n, SIZES[src]) for n in TRAIN])
        seen = pd.concat([dev(src, n) for n in TRAIN], axis=1).mean(axis=1)
        errs, covered, n = [], [], 0
        for t in TRAIN + TEST:
            c = _load(dst, t, SIZES[dst])
            d = seen.reindex(c.step).to_numpy()
            p = fit.predict_curve(c) * np.exp(np.nan_to_num(d))
            errs.append(float(np.mean(np.abs(p / c.loss - 1))))
            covered.append(np.isfinite(d).mean())
            n += len(c.step)
        row("multipower", f"{src} protocol curves -> all 9 {dst} curves", "MPL kaplan-floor + stream deviations", n,
            float(np.mean(errs)), None, None,
            f"trend over {width} logged points; {100 * np.mean(covered):.0f}% of points covered")


# ---- ladders (run directories) ---------------------------------------------------------------------


def load_ladder(path: Path) -> tuple[list[RungRun], RungRun | None, list[RungRun]]:
    """(the rungs, the hero of the lowest seed, every hero run: its replicates too)."""
    rungs, heroes = [], []
    for rd in iter_run_dirs(path):
        if not rd.metrics_path.exists():
            continue
        spec = load_spec(rd.spec_path)
        run = RungRun(spec, rd.path, read_metrics_frame(rd.metrics_path))
        if spec.role == "hero":
            heroes.append(run)
        elif spec.role == "rung":
            rungs.append(run)
    heroes.sort(key=lambda r: (r.spec.seed, r.spec.name))
    return sorted(rungs, key=lambda r: r.flops), (heroes[0] if heroes else None), heroes


def _finished(r: RungRun) -> bool:
    return len(r.metrics) and int(r.metrics["step"].max()) + 1 >= r.spec.total_steps


def ladder(name: str, path: Path, boot: int) -> None:
    rungs, hero, heroes = load_ladder(path)
    rungs = [r for r in rungs if _finished(r)]
    if len(replicates.group(rungs)) < 3:
        print(f"{name}: {len(rungs)} finished rungs in {path}; skipped")
        return
    # final loss: each rung family with >= 3 smaller ones from those, the hero interval's whole method
    # (analysis.forecast.final_loss: fit + measurement + nested backtest, t-calibrated), and the bare law's interval
    cov = final_loss_coverage(rungs)
    if cov:
        row(name, "final loss: each rung family from the smaller ones", "hero final-loss interval's method", cov["n"],
            cov["mean_abs_rel_err"], cov["coverage"], cov["mean_rel_width"], f"held out {', '.join(cov['held_out'])}")
    fams = replicates.group(rungs)
    if any(f.n > 1 for f in fams):
        nz = replicates.noise(fams)
        print(f"{name}: seed spread {100 * (nz.seed_var or 0) ** 0.5:.2f}% of final eval loss ({nz.seed_dof} dof), "
              f"eval standard error {100 * nz.eval_var ** 0.5:.2f}%")
    # the curve model: the largest rung's curve (and the hero's) from the smaller runs, told only its
    # size and schedule; curves as the forecast fits them (analysis.forecast.hero.rung_curves); one run (the
    # first seed) per rung family, so that no replicate of a held-out rung is among the fitted
    faces = sorted((f.runs[0] for f in fams), key=lambda r: r.flops)
    runs = faces + ([hero] if hero is not None and _finished(hero) else [])
    curves = rung_curves(runs, min(r.spec.data.tokens_per_step for r in runs))
    for k in range(len(faces) - 1, len(runs)):
        try:
            fit = fit_curves(curves[:k], n_boot=boot)
            n, e, c, w = _curve_scores(fit, [curves[k]])
            row(name, f"train curve of {runs[k].spec.name} from the {k} smaller runs", "MPL size law band", n, e, c, w,
                f"vs 25-step mean {100 * _smooth_err(fit, curves[k]):.2f}%, per-step noise {100 * _noise(curves[k]):.2f}%"
                + ("; not converged" if not fit.converged else ""))
            _stream_row(name, fit, runs[:k], runs[k], curves[k])
        except Exception as err:  # a failed fit is a result too
            print(f"{name}: curve model failed: {err}")
        try:  # the same with the floor's size law (E, p) held at the compute law's of those runs
            E, p = floor_law(runs[:k])
            fit = fit_curves(curves[:k], n_boot=boot, floor_law=(E, p))
            n, e, c, w = _curve_scores(fit, [curves[k]])
            row(name, f"train curve of {runs[k].spec.name} from the {k} smaller runs",
                f"MPL size law, floor E {E:.3g} p {p:.3f} from L(C)", n, e, c, w,
                f"vs 25-step mean {100 * _smooth_err(fit, curves[k]):.2f}%" + ("; not converged" if not fit.converged else ""))
        except Exception as err:
            print(f"{name}: curve model with the compute law's floor failed: {err}")
    for stream in (False, True):  # the same, its level anchored to the compute law's forecast of the final loss
        try:  # (as the hero's), without and with the stream deviations of the smaller rungs
            base, held = largest_family_out(rungs)
            mean, lo, hi, _ = final_interval(base, held[0].flops)
            traj = trajectory_forecast(base, held[0].spec, {"mean": mean, "lo": lo, "hi": hi, "level": LEVEL},
                                       stream_deviations=stream).band
            _trajectory_row(name, f"train curve of {held[0].spec.name} from the smaller rungs",
                            "curve model on L(C)'s final loss" + (" + stream deviations" if stream else ""), traj, held[0])
        except Exception as err:
            print(f"{name}: anchored curve model failed: {err}")
    one_size_priors(name, curves, boot)
    two_sizes(name, curves, boot)
    gn = gn_backtest([_grad(r) for r in faces])
    if gn:
        row(name, "grad norm: each rung >= 3rd from the smaller", "grad-norm envelope", gn["n"],
            gn["mean_abs_rel_err"], gn["coverage"], gn["mean_rel_width"])
    if hero is None or not _finished(hero):
        return
    hf = forecast(name, rungs, hero.spec)
    fl = hf.hero.final_loss
    for h in [x for x in heroes if _finished(x)]:  # every seed of the hero against the one forecast
        act = h.final_loss
        row(name, f"hero {h.spec.name} final eval loss", "hero final-loss interval", 1, abs(fl["mean"] / act - 1),
            float(fl["lo"] <= act <= fl["hi"]), (fl["hi"] - fl["lo"]) / fl["mean"],
            f"sd: fit {fl['sd']['fit']:.4f}, measurement {fl['sd']['measurement']:.4f}, backtest {fl['sd']['backtest']:.4f}")
    for stream in (False, True):  # the default forecast carries stream deviations (analysis.forecast.hero.STREAM_DEVIATIONS)
        tr = hf.trajectory if stream else forecast(name, rungs, hero.spec, stream_deviations=False).trajectory
        _trajectory_row(name, f"hero {hero.spec.name} train-loss trajectory",
                        f"trajectory band ({tr.method or ''}, {_factors(tr)})", tr, hero)
    g = hf.grad_norm
    hg = _grad(hero)
    glo, ghi, gm = (np.interp(hg.frac, g["frac"], g[k]) for k in ("lo", "hi", "mean"))
    row(name, f"hero {hero.spec.name} grad norm, every step", "grad-norm envelope", len(hg.g),
        float(np.mean(np.abs(gm / hg.g - 1))), float(np.mean((hg.g >= glo) & (hg.g <= ghi))),
        float(np.mean((ghi - glo) / gm)))


def _trajectory_row(name: str, split: str, method: str, tr: ForecastTrajectory, run: RungRun) -> None:
    """A forecast trajectory against a run's per-step train loss; the note gives the error against the
    run's centred 25-step mean too (what a forecast of the expected loss can reach)."""
    p, l, h, y = on_run_steps(tr, run)
    s = law_backtest.summarise(p, l, h, y)
    row(name, split, method, s["n"], s["mean_abs_rel_err"], s["coverage"], s["mean_rel_width"],
        f"vs 25-step mean {100 * _mean25_err(p, y):.2f}%" + _covered_note(tr))


def _factors(tr: ForecastTrajectory) -> str:
    cal = tr.calibration or {}
    out = f"x{cal.get('factor', 1):.2f}"
    return out + (f", covered x{cal['factor_covered']:.2f}" if "factor_covered" in cal else "")


def _mean25_err(pred, loss) -> float:
    """Mean |relative error| of the forecast's centred 25-step mean against the run's (for a smooth
    forecast, the forecast itself against the run's 25-step mean)."""
    sm = lambda v: pd.Series(v).rolling(25, center=True, min_periods=1).mean().to_numpy()  # noqa: E731
    return float(np.mean(np.abs(sm(pred) / sm(loss) - 1)))


def _covered_note(tr: ForecastTrajectory) -> str:
    st = tr.stream or {}
    if not st.get("covered_steps"):
        return ""
    return f"; stream deviations on {st['covered_steps']} steps, left sd {100 * st['residual_sd']:.2f}%"


def _stream_row(name: str, fit, base: list[RungRun], target: RungRun, c: Curve) -> None:
    """The curve model's forecast times the stream deviations that the smaller runs measured at the
    target's tokens (analysis.forecast.stream_residual), scored per step (no band: errors only)."""
    srs = [StreamRun.from_run(r) for r in same_stream(target.spec, base)]
    df = target.metrics.dropna(subset=["loss"])
    st = df["step"].to_numpy()[df["step"].to_numpy() >= FIT_FROM * target.spec.total_steps]
    dev, cov = stream_transfer(srs, st, target.spec.data.tokens_per_step)
    p = fit.predict_curve(c) * np.exp(dev)
    row(name, f"train curve of {target.spec.name} from the {len(base)} smaller runs", "MPL size law + stream deviations",
        len(p), float(np.mean(np.abs(p / c.loss - 1))), None, None,
        f"vs 25-step mean {100 * _mean25_err(p, c.loss):.2f}%; {100 * cov.mean():.0f}% of its steps covered, "
        f"per-step error there {100 * float(np.mean(np.abs(p[cov] / c.loss[cov] - 1))):.2f}%")


def _smooth_err(fit, c: Curve) -> float:
    smooth = pd.Series(c.loss).rolling(25, center=True, min_periods=1).mean().to_numpy()
    return float(np.mean(np.abs(fit.predict_curve(c) / smooth - 1)))


def _noise(c: Curve) -> float:
    """The floor of any forecast's error on a per-step train loss: its mean relative deviation from
    its own centred 25-step mean."""
    smooth = pd.Series(c.loss).rolling(25, center=True, min_periods=1).mean().to_numpy()
    return float(np.mean(np.abs(c.loss / smooth - 1)))


def two_sizes(name: str, curves: list[Curve], boot: int) -> None:
    """Two consecutive sizes' curves predicting the curve of the size nearest 4x beyond the larger (3-6x),
    with the size term the fit measures itself (the larger size predicted from the smaller)."""
    n, errs, inside, width, notes = 0, [], [], [], []
    for i in range(len(curves) - 2):
        a, b = curves[i], curves[i + 1]
        far = [c for c in curves[i + 2:] if 3.0 <= c.params / b.params <= 6.0]
        if not far:
            continue
        t = min(far, key=lambda c: abs(math.log(c.params / b.params / 4.0)))
        try:
            fit = fit_curves([a, b], n_boot=boot)
        except CurveError as err:
            print(f"{name}: two-size fit of {a.name}, {b.name} failed: {err}")
            continue
        k, e, c, w = _curve_scores(fit, [t])
        n, errs, inside, width = n + k, errs + [e], inside + [c * k], width + [w * k]
        notes.append(f"{a.name}+{b.name} -> {t.name} ({t.params / b.params:.1f}x): cover {100 * c:.0f}%, width "
                     f"{100 * w:.1f}%, size sd {fit.size_term:.4f}/e-fold")
    if n:
        row(name, "two sizes' curves -> the size ~4x beyond", "MPL size law, measured size term", n,
            float(np.mean(errs)), sum(inside) / n, sum(width) / n, "; ".join(notes))


def one_size_priors(name: str, curves: list[Curve], boot: int) -> None:
    """Each run's curve from the next smaller run's alone, under each one-size prior (pooled rows)."""
    fits = []
    for small, big in zip(curves, curves[1:]):
        try:
            fits.append((fit_curves([small], n_boot=boot), big))
        except CurveError as err:
            print(f"{name}: one-size fit of {small.name} failed: {err}")
    if not fits:
        return
    for prior in SIZE_PRIORS:
        n, errs, inside, width = 0, [], [], []
        for fit, big in fits:
            fit.size_prior = prior
            k, e, c, w = _curve_scores(fit, [big])
            n, errs, inside, width = n + k, errs + [e], inside + [c * k], width + [w * k]
        row(name, f"each run's curve from the next smaller run's ({len(fits)} pairs)", f"MPL, one-size {prior} prior",
            n, float(np.mean(errs)), sum(inside) / n, sum(width) / n)


def _grad(r: RungRun) -> RungGrad:
    df = r.metrics.dropna(subset=["grad_norm"])
    return RungGrad(r.spec.name, r.active, (df["step"].to_numpy() + 1) / r.spec.total_steps, df["grad_norm"].to_numpy())


def unpacked(path: Path, tmp: Path) -> Path:
    """A directory of run dirs as it is, or the runs of its *.tar.gz results unpacked under tmp."""
    tars = sorted(path.glob("*_ladder.tar.gz")) if path.is_dir() else []
    if not tars or any(True for _ in iter_run_dirs(path)):
        return path
    out = tmp / path.name
    for t in tars:
        with tarfile.open(t) as tar:
            tar.extractall(out, filter="data")
    return out


def markdown() -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    lines = ["| dataset | split | method | n | mean error | 90% coverage | mean width | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r['dataset']} | {r['split']} | {r['method']} | {r['n']} | {pct(r['mean_abs_rel_err'])} | "
                     f"{pct(r['coverage'])} | {pct(r['mean_rel_width'])} | {r['note']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ladder", type=Path, action="append", default=None,
                    help="a ladder's run directories (default: the CPU demo's under --root, and docs/results/h200_ladder)")
    ap.add_argument("--root", default=None, help="ladder root for the CPU demo (default $MOE_LADDER_ROOT or ./.ladder)")
    ap.add_argument("--no-train", action="store_true", help="do not train the CPU demo's missing runs")
    ap.add_argument("--boot", type=int, default=16, help="bootstrap refits per curve fit")
    ap.add_argument("--markdown", action="store_true", help="print the Markdown table at the end")
    ap.add_argument("--only", choices=("chinchilla", "multipower", "ladders"), action="append")
    args = ap.parse_args()
    only = set(args.only or ("chinchilla", "multipower", "ladders"))
    if "chinchilla" in only:
        chinchilla()
        chinchilla_envelope()
    if "multipower" in only:
        multipower(args.boot)
        multipower_stream()
    if "ladders" in only:
        ladders = args.ladder
        if ladders is None:
            root = ladder_root(args.root)
            if not args.no_train:
                subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(ROOT / "experiments" / "proxy_cpu.py"),
                                "--include-hero", "--no-tracking", *(["--root", args.root] if args.root else [])],
                               check=True)
            ladders = [Path(root) / "runs" / "proxy_cpu"] + ([H200] if (H200 / "h200_ladder.tar.gz").exists() else [])
        with tempfile.TemporaryDirectory() as tmp:
            for p in ladders:
                ladder("h200 ladder" if p.resolve() == H200 else p.name, unpacked(p, Path(tmp)), args.boot)
    if args.markdown:
        print()
        print(markdown())


if __name__ == "__main__":
    main()
