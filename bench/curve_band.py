"""The curve band across sizes on every cross-size split the curve data allows: each size predicted
from two or more sizes below it (and, on multipower, the one size below: only two sizes there), the
target 1.9-9x beyond the largest fitted size. The band is calibrated on the fitted sizes alone (its
size term from the fit's own size backtest: each fitted size from the smaller fitted ones), so each
split is nested. Printed per split: points, mean relative error, 90% coverage, mean width
(hi - lo) / prediction, for the band as it is (analysis.curves.sizeband: per-stretch split-conformal
size term from two held-out sizes on) and, with --legacy, for the band without the stretch scores
(bootstrap spread, LR-area term, whole-curve size sd at Student's t).

    PYTHONPATH=. .venv/bin/python bench/curve_band.py [--legacy] [--boot 16]
"""

from __future__ import annotations

import argparse
import tarfile
import tempfile
from pathlib import Path

from analysis.curves import sizeband
from analysis.curves.fit import fit_curves
from analysis.runs import replicates
from bench.forecast_backtest import H200, SIZES, TEST, TRAIN, _curve_scores, _finished, _load, load_ladder, rung_curves


def h200_curves(tmp: Path):
    with tarfile.open(H200 / "h200_ladder.tar.gz") as tar:
        tar.extractall(tmp, filter="data")
    rungs, hero, _ = load_ladder(tmp)
    rungs = [r for r in rungs if _finished(r)]
    faces = sorted((f.runs[0] for f in replicates.group(rungs)), key=lambda r: r.flops)
    runs = faces + ([hero] if hero is not None and _finished(hero) else [])
    return rung_curves(runs, min(r.spec.data.tokens_per_step for r in runs))


def splits(curves, lo: float = 1.9, hi: float = 9.0):
    """(k, t, ratio): the k smallest sizes (k >= 2) predicting size t, ratio to the largest fitted."""
    return [(k, t, curves[t].params / curves[k - 1].params) for k in range(2, len(curves))
            for t in range(k, len(curves)) if lo <= curves[t].params / curves[k - 1].params <= hi]


def show(label: str, fit, targets) -> None:
    n, e, c, w = _curve_scores(fit, targets)
    print(f"  {label:10s} n={n:<5d} error {100 * e:6.2f}%  coverage {100 * c:6.2f}%  width {100 * w:6.2f}%", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boot", type=int, default=16)
    ap.add_argument("--legacy", action="store_true", help="also the band without the stretch scores")
    args = ap.parse_args()
    modes = [("current", sizeband.MIN_HELD_OUT)] + ([("legacy", 10**9)] if args.legacy else [])
    jobs = [("multipower 25M (protocol curves) -> all 9 100M curves (4x)",
             lambda: fit_curves([_load("25M", n, SIZES["25M"]) for n in TRAIN], n_boot=args.boot),
             [_load("100M", t, SIZES["100M"]) for t in TRAIN + TEST])]
    with tempfile.TemporaryDirectory() as tmp:
        curves = h200_curves(Path(tmp)) if (H200 / "h200_ladder.tar.gz").exists() else []
    for k, t, ratio in splits(curves):
        jobs.append((f"h200 ladder {'+'.join(c.name for c in curves[:k])} -> {curves[t].name} ({ratio:.1f}x)",
                     lambda k=k: fit_curves(curves[:k], n_boot=args.boot), [curves[t]]))
    for label, make, targets in jobs:
        print(label)
        fit = make()
        for mode, m in modes:
            saved, sizeband.MIN_HELD_OUT = sizeband.MIN_HELD_OUT, m
            try:
                show(mode, fit, targets)
            finally:
                sizeband.MIN_HELD_OUT = saved


if __name__ == "__main__":
    main()
