"""Backtest of the forecast on the CPU proxy ladder: train the rungs (reusing finished runs), refit
without the largest rung, and report the error of its predicted final loss; then the hero forecast
against the hero's actual final loss when the hero has finished.

    .venv/bin/python bench/forecast_backtest.py [--experiment experiments/proxy_cpu.py] [--root DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default=str(ROOT / "experiments/proxy_cpu.py"))
    ap.add_argument("--root", default=None)
    ap.add_argument("--with-hero", action="store_true", help="also train the hero and compare its final loss")
    args = ap.parse_args()
    root = ["--root", args.root] if args.root else []
    ladder = [sys.executable, "-m", "ladder.cli"]
    subprocess.run([*ladder, "submit", args.experiment, *root, *(["--include-hero"] if args.with_hero else [])], check=True)

    from analysis.forecast import backtest, final_loss_forecast
    from ladder.commands.forecast import finished_rungs
    from ladder.experiment import load_experiment
    from ladder.ledger import is_finished, ladder_root, run_dir_for

    exp = load_experiment(args.experiment)
    r = ladder_root(args.root)
    rungs, missing = finished_rungs(r, exp)
    bt = backtest(rungs)
    print(f"{exp.name}: {len(rungs)} finished rungs" + (f" (unfinished: {', '.join(missing)})" if missing else ""))
    for x in sorted(rungs, key=lambda x: x.flops):
        print(f"  {x.spec.name:10s} C={x.flops:.3e}  final eval loss {x.final_loss:.4f}")
    if bt:
        print(f"backtest: {bt['held_out']} predicted {bt['predicted']:.4f} ({bt['lo']:.4f} to {bt['hi']:.4f}), "
              f"actual {bt['actual']:.4f}, error {100 * bt['rel_error']:+.2f}%")
    final, _, _ = final_loss_forecast(rungs, exp.hero)
    hero_dir = run_dir_for(r, exp.name, exp.hero)
    line = f"hero {exp.hero.name}: forecast {final['mean']:.4f} (90% {final['lo']:.4f} to {final['hi']:.4f})"
    if is_finished(hero_dir, exp.hero):
        from analysis.forecast import RungRun
        from analysis.metrics_io import read_metrics_frame

        actual = RungRun(exp.hero, hero_dir, read_metrics_frame(hero_dir / "metrics.jsonl")).final_loss
        line += f", actual {actual:.4f}, error {100 * (final['mean'] - actual) / actual:+.2f}%"
    print(line)


if __name__ == "__main__":
    main()
