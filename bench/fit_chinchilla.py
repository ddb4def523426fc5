"""Time the L(N, D) fit on Epoch AI's Chinchilla points (5 highest-loss points dropped, as Epoch did).

    .venv/bin/python bench/fit_chinchilla.py [--bootstrap 200] [--repeat 3] [--csv PATH]

Prints the fitted law against Epoch's published refit, the seconds for the point fit alone and for
the fit plus bootstrap, best of --repeat runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from analysis.laws import backtest as law_backtest
from analysis.laws.fit import fit_law

DEFAULT_CSV = Path(__file__).resolve().parents[1] / "tests" / "data" / "chinchilla" / "svg_extracted_data.csv"
EPOCH = {"E": 1.817, "A": 482.0, "B": 2085.4, "alpha": 0.348, "beta": 0.366}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    df = pd.read_csv(args.csv).sort_values("loss", kind="stable").iloc[:-5]
    N = df["Model Size"].to_numpy()
    D = df["Training FLOP"].to_numpy() / (6 * N)
    L = df["loss"].to_numpy()

    def best_of(**kw):
        times, fit = [], None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fit = fit_law(N, D, L, **kw)
            times.append(time.perf_counter() - t0)
        return min(times), fit

    t_fit, fit = best_of(n_bootstrap=0)
    t_boot, fit_b = best_of(n_bootstrap=args.bootstrap)

    print(f"{len(L)} points ({args.csv.name}, 5 highest-loss dropped)")
    print(f"{'param':>6} {'fit':>10} {'Epoch':>10} {'rel diff':>9}   {100 * fit_b.level:.0f}% bootstrap interval")
    for k, ref in EPOCH.items():
        lo, hi = fit_b.ci[k]
        print(f"{k:>6} {fit.params[k]:>10.4g} {ref:>10.4g} {fit.params[k] / ref - 1:>+9.2%}   [{lo:.4g}, {hi:.4g}]")
    print(f"Huber sum {fit.loss:.6g}, converged {fit.converged}")
    print(f"fit seconds: {t_fit:.3f}")
    print(f"fit + {args.bootstrap} bootstrap refits seconds: {t_boot:.3f} ({fit_b.n_bootstrap_failed} refits failed)")
    # what `ladder law fit` adds: the backtests, their refits warm-started from the fit of all the points
    times = {}
    for warm in (False, True):
        t0 = time.perf_counter()
        law_backtest.cross_validate(law_backtest.fit_n_d, [N, D], L, level=0.95, start=fit_b if warm else None)
        law_backtest.extrapolate(law_backtest.fit_n_d, [N, D], L, level=0.95, start=fit_b if warm else None)
        times[warm] = time.perf_counter() - t0
    print(f"backtests seconds: {times[True]:.3f} warm-started, {times[False]:.3f} from the start grid "
          f"(ratio {times[True] / times[False]:.2f})")


if __name__ == "__main__":
    main()
