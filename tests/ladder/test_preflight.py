"""The memory pre-flight: a spec whose estimate exceeds its device memory is refused with the
estimate; one that fits passes."""

from __future__ import annotations

import pytest

from ladder.errors import LadderError
from ladder.preflight import check_memory, memory_problem
from ladder.presets import micro_spec


def test_a_spec_that_fits_its_memory_passes():
    assert memory_problem(micro_spec("fits")) is None
    check_memory([micro_spec("fits")])


def test_a_spec_beyond_its_memory_is_refused_with_the_estimate():
    big = micro_spec("big", **{"hardware.hbm_gb": 1e-4})
    with pytest.raises(LadderError, match=r"spec big needs an estimated 0.00[0-9]+ GB per device .*hardware.hbm_gb is 0.0001 GB"):
        check_memory([micro_spec("fits"), big])
