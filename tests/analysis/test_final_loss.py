"""The final-loss interval (analysis.forecast.final_loss) on compute envelopes cut from Epoch's Chinchilla points:
its parts, the backtest term that never silently drops to 0, the t calibration and its coverage."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.forecast.final_loss import PRIOR_DOF, TAU_PRIOR, Point, coverage, fit_final_law
from tests.refdata import CHINCHILLA


@pytest.fixture(scope="module")
def envelope() -> list[Point]:
    """The least loss per half-decade of compute among the Chinchilla points (5 highest dropped)."""
    df = pd.read_csv(CHINCHILLA).sort_values("loss", kind="stable").iloc[:-5]
    C, L = df["Training FLOP"].to_numpy(), df["loss"].to_numpy()
    lc = np.log10(C)
    out = []
    for a in np.arange(lc.min(), lc.max() + 0.5, 0.5):
        m = (lc >= a) & (lc < a + 0.5)
        if m.any():
            i = int(np.argmin(np.where(m, L, np.inf)))
            out.append(Point(f"C{i}", float(C[i]), float(L[i])))
    return out


def test_the_interval_adds_fit_measurement_and_backtest_variance(envelope):
    law = fit_final_law(envelope[:6], seed_var=0.01**2, seed_dof=4)
    C = envelope[6].flops
    iv = law.interval(C)
    sd = iv["sd"]
    assert sd["fit"] > 0 and sd["measurement"] == pytest.approx(0.01) and sd["backtest"] > 0
    half = math.log(iv["hi"] / iv["mean"])
    assert half == pytest.approx(iv["quantile"] * math.sqrt(sum(v * v for v in sd.values())))
    assert law.backtest["points"] and law.tau_dof == PRIOR_DOF + len(law.backtest["points"])


def test_a_ladder_too_short_for_a_backtest_keeps_the_prior_and_says_so(envelope):
    law = fit_final_law(envelope[:3], seed_var=None, seed_dof=0)
    assert law.tau == TAU_PRIOR and not law.backtest["points"]
    assert any("no backtest can run" in w for w in law.warnings)
    assert law.interval(envelope[4].flops)["sd"]["backtest"] > 0


def test_few_degrees_of_freedom_widen_the_quantile(envelope):
    few = fit_final_law(envelope[:6], seed_var=0.01**2, seed_dof=1).interval(envelope[7].flops)
    many = fit_final_law(envelope[:6], seed_var=0.01**2, seed_dof=200).interval(envelope[7].flops)
    assert few["dof"] < many["dof"] and few["quantile"] > many["quantile"] > 1.6448


def test_inside_the_ladder_no_extrapolation_term(envelope):
    law = fit_final_law(envelope[:6], seed_var=None, seed_dof=0)
    assert law.interval(envelope[3].flops)["sd"]["backtest"] == 0.0


def test_coverage_predicts_each_point_from_the_smaller_ones(envelope):
    cov = coverage(envelope[:7], seed_var=None, seed_dof=0)
    assert cov["n"] == 4 and cov["held_out"] == [p.name for p in envelope[3:7]]
    assert 0.0 <= cov["coverage"] <= 1.0 and cov["mean_rel_width"] > 0
