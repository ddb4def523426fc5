"""The report's verdict on a finished hero with replicates at other seeds."""

from __future__ import annotations

import pytest

from analysis.forecast.file import HeroForecast
from analysis.report import verdict_text

FORECAST = HeroForecast.from_dict({"hero": {"final_loss": {"mean": 1.0, "lo": 0.9, "hi": 1.1, "level": 0.9}}})


def test_the_verdict_states_each_hero_seed_and_their_mean_against_the_forecast():
    text, inside = verdict_text(FORECAST, 1.05, replicates={"hero-seed1": 1.2, "hero-seed2": 0.95})
    assert inside  # the verdict's own flag is the hero spec's (seed 0's)
    assert "error +4.76%" in text
    assert "seed1 1.2000 (+16.67%)" in text and "seed2 0.9500 (-5.26%)" in text
    assert "1 of 2 inside" in text
    mean = (1.05 + 1.2 + 0.95) / 3
    assert f"the mean of all 3 seeds {mean:.4f} ({100 * (mean - 1) / mean:+.2f}%)" in text


def test_without_replicates_the_verdict_is_the_hero_alone():
    text, _ = verdict_text(FORECAST, 1.05)
    assert "replicates" not in text and text.endswith("inside the interval.")


@pytest.mark.parametrize("actual", [0.5, 2.0])
def test_a_hero_outside_the_interval_is_said_to_be(actual):
    text, inside = verdict_text(FORECAST, actual, replicates={"hero-seed1": 1.0})
    assert not inside and "OUTSIDE" in text
