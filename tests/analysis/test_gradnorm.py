"""The grad-norm envelope: its centre follows a power law in size, its band comes from nested
backtests and holds a rung that follows the ladder's law."""

from __future__ import annotations

import numpy as np

from analysis.forecast.gradnorm import RungGrad, backtest, envelope


def _rung(name: str, size: float, slope: float, noise: float, seed: int, n: int = 400) -> RungGrad:
    rng = np.random.default_rng(seed)
    frac = (np.arange(n) + 1) / n
    shape = 1.0 + 0.5 * frac  # grad norm grows through training, the same shape at every size
    return RungGrad(name, size, frac, shape * size**slope * np.exp(noise * rng.standard_normal(n)))


def test_envelope_centre_follows_the_rungs_power_law_at_the_hero_size():
    rungs = [_rung(f"r{i}", s, 0.2, 0.0, i) for i, s in enumerate((1e4, 2e4, 4e4, 8e4))]
    env = envelope(rungs, 3.2e5, 1000, n_bins=20)
    truth = (1.0 + 0.5 * np.array(env["frac"])) * 3.2e5**0.2
    # bin medians of a linear shape sit within a bin's half-width of its centre
    assert np.allclose(env["mean"], truth, rtol=0.02)
    assert np.all(np.array(env["lo"]) < np.array(env["mean"])) and np.all(np.array(env["mean"]) < np.array(env["hi"]))


def test_band_holds_a_held_out_rung_of_the_same_law_and_reports_its_coverage():
    rungs = [_rung(f"r{i}", s, 0.2, 0.1, i) for i, s in enumerate((1e4, 2e4, 4e4, 8e4, 1.6e5))]
    bt = backtest(rungs, n_bins=20)
    assert bt["coverage"] >= 0.8 and bt["n"] == 3 * 400
    hero = _rung("hero", 3.2e5, 0.2, 0.1, 99, n=2000)
    env = envelope(rungs, 3.2e5, 2000, n_bins=20)
    lo, hi = (np.interp(hero.frac, env["frac"], env[k]) for k in ("lo", "hi"))
    assert np.mean((hero.g >= lo) & (hero.g <= hi)) >= 0.8


def test_without_a_backtest_the_extrapolation_term_is_the_stated_prior():
    rungs = [_rung("a", 1e4, 0.2, 0.05, 0), _rung("b", 2e4, 0.2, 0.05, 1)]
    env = envelope(rungs, 8e4, 100, n_bins=10)
    assert env["backtest"] is None and "prior" in env["extrap_sd_from"]
