"""The curve band's size term per stretch of the run (analysis.curves.sizeband): properties of the
method on synthetic scores and families, not numbers of one dataset."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.curves import sizeband as sb
from analysis.curves.fitted import CurveFit

STEPS = np.arange(100, 10_001, 100)


def _scores(rng, n_curves: int, sd: float, efolds: float = 1.0) -> list:
    """Held-out curves whose relative error is a constant level per curve, drawn N(0, (sd x efolds)^2)."""
    out = []
    for _ in range(n_curves):
        pred = np.full(len(STEPS), 3.0)
        loss = pred / (1 + sd * efolds * rng.standard_normal())
        out.append(sb.stretch_scores(STEPS, pred, loss, efolds))
    return out


def test_coverage_on_a_synthetic_family_with_known_noise_lands_near_nominal():
    rng = np.random.default_rng(0)
    inside = []
    for _ in range(400):  # calibrate on 19 held-out curves, score one new curve 2 e-folds out
        cal = _scores(rng, 19, 0.05)
        hw = sb.size_halfwidth(STEPS, np.full(len(STEPS), 3.0), 2.0, cal, 0.9)
        err = 3.0 * abs(0.05 * 2.0 * rng.standard_normal())
        inside.append(err <= hw[0])
    assert 0.85 <= np.mean(inside) <= 0.95


def test_width_shrinks_when_the_held_out_residuals_shrink():
    rng = np.random.default_rng(1)
    wide = sb.size_halfwidth(STEPS, np.full(len(STEPS), 3.0), 1.0, _scores(rng, 5, 0.04), 0.9)
    rng = np.random.default_rng(1)
    narrow = sb.size_halfwidth(STEPS, np.full(len(STEPS), 3.0), 1.0, _scores(rng, 5, 0.01), 0.9)
    assert np.allclose(narrow, wide / 4)


def test_width_grows_linearly_with_the_extrapolation_in_log_size():
    cal = _scores(np.random.default_rng(2), 5, 0.03)
    pred = np.full(len(STEPS), 3.0)
    one, three = (sb.size_halfwidth(STEPS, pred, r, cal, 0.9) for r in (1.0, 3.0))
    assert np.allclose(three, 3 * one) and np.all(sb.size_halfwidth(STEPS, pred, 0.0, cal, 0.9) == 0)


def test_each_stretch_of_the_run_gets_its_own_width():
    # held-out errors that grow along the run (an early sign change cancels in a whole-curve mean)
    pred = np.full(len(STEPS), 3.0)
    loss = pred / (1 + np.linspace(-0.02, 0.06, len(STEPS)))
    hw = sb.size_halfwidth(STEPS, pred, 1.0, [sb.stretch_scores(STEPS, pred, loss, 1.0)], 0.9)
    assert hw[-1] > 3 * hw[len(STEPS) // 5] and hw[-1] == pytest.approx(3.0 * 0.056, rel=0.1)


def test_the_conformal_rank_and_the_largest_score_below_its_minimum():
    scores = [[float(v)] for v in range(1, 20)]  # 19 curves, one stretch: rank ceil(20 x 0.9) = 18
    q, short = sb.stretch_quantiles(scores, 0.9)
    assert q[0] == 18.0 and not short
    q, short = sb.stretch_quantiles(scores[:5], 0.9)
    assert q[0] == 5.0 and short


def test_an_empty_stretch_takes_the_nearest_one():
    q, _ = sb.stretch_quantiles([[None, 0.1, None, 0.3]], 0.9)
    assert q[0] == q[1] == 0.1 and q[3] == 0.3 and q[2] in (0.1, 0.3)


def _fit_with(rows) -> CurveFit:
    fit = CurveFit(model="mpl", names=["L0", "A", "alpha", "B", "C", "beta", "gamma"],
                   z=np.array([3.0] + [math.log(v) for v in (0.5, 0.5, 300.0, 2.0, 0.6, 0.6)]),
                   law_kind="none", sizes=[1e6, 2e6, 4e6])
    fit.size_backtest = {"curves": rows}
    return fit


def test_the_band_uses_stretch_scores_only_from_two_held_out_sizes_on():
    row = lambda size, s: {"size": size, "stretch_scores": [s] * sb.STRETCHES}  # noqa: E731
    assert _fit_with([row(2e6, 0.1)]).stretch_scores is None
    assert _fit_with([row(2e6, 0.1), row(4e6, 0.2)]).stretch_scores == [[0.1] * 8, [0.2] * 8]


def test_a_fit_of_four_sizes_bands_the_next_size_from_its_own_held_out_sizes():
    # an additive-law family (floor falling as N^-0.3) with 0.3% per-step noise: the band at the fifth
    # size comes from the stretch scores (three held-out sizes) and holds it, a few per cent wide
    from analysis.curves.fit import Curve, fit_curves
    from tests.analysis.test_curves import PAPER_25M, _mpl, _schedule

    truth, rng, lr = _mpl(PAPER_25M), np.random.default_rng(0), _schedule("cosine")
    steps = np.arange(500, 12_000, 100)
    fam = [Curve(steps, lr, (truth.predict(steps, lr) + 0.5 * ((n / 1e7) ** -0.3 - 1))
                 * (1 + 0.003 * rng.standard_normal(len(steps))), params=n, name=f"{n:g}")
           for n in (1e7, 2e7, 4e7, 8e7, 1.6e8)]
    fit = fit_curves(fam[:4])
    assert fit.stretch_scores is not None and len(fit.stretch_scores) == 3
    c = fam[4]
    lo, hi = fit.band(c.step, c.lr_per_step, params=c.params)
    assert np.mean((c.loss >= lo) & (c.loss <= hi)) >= 0.8
    assert np.mean((hi - lo) / fit.predict_curve(c)) < 0.06
