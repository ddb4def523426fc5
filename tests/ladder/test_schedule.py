import numpy as np
import pytest

from ladder.presets import micro_spec
from core.schedule import lr_at, lr_ratio
from core.spec import Rejoin, ScheduleSpec


def test_marin_default_warms_up_one_percent_then_decays_linearly_to_five_percent():
    r = lr_ratio(ScheduleSpec(), np.arange(1000), 1000)
    assert r[9] == pytest.approx(1.0) and r[0] == pytest.approx(0.1)
    assert r[-1] == pytest.approx(0.05 + 0.95 / 990, rel=1e-6)
    assert np.all(np.diff(r[10:]) < 0)
    assert lr_ratio(ScheduleSpec(), np.array([1000]), 1000)[0] == pytest.approx(0.05)


def test_cosine_reaches_minimum_at_decay_end():
    s = ScheduleSpec(decay="cosine", warmup_frac=0.0, min_lr_ratio=0.1)
    r = lr_ratio(s, np.array([0, 50, 100, 150]), 100)
    assert r == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_wsd_is_flat_until_decay_start():
    s = ScheduleSpec(decay="wsd", warmup_frac=0.0, decay_start_frac=0.8, min_lr_ratio=0.0)
    r = lr_ratio(s, np.array([0, 79, 80, 90, 100]), 100)
    assert r == pytest.approx([1, 1, 1, 0.5, 0])


def test_rejoin_is_continuous_and_reaches_minimum_at_new_end():
    old = ScheduleSpec()
    new = ScheduleSpec(rejoins=(Rejoin(step=200, prev_total_steps=1000),))
    before = lr_ratio(old, np.arange(200), 1000)
    assert np.array_equal(lr_ratio(new, np.arange(200), 600), before)
    at = lr_ratio(old, np.array([200]), 1000)[0]
    assert lr_ratio(new, np.array([200]), 600)[0] == pytest.approx(at)
    assert lr_ratio(new, np.array([600]), 600)[0] == pytest.approx(0.05)


def test_lr_at_scales_by_peak():
    s = micro_spec()
    assert lr_at(s, np.arange(s.total_steps)).max() == pytest.approx(s.optim.peak_lr)
