"""The trajectory band's calibration: the factor scales each side's half-width, and a factor held
at its clip bound is named in the forecast's warnings."""

from __future__ import annotations

from analysis.forecast.file import ForecastTrajectory
from analysis.forecast.hero import CALIB_MAX, CALIB_MIN, calibrate_trajectory, calibration_warnings


def test_a_factor_on_its_lower_bound_is_named_for_the_steps_it_covers():
    ws = calibration_warnings({"calibration_factor": CALIB_MIN, "calibration_factor_covered": 1.98})
    assert len(ws) == 1 and "steps without stream deviations" in ws[0] and "lower bound" in ws[0]


def test_a_factor_on_its_upper_bound_is_named():
    ws = calibration_warnings({"calibration_factor": CALIB_MAX})
    assert len(ws) == 1 and "every step" in ws[0] and "upper bound" in ws[0]


def test_factors_inside_their_range_raise_no_warning():
    assert calibration_warnings({"calibration_factor": 0.72, "calibration_factor_covered": 1.98}) == []
    assert calibration_warnings(None) == []


def test_each_step_gets_the_factor_of_its_kind():
    traj = ForecastTrajectory(step=[10, 20], loss=[2.0, 2.0], lo=[1.9, 1.9], hi=[2.2, 2.2], stream_covered=[True, False])
    traj = calibrate_trajectory(traj, {"calibration_factor": 0.5, "calibration_factor_covered": 2.0})
    assert [round(v, 9) for v in traj.lo] == [1.8, 1.95]
    assert [round(v, 9) for v in traj.hi] == [2.4, 2.1]
