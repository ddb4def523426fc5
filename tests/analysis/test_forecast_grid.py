"""The grid route to the hero's final loss (analysis.forecast.grid) and the two routes side by side
(analysis.forecast.hero._routes), on planted points: the law, its nearest-point backtest and the
widening where the curve model's own forecast lies outside the law's interval."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.forecast.file import ForecastTrajectory
from analysis.forecast.grid import K_NEAR, GridPoint, fit_grid_law, is_grid
from analysis.forecast.verdicts import routes as _routes
from analysis.runs.replicates import Noise

TRUE = dict(E=1.2, A=60.0, alpha=0.3, B=400.0, beta=0.3)


def law(N, D, p=TRUE):
    return p["E"] + p["A"] * N ** -p["alpha"] + p["B"] * D ** -p["beta"]


def planted(sizes=(1e7, 2e7, 3e7), multiples=(3.0, 6.0, 12.0), rel_sd=0.003, seed=0) -> list[GridPoint]:
    rng = np.random.default_rng(seed)
    return [GridPoint(f"n{N:.0e}-t{m:g}", N, m * N, law(N, m * N) * math.exp(rng.normal(0, rel_sd)), rel_sd ** 2)
            for N in sizes for m in multiples]


NOISE = Noise(seed_var=0.003 ** 2, seed_dof=4, eval_var=0.0)


def test_one_tokens_per_parameter_line_is_not_a_grid():
    pts = [p for p in planted() if p.name.endswith("-t6")]
    assert not is_grid(pts)


def test_two_sizes_at_two_budgets_each_are_a_grid():
    pts = [p for p in planted(sizes=(1e7, 2e7), multiples=(3.0, 6.0))]
    assert is_grid(pts)


def test_the_grid_law_forecasts_a_planted_hero_inside_its_interval():
    pts = planted()
    N, D = 4e7, 6 * 4e7  # a larger size at a budget the grid trained
    g = fit_grid_law(pts, NOISE, N, D)
    iv = g.interval(N, D)
    truth = law(N, D)
    assert abs(iv["mean"] / truth - 1) < 0.02
    assert iv["lo"] <= truth <= iv["hi"]


def test_the_backtest_holds_out_the_families_nearest_the_hero():
    pts = planted()
    N, D = 3e7, 6 * 3e7
    g = fit_grid_law(pts, NOISE, N, D)
    assert len(g.backtest) == K_NEAR
    assert g.backtest[0]["held_out"] == "n3e+07-t6"  # the hero's own point is the nearest
    assert all(abs(b["rel_error"]) < 0.03 for b in g.backtest)


def test_too_few_families_for_the_law_are_refused():
    from analysis.laws.fit import FitError

    with pytest.raises(FitError, match="at least 6 rung families"):
        fit_grid_law(planted()[:5], NOISE, 3e7, 1.8e8)


def _final(mean=1.40, lo=1.30, hi=1.50):
    return {"mean": mean, "lo": lo, "hi": hi}


def test_a_curve_model_inside_the_laws_interval_leaves_it_alone():
    final = _final()
    traj = ForecastTrajectory(train_eval_ratio=1.0, shift=0.05)  # the curve model ended at 1.35
    assert _routes(final, traj) == []
    assert (final["lo"], final["hi"]) == (1.30, 1.50)
    assert final["routes"]["curve_model"] == pytest.approx(1.35)


def test_a_curve_model_outside_the_laws_interval_widens_it_and_says_so():
    final = _final()
    traj = ForecastTrajectory(train_eval_ratio=1.0, shift=0.15)  # the curve model ended at 1.25
    warnings = _routes(final, traj)
    assert len(warnings) == 1 and warnings[0].startswith("two routes disagree")
    assert final["lo"] == pytest.approx(1.25) and final["hi"] == 1.50
    assert final["routes"]["widened_from"] == [1.30, 1.50]
